"""``center``: mean-centre the writers of a pre-LN residual stream."""

from __future__ import annotations

from collections.abc import Set
from typing import TYPE_CHECKING, ClassVar

import attrs
import torch

from .base import BindContext, CanonOp, CanonStep, writable

if TYPE_CHECKING:
    from ..spec.model import StepDecl


class Center(CanonStep):
    """``- center: {writers: {NAME: AXIS}}``: each writer loses its mean along its residual axis."""

    kind: ClassVar[str] = "center"

    def bind(self, step: StepDecl, index: int, ctx: BindContext) -> list[CanonOp]:
        writers = []
        for template, axis in step.as_dict()["writers"].items():
            found = ctx.matches(template)
            if not found:
                ctx.no_match(step.loc, self.kind, template)
            for n, _ in found:
                shape = ctx.shapes[n]
                if not -len(shape) <= axis < len(shape):
                    ctx.error(step.loc, f"center: {n} has no axis {axis} (shape {list(shape)})")
                    continue
                ctx.touches_tie(n, step.loc, self.kind)
                writers.append({"param": n, "axis": axis % len(shape)})
        return [CanonOp(self.kind, {"writers": writers}, step.loc, index)]

    def apply(self, op: CanonOp, sd: dict[str, torch.Tensor]) -> None:
        for w in op.args["writers"]:
            x = sd[w["param"]]
            if writable(sd, w["param"]):  # a scratch copy: centred where it is
                x.sub_(x.mean(dim=w["axis"], keepdim=True))
            else:
                sd[w["param"]] = x - x.mean(dim=w["axis"], keepdim=True)

    def rows_apart(self, op: CanonOp, sliced: Set[str]) -> bool:
        """A writer centred along an axis other than its rows: row by row."""
        return all(w["axis"] != 0 for w in op.args["writers"] if w["param"] in sliced)

    def pieces(self, op: CanonOp) -> list[CanonOp]:
        """One writer at a time: only one writer's centred copy (the embedding, for a
        language model) exists at once."""
        return [attrs.evolve(op, args={**op.args, "writers": [w]}) for w in op.args["writers"]]

    def subject(self, op: CanonOp) -> str:
        return ", ".join(w["param"] for w in op.args["writers"])
