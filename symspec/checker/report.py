"""What :func:`~symspec.checker.check` reports: a row per space and dtype, and the report's
table and JSON."""

from __future__ import annotations

import json
import math
from typing import Any

import attrs

DEFAULT_RTOL: dict[str, float] = {"float64": 1e-9, "float32": 1e-4}


@attrs.frozen
class CheckRow:
    space: str
    group: str
    dtype: str
    samples: int
    max_abs: float
    max_rel: float
    rtol: float
    failing: tuple[str, ...] = ()

    @property
    def passed(self) -> bool:
        return math.isfinite(self.max_rel) and self.max_rel <= self.rtol


@attrs.define
class CheckReport:
    spec: str
    model: str
    rows: list[CheckRow]
    notes: list[str] = attrs.field(factory=list)

    @property
    def passed(self) -> bool:
        return all(r.passed for r in self.rows)

    def failed_rows(self) -> list[CheckRow]:
        return [r for r in self.rows if not r.passed]

    def to_dict(self) -> dict[str, Any]:
        return {
            "spec": self.spec,
            "model": self.model,
            "passed": self.passed,
            "rows": [
                {**attrs.asdict(r), "failing": list(r.failing), "passed": r.passed,
                 "max_abs": _num(r.max_abs), "max_rel": _num(r.max_rel)}
                for r in self.rows
            ],
            "notes": self.notes,
        }

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)

    def render(self) -> str:
        """A plain-text table (the CLI prints a rich one)."""
        head = f"{'space':<16} {'group':<34} {'dtype':<8} {'max abs':>10} {'max rel':>10} {'rtol':>8}  result"
        lines = [f"symspec check: spec '{self.spec}' on {self.model}", head, "-" * len(head)]
        for r in self.rows:
            res = "pass" if r.passed else "FAIL" + (f" ({', '.join(r.failing)})" if r.failing else "")
            lines.append(f"{r.space:<16} {r.group[:34]:<34} {r.dtype:<8} {r.max_abs:>10.2e} {r.max_rel:>10.2e} {r.rtol:>8.0e}  {res}")
        lines += self.notes
        lines.append("all passed" if self.passed else f"{len(self.failed_rows())} row(s) failed")
        return "\n".join(lines)


def _num(x: float) -> float | str:
    return x if math.isfinite(x) else str(x)
