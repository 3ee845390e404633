"""Universe matching: align many models to one shared universe, average, repeat (DESIGN §4).

>>> import symspec.universe as U  # doctest: +SKIP
>>> res = U.universe_match(["seed0.pt", "seed1.pt", "seed2.pt"], "nanogpt", factory="model.py", jobs=2)  # doctest: +SKIP
>>> res.history          # sum_i ||U - g_i·θ_i||^2 before the first round, then after each  # doctest: +SKIP
>>> res.merged           # the universe: a canonical state dict of the reference's class  # doctest: +SKIP
>>> res.transform(0, 2)  # g_2^-1 g_0: model 0 aligned to model 2, through the universe  # doctest: +SKIP

The universe starts as one model (``start``, canonical form). Each round aligns every
model to the current universe by weight matching with the spec's groups (warm-started
from the model's element of the previous round) and sets the universe to the mean of
the aligned models. Both steps lower ``F(U, g) = sum_i ||U - g_i·θ_i||^2`` over the
bound parameters, so the objective reported per round never grows; the rounds stop when
it improves by less than ``tol`` (relative), when it reaches the rounding level of the
working precision (``eps * n * ||U||^2``), or after ``rounds``.

Every model gets one element ``g_i`` (a :class:`~symspec.record.TransformRecord`) into
the universe, so any two models are aligned to each other through it:
``g_{i->j} = g_j^-1 g_i``, cycle-consistent by construction (``g_{j->k} g_{i->j} = g_{i->k}``).

The work runs as tasks (:mod:`symspec.universe_workers`) that exchange files in a work
folder: inline, in ``jobs`` worker processes, or as Ray tasks. The parent holds the
universe and a running float64 sum, and adds the aligned models in index order as they
complete, one at a time: memory does not grow with the number of models, and the merged
model is bitwise the same whichever executor ran the tasks (each task runs with the
same number of torch threads). A task's outputs are persisted as it completes, so a
failed run resumes from its work folder.
"""

from __future__ import annotations

import functools
import glob
import hashlib
import math
import os
import pickle
import shutil
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import attrs
import torch

from .errors import SymspecInputError
from .io_util import json_safe
from .outputs import FolderLock, Target, clear_folder, publish
from .record import TransformRecord
from .universe_workers import (
    RunConfig,
    Task,
    UniverseError,
    architecture_error,
    load_elements,
    load_tensors,
    make_executor,
    prepare_state,
    read_json,
    save_tensors,
    signature_differences,
    state_signature,
    write_json,
)

STATE_VERSION = 1
Result = dict[str, Any]


class WorkerError(UniverseError):
    """One or more models whose task failed (their worker raised or died); the other
    models' results are kept in the work folder, so a rerun resumes."""

    def __init__(self, message: str, failures: Sequence[Mapping[str, Any]]) -> None:
        super().__init__(message)
        self.failures = [dict(f) for f in failures]


@attrs.frozen
class UniverseEvent:
    """Progress: ``kind`` is 'prepare' (a model loaded), 'align' (a model aligned),
    'round' (a round finished: ``objective``), or 'note' (``message``)."""

    kind: str
    round: int = 0
    rounds: int = 0
    done: int = 0
    total: int = 0
    name: str = ""
    objective: float = math.nan
    seconds: float = 0.0
    message: str = ""


Progress = Callable[[UniverseEvent], None]


@attrs.frozen
class ModelEntry:
    """One input model: ``name`` as given (a path, or ``model{i}``), ``key`` a unique
    file-safe name (``03-seed3``), ``format`` of its source (see symspec.loading) and
    ``dtype``, the one dtype its weights are stored in (None: mixed), which its outputs
    are written in."""

    index: int
    name: str
    key: str
    path: str | None
    format: str
    dtype: str | None = None


