"""The model file's own data: ``hook[,key=value...]`` calls its ``data(split, ...)``.

Names looked up on the model file's module:

- ``data(split, batch_size=..., max_samples=..., seed=..., model=..., **options)``
  returns an iterable of ``(inputs, targets)`` batches; ``inputs`` is what
  ``model.forward`` takes (a tensor, a tuple of positional inputs, a dict of keyword
  inputs). Only the keyword arguments its signature names are passed.
- ``loss(output, targets)`` returns the mean loss of one batch (a scalar tensor); it
  is used with every data source (a model file knows its own output format best).
- ``accuracy(output, targets)`` (optional) returns the fraction correct of one batch.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch

from symspec.data.base import (
    Batch,
    DataError,
    DataRequest,
    EvalData,
    batch_len,
    register_source,
    slice_inputs,
)
from symspec.data.losses import cross_entropy
from symspec.loading import describe_failure, import_file, user_code, where_in


def hooks_module(loaded: Any, factory: str | Path | None = None) -> Any:
    """The Python module whose ``data``/``loss``/``accuracy`` hooks apply to ``loaded`` (a
    :class:`~symspec.loading.LoadedModel`): its own model file, else the ``--model`` file
    ``factory``, else None. Beside Hugging Face folders the ``--model`` file only lends
    its hooks: it is imported, its ``build()`` is not called."""
    mf = getattr(loaded, "model_file", None)
    if mf is not None:
        return mf.module
    if factory is None:
        return None

    return import_file(factory)


def hook_data(req: DataRequest) -> EvalData:
    """The model file's own ``data(split, ...)``: an iterable of (inputs, targets) batches."""
    src, module, split = req.source, req.module, req.split
    fn = getattr(module, "data", None) if module is not None else None
    if not callable(fn):
        if module is None:
            raise DataError("--data hook: no model file to take data(split, ...) from (the models are not model "
                            "files); pass --model model.py that defines data(), or --data text:PATH, mnist:DIR or digits")
        raise DataError(f"--data hook: {getattr(module, '__file__', None) or 'the model file'} defines no "
                        "data(split, ...) function; pass --data text:PATH, mnist:DIR or digits, or add data() to it")
    params = inspect.signature(fn).parameters
    kwargs: dict[str, Any] = {}
    offered = {"batch_size": req.batch_size, "max_samples": req.max_samples, "seed": req.seed, "model": req.model,
               **src.options}
    takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    for k, v in offered.items():
        if k in params or (takes_any and k in src.options):
            kwargs[k] = v
    unused = [k for k in src.options if k not in kwargs]
    if unused:
        raise DataError(f"--data {src}: the model file's data() takes no option '{unused[0]}'")

    try:
        with user_code(getattr(module, "__file__", None) or "the model file", f"in data({split!r})"):
            produced = fn(split, **kwargs)
            batches = collect_batches(produced, req.max_samples)
    except DataError:
        raise
    except (Exception, SystemExit) as e:  # the model file's own code: sys.exit() there is a failure too

        origin = getattr(module, "__file__", None)
        where = where_in(e, origin) if origin else "the model file"
        raise DataError(f"{where}: data({split!r}) failed: {describe_failure(e)}") from e
    if not batches:
        raise DataError(f"the model file's data({split!r}) gave no batches: the {split} split is empty")
    return EvalData(f"hook:{getattr(module, '__file__', 'model')}", "hook", split, batches, cross_entropy, None, {})


def collect_batches(produced: Any, max_samples: int | None) -> list[Batch]:
    """The (inputs, targets) batches ``produced`` by a ``data()`` hook, checked, at most
    ``max_samples`` examples (the last batch cut), empty batches dropped."""
    if produced is None or isinstance(produced, (torch.Tensor, str, bytes)) or not isinstance(produced, Iterable):
        raise DataError(f"data() must return an iterable of (inputs, targets) batches, got {type(produced).__name__}")
    out: list[Batch] = []
    seen = 0
    for item in produced:
        if not isinstance(item, (tuple, list)) or len(item) != 2 or not isinstance(item[1], torch.Tensor):
            raise DataError("data() must yield (inputs, targets) pairs with targets a tensor, "
                            f"got {type(item).__name__}" + (f" of length {len(item)}" if isinstance(item, (tuple, list)) else ""))
        x, y = item
        if isinstance(x, list):
            x = tuple(x)
        if max_samples is not None:
            room = max_samples - seen
            if room <= 0:
                break
            if batch_len(y) > room:
                x, y = slice_inputs(x, room), y[:room]
        seen += batch_len(y)
        if y.numel():
            out.append((x, y))
    return out


register_source("hook", hook_data, options=None, path=False)
