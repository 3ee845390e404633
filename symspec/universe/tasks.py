"""The per-model tasks of universe matching, run by any executor of :mod:`symspec.runtime`.

- ``prepare``: load a model from its source (model file, Hugging Face folder,
  checkpoint + factory), bind the spec, check that it has the reference's architecture,
  bring it into canonical form and write it;
- ``align``: read a canonical model, the current universe and the model's element of
  the previous round (the warm start), align the model onto the universe with the run's
  registered alignment method (:mod:`symspec.alignment`), and write the aligned model
  and its elements.

A task talks to the parent only through files in the work folder
(:mod:`.workdir`) and a small JSON-able result, which it also writes as its marker,
last: a task whose marker exists is complete.
"""

from __future__ import annotations

import functools
import os
import pickle
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import attrs
import torch

from .. import loading
from ..alignment import AlignOptions, Endpoint, get_method
from ..binding import bind
from ..errors import SymspecInputError
from ..loading import source_dtype
from ..runtime import Result, torch_threads
from ..solvers import WeightOptions, embed, restrict_problem
from ..statedict import check_finite, element_to_cpu, squared_distance, widen
from ..transforms import apply_elements, canonicalize_model, canonicalize_state_dict
from .errors import UniverseError
from .workdir import load_elements, load_tensors, save_elements, save_tensors, write_json

#: a canonical state's tensors: name -> (shape, dtype, floating)
Signature = dict[str, tuple[tuple[int, ...], str, bool]]


@attrs.frozen
class RunConfig:
    """What every task of a run needs besides its own files (pickled once per run).

    ``problem``: the reference's problem (the spec's groups); ``modes``: the searched
    restriction per space; ``spec``: what a prepare task binds a loaded model to (None
    when the run starts from canonical state dicts); ``method``: the registered
    alignment method each align task runs; ``match_rounds``/``match_tol``/``max_iter``:
    its rounds, tolerance and Gauss-Newton steps; ``threads``: torch threads per task.
    ``module``: the reference in canonical form, for methods that run the models (each
    round runs it with the universe's and with each model's weights), or
    ``module_source``, where each worker loads it from; ``data``: the batches a
    data-driven method aligns on."""

    problem: Any  # symspec.problem.Problem
    modes: dict[str, str]  # space -> "full" | "perm" | "fixed"
    signature: Signature
    reference: str
    dtype: str
    spec: Any = None  # symspec.spec.Spec
    factory: str | None = None
    device: str = "cpu"
    method: str = "weight"
    match_rounds: int = 10
    match_tol: float = 1e-6
    max_iter: int = 10
    threads: int = 1
    module: Any = None  # torch.nn.Module (a reference given in memory)
    module_source: str | None = None  # else the reference's file or folder, loaded once per worker
    data: Any = None  # an object with ``batches``


@attrs.frozen
class Task:
    """One unit of work; every path is a file in the run's work folder (or a model source)."""

    kind: str  # "prepare" | "align"
    index: int
    name: str
    config: str  # the pickled RunConfig
    source: str = ""  # prepare: the model to load
    canonical: str = ""  # prepare: written; align: read
    universe: str = ""
    init: str = ""  # align: the previous round's elements ("" = start from the identity)
    aligned: str = ""
    elements: str = ""
    done: str = ""  # the result as JSON, written last

    def run(self) -> Result:
        start = time.perf_counter()
        cfg, searched = load_config(self.config)
        with torch_threads(cfg.threads):
            result = (prepare if self.kind == "prepare" else align)(self, cfg, searched)
        result.update(ok=True, index=self.index, name=self.name, seconds=time.perf_counter() - start, pid=os.getpid())
        write_json(self.done, result)
        return result


_CONFIGS: dict[tuple[str, int], tuple[RunConfig, Any]] = {}


def load_config(path: str) -> tuple[RunConfig, Any]:
    """The run's config and its searched (restricted) problem, cached per process."""
    key = (path, Path(path).stat().st_mtime_ns)
    if key not in _CONFIGS:
        with open(path, "rb") as f:
            cfg: RunConfig = pickle.load(f)
        _CONFIGS.clear()
        _CONFIGS[key] = (cfg, restrict_problem(cfg.problem, cfg.modes))
    return _CONFIGS[key]


# --------------------------------------------------------------------------- architecture checks


def state_signature(sd: Mapping[str, torch.Tensor]) -> Signature:
    return {k: (tuple(v.shape), str(v.dtype).removeprefix("torch."), bool(v.is_floating_point())) for k, v in sd.items()}


def signature_differences(ref: Signature, other: Signature) -> list[str]:
    """How ``other`` differs from ``ref``: missing, extra and reshaped tensors."""
    out = []
    for k in sorted(set(ref) | set(other)):
        if k not in other:
            out.append(f"{k} is missing")
        elif k not in ref:
            out.append(f"{k} is not in the reference")
        elif tuple(ref[k][0]) != tuple(other[k][0]) or ref[k][2] != other[k][2]:
            out.append(f"{k} has shape {list(other[k][0])} ({other[k][1]}) here but {list(ref[k][0])} ({ref[k][1]}) in the reference")
    return out


