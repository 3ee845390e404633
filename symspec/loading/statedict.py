"""Plain PyTorch state dicts and safetensors files: reading one (``weights_only``) and
loading it into the module of a model file, untying what the checkpoint stores apart."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import torch
from safetensors.torch import load_file

from ..binding import named_tensors
from ..canonical import untie_module
from ..errors import ModelLoadError
from .base import SAFETENSORS_SUFFIXES
from .usercode import describe_failure


def read_state_dict(path: Path) -> dict[str, torch.Tensor]:
    """The tensors of a checkpoint file (a ``state_dict`` or ``model`` entry unwrapped)."""
    if path.is_file() and path.stat().st_size == 0:
        raise ModelLoadError(f"{path}: the file is empty (0 bytes), not a checkpoint")
    if path.suffix in SAFETENSORS_SUFFIXES:
        try:
            return load_file(str(path))
        except Exception as e:
            raise ModelLoadError(f"{path}: not a readable safetensors file ({describe_failure(e)})") from e
    try:
        obj = torch.load(str(path), map_location="cpu", weights_only=True)
    except Exception as e:
        raise ModelLoadError(f"{path}: cannot be read as a state dict with weights_only=True ({describe_failure(e)})") from e
    if isinstance(obj, Mapping) and "state_dict" in obj and isinstance(obj["state_dict"], Mapping):
        obj = obj["state_dict"]
    if isinstance(obj, Mapping) and "model" in obj and isinstance(obj["model"], Mapping):
        obj = obj["model"]
    if not isinstance(obj, Mapping) or not all(isinstance(v, torch.Tensor) for v in obj.values()):
        raise ModelLoadError(f"{path}: does not hold a state dict (a mapping of names to tensors)")
    return dict(obj)


def load_state_dict_into(model: torch.nn.Module, sd: Mapping[str, torch.Tensor], source: str = "") -> None:
    """``load_state_dict(strict)`` that unties parameters the checkpoint stores apart.

    A canonicalised checkpoint may hold different values for two names that the freshly
    built model ties (one Parameter): those names are untied before loading, so that
    neither value is silently lost.
    """
    _, ties = named_tensors(model)
    for group in ties:
        present = [n for n in group if n in sd]
        if len(present) > 1 and any(not torch.equal(sd[present[0]], sd[n]) for n in present[1:]):
            for n in present[1:]:
                untie_module(model, n)
    missing, unexpected = [], []
    own = model.state_dict()
    for k in own:
        if k not in sd:
            missing.append(k)
    for k in sd:
        if k not in own:
            unexpected.append(k)
    # Tied twins absent from the checkpoint (safetensors stores one of them) are fine.
    tied_names = {n for g in ties for n in g}
    missing = [k for k in missing if k not in tied_names or not any(t in sd for g in ties if k in g for t in g)]
    missing = [k for k in missing if own[k].is_floating_point()]
    if missing or unexpected:
        msg = []
        if missing:
            msg.append(f"missing {len(missing)}: {', '.join(missing[:5])}")
        if unexpected:
            msg.append(f"unexpected {len(unexpected)}: {', '.join(unexpected[:5])}")
        raise ModelLoadError(f"{source}: the checkpoint does not fit {type(model).__name__} ({'; '.join(msg)})")
    for k, v in sd.items():
        if own[k].shape != v.shape:
            raise ModelLoadError(f"{source}: {k} has shape {list(v.shape)} in the checkpoint but {list(own[k].shape)} in {type(model).__name__}")
    # load_state_dict casts silently: integer (or boolean) values where the model has
    # floating-point weights are no trained weights (a cast or a wrong file), and would be
    # matched and written as floats without a word. The model's own integer buffers
    # (position ids) stay integers and are fine.
    for k in (k for k in own if k in sd):  # the first in the model's order, whatever the file's
        v = sd[k]
        if own[k].is_floating_point() and not (v.is_floating_point() or v.is_complex()):
            raise ModelLoadError(f"{source}: {k} holds {v.dtype} weights where the model has "
                                 f"{str(own[k].dtype).removeprefix('torch.')}; "
                                 "save the floating-point weights (the checkpoint's values were cast or it is another file)")
    model.load_state_dict(sd, strict=False)
