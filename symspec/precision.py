"""Keeping a float64 forward pass in float64.

Some models compute parts of their forward pass in float32 on purpose, whatever the
dtype of their weights: Hugging Face's ``LlamaRMSNorm`` (and Qwen2's, Mistral's, ...)
casts its input to float32, eager attention runs its softmax with ``dtype=torch.float32``,
rotary embeddings compute cos/sin from ``inv_freq.float()``. A ``.double()`` Llama then
only agrees with itself to ~1e-7 relative, and a float64 symmetry check would measure
that rounding, not the symmetry (DESIGN §6: ~1.5e-5 absolute on a real model).

:class:`KeepFloat64` is a torch function mode: while it is active, every *downcast of
a float64 tensor* (``x.float()``, ``x.to(torch.float32)``, ``x.to(other32)``,
``softmax(x, dtype=torch.float32)``, ``x.half()``, ...) keeps float64 instead, and is
recorded with the source line that asked for it. Nothing else changes: integer casts,
float32 tensors, new tensors created in float32 (they promote to float64 when mixed
with float64 ones). The model's own code is not modified and nothing is patched
globally; leaving the ``with`` block restores the model's normal behaviour.

>>> import torch
>>> x = torch.ones(3, dtype=torch.float64)
>>> with KeepFloat64() as keep:
...     y = x.float() * 3
>>> y.dtype, keep.count
(torch.float64, 1)
"""

from __future__ import annotations

import contextlib
import sys
from collections import Counter
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

_LOW = (torch.float32, torch.float16, torch.bfloat16)
_METHOD_TARGET = {
    torch.Tensor.float: torch.float32,
    torch.Tensor.half: torch.float16,
    torch.Tensor.bfloat16: torch.bfloat16,
}
_SKIP = ("torch", "symspec", "contextlib", "functools")


def _is_f64(x: Any) -> bool:
    return isinstance(x, torch.Tensor) and x.dtype == torch.float64


def _caller() -> str:
    """``file.py:Qualified.name`` of the first frame outside torch and symspec."""
    f = sys._getframe(2)
    while f is not None:
        mod = str(f.f_globals.get("__name__", ""))
        if mod.split(".")[0] not in _SKIP:
            name = getattr(f.f_code, "co_qualname", f.f_code.co_name)
            return f"{f.f_code.co_filename.rsplit('/', 1)[-1]}:{name}"
        f = f.f_back  # type: ignore[assignment]
    return "<torch>"


class KeepFloat64(TorchFunctionMode):
    """Within the block, float64 tensors are never cast down to a lower precision.

    ``sites`` counts the downcasts per ``file.py:function``; ``count`` is their total.
    With ``rewrite=False`` the casts happen as the model wrote them and are only
    counted (to report that a float64 run is not float64 throughout).
    """

    def __init__(self, rewrite: bool = True) -> None:
        super().__init__()
        self.rewrite = rewrite
        self.sites: Counter[str] = Counter()

    @property
    def count(self) -> int:
        return sum(self.sites.values())

    def summary(self, limit: int = 4) -> str:
        """``LlamaRMSNorm.forward x8, ...`` (most frequent first)."""
        parts = [f"{site} x{n}" for site, n in self.sites.most_common(limit)]
        more = len(self.sites) - limit
        return ", ".join(parts) + (f" and {more} more" if more > 0 else "")

    def __torch_function__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None) -> Any:
        kwargs = dict(kwargs or {})
        if func in _METHOD_TARGET and args and _is_f64(args[0]):
            self.sites[_caller()] += 1
            if self.rewrite:
                return args[0]
        elif func is torch.Tensor.to and args and _is_f64(args[0]):
            new_args, new_kwargs, kept = _keep_to(args, kwargs)
            if kept:
                self.sites[_caller()] += 1
                if self.rewrite:
                    args, kwargs = new_args, new_kwargs
        elif kwargs.get("dtype") in _LOW and any(_is_f64(a) for a in args):
            # reductions and softmax with an accumulation dtype: softmax(x, dtype=float32)
            self.sites[_caller()] += 1
            if self.rewrite:
                kwargs["dtype"] = torch.float64
        return func(*args, **kwargs)


