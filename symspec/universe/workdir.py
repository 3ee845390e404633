"""The resumable work folder of a universe run, and the files in it.

```
WORK/run.json                       the run's fingerprint (inputs and settings) and model names
WORK/run.pkl                        the RunConfig every task reads
WORK/canonical/KEY.safetensors      each model in canonical form; KEY.json: its task's result
WORK/rounds/NNN/universe.safetensors        the universe that round NNN aligns to
WORK/rounds/NNN/KEY.{aligned,elements}.safetensors, KEY.json   each model's alignment
WORK/state.json                     the finished rounds and the objective
```

Every file is written to a temporary name and renamed, and a task's result marker
(``KEY.json``) is written last: a task whose marker exists is complete, so an
interrupted run resumes where it stopped. A run holds the folder locked
(:class:`~symspec.outputs.FolderLock`) from start to end.
"""

from __future__ import annotations

import json
import os
import pickle
import shutil
import tempfile
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from ..outputs import FolderLock, atomic_write, atomic_write_bytes, atomic_write_text, clear_folder
from ..statedict import storage_key
from .errors import UniverseError
from .progress import Progress, UniverseEvent

# --------------------------------------------------------------------------- files


def save_tensors(path: str | Path, tensors: Mapping[str, torch.Tensor], metadata: Mapping[str, str] | None = None) -> None:
    """Write a safetensors file atomically (tied entries are stored as separate copies)."""
    from safetensors.torch import save_file

    seen: set[tuple[object, ...]] = set()
    out: dict[str, torch.Tensor] = {}
    for k, v in tensors.items():
        t = v.detach().to("cpu").contiguous()
        key = storage_key(t)
        out[k] = t.clone() if key in seen and t.numel() else t
        seen.add(key)
    atomic_write(path, lambda tmp: save_file(out, str(tmp), metadata=dict(metadata) if metadata else None))


def load_tensors(path: str | Path) -> dict[str, torch.Tensor]:
    """A safetensors file's tensors (on the CPU)."""
    from safetensors.torch import load_file

    return load_file(str(path))


def write_json(path: str | Path, data: Any) -> None:
    """Write ``data`` as JSON, atomically."""
    atomic_write_text(path, json.dumps(data, indent=1, default=str) + "\n")


def read_json(path: str | Path) -> Any:
    return json.loads(Path(path).read_text())


def save_elements(path: str | Path, searched: Mapping[str, Mapping[str, torch.Tensor]],
                  full: Mapping[str, Mapping[str, torch.Tensor]]) -> None:
    """Elements of the searched groups (the next round's warm start) and of the spec's
    full groups (the transform record), as ``{searched|full}/{space}/{field}``."""
    tensors = {f"searched/{s}/{k}": v for s, e in searched.items() for k, v in e.items()}
    tensors.update({f"full/{s}/{k}": v for s, e in full.items() for k, v in e.items()})
    save_tensors(path, tensors)


def load_elements(path: str | Path) -> tuple[dict[str, dict[str, torch.Tensor]], dict[str, dict[str, torch.Tensor]]]:
    """What :func:`save_elements` wrote: (searched, full)."""
    parts: dict[str, dict[str, dict[str, torch.Tensor]]] = {"searched": {}, "full": {}}
    for key, v in load_tensors(path).items():
        which, space, field = key.split("/", 2)
        parts[which].setdefault(space, {})[field] = v
    return parts["searched"], parts["full"]


def round_dir(work: Path, r: int) -> Path:
    """The folder of round ``r`` (1-based) in the work folder ``work``."""
    return work / "rounds" / f"{r:03d}"


# --------------------------------------------------------------------------- the folder


