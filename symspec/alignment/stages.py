"""The stages of :func:`symspec.align`, in order: bind both models and check that they fit
one problem (:func:`bind_and_check`), bring them into canonical form
(:func:`canonicalize`), restrict the searched groups (:func:`restrict`), give the method
its endpoints (:func:`endpoints`), embed its elements back into the spec's groups
(:func:`embed_elements`), transform B (:func:`transform_b`) and record it
(:func:`record`). Extensions add stages before and after (:mod:`.hooks`)."""

from __future__ import annotations

import weakref
from collections import Counter
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import attrs
import torch

from ..binding import BoundSpec, bind
from ..errors import SymspecInputError
from ..groups import Element
from ..problem import Problem
from ..record import TransformRecord
from ..solvers import Timer, embed, parse_restriction, restrict_problem
from ..spec import load_spec
from ..spec.model import Spec
from ..statedict import (
    check_finite,
    detached_state,
    element_to_cpu,
    mapped_from_file,
    release_file_pages,
    widen,
)
from ..transforms import apply_elements, canonicalize_state_dict
from .protocol import Alignment, Endpoint, Method
from .result import canonical_module, mode_text

ModelLike = torch.nn.Module | Mapping[str, torch.Tensor]


def check_same_problem(ba: BoundSpec, bb: BoundSpec) -> None:
    """Two bindings of one spec that must describe the same problem (same spaces, groups
    and parameter shapes)."""
    problems = ba.problem.differences(bb.problem, "in A", "in B")
    if problems:
        more = f" (and {len(problems) - 5} more)" if len(problems) > 5 else ""
        raise SymspecInputError(f"A and B do not fit one spec '{ba.spec.name}': " + "; ".join(problems[:5]) + more)


def resolve_spec(spec: Spec | BoundSpec | str | Path) -> Spec | BoundSpec:
    return spec if isinstance(spec, (Spec, BoundSpec)) else load_spec(spec)


@attrs.define
class Pair:
    """The two models on their way through the pipeline."""

    bound_a: BoundSpec
    bound_b: BoundSpec
    raw_a: dict[str, torch.Tensor]
    raw_b: dict[str, torch.Tensor]
    a: dict[str, torch.Tensor] = attrs.field(factory=dict)
    b: dict[str, torch.Tensor] = attrs.field(factory=dict)


def bind_and_check(model_a: ModelLike, model_b: ModelLike, spec: Spec | BoundSpec | str | Path,
                    config: Any, timer: Timer) -> Pair:
    with timer("bind"):
        spec_obj = resolve_spec(spec)
        bound_a = spec_obj if isinstance(spec_obj, BoundSpec) else bind(spec_obj, model_a, config=config)
        bound_b = bind(bound_a.spec, model_b, config=config)
        check_same_problem(bound_a, bound_b)
    pair = Pair(bound_a, bound_b, detached_state(model_a), detached_state(model_b))
    with timer("check"):
        check_finite(pair.raw_a, "A")
        check_finite(pair.raw_b, "B")
    # the check read every page of a checkpoint mapped from its file: give them back until
    # each entry is copied (clean file pages, read again when touched)
    release_file_pages(pair.raw_a.values())
    release_file_pages(pair.raw_b.values())
    return pair


def canonicalize(pair: Pair, method: Method, timer: Timer, force: bool = False, own_b: bool = False) -> None:
    """Both models in canonical form, float16/bfloat16 widened to float32 (they come back
    in their own dtype); a method that works on raw weights gets them widened only (unless
    ``force``: B was lifted, and a lift writes canonical form). One model at a time, and
    a widened entry a step rewrites is let go as soon as it is replaced, so a model's
    working copy is held once. ``own_b``: the method will replace B's working copy entry
    by entry, so what is still a view of B's mapped checkpoint becomes a copy of its own
    (the file's pages given back), freed as the method replaces it."""
    if not method.canonical and not force:
        pair.a, pair.b = widen(pair.raw_a), widen(pair.raw_b)
        return
    pair.a = _canonical(pair.bound_a, pair.raw_a, timer, "A")
    pair.b = _canonical(pair.bound_b, pair.raw_b, timer, "B")
    if own_b:
        mapped = mapped_from_file(pair.b.values())
        for k, v in pair.b.items():
            if id(v) in mapped:
                pair.b[k] = v.clone()
                release_file_pages([v])