@attrs.define
class UniverseResult:
    """What :func:`universe_match` found.

    ``merged``: the universe after the last round (canonical form; loads into
    ``canonical_model``). ``aligned``: each model aligned into it (None unless
    ``load_aligned``; else read them with :meth:`aligned_state` while the work folder
    lives). ``records``: each model's transform into the universe. ``history``: the
    objective ``sum_i ||U - g_i·θ_i||^2`` before the first round and after each.
    ``rounds``: per round, each model's distance to the round's target before and after
    its alignment, and seconds. ``timings``: seconds per phase.
    """

    bound: Any
    models: list[ModelEntry]
    start: int
    merged: dict[str, torch.Tensor]
    records: list[TransformRecord]
    history: list[float]
    rounds: list[dict[str, Any]]
    converged: bool
    timings: dict[str, float]
    executor: str
    jobs: int
    dtype: str
    groups: str
    aligned: list[dict[str, torch.Tensor]] | None = None
    canonical_model: torch.nn.Module | None = None
    reference: Any = None  # the reference's LoadedModel when it came from a file
    workdir: Path | None = None
    resumed: int = 0
    max_in_flight: int = 0

    @property
    def spec(self) -> Any:
        return self.bound.spec

    @property
    def names(self) -> list[str]:
        return [m.name for m in self.models]

    def index(self, model: int | str) -> int:
        if isinstance(model, int):
            if not 0 <= model < len(self.models):
                raise UniverseError(f"no model {model}: there are {len(self.models)}")
            return model
        for m in self.models:
            if model in (m.name, m.key):
                return m.index
        raise UniverseError(f"no model named {model!r}; models: {', '.join(self.names)}")

    def aligned_state(self, model: int | str) -> dict[str, torch.Tensor]:
        """Model ``model`` aligned into the universe (canonical form)."""
        i = self.index(model)
        if self.aligned is not None:
            return self.aligned[i]
        path = self.aligned_path(i)
        if path is None or not path.exists():
            raise UniverseError("the aligned models were not kept: pass load_aligned=True or a workdir")
        return load_tensors(path)

    def aligned_path(self, model: int | str) -> Path | None:
        if self.workdir is None:
            return None
        i = self.index(model)
        return _round_dir(self.workdir, len(self.rounds)) / f"{self.models[i].key}.aligned.safetensors"

    def transform(self, source: int | str, target: int | str) -> TransformRecord:
        """The transform aligning model ``source`` to model ``target`` through the
        universe: ``g_target^-1 g_source``, acting on ``source``'s canonical form."""
        i, j = self.index(source), self.index(target)
        ri, rj = self.records[i], self.records[j]
        elements = {}
        for s, gi in ri.elements.items():
            group = ri.group(s)
            elements[s] = group.compose(group.inverse(rj.elements[s]), gi)
        meta = {"method": "universe", "from": self.models[i].name, "to": self.models[j].name}
        return TransformRecord(ri.spec, dict(ri.groups), elements, list(ri.canonical), dict(ri.searched), meta)

    def summary(self) -> dict[str, Any]:
        """A JSON-able account of the run (the ``universe`` part of the report)."""
        h0 = self.history[0] if self.history else 0.0
        return {
            "spec": self.spec.name,
            "groups": self.groups,
            "start": self.models[self.start].name,
            "models": [{"index": m.index, "name": m.name, "key": m.key, "format": m.format,
                        "distance_before": self.rounds[0]["models"][m.index]["before"] if self.rounds else None,
                        "distance_after": self.rounds[-1]["models"][m.index]["after"] if self.rounds else None}
                       for m in self.models],
            "rounds": len(self.rounds),
            "converged": self.converged,
            "objective": list(self.history),
            "relative_objective": [h / h0 if h0 else 0.0 for h in self.history],
            "per_round": self.rounds,
            "executor": self.executor,
            "jobs": self.jobs,
            "dtype": self.dtype,
            "resumed_tasks": self.resumed,
            "timings": dict(self.timings),
        }


# --------------------------------------------------------------------------- inputs


def expand_models(args: Sequence[str | Path]) -> list[str]:
    """Model arguments as paths: globs (``runs/*/model.pt``, expanded here when the
    shell did not) and list files (``@models.txt``: one path or glob a line, ``#``
    comments, relative to the list file's folder). Order is kept; globs sort."""
    out: list[str] = []
    for arg in args:
        text = str(arg)
        if text.startswith("@"):
            listing = Path(text[1:])
            try:
                raw = listing.read_bytes()
            except OSError as e:
                raise UniverseError(f"{text}: cannot read the list of models ({e.strerror or e})") from None
            try:
                content = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise UniverseError(f"{text}: not a text list of model paths (byte {e.start} is not UTF-8; "
                                    "is it a model rather than a list?)") from None
            if "\0" in content:  # a path cannot hold NUL (os calls refuse it): binary data
                raise UniverseError(f"{text}: not a text list of model paths (it holds NUL bytes; is it a model rather than a list?)")
            lines = content.splitlines()
            entries = [ln.split("#", 1)[0].strip() for ln in lines]
            entries = [e if Path(e).is_absolute() else str(listing.parent / e) for e in entries if e]
            if not entries:
                raise UniverseError(f"{text}: the list of models is empty")
            nested = [e for e in entries if Path(e).name.startswith("@")]
            if nested:
                raise UniverseError(f"{text}: a list of models cannot name another list ({nested[0]})")
            out += expand_models(entries)
        elif glob.has_magic(text):
            found = sorted(glob.glob(text, recursive=True))
            if not found:
                raise UniverseError(f"{text}: no file matches")
            out += found
        else:
            out.append(text)
    return out


def _key(index: int, width: int, name: str) -> str:
    stem = Path(name.rstrip("/")).name
    for suffix in (".safetensors", ".pt", ".pth", ".bin", ".ckpt", ".py"):
        stem = stem.removesuffix(suffix)
    safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in stem) or "model"
    return f"{index:0{width}d}-{safe}"


def _fingerprint_path(p: Path) -> list[Any]:
    if p.is_dir():
        return [str(p.resolve()), *([f.name, f.stat().st_size, f.stat().st_mtime_ns] for f in sorted(p.iterdir()) if f.is_file())]
    st = p.stat()
    return [str(p.resolve()), st.st_size, st.st_mtime_ns]


def _fingerprint_state(sd: Mapping[str, torch.Tensor]) -> str:
    h = hashlib.sha256()
    for k in sorted(sd):
        v = sd[k].detach().to("cpu").contiguous()
        h.update(k.encode())
        h.update(str(v.dtype).encode())
        h.update(str(tuple(v.shape)).encode())
        h.update(v.view(torch.uint8).numpy().tobytes() if v.numel() else b"")
    return h.hexdigest()


