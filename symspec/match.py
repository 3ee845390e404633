"""Weight matching of two models under a spec: the high-level API.

>>> import symspec.match  # doctest: +SKIP
>>> res = symspec.match.weight_match(model_a, model_b, "nanogpt")  # doctest: +SKIP
>>> res.history  # the objective before the first round, then after each  # doctest: +SKIP
>>> merged = res.interpolate(0.5)  # doctest: +SKIP
>>> res.canonical_model.load_state_dict(merged)  # doctest: +SKIP

Both models are bound to the spec and brought into canonical form (norm gains folded,
residual writers mean-centred, ...); the solver (:mod:`symspec.solvers`) then finds the
element of every space that brings B closest to A in weight space, and B is transformed
by it. The result keeps the architecture: ``aligned_b`` loads into ``canonical_model``
(a copy of A's class in canonical form), as does any interpolation of the two.
"""

from __future__ import annotations

import copy
import itertools
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import attrs
import torch

from .binding import BoundSpec, bind
from .errors import SymspecInputError
from .groups import Element
from .record import TransformRecord
from .solvers import (
    MatchEvent,
    Timer,
    embed,
    match_weights,
    parse_restriction,
    restrict_problem,
    working_dtype,
)
from .solvers.weight import LOW_PRECISION, widen
from .spec.model import Spec
from .transforms import apply_elements, canonicalize_state_dict
from .transforms.canonical import untie_module

ModelLike = torch.nn.Module | Mapping[str, torch.Tensor]


@attrs.define
class MatchResult:
    """What :func:`weight_match` found.

    ``canonical_a`` and ``canonical_b``: both state dicts in canonical form;
    ``aligned_b``: canonical B transformed by ``elements`` (one element per space, in the
    spec's groups); ``record``: the same as a :class:`~symspec.record.TransformRecord`;
    ``history``: the objective ``sum_P ||A_P - g.B_P||^2`` over the bound parameters,
    before the first round and after each; ``timings``: seconds per phase;
    ``canonical_model``: A's module in canonical form (same class), into which
    ``canonical_a``, ``aligned_b`` and their interpolations load; None for state-dict inputs.
    """

    bound: BoundSpec
    canonical_a: dict[str, torch.Tensor]
    #: None when ``weight_match(keep_canonical_b=False)`` (B's copy became the aligned one)
    canonical_b: dict[str, torch.Tensor] | None
    aligned_b: dict[str, torch.Tensor]
    elements: dict[str, Element]
    record: TransformRecord
    history: list[float]
    timings: dict[str, float]
    converged: bool
    searched: dict[str, str]
    model_a: torch.nn.Module | None = attrs.field(default=None, repr=False)
    _canonical_model: torch.nn.Module | None = attrs.field(default=None, init=False, repr=False)

    @property
    def spec(self) -> Spec:
        return self.bound.spec

    @property
    def canonical_model(self) -> torch.nn.Module | None:
        """A's module in canonical form (a copy of the same class; built on first use, so
        that callers who only need the weights do not pay for it). None for state dicts."""
        if self._canonical_model is None and self.model_a is not None:
            self._canonical_model = canonical_module(self.bound, self.model_a, self.canonical_a)
        return self._canonical_model

    def distance(self, which: str = "aligned") -> float:
        """Squared weight distance over the bound parameters between canonical A and
        canonical B (``which="canonical"``) or aligned B (``"aligned"``)."""
        if which == "canonical" and self.canonical_b is None:
            return self.history[0]  # the objective at the identity is that distance
        other = self.aligned_b if which == "aligned" else self.canonical_b
        assert other is not None
        return weight_distance(self.bound, self.canonical_a, other)

    def interpolate(self, alpha: float, *, align: bool = True) -> dict[str, torch.Tensor]:
        """``(1 - alpha) A + alpha B`` (aligned B unless ``align=False``), canonical form."""
        other = self.aligned_b if align else self.canonical_b
        if other is None:
            raise SymspecInputError("canonical B was not kept (weight_match(keep_canonical_b=False))")
        return interpolate_state_dicts(self.canonical_a, other, alpha)

    def summary(self) -> dict[str, Any]:
        """A JSON-able report: objective per round, time per phase, groups searched."""
        return {
            "spec": self.spec.name,
            "rounds": len(self.history) - 1,
            "converged": self.converged,
            "objective": self.history,
            "relative_objective": [h / self.history[0] if self.history[0] else 0.0 for h in self.history],
            "searched": self.searched,
            "timings": self.timings,
        }


def weight_distance(bound: BoundSpec, a: Mapping[str, torch.Tensor], b: Mapping[str, torch.Tensor]) -> float:
    """sum over the bound parameters of ||a - b||^2 (float64 accumulation)."""
    return float(sum(float((a[p].double() - b[p].double()).square().sum()) for p in bound.problem.params))


