"""``load_model``: one entry for every kind of model source."""

from __future__ import annotations

from pathlib import Path

from ..errors import ModelLoadError
from ..io_util import refuse_special_file
from .base import SAFETENSORS_SUFFIXES, STATE_DICT_SUFFIXES, LoadedModel
from .gguf import load_gguf
from .hf import load_hf
from .modelfile import load_model_file
from .statedict import load_state_dict_into, read_state_dict


def load_model(path: str | Path, *, factory: str | Path | None = None) -> LoadedModel:
    """Load a model from a model file, a Hugging Face folder or a checkpoint (+ factory)."""
    p = Path(path)
    if not p.exists():
        raise ModelLoadError(f"{path}: no such file or folder")
    if p.is_dir():
        if (p / "config.json").exists():
            return LoadedModel(load_hf(p), p, "hf")
        raise ModelLoadError(f"{path}: a folder without config.json is not a Hugging Face model")
    refuse_special_file(p, "model file or checkpoint", ModelLoadError)
    if p.suffix.lower() == ".gguf":
        return load_gguf(p)
    if p.suffix == ".py":
        mf = load_model_file(p)
        return LoadedModel(mf.model, p, "modelfile", mf)
    if p.suffix in STATE_DICT_SUFFIXES + SAFETENSORS_SUFFIXES:
        if factory is None:
            raise ModelLoadError(f"{path}: a state dict needs the model it belongs to; pass --model model.py (a file with build())")
        mf = load_model_file(factory)
        sd = read_state_dict(p)
        load_state_dict_into(mf.model, sd, str(p))
        fmt = "safetensors" if p.suffix in SAFETENSORS_SUFFIXES else "state_dict"
        return LoadedModel(mf.model, p, fmt, mf, {k: v.dtype for k, v in sd.items() if v.is_floating_point()})
    raise ModelLoadError(f"{path}: unknown model format (expected model.py, a Hugging Face folder, .gguf, .pt/.pth/.bin or .safetensors)")