def _state_of(obj: Any) -> dict[str, torch.Tensor]:
    if isinstance(obj, torch.nn.Module):
        return {k: v.detach() for k, v in obj.state_dict().items()}
    if hasattr(obj, "model") and isinstance(obj.model, torch.nn.Module):
        return {k: v.detach() for k, v in obj.model.state_dict().items()}
    return dict(obj)


def _module_of(obj: Any) -> torch.nn.Module | None:
    if isinstance(obj, torch.nn.Module):
        return obj
    m = getattr(obj, "model", None)
    return m if isinstance(m, torch.nn.Module) else None


# --------------------------------------------------------------------------- the work folder


def _mode_text(modes: Mapping[str, str]) -> str:
    """``full``, ``perm`` or ``fixed`` when every space has it, else ``space=mode,...``."""
    kinds = set(modes.values())
    if len(kinds) <= 1:
        return next(iter(kinds), "full")
    return ",".join(f"{s}={m}" for s, m in modes.items())


def _round_dir(work: Path, r: int) -> Path:
    return work / "rounds" / f"{r:03d}"


class _Mean:
    """A running sum in float64, added to in index order: the mean is bitwise the same
    whatever order the models were aligned in."""

    def __init__(self) -> None:
        self.total: dict[str, torch.Tensor] = {}
        self.count = 0

    def add(self, sd: Mapping[str, torch.Tensor]) -> None:
        if not self.total:
            self.total = {k: (v.to(torch.float64, copy=True) if v.is_floating_point() else v) for k, v in sd.items()}
        else:
            for k, v in self.total.items():
                if v.is_floating_point():
                    v.add_(sd[k].to(torch.float64))
        self.count += 1

    def mean(self, dtype: torch.dtype) -> dict[str, torch.Tensor]:
        return {k: ((v / self.count).to(dtype) if v.is_floating_point() else v) for k, v in self.total.items()}


class _Round:
    """One round's bookkeeping in the parent: results as they complete, and the mean fed
    with the aligned models in index order (read from disk one at a time)."""

    def __init__(self, n: int, rdir: Path, keys: list[str], say: Callable[[int, str], None]) -> None:
        self.n, self.rdir, self.keys, self.say = n, rdir, keys, say
        self.results: dict[int, Result] = {}
        self.failures: list[Result] = []
        self.mean = _Mean()
        self.next = 0

    def feed(self) -> None:
        while self.next < self.n and self.results.get(self.next, {}).get("ok"):
            self.mean.add(load_tensors(self.rdir / f"{self.keys[self.next]}.aligned.safetensors"))
            self.next += 1

    def done(self, task: Task, res: Result) -> None:
        self.results[task.index] = res
        if not res.get("ok"):
            self.failures.append(res)
        self.say(len(self.results), task.name)
        self.feed()


def _say_align(say: Progress, r: int, rounds: int, n: int, done: int, name: str) -> None:
    say(UniverseEvent("align", r, rounds, done, n, name))


def _converged(history: list[float], tol: float, floor: float, noise: float = 0.0) -> bool:
    """The last round gained less than ``tol`` (relative) or no more than ``noise`` (the
    rounding error of the two values: no decision is taken on rounding noise), or the
    objective is at the rounding level of the working precision (``floor``: eps * n *
    ||U||^2)."""
    prev, now = history[-2], history[-1]
    return now <= floor or prev - now <= max(tol * max(prev, 1e-300), noise)


def _noise(history: list[float], rounds_done: list[dict[str, Any]], eps: float) -> float:
    """The rounding error of the last two objectives. Each is float64 arithmetic on sums
    of per-model distances that the working precision (``eps``) computed to about 2 eps
    of their size (``target_objective``, before the universe's own change is taken off;
    the first value is such a sum itself)."""
    now = rounds_done[-1]["target_objective"]
    prev = rounds_done[-2]["target_objective"] if len(rounds_done) > 1 else history[-2]
    return 2 * eps * (abs(prev) + abs(now))


def _stop(history: list[float], rounds_done: list[dict[str, Any]], rounds: int, tol: float, eps: float = 0.0) -> bool:
    return bool(rounds_done) and (len(rounds_done) >= rounds
                                  or _converged(history, tol, rounds_done[-1]["floor"], _noise(history, rounds_done, eps)))


# --------------------------------------------------------------------------- the API


