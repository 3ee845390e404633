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

A resumed run trusts nothing it reads: a marker, ``state.json`` or a tensor file that is
truncated or corrupt (:func:`damage`) is named in a note and recomputed (its task runs
again; a finished round that lost a file starts the rounds over). A write that fails (a
full disk, a read-only folder) is one line, ``cannot write PATH: REASON``
(:class:`~.errors.WorkWriteError`).
"""

from __future__ import annotations

import errno
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
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from ..outputs import (
    STAGING_PREFIX,
    FolderLock,
    atomic_write,
    atomic_write_bytes,
    atomic_write_text,
    clear_folder,
    is_write_error,
)
from ..statedict import storage_key
from .errors import UniverseError, WorkWriteError, resume_hint, work_write_error
from .progress import Progress, UniverseEvent

# --------------------------------------------------------------------------- files


def save_tensors(path: str | Path, tensors: Mapping[str, torch.Tensor], metadata: Mapping[str, str] | None = None) -> None:
    """Write a safetensors file atomically (tied entries are stored as separate copies)."""
    seen: set[tuple[object, ...]] = set()
    out: dict[str, torch.Tensor] = {}
    for k, v in tensors.items():
        t = v.detach().to("cpu").contiguous()
        key = storage_key(t)
        out[k] = t.clone() if key in seen and t.numel() else t
        seen.add(key)
    with writing(path):
        atomic_write(path, lambda tmp: save_file(out, str(tmp), metadata=dict(metadata) if metadata else None))


@contextmanager
def writing(path: str | Path) -> Iterator[None]:
    """A failed write in the block (``OSError``, safetensors' error on a full disk) as one
    :class:`~.errors.WorkWriteError` line naming ``path``."""
    try:
        yield
    except WorkWriteError:
        raise
    except Exception as e:
        if not is_write_error(e):
            raise
        raise work_write_error(path, e) from e


def load_tensors(path: str | Path) -> dict[str, torch.Tensor]:
    """A safetensors file's tensors (on the CPU); a missing or corrupt file is one
    :class:`~.errors.UniverseError` line naming it (a rerun recomputes it)."""
    try:
        return load_file(str(path))
    except Exception as e:
        if not is_write_error(e):  # OSError, or safetensors' error: the file, not a bug
            raise
        raise UniverseError(f"{path} cannot be read ({_reason(e)}); rerun the same command: the rerun "
                            "recomputes it") from e


def write_json(path: str | Path, data: Any) -> None:
    """Write ``data`` as JSON, atomically."""
    with writing(path):
        atomic_write_text(path, json.dumps(data, indent=1, default=str) + "\n")


def read_json(path: str | Path) -> Any:
    return json.loads(Path(path).read_text())


def _reason(e: BaseException) -> str:
    if isinstance(e, OSError) and e.strerror:
        return e.strerror
    return " ".join(str(e).split())[:200] or type(e).__name__


def damage(path: str | Path) -> str | None:
    """Why the work folder's file ``path`` cannot be used (missing, truncated, corrupt),
    or None when it can: a JSON file must parse to an object; a safetensors file's header
    must parse and cover the file exactly (what a truncated file fails). Cheap: tensor
    data is not read."""
    p = Path(path)
    try:
        if p.suffix == ".json":
            data = json.loads(p.read_bytes())
            return None if isinstance(data, dict) else "not a JSON object"
        with safe_open(str(p), "pt"):
            return None
    except FileNotFoundError:
        return "missing"
    except Exception as e:  # a JSON, Unicode, OS or safetensors error: the file is no use
        return _reason(e)


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


#: where a work folder's longest file lies, beside its model's key
_DEEPEST = ("rounds", "001", "{key}.elements.safetensors")
#: the longest name an output folder's file gets (a transform record's), beside the key
_DEEPEST_OUT = ("transforms", "{key}", "transform.safetensors")


def deepest_paths(work: str | Path, keys: Sequence[str], out: str | Path | None = None) -> list[Path]:
    """The longest paths a run writes: in its work folder, and in its output folder
    ``out`` (at its final name and in the staging folder beside it)."""
    key = max(keys, key=lambda k: len(os.fsencode(k)), default="model")
    paths = [Path(os.path.abspath(work)).joinpath(*(n.format(key=key) for n in _DEEPEST))]
    if out is not None:
        final = Path(os.path.abspath(out))
        inner = [n.format(key=key) for n in _DEEPEST_OUT]
        paths += [final.joinpath(*inner), final.parent.joinpath(STAGING_PREFIX + "x" * 8, "output", *inner)]
    return paths


def check_paths(what: str | Path, paths: Sequence[Path]) -> None:
    """Refuse, before any work, files that would be named longer than the file system
    allows (a name over its name limit, a path over its path limit): one line,
    ``cannot write WHAT: File name too long``."""
    for path in paths:
        probe = path.parent
        while not probe.exists() and probe != probe.parent:
            probe = probe.parent
        limits = []
        for name, default in (("PC_NAME_MAX", 255), ("PC_PATH_MAX", 4096)):
            try:
                limits.append(int(os.pathconf(probe, name)))
            except (OSError, ValueError):
                limits.append(default)
        name_max, path_max = limits
        # a temporary sibling (atomic writes) may be longer than the file's own name
        if any(len(os.fsencode(n)) > name_max for n in path.parts) or len(os.fsencode(path)) + 8 >= path_max:
            raise WorkWriteError(f"cannot write {what}: {os.strerror(errno.ENAMETOOLONG)} (the run's files, such as "
                                 f"{path.name}, would pass the system's limits of {name_max} bytes a name and "
                                 f"{path_max} a path); write it under a shorter path", errno.ENAMETOOLONG)


def round_dir(work: Path, r: int) -> Path:
    """The folder of round ``r`` (1-based) in the work folder ``work``."""
    return work / "rounds" / f"{r:03d}"


# --------------------------------------------------------------------------- the folder

#: what every round of ``state.json`` holds (a log without them is corrupt)
_ROUND_FIELDS = {"round", "objective", "target_objective", "floor", "models"}
#: what a task's marker holds: a prepared model's, an aligned model's
PREPARED_FIELDS = ("ok",)
ALIGNED_FIELDS = ("ok", "before", "after")


class WorkFolder:
    """One run's work folder: a temporary one (``workdir=None``), or the caller's, locked
    and resumed when it holds an unfinished run of the same inputs and settings.

    Use :meth:`open`, then run inside :meth:`session`, which releases the lock and
    cleans up: after a failure it keeps a folder that holds finished rounds (a rerun
    resumes them), and a temporary folder is removed unless ``keep``.
    """

    def __init__(self, path: Path, *, temporary: bool, keep: bool, lock: FolderLock | None,
                 say: Progress | None = None) -> None:
        self.path = path
        self.temporary = temporary
        self.keep = keep
        self.lock = lock
        self.say = say or (lambda e: None)

    def note(self, message: str) -> None:
        self.say(UniverseEvent("note", message=message))

    @classmethod
    def open(cls, workdir: str | Path | None, fingerprint: Mapping[str, Any], names: Sequence[str], *,
             resume: bool = True, keep: bool | None = None, say: Progress | None = None) -> WorkFolder:
        """Take ``workdir`` (None: a new temporary folder) for a run with ``fingerprint``.

        A folder that is not a work folder of ours (a file, or a folder holding anything
        but a run) is refused and left as it is; one holding a run of other inputs or
        settings (or any run, without ``resume``) is emptied."""
        temporary = workdir is None
        if workdir is None:
            with writing(tempfile.gettempdir()):
                work = Path(tempfile.mkdtemp(prefix="symspec-universe-"))
        else:
            work = Path(workdir)
        keep = (not temporary) if keep is None else keep
        if not temporary and os.path.lexists(work) and not work.is_symlink() and not work.is_dir():
            raise UniverseError(f"{work} exists and is not a universe work folder; give an empty or new folder")
        # Two runs on one work folder would destroy each other's files: hold it locked (a
        # symbolic link planted at its name is refused, never followed)
        lock = None if temporary else FolderLock(work).acquire()
        folder = cls(work, temporary=temporary, keep=keep, lock=lock, say=say)
        try:
            folder._take(fingerprint, names, resume)
        except WorkWriteError as e:
            folder.release()
            raise folder.explained(e, not temporary and folder.resumable()) from e
        except BaseException:
            folder.release()
            raise
        return folder

    def explained(self, e: WorkWriteError, kept: bool) -> WorkWriteError:
        """``e`` with what becomes of the work done (``kept``: a rerun resumes it)."""
        return WorkWriteError(str(e) + resume_hint(e, self.path, kept), e.code)

    def _take(self, fingerprint: Mapping[str, Any], names: Sequence[str], resume: bool) -> None:
        run_file = self.path / "run.json"
        if not self.temporary and not run_file.exists() and any(self.path.iterdir()):
            # never write into (or later remove) a folder that is not a work folder of ours
            raise UniverseError(f"{self.path} exists and is not a universe work folder; give an empty or new folder")
        resuming = False
        if run_file.exists():
            why = damage(run_file)
            same = why is None and read_json(run_file).get("fingerprint") == fingerprint
            resuming = same and resume
            if not resuming:
                if why is not None:
                    self.note(f"{run_file} is corrupt ({why}); starting over")
                elif resume:
                    self.note(f"{self.path} holds a run of other inputs or settings; starting over")
                with writing(self.path):
                    clear_folder(self.path)  # not rmtree: the lock is held on the folder itself
        with writing(self.path):
            self.path.mkdir(parents=True, exist_ok=True)
        write_json(run_file, {"fingerprint": dict(fingerprint), "models": list(names)})
        with writing(self.path / "canonical"):
            (self.path / "canonical").mkdir(exist_ok=True)
        if resuming:  # said once the folder proved writable
            self.note(f"resuming the unfinished run in {self.path}")

    @contextmanager
    def session(self) -> Iterator[WorkFolder]:
        """The run: on a failure, remove the folder unless it holds finished rounds (models
        that failed to load will be fixed or dropped, which starts over anyway); at the
        end, release the lock and remove a temporary folder unless ``keep``."""
        try:
            yield self
        except BaseException as e:
            kept = not self.temporary and self.resumable()
            if not kept:
                shutil.rmtree(self.path, ignore_errors=True)
            if isinstance(e, WorkWriteError):  # say what becomes of the work done
                raise self.explained(e, kept) from e
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
        with writing(path):
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
        """The finished rounds and the objective so far (none for a new run; a corrupt
        ``state.json`` is named and the rounds start over)."""
        path = self.path / "state.json"
        if not path.exists():
            # only round 1 runs before the first state.json (and writes round 2's universe
            # just before it): round 1 gone, or a later round's task results, without it
            # are a log that was lost
            rounds, first = self.path / "rounds", round_dir(self.path, 1)
            later = [p for p in rounds.iterdir() if p != first] if rounds.is_dir() else []
            if later and (not first.exists() or any(any(p.glob("*.json")) for p in later)):
                self.restart_rounds(f"{path} is missing")
            return [], []
        why = damage(path)
        if why is None:
            saved = read_json(path)
            rounds, history = saved.get("rounds"), saved.get("history")
            if (isinstance(rounds, list) and isinstance(history, list)
                    and all(isinstance(r, dict) and r.keys() >= _ROUND_FIELDS for r in rounds)
                    and len(history) == (len(rounds) + 1 if rounds else 0)):
                return rounds, history
            why = "not the rounds' log"
        self.restart_rounds(f"{path} is corrupt ({why})")
        return [], []

    def restart_rounds(self, why: str) -> None:
        """Drop every round (the canonical models stay): the rounds run again from the
        first, to the same result."""
        self.note(f"{why}; recomputing the rounds from the first")
        for p in (self.path / "state.json", self.path / "rounds"):
            self.discard(p)

    def discard(self, path: Path) -> None:
        """Remove a file or folder that cannot be used (one that cannot be removed, in a
        read-only folder, stops the run: it would be read again)."""
        try:
            if path.is_dir() and not path.is_symlink():
                shutil.rmtree(path)
            else:
                path.unlink(missing_ok=True)
        except OSError as e:
            raise work_write_error(path, e) from e

    def finished(self, marker: Path, files: Sequence[Path], fields: Sequence[str] = ()) -> dict[str, Any] | None:
        """The result a task's ``marker`` holds when the task is complete (its result
        has ``fields``) and its ``files`` are intact, else None: a corrupt marker or file
        is named in a note and removed, so that the task runs again."""
        if not marker.exists():
            return None
        for p in (marker, *files):
            why = damage(p)
            if why is None and p == marker and not set(fields) <= read_json(p).keys():
                why = "not a task's result"
            if why is not None:
                self.note(f"{p} is {why if why == 'missing' else f'corrupt ({why})'}; recomputing it")
                for q in (marker, *files):
                    self.discard(q)
                return None
        data: dict[str, Any] = read_json(marker)
        return data

    def first_damage(self, files: Sequence[Path]) -> str | None:
        """``PATH is corrupt (REASON)`` for the first file of ``files`` that cannot be used."""
        for p in files:
            why = damage(p)
            if why is not None:
                return f"{p} is {why if why == 'missing' else f'corrupt ({why})'}"
        return None

    def write_state(self, rounds: list[dict[str, Any]], history: list[float]) -> None:
        write_json(self.path / "state.json", {"rounds": rounds, "history": history})

    def drop_rounds_before(self, r: int) -> None:
        """Remove the files of rounds before ``r`` (round ``r`` holds the warm start)."""
        for old in range(1, r):
            shutil.rmtree(self.round(old), ignore_errors=True)


__all__ = [
    "ALIGNED_FIELDS",
    "PREPARED_FIELDS",
    "WorkFolder",
    "check_paths",
    "damage",
    "deepest_paths",
    "load_elements",
    "load_tensors",
    "read_json",
    "round_dir",
    "save_elements",
    "save_tensors",
    "write_json",
    "writing",
]
