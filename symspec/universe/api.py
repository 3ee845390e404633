"""The entry points of universe matching.

- :func:`universe_match`: models given as files, modules or state dicts, under a spec:
  loaded, checked and brought into canonical form (``prepare`` tasks), then the rounds;
  the result holds a transform record per model and what the outputs need;
- :func:`state_universe`: canonical state dicts under a (restricted) problem, in this
  process: what the ``universe`` alignment method runs on a pair.

>>> import symspec.universe as U  # doctest: +SKIP
>>> res = U.universe_match(["seed0.pt", "seed1.pt", "seed2.pt"], "nanogpt", factory="model.py", jobs=2)  # doctest: +SKIP
>>> res.history          # sum_i ||U - g_i·θ_i||^2 before the first round, then after each  # doctest: +SKIP
>>> res.merged           # the universe: a canonical state dict of the reference's class  # doctest: +SKIP
>>> res.transform(0, 2)  # g_2^-1 g_0: model 0 aligned to model 2, through the universe  # doctest: +SKIP
"""

from __future__ import annotations

import hashlib
import time
import types
from collections.abc import Mapping, Sequence
from contextlib import closing
from pathlib import Path
from typing import Any

import attrs
import torch

from .._version import __version__
from ..alignment import get_method, mode_text
from ..binding import bind
from ..errors import SymspecInputError
from ..learned.method import LearnedMatching, as_options
from ..loading import source_dtype
from ..record import TransformRecord
from ..runtime import InlineExecutor, make_executor
from ..solvers import restrict_problem
from ..spec.load import dump_spec
from ..statedict import check_finite, working_dtype
from .algorithm import RoundLog, Run, iterate
from .errors import UniverseError, raise_failures
from .inputs import (
    Reference,
    Source,
    fingerprint,
    fingerprint_path,
    load_reference,
    model_keys,
    model_sources,
    module_of,
    start_index,
    state_of,
)
from .learned import refine
from .method import UniverseMatching
from .progress import Progress, UniverseEvent, quiet
from .result import ModelEntry, StateUniverse, UniverseResult
from .tasks import (
    RunConfig,
    Task,
    architecture_error,
    prepare_state,
    signature_differences,
    state_signature,
)
from .workdir import (
    PREPARED_FIELDS,
    WorkFolder,
    check_paths,
    deepest_paths,
    load_elements,
    load_tensors,
    save_tensors,
    write_json,
)

#: the work folder's layout version (a folder of another version starts over)
STATE_VERSION = 1


def _check_arguments(n: int, rounds: int, jobs: int | None) -> None:
    if rounds < 1:
        raise UniverseError(f"rounds must be at least 1, got {rounds}")
    if jobs is not None and jobs < 1:
        raise UniverseError(f"jobs must be at least 1, got {jobs}")
    if n < 2:
        raise UniverseError(f"universe matching needs at least 2 models, got {n}")


def round_method(name: str, data: Any = None) -> Any:
    """The registered alignment method every round runs, checked: not universe matching
    itself, and with data when it needs some."""
    m = get_method(name)
    if isinstance(m, UniverseMatching):
        raise UniverseError(f"universe matching cannot align with '{m.name}' (universe matching itself)")
    if m.needs_data and data is None:
        raise UniverseError(f"the method '{m.name}' needs data (pass data=, or --data on the command line)")
    return m


#: the batches of the data a data-driven method reads in every alignment
ALIGN_BATCHES = 32


def _align_inputs(m: Any, ref: Reference, source: Source, data: Any) -> dict[str, Any]:
    """What a method needs in every task (pickled once per run): the reference's module
    (or the file each worker loads it from) and the data."""
    out: dict[str, Any] = {}
    if m.needs_module:
        if ref.canonical_model is None:
            raise UniverseError(f"the method '{m.name}' runs the models: pass modules, model files or folders "
                                "(not state dicts)")
        out = {"module_source": source.path} if source.path is not None else {"module": ref.canonical_model}
    if not m.needs_data:
        return out
    batches = list(getattr(data, "batches", None) or [])[:ALIGN_BATCHES]
    if not batches:
        raise UniverseError("the data has no batches to align on")
    # a method that scores its result (auto) needs the loss too; the others only the batches
    scored = {"loss": data.loss} if getattr(m, "validates", False) and getattr(data, "loss", None) is not None else {}
    return out | {"data": types.SimpleNamespace(batches=batches, **scored)}


