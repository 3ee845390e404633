"""The shape of the code, as rules a change can break.

- **Floors.** Every module of ``symspec/`` (and ``analyzers/``, ``cli/``, installed as
  ``symspec.analyzers`` and ``symspec.cli``) stands on one floor of :data:`FLOORS`, and
  imports only its own floor or lower: at module level, inside a function, or through
  ``importlib.import_module("...")`` with a literal name. Extensions (floor 5) register
  themselves with the floors below; the floors below never name them.
- **No circle between packages.** The graph of package -> package imports has no cycle,
  within a floor too: its nodes are the units of :data:`FLOORS` (``symspec.groups``,
  ``symspec.binding``, ...) and, inside a unit, each sub-package (``symspec.solvers.engine``
  and ``symspec.solvers.kinds`` are two); a package's ``__init__`` re-exporting its own
  sub-packages is its face, not an edge.
- **Size.** No function (``def`` line to last line) over :data:`MAX_FUNCTION` lines and no
  file over :data:`MAX_FILE` lines in ``symspec/``, ``analyzers/`` or ``cli/``.
- **Benchmarks** (``bench/``, a package run as ``python -m bench.NAME``) import public
  names of symspec only and never change ``sys.path``.

Each rule has a negative case below: a snippet that breaks it, which the rule must flag.
"""

from __future__ import annotations

import ast
from collections.abc import Iterable, Iterator
from pathlib import Path

import networkx as nx
import pytest

ROOT = Path(__file__).resolve().parent.parent
CORE = ROOT / "symspec"
#: where each installed package's files live (pyproject's package-dir)
SOURCES: dict[str, Path] = {
    "symspec": CORE,
    "symspec.analyzers": ROOT / "analyzers",
    "symspec.cli": ROOT / "cli",
}

#: The floors, lowest first: floor -> the packages and modules standing on it. A module
#: belongs to the longest entry its name starts with (``symspec`` alone is the facade,
#: ``symspec/__init__.py``, so ``from symspec import align`` is an import of the top).
FLOORS: dict[int, tuple[str, ...]] = {
    0: (  # base
        "symspec.errors", "symspec.io_util", "symspec.linalg", "symspec.process",
        "symspec.progress", "symspec.precision", "symspec.outputs", "symspec.runtime",
        "symspec._lazy", "symspec._version",
    ),
    1: (  # language: group text, spec text, the canonical step kinds' syntax
        "symspec.groups", "symspec.spec",
    ),
    2: (  # compilation
        "symspec.problem", "symspec.graph", "symspec.canonical", "symspec.binding",
        "symspec.statedict", "symspec.transforms", "symspec.record", "symspec.checker",
        "symspec.planting", "symspec.testing", "symspec.loading", "symspec.data",
    ),
    3: (  # solving: the weight-matching engine and the per-kind solvers
        "symspec.solvers",
    ),
    4: (  # methods: the alignment registry, align()'s stages, the closed-form methods
        "symspec.alignment",
    ),
    5: (  # extensions that register themselves
        "symspec.width", "symspec.universe", "symspec.learned", "symspec.certify",
        "symspec.inference",
    ),
    6: (  # top: the public facade, the analyzers, the CLI
        "symspec", "symspec.analyzers", "symspec.cli",
    ),
}
UNITS: dict[str, int] = {unit: floor for floor, units in FLOORS.items() for unit in units}
TOP = max(FLOORS)
MAX_FUNCTION = 80
MAX_FILE = 600


def within(name: str, package: str) -> bool:
    return name == package or name.startswith(package + ".")


def unit_of(name: str) -> str | None:
    """The entry of :data:`FLOORS` that ``name`` (a module, or ``module.attribute``) belongs to;
    ``None`` outside symspec."""
    owners = [unit for unit in UNITS if within(name, unit)]
    return max(owners, key=len) if owners else None


