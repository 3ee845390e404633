"""JSON documents keep non-finite numbers as strings (files themselves are written by
:mod:`symspec.outputs`: :func:`~symspec.outputs.atomic_write` and the rest)."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any


def json_safe(x: Any) -> Any:
    """``x`` with every non-finite float as the string "nan", "inf" or "-inf" (strict
    JSON has no such numbers), mappings and sequences walked, tuples as lists.

    >>> json_safe({"a": [1.0, float("inf")], "b": (float("nan"),)})
    {'a': [1.0, 'inf'], 'b': ['nan']}
    """
    if isinstance(x, float) and not math.isfinite(x):
        return "nan" if math.isnan(x) else ("inf" if x > 0 else "-inf")
    if isinstance(x, Mapping):
        return {k: json_safe(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [json_safe(v) for v in x]
    return x


__all__ = ["json_safe"]
