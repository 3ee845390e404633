"""The canonicalisation, in place and step by step: :func:`canonicalize_inplace` brings a
working copy into canonical form one step at a time, and :func:`locate_canonical_failure`
names the steps that change the model's function when the canonicalize row fails."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from ..binding import BoundSpec
from ..canonical import CanonOp
from ..precision import KeepFloat64
from ..transforms.canonicalize import canonicalize_structure
from .forward import DTYPES, compare, copy_as, forward_outputs, live_tensors


def canonicalize_inplace(bound: BoundSpec, module: torch.nn.Module) -> None:
    """Bring ``module`` into canonical form in place: the same steps as
    :func:`~symspec.transforms.canonicalize_model`, one step at a time, so that only the
    tensors one step rewrites exist twice."""
    canonicalize_structure(bound, module)
    live = live_tensors(module)
    views = {k: v.detach() for k, v in live.items()}
    for op in _value_steps(bound.canonical):
        _step_saving(op, live, views, keep=False)


def _value_steps(ops: Sequence[CanonOp]) -> list[CanonOp]:
    """The ops that rewrite values (untie only restructures the module), each in the
    pieces it applies in (``center``: one writer at a time)."""
    return [piece for op in ops if op.impl.rewrites_values for piece in op.impl.pieces(op)]


def _step_saving(op: CanonOp, live: Mapping[str, torch.Tensor], views: Mapping[str, torch.Tensor],
                 keep: bool = True) -> dict[str, torch.Tensor]:
    """One canonicalisation step, its results copied into the module's own tensors; the
    old values of what it changed when ``keep``. (A function of its own, so that no
    rewritten tensor outlives the step.)"""
    sd = dict(views)
    op.impl.apply(op, sd)
    saved = {}
    with torch.no_grad():
        for name in [k for k, v in sd.items() if v is not views[k]]:
            if keep:
                saved[name] = views[name].clone()
            live[name].copy_(sd.pop(name))
    return saved


def locate_canonical_failure(model: torch.nn.Module, bound: BoundSpec, inputs: Any, dtype: str, rtol: float,
                             exact64: bool = True) -> tuple[tuple[str, ...], list[str]]:
    """Which canonicalisation steps change ``model``'s function: one label per failing
    step of the spec, naming the step and its norms (``canonicalize[1] fold_norm
    model.layers.{i}.input_layernorm.weight (all 2)``, or the concrete names when only some
    of its matches fail), and a note per failing step with its place in the spec.

    Each step alone must preserve the function whatever the weights are (a fold is an
    identity of the computation; centring one writer adds a multiple of the all-ones
    vector that every pre-LN reader removes), so a fresh copy is canonicalised one step
    at a time and each step's output is compared with the one before it: every wrong
    step is named, not only the first. A wrong step is retried in the step's other
    reading, if it has one (a fold with the other ``gain_offset``: does the norm
    multiply by (1 + weight)?)."""
    trial = _StepByStep(model, bound, inputs, dtype, exact64)
    bad, hints = trial.failing(rtol)
    total: dict[int, int] = {}
    for op in bound.canonical:
        if op.impl.rewrites_values:
            total[op.step] = total.get(op.step, 0) + 1
    failing: list[str] = []
    notes: list[str] = []
    for step, ops in bad.items():
        first = ops[0][0]
        where = f"canonicalize[{step}]" if step >= 0 else "canonicalize"
        names = [op.impl.subject(op) for op, _ in ops]
        shown = ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
        decl = bound.spec.canonicalize[step] if 0 <= step < len(bound.spec.canonicalize) else None
        declared = first.impl.declared_subject(decl) if decl is not None else None
        if declared is not None and len(ops) > 1 and len(ops) == total[step]:
            failing.append(f"{where} {first.kind} {declared} (all {len(ops)})")
        else:
            failing.append(f"{where} {first.kind} {shown}")
        note = (f"canonicalize: {first.loc}: {first.kind} of {shown} changes the function "
                f"({dtype} max rel err {max(r for _, r in ops):.2e} > {rtol:.0e})")
        if hints.get(step):
            note += f"; {hints[step]}"
        notes.append(note)
    if not failing:
        notes.append(f"canonicalize: no single step changes the function beyond rtol {rtol:.0e} in {dtype}; the steps fail together")
    return tuple(failing), notes


class _StepByStep:
    """A fresh copy of the model in one dtype, canonicalised one step at a time, with the
    output compared after each."""

    def __init__(self, model: torch.nn.Module, bound: BoundSpec, inputs: Any, dtype: str, exact64: bool) -> None:
        self.bound = bound
        self.inputs = inputs
        self.dt = DTYPES[dtype]
        self.work = copy_as(model, self.dt)
        self.keep = KeepFloat64(rewrite=exact64) if dtype == "float64" else None
        canonicalize_structure(bound, self.work)
        self.live = live_tensors(self.work)
        self.views = {k: v.detach() for k, v in self.live.items()}

    def forward(self) -> list[torch.Tensor]:
        return forward_outputs(self.work, self.inputs, self.dt, self.keep, self.bound.problem.outputs)

    def failing(self, rtol: float) -> tuple[dict[int, list[tuple[CanonOp, float]]], dict[int, str]]:
        """The ops that change the function, with their error, by the spec's step; and for
        each such step, what its other reading tells (see :meth:`alternative_hint`)."""
        before = self.forward()
        bad: dict[int, list[tuple[CanonOp, float]]] = {}
        hints: dict[int, str] = {}
        for op in self.bound.canonical:
            if not op.impl.rewrites_values:
                continue
            rel, prev, saved = 0.0, before, {}
            for piece in op.impl.pieces(op):  # as check() applies it
                saved = _step_saving(piece, self.live, self.views)
                after = self.forward()
                rel = max(rel, compare(before, after)[1])
                before = after
            if rel <= rtol:
                continue
            alternative = op.impl.alternative(op)
            if op.step not in bad and alternative is not None:
                hints[op.step] = self.alternative_hint(*alternative, saved, prev, rtol)
            bad.setdefault(op.step, []).append((op, rel))
        return bad, hints

    def alternative_hint(self, other: CanonOp, told: str, saved: Mapping[str, torch.Tensor],
                         before: Sequence[torch.Tensor], rtol: float) -> str:
        """``told`` if the other reading of the op that just ran preserves the function, else
        "". (The weights are left as the wrong op made them, so that later steps are judged
        as before.)"""
        wrong = {k: self.views[k].clone() for k in saved}
        with torch.no_grad():
            for k, v in saved.items():
                self.live[k].copy_(v)
            _step_saving(other, self.live, self.views)
            _, rel = compare(before, self.forward())
            for k, v in wrong.items():
                self.live[k].copy_(v)
        return told if rel <= rtol else ""
