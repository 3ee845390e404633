"""``untie``: give a tied parameter its own storage."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, ClassVar

import torch

from ..spec.templates import matches
from ..statedict import storage_key
from .base import BindContext, CanonOp, CanonStep, OwnedState, writable

if TYPE_CHECKING:
    from ..spec.model import StepDecl


def untie_module(model: torch.nn.Module, name: str) -> None:
    """Give the parameter ``name`` of ``model`` its own copy (in place), and tell a Hugging
    Face config not to tie it again when the model is saved and loaded."""
    prefix, _, attr = name.rpartition(".")
    owner = model.get_submodule(prefix) if prefix else model
    current = getattr(owner, attr)
    setattr(owner, attr, torch.nn.Parameter(current.detach().clone(), requires_grad=current.requires_grad))
    untie_config(getattr(model, "config", None))


def untie_config(cfg: Any) -> None:
    """Tell a Hugging Face config (in place; anything else: nothing) not to tie the word
    embeddings again when the model is loaded."""
    # Hugging Face models re-tie on load unless told not to; say so in their config.
    if cfg is not None and hasattr(cfg, "tie_word_embeddings"):
        cfg.tie_word_embeddings = False
    text_cfg = getattr(cfg, "text_config", None) if cfg is not None else None
    if text_cfg is not None and hasattr(text_cfg, "tie_word_embeddings"):
        text_cfg.tie_word_embeddings = False


class Untie(CanonStep):
    """``- untie: NAME``: the tied parameter gets its own copy."""

    kind: ClassVar[str] = "untie"
    rewrites_values: ClassVar[bool] = False

    def bind(self, step: StepDecl, index: int, ctx: BindContext) -> list[CanonOp]:
        template = step.arg("param")
        names = self.unties(step, list(ctx.tensors))
        if not names:
            ctx.error(step.loc, f"untie: '{template}' matches no parameter", ctx.hint(template, ctx.tensors))
        out = []
        for n in names:
            if not ctx.is_tied(n):
                ctx.error(step.loc, f"untie: {n} is not declared tied to anything")
            ctx.untied.add(n)
            out.append(CanonOp("untie", {"param": n}, step.loc, index))
        return out

    def unties(self, step: StepDecl, names: Sequence[str]) -> list[str]:
        template = step.arg("param")
        return [n for n, _ in matches(template, names)] if template else []

    def apply(self, op: CanonOp, sd: dict[str, torch.Tensor]) -> None:
        # in a state dict the entry gets its own copy; on a module, apply_module unties it
        name = op.args["param"]
        if not writable(sd, name):  # a scratch copy no twin shares is its own already
            sd[name] = sd[name].clone()
            if isinstance(sd, OwnedState):
                sd.owned.add(id(sd[name]))

    def apply_module(self, op: CanonOp, module: torch.nn.Module) -> None:
        untie_module(module, op.args["param"])

    def undo(self, op: CanonOp, sd: dict[str, torch.Tensor], reference: Mapping[str, torch.Tensor]) -> str | None:
        name = op.args["param"]
        ref = reference.get(name)
        twins = [] if ref is None else [k for k, v in reference.items()
                                        if k != name and isinstance(v, torch.Tensor) and storage_key(v) == storage_key(ref)]
        if not twins:  # the reference holds it apart (a model that does not tie it): nothing was untied
            return None
        return (f"{name} stays untied from {', '.join(twins)}: its canonical copy was changed on its own "
                "(a norm folded into it), so the two no longer hold the same values")

    def subject(self, op: CanonOp) -> str:
        return str(op.args["param"])
