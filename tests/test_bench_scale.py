"""bench/bench_scale.py measures CLI commands in child processes and writes its JSON, plot
and README table; bench/bench_gpu.py runs its CPU half without a GPU (timings are
reported, never asserted)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from bench import bench_gpu, bench_scale
from tests.needs import shared_data


def test_a_quick_run_writes_rows_a_plot_and_a_table(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("transformers")
    shared_data("tinyshakespeare.txt")  # the benchmark's text
    out = tmp_path / "scale.json"
    bench_scale.main(["--quick", "--sizes", "gpt2-tiny", "--dtypes", "float32", "--commands", "check",
                      "--cache", str(tmp_path / "cache"), "--out", str(out)])
    doc = json.loads(out.read_text())
    assert doc["command"].startswith("python -m bench.bench_scale --quick")
    assert doc["machine"]["cpus"] >= 1 and doc["data"]["train_tokens"] == 4096
    (row,) = doc["rows"]
    assert row["model"] == "gpt2-tiny" and row["command"] == "check" and row["dtype"] == "float32"
    assert row["rc"] == 0, row
    assert row["params"] == bench_scale.count_params(bench_scale.build("gpt2-tiny", 0))
    assert row["shards"] >= 2 and row["checkpoint_gb"] > 0
    # a child's own figures: torch alone takes more than 50 MB, and the ratio is to the checkpoint
    assert row["wall_s"] > 0 and row["cpu_s"] > 0 and row["peak_rss_gb"] > 0.05
    assert row["ratio"] == pytest.approx(row["peak_rss_gb"] * 1e9 / row["checkpoint_bytes"], rel=0.01)
    assert row["argv"].startswith("symspec check ") and "--samples 1" in row["argv"]
    assert (tmp_path / "scale.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    capsys.readouterr()
    bench_scale.main(["--table", "--out", str(out)])
    table = capsys.readouterr().out.splitlines()
    assert table[0].startswith("| model |") and len(table) == 3 and "| gpt2-tiny |" in table[2]


def test_a_failing_or_stuck_command_is_a_row_with_its_error(tmp_path: Path) -> None:
    ok = bench_scale.measure([sys.executable, "-c", "pass"], tmp_path / "ok.log", 60)
    assert ok["rc"] == 0 and "error" not in ok  # positive control
    bad = bench_scale.measure([sys.executable, "-c", "import sys; print('noise'); print('error: --x: no'); "
                               "print('more'); sys.exit(2)"], tmp_path / "bad.log", 60)
    assert bad["rc"] == 2 and bad["error"] == "error: --x: no"
    crash = bench_scale.measure([sys.executable, "-c", "raise RuntimeError('dtype mismatch')"], tmp_path / "c.log", 60)
    assert crash["rc"] == 1 and crash["error"] == "RuntimeError: dtype mismatch"
    stuck = bench_scale.measure([sys.executable, "-c", "import time; time.sleep(30)"], tmp_path / "s.log", 0.5)
    assert stuck["rc"] != 0 and stuck["error"].startswith("timed out") and stuck["wall_s"] < 20


def test_the_table_and_merge_keep_one_row_per_measurement() -> None:
    row = {"model": "m", "params": 5e8, "dtype": "bfloat16", "shards": 5, "command": "match", "rc": 0, "wall_s": 150.0,
           "peak_rss_gb": 3.0, "ratio": 3.0, "recovery": 2e-6}
    failed = {**row, "command": "check", "rc": 2, "error": "error: x"}
    merged = bench_scale.merged({"rows": [row, failed]}, [{**row, "wall_s": 90.0}])
    assert sorted((r["command"], r["wall_s"]) for r in merged) == [("check", 150.0), ("match", 90.0)]
    table = bench_scale.table({"rows": merged}).splitlines()
    # an input error (exit 2) is a refusal, after the time it took; anything else a failure
    assert "| `check` | refused after 2:30 (error: x) |" in table[2]
    assert "| `match` | 90.0 s | 3.00 GB | 3.0x | 2.0e-06 |" in table[3]
    crashed = bench_scale.table({"rows": [{**failed, "rc": 1, "error": "RuntimeError: y"}]}).splitlines()
    assert "| `check` | failed (RuntimeError: y) |" in crashed[2]
    assert bench_scale.fmt_seconds(150) == "2:30"


def test_the_table_goes_between_the_readme_markers(tmp_path: Path) -> None:
    readme = tmp_path / "README.md"
    readme.write_text("# x\n<!-- scale-table:begin -->\nold\n<!-- scale-table:end -->\ntail\n")
    bench_scale.write_between_markers(readme, "| new |")
    assert readme.read_text() == "# x\n<!-- scale-table:begin -->\n| new |\n<!-- scale-table:end -->\ntail\n"
    readme.write_text("no markers\n")
    with pytest.raises(SystemExit, match="needs one"):
        bench_scale.write_between_markers(readme, "| new |")
    assert readme.read_text() == "no markers\n"


def test_the_gpu_script_says_no_cuda_or_runs_its_cpu_half(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("transformers")
    import torch

    out = tmp_path / "gpu.json"
    if not torch.cuda.is_available():
        assert bench_gpu.main(["--out", str(out)]) == 0
        assert "no CUDA" in capsys.readouterr().out and not out.exists()
    assert bench_gpu.main(["--cpu-only", "--cases", "experts-16", "--methods", "weight", "--out", str(out)]) == 0
    (row,) = json.loads(out.read_text())["rows"]
    assert row["device"] == "cpu" and row["method"] == "weight" and row["recovery"] < 1e-5


def test_a_failing_gpu_case_is_a_row_and_the_run_goes_on(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("transformers")
    import symspec

    def fails(*args: object, **kwargs: object) -> None:
        raise RuntimeError("Expected all tensors to be on the same device")

    monkeypatch.setattr(symspec, "align", fails)
    out = tmp_path / "gpu.json"
    assert bench_gpu.main(["--cpu-only", "--cases", "experts-16", "experts-16", "--methods", "weight",
                           "--out", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert len(rows) == 2 and all(r["error"] == "RuntimeError: Expected all tensors to be on the same device" for r in rows)
