"""The package's public names: lazily exported, and never shadowed by a submodule."""

from __future__ import annotations

import importlib
import pkgutil
import types

import symspec


def _all_submodules() -> list[str]:
    names = []
    for info in pkgutil.walk_packages(symspec.__path__, "symspec."):
        if ".cli" in info.name:  # imports click commands only; not part of the API surface
            continue
        names.append(info.name)
    return names


def test_exports_are_not_shadowed_by_submodules() -> None:
    # importing symspec.X sets attribute X on the package: an exported function named
    # like a module (symspec.check vs symspec/check.py) would be replaced by the module
    for name in _all_submodules():
        importlib.import_module(name)
    clashes = [n for n in symspec._EXPORTS if isinstance(getattr(symspec, n), types.ModuleType)]
    assert clashes == []
    assert callable(symspec.check) and symspec.check.__module__.startswith("symspec.checker")
    assert callable(symspec.bind) and symspec.bind.__module__ == "symspec.binding"
    assert callable(symspec.align) and callable(symspec.universe_match)
    assert not hasattr(symspec, "weight_match")  # one public way to align: symspec.align


def test_no_export_is_named_like_a_module() -> None:
    modules = {n.rsplit(".", 1)[1] for n in _all_submodules() if n.count(".") == 1}
    assert modules, "walk_packages found no submodule"
    assert sorted(set(symspec._EXPORTS) & modules) == []


def test_unknown_attribute_is_an_attribute_error() -> None:
    try:
        symspec.no_such_thing  # noqa: B018
    except AttributeError as e:
        assert "no_such_thing" in str(e)
    else:  # pragma: no cover
        raise AssertionError("symspec.no_such_thing resolved")


def test_every_package_is_installed_by_pyproject() -> None:
    """A package folder missing from pyproject's explicit list works in an editable
    install and vanishes from a wheel (symspec.inference and symspec.width once did)."""
    from pathlib import Path

    import pytest

    tomllib = pytest.importorskip("tomllib")  # Python 3.11+

    root = Path(__file__).resolve().parent.parent
    listed = set(tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    folders = {"symspec": root / "symspec", "symspec.analyzers": root / "analyzers", "symspec.cli": root / "cli",
               "symspec.specs": root / "specs"}
    found = set()
    for name, folder in folders.items():
        for init in folder.rglob("__init__.py"):
            rel = init.parent.relative_to(folder)
            if any(part.startswith(".") or part == "__pycache__" for part in rel.parts):
                continue
            found.add(".".join([name, *rel.parts]))
    assert found - listed == set(), f"packages pyproject.toml does not install: {sorted(found - listed)}"
    assert listed - found == set(), f"pyproject.toml lists packages that do not exist: {sorted(listed - found)}"
