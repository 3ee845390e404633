"""Solvers: they see a :class:`symspec.problem.Problem` and state dicts, nothing else."""
