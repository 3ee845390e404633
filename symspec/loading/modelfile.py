"""The model-file convention (``symspec check model.py``): a Python file whose ``build()``
makes the module (or that defines a module-level ``model``), with its example inputs,
``SPEC`` and ``CHECK_RTOL``."""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from pathlib import Path
from types import ModuleType
from typing import Any

import attrs
import torch

from ..errors import ModelLoadError
from .usercode import describe_failure, import_file, user_code, where_in


@attrs.define
class ModelFile:
    path: Path
    module: ModuleType
    model: torch.nn.Module

    def attr(self, name: str, default: Any = None) -> Any:
        return getattr(self.module, name, default)

    def example_inputs(self, batch: int = 2, seed: int = 0, model: torch.nn.Module | None = None) -> Any:
        fn: Callable[..., Any] | None = self.attr("example_inputs")
        if fn is None:
            value = self.attr("example_input")
            if value is None:
                raise ModelLoadError(f"{self.path} defines no example_inputs(model, batch, seed) (nor example_input)")
            return value
        if not callable(fn):
            raise ModelLoadError(f"{self.path}: example_inputs is a {type(fn).__name__}, not a function (model, batch, seed)")
        try:
            params = inspect.signature(fn).parameters
        except (TypeError, ValueError):  # a builtin without a signature: pass only the model
            params = {}  # type: ignore[assignment]
        kwargs: dict[str, Any] = {}
        if "batch" in params:
            kwargs["batch"] = batch
        if "seed" in params:
            kwargs["seed"] = seed
        try:
            with user_code(self.path, "in example_inputs()"):
                return fn(model if model is not None else self.model, **kwargs)
        except (Exception, SystemExit) as e:
            raise ModelLoadError(f"{where_in(e, self.path)}: example_inputs() failed: {describe_failure(e)}") from e

    def check_rtol(self) -> dict[str, float]:
        """``CHECK_RTOL``, validated: {"float32"|"float64": a tolerance in (0, 1)}."""
        value = self.attr("CHECK_RTOL")
        if value is None:
            return {}
        if not isinstance(value, Mapping):
            raise ModelLoadError(f"{self.path}: CHECK_RTOL is a {type(value).__name__}; expected a dict like {{'float32': 1e-3}}")
        out: dict[str, float] = {}
        for key, tol in value.items():
            if key not in ("float32", "float64"):
                raise ModelLoadError(f"{self.path}: CHECK_RTOL has key {key!r}; expected 'float32' or 'float64'")
            if isinstance(tol, bool) or not isinstance(tol, (int, float)) or not 0 < tol < 1:
                raise ModelLoadError(f"{self.path}: CHECK_RTOL[{key!r}] = {tol!r}; expected a number between 0 and 1 (exclusive)")
            out[key] = float(tol)
        return out

    def spec_hint(self) -> str | None:
        spec = self.attr("SPEC")
        if spec is None:
            return None
        p = Path(str(spec))
        if not p.is_absolute() and (self.path.parent / p).exists():
            return str(self.path.parent / p)
        return str(spec)


def load_model_file(path: str | Path) -> ModelFile:
    module = import_file(path)
    build = getattr(module, "build", None)
    if callable(build):
        try:
            with user_code(path, "in build()"):
                model = build()
        except (Exception, SystemExit) as e:
            raise ModelLoadError(f"{where_in(e, path)}: build() failed: {describe_failure(e)}") from e
    else:
        model = getattr(module, "model", None)
        if model is None:
            raise ModelLoadError(f"{path} defines neither build() nor a module-level 'model'")
    if not isinstance(model, torch.nn.Module):
        raise ModelLoadError(f"{path}: the model is a {type(model).__name__}, not a torch.nn.Module")
    return ModelFile(Path(path), module, model)
