"""Activation statistics that would not fit in the free memory are refused up front, in
one line naming what they need and what is free, instead of the process being killed
without a word (Qwen2-0.5B: float64 4864 x 4864 moments for every layer at once)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import symspec
import symspec.alignment.moments as moments_module
from symspec.graph import SiteRecorder, read_sites
from symspec.solvers.engine.activation_statistics import ActivationMoments
from tests.cli_files import WORDS, run, write_words
from tests.zoo import ZOO

transformers = pytest.importorskip("transformers")

VOCAB = len(set(" ".join(WORDS) + ".\n"))


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("actmem")
    text = root / "words.txt"
    write_words(text)
    out = {"text": text}
    for seed in (0, 1):
        ZOO["qwen2"](seed=seed, n_layer=1, vocab=VOCAB)[0].save_pretrained(root / f"m{seed}")
        out[f"m{seed}"] = root / f"m{seed}"
    return out


@pytest.mark.parametrize("method", ["activation", "weight+activation"])
def test_statistics_beyond_free_memory_are_one_line(folders: dict[str, Path], tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch, method: str) -> None:
    args = ["match", str(folders["m0"]), str(folders["m1"]), "--method", method, "--rounds", "1",
            "--data", f"text:{folders['text']},block=8"]
    monkeypatch.setattr(moments_module, "available_memory", lambda: 1000)
    code, _, err = run(*args, "--out", str(tmp_path / "o"))
    assert code == 2 and err.startswith("error: ") and len(err.strip().splitlines()) == 1, err
    assert "activation statistics" in err and "GB" in err and "--method weight" in err
    assert not (tmp_path / "o").exists()
    monkeypatch.setattr(moments_module, "available_memory", lambda: 1 << 40)  # the control: enough memory
    code, _, err = run(*args, "--out", str(tmp_path / "o2"))
    assert code == 0, err


def test_the_estimate_is_what_the_statistics_hold() -> None:
    """The planned bytes (meta tensors) are the bytes the real moments take."""
    model, inputs = ZOO["qwen2"](seed=0, n_layer=1, vocab=VOCAB)
    bound = symspec.bind("qwen2", model)
    rec = SiteRecorder(model, bound.problem, select=read_sites)
    rec.record(inputs)
    planned = ActivationMoments.empty(rec.sites, "meta", bound.problem)
    real = ActivationMoments.empty(rec.sites, "cpu", bound.problem)
    assert planned.bytes == real.bytes > 0
    moments_module.refuse_beyond_memory(planned, "m", available=2 * planned.bytes)  # fits: no error
    with pytest.raises(Exception, match="activation statistics of m need"):
        moments_module.refuse_beyond_memory(planned, "m", available=2 * planned.bytes - 1)
    assert torch.float64 in {t.dtype for m in real.moments.values() for t in m.cross}


def _qwen_bound() -> tuple[torch.nn.Module, dict, symspec.Bound]:
    model, inputs = ZOO["qwen2"](seed=0, n_layer=1, vocab=VOCAB)
    return model, inputs, symspec.bind("qwen2", model)


class _Batches:
    def __init__(self, inputs: object, n: int) -> None:
        self.batches = [(inputs, None)] * n


def test_the_refusal_comes_before_the_first_forward_pass(monkeypatch: pytest.MonkeyPatch) -> None:
    # at 0.5B the process was killed while recording A's first batch, before the refusal
    model, inputs, bound = _qwen_bound()
    state = dict(model.state_dict())

    def ran(*args: object, **kw: object) -> None:
        raise AssertionError("a forward pass ran")

    monkeypatch.setattr(SiteRecorder, "record", ran)
    monkeypatch.setattr(moments_module, "available_memory", lambda: 1000)
    with pytest.raises(symspec.errors.SymspecInputError, match="activation statistics of Qwen2ForCausalLM need"):
        moments_module.collect_moments(model, bound.problem, state, state, _Batches(inputs, 1))
    monkeypatch.setattr(moments_module, "available_memory", lambda: 1 << 40)  # the control: the pass would run
    with pytest.raises(AssertionError, match="a forward pass ran"):
        moments_module.collect_moments(model, bound.problem, state, state, _Batches(inputs, 1))


def test_one_batch_features_are_counted_before_they_are_recorded() -> None:
    model, inputs, bound = _qwen_bound()
    rec = SiteRecorder(model, bound.problem, select=read_sites)
    sites = rec.prepare(inputs)
    recorded = rec.record(inputs)
    assert set(recorded) == {s.name for s in sites} and recorded
    held = sum(t.numel() * t.element_size() for t in recorded.values())
    assert moments_module._feature_bytes(sites, inputs, torch.float32) == held > 0
    planned = ActivationMoments.empty(sites, "meta", bound.problem)
    moments_module.refuse_beyond_memory(planned, "m", available=2 * planned.bytes + held, features=held)
    with pytest.raises(Exception, match="one batch's features"):
        moments_module.refuse_beyond_memory(planned, "m", available=2 * planned.bytes + held - 1, features=held)


def test_the_statistics_pass_reports_its_progress() -> None:
    from symspec.solvers.engine.activation_statistics import activation_terms

    model, inputs, bound = _qwen_bound()
    state = dict(model.state_dict())
    events: list = []
    moments = moments_module.collect_moments(model, bound.problem, state, state, _Batches(inputs, 3),
                                             progress=events.append)
    seen = [(e.kind, e.round, e.rounds, e.space, e.done, e.total) for e in events]
    assert seen == [("statistics", i // 2 + 1, 3, "AB"[i % 2], i, 6) for i in range(6)]
    n = len(moments.sites)
    events.clear()
    activation_terms(bound.problem, moments, release=True, progress=events.append)
    assert [(e.kind, e.done, e.total) for e in events] == [("factor", i, n) for i in range(n)]
    assert [e.space for e in events] == list(moments.sites)


def test_a_log_shows_the_statistics_pass(folders: dict[str, Path], tmp_path: Path,
                                         monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SYMSPEC_PROGRESS_SECONDS", "0")  # a line for every update
    args = ["match", str(folders["m0"]), str(folders["m1"]), "--rounds", "1"]
    code, _, err = run(*args, "--method", "weight+activation", "--data", f"text:{folders['text']},block=8",
                       "--out", str(tmp_path / "o"))
    assert code == 0, err
    assert "match: activation statistics: batch 1/" in err and ", model A (0/" in err, err
    assert ", model B (1/" in err and "match: factoring activation statistics: " in err, err
    code, _, err = run(*args, "--out", str(tmp_path / "w"))  # the control: weight matching has no such pass
    assert code == 0 and "activation statistics" not in err, err
