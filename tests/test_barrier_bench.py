"""bench/bench_barrier.py runs end to end in --quick mode (timings are reported, not asserted)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from symspec.loading import import_file
from tests.needs import shared_data

ROOT = Path(__file__).resolve().parent.parent


def test_bench_quick_writes_its_results(tmp_path: Path) -> None:
    shared = shared_data("tinyshakespeare.txt", "mnist")
    bench = import_file(ROOT / "bench" / "bench_barrier.py")
    out = tmp_path / "barrier.json"
    threads = torch.get_num_threads()
    try:
        assert bench.main(["--quick", "--data", str(shared), "--out", str(out), "--points", "3"]) == 0
    finally:
        torch.set_num_threads(threads)  # the bench pins its own thread count
    doc = json.loads(out.read_text())
    assert [c["case"] for c in doc["cases"]] == ["gpt-tinyshakespeare", "vit-mnist"]
    for c in doc["cases"]:
        assert c["points"] == 3 and c["forward_passes"] == 3 * c["data"]["batches"]
        assert math.isfinite(c["ratio"]) and c["ratio"] > 0 and c["within_target"] == (c["ratio"] <= 1.2)


def test_bench_names_missing_data(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bench = import_file(ROOT / "bench" / "bench_barrier.py")
    assert bench.main(["--data", str(tmp_path), "--out", str(tmp_path / "x.json")]) == 2
    assert "missing data" in capsys.readouterr().err and not (tmp_path / "x.json").exists()
