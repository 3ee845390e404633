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


#: glibc's M_TRIM_THRESHOLD and M_MMAP_THRESHOLD, its default trim threshold and the
#: largest mmap threshold it accepts on 64-bit systems (4 * 1024 * 1024 * sizeof(long))
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
_TRIM_DEFAULT, _MMAP_MAX = 128 * 1024, 32 << 20

#: the mmap threshold configure_process set (None: it set none, the process's own allocator rules)
_configured_mmap: int | None = None


def _libc() -> ctypes.CDLL | None:
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    except OSError:
        return None


def configure_process() -> None:
    """Apply the settings to this process, where the environment does not make them: the
    OpenMP one through the environment (effective only before torch is imported), the
    allocator ones through glibc's ``mallopt`` (elsewhere than glibc: nothing)."""
    global _configured_mmap
    os.environ.setdefault("OMP_WAIT_POLICY", SETTINGS["OMP_WAIT_POLICY"])
    with contextlib.suppress(ValueError):  # a fixed threshold from the environment: glibc read it at start
        _configured_mmap = int(os.environ["MALLOC_MMAP_THRESHOLD_"]) if "MALLOC_MMAP_THRESHOLD_" in os.environ else None
    wanted = [(param, int(SETTINGS[name])) for name, param in _MALLOPT.items() if name not in os.environ]
    if not wanted:
        return
    with contextlib.suppress(OSError, AttributeError, TypeError):
        libc = _libc()
        if libc is None:
            return
        for param, value in wanted:
            if libc.mallopt(param, value) and param == _M_MMAP_THRESHOLD:
                _configured_mmap = value


@contextlib.contextmanager
def reused_heap() -> Iterator[None]:
    """For a block that allocates and frees the same large buffers over and over (a
    forward pass per micro-batch: activations of a few MB, each freed before the next
    is made), the freed blocks are kept in the heap and reused, instead of going back to
    the kernel and coming back as fresh pages: in a process holding a few GB, each
    fresh page is a fault that costs more than the arithmetic on it (GPT-2 small's
    sites recorded on 4096 tokens in micro-batches of 4 sequences, 4 GB held beside:
    1.7 M faults and 6.9 s with the 1 MiB threshold, 2.3 k faults and 4.5 s in this
    block). Only where :func:`configure_process` set the 1 MiB mmap
    threshold (the CLI's processes): the threshold is raised to glibc's largest, 32 MiB,
    the heap not trimmed while the block runs, and afterwards both restored and what the
    block freed handed back (``malloc_trim``). Elsewhere (a library user's process, not
    glibc): nothing is changed, glibc's own dynamic threshold does much the same."""
    libc = _libc() if _configured_mmap is not None else None
    if libc is None:
        yield
        return
    libc.mallopt(_M_MMAP_THRESHOLD, _MMAP_MAX)
    libc.mallopt(_M_TRIM_THRESHOLD, 1 << 30)
    try:
        yield
    finally:
        libc.mallopt(_M_MMAP_THRESHOLD, _configured_mmap)
        libc.mallopt(_M_TRIM_THRESHOLD, _TRIM_DEFAULT)
        libc.malloc_trim(0)


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
