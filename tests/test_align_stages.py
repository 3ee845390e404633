"""align() is a chain of stages with hooks: the extensions (width, universe, learned,
certify) register their methods, stages and the certifier from the entry-point group
``symspec.extensions``, and alignment imports none of them."""

from __future__ import annotations

import ast
import subprocess
import sys
from importlib.metadata import entry_points
from pathlib import Path
from typing import Any

import pytest

import symspec
from symspec.alignment import hooks
from symspec.alignment.hooks import (
    AlignRequest,
    register_certifier,
    register_post_stage,
    register_pre_stage,
)
from symspec.alignment.registry import EXTENSION_GROUP, method_names
from symspec.errors import SymspecInputError
from tests.zoo import ZOO

ROOT = Path(__file__).resolve().parents[1]
EXTENSIONS = ("symspec.width", "symspec.universe", "symspec.learned", "symspec.certify")


def _python(code: str) -> str:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT).stdout.strip()


def test_the_extensions_register_their_methods_stages_and_certifier() -> None:
    assert sorted(ep.value for ep in entry_points(group=EXTENSION_GROUP)) == sorted(f"{e}.extension" for e in EXTENSIONS)
    names = method_names()
    assert {"universe", "learned", "learned-perm"} <= set(names)
    assert names[:6] == ["none", "weight", "weight-perm", "activation", "weight+activation", "weight-tokens"]
    assert hooks._PRE["width-lift"] == "symspec.width.stages:lift_stage"
    assert hooks._POST["lift-free"] == "symspec.width.stages:free_stage"
    assert hooks.certifier().__module__ == "symspec.certify.aligned"


def test_a_worker_process_loads_the_extensions() -> None:
    """A worker (symspec.runtime) looks its method up by name: the extensions' are there too."""
    code = ("from symspec.universe.tasks import alignment_method\n"
            "print(alignment_method('learned-perm').name, alignment_method('universe').name)\n"
            "try:\n    alignment_method('never-registered')\nexcept Exception as e:\n    print('refused' if 'not registered' in str(e) else e)")
    assert _python(code).split() == ["learned-perm", "universe", "refused"]


def test_listing_the_methods_imports_no_torch() -> None:
    code = "import sys, symspec.alignment as A; A.method_names(); print('torch' in sys.modules)"
    assert _python(code) == "False"
    # the positive control: running a stage does import it
    assert _python(code + "; import symspec.width.stages; print('torch' in sys.modules)").split() == ["False", "True"]


def _imported(path: Path, package: str) -> set[str]:
    """The symspec modules a source file imports (relative imports resolved), anywhere in it."""
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = package.split(".")[: len(package.split(".")) - node.level + 1] if node.level else []
            out.add(".".join([*base, *([node.module] if node.module else [])]))
    return out


def _reaches_an_extension(path: Path) -> set[str]:
    return {m for m in _imported(path, "symspec.alignment") if m.startswith(EXTENSIONS)}


def test_alignment_imports_no_extension(tmp_path: Path) -> None:
    files = sorted((ROOT / "symspec" / "alignment").glob("*.py"))
    assert files and {f.name: _reaches_an_extension(f) for f in files} == {f.name: set() for f in files}
    bad = tmp_path / "bad.py"  # the negative case: an upward import, function-level, is found
    bad.write_text("def f():\n    from ..width.free import learn_free\n    import symspec.certify\n")
    assert _reaches_an_extension(bad) == {"symspec.width.free", "symspec.certify"}


def test_registered_stages_run_around_the_method() -> None:
    seen: list[str] = []

    def pre(request: AlignRequest) -> None:
        seen.append(f"pre:{request.method.name}")
        request.info["probe"] = {"from": "pre"}

    def post(result: Any, request: AlignRequest) -> Any:
        seen.append(f"post:{result.method}")
        result.info["after"] = request.info["probe"]["from"]
        return result

    a, _ = ZOO["nanogpt"](seed=0)
    b, _ = ZOO["nanogpt"](seed=1)
    register_pre_stage("test-probe", pre)
    register_post_stage("test-probe-after", post)
    try:
        with pytest.raises(ValueError, match="already registered"):
            register_pre_stage("test-probe", lambda request: None)
        res = symspec.align(a, b, "nanogpt", method="weight", rounds=1)
    finally:
        hooks.unregister("test-probe")
        hooks.unregister("test-probe-after")
    assert seen == ["pre:weight", "post:weight"]
    assert res.info["probe"] == {"from": "pre"} and res.record.meta["probe"] == {"from": "pre"}
    assert res.info["after"] == "pre"
    again = symspec.align(a, b, "nanogpt", method="weight", rounds=1)  # withdrawn: nothing added
    assert "probe" not in again.info and "after" not in again.info and seen == ["pre:weight", "post:weight"]


def test_certify_without_a_certifier_is_one_line() -> None:
    a, _ = ZOO["nanogpt"](seed=0)
    b, _ = ZOO["nanogpt"](seed=1)
    res = symspec.align(a, b, "nanogpt", method="weight", rounds=1)
    saved = hooks._CERTIFIER["certifier"]
    hooks.unregister("certifier")
    try:
        with pytest.raises(SymspecInputError, match="no certifier is registered"):
            res.certify(per_space=False, joint=False)
    finally:
        register_certifier(saved)
    assert res.certify(per_space=False, joint=False) is not None  # the registered one answers


def test_missing_extension_metadata_is_said(tmp_path: Path) -> None:
    """A stale symspec.egg-info found first on sys.path (an old build in the working
    directory) hides the extensions' entry points: a warning says so and how to fix it."""
    stale = tmp_path / "symspec.egg-info"
    stale.mkdir()
    (stale / "PKG-INFO").write_text("Metadata-Version: 2.1\nName: symspec\nVersion: 0.0.0\n")
    (stale / "entry_points.txt").write_text("[console_scripts]\nsymspec = symspec.cli.main:main\n")
    code = ("import sys, warnings; sys.path.insert(0, sys.argv[1]); warnings.simplefilter('always')\n"
            "import symspec.alignment as A\nprint('universe' in A.method_names())")
    for path, universe, warned in ((str(tmp_path), "False", True), (str(tmp_path / "nothing"), "True", False)):
        out = subprocess.run([sys.executable, "-c", code, path], capture_output=True, text=True, check=True, cwd=ROOT)
        assert out.stdout.strip() == universe
        assert ("extensions (universe, learned, width, certify) are not registered" in out.stderr) is warned, out.stderr
