"""Hugging Face model folders (``config.json`` plus safetensors or ``pytorch_model.bin``):
rebuilt offline from ``transformers``, and their random example inputs."""

from __future__ import annotations

import contextlib
import inspect
import json
import os
from pathlib import Path

import torch

from ..errors import ModelLoadError
from ..io_util import read_small_file
from .shards import Layout, read_layout
from .usercode import describe_failure


def hf_example_inputs(model: torch.nn.Module, batch: int = 2, seed: int = 0, length: int = 16) -> dict[str, torch.Tensor]:
    """Random inputs for a Hugging Face model, from its config and main input name: token
    ids, images, or an audio model's features (Whisper's log-mel frames); an
    encoder-decoder (T5, BART, Whisper) gets the decoder's token ids too."""
    cfg = getattr(model, "config", None)
    name = getattr(model, "main_input_name", "input_ids")
    g = torch.Generator().manual_seed(seed)
    inputs: dict[str, torch.Tensor] = {}
    if name == "input_ids":
        inputs["input_ids"] = _token_ids(model, cfg, batch, length, g)
    elif name == "pixel_values":
        size = getattr(cfg, "image_size", 224)
        size = size if isinstance(size, int) else size[0]
        ch = getattr(cfg, "num_channels", 3)
        inputs["pixel_values"] = torch.randn(batch, ch, size, size, generator=g)
    elif name == "input_features" and getattr(cfg, "num_mel_bins", None) and getattr(cfg, "max_source_positions", None):
        # Whisper's encoder takes exactly 2 x max_source_positions frames (two strided convolutions)
        inputs["input_features"] = torch.randn(batch, cfg.num_mel_bins, 2 * cfg.max_source_positions, generator=g)
    else:
        raise ModelLoadError(f"{type(model).__name__}: no default inputs for main input '{name}'; use a model file with "
                             "example_inputs")
    params = inspect.signature(model.forward).parameters
    if getattr(cfg, "is_encoder_decoder", False) and "decoder_input_ids" in params:
        limit = getattr(cfg, "max_target_positions", None) or length
        inputs["decoder_input_ids"] = _token_ids(model, cfg, batch, min(length // 2 + 1, limit), g)
    if "use_cache" in params:
        inputs["use_cache"] = False  # type: ignore[assignment]
    return inputs


def _token_ids(model: torch.nn.Module, cfg: object, batch: int, length: int, g: torch.Generator) -> torch.Tensor:
    vocab = getattr(cfg, "vocab_size", None)
    if vocab is None:
        raise ModelLoadError(f"{type(model).__name__}: its config has no vocab_size to draw input ids from")
    limit = getattr(cfg, "max_position_embeddings", None) or getattr(cfg, "n_positions", None) or length
    return torch.randint(vocab, (batch, min(length, limit)), generator=g)


def load_hf(path: Path) -> torch.nn.Module:
    """The model of a Hugging Face folder, rebuilt from the class its config names (offline)."""
    cfg_path = path / "config.json"
    try:
        import transformers  # optional: the hf extra
    except ImportError as e:
        raise ModelLoadError(f"{path}: a Hugging Face model folder needs transformers (pip install 'symspec[hf]')") from e
    try:
        cfg = json.loads(read_small_file(cfg_path, "config file", error=ModelLoadError).decode("utf-8"))
    except (OSError, ValueError) as e:  # ValueError: bad JSON, and text that is not UTF-8
        raise ModelLoadError(f"{cfg_path}: unreadable config ({describe_failure(e)})") from e
    if not isinstance(cfg, dict):
        raise ModelLoadError(f"{cfg_path}: the config is a JSON {type(cfg).__name__}; expected an object with 'architectures'")
    archs = cfg.get("architectures")
    if not archs:
        raise ModelLoadError(f"{cfg_path}: no 'architectures' entry names the model class")
    if not isinstance(archs, list) or not isinstance(archs[0], str):
        raise ModelLoadError(f"{cfg_path}: 'architectures' is {json.dumps(archs)[:100]}; expected a list of class names "
                             "like [\"GPT2LMHeadModel\"]")
    try:
        cls = getattr(transformers, archs[0], None) if archs[0].isidentifier() and not archs[0].startswith("_") else None
    except Exception:  # transformers imports its classes lazily: a missing backend raises here
        cls = None
    if not isinstance(cls, type) or not issubclass(cls, torch.nn.Module):
        raise ModelLoadError(f"{cfg_path}: transformers has no model class {archs[0]!r}")
    # a corrupt index or a missing shard is named here, not deep inside from_pretrained
    layout = read_layout(path)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers.utils import logging as hf_logging  # optional: the hf extra

    # no "Loading weights" bar on stderr: an error about the weights is then the one line there
    bar = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        model = cls.from_pretrained(str(path), local_files_only=True)
    except Exception as e:
        raise ModelLoadError(f"{path}: {archs[0]}.from_pretrained failed: {describe_failure(e)}") from e
    finally:
        if bar:
            hf_logging.enable_progress_bar()
    if layout is not None:
        _refuse_integer_weights(layout, model)
    _aligned_experts(model)
    return model.eval()


def _refuse_integer_weights(layout: Layout, model: torch.nn.Module) -> None:
    """from_pretrained casts integer tensors into floating-point parameters without a word:
    refuse a folder whose safetensors files hold integer values where the model has
    floating-point weights (read from the files' headers; the model's own integer buffers
    are fine), as :func:`load_state_dict_into` does for state dicts."""
    own = model.state_dict()
    dtypes = layout.dtypes
    for k in (k for k in own if k in dtypes or k.partition(".")[2] in dtypes):
        name = k if k in dtypes else k.partition(".")[2]
        dt = dtypes[name]
        if own[k].is_floating_point() and not (dt.is_floating_point or dt.is_complex):
            raise ModelLoadError(f"{layout.folder / layout.files[name]}: {name} holds {dt} weights where the model has "
                                 f"{str(own[k].dtype).removeprefix('torch.')}; save the floating-point weights "
                                 "(the checkpoint's values were cast or it is another file)")


def _aligned_experts(model: torch.nn.Module) -> None:
    """A mixture of experts loads with transformers' ``grouped_mm`` experts, whose CPU
    kernel needs every stride of the expert weights (and of the activations between them)
    to be a multiple of 16 bytes: an expert width such as 6 (toy configs) makes every
    forward fail ("strides should be multiple of 16 bytes"). Such a model is switched to
    ``batched_mm``, the same products one token at a time; an aligned one is left as it is."""
    config = getattr(model, "config", None)
    if getattr(config, "_experts_implementation", None) != "grouped_mm" or not hasattr(model, "set_experts_implementation"):
        return
    for name, p in model.named_parameters():
        if p.ndim == 3 and "expert" in name.lower() and any((size * p.element_size()) % 16 for size in p.shape[1:]):
            # an implementation this model does not offer: left as it is, its forward will say
            with contextlib.suppress(Exception):
                model.set_experts_implementation("batched_mm")
            return
