"""GGUF checkpoints (llama.cpp's format) as model sources, read through transformers.

A ``.gguf`` file is accepted wherever a model is (``load_model("model.gguf")``, and so
``symspec check/infer/match/merge/barrier/universe model.gguf``). transformers' GGUF
loader rebuilds the model class from the file's metadata and dequantises every tensor
(F32, F16, BF16, Q8_0, Q4_K, ...) to a float dtype (float32 here). What transformers
leaves behind marks the model as "quantised with gguf", which ``save_pretrained``
refuses; that mark is removed, so the loaded model is an ordinary Hugging Face model
(format ``"hf"``): results computed from it (an aligned or merged model) are written as a
Hugging Face folder (``config.json`` + ``model.safetensors``). Nothing is written back as
GGUF: the weights are no longer quantised, and llama.cpp's ``convert_hf_to_gguf.py``
turns such a folder into a GGUF file again.

To convert a GGUF file into a Hugging Face folder once (for other tools too)::

    from symspec.loading import load_model, save_model

    loaded = load_model("model.gguf")  # or symspec.loading.gguf.load_gguf(path, dtype=torch.bfloat16)
    save_model(loaded, loaded.model.state_dict(), "model-hf")  # config.json + model.safetensors

Needs the ``gguf`` extra: ``pip install 'symspec[gguf]'`` (transformers, gguf and
accelerate, which transformers asks for to load a GGUF file). A model split into
several GGUF files is refused with how to merge them (llama.cpp's ``llama-gguf-split``).
"""

from __future__ import annotations

import contextlib
import os
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..errors import ModelLoadError
from .base import LoadedModel
from .usercode import describe_failure

INSTALL = "pip install 'symspec[gguf]'"


def _require(path: Path) -> Any:
    """The ``gguf`` module, after checking that transformers and accelerate are there too;
    one line naming the extra otherwise."""
    missing = []
    for module in ("gguf", "transformers", "accelerate"):
        try:
            __import__(module)
        except ImportError:
            missing.append(module)
    if missing:
        raise ModelLoadError(f"{path}: reading a GGUF file needs {', '.join(missing)}: {INSTALL}")
    import gguf  # optional: the gguf extra

    return gguf


def read_header(path: str | Path) -> tuple[str, Counter[str]]:
    """The architecture a GGUF file names (``general.architecture``) and how many tensors
    it stores in each type (``{"F32": 19, "Q8_0": 2}``), read without loading the weights;
    a file that is not a complete GGUF file (truncated, another format) is one
    :class:`ModelLoadError` line."""
    p = Path(path)
    gguf = _require(p)
    if p.stat().st_size == 0:
        raise ModelLoadError(f"{p}: the file is empty (0 bytes), not a GGUF checkpoint")
    try:
        reader = gguf.GGUFReader(str(p))
        field = reader.fields.get("general.architecture")
        arch = field.contents() if field is not None else None
        types = Counter(t.tensor_type.name for t in reader.tensors)
        split = reader.fields.get("split.count")
        shards = int(split.contents()) if split is not None else 1
    except Exception as e:  # bad magic, a header or tensor data cut short: numpy's words for it
        raise ModelLoadError(f"{p}: not a readable GGUF file, truncated or corrupt ({_first_line(e)})") from e
    if not isinstance(arch, str) or not arch:
        raise ModelLoadError(f"{p}: the GGUF file names no architecture (general.architecture); it cannot be rebuilt")
    if shards > 1:  # transformers reads one file: the other shards' tensors would be missing
        raise ModelLoadError(f"{p}: one shard of a GGUF model split in {shards} files; merge them first with llama.cpp's "
                             f"`llama-gguf-split --merge {p.name} merged.gguf` and give merged.gguf")
    if not types:
        raise ModelLoadError(f"{p}: the GGUF file holds no tensors")
    return arch, types


def _first_line(e: BaseException) -> str:
    lines = str(e).strip().splitlines()
    return f"{type(e).__name__}: {lines[0][:200]}" if lines else type(e).__name__


def _supported() -> list[str]:
    try:  # optional: the gguf extra
        from transformers.modeling_gguf_pytorch_utils import GGUF_SUPPORTED_ARCHITECTURES
    except ImportError:
        return []
    return [a for a in GGUF_SUPPORTED_ARCHITECTURES if a not in ("general", "tokenizer")]


def _unsupported(p: Path, arch: str) -> ModelLoadError:
    import transformers  # optional: the gguf extra

    known = _supported()
    listed = f" (it reads {', '.join(known)})" if known else ""
    return ModelLoadError(f"{p}: transformers {transformers.__version__} cannot read GGUF architecture '{arch}'{listed}; "
                          "a newer transformers may, else convert the model to a Hugging Face folder (config.json + "
                          "safetensors) with the tool that made the GGUF file")