def interpolate_state_dicts(a: Mapping[str, torch.Tensor], b: Mapping[str, torch.Tensor], alpha: float) -> dict[str, torch.Tensor]:
    """Floating-point entries ``(1 - alpha) a + alpha b``; the others from ``a``."""
    out: dict[str, torch.Tensor] = {}
    for k, v in a.items():
        w = b.get(k)
        if w is not None and v.is_floating_point() and w.is_floating_point():
            out[k] = torch.lerp(v, w.to(v.dtype), alpha) if alpha not in (0.0, 1.0) else (v if alpha == 0.0 else w.to(v.dtype)).clone()
        else:
            out[k] = v
    return out


def _state(model: ModelLike) -> dict[str, torch.Tensor]:
    if isinstance(model, torch.nn.Module):
        return {k: v.detach() for k, v in model.state_dict().items()}
    return dict(model)


def _resolve_spec(spec: Spec | BoundSpec | str | Path) -> Spec | BoundSpec:
    if isinstance(spec, (Spec, BoundSpec)):
        return spec
    from .spec import load_spec

    return load_spec(spec)


def _finite(v: torch.Tensor) -> bool:
    # one pass without a temporary: a finite sum means finite entries; an infinite sum
    # may be an overflow of finite entries, so then look at them
    return bool(torch.isfinite(v.sum())) or bool(torch.isfinite(v).all())


def check_finite(sd: Mapping[str, torch.Tensor], which: str) -> None:
    bad = [k for k, v in sd.items() if isinstance(v, torch.Tensor) and v.is_floating_point() and not _finite(v)]
    if bad:
        more = f" and {len(bad) - 3} more" if len(bad) > 3 else ""
        raise SymspecInputError(f"model {which} has NaN or inf weights in {', '.join(bad[:3])}{more}")


def check_same_problem(ba: BoundSpec, bb: BoundSpec) -> None:
    """Two bindings of one spec that must describe the same problem (same spaces, groups
    and parameter shapes)."""
    problems = ba.problem.differences(bb.problem, "in A", "in B")
    if problems:
        more = f" (and {len(problems) - 5} more)" if len(problems) > 5 else ""
        raise SymspecInputError(f"A and B do not fit one spec '{ba.spec.name}': " + "; ".join(problems[:5]) + more)


def weight_match(model_a: ModelLike, model_b: ModelLike, spec: Spec | BoundSpec | str | Path, *,
                 groups: str | Mapping[str, str] | None = None, rounds: int = 10, tol: float = 1e-6,
                 device: str | torch.device = "cpu", dtype: torch.dtype | None = None,
                 progress: Any = None, config: Any = None, max_iter: int = 5,
                 greedy_start: bool = True, keep_canonical_b: bool = True, lap_workers: int = 1,
                 overlap: bool = True) -> MatchResult:
    """Align ``model_b`` to ``model_a`` in weight space under ``spec`` (data-free).

    ``model_a``/``model_b``: modules (or state dicts, with ``config`` for the spec's
    dimensions). ``spec``: a Spec, a BoundSpec (of A), a path or a built-in name.
    ``groups``: restrict the search, ``"perm"`` (permutations only, the paper's ablation),
    ``"full"`` (default), or per declared space, ``"perm,attn=full"``; see
    :mod:`symspec.solvers.restrict`. ``rounds``/``tol``: at most ``rounds`` rounds of
    coordinate descent, fewer once a round gains less than ``tol`` (relative).
    ``device``: where the dense work runs ("cuda" when present). ``dtype``: the working
    precision (default: A's; float32 for float16 and bfloat16 weights, which are also
    canonicalised in float32; the state dicts returned keep every input's dtype).
    ``progress``: called with a
    :class:`~symspec.solvers.MatchEvent` after every solved space and round.
    ``keep_canonical_b=False`` saves one copy of B: its canonical form becomes the working
    copy and then ``aligned_b`` (which then equals the record applied to B up to
    rounding), and ``canonical_b`` is None. ``lap_workers``: linear assignments solved at
    once, in threads (1: one at a time). ``overlap``: on few cores, batched solves (the
    within-head maps) run beside the other spaces' statistics (same result either way).
    Inputs are never modified.
    """
    timer = Timer()
    t0 = time.perf_counter()
    with timer("bind"):
        spec_obj = _resolve_spec(spec)
        bound_a = spec_obj if isinstance(spec_obj, BoundSpec) else bind(spec_obj, model_a, config=config)
        bound_b = bind(bound_a.spec, model_b, config=config)
        check_same_problem(bound_a, bound_b)
    sd_a, sd_b = _state(model_a), _state(model_b)
    with timer("check"):
        check_finite(sd_a, "A")
        check_finite(sd_b, "B")
    # float16/bfloat16 weights are canonicalised and matched in float32, and come back in
    # their own dtype
    wa, wb = widen(sd_a), widen(sd_b)
    with timer("canonicalize"):
        ca = canonicalize_state_dict(bound_a, wa)
        cb = canonicalize_state_dict(bound_b, wb)
    with timer("check"):
        # the entries canonicalisation rewrote (a finite model can overflow when folded)
        check_finite({k: v for k, v in ca.items() if v is not wa.get(k)}, "A (canonical form)")
        check_finite({k: v for k, v in cb.items() if v is not wb.get(k)}, "B (canonical form)")
    problem = bound_a.problem
    modes = parse_restriction(groups, problem)
    searched_problem = restrict_problem(problem, modes)
    # keep_canonical_b=False: the solver takes the bound tensors out of ``cb`` and works on
    # them (never in place, so entries still shared with the caller's B are safe)
    own = not keep_canonical_b
    res = match_weights(searched_problem, ca, cb, rounds=rounds, tol=tol, device=device, dtype=dtype,
                        progress=progress, max_iter=max_iter, greedy_start=greedy_start, timer=timer, own_b=own,
                        lap_workers=lap_workers, overlap=overlap)
    work_dtype = dtype or working_dtype(next((ca[p].dtype for p in problem.params), torch.float64))
    elements = {s: embed(problem.spaces[s].group, searched_problem.spaces[s].group, e, work_dtype)
                for s, e in res.elements.items()}
    with timer("transform"):
        if res.aligned is None:
            aligned = apply_elements(problem, {s: _to_cpu(e) for s, e in elements.items()}, cb)
        else:
            aligned = dict(cb)  # what is left: the entries no space acts on
            tie_of = {n: g for g in problem.ties for n in g}
            for name in problem.params:
                rep = next(n for n in tie_of.get(name, (name,)) if n in res.aligned)
                aligned[name] = res.aligned[rep].to(device=sd_b[name].device, dtype=sd_b[name].dtype)
            cb = None  # type: ignore[assignment]
            res.aligned = None
    searched = {s: str(searched_problem.spaces[s].group) for s in problem.spaces
                if searched_problem.spaces[s].group != problem.spaces[s].group}
    record = TransformRecord(
        spec=bound_a.spec.name,
        groups={s: str(si.group) for s, si in problem.spaces.items()},
        elements={s: _to_cpu(e) for s, e in elements.items()},
        canonical=[{"kind": op.kind, "args": dict(op.args)} for op in bound_a.canonical],
        searched=searched,
        meta={"objective": res.history, "rounds": len(res.history) - 1, "converged": res.converged,
              "groups": _mode_text(modes), "dtype": str(work_dtype).removeprefix("torch.")},
    )
    ca, aligned = _narrow(ca, sd_a), _narrow(aligned, sd_b)
    cb = _narrow(cb, sd_b) if cb is not None else None
    timings = timer.as_dict()
    timings["total"] = time.perf_counter() - t0
    return MatchResult(bound_a, ca, cb, aligned, elements, record, res.history, timings, res.converged,
                       {s: str(searched_problem.spaces[s].group) for s in problem.spaces},
                       model_a if isinstance(model_a, torch.nn.Module) else None)


