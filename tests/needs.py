"""What a skipped test needs, and how to get it: every skip says so, not only that
something is missing."""

from __future__ import annotations

import types
from pathlib import Path
from typing import NoReturn

import pytest

#: the project's offline data (DESIGN.md §5): CI lays a copy of shared/ beside its clone
SHARED_DATA = Path(__file__).resolve().parents[2] / "shared" / "data"

_HOW_SHARED = ("these tests read the project's offline data from ../shared/data beside the repository "
               "(CI lays its copy of shared/ there); put tinyshakespeare.txt and mnist/ (the MNIST test-set "
               "idx .gz files) there to run them")
_HOW_EXTRAS = "install the test extras: the README's test command (pip install -e '.[all,test]')"


def shared_data(*names: str) -> Path:
    """``SHARED_DATA``, after checking that each of ``names`` is in it; skips, saying how
    to get it, when one is missing."""
    missing = [n for n in names if not (SHARED_DATA / n).exists()]
    if missing:
        pytest.skip(f"{', '.join(str(SHARED_DATA / n) for n in missing)} missing: {_HOW_SHARED}")
    return SHARED_DATA


def optional(module: str, how: str = _HOW_EXTRAS) -> types.ModuleType:
    """``import module``, or skip saying how to install it."""
    return pytest.importorskip(module, reason=f"needs {module}: {how}")


def optional_missing(module: str, how: str = _HOW_EXTRAS) -> NoReturn:
    """Skip: ``module``, an optional package, is not installed."""
    pytest.skip(f"needs {module}, which is not installed: {how}")