def module_name(path: Path) -> str:
    """``symspec/universe/api.py`` -> ``symspec.universe.api``, ``cli/match.py`` ->
    ``symspec.cli.match`` (a package: its ``__init__``'s name)."""
    for package, root in SOURCES.items():
        if path.is_relative_to(root):
            parts = (*package.split("."), *path.relative_to(root).with_suffix("").parts)
            return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
    raise ValueError(f"{path} is not in symspec, analyzers or cli")


def source_files() -> list[Path]:
    # symspec.analyzers and symspec.cli are symspec's sub-packages only once installed: in the
    # tree they are folders of their own, so CORE's walk does not see them twice
    return sorted(p for root in SOURCES.values() for p in root.rglob("*.py"))


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


def upward(source: str, module: str, is_package: bool = False) -> list[str]:
    """The imports in ``source`` (the text of ``module``) of a floor above the module's own."""
    own = UNITS[unit_of(module)]  # KeyError: a module on no floor (test_every_module_has_a_floor)
    found = []
    for line, name in imported(source, module, is_package):
        unit = unit_of(name)
        if unit is not None and UNITS[unit] > own:
            found.append(f"{module}:{line}: imports {name} (floor {UNITS[unit]} {unit}) "
                         f"from floor {own}")
    return found


def node_of(name: str, packages: Iterable[str]) -> str | None:
    """The package ``name`` counts in: the deepest of ``packages`` inside its unit of
    :data:`FLOORS` that holds it, else the unit itself."""
    unit = unit_of(name)
    if unit is None:
        return None
    return max((p for p in packages if within(name, p) and within(p, unit)), key=len, default=unit)


def package_graph(modules: Iterable[tuple[str, str, bool]]) -> nx.DiGraph:
    """Package -> package imports of ``(module, source, is_package)`` triples (the packages
    being those of the triples with ``is_package``); each edge keeps one import that
    makes it, for the message."""
    modules = list(modules)
    packages = {module for module, _, is_package in modules if is_package}
    graph = nx.DiGraph()
    for module, source, is_package in modules:
        mine = node_of(module, packages)
        graph.add_node(mine)
        for line, name in imported(source, module, is_package):
            theirs = node_of(name, packages)
            if theirs is None or theirs == mine or graph.has_edge(mine, theirs):
                continue
            if is_package and within(theirs, module):
                continue  # a package's face re-exporting its own sub-packages
            graph.add_edge(mine, theirs, why=f"{module}:{line} imports {name}")
    return graph


def circles(graph: nx.DiGraph) -> list[str]:
    """Each cycle of ``graph``, written with the import behind every edge."""
    found = []
    for cycle in nx.simple_cycles(graph):
        edges = zip(cycle, [*cycle[1:], cycle[0]])
        found.append(" -> ".join([*cycle, cycle[0]]) + ": "
                     + "; ".join(graph.edges[a, b]["why"] for a, b in edges))
    return found


def functions(tree: ast.AST) -> Iterator[ast.FunctionDef | ast.AsyncFunctionDef]:
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            yield node


def long_functions(source: str, where: str) -> list[str]:
    """The functions (methods and nested ones too) over :data:`MAX_FUNCTION` lines, counted
    from the ``def`` line to the last line."""
    return [f"{where}:{node.lineno}: {node.name} has {node.end_lineno - node.lineno + 1} lines"
            for node in functions(ast.parse(source))
            if node.end_lineno - node.lineno + 1 > MAX_FUNCTION]


def unexplained_deferred_imports(source: str, where: str) -> list[str]:
    """Imports inside a function with no comment on their line or the three lines above
    it (or above the run of imports it stands in). Everything is imported at module level
    except an optional dependency (cvxpy, transformers, matplotlib, ...) or a module that
    must stay off an import path (the CLI's help imports no torch), and such an import
    says why where it stands."""
    lines = source.splitlines()
    found = []
    for fn in functions(ast.parse(source)):
        for node in ast.walk(fn):
            if not isinstance(node, (ast.Import, ast.ImportFrom)):
                continue
            first = node.lineno - 1
            while first > 0 and lines[first - 1].strip().startswith(("import ", "from ")):
                first -= 1
            if not any("#" in line for line in lines[max(0, first - 3):node.lineno]):
                found.append(f"{where}:{node.lineno}: {lines[node.lineno - 1].strip()} (in {fn.name}) says not why")
    return sorted(set(found))


