"""Process-wide settings for matching large models, in one place.

These belong to the whole process (OpenMP's threads, the C library's allocator), not to
a call, so the library never sets them by itself: ``symspec match``/``merge`` apply them
to their own process (:func:`configure_process`, before torch is imported), and the
benchmarks pass them to the processes they start (:func:`child_environment`). A user's
own settings win. Library users on busy machines may export them themselves. Why each:

- ``OMP_WAIT_POLICY=PASSIVE``: OpenMP threads that spin while waiting make batched
  small LAPACK calls (per-head inverses) 10-30x slower on a machine shared with other
  work; passive waiting costs nothing for the large products. Read when torch loads.
- ``MALLOC_MMAP_THRESHOLD_=1048576``: glibc raises its mmap threshold after large
  blocks are freed, so later per-layer weights (a few MB) come from the heap and stay
  resident after they are freed; a fixed 1 MiB threshold returns them (peak 3.74x ->
  3.53x the two GPT-2-small models). The solvers keep their temporaries below it.
- ``MALLOC_ARENA_MAX=1``: the solves that run in worker threads would each get a heap
  arena of their own, whose freed blocks the other threads cannot reuse; one arena
  keeps them shared (3.02x -> 2.83x, no slower: ``MALLOC_ARENA_MAX=1 python
  bench/bench_match.py --cases gpt2-small --pairs independent --groups full --layers ''``).

Torch's CPU thread count is process-wide too: :func:`torch_threads` is the one helper
that sets it, for a block (worker tasks, the solvers' small dense algebra).

This module imports nothing heavy (no torch): the CLI imports it before torch.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import os
from collections.abc import Iterator, Mapping

#: environment variable -> its value here
SETTINGS: dict[str, str] = {
    "OMP_WAIT_POLICY": "PASSIVE",
    "MALLOC_MMAP_THRESHOLD_": str(1 << 20),
    "MALLOC_ARENA_MAX": "1",
}

#: the allocator settings' glibc ``mallopt`` parameters (M_MMAP_THRESHOLD, M_ARENA_MAX),
#: for a process already running: glibc reads the variables only when it starts
_MALLOPT = {"MALLOC_MMAP_THRESHOLD_": -3, "MALLOC_ARENA_MAX": -8}


def child_environment(env: Mapping[str, str]) -> dict[str, str]:
    """``env`` with every setting it does not make itself: the environment of a process
    to start."""
    return {**SETTINGS, **env}


def configure_process() -> None:
    """Apply the settings to this process, where the environment does not make them: the
    OpenMP one through the environment (effective only before torch is imported), the
    allocator ones through glibc's ``mallopt`` (elsewhere than glibc: nothing)."""
    os.environ.setdefault("OMP_WAIT_POLICY", SETTINGS["OMP_WAIT_POLICY"])
    wanted = [(param, int(SETTINGS[name])) for name, param in _MALLOPT.items() if name not in os.environ]
    if not wanted:
        return
    with contextlib.suppress(OSError, AttributeError, TypeError):
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        for param, value in wanted:
            libc.mallopt(param, value)


@contextlib.contextmanager
def torch_threads(n: int) -> Iterator[None]:
    """torch's CPU threads set to ``n`` (a process-wide setting; 0 or less: unchanged),
    and what they were before restored after: the same count everywhere keeps results
    bitwise identical, whichever thread, process or executor computes them."""
    import torch  # deferred: the CLI reads this module's settings before it needs torch

    before = torch.get_num_threads()
    if n > 0 and n != before:
        torch.set_num_threads(n)
    try:
        yield
    finally:
        if torch.get_num_threads() != before:
            torch.set_num_threads(before)


def available_memory() -> int | None:
    """Bytes this machine can still give a process without swapping (``MemAvailable`` of
    /proc/meminfo); None where that cannot be read (not Linux)."""
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError):
        return None
    return None