def _data_digest(data: Any) -> str | None:
    """A digest of the batches (a resumed run must align on the same data)."""
    if data is None:
        return None
    h = hashlib.sha256()
    for x, _ in data.batches:
        for leaf in torch.utils._pytree.tree_leaves(x):
            if isinstance(leaf, torch.Tensor):
                h.update(str((tuple(leaf.shape), leaf.dtype)).encode())
                h.update(leaf.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
            else:
                h.update(repr(leaf).encode())
    return h.hexdigest()


# --------------------------------------------------------------------------- models, spec


def universe_match(models: Sequence[Any], spec: Any, *, rounds: int = 10, tol: float = 1e-4,
                   groups: str | Mapping[str, str] | None = None, method: str = "weight", jobs: int | None = None,
                   ray: str | None = None, device: str = "cpu", dtype: torch.dtype | None = None,
                   start: int | str = 0, factory: str | Path | None = None, config: Any = None,
                   workdir: str | Path | None = None, resume: bool = True, progress: Progress | None = None,
                   match_rounds: int = 10, match_tol: float = 1e-6, max_iter: int = 10, threads: int = 1,
                   worker_setup: str | None = None, load_aligned: bool = True, keep_workdir: bool | None = None,
                   ray_retries: int = 0, data: Any = None, validation: Any = None,
                   options: Any = None) -> UniverseResult:
    """Universe matching of ``models`` under ``spec``.

    ``models``: paths (model files, Hugging Face folders, checkpoints with ``factory``),
    modules, :class:`~symspec.loading.LoadedModel` objects, or state dicts (with
    ``config`` for the spec's dimensions), at least two, all of one architecture.
    ``spec``: a Spec, a BoundSpec, a path or a built-in name. ``groups``: as in
    :func:`symspec.align` (``"perm"``, ``"full"``, ``"perm,attn=full"``; default: the
    method's own, ``"full"`` for most). ``method``: the
    registered alignment method that aligns each model onto the universe in every round
    (:func:`symspec.alignment.method_names`); a data-driven one reads the first
    :data:`ALIGN_BATCHES` batches of ``data`` (an object with ``batches``, the train
    split) and runs the reference's module with the universe's and each model's weights. ``rounds``/``tol``: at most
    ``rounds`` rounds, fewer once a round improves the objective by less than ``tol``
    (relative). ``start``: the model the universe starts from (index or name); it is
    also the reference whose class and format the merged model keeps. ``jobs``: worker
    processes (``None``/1: this process); with ``ray`` (``"local"``, ``"auto"``, an
    address), Ray tasks, ``jobs`` in flight (default: the cluster's CPUs). ``device``:
    where each alignment's dense work runs. ``dtype``: the working precision (default:
    the reference's). ``workdir``: keep the run's files there; an unfinished run in it
    is resumed when its inputs and settings are the same (``resume``).
    ``match_rounds``/``match_tol``/``max_iter``: each alignment's rounds, tolerance and
    Gauss-Newton steps. ``threads``: torch threads per alignment (the same in every
    executor, for identical results). ``worker_setup``: ``"module:function"`` called
    once in every worker process (register custom groups or alignment methods there: a
    method registered in this process only is known to ``jobs=1`` runs alone).

    ``method="learned"`` (or ``"learned-perm"``): the rounds are weight matching's (its
    permutations-only form for ``learned-perm``), then every model's element is refined
    for the loss of merged models with Dirichlet weights (:mod:`.learned`, the paper's
    §4.3) on ``data`` (the train split), validated on ``validation`` (the val split; None:
    a held-out tenth of ``data``); ``options``: a
    :class:`~symspec.learned.LearnedOptions` (steps, rate, ``dirichlet``, ...). The
    refined models are held in memory (``aligned``).
    """
    t0 = time.perf_counter()
    say = progress or quiet
    _check_arguments(len(models), rounds, jobs)
    m, refinement = _methods(method, data)
    sources = model_sources(models)
    names = [s.name for s in sources]
    start = start_index(start, names)
    if workdir is not None:  # before any work: files named longer than the system allows
        check_paths(workdir, deepest_paths(workdir, model_keys(names)))
    tick = time.perf_counter()
    ref = load_reference(sources[start], spec, factory=factory, config=config, dtype=dtype,
                         groups=groups if groups is not None else m.groups)
    cfg = RunConfig(problem=ref.bound.problem, modes=ref.modes, signature=state_signature(ref.canonical),
                    reference=ref.name, dtype=str(ref.dtype).removeprefix("torch."), spec=ref.bound.spec,
                    factory=str(factory) if factory else None, device=str(device), method=m.name,
                    match_rounds=match_rounds, match_tol=match_tol, max_iter=max_iter, threads=threads)
    cfg = attrs.evolve(cfg, **_align_inputs(m, ref, sources[start], data))
    timings = {"reference": time.perf_counter() - tick}
    folder = WorkFolder.open(workdir, _fingerprint(cfg, ref, sources, start), names, resume=resume,
                             keep=keep_workdir, say=say)
    with folder.session(), closing(make_executor(jobs, ray, worker_setup, device=str(device),
                                                 retries=ray_retries)) as executor:
        run = Run(folder, executor, folder.save_config(cfg), names, model_keys(names), start,
                  list(ref.bound.problem.params), ref.dtype, say, own_objective=own_objective(m))
        result = _run_rounds(run, sources, ref, cfg, config, rounds, tol, load_aligned, timings)
    if refinement is not None:
        _refine(result, refinement, ref, data, validation, options, device, say)
    timings["total"] = time.perf_counter() - t0
    return result


def own_objective(m: Any) -> bool:
    """Whether the rounds stop on ``m``'s own objective rather than on F: a method whose
    objective is not the squared weight distance (``objective_is_distance``: weight
    matching's is F before the universe moves) and that does not pick among candidates
    on validation data (``validates``: auto's models may each take another method, whose
    objectives do not add up)."""
    return not getattr(m, "objective_is_distance", False) and not getattr(m, "validates", False)


def _methods(name: str, data: Any) -> tuple[Any, Any]:
    """The method the rounds run, and learned matching's refinement after them (None for
    other methods): learned matching's rounds are weight matching's, its start."""
    m = round_method(name, data)
    if not isinstance(m, LearnedMatching):
        return m, None
    return get_method("weight-perm" if m.groups == "perm" else "weight"), m


def _run_rounds(run: Run, sources: Sequence[Source], ref: Reference, cfg: RunConfig, config: Any, rounds: int,
                tol: float, load_aligned: bool, timings: dict[str, float]) -> UniverseResult:
    """Prepare every model, run the rounds, record each model's transform: the result."""
    folder, executor = run.folder, run.executor
    tick = time.perf_counter()
    formats, stored = prepare_models(run, sources, ref, cfg, config)
    timings["prepare"] = time.perf_counter() - tick
    log, merged = iterate(run, rounds, tol)
    timings["rounds"] = log.seconds
    tick = time.perf_counter()
    records = _records(run, ref, cfg, log)
    last = len(log.rounds)
    aligned = [load_tensors(folder.aligned(last, k)) for k in run.keys] if load_aligned else None
    timings["records"] = time.perf_counter() - tick
    return UniverseResult(
        bound=ref.bound, models=[ModelEntry(i, s.name, run.keys[i], s.path, formats[i], stored[i]) for i, s in enumerate(sources)],
        start=run.start, merged=merged, records=records, history=log.history, rounds=log.rounds,
        converged=log.converged(tol, torch.finfo(ref.dtype).eps), timings=timings, executor=executor.name,
        jobs=int(executor.jobs), dtype=cfg.dtype, groups=mode_text(ref.modes), aligned=aligned,
        canonical_model=ref.canonical_model, reference=ref.loaded, workdir=folder.path if folder.keep else None,
        resumed=run.resumed, max_in_flight=executor.max_in_flight, method=cfg.method,
        converged_on=log.converged_on,
    )


def _refine(result: UniverseResult, refinement: Any, ref: Reference, data: Any, validation: Any, options: Any,
            device: str, say: Progress) -> None:
    """Learned matching's refinement of every model's element (:mod:`.learned`), in place."""
    tick = time.perf_counter()
    say(UniverseEvent("note", message="learned refinement"))

    def stepped(ev: Any) -> None:
        say(UniverseEvent("learn", round=ev.round, rounds=ev.rounds, done=ev.done, total=ev.total,
                          objective=ev.objective))

    result.refinement = refine(result, ref.modes, data, validation, as_options(options, refinement.permutations),
                               device=device, progress=stepped)
    result.method = refinement.name
    result.timings["refine"] = time.perf_counter() - tick


def _fingerprint(cfg: RunConfig, ref: Reference, sources: Sequence[Source], start: int) -> dict[str, Any]:
    """What a resumed run must share with the run that left the work folder."""
    return {
        "version": STATE_VERSION, "symspec": __version__, "spec": dump_spec(ref.bound.spec),
        "groups": mode_text(ref.modes), "start": start, "dtype": cfg.dtype, "device": cfg.device, "method": cfg.method,
        "match": [cfg.match_rounds, cfg.match_tol, cfg.max_iter, cfg.threads], "data": _data_digest(cfg.data),
        "factory": fingerprint_path(Path(cfg.factory)) if cfg.factory else None,
        "models": [fingerprint(s) for s in sources],
    }


def prepare_models(run: Run, sources: Sequence[Source], ref: Reference, cfg: RunConfig,
                   config: Any) -> tuple[list[str], list[str | None]]:
    """Every model in canonical form in the work folder, checked against the reference:
    the start model and the models given in memory here, the files by ``prepare``
    tasks. Returns each model's format and stored dtype (its outputs are written so)."""
    folder = run.folder
    formats: list[str] = ["state_dict"] * run.n
    stored: list[str | None] = [None] * run.n
    count = 0

    def prepared(i: int, meta: Mapping[str, Any]) -> None:
        nonlocal count
        count += 1
        formats[i] = str(meta.get("format", "state_dict"))
        stored[i] = meta.get("dtype") or None
        run.say(UniverseEvent("prepare", done=count, total=run.n, name=run.names[i]))

    tasks: list[Task] = []
    for i, source in enumerate(sources):
        key = run.keys[i]
        marker = folder.canonical_marker(key)
        done = folder.finished(marker, [folder.canonical(key)], PREPARED_FIELDS)
        if done is not None:
            run.resumed += 1
            prepared(i, done)
        elif source.path is not None and i != run.start:
            tasks.append(Task("prepare", i, source.name, run.config, source=source.path,
                              canonical=str(folder.canonical(key)), done=str(marker)))
        else:
            meta = _prepare_here(i == run.start, source, ref, cfg, config, folder.canonical(key))
            write_json(marker, meta)
            prepared(i, meta)
    failures: list[dict[str, Any]] = []

    def on_done(task: Task, res: dict[str, Any]) -> None:
        if res.get("ok"):
            prepared(task.index, res)
        else:
            failures.append(res)

    run.executor.run(tasks, on_done)
    raise_failures(failures, "loading", folder.path, folder.temporary)
    return formats, stored


def _prepare_here(is_start: bool, source: Source, ref: Reference, cfg: RunConfig, config: Any,
                  target: Path) -> dict[str, Any]:
    """Write the start model's or an in-memory model's canonical form; its marker's meta."""
    if is_start:
        save_tensors(target, ref.canonical)
        return {"ok": True, "format": ref.loaded.format if ref.loaded is not None else "state_dict",
                "dtype": source_dtype(ref.loaded if ref.loaded is not None else ref.state)}
    save_tensors(target, _canonical_in_memory(source, ref, cfg, config))
    return {"ok": True, "format": getattr(source.obj, "format", "state_dict"), "dtype": source_dtype(source.obj)}


def _canonical_in_memory(source: Source, ref: Reference, cfg: RunConfig, config: Any) -> dict[str, torch.Tensor]:
    other, state = module_of(source.obj), state_of(source.obj)
    if other is None and config is None:
        # a bare state dict: it has the reference's binding if it has its tensors
        problems = signature_differences(state_signature(ref.state), state_signature(state))
        if problems:
            raise architecture_error(source.name, ref.name, problems)
        bound = ref.bound
    else:
        try:
            bound = bind(ref.bound.spec, other if other is not None else state, config=config)
        except SymspecInputError as e:
            raise UniverseError(f"{source.name}: {e}") from e
    try:
        return prepare_state(cfg, source.name, state, bound)
    except UniverseError:
        raise
    except SymspecInputError as e:
        raise UniverseError(f"{source.name}: {e}") from e


def _records(run: Run, ref: Reference, cfg: RunConfig, log: RoundLog) -> list[TransformRecord]:
    """Each model's transform record into the universe (the spec's full groups)."""
    bound, last = ref.bound, len(log.rounds)
    searched = restrict_problem(bound.problem, ref.modes)
    searched_text = {s: str(searched.spaces[s].group) for s in bound.problem.spaces
                     if searched.spaces[s].group != bound.problem.spaces[s].group}
    records = []
    for i, name in enumerate(run.names):
        _, full = load_elements(run.folder.elements(last, run.keys[i]))
        info = log.rounds[-1]["models"][i]
        records.append(TransformRecord.of(
            bound, full, searched=searched_text,
            meta={"method": "universe", "model": name, "index": i, "round": last, "distance_before": info["before"],
                  "distance_after": info["after"], "objective": log.history, "groups": mode_text(ref.modes),
                  "dtype": cfg.dtype, "alignment": cfg.method},
        ))
    return records


# --------------------------------------------------------------------------- canonical states, a problem


def state_universe(problem: Any, states: Sequence[Mapping[str, torch.Tensor]], *, method: str = "weight",
                   rounds: int = 10, tol: float = 1e-4, start: int = 0, device: str | torch.device = "cpu",
                   dtype: torch.dtype | None = None, match_rounds: int = 10, match_tol: float = 1e-6,
                   max_iter: int = 10, threads: int = 1, progress: Progress | None = None) -> StateUniverse:
    """Universe matching of canonical state dicts under ``problem`` (searched as it is:
    restrict it first for ``"perm"``), in this process, in a temporary work folder.

    The same rounds as :func:`universe_match` (see there for the arguments); the elements
    found are in ``problem``'s groups. ``dtype``: the working precision (default: the
    start model's; float32 for float16 and bfloat16).
    """
    say = progress or quiet
    _check_arguments(len(states), rounds, None)
    method = round_method(method).name
    names = [f"model{i}" for i in range(len(states))]
    start = start_index(start, names)
    first = states[start]
    work = dtype or next((working_dtype(first[p].dtype) for p in problem.params if first[p].is_floating_point()),
                         torch.float32)
    canonical = [{k: (v.detach().to(work) if v.is_floating_point() else v.detach()) for k, v in sd.items()} for sd in states]
    signature = state_signature(canonical[start])
    for name, sd in zip(names, canonical):
        check_finite(sd, name)
        problems = signature_differences(signature, state_signature(sd))
        if problems:
            raise architecture_error(name, names[start], problems)
    cfg = RunConfig(problem=problem, modes=dict.fromkeys(problem.spaces, "full"), signature=signature,
                    reference=names[start], dtype=str(work).removeprefix("torch."), device=str(device), method=method,
                    match_rounds=match_rounds, match_tol=match_tol, max_iter=max_iter, threads=threads)
    folder = WorkFolder.open(None, {}, names)
    with folder.session(), closing(InlineExecutor()) as executor:
        run = Run(folder, executor, folder.save_config(cfg), names, model_keys(names), start, list(problem.params),
                  work, say, own_objective=own_objective(get_method(method)))
        for key, sd in zip(run.keys, canonical):
            save_tensors(folder.canonical(key), sd)
        log, merged = iterate(run, rounds, tol)
        elements = [load_elements(folder.elements(len(log.rounds), k))[0] for k in run.keys]
    return StateUniverse(problem, merged, elements, log.history, log.rounds, log.converged(tol, torch.finfo(work).eps))


__all__ = ["STATE_VERSION", "round_method", "state_universe", "universe_match"]
