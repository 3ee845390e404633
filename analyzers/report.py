"""Barrier reports: a JSON document with a documented schema, and a markdown summary.

The schema (``REPORT_SCHEMA``, a JSON Schema; described in docs/analyzers.md) is
versioned by the ``schema`` field, ``"symspec.barrier/1"``. Non-finite numbers (a
diverging interpolation) are written as the strings ``"inf"``, ``"-inf"``, ``"nan"``,
so the file stays valid JSON.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import attrs

from symspec._version import __version__
from symspec.data import EvalData
from symspec.io_util import json_safe
from symspec.outputs import atomic_write_bytes

from .barrier import PairResult, Summary, method_label, summarize
from .plots import plot_report

SCHEMA_ID = "symspec.barrier/1"


@attrs.define
class BarrierReport:
    """Everything one barrier run measured: the data, the grid, each method's pairs and summary."""

    data: Mapping[str, Any]
    results: dict[str, list[PairResult]]
    device: str = "cpu"
    dtype: str = "float32"
    pairs: list[tuple[str, str]] = attrs.field(factory=list)
    seconds: float = 0.0
    notes: list[str] = attrs.field(factory=list)

    @classmethod
    def build(cls, data: EvalData, results: dict[str, list[PairResult]], *, device: str = "cpu",
              dtype: str = "float32", seconds: float = 0.0, notes: Sequence[str] = ()) -> BarrierReport:
        first = next(iter(results.values()), [])
        pairs = [(r.a, r.b) for r in first]
        return cls(data.describe(), results, str(device), str(dtype).replace("torch.", ""), pairs, seconds, list(notes))

    @property
    def lambdas(self) -> tuple[float, ...]:
        for rs in self.results.values():
            if rs:
                return rs[0].curve.lambdas
        return ()

    def summaries(self) -> dict[str, Summary]:
        return {m: summarize(rs) for m, rs in self.results.items() if rs}

    def to_dict(self) -> dict[str, Any]:

        sums = self.summaries()
        methods = []
        for m, rs in self.results.items():
            s = sums[m]
            methods.append({
                "method": m,
                "label": method_label(m),
                "summary": {
                    "n": s.n,
                    "barrier_mean": s.barrier_mean,
                    "barrier_stderr": s.barrier_stderr,
                    "peak_lambda_mean": s.peak_lambda_mean,
                    "loss_a_mean": s.loss_a_mean,
                    "loss_b_mean": s.loss_b_mean,
                    "accuracy_barrier_mean": s.accuracy_barrier_mean,
                    "accuracy_barrier_stderr": s.accuracy_barrier_stderr,
                    "loss_mean": list(s.loss_mean),
                    "loss_stderr": list(s.loss_stderr),
                    "accuracy_mean": list(s.accuracy_mean) if s.accuracy_mean is not None else None,
                },
                "pairs": [_pair_dict(r) for r in rs],
            })
        doc = {
            "schema": SCHEMA_ID,
            "symspec_version": __version__,
            "data": dict(self.data),
            "device": self.device,
            "dtype": self.dtype,
            "points": len(self.lambdas),
            "lambdas": list(self.lambdas),
            "pairs": [{"index": i, "a": a, "b": b} for i, (a, b) in enumerate(self.pairs)],
            "methods": methods,
            "seconds": self.seconds,
            "notes": list(self.notes),
        }
        return json_safe(doc)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)

    def write_json(self, path: str | Path) -> Path:
        p = Path(path)
        atomic_write_bytes(p, (self.to_json() + "\n").encode())
        return p

    def markdown(self) -> str:
        """A short markdown summary: one table row per method."""
        d = self.data
        what = f"{d.get('source', '?')}, {d.get('split', '?')} split ({d.get('examples', '?')} examples, {d.get('targets', '?')} targets)"
        lines = [f"### Loss barrier: {what}", "",
                 f"{len(self.lambdas)} points of λ, {len(self.pairs)} pair(s), {self.device}, {self.dtype}; "
                 "barrier = max over λ of L((1-λ)A + λB) - ((1-λ)L(A) + λL(B)), mean ± standard error over pairs.", "",
                 "| method | pairs | loss barrier | peak λ | loss A | loss B | loss at λ=0.5 | accuracy barrier |",
                 "|---|---:|---:|---:|---:|---:|---:|---:|"]
        mid = _index_of(self.lambdas, 0.5)
        for m, s in self.summaries().items():
            acc = _pm(s.accuracy_barrier_mean, s.accuracy_barrier_stderr) if s.accuracy_barrier_mean is not None else "n/a"
            at_mid = _fmt(s.loss_mean[mid]) if mid is not None else "n/a"
            lines.append(f"| {method_label(m)} | {s.n} | {_pm(s.barrier_mean, s.barrier_stderr)} | {s.peak_lambda_mean:.2f} | "
                         f"{_fmt(s.loss_a_mean)} | {_fmt(s.loss_b_mean)} | {at_mid} | {acc} |")
        lines += [""] + [f"- {n}" for n in self.notes]
        return "\n".join(lines).rstrip() + "\n"

    def plot(self, path: str | Path, title: str | None = None) -> Path:

        return plot_report(self, path, title=title)


def _index_of(grid: Sequence[float], value: float) -> int | None:
    for i, x in enumerate(grid):
        if abs(x - value) < 1e-12:
            return i
    return None