def architecture_error(name: str, reference: str, problems: list[str]) -> UniverseError:
    more = f" (and {len(problems) - 5} more)" if len(problems) > 5 else ""
    return UniverseError(f"{name} does not share the architecture of {reference}: " + "; ".join(problems[:5]) + more)


# --------------------------------------------------------------------------- prepare


def prepare_state(cfg: RunConfig, name: str, state: Mapping[str, torch.Tensor], bound: Any) -> dict[str, torch.Tensor]:
    """Check a bound model against the reference and return its canonical state in the
    run's dtype (raises SymspecInputError naming the model)."""
    problems = bound.problem.differences(cfg.problem, "here", "in the reference")
    if problems:
        raise architecture_error(name, cfg.reference, problems)
    check_finite(state, name)
    canonical = canonicalize_state_dict(bound, widen(state))  # float16/bfloat16: in float32
    check_finite(canonical, f"{name} (canonical form)")
    dtype = getattr(torch, cfg.dtype)
    canonical = {k: (v.detach().to(dtype) if v.is_floating_point() else v.detach()) for k, v in canonical.items()}
    problems = signature_differences(cfg.signature, state_signature(canonical))
    if problems:
        raise architecture_error(name, cfg.reference, problems)
    return canonical


def prepare(task: Task, cfg: RunConfig, searched: Any) -> Result:
    try:
        loaded = loading.load_model(task.source, factory=cfg.factory)
        bound = bind(cfg.spec, loaded.model)
    except SymspecInputError as e:
        text = str(e)
        raise SymspecInputError(text if task.source in text else f"{task.name}: {text}") from e
    state = {k: v.detach() for k, v in loaded.model.state_dict().items()}
    canonical = prepare_state(cfg, task.name, state, bound)
    save_tensors(task.canonical, canonical)
    return {"format": loaded.format, "class": type(loaded.model).__name__, "dtype": source_dtype(loaded)}


# --------------------------------------------------------------------------- align


def alignment_method(name: str) -> Any:
    """The registered method ``name``; in a worker process that does not know it (it was
    registered in the parent only), an error that says how to register it there."""
    try:
        return get_method(name)
    except SymspecInputError:
        raise SymspecInputError(f"alignment method '{name}' is not registered in this worker process: register it "
                                "through an entry point (symspec.methods) or a setup hook (--setup, worker_setup=), "
                                "or run in one process (jobs=1)") from None


@functools.lru_cache(maxsize=1)
def _reference_module(source: str, factory: str | None, spec: Any, dtype: str) -> Any:
    """The reference model in canonical form, in the run's working dtype (its weights do
    not matter: methods run it with the states they are given, which are in that dtype;
    a bfloat16 folder's module would meet float32 states), loaded once per worker."""
    model = loading.load_model(source, factory=factory).model
    module = canonicalize_model(bind(spec, model), model).eval()
    work = getattr(torch, dtype)
    if any(p.is_floating_point() and p.dtype != work for p in module.parameters()):
        module = module.to(work)
    return module


def _module(cfg: RunConfig) -> Any:
    if cfg.module is not None or cfg.module_source is None:
        return cfg.module
    return _reference_module(cfg.module_source, cfg.factory, cfg.spec, cfg.dtype)


def align(task: Task, cfg: RunConfig, searched: Any) -> Result:
    problem = cfg.problem
    dtype = getattr(torch, cfg.dtype)
    theta = load_tensors(task.canonical)
    universe = load_tensors(task.universe)
    init = None
    start = theta
    if task.init:
        init, init_full = load_elements(task.init)
        start = apply_elements(problem, init_full, theta)
    before = squared_distance(universe, start, problem.params)
    del start
    options = AlignOptions(rounds=cfg.match_rounds, tol=cfg.match_tol, device=cfg.device, dtype=dtype, init=init,
                           data=cfg.data, tuning=WeightOptions(max_iter=cfg.max_iter, greedy_start=init is None))
    method = alignment_method(cfg.method)
    module = _module(cfg) if method.needs_module else None
    found = method.align(searched, Endpoint(universe, module), Endpoint(theta, module), options)
    elements = {s: element_to_cpu(e) for s, e in found.elements.items()}
    for s, si in searched.spaces.items():  # a space the method left out is the identity
        elements.setdefault(s, si.group.identity(dtype=dtype))
    full = {s: embed(problem.spaces[s].group, searched.spaces[s].group, e, dtype) for s, e in elements.items()}
    aligned = apply_elements(problem, full, theta)
    after = squared_distance(universe, aligned, problem.params)
    save_tensors(task.aligned, aligned)
    save_elements(task.elements, elements, full)
    return {"before": before, "after": after, "match_rounds": max(len(found.history) - 1, 0),
            "converged": found.converged, "match_objective": found.history}


__all__ = [
    "RunConfig",
    "Task",
    "align",
    "architecture_error",
    "load_config",
    "prepare",
    "prepare_state",
    "signature_differences",
    "state_signature",
]