def canonical_module(bound: BoundSpec, model: torch.nn.Module, canonical: Mapping[str, torch.Tensor]) -> torch.nn.Module:
    """A copy of ``model`` (same class) holding the canonical weights ``canonical``: what
    :func:`~symspec.transforms.canonicalize_model` returns, without canonicalising again
    and without first copying the old weights."""
    memo: dict[int, Any] = {}
    # Fresh (uninitialised) storage only for what ``canonical`` overwrites: a buffer in no
    # state dict (rotary frequencies, Gemma's embedding scale) is copied as it is, else it
    # would stay uninitialised memory.
    written = {id(t) for k, t in model.state_dict(keep_vars=True).items() if k in canonical}
    for t in itertools.chain(model.parameters(), model.buffers()):
        if t.is_floating_point() and id(t) in written and id(t) not in memo:
            empty = torch.empty(t.shape, dtype=t.dtype, device=t.device)
            memo[id(t)] = torch.nn.Parameter(empty, requires_grad=t.requires_grad) if isinstance(t, torch.nn.Parameter) else empty
    out = copy.deepcopy(model, memo)
    for op in bound.canonical:
        if op.kind == "untie":
            untie_module(out, op.args["param"])
    own = out.state_dict()
    out.load_state_dict({k: v for k, v in canonical.items() if k in own}, strict=False)
    return out.eval() if not model.training else out


def _narrow(sd: Mapping[str, torch.Tensor], like: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``sd`` with the entries that ``like`` stores in float16/bfloat16 cast back to it."""
    out = dict(sd)
    for k, v in sd.items():
        ref = like.get(k)
        if ref is not None and ref.dtype in LOW_PRECISION and v.is_floating_point() and v.dtype != ref.dtype:
            out[k] = v.to(ref.dtype)
    return out


def _to_cpu(e: Element) -> Element:
    return {k: v.detach().to("cpu") for k, v in e.items()}


def _mode_text(modes: Mapping[str, str]) -> str:
    kinds = set(modes.values())
    if len(kinds) <= 1:
        return next(iter(kinds), "full")
    return ",".join(f"{s}={m}" for s, m in modes.items())


__all__ = ["MatchEvent", "MatchResult", "interpolate_state_dicts", "weight_distance", "weight_match"]