def universe_match(models: Sequence[Any], spec: Any, *, rounds: int = 10, tol: float = 1e-4,
                   groups: str | Mapping[str, str] | None = None, jobs: int | None = None, ray: str | None = None,
                   device: str = "cpu", dtype: torch.dtype | None = None, start: int | str = 0,
                   factory: str | Path | None = None, config: Any = None, workdir: str | Path | None = None,
                   resume: bool = True, progress: Progress | None = None, match_rounds: int = 10,
                   match_tol: float = 1e-6, max_iter: int = 10, threads: int = 1, worker_setup: str | None = None,
                   load_aligned: bool = True, keep_workdir: bool | None = None, ray_retries: int = 0) -> UniverseResult:
    """Universe matching of ``models`` under ``spec``.

    ``models``: paths (model files, Hugging Face folders, checkpoints with ``factory``),
    modules, :class:`~symspec.loading.LoadedModel` objects, or state dicts (with
    ``config`` for the spec's dimensions), at least two, all of one architecture.
    ``spec``: a Spec, a BoundSpec, a path or a built-in name. ``groups``: as in
    :func:`symspec.match.weight_match` (``"perm"``, ``"full"``, ``"perm,attn=full"``).
    ``rounds``/``tol``: at most ``rounds`` rounds, fewer once a round improves the
    objective by less than ``tol`` (relative). ``start``: the model the universe starts
    from (index or name); it is also the reference whose class and format the merged
    model keeps. ``jobs``: worker processes (``None``/1: this process); with ``ray``
    (``"local"``, ``"auto"``, an address), Ray tasks, ``jobs`` in flight (default: the
    cluster's CPUs). ``device``: where each alignment's dense work runs. ``dtype``: the
    working precision (default: the reference's). ``workdir``: keep the run's files
    there; an unfinished run in it is resumed when its inputs and settings are the same
    (``resume``). ``match_rounds``/``match_tol``/``max_iter``: the weight matching of one
    model onto the universe. ``threads``: torch threads per alignment (the same in every
    executor, for identical results). ``worker_setup``: ``"module:function"`` called
    once in every worker process (register custom groups or solvers there).
    """
    t0 = time.perf_counter()
    timings: dict[str, float] = {}
    say = progress or (lambda e: None)
    if rounds < 1:
        raise UniverseError(f"rounds must be at least 1, got {rounds}")
    if jobs is not None and jobs < 1:
        raise UniverseError(f"jobs must be at least 1, got {jobs}")
    if len(models) < 2:
        raise UniverseError(f"universe matching needs at least 2 models, got {len(models)}")

    # -- the models: names, existence -----------------------------------------------
    from .loading import LoadedModel, load_model, source_dtype

    width = max(2, len(str(len(models) - 1)))
    entries: list[tuple[str, str | None, Any]] = []
    missing = []
    for i, m in enumerate(models):
        if isinstance(m, (str, Path)):
            p = Path(m)
            if not p.exists():
                missing.append(str(m))
            entries.append((str(m), str(m), None))
        else:
            name = str(m.source) if isinstance(m, LoadedModel) else f"model{i}"
            entries.append((name, None, m))
    if missing:
        raise UniverseError(f"no such file or folder: {', '.join(missing)}")
    if isinstance(start, str):
        matches = [i for i, (n, _, _) in enumerate(entries) if n == start]
        if not matches:
            raise UniverseError(f"--start {start!r} is none of the models")
        start = matches[0]
    if not 0 <= start < len(entries):
        raise UniverseError(f"start must name one of the {len(entries)} models, got {start}")

    # -- the reference: bound, canonical form ----------------------------------------
    from .binding import BoundSpec, bind
    from .solvers import parse_restriction, restrict_problem, working_dtype
    from .solvers.weight import widen
    from .transforms import canonicalize_model, canonicalize_state_dict

    tick = time.perf_counter()
    ref_name, ref_path, ref_obj = entries[start]
    reference: Any = None
    if ref_path is not None:
        reference = load_model(ref_path, factory=factory)
        ref_obj = reference
    elif isinstance(ref_obj, LoadedModel):
        reference = ref_obj
    ref_module = _module_of(ref_obj)
    ref_state = _state_of(ref_obj)
    spec_obj = spec
    if not isinstance(spec, BoundSpec):
        from .spec import Spec, load_spec

        spec_obj = spec if isinstance(spec, Spec) else load_spec(spec)
    try:
        bound = spec_obj if isinstance(spec_obj, BoundSpec) else bind(spec_obj, ref_module if ref_module is not None else ref_state, config=config)
    except SymspecInputError as e:
        raise UniverseError(f"{ref_name}: {e}") from e
    modes = parse_restriction(groups, bound.problem)
    searched = restrict_problem(bound.problem, modes)
    # float16/bfloat16 models are canonicalised and matched in float32 (see working_dtype);
    # the outputs are written back in each model's own dtype
    ref_canonical = canonicalize_state_dict(bound, widen(ref_state))
    work_dtype = dtype or next((working_dtype(ref_canonical[p].dtype) for p in bound.problem.params
                                if ref_canonical[p].is_floating_point()), torch.float32)
    ref_canonical = {k: (v.to(work_dtype) if v.is_floating_point() else v) for k, v in ref_canonical.items()}
    canonical_model = canonicalize_model(bound, ref_module) if ref_module is not None else None
    if canonical_model is not None and work_dtype != next(iter(canonical_model.parameters())).dtype:
        canonical_model = canonical_model.to(work_dtype)
    cfg = RunConfig(bound=bound, modes=dict(modes), signature=state_signature(ref_canonical), reference=ref_name,
                    factory=str(factory) if factory else None, dtype=str(work_dtype).removeprefix("torch."),
                    device=str(device), match_rounds=match_rounds, match_tol=match_tol, max_iter=max_iter, threads=threads)
    timings["reference"] = time.perf_counter() - tick

    # -- the work folder ---------------------------------------------------------------
    from . import __version__
    from .spec.load import dump_spec

    fingerprint = {
        "version": STATE_VERSION, "symspec": __version__, "spec": dump_spec(bound.spec),
        "groups": _mode_text(modes), "start": start, "dtype": cfg.dtype, "device": cfg.device,
        "match": [match_rounds, match_tol, max_iter, threads],
        "factory": _fingerprint_path(Path(factory)) if factory else None,
        "models": [_fingerprint_path(Path(p)) if p is not None else _fingerprint_state(_state_of(o)) for _, p, o in entries],
    }
    temporary = workdir is None
    work = Path(tempfile.mkdtemp(prefix="symspec-universe-")) if workdir is None else Path(workdir)
    keep = (not temporary) if keep_workdir is None else keep_workdir
    run_file = work / "run.json"
    if not temporary and os.path.lexists(work) and not work.is_symlink() and not work.is_dir():
        raise UniverseError(f"{work} exists and is not a universe work folder; give an empty or new folder")
    # Two runs on one work folder would destroy each other's files: hold it locked (a
    # symbolic link planted at its name is refused, never followed)
    lock = None if temporary else FolderLock(work).acquire()
    try:
        if not temporary and not run_file.exists() and any(work.iterdir()):
            # never write into (or later remove) a folder that is not a work folder of ours
            raise UniverseError(f"{work} exists and is not a universe work folder; give an empty or new folder")
        if run_file.exists():
            try:
                same = read_json(run_file).get("fingerprint") == fingerprint
            except (OSError, ValueError):
                same = False
            if same and resume:
                say(UniverseEvent("note", message=f"resuming the unfinished run in {work}"))
            else:
                if resume:
                    say(UniverseEvent("note", message=f"{work} holds a run of other inputs or settings; starting over"))
                clear_folder(work)  # not rmtree: the lock is held on the folder itself
        work.mkdir(parents=True, exist_ok=True)
        write_json(run_file, {"fingerprint": fingerprint, "models": [n for n, _, _ in entries]})
        cfg_path = work / "run.pkl"
        with open(cfg_path.with_suffix(".tmp"), "wb") as f:
            pickle.dump(cfg, f)
        os.replace(cfg_path.with_suffix(".tmp"), cfg_path)

        keys = [_key(i, width, n) for i, (n, _, _) in enumerate(entries)]
        formats: list[str] = ["state_dict"] * len(entries)
        stored: list[str | None] = [None] * len(entries)  # each source's dtype, to write it back in
        resumed = 0
        executor = make_executor(jobs, ray, worker_setup, device=str(device), retries=ray_retries)
    except BaseException:
        if lock is not None:
            lock.release()
        raise
    try:
        # -- prepare: every model in canonical form, checked against the reference ------
        tick = time.perf_counter()
        canon_dir = work / "canonical"
        canon_dir.mkdir(exist_ok=True)
        tasks: list[Task] = []
        done_count = 0

        def prepared(i: int, meta: Mapping[str, Any]) -> None:
            nonlocal done_count
            done_count += 1
            formats[i] = str(meta.get("format", "state_dict"))
            stored[i] = meta.get("dtype") or None
            say(UniverseEvent("prepare", done=done_count, total=len(entries), name=entries[i][0]))

        for i, (name, path, obj) in enumerate(entries):
            marker = canon_dir / f"{keys[i]}.json"
            if marker.exists():
                resumed += 1
                prepared(i, read_json(marker))
                continue
            target = canon_dir / f"{keys[i]}.safetensors"
            if i == start:
                save_tensors(target, ref_canonical)
                meta = {"ok": True, "format": reference.format if reference is not None else "state_dict",
                        "dtype": source_dtype(reference if reference is not None else ref_state)}
            elif path is not None:
                tasks.append(Task("prepare", i, name, str(cfg_path), source=path, canonical=str(target), done=str(marker)))
                continue
            else:
                other = _module_of(obj)
                state = _state_of(obj)
                if other is None and config is None:
                    # a bare state dict: it has the reference's binding if it has its tensors
                    problems = signature_differences(state_signature(ref_state), state_signature(state))
                    if problems:
                        raise architecture_error(name, ref_name, problems)
                    b = bound
                else:
                    try:
                        b = bind(bound.spec, other if other is not None else state, config=config)
                    except SymspecInputError as e:
                        raise UniverseError(f"{name}: {e}") from e
                try:
                    save_tensors(target, prepare_state(cfg, name, state, b))
                except UniverseError:
                    raise
                except SymspecInputError as e:
                    raise UniverseError(f"{name}: {e}") from e
                meta = {"ok": True, "format": getattr(obj, "format", "state_dict"), "dtype": source_dtype(obj)}
            write_json(marker, meta)
            prepared(i, meta)
        failures: list[Result] = []

        def on_prepared(task: Task, res: Result) -> None:
            if res.get("ok"):
                prepared(task.index, res)
            else:
                failures.append(res)

        executor.run(tasks, on_prepared)
        _raise_failures(failures, "loading", work, temporary)
        timings["prepare"] = time.perf_counter() - tick

        # -- rounds -------------------------------------------------------------------------
        n = len(entries)
        state_file = work / "state.json"
        saved: dict[str, Any] = read_json(state_file) if state_file.exists() else {"rounds": [], "history": []}
        done_rounds: list[dict[str, Any]] = list(saved["rounds"])
        history: list[float] = list(saved["history"])
        first = _round_dir(work, 1) / "universe.safetensors"
        if not first.exists():
            save_tensors(first, ref_canonical)
        merged: dict[str, torch.Tensor] | None = None
        align_seconds = 0.0
        # A resumed run continues from the rounds it has done (their files are gone but
        # for the last), even where these settings would have stopped earlier.
        eps = torch.finfo(work_dtype).eps
        while not _stop(history, done_rounds, rounds, tol, eps):
            r = len(done_rounds) + 1
            tick = time.perf_counter()
            rdir = _round_dir(work, r)
            universe_path = rdir / "universe.safetensors"
            universe = load_tensors(universe_path)
            rnd = _Round(n, rdir, keys, functools.partial(_say_align, say, r, rounds, n))
            tasks = []
            for i, (name, _, _) in enumerate(entries):
                marker = rdir / f"{keys[i]}.json"
                if marker.exists():
                    rnd.results[i] = read_json(marker)
                    resumed += 1
                    continue
                init = _round_dir(work, r - 1) / f"{keys[i]}.elements.safetensors" if r > 1 else None
                tasks.append(Task("align", i, name, str(cfg_path), canonical=str(canon_dir / f"{keys[i]}.safetensors"),
                                  universe=str(universe_path), init=str(init) if init else "",
                                  aligned=str(rdir / f"{keys[i]}.aligned.safetensors"),
                                  elements=str(rdir / f"{keys[i]}.elements.safetensors"), done=str(marker)))
            rnd.feed()
            executor.run(tasks, rnd.done)
            _raise_failures(rnd.failures, f"round {r}", work, temporary)
            rnd.feed()
            results = rnd.results
            merged = rnd.mean.mean(work_dtype)
            delta = _distance(bound, merged, universe)
            del universe
            before = math.fsum(results[i]["before"] for i in range(n))
            after = math.fsum(results[i]["after"] for i in range(n))
            if not history:
                history.append(before)
            # sum_i ||U_new - a_i||^2 = sum_i ||U_old - a_i||^2 - n ||U_new - U_old||^2 (U_new is their mean)
            history.append(max(0.0, after - n * delta))
            save_tensors(_round_dir(work, r + 1) / "universe.safetensors", merged)
            seconds = time.perf_counter() - tick
            align_seconds += seconds
            floor = torch.finfo(work_dtype).eps * n * _distance(bound, merged, {})
            done_rounds.append({
                "round": r, "objective": history[-1], "target_objective": after, "universe_change": delta,
                "floor": floor, "seconds": seconds,
                "models": [{"name": entries[i][0], "before": results[i]["before"], "after": results[i]["after"],
                            "match_rounds": results[i].get("match_rounds"), "seconds": results[i].get("seconds")}
                           for i in range(n)],
            })
            write_json(state_file, {"rounds": done_rounds, "history": history})
            for old in range(1, r):
                shutil.rmtree(_round_dir(work, old), ignore_errors=True)
            say(UniverseEvent("round", r, rounds, n, n, objective=history[-1], seconds=seconds))
        timings["rounds"] = align_seconds
        converged = _converged(history, tol, done_rounds[-1]["floor"], _noise(history, done_rounds, eps))
        last = len(done_rounds)
        if merged is None:
            merged = load_tensors(_round_dir(work, last + 1) / "universe.safetensors")

        # -- records ------------------------------------------------------------------------
        tick = time.perf_counter()
        records = []
        aligned: list[dict[str, torch.Tensor]] | None = [] if load_aligned else None
        canonical_ops = [{"kind": op.kind, "args": dict(op.args)} for op in bound.canonical]
        searched_text = {s: str(searched.spaces[s].group) for s in bound.problem.spaces
                         if searched.spaces[s].group != bound.problem.spaces[s].group}
        for i, (name, _, _) in enumerate(entries):
            _, full = load_elements(_round_dir(work, last) / f"{keys[i]}.elements.safetensors")
            info = done_rounds[-1]["models"][i]
            records.append(TransformRecord(
                spec=bound.spec.name, groups={s: str(si.group) for s, si in bound.problem.spaces.items()},
                elements=full, canonical=canonical_ops, searched=searched_text,
                meta={"method": "universe", "model": name, "index": i, "round": last, "distance_before": info["before"],
                      "distance_after": info["after"], "objective": history, "groups": _mode_text(modes), "dtype": cfg.dtype},
            ))
            if aligned is not None:
                aligned.append(load_tensors(_round_dir(work, last) / f"{keys[i]}.aligned.safetensors"))
        timings["records"] = time.perf_counter() - tick
    except BaseException:
        # keep a work folder that holds finished rounds (a rerun resumes them); models that
        # failed to load will be fixed or dropped, which starts over anyway
        if temporary or not (work / "rounds" / "001").exists() or not any((work / "rounds").rglob("*.json")):
            shutil.rmtree(work, ignore_errors=True)
        raise
    finally:
        executor.close()
        if lock is not None:
            lock.release()
    if temporary and not keep:
        shutil.rmtree(work, ignore_errors=True)
    timings["total"] = time.perf_counter() - t0
    model_entries = [ModelEntry(i, n, keys[i], p, formats[i], stored[i]) for i, (n, p, _) in enumerate(entries)]
    return UniverseResult(
        bound=bound, models=model_entries, start=start, merged=merged, records=records, history=history,
        rounds=done_rounds, converged=converged, timings=timings, executor=executor.name,
        jobs=int(getattr(executor, "jobs", 1)), dtype=cfg.dtype, groups=_mode_text(modes), aligned=aligned,
        canonical_model=canonical_model, reference=reference, workdir=work if keep else None, resumed=resumed,
        max_in_flight=executor.max_in_flight,
    )


