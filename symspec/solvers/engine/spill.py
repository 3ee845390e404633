"""Large statistics kept on disk between the pass that collects them and the descent
that reads them.

A data-driven method's statistics grow with the square of each site's width, for every
layer at once: a cross moment per MLP site is 4864^2 floats at Qwen2-0.5B, 4.9 GB over
the model (7.1 GB at TinyLlama-1.1B), as much as the two models' float32 working copies
beside them. The descent reads one space's sites at a time, so a block of at least
:data:`SPILL_MIN_BYTES` is written to a file as soon as its stage of the pass ends and
read back each time a space that acts on it is solved: reading an n x n block back is
n^2 numbers, against the n^3 products of solving over it (GPT-2 small's 3072-wide block:
tens of milliseconds from the page cache). Files live in a private folder
(``symspec-statistics-*``, under the system's temporary folder, ``TMPDIR``, unless told
otherwise), each removed when the last block naming it is let go and the folder with its
store; a failed write (a full disk, a read-only folder) is one line naming the folder.

>>> import torch
>>> store = SpillStore()
>>> x = store.put(torch.arange(6, dtype=torch.float32).reshape(2, 3))
>>> x.scaled(2.0).load().tolist()
[[0.0, 2.0, 4.0], [6.0, 8.0, 10.0]]
>>> store.close()
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
import weakref
from pathlib import Path
from typing import Any

import attrs
import torch

from ...errors import SymspecInputError
from ...outputs.base import is_write_error, write_error

__all__ = ["SPILL_MIN_BYTES", "SpillStore", "Spilled", "held"]

#: a block at least this large (in the statistics' dtype) is written to disk
SPILL_MIN_BYTES = 1 << 24


class _File:
    """One block's file, removed when the last handle naming it is let go."""

    def __init__(self, store: SpillStore, path: str) -> None:
        self.store = store  # the folder outlives its files
        self.path = path
        self._gone = weakref.finalize(self, _unlink, path, os.getpid())


def _unlink(path: str, pid: int | None = None) -> None:
    """Remove ``path`` (in the process that wrote it: a forked child lets go of its copy
    of a handle without removing the parent's file)."""
    if pid is None or os.getpid() == pid:
        with contextlib.suppress(OSError):
            os.unlink(path)


def _rmtree(folder: str, pid: int) -> None:
    if os.getpid() == pid:
        shutil.rmtree(folder, ignore_errors=True)


@attrs.frozen
class Spilled:
    """A tensor on disk: its file, shape and dtype, and a factor applied when it is read
    (a scaled block shares the file)."""

    file: _File = attrs.field(repr=False, eq=False)
    shape: tuple[int, ...]
    dtype: torch.dtype
    scale: float = 1.0

    @property
    def nbytes(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n * torch.empty((), dtype=self.dtype).element_size()

    def scaled(self, s: float) -> Spilled:
        return attrs.evolve(self, scale=self.scale * s)

    def load(self, device: torch.device | str | None = None) -> torch.Tensor:
        """The tensor, read into memory of its own (not a mapping of the file), times
        its factor, on ``device``."""
        t = torch.empty(self.shape, dtype=self.dtype)
        try:
            with open(self.file.path, "rb", buffering=0) as f:
                got = f.readinto(memoryview(t.numpy()).cast("B"))
        except OSError as e:
            raise SymspecInputError(f"cannot read activation statistics back from {self.file.path}: "
                                    f"{e.strerror or e}") from e
        if got != self.nbytes:
            raise SymspecInputError(f"activation statistics in {self.file.path} were changed while in use "
                                    f"(read {got} of {self.nbytes} bytes); run the command again")
        if self.scale != 1.0:
            t.mul_(self.scale)
        return t if device is None else t.to(device)


class SpillStore:
    """A private folder of spilled tensors (:func:`tempfile.mkdtemp` under ``folder``,
    default the system's temporary folder), removed with the store."""

    def __init__(self, folder: str | Path | None = None) -> None:
        parent = str(folder) if folder is not None else tempfile.gettempdir()
        try:
            self.folder = tempfile.mkdtemp(prefix="symspec-statistics-", dir=parent)
        except Exception as e:
            if not is_write_error(e):
                raise
            raise write_error(parent, e) from e
        self.parent = parent
        self._count = 0
        self._gone = weakref.finalize(self, _rmtree, self.folder, os.getpid())

    def free(self) -> int:
        """Bytes free on the folder's disk."""
        return shutil.disk_usage(self.folder).free

    def put(self, t: torch.Tensor) -> Spilled:
        """``t`` written to a file of its own (float dtypes numpy reads: float32, float64)."""
        t = t.detach().to("cpu").contiguous()
        self._count += 1
        path = os.path.join(self.folder, f"{self._count}.bin")
        try:
            with open(path, "wb", buffering=0) as f:
                view = memoryview(t.numpy()).cast("B")
                done = 0
                while done < len(view):  # a raw write may write less than asked
                    done += f.write(view[done:])
        except Exception as e:
            _unlink(path)
            if not is_write_error(e):
                raise
            raise SymspecInputError(f"{write_error(self.parent, e)} (spilling {t.nbytes / 1e9:.3g} GB of activation "
                                    "statistics; free space there, or set TMPDIR to a folder with room)") from e
        return Spilled(_File(self, path), tuple(t.shape), t.dtype)

    def close(self) -> None:
        """The folder and every file in it removed now (handles left cannot be read)."""
        self._gone()


def held(x: Any, device: torch.device | str | None = None) -> Any:
    """``x`` in memory: a :class:`Spilled` read back (on ``device``), anything else as it is."""
    return x.load(device) if isinstance(x, Spilled) else x