def long_file(source: str, where: str) -> list[str]:
    lines = len(source.splitlines())
    return [f"{where}: {lines} lines"] if lines > MAX_FILE else []


def bench_faults(source: str, where: str) -> list[str]:
    """What a benchmark script must not do: import a private name of symspec (``_x``, or
    from a private module) or change ``sys.path`` (the scripts are a package, run as
    ``python -m bench.NAME``)."""
    found = []
    tree = ast.parse(source)
    # names bound to symspec's modules or objects, whose private attributes are private too
    bound = {(a.asname or a.name).split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.Import)
             for a in node.names if within(a.name, "symspec")}
    bound |= {a.asname or a.name for node in ast.walk(tree)
              if isinstance(node, ast.ImportFrom) and node.module and within(node.module, "symspec") for a in node.names}
    for node in ast.walk(tree):
        if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in bound
                and node.attr.startswith("_") and not node.attr.startswith("__")):
            found.append(f"{where}:{node.lineno}: uses the private {node.value.id}.{node.attr}")
        if isinstance(node, ast.ImportFrom) and node.module and within(node.module, "symspec"):
            private = [a.name for a in node.names if a.name.startswith("_") and not a.name.startswith("__")]
            if private or any(part.startswith("_") for part in node.module.split(".")):
                found.append(f"{where}:{node.lineno}: imports a private name of {node.module}: "
                             f"{', '.join(private) or node.module}")
        elif (isinstance(node, ast.Attribute) and node.attr in ("insert", "append")
              and isinstance(node.value, ast.Attribute) and node.value.attr == "path"
              and isinstance(node.value.value, ast.Name) and node.value.value.id == "sys"):
            found.append(f"{where}:{node.lineno}: changes sys.path")
    return found


# ---------------------------------------------------------------- the live tree


@pytest.fixture(scope="module")
def tree() -> list[tuple[Path, str, str, bool]]:
    files = source_files()
    assert len(files) > 100  # the walk found the packages
    return [(f, module_name(f), f.read_text(), f.name == "__init__.py") for f in files]


def test_every_module_has_a_floor(tree) -> None:
    homeless = [module for _, module, _, _ in tree if unit_of(module) is None]
    assert not homeless, f"modules on no floor of FLOORS: {homeless}"
    # the facade alone stands for `symspec`; every sub-package of symspec is listed itself
    packages = {module_name(f) for f, _, _, pkg in tree if pkg}
    unlisted = [p for p in packages if p.count(".") == 1 and p not in UNITS]
    assert not unlisted, f"packages FLOORS does not name: {unlisted}"


def test_analyzers_and_cli_are_the_top(tree) -> None:
    for _, module, _, _ in tree:
        if within(module, "symspec.analyzers") or within(module, "symspec.cli"):
            assert UNITS[unit_of(module)] == TOP, module


def test_imports_run_downward(tree) -> None:
    bad = [v for _, module, source, pkg in tree for v in upward(source, module, pkg)]
    assert not bad, "\n".join(bad)


def test_no_circle_between_packages(tree) -> None:
    graph = package_graph((module, source, pkg) for _, module, source, pkg in tree)
    assert graph.number_of_edges() > 20  # the graph saw the imports
    assert {"symspec.solvers.engine", "symspec.solvers.kinds", "symspec.binding"} <= set(graph)  # and sub-packages
    bad = circles(graph)
    assert not bad, "\n".join(bad)


def test_no_function_over_80_lines(tree) -> None:
    bad = [v for f, _, source, _ in tree for v in long_functions(source, str(f.relative_to(ROOT)))]
    assert not bad, "\n".join(bad)