def _distance(bound: Any, a: Mapping[str, torch.Tensor], b: Mapping[str, torch.Tensor]) -> float:
    """sum over the bound parameters of ||a - b||^2 (||a||^2 for a missing b), in float64."""
    return math.fsum(float((a[p].double() - b[p].double()).square().sum()) if p in b else float(a[p].double().square().sum())
                     for p in bound.problem.params)


def _raise_failures(failures: list[Result], phase: str, work: Path, temporary: bool) -> None:
    if not failures:
        return
    failures = sorted(failures, key=lambda f: f["index"])
    lines = [f"  {f['error']}" if str(f["error"]).startswith(f["name"]) else f"  {f['name']}: {f['error']}" for f in failures]
    if all(f.get("input") for f in failures) and phase == "loading":
        head = f"{len(failures)} model(s) cannot be matched:"
    else:
        head = f"{len(failures)} model(s) failed in {phase}:"
    tail = "" if temporary or phase == "loading" else f"\n  the other models' results are kept in {work}; rerun the same command to resume"
    raise WorkerError("\n".join([head, *lines]) + tail, failures)


def transform_between(records: Sequence[TransformRecord], source: int, target: int) -> TransformRecord:
    """``g_target^-1 g_source`` from universe records (see :meth:`UniverseResult.transform`)."""
    ri, rj = records[source], records[target]
    elements = {}
    for s, gi in ri.elements.items():
        group = ri.group(s)
        elements[s] = group.compose(group.inverse(rj.elements[s]), gi)
    return TransformRecord(ri.spec, dict(ri.groups), elements, list(ri.canonical), dict(ri.searched),
                           {"method": "universe", "from": source, "to": target})


