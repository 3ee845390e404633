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


def _gpt_batch(n: int, t: int) -> tuple[torch.nn.Module, torch.Tensor, symspec.Bound]:
    model, _ = ZOO["gpt2"](seed=0, n_layer=2)
    ids = torch.randint(0, model.config.vocab_size, (n, t), generator=torch.Generator().manual_seed(0))
    return model, ids, symspec.bind("gpt2", model)


def test_micro_batches_hold_the_moments_of_the_whole_batch() -> None:
    """A batch recorded a few samples at a time (the default on any batch whose features
    exceed MICRO_BYTES) gives the moments of the batch recorded whole, to float32
    rounding; with a state B != A, so the cross moments are not Grams. Compared per
    row: a site without the batch axis (GPT-2's position embedding, [1, T, d]) is seen
    once per micro-batch, its rows counted as often."""
    model, ids, bound = _gpt_batch(6, 8)
    sa = dict(model.state_dict())
    sb = {k: v + 0.01 * torch.randn_like(v) if v.is_floating_point() else v for k, v in sa.items()}
    whole = moments_module.collect_moments(model, bound.problem, sa, sb, _Batches(ids, 2), micro_bytes=1 << 40)
    parts = moments_module.micro_batches(ids, 64, torch.float32, limit=2 * 8 * 64 * 4)
    assert [p.shape[0] for p in parts] == [2, 2, 2]  # the split did happen
    split = moments_module.collect_moments(model, bound.problem, sa, sb, _Batches(ids, 2), micro_bytes=2 * 8 * 64 * 4)
    assert whole.tokens == split.tokens == 2 * 6 * 8 and whole.batches == split.batches == 2
    worst = 0.0
    for name, m in whole.moments.items():
        other = split.moments[name]
        for got, want in [*zip(other.cross, m.cross), *((g, h) for g, h in zip(other.gram, m.gram) if h is not None),
                          (other.sum_a, m.sum_a), (other.sq_b, m.sq_b)]:
            assert got.dtype == torch.float64
            got, want = got / other.count, want / m.count
            worst = max(worst, float((got - want).abs().max() / want.abs().max().clamp_min(1e-30)))
    assert worst < 1e-5, worst
    # the control: a different batch's moments are far from these
    other = moments_module.collect_moments(model, bound.problem, sa, sb, _Batches(ids.flip(0)[:, :7], 2))
    name = next(iter(whole.moments))
    assert float((other.moments[name].cross[0] - whole.moments[name].cross[0]).abs().max()) > 1e-3


def test_micro_batches_split_whole_samples_evenly_or_not_at_all() -> None:
    ids = torch.zeros(12, 10, dtype=torch.long)
    row = 10 * 100 * 4  # one sample's bytes at 100 features in float32
    assert [p.shape for p in moments_module.micro_batches(ids, 100, torch.float32, 5 * row)] == [(4, 10)] * 3
    assert len(moments_module.micro_batches(ids, 100, torch.float32, 12 * row)) == 1
    assert [p.shape[0] for p in moments_module.micro_batches(ids, 100, torch.float32, 1)] == [1] * 12
    odd = moments_module.micro_batches(torch.zeros(7, 10, dtype=torch.long), 100, torch.float32, 3 * row)
    assert [p.shape[0] for p in odd] == [1] * 7  # 7 is prime: equal pieces are single samples
    mapping = {"input_ids": ids, "attention_mask": torch.ones(12, 10), "flag": True}
    pieces = moments_module.micro_batches(mapping, 100, torch.float32, 6 * row)
    assert [(p["input_ids"].shape[0], p["attention_mask"].shape[0], p["flag"]) for p in pieces] == [(6, 6, True)] * 2
    # no batch axis to read: one piece
    assert len(moments_module.micro_batches({"a": torch.zeros(4, 3), "b": torch.zeros(5)}, 100, torch.float32, 1)) == 1
    assert len(moments_module.micro_batches(torch.tensor(3), 100, torch.float32, 1)) == 1
    # an unbatched sequence: its first axis is tokens that attend to each other, never split
    assert len(moments_module.micro_batches(torch.zeros(64, dtype=torch.long), 100, torch.float32, 1)) == 1


def test_the_heap_setting_is_restored_and_untouched_where_not_configured(monkeypatch: pytest.MonkeyPatch) -> None:
    import symspec.process as process

    calls: list[tuple] = []

    class FakeLibc:
        def mallopt(self, param: int, value: int) -> int:
            calls.append(("mallopt", param, value))
            return 1

        def malloc_trim(self, pad: int) -> int:
            calls.append(("trim", pad))
            return 1

    monkeypatch.setattr(process, "_libc", lambda: FakeLibc())
    monkeypatch.setattr(process, "_configured_mmap", None)
    with process.reused_heap():
        pass
    assert calls == []  # a library user's process: its allocator is left alone
    monkeypatch.setattr(process, "_configured_mmap", 1 << 20)
    with pytest.raises(RuntimeError), process.reused_heap():
        assert calls[0] == ("mallopt", -3, 32 << 20)
        raise RuntimeError("the block failed")
    assert calls[-3:] == [("mallopt", -3, 1 << 20), ("mallopt", -1, 128 * 1024), ("trim", 0)]
