"""The registry of alignment methods: the only place that knows which methods exist.

Everything that offers a choice of method reads it from here: :func:`symspec.align`,
universe matching (each round aligns with a registered method), the barrier analyzers
(``--align``), the CLI (``symspec match --method``) and the benchmarks. A method
registered in this process, by :func:`register_method` or by an installed package that
declares an entry point in the group ``symspec.methods`` (a :class:`Method`, or a
callable returning one), is offered everywhere with no other change. symspec's own
extensions (universe and learned matching, the width lift, certificates) register
themselves the same way, from the group ``symspec.extensions``.

>>> from symspec.alignment import get_method, method_names
>>> "weight" in method_names() and get_method("weight").label
'weight matching'
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator
from importlib.metadata import entry_points

from ..errors import SymspecInputError, suggest
from .builtin import BUILTIN
from .protocol import Method

ENTRY_POINT_GROUP = "symspec.methods"
#: modules that extend alignment (methods, align() stages, the certifier) when imported
EXTENSION_GROUP = "symspec.extensions"

_METHODS: dict[str, Method] = {}
_entry_points_loaded = False


def register_method(method: Method, *, replace: bool = False) -> Method:
    """Offer ``method`` under ``method.name`` everywhere, and return it. A name already
    taken is refused unless ``replace``."""
    if not isinstance(method, Method):
        raise TypeError(f"{method!r} does not implement symspec.alignment.Method "
                        "(name, label, canonical, needs_data, needs_module, groups, align())")
    name = method.name
    if not name or not name.replace("-", "").replace("_", "").replace("+", "").isalnum():
        raise ValueError(f"method names are words joined by - _ or +, got {name!r}")
    if name in _METHODS and not replace and _METHODS[name] is not method:
        raise ValueError(f"an alignment method '{name}' is already registered (pass replace=True)")
    _METHODS[name] = method
    return method


def unregister_method(name: str) -> None:
    """Withdraw a method (tests that register a toy one clean up with this)."""
    _METHODS.pop(name, None)


@contextlib.contextmanager
def registered(method: Method) -> Iterator[Method]:
    """``with registered(m):`` offers ``m`` for the duration of the block."""
    previous = _METHODS.get(method.name)
    register_method(method, replace=True)
    try:
        yield method
    finally:
        if previous is None:
            unregister_method(method.name)
        else:
            _METHODS[method.name] = previous


def load_plugins() -> None:
    """The built-in methods, then the extensions (entry-point group
    ``symspec.extensions``: modules that register methods and align() hooks when imported,
    :mod:`.hooks`), then the installed method plugins (``symspec.methods``); once per
    process (a worker process of :mod:`symspec.runtime` too: it loads them on its first
    method look-up)."""
    global _entry_points_loaded
    if _entry_points_loaded:
        return
    _entry_points_loaded = True
    extensions = entry_points(group=EXTENSION_GROUP)
    if not extensions:  # the metadata of another install of symspec is found first (a stale *.egg-info)
        warnings.warn("symspec's extensions (universe, learned, width, certify) are not registered: no "
                      f"'{EXTENSION_GROUP}' entry points in the installed metadata; reinstall symspec "
                      "(pip install -e .), and remove a stale symspec.egg-info from the working directory",
                      stacklevel=2)
    for ep in extensions:
        try:
            ep.load()
        except Exception as e:  # a broken extension must not take the built-in methods down
            warnings.warn(f"symspec extension {ep.name!r} ({ep.value}) failed to load: {e}", stacklevel=2)
    for ep in entry_points(group=ENTRY_POINT_GROUP):
        try:
            obj = ep.load()
            register_method(obj if isinstance(obj, Method) else obj(), replace=False)
        except Exception as e:  # a broken plugin must not take the built-in methods down
            warnings.warn(f"alignment method plugin {ep.name!r} ({ep.value}) failed to load: {e}", stacklevel=2)


def method_names() -> list[str]:
    """The registered methods, in registration order (the built-in ones first)."""
    load_plugins()
    return list(_METHODS)


def get_method(name: str) -> Method:
    """The method registered as ``name``; an unknown name is a one-line input error with
    the closest names."""
    load_plugins()
    if name not in _METHODS:
        hint = suggest(name, _METHODS)
        raise SymspecInputError(f"unknown alignment method '{name}'"
                                + (f"; {hint}" if hint else f"; methods: {', '.join(_METHODS)}"))
    return _METHODS[name]


for _method in BUILTIN:  # the built-in methods come first
    register_method(_method)