# --------------------------------------------------------------------------- a pair aligner


def align_universe(model_a: torch.nn.Module, model_b: torch.nn.Module, *, spec: Any = None,
                   device: str | torch.device = "cpu", **kw: Any) -> Any:
    """An aligner for the barrier analyzers: both models aligned into their universe.

    ``symspec.analyzers.barrier.register_aligner("universe", align_universe, "universe
    matching")`` makes it a method of ``symspec barrier``'s machinery and of the paper-table
    benchmark. The path from aligned A to aligned B passes through the merged model at
    λ = 1/2. ``kw`` goes to :func:`universe_match` (``rounds``, ``groups``, ``jobs``, ...).
    """
    from .analyzers.barrier import Aligned

    if spec is None:
        raise UniverseError("universe matching needs a spec (--spec, the model file's SPEC, or a built-in spec)")
    start = time.perf_counter()
    res = universe_match([model_a, model_b], spec, device=str(device), **kw)
    if res.canonical_model is None or res.aligned is None:
        raise UniverseError("universe matching of two modules returned no canonical module")
    info = {"objective": res.history, "rounds": len(res.rounds), "converged": res.converged, "groups": res.groups}
    return Aligned(res.canonical_model, res.aligned[0], res.aligned[1], time.perf_counter() - start, info)


