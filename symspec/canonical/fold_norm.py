"""``fold_norm``: fold a norm's gain (and bias) into the weights that read its output."""

from __future__ import annotations

from collections.abc import Mapping, Set
from typing import TYPE_CHECKING, Any, ClassVar

import attrs
import torch

from ..errors import Location
from ..spec.templates import captures_of, fill
from .base import BindContext, CanonicalizationError, CanonOp, CanonStep, writable

if TYPE_CHECKING:
    from ..spec.model import StepDecl


def _along(v: torch.Tensor, axis: int, ndim: int) -> torch.Tensor:
    shape = [1] * ndim
    shape[axis] = -1
    return v.reshape(shape)


class FoldNorm(CanonStep):
    """``- fold_norm: {gain, bias, into: [...]}``: a norm's gain and bias move into its readers."""

    kind: ClassVar[str] = "fold_norm"

    # -- binding ----------------------------------------------------------------------------
    def bind(self, step: StepDecl, index: int, ctx: BindContext) -> list[CanonOp]:
        args = step.as_dict()
        found = ctx.matches(args["gain"])
        if not found:
            ctx.no_match(step.loc, self.kind, args["gain"])
        out = []
        for gain, caps in found:
            bias = fill(args["bias"], caps) if args.get("bias") else None
            if ctx.lacks(step.loc, self.kind, bias):
                continue
            size = ctx.shapes[gain]
            if len(size) != 1:
                ctx.error(step.loc, f"fold_norm: {gain} has shape {list(size)}; a norm gain is a vector")
                continue
            folds_bias = bias is not None and args.get("fold_bias", True)
            readers = [r for spec in args["into"] for rcaps in self._reader_captures(spec, caps, step.loc, ctx)
                       if (r := self._reader(spec, rcaps, size[0], folds_bias, bias, step.loc, ctx))]
            ctx.touches_tie(gain, step.loc, self.kind)
            op_args = {"gain": gain, "bias": bias, "fold_bias": bool(args.get("fold_bias", True)), "into": readers}
            if args.get("gain_offset"):  # only when set: records of plain folds stay as they were
                op_args["gain_offset"] = args["gain_offset"]
            out.append(CanonOp(self.kind, op_args, step.loc, index))
        return out

    def _reader_captures(self, spec: dict[str, Any], caps: dict[str, int], loc: Location,
                         ctx: BindContext) -> list[dict[str, int]]:
        """The captures of each reader ``spec`` names for this gain: the gain's own where
        the reader's pattern has no other; else one per parameter the pattern matches that
        agrees with the gain's (a final norm read in every block), none matched an error."""
        if set(captures_of(spec["weight"])) <= set(caps):
            return [caps]
        found = [{**rc, **caps} for _, rc in ctx.matches(spec["weight"])
                 if all(rc.get(k, v) == v for k, v in caps.items())]
        if not found:
            ctx.no_match(loc, self.kind, spec["weight"])
        return sorted(found, key=lambda c: sorted(c.items()))

    def _reader(self, spec: dict[str, Any], caps: dict[str, int], size: int, folds_bias: bool, bias: str | None,
                loc: Location, ctx: BindContext) -> dict[str, Any] | None:
        """One reader of the norm with concrete names, or None after reporting why not."""
        w = fill(spec["weight"], caps)
        rb = fill(spec["bias"], caps) if spec.get("bias") else None
        if ctx.lacks(loc, self.kind, w):
            return None
        ax = spec["axis"]
        shape = ctx.shapes[w]
        if not -len(shape) <= ax < len(shape) or shape[ax] != size:
            ctx.error(loc, f"fold_norm: axis {ax} of {w} (shape {list(shape)}) does not have the norm's size {size}")
            return None
        if ctx.lacks(loc, self.kind, rb):
            return None
        if rb is not None:
            want = tuple(s for k, s in enumerate(shape) if k != ax % len(shape))
            if tuple(ctx.shapes[rb]) != want:
                ctx.error(loc, f"fold_norm: {rb} has shape {list(ctx.shapes[rb])}, but {w} without axis {ax} has {list(want)}; it is not that reader's bias")
                return None
        if folds_bias and rb is None:
            ctx.error(loc, f"fold_norm: {w} has no bias to absorb {bias}",
                      "set 'fold_bias: false' to keep the norm's bias (and bind it to the space)")
            return None
        ctx.touches_tie(w, loc, self.kind)
        if rb:
            ctx.touches_tie(rb, loc, self.kind)
        return {"weight": w, "axis": ax % len(shape), "bias": rb}

    # -- applying ---------------------------------------------------------------------------
    def apply(self, op: CanonOp, sd: dict[str, torch.Tensor]) -> None:
        stored = sd[op.args["gain"]]
        # The factor the norm multiplies by: its weight, or (offset + weight) for norms that
        # store the gain as an offset from it (Gemma's RMSNorm: x * (1 + w)).
        offset = op.args.get("gain_offset", 0)
        gain = stored + offset if offset else stored
        bias_name = op.args.get("bias")
        bias = sd[bias_name] if bias_name else None
        fold_bias = op.args.get("fold_bias", True) and bias is not None
        for r in op.args["into"]:
            w = sd[r["weight"]]
            ax = r["axis"]
            if fold_bias and r.get("bias"):
                contrib = torch.tensordot(w, bias.to(w.dtype), dims=([ax], [0]))  # type: ignore[union-attr]
                b = sd[r["bias"]]
                sd[r["bias"]] = b + contrib.reshape(b.shape).to(b.dtype)
            if writable(sd, r["weight"]):  # a scratch copy: scaled where it is
                w.mul_(_along(gain.to(w.dtype), ax, w.ndim))
            else:
                sd[r["weight"]] = w * _along(gain.to(w.dtype), ax, w.ndim)
        # the stored weight that makes the factor 1: 1 - offset (0 for Gemma)
        sd[op.args["gain"]] = torch.full_like(stored, 1 - offset) if offset else torch.ones_like(stored)
        if fold_bias and bias_name:
            sd[bias_name] = torch.zeros_like(bias)  # type: ignore[arg-type]
        elif bias is not None:
            # The bias stays on the norm: its output must read gain * (n + bias / gain).
            if bool((gain == 0).any()):
                what = "its factor (gain_offset + weight)" if offset else "it"
                raise CanonicalizationError(f"cannot fold {op.args['gain']}: {what} has zero entries and {bias_name} is kept")
            sd[bias_name] = bias / gain.to(bias.dtype)  # type: ignore[index]

    def rows_apart(self, op: CanonOp, sliced: Set[str]) -> bool:
        """Readers scaled along an axis other than their rows, row by row; a reader's bias
        that absorbs the norm's bias is sliced with it (its rows are the reader's)."""
        if op.args["gain"] in sliced or op.args.get("bias") in sliced:
            return False
        fold_bias = op.args.get("fold_bias", True) and op.args.get("bias") is not None
        for r in op.args["into"]:
            if r["weight"] in sliced:
                if r["axis"] == 0 or (fold_bias and r.get("bias") and r["bias"] not in sliced):
                    return False
            elif fold_bias and r.get("bias") in sliced:
                return False
        return True

    def undo(self, op: CanonOp, sd: dict[str, torch.Tensor], reference: Mapping[str, torch.Tensor]) -> str | None:
        """Unfold the norm with the reference's gain ``g`` (and bias ``b``): the norm's
        weight becomes the reference's, every reader ``W`` becomes ``W diag(f / g)`` (``f``:
        the factor the norm has in ``sd``, 1 in canonical form) and, where the bias was
        folded into the readers' biases, the norm's bias becomes ``b`` and leaves them
        again (``r + W c - W' b``, ``c``: the norm's bias in ``sd``); a bias kept on the
        norm becomes ``c g / f``. Exactly the same function for any ``g`` without zeros
        (computed in float64). A zero in ``g`` or ``f`` leaves this norm folded (a note)."""
        name = op.args["gain"]
        bias_name = op.args.get("bias")
        offset = op.args.get("gain_offset", 0)
        if name not in reference or (bias_name and bias_name not in reference):
            return f"{name}: the reference has no {name if name not in reference else bias_name}; this norm stays folded"
        target = reference[name].double() + offset
        current = sd[name].double() + offset
        if tuple(target.shape) != tuple(current.shape):
            return f"{name}: the reference's gain has shape {list(target.shape)}, not {list(current.shape)}; this norm stays folded"
        for what, factor in (("the reference's gain", target), ("the gain here", current)):
            if bool((factor == 0).any()):
                told = f"{what} (gain_offset + weight)" if offset else what
                return f"{name}: {told} has zero entries, which cannot be divided out; this norm stays folded"
        if not bool(torch.isfinite(target).all()):
            return f"{name}: the reference's gain is not finite; this norm stays folded"
        scale = current / target
        bias = sd[bias_name].double() if bias_name else None
        ref_bias = reference[bias_name].double() if bias_name else None
        moves_bias = bias is not None and op.args.get("fold_bias", True) and all(r.get("bias") for r in op.args["into"])
        staged: dict[str, torch.Tensor] = {}  # written only once every new value is finite in its dtype
        for r in op.args["into"]:
            w, ax = sd[r["weight"]], r["axis"]
            w64 = w.double()
            new = w64 * _along(scale.to(w.device), ax, w.ndim)
            if moves_bias:
                b = sd[r["bias"]]
                moved = (torch.tensordot(w64, bias.to(w.device), dims=([ax], [0]))  # type: ignore[union-attr]
                         - torch.tensordot(new, ref_bias.to(w.device), dims=([ax], [0])))  # type: ignore[union-attr]
                staged[r["bias"]] = (b.double() + moved.reshape(b.shape).to(b.device)).to(b.dtype)
            staged[r["weight"]] = new.to(w.dtype)
        staged[name] = reference[name].detach().to(device=sd[name].device, dtype=sd[name].dtype).clone()
        if bias is not None and bias_name:
            kept = ref_bias if moves_bias else bias * target.to(bias.device) / current.to(bias.device)
            staged[bias_name] = kept.to(device=sd[bias_name].device, dtype=sd[bias_name].dtype)  # type: ignore[union-attr]
        overflow = next((k for k, v in staged.items() if not bool(torch.isfinite(v).all())), None)
        if overflow is not None:
            return f"{name}: unfolding it makes {overflow} overflow in {str(sd[overflow].dtype).removeprefix('torch.')}; this norm stays folded"
        sd.update(staged)
        return None

    # -- reporting --------------------------------------------------------------------------
    def subject(self, op: CanonOp) -> str:
        return str(op.args["gain"])

    def declared_subject(self, step: StepDecl) -> str | None:
        return str(step.arg("gain"))

    def alternative(self, op: CanonOp) -> tuple[CanonOp, str] | None:
        """The same fold with the other ``gain_offset`` (1 instead of none, or none instead
        of 1): does the norm multiply by (1 + weight)?"""
        other = 0 if op.args.get("gain_offset", 0) else 1
        if other:
            told = f"with 'gain_offset: {other}' it preserves the function: the norm multiplies by ({other} + weight)"
        else:
            told = "without gain_offset it preserves the function: the norm multiplies by its weight itself"
        return attrs.evolve(op, args={**op.args, "gain_offset": other}), told
