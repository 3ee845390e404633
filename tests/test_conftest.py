"""The suite's own hooks: a missing optional package skips the tests that need it (CI's
fallback install has no timm), a missing core module still fails."""

from __future__ import annotations

import pytest


def test_a_missing_optional_package_skips_and_a_missing_core_module_fails(pytester: pytest.Pytester) -> None:
    pytester.makeconftest("from tests.conftest import pytest_pyfunc_call  # noqa: F401\n")
    pytester.makepyfile(test_inner="""
import sys

def test_needs_timm(monkeypatch):
    monkeypatch.setitem(sys.modules, "timm", None)   # what 'import timm' meets where timm is not installed
    import timm  # noqa: F401

def test_needs_a_timm_submodule(monkeypatch):
    monkeypatch.setitem(sys.modules, "timm", None)
    from timm.models import vision_transformer  # noqa: F401

def test_needs_a_core_module():
    import symspec_no_such_module  # noqa: F401

def test_an_optional_package_that_is_there_runs():
    import scipy  # noqa: F401
""")
    result = pytester.runpytest_inprocess("-p", "no:cacheprovider", "-rsf")
    result.assert_outcomes(passed=1, skipped=2, failed=1)
    result.stdout.fnmatch_lines(["*needs timm, which is not installed: install the test extras*"])
    result.stdout.fnmatch_lines(["*FAILED*test_needs_a_core_module*"])
