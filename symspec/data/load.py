"""Loading one split of a data source for a model, and checking that the model takes it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from symspec.data.base import (
    SOURCES,
    AccuracyFn,
    DataError,
    DataRequest,
    DataSource,
    EvalData,
    LossFn,
    batch_len,
    check_split,
    move,
    parse_source,
    slice_inputs,
)
from symspec.data.losses import (
    call_model,
    cross_entropy,
    default_accuracy_if_classes,
    has_logits,
    logits_of,
)


def load_data(source: str | DataSource | None, *, model: torch.nn.Module | None = None, module: Any = None,
              split: str = "val", batch_size: int = 64, max_samples: int | None = None,
              loss: LossFn | None = None, accuracy: AccuracyFn | None = None, seed: int = 0,
              model_dir: str | Path | None = None) -> EvalData:
    """Load one split of a data source for ``model``, checking that it fits.

    ``module``: the model file's Python module (``LoadedModel.model_file.module``), for
    its ``data``/``loss``/``accuracy`` hooks. ``source=None`` means the hook.
    ``loss``/``accuracy`` override everything; else the model file's ``loss`` and
    ``accuracy`` are used when defined, else the adapter's (cross-entropy, argmax).
    ``model_dir``: the model's folder (``LoadedModel.source`` of a Hugging Face folder),
    where its tokenizer and ``preprocessor_config.json`` are looked for; a path that is
    not a folder is ignored, and without one a Hugging Face model's ``name_or_path`` is
    used when it is a folder.
    """
    check_split(split)
    if batch_size < 1:
        raise DataError(f"batch size must be at least 1, got {batch_size}")
    if max_samples is not None and max_samples < 1:
        raise DataError(f"max samples must be at least 1, got {max_samples}")
    if source is None:
        if module is None or not callable(getattr(module, "data", None)):
            raise DataError("no data: pass --data (text:PATH, mnist:DIR, digits, images:DIR, hf:DIR) "
                            "or define data(split, ...) in the model file")
        src = DataSource("hook", None, {}, "hook")
    else:
        src = source if isinstance(source, DataSource) else parse_source(source)
    request = DataRequest(src, split, batch_size, max_samples, model, module, _model_folder(model, model_dir), seed)
    data = SOURCES[src.kind].loader(request)
    hook_loss = getattr(module, "loss", None) if module is not None else None
    hook_acc = getattr(module, "accuracy", None) if module is not None else None
    data.loss = loss or (hook_loss if callable(hook_loss) else data.loss)
    if accuracy is not None:
        data.accuracy = accuracy
    elif callable(hook_acc):
        data.accuracy = hook_acc
    elif data.accuracy is None:
        data.accuracy = default_accuracy_if_classes
    data.details.setdefault("loss", getattr(data.loss, "__name__", type(data.loss).__name__))
    return data


def _model_folder(model: torch.nn.Module | None, model_dir: str | Path | None) -> Path | None:
    if model_dir is None:
        model_dir = getattr(model, "name_or_path", None) or None
    if model_dir is None:
        return None
    p = Path(model_dir)
    return p if p.is_dir() else None


def check_inputs(model: torch.nn.Module, data: EvalData, label: str = "the model") -> tuple[Any, torch.Tensor]:
    """Run ``model`` on the first examples of ``data``, where a batch first meets the model
    (the barrier's evaluation, activation statistics, learned matching: all go through
    here or :func:`check_fits`), and raise one :class:`DataError` line if it cannot take
    them: data of the wrong kind (images for a model that reads token ids, token ids for
    one that reads images) is named as such, with the source and what the model takes;
    any other failure with the likely cause. Returns (the model's output, the targets).
    ``data``: :class:`EvalData`, or any object with ``batches`` of (inputs, targets or
    None), as the alignment methods take; without batches there is nothing to check."""
    batches = getattr(data, "batches", None)
    if not batches:
        return None, None
    inputs, targets = batches[0]
    n = min(2, batch_len(targets)) if isinstance(targets, torch.Tensor) else 2
    x, y = slice_inputs(inputs, n), targets[:n] if isinstance(targets, torch.Tensor) else targets
    param = next(iter(model.parameters()), None)
    if param is not None:
        x = move(x, param.device, param.dtype)
        y = y.to(param.device) if isinstance(y, torch.Tensor) else y
    name = getattr(data, "name", "the data")
    wrong: list[str] = []
    hooks = [m.register_forward_pre_hook(_kind_probe(name, m, wrong)) for name, m in model.named_modules()
             if isinstance(m, _READS_IDS + _READS_FLOATS)]
    try:
        with torch.no_grad():
            out = call_model(model, x)
    except (Exception, SystemExit) as e:
        if wrong:
            raise DataError(f"{name} does not fit {label}: the data gives {_describe(x, data)}, but {label} "
                            f"takes {wrong[0]}; give --data of that kind") from e
        msg = str(e).splitlines()[0][:300] if str(e) else type(e).__name__
        raise DataError(f"{name} does not fit {label}: it fails on the first batch with "
                        f"{type(e).__name__}: {msg}{_likely_cause(data)}") from e
    finally:
        for h in hooks:
            h.remove()
    return out, y


#: the modules whose input says what a model reads: an embedding table reads token ids,
#: a convolution or a linear map floating-point values (images, features)
_READS_IDS: tuple[type[torch.nn.Module], ...] = (torch.nn.Embedding, torch.nn.EmbeddingBag)
_READS_FLOATS: tuple[type[torch.nn.Module], ...] = (torch.nn.Conv1d, torch.nn.Conv2d, torch.nn.Conv3d, torch.nn.Linear)


def _kind_probe(name: str, module: torch.nn.Module, wrong: list[str]) -> Any:
    """A forward pre-hook that records, once, a module given inputs of the wrong kind."""
    ids = isinstance(module, _READS_IDS)

    def probe(mod: torch.nn.Module, args: tuple[Any, ...]) -> None:
        t = args[0] if args else None
        if wrong or not isinstance(t, torch.Tensor):
            return
        if ids and t.is_floating_point():
            wrong.append(f"token ids (integers, read by its embedding {name or type(module).__name__})")
        elif not ids and not (t.is_floating_point() or t.is_complex()):
            what = "images" if isinstance(module, (torch.nn.Conv2d, torch.nn.Conv3d)) else "floating-point features"
            wrong.append(f"{what} (floating-point values, read by its {type(module).__name__} "
                         f"{name or type(module).__name__})")

    return probe


def _describe(x: Any, data: EvalData) -> str:
    """What a batch of inputs holds, in words: token ids, images, or tensors of a dtype."""
    t = x if isinstance(x, torch.Tensor) else next((v for v in (x.values() if isinstance(x, dict) else x)
                                                     if isinstance(v, torch.Tensor)), None)
    if t is None:
        return f"{type(x).__name__} inputs"
    shape = "x".join(str(d) for d in t.shape[1:])
    if t.is_floating_point():
        what = "images" if getattr(data, "kind", None) == "images" or t.dim() == 4 else "floating-point inputs"
        return f"{what} ({str(t.dtype).replace('torch.', '')} tensors of {shape} per example)"
    return f"integer ids (token ids: {str(t.dtype).replace('torch.', '')} tensors of {shape} per example)"


def check_fits(model: torch.nn.Module, data: EvalData, label: str = "the model") -> None:
    """Run ``model`` on a few examples of ``data`` and raise :class:`DataError`, naming
    the likely cause (data of the wrong kind, vocabulary, image size, classes), if it
    cannot take them (:func:`check_inputs`), or its outputs do not fit the targets."""
    out, y = check_inputs(model, data, label)
    if data.kind in ("text", "images") and (data.loss is cross_entropy or has_logits(out)):
        _check_outputs(logits_of(out), y, data, label)  # a loss hook may read an output without logits
    try:
        value = data.loss(out, y)
    except (Exception, SystemExit) as e:
        raise DataError(f"the loss fails on {data.name} with {label}'s outputs: {type(e).__name__}: {e}") from e
    if not isinstance(value, torch.Tensor) or value.numel() != 1:
        raise DataError(f"loss(output, targets) must return a scalar tensor, got {type(value).__name__}"
                        + (f" of shape {list(value.shape)}" if isinstance(value, torch.Tensor) else ""))


def _likely_cause(data: EvalData) -> str:
    d = getattr(data, "details", None) or {}
    if not hasattr(data, "kind"):
        return ""
    if data.kind == "text" and "tokenizer" in d:
        return (f" (the data has token ids up to {d.get('max_id')} and blocks of {d.get('context')}: does the model's "
                "vocabulary or context fit?)")
    if data.kind == "text":
        return f" (the data has {d.get('vocab')} characters and context {d.get('context')}: does the model's vocabulary or context fit?)"
    if data.kind == "images":
        size = d.get("image_size") or ["?", "?"]
        return f" (the images are {d.get('channels')}x{size[0]}x{size[1]}: does the model take that size? resize with ,size=N)"
    return ""


def _check_outputs(logits: torch.Tensor, y: torch.Tensor, data: EvalData, label: str) -> None:
    d = data.details
    if logits.shape[:-1] != y.shape:
        raise DataError(f"{data.name} does not fit {label}: outputs of shape {list(logits.shape)} for targets {list(y.shape)}")
    width = logits.shape[-1]
    if data.kind == "text" and "tokenizer" in d:
        if width <= int(d.get("max_id", -1)):
            raise DataError(f"{data.name} does not fit {label}: the model predicts {width} classes but the "
                            f"tokenizer's ids go up to {d.get('max_id')}")
        return
    classes = int(d.get("vocab") or d.get("classes") or 0)
    if data.kind == "text" and width != classes:
        raise DataError(f"{data.name} does not fit {label}: the model predicts {width} classes but the "
                        f"text's alphabet has {classes} characters")
    if width < classes:
        raise DataError(f"{data.name} does not fit {label}: the model predicts {width} classes but the "
                        f"labels go up to {classes - 1}")
