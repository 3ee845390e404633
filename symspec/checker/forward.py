"""Running a model for :func:`~symspec.checker.check` (and for whoever compares outputs the
same way: loading, width, learned matching): copies in one dtype, inputs cast to it, a
forward pass without gradients, and the floating-point tensors of its output compared."""

from __future__ import annotations

import contextlib
import copy
import itertools
import math
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from ..errors import SymspecInputError

DTYPES = {"float64": torch.float64, "float32": torch.float32}


def flatten_outputs(out: Any) -> list[torch.Tensor]:
    """Floating-point tensors of a model output (tensor, tuple, dict, HF ModelOutput)."""
    if isinstance(out, torch.Tensor):
        return [out] if out.is_floating_point() else []
    if isinstance(out, Mapping):
        return [t for v in out.values() for t in flatten_outputs(v)]
    if isinstance(out, (tuple, list)):
        return [t for v in out for t in flatten_outputs(v)]
    return []


def cast_inputs(inputs: Any, dtype: torch.dtype) -> Any:
    """``inputs`` (a tensor, or a dict, tuple or list of them) with its floating-point tensors in ``dtype``."""
    if isinstance(inputs, torch.Tensor):
        return inputs.to(dtype) if inputs.is_floating_point() else inputs
    if isinstance(inputs, Mapping):
        return {k: cast_inputs(v, dtype) for k, v in inputs.items()}
    if isinstance(inputs, (tuple, list)):
        return type(inputs)(cast_inputs(v, dtype) for v in inputs)
    return inputs


def compare(a: Sequence[torch.Tensor], b: Sequence[torch.Tensor]) -> tuple[float, float]:
    """(max |a - b|, that divided by max |a|) over all outputs."""
    if len(a) != len(b) or any(x.shape != y.shape for x, y in zip(a, b)):
        return math.inf, math.inf
    if not a:
        return 0.0, 0.0
    diff = max(float((x.double() - y.double()).abs().max()) if x.numel() else 0.0 for x, y in zip(a, b))
    scale = max(float(x.double().abs().max()) if x.numel() else 0.0 for x in a)
    if math.isnan(diff):
        return math.inf, math.inf
    return diff, diff / max(scale, 1e-30)


def copy_as(model: torch.nn.Module, dtype: torch.dtype) -> torch.nn.Module:
    """A deep copy of ``model`` (same class) whose floating-point parameters and buffers
    are ``dtype``, made without an intermediate copy in the model's own dtype; tied
    parameters stay tied."""
    memo: dict[int, Any] = {}
    with torch.no_grad():
        for t in itertools.chain(model.parameters(), model.buffers()):
            if id(t) in memo:
                continue
            new = t.detach().to(dtype=dtype, copy=True) if t.is_floating_point() else t.detach().clone()
            memo[id(t)] = torch.nn.Parameter(new, requires_grad=False) if isinstance(t, torch.nn.Parameter) else new
    return copy.deepcopy(model, memo).eval()


def live_tensors(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Name -> the module's own floating-point parameter or buffer (tied names share one)."""
    return {k: v for k, v in module.state_dict(keep_vars=True).items() if isinstance(v, torch.Tensor) and v.is_floating_point()}


def call_forward(module: torch.nn.Module, inputs: Any, mode: Any = None) -> Any:
    """``module`` on ``inputs`` without gradients: a dict is keyword inputs, a tuple the
    positional ones, anything else the one input."""
    if isinstance(inputs, Mapping):
        args: tuple[Any, ...] = ()
        kwargs = dict(inputs)
    else:
        args, kwargs = (inputs if isinstance(inputs, tuple) else (inputs,)), {}
    with torch.no_grad(), (mode if mode is not None else contextlib.nullcontext()):
        return module(*args, **kwargs)


def select_outputs(out: Any, keys: Sequence[str] = ()) -> Any:
    """The outputs a spec's symmetries preserve (its ``outputs``: keys of the model's
    output mapping); all of ``out`` where the spec names none. A key the output lacks is
    bad input, named with the keys there are."""
    if not keys:
        return out
    if not isinstance(out, Mapping):
        raise SymspecInputError(f"the spec names the outputs {', '.join(keys)}, but the model returns a "
                                f"{type(out).__name__}, not a mapping of named outputs")
    missing = [k for k in keys if out.get(k) is None]
    if missing:
        have = ", ".join(k for k, v in out.items() if v is not None)
        raise SymspecInputError(f"the spec's outputs name {', '.join(missing)}, which the model does not return "
                                f"(it returns {have})")
    return {k: out[k] for k in keys}


def forward_outputs(module: torch.nn.Module, inputs: Any, dtype: torch.dtype, mode: Any = None,
                    keys: Sequence[str] = ()) -> list[torch.Tensor]:
    """The floating-point outputs of ``module`` on ``inputs`` cast to ``dtype`` (only
    ``keys`` of them, where given: :func:`select_outputs`)."""
    out = call_forward(module, cast_inputs(inputs, dtype), mode)
    return [t.detach() for t in flatten_outputs(select_outputs(out, keys))]
