"""A universe run's inputs: the models (paths, globs, list files, modules, state dicts)
and the reference model, bound to the spec, that every other model must match.

>>> model_key(3, 2, "runs/seed3/model.pt")
'03-model'
"""

from __future__ import annotations

import glob
import hashlib
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import attrs
import torch

from .. import loading
from ..binding import BoundSpec, bind
from ..errors import SymspecInputError
from ..io_util import read_small_file
from ..loading import LoadedModel
from ..solvers import parse_restriction
from ..spec import Spec, load_spec
from ..statedict import widen, working_dtype
from ..transforms import canonicalize_model, canonicalize_state_dict
from .errors import UniverseError


def expand_models(args: Sequence[str | Path]) -> list[str]:
    """Model arguments as paths: globs (``runs/*/model.pt``, expanded here when the
    shell did not) and list files (``@models.txt``: one path or glob a line, ``#``
    comments, relative to the list file's folder). Order is kept; globs sort."""
    out: list[str] = []
    for arg in args:
        text = str(arg)
        if text.startswith("@"):
            listing = Path(text[1:])
            raw = read_small_file(listing, "list of models", error=UniverseError)
            try:
                content = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise UniverseError(f"{text}: not a text list of model paths (byte {e.start} is not UTF-8; "
                                    "is it a model rather than a list?)") from None
            if "\0" in content:  # a path cannot hold NUL (os calls refuse it): binary data
                raise UniverseError(f"{text}: not a text list of model paths (it holds NUL bytes; is it a model rather than a list?)")
            lines = content.splitlines()
            entries = [ln.split("#", 1)[0].strip() for ln in lines]
            entries = [e if Path(e).is_absolute() else str(listing.parent / e) for e in entries if e]
            if not entries:
                raise UniverseError(f"{text}: the list of models is empty")
            nested = [e for e in entries if Path(e).name.startswith("@")]
            if nested:
                raise UniverseError(f"{text}: a list of models cannot name another list ({nested[0]})")
            out += expand_models(entries)
        elif glob.has_magic(text):
            found = sorted(glob.glob(text, recursive=True))
            if not found:
                raise UniverseError(f"{text}: no file matches")
            out += found
        else:
            out.append(text)
    return out


@attrs.frozen
class Source:
    """One input model: ``name`` as given (a path, or ``model{i}``), ``path`` when it is a
    file or folder to load, else ``obj`` (a module, a LoadedModel or a state dict)."""

    name: str
    path: str | None
    obj: Any = None


def model_sources(models: Sequence[Any]) -> list[Source]:
    """The models as :class:`Source` values; a path that does not exist is refused."""
    out: list[Source] = []
    missing = []
    for i, m in enumerate(models):
        if isinstance(m, (str, Path)):
            if not Path(m).exists():
                missing.append(str(m))
            out.append(Source(str(m), str(m)))
        else:
            out.append(Source(str(m.source) if isinstance(m, LoadedModel) else f"model{i}", None, m))
    if missing:
        raise UniverseError(f"no such file or folder: {', '.join(missing)}")
    return out


def start_index(start: int | str, names: Sequence[str]) -> int:
    """The start model's index, from an index or a model's name as given."""
    if isinstance(start, str):
        matches = [i for i, n in enumerate(names) if n == start]
        if not matches:
            raise UniverseError(f"--start {start!r} is none of the models")
        start = matches[0]
    if not 0 <= start < len(names):
        raise UniverseError(f"start must name one of the {len(names)} models, got {start}")
    return start


#: a model key's file stem at most: keys name files (``KEY.elements.safetensors``, the
#: outputs' ``aligned/KEY.pt``) that must stay within the file system's name limit
MAX_KEY_STEM = 100


def model_key(index: int, width: int, name: str) -> str:
    """A unique file-safe name for a model: its index, then its file's stem."""
    stem = Path(name.rstrip("/")).name
    for suffix in (".safetensors", ".pt", ".pth", ".bin", ".ckpt", ".py", ".gguf"):
        stem = stem.removesuffix(suffix)
    safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in stem) or "model"
    if len(safe) > MAX_KEY_STEM:  # a long file name: its start and a hash of it, a legal file name still
        safe = f"{safe[:MAX_KEY_STEM - 13]}-{hashlib.sha256(stem.encode()).hexdigest()[:12]}"
    return f"{index:0{width}d}-{safe}"


def model_keys(names: Sequence[str]) -> list[str]:
    width = max(2, len(str(len(names) - 1)))
    return [model_key(i, width, n) for i, n in enumerate(names)]