def test_imports_in_functions_say_why(tree) -> None:
    """The library and the analyzers; the CLI's command modules import lazily by design
    (cli/main.py loads each command on use)."""
    bad = [v for f, module, source, _ in tree if not within(module, "symspec.cli")
           for v in unexplained_deferred_imports(source, str(f.relative_to(ROOT)))]
    assert not bad, "\n".join(bad)


def test_no_file_over_600_lines(tree) -> None:
    bad = [v for f, _, source, _ in tree for v in long_file(source, str(f.relative_to(ROOT)))]
    assert not bad, "\n".join(bad)


def test_benchmarks_import_public_names_only() -> None:
    scripts = sorted((ROOT / "bench").glob("*.py"))
    assert len(scripts) > 10 and (ROOT / "bench" / "__init__.py").exists()
    bad = [v for f in scripts for v in bench_faults(f.read_text(), str(f.relative_to(ROOT)))]
    assert not bad, "\n".join(bad)


# ---------------------------------------------------------------- negative cases


@pytest.mark.parametrize(
    ("source", "module", "is_package"),
    [
        ("from symspec.analyzers import measure\n", "symspec.universe.api", False),
        ("import symspec.cli.main\n", "symspec.checker", False),
        ("def f():\n    from ..analyzers.barrier import Measurer\n", "symspec.universe.api", False),
        ("from .. import analyzers\n", "symspec.universe.api", False),
        ("from .. import cli\n", "symspec.alignment", True),
        ("import importlib\nimportlib.import_module('symspec.analyzers.report')\n", "symspec.record", False),
        # one floor up, each floor
        ("from .groups import S\n", "symspec.outputs", False),
        ("from ..canonical import STEPS\n", "symspec.spec.steps", False),
        ("from .solvers.engine import weight\n", "symspec.binding", False),
        ("def f():\n    from ...alignment import align\n", "symspec.solvers.kinds.smooth", False),
        ("from ..width.extension import register\n", "symspec.alignment.stages", False),
        ("from symspec import align\n", "symspec.certify.space", False),  # the facade is the top
        ("import importlib\nimportlib.import_module('symspec.universe.method')\n",
         "symspec.alignment.registry", False),
    ],
)
def test_an_upward_import_is_flagged(source: str, module: str, is_package: bool) -> None:
    assert upward(source, module, is_package)


@pytest.mark.parametrize(
    ("source", "module", "is_package"),
    [
        ("from ..binding import BoundSpec\n", "symspec.universe.api", False),  # down
        ("from .report import write\n", "symspec.universe.api", False),  # its own package
        ("from ..spec import load_spec\n", "symspec.groups.text", False),  # its own floor
        ("from symspec import errors\n", "symspec.groups.base", False),  # symspec.errors
        ("from symspec.certify import certify\n", "symspec.cli.match", False),  # the top
        ("import torch\nfrom analyzers import x\n", "symspec.errors", False),  # not symspec
    ],
)
def test_a_downward_import_is_not_flagged(source: str, module: str, is_package: bool) -> None:
    assert not upward(source, module, is_package)


def test_relative_imports_resolve() -> None:
    assert imported("from ..groups import S\n", "symspec.solvers.base") == [(1, "symspec.groups.S")]
    assert imported("from . import text\n", "symspec.groups", is_package=True) == [(1, "symspec.groups.text")]
    assert module_name(CORE / "universe" / "__init__.py") == "symspec.universe"
    assert module_name(ROOT / "cli" / "match.py") == "symspec.cli.match"
    assert unit_of("symspec.solvers.engine.weight.match_weights") == "symspec.solvers"
    assert unit_of("symspec.align") == "symspec" and unit_of("torch.nn") is None


