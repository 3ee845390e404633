"""Writing a model back in the format it was read in and the dtypes it was stored in."""

from __future__ import annotations

import copy
import io
from collections.abc import Mapping
from pathlib import Path

import torch
from safetensors.torch import save

from ..binding import named_tensors
from ..canonical.untie import untie_config
from ..errors import ModelLoadError
from ..outputs import atomic_write, atomic_write_bytes
from .base import SAFETENSORS_SUFFIXES, LoadedModel, stored_dtype
from .shards import Layout, plan_shards, read_layout, write_like
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

    A Hugging Face folder read from safetensors is written in its own layout, one shard
    at a time (:func:`~symspec.loading.shards.write_like`): the same shard files and index
    mapping (a single file stays single), each tensor in the dtype its file stored it in,
    without a copy of the module; other folders go through ``save_pretrained``.
    """
    out = Path(out)
    if out.exists() and not overwrite:
        raise ModelLoadError(f"{out} exists; refusing to overwrite it")
    target = model if model is not None else loaded.model
    layout = read_layout(loaded.source) if loaded.format == "hf" and loaded.source.is_dir() else None
    plan = plan_shards(layout, state_dict, named_tensors(target)[1]) if layout is not None else None
    if layout is not None and plan is not None:
        atomic_write(out, lambda tmp: _write_folder(layout, plan, target, state_dict, tmp), folder=True)
        return out
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


def _write_folder(layout: Layout, plan: Mapping[str, list[str]], target: torch.nn.Module,
                  state_dict: Mapping[str, torch.Tensor], folder: Path) -> None:
    """A Hugging Face folder in ``layout``: its config (a copy, untied where a tied twin is
    now stored apart), its generation config where it had one, and the weights shard by shard."""
    cfg = getattr(target, "config", None)
    if cfg is not None:
        cfg = copy.deepcopy(cfg)
        cfg.architectures = [type(target).__name__]  # as save_pretrained writes it: the class to rebuild
        if any(k not in layout.files for names in plan.values() for k in names):
            untie_config(cfg)  # a twin written apart: loading must not tie it again
        cfg.save_pretrained(str(folder))
    gen = getattr(target, "generation_config", None)
    if gen is not None and (layout.folder / "generation_config.json").is_file():
        gen.save_pretrained(str(folder))
    write_like(layout, state_dict, folder, plan)
