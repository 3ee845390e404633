"""Loading and saving models: one loader for check, match, merge and the analyzers.

Accepted inputs (``load_model(path, factory=...)``):

- a **model file** ``model.py`` (see below);
- a **Hugging Face folder** (``config.json`` plus ``model.safetensors`` or
  ``pytorch_model.bin``): the class named in ``config.architectures`` is rebuilt from
  ``transformers`` and loaded offline;
- a **plain PyTorch state dict** (``.pt``, ``.pth``, ``.bin``; read with
  ``weights_only=True``, never unpickling arbitrary objects) or a **safetensors file**,
  together with ``factory``: a model file whose ``build()`` makes the module to load
  it into.

The model-file convention (``symspec check model.py``): a Python file that defines

- ``build(**overrides)`` returning an ``nn.Module`` (or a module-level ``model`` object);
- ``example_inputs(model, batch=2, seed=0)`` returning the inputs of ``model.forward``:
  a tensor, a tuple of positional inputs, or a dict of keyword inputs;
- optionally ``SPEC``, a spec path (relative to the file) or a built-in spec name;
- optionally ``CHECK_RTOL``, tolerances for ``symspec check`` ({"float32": 1e-3});
- optionally ``loss(output, targets)`` and data hooks, used by the analyzers.

``save_model(loaded, state_dict, out)`` writes a model in the format it was read in
(a Hugging Face folder stays one; a state dict stays one), atomically.
"""

from __future__ import annotations

import hashlib
import importlib.util
import inspect
import json
import os
import shutil
import sys
import tempfile
import traceback
from collections.abc import Callable, Mapping
from pathlib import Path
from types import ModuleType
from typing import Any

import attrs
import torch

from .errors import ModelLoadError

STATE_DICT_SUFFIXES = (".pt", ".pth", ".bin", ".ckpt")
SAFETENSORS_SUFFIXES = (".safetensors",)


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
        params = inspect.signature(fn).parameters
        kwargs: dict[str, Any] = {}
        if "batch" in params:
            kwargs["batch"] = batch
        if "seed" in params:
            kwargs["seed"] = seed
        try:
            return fn(model if model is not None else self.model, **kwargs)
        except Exception as e:
            raise ModelLoadError(f"{self.path}: example_inputs failed: {type(e).__name__}: {e}") from e

    def spec_hint(self) -> str | None:
        spec = self.attr("SPEC")
        if spec is None:
            return None
        p = Path(str(spec))
        if not p.is_absolute() and (self.path.parent / p).exists():
            return str(self.path.parent / p)
        return str(spec)


def import_file(path: str | Path) -> ModuleType:
    """Import a Python file as a fresh module (its folder is importable meanwhile)."""
    p = Path(path)
    if not p.exists():
        raise ModelLoadError(f"{path}: no such file")
    if p.is_dir() or p.suffix != ".py":
        raise ModelLoadError(f"{path}: expected a Python model file (model.py)")
    digest = hashlib.sha1(str(p.resolve()).encode()).hexdigest()[:10]
    name = f"symspec_model_{p.stem}_{digest}"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, p)
    if spec is None or spec.loader is None:
        raise ModelLoadError(f"{path}: cannot be imported")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    parent = str(p.resolve().parent)
    added = parent not in sys.path
    if added:
        sys.path.insert(0, parent)
    try:
        spec.loader.exec_module(module)
    except Exception as e:
        del sys.modules[name]
        tb = traceback.extract_tb(e.__traceback__)
        where = next((f"{f.filename}:{f.lineno}" for f in reversed(tb) if f.filename.endswith(p.name)), str(p))
        raise ModelLoadError(f"{where}: importing the model file failed: {type(e).__name__}: {e}") from e
    finally:
        if added:
            sys.path.remove(parent)
    return module