def test_a_circle_between_two_packages_is_flagged() -> None:
    modules = [
        ("symspec.groups.text", "from ..spec.model import Spec\n", False),
        ("symspec.spec.load", "def f():\n    from symspec.groups import parse\n", False),
        ("symspec.binding", "from .groups import S\nfrom .spec import load_spec\n", False),
    ]
    found = circles(package_graph(modules))
    assert len(found) == 1 and "symspec.groups" in found[0] and "symspec.spec" in found[0]
    assert "symspec.groups.text:1 imports symspec.spec.model.Spec" in found[0]
    # the same imports one way only: no circle
    assert not circles(package_graph(modules[::2]))


def test_a_circle_between_two_sub_packages_is_flagged() -> None:
    modules = [
        ("symspec.solvers", "from .engine import weight\nfrom .kinds import assignment\n", True),
        ("symspec.solvers.engine", "", True),
        ("symspec.solvers.kinds", "", True),
        ("symspec.solvers.engine.weight", "from ..kinds import assignment\n", False),
        ("symspec.solvers.kinds.assignment", "from .. import convex\n", False),
        ("symspec.solvers.convex", "from .engine.base import Term\n", False),
    ]
    found = circles(package_graph(modules))
    assert len(found) == 1
    assert set(found[0].partition(":")[0].split(" -> ")) == {"symspec.solvers", "symspec.solvers.engine",
                                                             "symspec.solvers.kinds"}
    # the package's face (its __init__) importing its sub-packages is no edge: without
    # convex's import there is no circle
    assert not circles(package_graph(modules[:-1]))


def _function(lines: int) -> str:
    """A function of ``lines`` lines, ``def`` line included."""
    return "def f():\n" + "    x = 1\n" * (lines - 1)


def test_a_function_over_80_lines_is_flagged() -> None:
    assert long_functions(_function(81), "x.py") == ["x.py:1: f has 81 lines"]
    assert not long_functions(_function(80), "x.py")
    # a method, and a function nested in a short one's place, count the same
    method = "class C:\n" + "\n".join("    " + line for line in _function(81).splitlines()) + "\n"
    assert long_functions(method, "x.py") == ["x.py:2: f has 81 lines"]


def test_an_import_in_a_function_without_a_reason_is_flagged() -> None:
    assert unexplained_deferred_imports("def f():\n    import torch\n    return torch\n", "x.py") == \
        ["x.py:2: import torch (in f) says not why"]
    assert not unexplained_deferred_imports("def f():\n    import cvxpy  # optional: the convex extra\n", "x.py")
    assert not unexplained_deferred_imports("def f():\n    # optional: plotting\n    import matplotlib\n", "x.py")
    # a run of imports under one comment: each is explained; the run ends at other code
    run = "def f():\n    # optional: plotting\n" + "    import a\n" * 5 + "    x = 1\n    import b\n"
    assert unexplained_deferred_imports(run, "x.py") == ["x.py:9: import b (in f) says not why"]
    assert not unexplained_deferred_imports("import torch\n\n\ndef f():\n    return torch\n", "x.py")


def test_a_file_over_600_lines_is_flagged() -> None:
    assert long_file("x = 1\n" * 601, "x.py") == ["x.py: 601 lines"]
    assert not long_file("x = 1\n" * 600, "x.py")


@pytest.mark.parametrize("source", [
    "from symspec.width.fit import _lift_all_but\n",
    "def f():\n    from symspec.solvers.kinds.smooth import best_scale_value, _polish\n",
    "from symspec._lazy import lazy_exports\n",
    "import sys\nsys.path.insert(0, 'bench')\n",
    "import symspec.solvers.kinds.smooth as smooth\nsmooth._polish(x, c)\n",
    "from symspec.certify import joint as cj\ncj._value_of(v)\n",
])
def test_a_benchmark_reaching_into_private_names_is_flagged(source: str) -> None:
    assert bench_faults(source, "bench/x.py")
    assert not bench_faults("from symspec.width.fit import unit_costs\nfrom symspec import __version__\n", "bench/x.py")
