"""The imports run one way: the core (``symspec/``) never imports the analyzers or the CLI
(``analyzers/`` and ``cli/``, installed as ``symspec.analyzers`` and ``symspec.cli``), at
module level or inside a function, and the transforms never import the binding."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

CORE = Path(__file__).resolve().parent.parent / "symspec"

#: (importing package, packages it must not import)
RULES: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("symspec", ("symspec.analyzers", "symspec.cli")),
    ("symspec.transforms", ("symspec.binding",)),
)


def module_name(path: Path, root: Path = CORE) -> str:
    """``symspec/universe/api.py`` -> ``symspec.universe.api`` (a package: its ``__init__``'s name)."""
    parts = ("symspec", *path.relative_to(root).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported(source: str, module: str, is_package: bool = False) -> list[tuple[int, str]]:
    """Every module ``source`` imports, wherever the import stands (module level, functions,
    ``importlib.import_module("...")`` with a literal name), relative imports resolved
    against ``module``: ``(line, absolute name)``; ``from X import y`` counts as ``X.y``."""
    package = module if is_package else module.rpartition(".")[0]
    out: list[tuple[int, str]] = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            out += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join([*anchor, *([base] if base else [])])
            out += [(node.lineno, f"{base}.{alias.name}") for alias in node.names]
        elif (isinstance(node, ast.Call) and isinstance(node.func, (ast.Attribute, ast.Name))
              and (node.func.attr if isinstance(node.func, ast.Attribute) else node.func.id) == "import_module"
              and node.args and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str)):
            out.append((node.lineno, node.args[0].value))
    return out


def _within(name: str, package: str) -> bool:
    return name == package or name.startswith(package + ".")


def violations(source: str, module: str, is_package: bool = False) -> list[str]:
    """The imports in ``source`` (the text of ``module``) that break :data:`RULES`."""
    found = []
    for line, name in imported(source, module, is_package):
        for importer, forbidden in RULES:
            if _within(module, importer) and any(_within(name, f) for f in forbidden):
                found.append(f"{module}:{line}: imports {name}")
    return found


def test_core_imports_run_one_way() -> None:
    files = sorted(CORE.rglob("*.py"))
    assert len(files) > 50  # the walk found the package
    bad = [v for f in files for v in violations(f.read_text(), module_name(f), f.name == "__init__.py")]
    assert not bad, "\n".join(bad)


@pytest.mark.parametrize(
    ("source", "module", "is_package"),
    [
        ("from symspec.analyzers import measure\n", "symspec.universe.api", False),
        ("import symspec.cli.main\n", "symspec.checker", False),
        ("def f():\n    from ..analyzers.barrier import Measurer\n", "symspec.universe.api", False),
        ("from .. import analyzers\n", "symspec.universe.api", False),
        ("from . import cli\n", "symspec", True),
        ("import importlib\nimportlib.import_module('symspec.analyzers.report')\n", "symspec.record", False),
        ("from ..binding import BoundSpec\n", "symspec.transforms.apply", False),
    ],
)
def test_a_forbidden_import_is_flagged(source: str, module: str, is_package: bool) -> None:
    assert violations(source, module, is_package)


@pytest.mark.parametrize(
    ("source", "module", "is_package"),
    [
        ("from ..binding import BoundSpec\n", "symspec.universe.api", False),  # universe may bind
        ("from .report import write\n", "symspec.universe.api", False),  # symspec.universe.report
        ("from symspec.analyzers import measure\n", "symspec_other.x", False),  # not the core
    ],
)
def test_an_allowed_import_is_not_flagged(source: str, module: str, is_package: bool) -> None:
    assert not violations(source, module, is_package)


def test_relative_imports_resolve() -> None:
    assert imported("from ..groups import S\n", "symspec.solvers.base") == [(1, "symspec.groups.S")]
    assert imported("from . import text\n", "symspec.groups", is_package=True) == [(1, "symspec.groups.text")]
    assert module_name(CORE / "universe" / "__init__.py") == "symspec.universe"
