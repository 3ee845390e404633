"""Losses and accuracies of a batch, and how a model is called on batch inputs.

Model outputs may be tensors, tuples (their first element), mappings with ``"logits"``
or objects with ``.logits`` (Hugging Face).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.nn.functional as F

from symspec.data.base import DataError


def logits_of(output: Any) -> torch.Tensor:
    """The logits of a model output: a tensor, an object with ``.logits`` (Hugging Face),
    a mapping with ``"logits"``, or the first element of a tuple."""
    if isinstance(output, torch.Tensor):
        return output
    if isinstance(output, Mapping) and "logits" in output:
        return output["logits"]
    logits = getattr(output, "logits", None)
    if isinstance(logits, torch.Tensor):
        return logits
    if isinstance(output, (tuple, list)) and output and isinstance(output[0], torch.Tensor):
        return output[0]
    raise DataError(no_logits_message(output))


def has_logits(output: Any) -> bool:
    """Whether :func:`logits_of` finds logits in ``output``."""
    try:
        logits_of(output)
    except DataError:
        return False
    return True


def no_logits_message(output: Any) -> str:
    """Why a model output has no logits, and how to score it instead: a ``loss`` hook,
    which a Hugging Face folder (it has no model file) takes from ``--model hooks.py``."""
    tensors = [str(k) for k, v in output.items() if isinstance(v, torch.Tensor)] if isinstance(output, Mapping) else []
    field = f"output.{tensors[0]}" if tensors and tensors[0].isidentifier() else "output"
    held = f" (its tensors: {', '.join(tensors[:6])})" if tensors else ""
    return (f"cannot find logits in a model output of type {type(output).__name__}{held}; say how to score it with "
            "loss(output, targets) in the model file, or, for a Hugging Face folder (it has no model file), in a file "
            "passed as --model hooks.py that holds two lines: 'import torch' and "
            f"'def loss(output, targets): return ...' (a scalar tensor computed from {field} and targets)")


def cross_entropy(output: Any, targets: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy over all targets (tokens or examples).

    >>> round(float(cross_entropy(torch.zeros(1, 3, 4), torch.tensor([[0, 1, 2]]))), 4)  # log 4
    1.3863
    """
    logits = logits_of(output)
    if logits.dtype in (torch.float16, torch.bfloat16):  # half-precision logits: a float32 loss
        logits = logits.float()
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def argmax_accuracy(output: Any, targets: torch.Tensor) -> torch.Tensor | float:
    """The fraction of argmax hits; NaN (not reported) for an output without logits,
    which only a model file's own loss can score."""
    if not has_logits(output):
        return math.nan
    logits = logits_of(output)
    return (logits.argmax(-1) == targets).float().mean()


def default_accuracy_if_classes(output: Any, targets: torch.Tensor) -> torch.Tensor | float:
    """argmax accuracy where targets are class indices; NaN (not reported) elsewhere."""
    try:
        logits = logits_of(output)
    except DataError:
        return math.nan
    if targets.is_floating_point() or logits.shape[:-1] != targets.shape:
        return math.nan
    return (logits.argmax(-1) == targets).float().mean()


def call_model(model: Callable[..., Any], inputs: Any) -> Any:
    """``model(**inputs)`` for a mapping, ``model(*inputs)`` for a tuple, else ``model(inputs)``."""
    if isinstance(inputs, Mapping):
        return model(**inputs)
    if isinstance(inputs, tuple):
        return model(*inputs)
    return model(inputs)