def load_model_file(path: str | Path) -> ModelFile:
    module = import_file(path)
    build = getattr(module, "build", None)
    if callable(build):
        try:
            model = build()
        except Exception as e:
            raise ModelLoadError(f"{path}: build() failed: {type(e).__name__}: {e}") from e
    else:
        model = getattr(module, "model", None)
        if model is None:
            raise ModelLoadError(f"{path} defines neither build() nor a module-level 'model'")
    if not isinstance(model, torch.nn.Module):
        raise ModelLoadError(f"{path}: the model is a {type(model).__name__}, not a torch.nn.Module")
    return ModelFile(Path(path), module, model)


# ---------------------------------------------------------------------------------------


@attrs.define
class LoadedModel:
    """A model and where it came from, so that results can be written in its format."""

    model: torch.nn.Module
    source: Path
    format: str  # "modelfile" | "hf" | "state_dict" | "safetensors"
    model_file: ModelFile | None = None

    @property
    def name(self) -> str:
        return self.source.name

    def example_inputs(self, batch: int = 2, seed: int = 0) -> Any:
        if self.model_file is not None and (self.model_file.attr("example_inputs") or self.model_file.attr("example_input")) is not None:
            return self.model_file.example_inputs(batch=batch, seed=seed, model=self.model)
        if self.format == "hf":
            return hf_example_inputs(self.model, batch=batch, seed=seed)
        raise ModelLoadError(f"{self.source}: no example inputs; give a model file that defines example_inputs(model, batch, seed)")

    def spec_hint(self) -> str | None:
        return self.model_file.spec_hint() if self.model_file is not None else None


def hf_example_inputs(model: torch.nn.Module, batch: int = 2, seed: int = 0, length: int = 16) -> dict[str, torch.Tensor]:
    """Random inputs for a Hugging Face model, from its config and main input name."""
    cfg = getattr(model, "config", None)
    name = getattr(model, "main_input_name", "input_ids")
    g = torch.Generator().manual_seed(seed)
    if name == "input_ids":
        vocab = getattr(cfg, "vocab_size", None)
        if vocab is None:
            raise ModelLoadError(f"{type(model).__name__}: its config has no vocab_size to draw input ids from")
        limit = getattr(cfg, "max_position_embeddings", None) or getattr(cfg, "n_positions", None) or length
        inputs: dict[str, torch.Tensor] = {"input_ids": torch.randint(vocab, (batch, min(length, limit)), generator=g)}
        if "use_cache" in inspect.signature(model.forward).parameters:
            inputs["use_cache"] = False  # type: ignore[assignment]
        return inputs
    if name == "pixel_values":
        size = getattr(cfg, "image_size", 224)
        size = size if isinstance(size, int) else size[0]
        ch = getattr(cfg, "num_channels", 3)
        return {"pixel_values": torch.randn(batch, ch, size, size, generator=g)}
    raise ModelLoadError(f"{type(model).__name__}: no default inputs for main input '{name}'; use a model file with example_inputs")


def _read_state_dict(path: Path) -> dict[str, torch.Tensor]:
    if path.suffix in SAFETENSORS_SUFFIXES:
        from safetensors.torch import load_file

        try:
            return load_file(str(path))
        except Exception as e:
            raise ModelLoadError(f"{path}: not a readable safetensors file: {e}") from e
    try:
        obj = torch.load(str(path), map_location="cpu", weights_only=True)
    except Exception as e:
        raise ModelLoadError(f"{path}: cannot be read as a state dict with weights_only=True ({type(e).__name__}: {str(e).splitlines()[0][:200]})") from e
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
    from .binding import named_tensors

    _, ties = named_tensors(model)
    for group in ties:
        present = [n for n in group if n in sd]
        if len(present) > 1 and any(not torch.equal(sd[present[0]], sd[n]) for n in present[1:]):
            from .transforms.canonical import untie_module

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
    model.load_state_dict(sd, strict=False)