# --------------------------------------------------------------------------- the report

SCHEMA_ID = "symspec.universe/1"


def build_report(result: UniverseResult, analysis: Any = None, *, seconds: float | None = None) -> dict[str, Any]:
    """The JSON report (schema :data:`SCHEMA_ID`, :func:`report_schema`; docs/universe.md):
    :meth:`UniverseResult.summary` plus ``analysis`` (a
    :class:`~symspec.analyzers.simplex.MergeAnalysis`, or None)."""
    from . import __version__

    doc: dict[str, Any] = {"schema": SCHEMA_ID, "symspec_version": __version__}
    doc.update(result.summary())
    doc["analysis"] = analysis.to_dict() if analysis is not None else None
    doc["seconds"] = result.timings.get("total", 0.0) if seconds is None else seconds
    return json_safe(doc)


def report_schema() -> dict[str, Any]:
    """JSON Schema of :func:`build_report`'s document (with ``outputs`` as
    :func:`save_outputs` writes it)."""
    from .analyzers.simplex import ANALYSIS_SCHEMA

    num = {"oneOf": [{"type": "number"}, {"enum": ["inf", "-inf", "nan"]}]}
    nums = {"type": "array", "items": num}
    model = {"type": "object", "required": ["name", "before", "after", "match_rounds", "seconds"],
             "properties": {"name": {"type": "string"}, "before": num, "after": num,
                            "match_rounds": {"type": ["integer", "null"]}, "seconds": {"type": ["number", "null"]}}}
    return {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "title": "symspec universe report",
        "type": "object",
        "required": ["schema", "symspec_version", "spec", "groups", "start", "models", "rounds", "converged", "objective",
                     "relative_objective", "per_round", "executor", "jobs", "dtype", "resumed_tasks", "timings",
                     "analysis", "seconds"],
        "properties": {
            "schema": {"const": SCHEMA_ID},
            "symspec_version": {"type": "string"},
            "spec": {"type": "string"},
            "groups": {"type": "string"},
            "start": {"type": "string"},
            "models": {"type": "array", "minItems": 2, "items": {
                "type": "object", "required": ["index", "name", "key", "format", "distance_before", "distance_after"],
                "properties": {"index": {"type": "integer", "minimum": 0}, "name": {"type": "string"},
                               "key": {"type": "string"}, "format": {"type": "string"},
                               "distance_before": num, "distance_after": num}}},
            "rounds": {"type": "integer", "minimum": 1},
            "converged": {"type": "boolean"},
            "objective": {**nums, "minItems": 2},
            "relative_objective": nums,
            "per_round": {"type": "array", "items": {
                "type": "object",
                "required": ["round", "objective", "target_objective", "universe_change", "floor", "seconds", "models"],
                "properties": {"round": {"type": "integer", "minimum": 1}, "objective": num, "target_objective": num,
                               "universe_change": num, "floor": num, "seconds": {"type": "number", "minimum": 0},
                               "models": {"type": "array", "items": model}}}},
            "executor": {"enum": ["inline", "processes", "ray"]},
            "jobs": {"type": "integer", "minimum": 1},
            "dtype": {"type": "string"},
            "resumed_tasks": {"type": "integer", "minimum": 0},
            "timings": {"type": "object", "additionalProperties": {"type": "number"}},
            "analysis": {"oneOf": [ANALYSIS_SCHEMA, {"type": "null"}]},
            "seconds": {"type": "number", "minimum": 0},
            "outputs": {"type": "object", "required": ["merged", "aligned", "transforms", "report"],
                        "properties": {"merged": {"type": "string"},
                                       "aligned": {"type": "array", "items": {"type": "string"}},
                                       "transforms": {"type": "array", "items": {"type": "string"}},
                                       "report": {"type": "string"}}},
        },
    }