def _model_class(config: Any) -> Any:
    """The transformers class for a config rebuilt from GGUF metadata: the one it names
    (``architectures``), else the causal LM for its model type (llama.cpp's models are
    language models), else a sequence-to-sequence LM (T5), else the bare model."""
    import transformers  # optional: the gguf extra

    for name in getattr(config, "architectures", None) or []:
        cls = getattr(transformers, name, None) if isinstance(name, str) and name.isidentifier() else None
        if isinstance(cls, type):
            return cls
    for auto in ("AutoModelForCausalLM", "AutoModelForSeq2SeqLM", "AutoModel"):
        factory = getattr(transformers, auto)
        with contextlib.suppress(Exception):
            if type(config) in factory._model_mapping:
                return factory
    return transformers.AutoModel


@contextlib.contextmanager
def _quiet_progress() -> Iterator[None]:
    """transformers draws progress bars on stderr while it dequantises (a plain tqdm) and
    loads the weights; a command's stderr is for errors and notes."""
    from transformers import modeling_gguf_pytorch_utils as utils  # optional: the gguf extra
    from transformers.utils import logging  # optional: the gguf extra

    bar = getattr(utils, "tqdm", None)
    shown = logging.is_progress_bar_enabled()
    if bar is not None:
        utils.tqdm = lambda iterable, *args, **kwargs: iterable  # type: ignore[attr-defined]
    logging.disable_progress_bar()
    try:
        yield
    finally:
        if bar is not None:
            utils.tqdm = bar  # type: ignore[attr-defined]
        if shown:
            logging.enable_progress_bar()


def _decimal(value: Any) -> Any:
    """A float that GGUF stored as float32 (``rms_norm_eps`` 1e-6 reads back as
    9.99999997e-07) as the shortest decimal with that float32 value (1e-06), so that
    the config matches the Hugging Face original's (a model merged with its GGUF copy
    would be warned about "different configs"); other values as they are. Floats that are
    not float32 numbers (a Python default such as 0.02) are left alone."""
    if isinstance(value, dict):
        return {k: _decimal(v) for k, v in value.items()}
    if isinstance(value, float) and np.isfinite(value) and float(np.float32(value)) == value:
        return float(str(np.float32(value)))
    return value


def _config_decimals(config: Any) -> None:
    for key, value in list(vars(config).items()):
        if not key.startswith("_") and isinstance(value, (float, dict)):
            with contextlib.suppress(AttributeError, TypeError, ValueError):
                setattr(config, key, _decimal(value))


def _dequantised(model: Any) -> None:
    """Drop the "quantised with gguf" mark transformers leaves on a GGUF-loaded model (its
    weights are plain float tensors by now): ``save_pretrained`` refuses a model with it,
    and the config must not say ``quantization_config`` when written."""
    for owner, attr in ((model, "hf_quantizer"), (model, "quantization_method"), (model, "_weight_conversions"),
                        (getattr(model, "config", None), "quantization_config")):
        if owner is not None and attr in vars(owner):
            delattr(owner, attr)
        elif owner is not None and getattr(owner, attr, None) is not None:
            with contextlib.suppress(AttributeError, TypeError):
                setattr(owner, attr, None)
    with contextlib.suppress(AttributeError, TypeError):
        model.is_quantized = False


def load_gguf(path: str | Path, *, dtype: torch.dtype = torch.float32) -> LoadedModel:
    """A GGUF file as a Hugging Face model, every tensor dequantised to ``dtype``.

    The result's format is ``"hf"`` (results are written as a Hugging Face folder) and
    its ``note`` says where it came from. Errors are one :class:`ModelLoadError` line: the
    ``gguf`` extra missing (how to install it), a file that is not a complete GGUF file,
    an architecture transformers does not read (named).
    """
    p = Path(path)
    if not p.is_file():
        raise ModelLoadError(f"{path}: no such file")
    arch, types = read_header(p)
    import transformers  # optional: the gguf extra
    from packaging.version import Version  # optional: comes with transformers

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    folder, name = str(p.resolve().parent), p.name
    try:
        config = transformers.AutoConfig.from_pretrained(folder, gguf_file=name, local_files_only=True)
    except Exception as e:
        if "not supported" in str(e):
            raise _unsupported(p, arch) from e
        raise ModelLoadError(f"{p}: transformers cannot rebuild the model's config from the GGUF metadata "
                             f"({describe_failure(e)})") from e
    _config_decimals(config)
    cls = _model_class(config)
    # transformers 4.56 renamed torch_dtype to dtype
    key = "dtype" if Version(transformers.__version__) >= Version("4.56") else "torch_dtype"
    try:
        with _quiet_progress():
            model = cls.from_pretrained(folder, gguf_file=name, config=config, local_files_only=True, **{key: dtype})
    except Exception as e:
        raise ModelLoadError(f"{p}: transformers could not load the GGUF file as {type(config).__name__.removesuffix('Config')} "
                             f"({describe_failure(e)})") from e
    _dequantised(model)
    model = model.to(dtype).eval()
    kinds = ", ".join(f"{n} {k}" for k, n in sorted(types.items()))
    note = (f"{p.name}: read from GGUF (architecture {arch}; tensors {kinds}) and dequantised to "
            f"{str(dtype).removeprefix('torch.')}; models computed from it are written as a Hugging Face folder "
            "(config.json + model.safetensors), not as GGUF")
    return LoadedModel(model, p, "hf", note=note)
