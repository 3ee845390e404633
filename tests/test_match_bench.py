"""bench/bench_match.py measures one case end to end (timings are reported, not asserted)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from symspec.loading import import_file

ROOT = Path(__file__).resolve().parent.parent


def test_one_case_reports_time_cpu_memory_and_the_floor() -> None:
    if not Path("/proc/self/status").exists():
        pytest.skip("the benchmark reads peak memory from /proc (Linux)")
    bench = import_file(ROOT / "bench" / "bench_match.py")
    case = {"size": "tiny", "pair": "related", "groups": "full", "rounds": 2, "overlap": False}
    r = bench.run_case(case)
    assert r["rounds"] == 2 and len(r["objective"]) == 3
    # a related pair (B = g.A + noise) is brought much closer than it started
    assert r["relative_objective"][-1] < 0.5
    assert r["cpu_seconds"] > 0 and r["cores_busy"] > 0 and r["seconds"] > 0
    assert r["peak_rss_bytes"] >= 0 and r["model_bytes"] > 0
    assert r["floor_seconds_per_round"]["total"] > 0 and math.isfinite(r["solver_x_floor"])
    assert not r["overlap"] and r["timings"]["solve:Heads"] > 0
    assert bench._label(r) == "full w1-"
