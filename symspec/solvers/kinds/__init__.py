"""The per-kind solvers: one module per family of group kinds, each registering its
solvers in :data:`symspec.solvers.engine.base.SOLVERS` (``@solver("Kind", ...)``) when
imported. Importing this package registers them all.
"""

from . import assignment, experts, heads, orthogonal, smooth  # noqa: F401  (register the solvers)
