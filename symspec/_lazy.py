"""The one lazy-export helper of symspec's packages: a package's ``__init__`` lists the
names it re-exports and the modules they live in, and each is imported on first use
(PEP 562's module ``__getattr__``), so that importing the package (``symspec --help``,
listing the alignment methods) costs nothing until a name is used.

>>> import types
>>> pkg = types.ModuleType("demo")
>>> getter, names = lazy_exports("demo", {"sqrt": "math", "join": ("os.path", "join"), "sep": "os"})
>>> names
['join', 'sep', 'sqrt']
>>> import sys; sys.modules["demo"] = pkg
>>> getter("sqrt")(9.0)
3.0
>>> "sqrt" in vars(pkg)  # cached on the package: the next access skips __getattr__
True
>>> del sys.modules["demo"]
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable, Iterable, Mapping
from typing import Any

#: where an exported name lives: a module (absolute, or relative to the package with a
#: leading dot), or (module, attribute) where the package exports it under another name
Target = str | tuple[str, str]


def lazy_exports(package: str, exports: Mapping[str, Target],
                 submodules: Iterable[str] = ()) -> tuple[Callable[[str], Any], list[str]]:
    """A module ``__getattr__`` for ``package`` serving ``exports`` (name -> where it
    lives), and the sorted ``__all__``. ``submodules`` are returned as modules when asked
    for by name before they were imported (``symspec.checker``)."""
    table = dict(exports)
    subs = frozenset(submodules)

    def __getattr__(name: str) -> Any:
        target = table.get(name)
        if target is None:
            if name in subs:
                return importlib.import_module(f"{package}.{name}")
            raise AttributeError(f"module '{package}' has no attribute '{name}'")
        module, attr = target if isinstance(target, tuple) else (target, name)
        value = getattr(importlib.import_module(module, package), attr)
        setattr(sys.modules[package], name, value)
        return value

    return __getattr__, sorted(table)