def _fmt(x: float) -> str:
    return f"{x:.4f}" if math.isfinite(x) else str(x)


def _pm(mean: float, se: float | None) -> str:
    return _fmt(mean) + (f" ± {se:.4f}" if se is not None else "")


def _pair_dict(r: PairResult) -> dict[str, Any]:
    acc = r.accuracy_barrier
    return {
        "pair": r.pair,
        "barrier": r.barrier.value,
        "peak_lambda": r.barrier.peak_lambda,
        "interior_max": r.barrier.interior_max,
        "loss": list(r.curve.losses),
        "gap": list(r.barrier.gaps),
        "accuracy": list(r.curve.accuracies) if r.curve.accuracies is not None else None,
        "accuracy_barrier": acc.value if acc is not None else None,
        "accuracy_peak_lambda": acc.peak_lambda if acc is not None else None,
        "seconds": r.curve.seconds,
        "align_seconds": r.align_seconds,
        "align": dict(r.align_info),
    }


_NUM: dict[str, Any] = {"oneOf": [{"type": "number"}, {"enum": ["inf", "-inf", "nan"]}]}
_NUM_OR_NULL: dict[str, Any] = {"oneOf": [{"type": "number"}, {"enum": ["inf", "-inf", "nan"]}, {"type": "null"}]}
_NUMS: dict[str, Any] = {"type": "array", "items": _NUM}

#: JSON Schema of :meth:`BarrierReport.to_dict` (documented in docs/analyzers.md)
REPORT_SCHEMA: dict[str, Any] = {
    "$schema": "https://json-schema.org/draft/2020-12/schema",
    "title": "symspec barrier report",
    "type": "object",
    "required": ["schema", "symspec_version", "data", "device", "dtype", "points", "lambdas", "pairs", "methods",
                 "seconds", "notes"],
    "properties": {
        "schema": {"const": SCHEMA_ID},
        "symspec_version": {"type": "string"},
        "data": {
            "type": "object",
            "required": ["source", "kind", "split", "batches", "examples", "targets"],
            "properties": {
                "source": {"type": "string"},
                "kind": {"enum": ["text", "images", "hook"]},
                "split": {"enum": ["train", "val", "test"]},
                "batches": {"type": "integer", "minimum": 1},
                "examples": {"type": "integer", "minimum": 1},
                "targets": {"type": "integer", "minimum": 1},
            },
        },
        "device": {"type": "string"},
        "dtype": {"type": "string"},
        "points": {"type": "integer", "minimum": 2},
        "lambdas": {"type": "array", "items": {"type": "number", "minimum": 0, "maximum": 1}, "minItems": 2},
        "pairs": {"type": "array", "items": {
            "type": "object", "required": ["index", "a", "b"],
            "properties": {"index": {"type": "integer"}, "a": {"type": "string"}, "b": {"type": "string"}}}},
        "methods": {"type": "array", "items": {
            "type": "object",
            "required": ["method", "label", "summary", "pairs"],
            "properties": {
                "method": {"type": "string"},
                "label": {"type": "string"},
                "summary": {
                    "type": "object",
                    "required": ["n", "barrier_mean", "barrier_stderr", "peak_lambda_mean", "loss_a_mean", "loss_b_mean",
                                 "accuracy_barrier_mean", "accuracy_barrier_stderr", "loss_mean", "loss_stderr",
                                 "accuracy_mean"],
                    "properties": {
                        "n": {"type": "integer", "minimum": 1},
                        "barrier_mean": _NUM,
                        "barrier_stderr": _NUM_OR_NULL,
                        "peak_lambda_mean": {"type": "number"},
                        "loss_a_mean": _NUM,
                        "loss_b_mean": _NUM,
                        "accuracy_barrier_mean": _NUM_OR_NULL,
                        "accuracy_barrier_stderr": _NUM_OR_NULL,
                        "loss_mean": _NUMS,
                        "loss_stderr": {"type": "array", "items": _NUM_OR_NULL},
                        "accuracy_mean": {"oneOf": [_NUMS, {"type": "null"}]},
                    },
                },
                "pairs": {"type": "array", "items": {
                    "type": "object",
                    "required": ["pair", "barrier", "peak_lambda", "interior_max", "loss", "gap", "accuracy",
                                 "accuracy_barrier", "accuracy_peak_lambda", "seconds", "align_seconds", "align"],
                    "properties": {
                        "pair": {"type": "integer", "minimum": 0},
                        "barrier": _NUM,
                        "peak_lambda": {"type": "number", "minimum": 0, "maximum": 1},
                        "interior_max": _NUM_OR_NULL,
                        "loss": _NUMS,
                        "gap": _NUMS,
                        "accuracy": {"oneOf": [_NUMS, {"type": "null"}]},
                        "accuracy_barrier": _NUM_OR_NULL,
                        "accuracy_peak_lambda": {"oneOf": [{"type": "number"}, {"type": "null"}]},
                        "seconds": {"type": "number", "minimum": 0},
                        "align_seconds": {"type": "number", "minimum": 0},
                        "align": {"type": "object"},
                    },
                }},
            },
        }},
        "seconds": {"type": "number", "minimum": 0},
        "notes": {"type": "array", "items": {"type": "string"}},
    },
}
