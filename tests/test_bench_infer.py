"""bench/bench_infer.py --families: inference timed per family of the inference zoo and
the encoder-decoders, with the groups found (a row that fails shows it)."""

from __future__ import annotations

import pytest

from bench import bench_infer

pytest.importorskip("transformers")


def test_a_family_row_says_what_was_found() -> None:
    row = bench_infer.measure_family("clip_text", samples=1)
    assert row["verified"] and row["as_expected"] and row["spaces"]["resid"] == "OC(d)"
    assert row["wall_s"] > 0 and row["rounds"] >= 1
    t5 = bench_infer.measure_family("t5", samples=1)
    assert t5["verified"] and t5["as_expected"] is None  # no expectation written for it: not claimed
    assert {"scale", "scale2"} <= set(t5["spaces"])


def test_every_family_is_listed() -> None:
    from tests.infer_zoo import NEW

    assert bench_infer.family_names() == [*NEW, "t5", "bart", "whisper"]
