"""Running independent tasks: in this process, in worker processes, or as Ray tasks.

Generic, for any method that splits its work into tasks (universe matching runs one task
per model and round): a task is a picklable object with ``index``, ``name`` and
``run()`` (:class:`Task`); an executor runs a list of them and hands each result back
as it completes (``executor.run(tasks, on_done)``), never raising for a task that failed:
a failure comes back as an ``ok: False`` result naming the task, and the caller decides.

- :mod:`.task`: the task protocol, :func:`run_task`, the ``setup`` hook (and
  :func:`torch_threads`, from :mod:`symspec.process`);
- :mod:`.local`: :class:`InlineExecutor`, :class:`ProcessExecutor` and the worker loop;
- :mod:`.cluster`: :class:`RayExecutor` and the Ray address check.

Worker processes and Ray workers know only what they import: an alignment method,
group or solver registered at run time in the parent reaches them through an installed
entry point (``symspec.methods``) or the ``setup`` hook (``"module:function"``, called
once per worker before its first task; ``symspec universe --setup``). symspec's own
extensions (``symspec.extensions``: universe and learned matching, the width stages, the
certifier) are loaded with the methods on a worker's first method look-up
(:func:`symspec.alignment.registry.load_plugins`), as in the parent.
"""

from __future__ import annotations

from .cluster import RAY_CONNECT_TIMEOUT, RayExecutor, check_ray_address, ray_endpoint
from .local import InlineExecutor, OnDone, ProcessExecutor, describe_exit
from .task import Result, Task, failure, run_setup, run_task, torch_threads

Executor = InlineExecutor | ProcessExecutor | RayExecutor


def make_executor(jobs: int | None = None, ray: str | None = None, setup: str | None = None, *, device: str = "cpu",
                  retries: int = 0) -> Executor:
    """Ray when ``ray`` names a cluster (``jobs`` tasks in flight, default: its CPUs),
    worker processes for ``jobs > 1``, else inline. A CUDA ``device`` makes each Ray
    task ask for one GPU.

    >>> make_executor().name, make_executor(jobs=1).name
    ('inline', 'inline')
    """
    if ray:
        gpus = 1.0 if str(device).startswith("cuda") else 0.0
        return RayExecutor(ray, jobs, setup, gpus=gpus, retries=retries)
    if jobs is not None and jobs > 1:
        return ProcessExecutor(jobs, setup)
    return InlineExecutor(setup)


__all__ = [
    "RAY_CONNECT_TIMEOUT",
    "Executor",
    "InlineExecutor",
    "OnDone",
    "ProcessExecutor",
    "RayExecutor",
    "Result",
    "Task",
    "check_ray_address",
    "describe_exit",
    "failure",
    "make_executor",
    "ray_endpoint",
    "run_setup",
    "run_task",
    "torch_threads",
]
