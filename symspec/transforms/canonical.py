"""Canonicalisation passes: function-preserving rewrites that widen the usable group.

Each step kind (declared in :mod:`symspec.spec.steps`) has an implementation here,
keyed by name. They act on state dicts (pure: a new dict) and on models (a deep copy
of the same class, with the canonical weights loaded).
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Mapping

import torch

from ..binding import BoundSpec, CanonOp
from ..errors import SymspecInputError


class CanonicalizationError(SymspecInputError):
    """A model whose weights make a declared canonicalisation impossible."""

StepFn = Callable[[CanonOp, dict[str, torch.Tensor]], None]
STEP_IMPLS: dict[str, StepFn] = {}


def step(name: str) -> Callable[[StepFn], StepFn]:
    def deco(fn: StepFn) -> StepFn:
        STEP_IMPLS[name] = fn
        return fn

    return deco


def _along(v: torch.Tensor, axis: int, ndim: int) -> torch.Tensor:
    shape = [1] * ndim
    shape[axis] = -1
    return v.reshape(shape)


@step("untie")
def _untie(op: CanonOp, sd: dict[str, torch.Tensor]) -> None:
    # In a state dict every entry is its own value already; the module-level untie is
    # done by canonicalize_model.
    name = op.args["param"]
    sd[name] = sd[name].clone()


@step("fold_norm")
def _fold_norm(op: CanonOp, sd: dict[str, torch.Tensor]) -> None:
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


@step("center")
def _center(op: CanonOp, sd: dict[str, torch.Tensor]) -> None:
    for w in op.args["writers"]:
        x = sd[w["param"]]
        sd[w["param"]] = x - x.mean(dim=w["axis"], keepdim=True)


def canonicalize_state_dict(bound: BoundSpec, state_dict: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The canonical form of a state dict (a new dict; the input is not modified)."""
    sd = dict(state_dict)
    for op in bound.canonical:
        STEP_IMPLS[op.kind](op, sd)
    return sd


def untie_module(model: torch.nn.Module, name: str) -> None:
    prefix, _, attr = name.rpartition(".")
    owner = model.get_submodule(prefix) if prefix else model
    current = getattr(owner, attr)
    setattr(owner, attr, torch.nn.Parameter(current.detach().clone(), requires_grad=current.requires_grad))
    cfg = getattr(model, "config", None)
    # Hugging Face models re-tie on load unless told not to; say so in their config.
    if cfg is not None and hasattr(cfg, "tie_word_embeddings"):
        cfg.tie_word_embeddings = False
    text_cfg = getattr(cfg, "text_config", None) if cfg is not None else None
    if text_cfg is not None and hasattr(text_cfg, "tie_word_embeddings"):
        text_cfg.tie_word_embeddings = False


def canonicalize_model(bound: BoundSpec, model: torch.nn.Module) -> torch.nn.Module:
    """A deep copy of ``model`` (same class) in canonical form, with the same function."""
    out = copy.deepcopy(model)
    for op in bound.canonical:
        if op.kind == "untie":
            untie_module(out, op.args["param"])
    sd = canonicalize_state_dict(bound, {k: v.detach() for k, v in model.state_dict().items()})
    out.load_state_dict(sd)
    return out
