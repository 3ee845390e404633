"""Small file helpers: outputs are written atomically (a temporary file, then rename),
and JSON documents keep non-finite numbers as strings."""

from __future__ import annotations

import math
import os
import tempfile
from collections.abc import Mapping
from pathlib import Path
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


def atomic_write_bytes(path: str | Path, data: bytes) -> None:
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{p.name}.", dir=p.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, p)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def atomic_write_text(path: str | Path, text: str) -> None:
    atomic_write_bytes(path, text.encode("utf-8"))