def _keep_to(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any], bool]:
    """Rewrite the arguments of ``Tensor.to`` so that a float64 tensor stays float64."""
    kwargs = dict(kwargs)
    kept = False
    if kwargs.get("dtype") in _LOW:
        kwargs["dtype"] = torch.float64
        kept = True
    rest = list(args[1:])
    if rest and isinstance(rest[0], torch.Tensor) and rest[0].dtype in _LOW:
        # x.to(other, non_blocking, copy): keep other's device, not its precision
        other, *flags = rest
        kwargs.update(zip(("non_blocking", "copy"), flags))
        return (args[0], other.device), {**kwargs, "dtype": torch.float64}, True
    for i, a in enumerate(rest):
        if isinstance(a, torch.dtype) and a in _LOW:
            rest[i] = torch.float64
            kept = True
    return (args[0], *rest), kwargs, kept


# ---------------------------------------------------------------- float32 matmuls in float32


def tf32_setting() -> tuple[str, str] | None:
    """How float32 matmuls are allowed to run faster than IEEE float32 on the GPU, as
    ``(api, value)``: ``("legacy", "high"|"medium")`` (``torch.set_float32_matmul_precision``,
    or ``torch.backends.cuda.matmul.allow_tf32 = True``), ``("new", "tf32")`` (torch's
    per-backend ``torch.backends.cuda.matmul.fp32_precision``); None for IEEE float32.
    Torch refuses to read one API's setting once the other set it, hence the two."""
    try:
        legacy = torch.get_float32_matmul_precision()
    except RuntimeError:  # set through the per-backend API: the legacy reading refuses
        legacy = None
    if legacy is not None:
        return None if legacy == "highest" else ("legacy", legacy)
    new = getattr(torch.backends.cuda.matmul, "fp32_precision", "ieee")
    return ("new", new) if new == "tf32" else None


class IEEEFloat32(contextlib.ContextDecorator):
    """Within the block (or the decorated function), float32 matmuls on the GPU run in
    IEEE float32, not TF32 (10-bit mantissa inputs, ~1e-3 relative per product), whatever
    the caller set; the setting is restored after. A CPU ignores both settings.

    The solvers' planted recovery is exact to float32's precision on the CPU (about 3e-6
    on a planted Mixtral); with TF32 products the same descent stops 100x further off
    (an emulation on the CPU: ``tests/test_gpu_precision.py``). Torch's default is IEEE,
    but TF32 is one line away (``torch.set_float32_matmul_precision("high")``, which
    training scripts and torch's own warning on recent GPUs recommend). Nothing is set
    where nothing needs to be, so the caller's choice of torch API is left alone.

    >>> torch.set_float32_matmul_precision("high")
    >>> with IEEEFloat32():
    ...     torch.get_float32_matmul_precision()
    'highest'
    >>> torch.get_float32_matmul_precision()
    'high'
    >>> torch.set_float32_matmul_precision("highest")
    """

    _before: tuple[str, str] | None = None

    def _recreate_cm(self) -> IEEEFloat32:
        return type(self)()  # a decorated function's calls may nest: each keeps its own setting

    def __enter__(self) -> IEEEFloat32:
        self._before = tf32_setting()
        if self._before is not None:
            _set_tf32(self._before[0], None)
        return self

    def __exit__(self, *exc: object) -> None:
        if self._before is not None:
            _set_tf32(*self._before)


def _set_tf32(api: str, value: str | None) -> None:
    """Set float32 matmul precision through ``api`` (the one the caller used: mixing the
    two makes torch refuse matmuls on CUDA); ``value`` None: IEEE float32."""
    if api == "legacy":
        torch.set_float32_matmul_precision(value or "highest")
    else:
        torch.backends.cuda.matmul.fp32_precision = value or "ieee"
