"""Built-in specs, shipped as package data in ``symspec.specs`` (the repository's specs/)."""

from __future__ import annotations

import functools
from importlib import resources
from pathlib import Path

import yaml

#: how errors cite a built-in spec (``builtin:gpt2:14:5: ...``): its file is inside the
#: installed package, not at the repository's specs/ path a user would look for
BUILTIN_PREFIX = "builtin:"


def _root() -> Path:
    return Path(str(resources.files("symspec.specs")))


def builtin_names() -> list[str]:
    return sorted(p.stem for p in _root().glob("*.yaml"))


def builtin_path(name: str) -> Path | None:
    p = _root() / f"{name}.yaml"
    return p if p.is_file() else None


@functools.lru_cache(maxsize=1)
def _headers() -> dict[str, dict]:
    out = {}
    for name in builtin_names():
        path = builtin_path(name)
        assert path is not None
        try:
            doc = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
        except yaml.YAMLError:
            doc = {}
        out[name] = {"models": list(doc.get("models") or []), "description": doc.get("description", "")}
    return out


def builtin_index() -> dict[str, dict]:
    """name -> {models, description} without validating every spec."""
    return dict(_headers())


def specs_for_class(class_name: str) -> list[str]:
    """Built-in specs whose ``models`` list names this class."""
    return [name for name, h in _headers().items() if class_name in h["models"]]