# --------------------------------------------------------------------------- outputs

_SUFFIX = {"safetensors": ".safetensors", "modelfile": ".pt", "state_dict": ".pt"}


def output_name(entry: ModelEntry | None, fmt: str, stem: str) -> str:
    """``stem`` with the extension of the model's format (a folder for Hugging Face)."""
    if fmt == "hf":
        return stem
    if fmt == "state_dict" and entry is not None and entry.path is not None and Path(entry.path).suffix in (".pt", ".pth", ".bin", ".ckpt"):
        return stem + Path(entry.path).suffix
    return stem + _SUFFIX.get(fmt, ".pt")


def save_outputs(result: UniverseResult, out: str | Path, *, report: Mapping[str, Any] | None = None,
                 overwrite: bool = False, extra: Callable[[Path], None] | None = None,
                 extra_outputs: Mapping[str, str] | None = None) -> dict[str, Any]:
    """Write the run into the folder ``out``, atomically (staged next to it, renamed into
    place when complete; see :func:`symspec.outputs.publish`):

    - ``merged{.pt,.safetensors,/}``: the universe, in the reference's class and format;
    - ``aligned/{key}{ext}``: each model aligned into the universe, in its own format;
    - ``transforms/{key}/transform.{safetensors,json}``: each model's transform record;
    - ``report.json``: ``report`` (default: :meth:`UniverseResult.summary`).

    ``extra(folder)`` may add files before the rename (``extra_outputs``: their names,
    listed in the report). Returns the written paths (final names), which the report's
    ``outputs`` lists too. A write that fails (a full disk) raises one
    :class:`~symspec.errors.SymspecInputError` line and leaves nothing behind.
    """
    from .loading import LoadedModel, save_model

    out = Path(out)
    if os.path.lexists(out) and not overwrite:
        raise UniverseError(f"{out} exists; refusing to overwrite it (use --overwrite)")
    module = result.canonical_model if result.canonical_model is not None else torch.nn.Module()
    written: dict[str, Any] = {"aligned": [], "transforms": []}

    def stored(entry: ModelEntry, sd: Mapping[str, torch.Tensor]) -> dict[str, torch.dtype] | None:
        # every floating-point tensor in the dtype the model was stored in (the universe
        # works in float32 for float16/bfloat16 models)
        dt = getattr(torch, entry.dtype, None) if entry.dtype else None
        return {k: dt for k, v in sd.items() if v.is_floating_point()} if isinstance(dt, torch.dtype) else None

    def fill(tmp: Path) -> None:
        ref_entry = result.models[result.start]
        ref_fmt = result.reference.format if result.reference is not None else ref_entry.format
        name = output_name(ref_entry, ref_fmt, "merged")
        save_model(LoadedModel(module, Path(ref_entry.path or "merged"), ref_fmt, dtypes=stored(ref_entry, result.merged)),
                   result.merged, tmp / name, model=module)
        written["merged"] = str(out / name)
        (tmp / "aligned").mkdir()
        for m in result.models:
            fmt = m.format if (m.format != "hf" or result.canonical_model is not None) else "state_dict"
            aname = output_name(m, fmt, m.key)
            state = result.aligned_state(m.index)
            save_model(LoadedModel(module, Path(m.path or m.key), fmt, dtypes=stored(m, state)), state,
                       tmp / "aligned" / aname, model=module)
            written["aligned"].append(str(out / "aligned" / aname))
            result.records[m.index].save(tmp / "transforms" / m.key)
            written["transforms"].append(str(out / "transforms" / m.key))
        written["report"] = str(out / "report.json")
        written.update({k: str(out / v) for k, v in (extra_outputs or {}).items()})
        doc = dict(report) if report is not None else result.summary()
        doc["outputs"] = written
        write_json(tmp / "report.json", doc)
        if extra is not None:
            extra(tmp)

    publish([(Target(out, "--out", folder=True), fill)], force=overwrite, flag="--overwrite")
    return written


__all__ = [
    "SCHEMA_ID",
    "ModelEntry",
    "UniverseError",
    "UniverseEvent",
    "UniverseResult",
    "WorkerError",
    "align_universe",
    "build_report",
    "expand_models",
    "report_schema",
    "save_outputs",
    "transform_between",
    "universe_match",
]