class WorkFolder:
    """One run's work folder: a temporary one (``workdir=None``), or the caller's, locked
    and resumed when it holds an unfinished run of the same inputs and settings.

    Use :meth:`open`, then run inside :meth:`session`, which releases the lock and
    cleans up: after a failure it keeps a folder that holds finished rounds (a rerun
    resumes them), and a temporary folder is removed unless ``keep``.
    """

    def __init__(self, path: Path, *, temporary: bool, keep: bool, lock: FolderLock | None) -> None:
        self.path = path
        self.temporary = temporary
        self.keep = keep
        self.lock = lock

    @classmethod
    def open(cls, workdir: str | Path | None, fingerprint: Mapping[str, Any], names: Sequence[str], *,
             resume: bool = True, keep: bool | None = None, say: Progress | None = None) -> WorkFolder:
        """Take ``workdir`` (None: a new temporary folder) for a run with ``fingerprint``.

        A folder that is not a work folder of ours (a file, or a folder holding anything
        but a run) is refused and left as it is; one holding a run of other inputs or
        settings (or any run, without ``resume``) is emptied."""
        temporary = workdir is None
        work = Path(tempfile.mkdtemp(prefix="symspec-universe-")) if workdir is None else Path(workdir)
        keep = (not temporary) if keep is None else keep
        if not temporary and os.path.lexists(work) and not work.is_symlink() and not work.is_dir():
            raise UniverseError(f"{work} exists and is not a universe work folder; give an empty or new folder")
        # Two runs on one work folder would destroy each other's files: hold it locked (a
        # symbolic link planted at its name is refused, never followed)
        lock = None if temporary else FolderLock(work).acquire()
        folder = cls(work, temporary=temporary, keep=keep, lock=lock)
        try:
            folder._take(fingerprint, names, resume, say)
        except BaseException:
            folder.release()
            raise
        return folder

    def _take(self, fingerprint: Mapping[str, Any], names: Sequence[str], resume: bool, say: Progress | None) -> None:
        run_file = self.path / "run.json"
        if not self.temporary and not run_file.exists() and any(self.path.iterdir()):
            # never write into (or later remove) a folder that is not a work folder of ours
            raise UniverseError(f"{self.path} exists and is not a universe work folder; give an empty or new folder")
        if run_file.exists():
            try:
                same = read_json(run_file).get("fingerprint") == fingerprint
            except (OSError, ValueError):
                same = False
            note = say or (lambda e: None)
            if same and resume:
                note(UniverseEvent("note", message=f"resuming the unfinished run in {self.path}"))
            else:
                if resume:
                    note(UniverseEvent("note", message=f"{self.path} holds a run of other inputs or settings; starting over"))
                clear_folder(self.path)  # not rmtree: the lock is held on the folder itself
        self.path.mkdir(parents=True, exist_ok=True)
        write_json(run_file, {"fingerprint": dict(fingerprint), "models": list(names)})
        (self.path / "canonical").mkdir(exist_ok=True)

    @contextmanager
    def session(self) -> Iterator[WorkFolder]:
        """The run: on a failure, remove the folder unless it holds finished rounds (models
        that failed to load will be fixed or dropped, which starts over anyway); at the
        end, release the lock and remove a temporary folder unless ``keep``."""
        try:
            yield self
        except BaseException:
            if self.temporary or not self.resumable():
                shutil.rmtree(self.path, ignore_errors=True)
            raise
        finally:
            self.release()
        if self.temporary and not self.keep:
            shutil.rmtree(self.path, ignore_errors=True)

    def resumable(self) -> bool:
        """Whether the folder holds work of a finished round worth resuming."""
        rounds = self.path / "rounds"
        return (rounds / "001").exists() and any(rounds.rglob("*.json"))

    def release(self) -> None:
        if self.lock is not None:
            self.lock.release()
            self.lock = None

    # -- paths ------------------------------------------------------------------------

    def save_config(self, config: Any) -> str:
        """Pickle the run's config (every task reads it) and return its path."""
        path = self.path / "run.pkl"
        atomic_write_bytes(path, pickle.dumps(config))
        return str(path)

    def canonical(self, key: str) -> Path:
        return self.path / "canonical" / f"{key}.safetensors"

    def canonical_marker(self, key: str) -> Path:
        return self.path / "canonical" / f"{key}.json"

    def round(self, r: int) -> Path:
        return round_dir(self.path, r)

    def universe(self, r: int) -> Path:
        """The universe round ``r`` aligns to (round ``r + 1``'s holds its result)."""
        return self.round(r) / "universe.safetensors"

    def aligned(self, r: int, key: str) -> Path:
        return self.round(r) / f"{key}.aligned.safetensors"

    def elements(self, r: int, key: str) -> Path:
        return self.round(r) / f"{key}.elements.safetensors"

    def marker(self, r: int, key: str) -> Path:
        return self.round(r) / f"{key}.json"

    # -- the rounds' log --------------------------------------------------------------

    def read_state(self) -> tuple[list[dict[str, Any]], list[float]]:
        """The finished rounds and the objective so far (none for a new run)."""
        path = self.path / "state.json"
        saved = read_json(path) if path.exists() else {"rounds": [], "history": []}
        return list(saved["rounds"]), list(saved["history"])

    def write_state(self, rounds: list[dict[str, Any]], history: list[float]) -> None:
        write_json(self.path / "state.json", {"rounds": rounds, "history": history})

    def drop_rounds_before(self, r: int) -> None:
        """Remove the files of rounds before ``r`` (round ``r`` holds the warm start)."""
        for old in range(1, r):
            shutil.rmtree(self.round(old), ignore_errors=True)


__all__ = [
    "WorkFolder",
    "load_elements",
    "load_tensors",
    "read_json",
    "round_dir",
    "save_elements",
    "save_tensors",
    "write_json",
]
