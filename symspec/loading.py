"""Loading and saving models: one loader for check, match, merge and the analyzers.

Accepted inputs (``load_model(path, factory=...)``):

- a **model file** ``model.py`` (see below);
- a **Hugging Face folder** (``config.json`` plus ``model.safetensors`` or
  ``pytorch_model.bin``): the class named in ``config.architectures`` is rebuilt from
  ``transformers`` and loaded offline;
- a **GGUF file** (``.gguf``, llama.cpp's format): read through transformers and
  dequantised to float32, then handled as a Hugging Face model (:mod:`symspec.gguf`);
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
(a Hugging Face folder stays one; a state dict stays one) and in the dtypes it was
stored in (``LoadedModel.dtypes``: a float16 checkpoint read into a float32 model file's
module is written as float16), atomically.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import inspect
import json
import os
import stat
import sys
import threading
import traceback
from collections.abc import Callable, Mapping
from pathlib import Path
from types import ModuleType
from typing import Any

import attrs
import torch

from .errors import ModelLoadError
from .io_util import read_small_file

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


class ExitCalled(SystemExit):
    """``os._exit(code)`` called by a user's code while :func:`user_code` guards it: a
    SystemExit (so that ``except Exception`` in that code does not swallow it, and every
    place that turns ``sys.exit`` into a located error does the same with it)."""


#: the guard of os._exit: how many user_code blocks run now (in any thread), the os._exit
#: they replaced and the process that replaced it (a forked child exits for real)
_guard_lock = threading.Lock()
_guard: dict[str, Any] = {"depth": 0, "exit": None, "pid": None}


def _refused_exit(code: int = 0) -> None:
    if os.getpid() != _guard["pid"]:
        _guard["exit"](code)
    raise ExitCalled(code)


@contextlib.contextmanager
def user_code(origin: str | Path, what: str) -> Any:
    """Run a user's code (a model file's import, ``build()``, ``example_inputs()``, a data
    hook) so that it cannot end the command or move it:

    - ``os._exit(code)`` raises :class:`ExitCalled` instead of ending the process with
      that code and no output (0 would read as success); the caller reports it like
      ``sys.exit``. A forked child (a data loader's worker) still exits for real, and a C
      extension that calls ``_exit`` itself is out of reach.
    - the working directory is restored afterwards when the code changed it (relative
      output paths mean the user's folder), with a ``note:`` on stderr naming ``origin``
      and ``what`` it was running.
    """
    try:
        cwd: str | None = os.getcwd()
    except OSError:  # the folder was deleted under us: nothing to restore
        cwd = None
    # one replacement for nested and concurrent blocks, put back by the last one to end
    with _guard_lock:
        if _guard["depth"] == 0:
            _guard.update(exit=os._exit, pid=os.getpid())
            os._exit = _refused_exit  # type: ignore[assignment]
        _guard["depth"] += 1
    try:
        yield
    finally:
        with _guard_lock:
            _guard["depth"] -= 1
            if _guard["depth"] == 0:
                os._exit = _guard["exit"]
        if cwd is not None:
            try:
                now: str | None = os.getcwd()
            except OSError:
                now = None
            if now != cwd:
                os.chdir(cwd)
                moved = f"to {now}" if now is not None else "to a folder that no longer exists"
                sys.stderr.write(f"note: {origin} changed the working directory {moved} ({what}); changed back to "
                                 f"{cwd}, where relative paths are read and written\n")


def describe_failure(e: BaseException) -> str:
    """One line for an exception raised by a user's code: its type and first line, or
    the exit code it asked for."""
    if isinstance(e, ExitCalled):
        return f"it called os._exit({e.code!r})"
    if isinstance(e, SystemExit):
        return f"it called sys.exit({'' if e.code is None else repr(e.code)})"
    lines = str(e).strip().splitlines()
    return f"{type(e).__name__}: {lines[0][:300]}" if lines else type(e).__name__


def where_in(e: BaseException, path: str | Path) -> str:
    """``path:LINE`` of the innermost frame of ``e``'s traceback in the file ``path``
    (where the user's code failed), else ``path``."""
    try:
        target = os.path.realpath(path)
        frames = traceback.extract_tb(e.__traceback__)
        line = next((f.lineno for f in reversed(frames) if os.path.realpath(f.filename) == target), None)
    except (OSError, ValueError):
        line = None
    return f"{path}:{line}" if line else str(path)


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
    # a FIFO waits for a writer, /dev/zero (or a link to it) never ends: refuse either
    # before the import system reads it
    read_small_file(p, "model file", error=ModelLoadError)
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
        with user_code(p, "at import"):
            spec.loader.exec_module(module)
    except (Exception, SystemExit) as e:
        # SystemExit too: a file that calls sys.exit() must not end the command with its
        # exit code (0 would read as success)
        del sys.modules[name]
        raise ModelLoadError(f"{where_in(e, p)}: importing the model file failed: {describe_failure(e)}") from e
    finally:
        if added:
            sys.path.remove(parent)
    return module


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


# ---------------------------------------------------------------------------------------


@attrs.define
class LoadedModel:
    """A model and where it came from, so that results can be written in its format."""

    model: torch.nn.Module
    source: Path
    format: str  # "modelfile" | "hf" | "state_dict" | "safetensors"
    model_file: ModelFile | None = None
    #: the dtype each floating-point tensor has where it is stored, where that is not the
    #: module's (a float16 checkpoint loaded into the float32 module of a model file):
    #: :func:`save_model` writes them back in it. None: the module's own.
    dtypes: dict[str, torch.dtype] | None = None
    #: where the model came from when ``format`` does not say it (a GGUF file read as a
    #: Hugging Face model, dequantised: :mod:`symspec.gguf`)
    note: str | None = None

    @property
    def name(self) -> str:
        return self.source.name

    def example_inputs(self, batch: int = 2, seed: int = 0, *, probe: bool = True) -> Any:
        """The model file's example inputs (for a Hugging Face folder: random ones from
        its config). With ``probe``, the model is run on them once, so that inputs it
        cannot take (a wrong shape, token ids outside the vocabulary) or an output with
        no floating-point tensor are reported here, naming the file, and not as a
        traceback from deep inside a check."""
        mf = self.model_file
        if mf is not None and (mf.attr("example_inputs") or mf.attr("example_input")) is not None:
            inputs = mf.example_inputs(batch=batch, seed=seed, model=self.model)
            origin = "its example inputs" if mf.path == self.source else f"the example inputs of {mf.path}"
        elif self.format == "hf":
            inputs = hf_example_inputs(self.model, batch=batch, seed=seed)
            origin = "example inputs drawn from its config"
        else:
            raise ModelLoadError(f"{self.source}: no example inputs; give a model file that defines example_inputs(model, batch, seed)")
        if probe:
            probe_forward(self.model, inputs, f"{self.source}", origin, mf.path if mf is not None else None)
        return inputs

    def spec_hint(self) -> str | None:
        return self.model_file.spec_hint() if self.model_file is not None else None


def probe_forward(model: torch.nn.Module, inputs: Any, name: str, origin: str = "its example inputs",
                  model_file: Path | None = None) -> None:
    """Run ``model`` once on ``inputs`` (no gradients, in eval mode, restored after) and
    raise :class:`ModelLoadError` naming ``name`` when the forward fails or returns no
    floating-point tensor (a check would compare nothing and pass)."""
    from .checker import call_forward, flatten_outputs

    training = model.training
    model.eval()  # no batch-norm statistics are updated by the probe
    try:
        with user_code(model_file or name, f"in the model's forward on {origin}"):
            out = call_forward(model, inputs)
    except (Exception, SystemExit) as e:
        where = where_in(e, model_file) if model_file is not None else ""
        at = f" (at {where})" if where and where != str(model_file) else ""
        raise ModelLoadError(f"{name}: the model's forward failed on {origin}{at}: {describe_failure(e)}") from e
    finally:
        model.train(training)
    if not flatten_outputs(out):
        raise ModelLoadError(f"{name}: the model's forward returned {_kind(out)} on {origin}; expected a tensor "
                             "(or a tuple, dict or model output holding floating-point tensors)")


def _kind(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"a {value.dtype} tensor"
    return "None" if value is None else f"a {type(value).__name__}"


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
    if path.is_file() and path.stat().st_size == 0:
        raise ModelLoadError(f"{path}: the file is empty (0 bytes), not a checkpoint")
    if path.suffix in SAFETENSORS_SUFFIXES:
        from safetensors.torch import load_file

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


def _load_hf(path: Path) -> torch.nn.Module:
    cfg_path = path / "config.json"
    try:
        import transformers
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
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers.utils import logging as hf_logging

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
    _refuse_integer_weights(path, model)
    _aligned_experts(model)
    return model.eval()


def _refuse_integer_weights(folder: Path, model: torch.nn.Module) -> None:
    """from_pretrained casts integer tensors into floating-point parameters without a word:
    refuse a folder whose safetensors files hold integer values where the model has
    floating-point weights (read from the files' headers; the model's own integer buffers
    are fine), as :func:`load_state_dict_into` does for state dicts."""
    own = model.state_dict()
    floats = {k for k, v in own.items() if v.is_floating_point()}
    for file in sorted(folder.glob("*.safetensors")):
        from safetensors import safe_open

        try:
            with safe_open(str(file), "pt") as f:
                dtypes = {k: f.get_slice(k).get_dtype() for k in f.keys()}  # noqa: SIM118 (safe_open is no dict)
        except Exception:  # unreadable: from_pretrained already read it, or will say
            continue
        for k in (k for k in own if k in dtypes or k.partition(".")[2] in dtypes):
            dt = dtypes.get(k) or dtypes[k.partition(".")[2]]
            if k in floats and not dt.startswith(("F", "BF", "C")):
                name = k if k in dtypes else k.partition(".")[2]
                what = _SAFETENSORS_DTYPES.get(dt, dt)
                raise ModelLoadError(f"{file}: {name} holds {what} weights where the model has "
                                     f"{str(own[k].dtype).removeprefix('torch.')}; save the floating-point weights "
                                     "(the checkpoint's values were cast or it is another file)")


#: safetensors' dtype names, as torch writes them
_SAFETENSORS_DTYPES = {"I64": "torch.int64", "I32": "torch.int32", "I16": "torch.int16", "I8": "torch.int8",
                       "U8": "torch.uint8", "U16": "torch.uint16", "U32": "torch.uint32", "U64": "torch.uint64",
                       "BOOL": "torch.bool"}


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


def _refuse_special(p: Path) -> None:
    """A model path that is a FIFO or a device is refused before anything opens it:
    ``torch.load`` of a FIFO waits for a writer forever, of ``/dev/zero`` until memory
    runs out."""
    mode = p.stat().st_mode
    if not stat.S_ISREG(mode):
        kind = "a pipe (FIFO)" if stat.S_ISFIFO(mode) else "a device" if stat.S_ISCHR(mode) or stat.S_ISBLK(mode) \
            else "not a regular file"
        raise ModelLoadError(f"{p}: is {kind}, not a model file or checkpoint (a regular file)")


def load_model(path: str | Path, *, factory: str | Path | None = None) -> LoadedModel:
    """Load a model from a model file, a Hugging Face folder or a checkpoint (+ factory)."""
    p = Path(path)
    if not p.exists():
        raise ModelLoadError(f"{path}: no such file or folder")
    if p.is_dir():
        if (p / "config.json").exists():
            return LoadedModel(_load_hf(p), p, "hf")
        raise ModelLoadError(f"{path}: a folder without config.json is not a Hugging Face model")
    _refuse_special(p)
    if p.suffix.lower() == ".gguf":
        from .gguf import load_gguf

        return load_gguf(p)
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
        return LoadedModel(mf.model, p, fmt, mf, {k: v.dtype for k, v in sd.items() if v.is_floating_point()})
    raise ModelLoadError(f"{path}: unknown model format (expected model.py, a Hugging Face folder, .gguf, .pt/.pth/.bin or .safetensors)")


#: config fields that do not change what an evaluated model computes: where it came
#: from, its storage precision, output and cache switches, label names, generation token
#: ids, and what only training reads (initialisation, dropout and layer drop are off in
#: eval mode)
HARMLESS_CONFIG_FIELDS = frozenset({
    "_name_or_path", "name_or_path", "architectures", "dtype", "torch_dtype", "transformers_version", "_commit_hash",
    "_attn_implementation", "_attn_implementation_autoset", "_attn_implementation_internal", "use_cache",
    "output_attentions", "output_hidden_states", "return_dict", "id2label", "label2id", "bos_token_id",
    "eos_token_id", "decoder_start_token_id", "initializer_range", "initializer_factor", "layerdrop",
    "problem_type", "finetuning_task", "tokenizer_class", "task_specific_params", "chunk_size_feed_forward",
    "gradient_checkpointing",
})


def config_differences(a: Any, b: Any) -> dict[str, tuple[Any, Any]]:
    """The config fields whose values differ between two models: ``{field: (value in a,
    value in b)}``, nested fields dotted (``rope_parameters.rope_theta``), in name order.

    ``a`` and ``b`` are :class:`LoadedModel` s, modules (their ``.config``) or configs (a
    Hugging Face config, a mapping, a dataclass or attrs instance). Two models with the
    same weight shapes may still compute different functions (another head count, norm
    epsilon, activation or rotary base), so averaging their weights means nothing; this
    names what differs. Fields in :data:`HARMLESS_CONFIG_FIELDS` and dropout rates are
    ignored. A model without a config has nothing to compare: ``{}``.

    >>> config_differences({"n_head": 2, "dropout": 0.1, "d": 8}, {"n_head": 4, "dropout": 0.0, "d": 8})
    {'n_head': (2, 4)}
    """
    import dataclasses

    def as_dict(obj: Any) -> dict[str, Any] | None:
        if isinstance(obj, LoadedModel):
            obj = obj.model
        if isinstance(obj, torch.nn.Module):
            obj = getattr(obj, "config", None)
        if obj is None:
            return None
        if isinstance(obj, Mapping):
            return dict(obj)
        if callable(getattr(obj, "to_dict", None)):  # Hugging Face configs, sub-configs included
            return dict(obj.to_dict())
        if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
            return dataclasses.asdict(obj)
        if attrs.has(type(obj)):
            return attrs.asdict(obj)
        fields = getattr(obj, "__dict__", None)
        return {k: v for k, v in fields.items() if not k.startswith("__")} if isinstance(fields, dict) else None

    def flat(d: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
        out: dict[str, Any] = {}
        for k, v in d.items():
            key = str(k)
            if key in HARMLESS_CONFIG_FIELDS or "dropout" in key:
                continue
            if isinstance(v, Mapping) and v:
                out.update(flat(v, f"{prefix}{key}."))
            else:
                out[f"{prefix}{key}"] = v
        return out

    def same(x: Any, y: Any) -> bool:
        try:
            return bool(x == y)
        except Exception:  # a tensor or array in a config: compare identities, do not fail
            return x is y

    da, db = as_dict(a), as_dict(b)
    if da is None or db is None:
        return {}
    fa, fb = flat(da), flat(db)
    absent = "<absent>"
    return {k: (fa.get(k, absent), fb.get(k, absent)) for k in sorted(set(fa) | set(fb))
            if not same(fa.get(k, absent), fb.get(k, absent))}


def _unique_state(model: torch.nn.Module, sd: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v.detach().contiguous().cpu() for k, v in sd.items()}


def source_dtype(model: Any) -> str | None:
    """The one dtype (``"bfloat16"``) a model's floating-point tensors are stored in: a
    :class:`LoadedModel`'s checkpoint (else its module), a module or a state dict; None
    when they are mixed or there are none."""
    if isinstance(model, LoadedModel) and model.dtypes:
        kinds = set(model.dtypes.values())
    else:
        if isinstance(model, LoadedModel):
            model = model.model
        sd = model.state_dict() if isinstance(model, torch.nn.Module) else model
        kinds = {v.dtype for v in sd.values() if isinstance(v, torch.Tensor) and v.is_floating_point()}
    return str(next(iter(kinds))).removeprefix("torch.") if len(kinds) == 1 else None


def stored_dtype(dtypes: Mapping[str, torch.dtype] | None, name: str) -> torch.dtype | None:
    """The dtype to write floating-point entry ``name`` in: its own in ``dtypes``, else
    (a tied twin the checkpoint stored once) the one dtype of all of them, if there is one."""
    if not dtypes:
        return None
    if name in dtypes:
        return dtypes[name]
    kinds = set(dtypes.values())
    return next(iter(kinds)) if len(kinds) == 1 else None


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
    from .outputs import atomic_write, atomic_write_bytes

    if loaded.format == "hf":
        import copy

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
        from safetensors.torch import save

        # safetensors refuses shared storage: every entry is its own contiguous copy here.
        atomic_write_bytes(out, save({k: v.clone() for k, v in sd.items()}))
    else:
        import io

        buf = io.BytesIO()
        torch.save(sd, buf)
        atomic_write_bytes(out, buf.getvalue())
    return out