def _canonical(bound: BoundSpec, raw: Mapping[str, torch.Tensor], timer: Timer, which: str) -> dict[str, torch.Tensor]:
    work: dict[str, torch.Tensor] = {}
    copied: list[torch.Tensor] = []
    for k, v in raw.items():  # widened entry by entry, mapped pages given back every 64 MiB copied
        work[k] = widen({k: v})[k]
        if work[k] is not v:
            copied.append(v)
        if sum(t.nbytes for t in copied) >= 1 << 26:
            release_file_pages(copied)
            copied.clear()
    release_file_pages(copied)
    # weak references: which entries the steps rewrote, without keeping the old ones alive
    given = {k: weakref.ref(v) for k, v in work.items()}
    with timer("canonicalize"):
        sd = canonicalize_state_dict(bound, work, in_place=True)
    with timer("check"):
        # the entries canonicalisation rewrote (a finite model can overflow when folded)
        check_finite({k: v for k, v in sd.items() if k not in given or given[k]() is not v}, f"{which} (canonical form)")
    # a checkpoint mapped from its file: the pages of what now has a working copy go back
    # (clean file pages, read again if touched; the caller's values are not changed)
    kept = {id(v) for v in sd.values()}
    release_file_pages(v for v in raw.values() if id(v) not in kept)
    return sd


def endpoints(pair: Pair, method: Method, model_a: ModelLike, model_b: ModelLike) -> tuple[Endpoint, Endpoint]:
    if not method.needs_module:
        return Endpoint(pair.a), Endpoint(pair.b)
    if not isinstance(model_a, torch.nn.Module) or not isinstance(model_b, torch.nn.Module):
        raise SymspecInputError(f"the method '{method.name}' runs the models: pass modules, not state dicts")
    # the modules share the working weights: a method runs them with weights it passes
    return (Endpoint(pair.a, canonical_module(pair.bound_a, model_a, pair.a, canonical=method.canonical, share=True)),
            Endpoint(pair.b, canonical_module(pair.bound_b, model_b, pair.b, canonical=method.canonical, share=True)))


def restrict(problem: Problem, groups: str | Mapping[str, str] | None) -> tuple[dict[str, str], Problem]:
    """The searched group per space (``groups``: :mod:`symspec.solvers.engine.restrict`)
    and the problem over them."""
    modes = parse_restriction(groups, problem)
    return modes, restrict_problem(problem, modes)


def embed_elements(problem: Problem, searched: Problem, found: Alignment, dtype: torch.dtype) -> dict[str, Element]:
    """The method's elements (in the searched groups) as elements of the spec's groups, on
    the CPU beside the weights they act on (a method may have run on a GPU)."""
    return {s: element_to_cpu(embed(problem.spaces[s].group, searched.spaces[s].group, e, dtype))
            for s, e in found.elements.items()}


def transform_b(pair: Pair, found: Alignment, elements: Mapping[str, Element]) -> dict[str, torch.Tensor]:
    """B transformed by ``elements``: from the tensors the method already transformed when
    it did (one per tie), else by applying the elements to canonical B."""
    problem = pair.bound_a.problem
    if found.aligned is None:
        return apply_elements(problem, {s: element_to_cpu(e) for s, e in elements.items()}, pair.b)
    aligned = dict(pair.b)  # what is left: the entries no space acts on
    tie_of = {n: g for g in problem.ties for n in g}
    done = dict(found.aligned)
    reps = {name: next(n for n in tie_of.get(name, (name,)) if n in done) for name in problem.params}
    left = Counter(reps.values())
    found.aligned = None
    for name, rep in reps.items():
        aligned[name] = done[rep].to(device=pair.raw_b[name].device, dtype=pair.raw_b[name].dtype)
        left[rep] -= 1
        if not left[rep]:  # its last name: the working copy goes as its stored one comes
            del done[rep]
    return aligned


def record(bound: BoundSpec, method: Method, elements: Mapping[str, Element], searched: Mapping[str, str],
            found: Alignment, modes: Mapping[str, str], work_dtype: torch.dtype) -> TransformRecord:
    meta = {"method": method.name, "objective": found.history, "rounds": max(len(found.history) - 1, 0),
            "converged": found.converged, "groups": mode_text(modes),
            "dtype": str(work_dtype).removeprefix("torch."), **found.info}
    return TransformRecord.of(bound, elements, canonical=method.canonical, searched=searched, meta=meta)