def _load_hf(path: Path) -> torch.nn.Module:
    cfg_path = path / "config.json"
    try:
        import transformers
    except ImportError as e:
        raise ModelLoadError(f"{path}: a Hugging Face model folder needs transformers (pip install 'symspec[hf]')") from e
    try:
        archs = json.loads(cfg_path.read_text()).get("architectures") or []
    except (OSError, json.JSONDecodeError) as e:
        raise ModelLoadError(f"{cfg_path}: unreadable config ({e})") from e
    if not archs:
        raise ModelLoadError(f"{cfg_path}: no 'architectures' entry names the model class")
    cls = getattr(transformers, archs[0], None)
    if cls is None:
        raise ModelLoadError(f"{cfg_path}: transformers has no class {archs[0]}")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    try:
        model = cls.from_pretrained(str(path), local_files_only=True)
    except Exception as e:
        raise ModelLoadError(f"{path}: {archs[0]}.from_pretrained failed: {type(e).__name__}: {str(e).splitlines()[0][:300]}") from e
    return model.eval()


def load_model(path: str | Path, *, factory: str | Path | None = None) -> LoadedModel:
    """Load a model from a model file, a Hugging Face folder or a checkpoint (+ factory)."""
    p = Path(path)
    if not p.exists():
        raise ModelLoadError(f"{path}: no such file or folder")
    if p.is_dir():
        if (p / "config.json").exists():
            return LoadedModel(_load_hf(p), p, "hf")
        raise ModelLoadError(f"{path}: a folder without config.json is not a Hugging Face model")
    if p.suffix == ".py":
        mf = load_model_file(p)
        return LoadedModel(mf.model, p, "modelfile", mf)
    if p.suffix in STATE_DICT_SUFFIXES + SAFETENSORS_SUFFIXES:
        if factory is None:
            raise ModelLoadError(f"{path}: a state dict needs the model it belongs to; pass --model model.py (a file with build())")
        mf = load_model_file(factory)
        sd = _read_state_dict(p)
        load_state_dict_into(mf.model, sd, str(p))
        fmt = "safetensors" if p.suffix in SAFETENSORS_SUFFIXES else "state_dict"
        return LoadedModel(mf.model, p, fmt, mf)
    raise ModelLoadError(f"{path}: unknown model format (expected model.py, a Hugging Face folder, .pt/.pth/.bin or .safetensors)")


def _unique_state(model: torch.nn.Module, sd: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v.detach().contiguous().cpu() for k, v in sd.items()}


def save_model(loaded: LoadedModel, state_dict: Mapping[str, torch.Tensor], out: str | Path, *,
               model: torch.nn.Module | None = None, overwrite: bool = False) -> Path:
    """Write ``state_dict`` as a model in ``loaded``'s format at ``out``, atomically.

    ``model`` is the module the weights belong to (default: ``loaded.model``); for a
    Hugging Face model it must be of the same class, and the folder is written with
    ``save_pretrained``. Refuses to overwrite an existing path unless ``overwrite``.
    """
    out = Path(out)
    if out.exists() and not overwrite:
        raise ModelLoadError(f"{out} exists; refusing to overwrite it")
    target = model if model is not None else loaded.model
    if loaded.format == "hf":
        import copy

        m = copy.deepcopy(target)
        load_state_dict_into(m, state_dict, str(out))
        parent = out.parent
        parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=parent))
        try:
            m.save_pretrained(str(tmp), safe_serialization=True)
            if out.exists():
                shutil.rmtree(out) if out.is_dir() else out.unlink()
            os.replace(tmp, out)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        return out
    from .io_util import atomic_write_bytes

    sd = _unique_state(target, state_dict)
    if loaded.format == "safetensors" or out.suffix in SAFETENSORS_SUFFIXES:
        from safetensors.torch import save

        # safetensors refuses shared storage: every entry is its own contiguous copy here.
        atomic_write_bytes(out, save({k: v.clone() for k, v in sd.items()}))
    else:
        import io

        buf = io.BytesIO()
        torch.save(sd, buf)
        atomic_write_bytes(out, buf.getvalue())
    return out
