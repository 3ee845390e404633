"""Writing a model back in the format it was read in and the dtypes it was stored in."""

from __future__ import annotations

import copy
import io
from collections.abc import Mapping
from pathlib import Path

import torch
from safetensors.torch import save

from ..errors import ModelLoadError
from ..outputs import atomic_write, atomic_write_bytes
from .base import SAFETENSORS_SUFFIXES, LoadedModel, stored_dtype
from .statedict import load_state_dict_into


def _unique_state(model: torch.nn.Module, sd: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v.detach().contiguous().cpu() for k, v in sd.items()}


def _as_stored(sd: Mapping[str, torch.Tensor], dtypes: Mapping[str, torch.dtype] | None) -> dict[str, torch.Tensor]:
    """``sd`` with every floating-point entry in the dtype its source stored it in."""
    out = dict(sd)
    for k, v in sd.items():
        dt = stored_dtype(dtypes, k) if v.is_floating_point() else None
        if dt is not None and v.dtype != dt:
            out[k] = v.to(dt)
    return out


def save_model(loaded: LoadedModel, state_dict: Mapping[str, torch.Tensor], out: str | Path, *,
               model: torch.nn.Module | None = None, overwrite: bool = False) -> Path:
    """Write ``state_dict`` as a model in ``loaded``'s format at ``out``, atomically.

    ``model`` is the module the weights belong to (default: ``loaded.model``); for a
    Hugging Face model it must be of the same class, and the folder is written with
    ``save_pretrained``. Every floating-point tensor is written in the dtype its source
    stored it in (``loaded.dtypes``; else the module's): a float16 checkpoint stays one,
    whatever precision the weights were computed in. Refuses to overwrite an existing
    path unless ``overwrite``.
    """
    out = Path(out)
    if out.exists() and not overwrite:
        raise ModelLoadError(f"{out} exists; refusing to overwrite it")
    target = model if model is not None else loaded.model
    if loaded.format == "hf":
        m = copy.deepcopy(target)
        for name, t in m.state_dict(keep_vars=True).items():
            dt = stored_dtype(loaded.dtypes, name) if t.is_floating_point() else None
            if dt is not None and t.dtype != dt:
                t.data = t.data.to(dt)  # the copy's own tensor: save_pretrained writes its dtype
        load_state_dict_into(m, state_dict, str(out))
        atomic_write(out, lambda tmp: m.save_pretrained(str(tmp), safe_serialization=True), folder=True)
        return out
    sd = _as_stored(_unique_state(target, state_dict), loaded.dtypes)
    if loaded.format == "safetensors" or out.suffix in SAFETENSORS_SUFFIXES:
        # safetensors refuses shared storage: every entry is its own contiguous copy here.
        atomic_write_bytes(out, save({k: v.clone() for k, v in sd.items()}))
    else:
        buf = io.BytesIO()
        torch.save(sd, buf)
        atomic_write_bytes(out, buf.getvalue())
    return out