def fingerprint_path(p: Path) -> list[Any]:
    """A file's (or a folder's files') path, size and modification time."""
    if p.is_dir():
        return [str(p.resolve()), *([f.name, f.stat().st_size, f.stat().st_mtime_ns] for f in sorted(p.iterdir()) if f.is_file())]
    st = p.stat()
    return [str(p.resolve()), st.st_size, st.st_mtime_ns]


def fingerprint_state(sd: Mapping[str, torch.Tensor]) -> str:
    """A hash of a state dict's names, dtypes, shapes and bytes."""
    h = hashlib.sha256()
    for k in sorted(sd):
        v = sd[k].detach().to("cpu").contiguous()
        h.update(k.encode())
        h.update(str(v.dtype).encode())
        h.update(str(tuple(v.shape)).encode())
        h.update(v.view(torch.uint8).numpy().tobytes() if v.numel() else b"")
    return h.hexdigest()


def state_of(obj: Any) -> dict[str, torch.Tensor]:
    """The (detached) state dict of a module, a LoadedModel or a state dict."""
    if isinstance(obj, torch.nn.Module):
        return {k: v.detach() for k, v in obj.state_dict().items()}
    if hasattr(obj, "model") and isinstance(obj.model, torch.nn.Module):
        return {k: v.detach() for k, v in obj.model.state_dict().items()}
    return dict(obj)


def module_of(obj: Any) -> torch.nn.Module | None:
    """The module of a module or a LoadedModel; None for a state dict."""
    if isinstance(obj, torch.nn.Module):
        return obj
    m = getattr(obj, "model", None)
    return m if isinstance(m, torch.nn.Module) else None


def fingerprint(source: Source) -> Any:
    """What identifies a model's content for resuming: a file's path, size and time, or
    a hash of an in-memory model's tensors."""
    return fingerprint_path(Path(source.path)) if source.path is not None else fingerprint_state(state_of(source.obj))


# --------------------------------------------------------------------------- the reference


@attrs.define
class Reference:
    """The start model: the spec bound to it (``bound``; every model must have its
    problem), the searched restriction (``modes``), its canonical state in the working
    ``dtype``, and its module in canonical form (``canonical_model``, which the merged
    model loads into; None for state dicts). ``loaded``: its LoadedModel when it came
    from a file (the merged model keeps its format)."""

    name: str
    loaded: Any
    module: torch.nn.Module | None
    state: dict[str, torch.Tensor]
    bound: Any  # symspec.binding.BoundSpec
    modes: dict[str, str]
    canonical: dict[str, torch.Tensor]
    dtype: torch.dtype
    canonical_model: torch.nn.Module | None


def _bind(spec: Any, target: Any, config: Any, name: str) -> Any:
    if isinstance(spec, BoundSpec):
        return spec
    spec_obj = spec if isinstance(spec, Spec) else load_spec(spec)
    try:
        return bind(spec_obj, target, config=config)
    except SymspecInputError as e:
        raise UniverseError(f"{name}: {e}") from e


def load_reference(source: Source, spec: Any, *, factory: str | Path | None, config: Any,
                   groups: str | Mapping[str, str] | None, dtype: torch.dtype | None) -> Reference:
    """Load and bind the start model and bring it into canonical form. float16/bfloat16
    models are canonicalised and matched in float32 (see ``working_dtype``); the outputs
    are written back in each model's own dtype."""
    loaded, obj = None, source.obj
    if source.path is not None:
        loaded = obj = loading.load_model(source.path, factory=factory)
    elif isinstance(obj, LoadedModel):
        loaded = obj
    module, state = module_of(obj), state_of(obj)
    bound = _bind(spec, module if module is not None else state, config, source.name)
    modes = parse_restriction(groups, bound.problem)
    canonical = canonicalize_state_dict(bound, widen(state))
    work = dtype or next((working_dtype(canonical[p].dtype) for p in bound.problem.params
                          if canonical[p].is_floating_point()), torch.float32)
    canonical = {k: (v.to(work) if v.is_floating_point() else v) for k, v in canonical.items()}
    canonical_model = canonicalize_model(bound, module) if module is not None else None
    if canonical_model is not None and work != next(iter(canonical_model.parameters())).dtype:
        canonical_model = canonical_model.to(work)
    return Reference(source.name, loaded, module, state, bound, dict(modes), canonical, work, canonical_model)


__all__ = ["Reference", "Source", "expand_models", "fingerprint", "load_reference", "model_keys", "model_sources",
           "module_of", "start_index", "state_of"]
