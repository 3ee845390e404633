"""Interpolation: the λ grid, lerped state dicts, and one evaluator instance for a whole curve.

Each curve is checked against an independent oracle: a fresh model loaded with the
interpolated weights and run on all the data at once.
"""

from __future__ import annotations

import copy
import itertools
import math
import random

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from symspec.analyzers.interpolate import (
    PathError,
    PathEvaluator,
    check_grid,
    check_pair,
    interpolation_curve,
    lambdas,
    lerp_state,
)
from symspec.data import EvalData, cross_entropy, load_data
from tests.zoo import example


def tiny_gpt(seed: int, vocab: int = 9, **kw: object) -> torch.nn.Module:
    torch.manual_seed(seed)
    cfg = {"vocab_size": vocab, "block_size": 8, "n_layer": 1, "n_head": 2, "n_embd": 8, "n_ff": 12, **kw}
    return example("nanogpt").build(**cfg).eval()


def text_file(tmp_path, vocab: int = 9, n: int = 1200, seed: int = 0):
    rng = random.Random(seed)
    alphabet = "abcdefghijklmnopqrstuvwxyz"[:vocab]
    path = tmp_path / "toy.txt"
    path.write_text(alphabet + "".join(rng.choice(alphabet) for _ in range(n - vocab)))
    return path


def oracle_loss(module: torch.nn.Module, sd: dict[str, torch.Tensor], data: EvalData) -> float:
    """A fresh copy, loaded with ``sd``, run on the whole split at once."""
    m = copy.deepcopy(module)
    m.load_state_dict(sd, strict=False)
    x = torch.cat([b[0][0] for b in data.batches])
    y = torch.cat([b[1] for b in data.batches])
    with torch.no_grad():
        return float(cross_entropy(m(x), y))


# ----------------------------------------------------------------------------- the grid

@given(st.integers(2, 60))
def test_lambdas_include_both_exact_endpoints_and_are_even(k: int) -> None:
    grid = lambdas(k)
    assert len(grid) == k
    assert grid[0] == 0.0 and grid[-1] == 1.0
    steps = [b - a for a, b in itertools.pairwise(grid)]
    assert all(abs(s - 1 / (k - 1)) < 1e-12 for s in steps)
    assert check_grid(grid) == grid


@pytest.mark.parametrize("k", [1, 0, -3, 2.5, True])
def test_fewer_than_two_points_are_refused(k: object) -> None:
    with pytest.raises(PathError, match="at least 2 points"):
        lambdas(k)  # type: ignore[arg-type]


@pytest.mark.parametrize("grid, msg", [([0.0], "at least 2"), ([0.1, 1.0], "start at 0"), ([0.0, 0.9], "end at 1"),
                                       ([0.0, 0.6, 0.4, 1.0], "increasing")])
def test_bad_custom_grids_are_refused(grid: list[float], msg: str) -> None:
    with pytest.raises(PathError, match=msg):
        check_grid(grid)


# ----------------------------------------------------------------------------- lerp

@given(st.floats(0.0, 1.0), st.integers(0, 1000))
def test_lerp_is_the_convex_combination_with_exact_ends(lam: float, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    a = {"w": torch.randn(5, 3, generator=g), "i": torch.arange(4)}
    b = {"w": torch.randn(5, 3, generator=g), "i": torch.arange(4)}
    mid = lerp_state(a, b, lam)
    assert torch.allclose(mid["w"], (1 - lam) * a["w"] + lam * b["w"], atol=1e-6)
    assert mid["i"] is a["i"]
    assert torch.equal(lerp_state(a, b, 0.0)["w"], a["w"])
    assert torch.equal(lerp_state(a, b, 1.0)["w"], b["w"])


def test_lerp_writes_into_given_buffers() -> None:
    a, b = {"w": torch.zeros(3)}, {"w": torch.full((3,), 2.0)}
    buf = {"w": torch.empty(3)}
    before = buf["w"].data_ptr()
    out = lerp_state(a, b, 0.25, out=buf)
    assert out is buf and buf["w"].data_ptr() == before
    assert buf["w"].tolist() == [0.5, 0.5, 0.5]
    assert a["w"].tolist() == [0.0, 0.0, 0.0]  # the endpoints are untouched


def test_check_pair_accepts_one_architecture_and_names_every_mismatch() -> None:
    a = {k: v for k, v in tiny_gpt(0).state_dict().items()}
    check_pair(a, dict(tiny_gpt(1).state_dict()))
    with pytest.raises(PathError, match=r"shape\(s\) differ: transformer.wte.weight"):
        check_pair(a, dict(tiny_gpt(1, n_embd=12).state_dict()))
    with pytest.raises(PathError, match="only in B: extra"):
        check_pair(a, {**a, "extra": torch.zeros(1)})
    with pytest.raises(PathError, match="only in A"):
        check_pair(a, {k: v for k, v in a.items() if k != "lm_head.weight"})
    with pytest.raises(PathError, match="non-floating"):
        check_pair({"i": torch.arange(3)}, {"i": torch.arange(3) + 1})
    bad = {k: v.clone() for k, v in a.items()}
    bad["transformer.wpe.weight"][0, 0] = math.nan
    with pytest.raises(PathError, match="NaN or inf in B"):
        check_pair(a, bad)


# ----------------------------------------------------------------------------- curves

def test_curve_matches_a_fresh_model_at_every_lambda(tmp_path) -> None:
    path = text_file(tmp_path)
    a, b = tiny_gpt(0), tiny_gpt(1)
    data = load_data(f"text:{path}", model=a, split="val", batch_size=5)
    assert len(data.batches) > 2 and data.batches[-1][1].shape[0] != 5  # uneven last batch: weighting matters
    sa, sb = dict(a.state_dict()), dict(b.state_dict())
    grid = [0.0, 0.3, 0.5, 0.8, 1.0]
    curve = interpolation_curve(a, sa, sb, data, points=grid)
    for lam, loss in zip(grid, curve.losses):
        want = oracle_loss(a, lerp_state(sa, sb, lam), data)
        assert abs(loss - want) < 1e-5 * want
        # negative control: the oracle at another λ is told apart by that tolerance
        assert abs(loss - oracle_loss(a, lerp_state(sa, sb, min(1.0, lam + 0.1) if lam < 1 else 0.9), data)) > 1e-5 * want


def test_batch_size_does_not_change_the_result(tmp_path) -> None:
    path = text_file(tmp_path)
    a, b = tiny_gpt(0), tiny_gpt(1)
    sa, sb = dict(a.state_dict()), dict(b.state_dict())
    curves = [interpolation_curve(a, sa, sb, load_data(f"text:{path}", model=a, batch_size=bs), points=4) for bs in (3, 7, 64)]
    for c in curves[1:]:
        assert all(abs(x - y) < 1e-5 for x, y in zip(c.losses, curves[0].losses))
        assert all(abs(x - y) < 1e-6 for x, y in zip(c.accuracies, curves[0].accuracies))  # type: ignore[arg-type]
    # negative control: an unweighted mean over uneven batches differs from the weighted one
    data = load_data(f"text:{path}", model=a, batch_size=4)
    assert data.batches[-1][1].shape[0] != 4
    with torch.no_grad():
        naive = sum(float(cross_entropy(a(x[0]), y)) for x, y in data.batches) / len(data.batches)
    assert abs(naive - curves[0].losses[0]) > 1e-6


def test_one_module_instance_serves_every_point(tmp_path, monkeypatch) -> None:
    path = text_file(tmp_path)
    a, b = tiny_gpt(0), tiny_gpt(1)
    data = load_data(f"text:{path}", model=a, batch_size=8)
    ev = PathEvaluator(a, data)
    seen: list[int] = []
    real = torch.func.functional_call

    def spy(module, *args, **kw):  # type: ignore[no-untyped-def]
        seen.append(id(module))
        return real(module, *args, **kw)

    monkeypatch.setattr(torch.func, "functional_call", spy)
    deepcopies = []
    real_deepcopy = copy.deepcopy
    monkeypatch.setattr(copy, "deepcopy", lambda x, *r: deepcopies.append(type(x)) or real_deepcopy(x, *r))
    ev.curve(dict(a.state_dict()), dict(b.state_dict()), points=7)
    assert len(seen) == 7 * len(data.batches) == ev.calls
    assert set(seen) == {id(ev.module)}
    assert not any(issubclass(t, torch.nn.Module) for t in deepcopies)
    # the template model's own weights are never used nor changed
    assert ev.module is not a and all(p.device.type == "cpu" for p in a.parameters())


def test_the_template_modules_weights_do_not_leak_into_the_curve(tmp_path) -> None:
    path = text_file(tmp_path)
    a, b, c = tiny_gpt(0), tiny_gpt(1), tiny_gpt(2)
    data = load_data(f"text:{path}", model=a, batch_size=16)
    sa, sb = dict(a.state_dict()), dict(b.state_dict())
    via_c = interpolation_curve(c, sa, sb, data, points=3)
    via_a = interpolation_curve(a, sa, sb, data, points=3)
    assert via_a.losses == via_c.losses
    assert interpolation_curve(c, dict(c.state_dict()), sb, data, points=3).losses[0] != via_a.losses[0]


def test_tied_weights_are_evaluated_once_and_untying_in_the_state_dict_is_refused(tmp_path) -> None:
    path = text_file(tmp_path)
    a = tiny_gpt(0)
    assert a.lm_head.weight is a.transformer.wte.weight
    data = load_data(f"text:{path}", model=a, batch_size=16)
    sd = dict(a.state_dict())
    ev = PathEvaluator(a, data)
    ev.evaluate(sd)
    broken = {**sd, "lm_head.weight": sd["lm_head.weight"] + 1.0}
    with pytest.raises(PathError, match="ties them"):
        ev.evaluate(broken)


def test_state_dicts_that_do_not_fit_the_module_are_refused(tmp_path) -> None:
    path = text_file(tmp_path)
    a = tiny_gpt(0)
    ev = PathEvaluator(a, load_data(f"text:{path}", model=a, batch_size=16))
    sd = dict(a.state_dict())
    with pytest.raises(PathError, match="lacks 1 tensor"):
        ev.evaluate({k: v for k, v in sd.items() if k != "transformer.wpe.weight"})
    with pytest.raises(PathError, match="does not: bogus"):
        ev.evaluate({**sd, "bogus": torch.zeros(1)})
    with pytest.raises(PathError, match="has shape"):
        ev.evaluate({**sd, "transformer.wpe.weight": torch.zeros(3, 3)})


def test_float64_evaluation_agrees_with_float32(tmp_path) -> None:
    path = text_file(tmp_path)
    a, b = tiny_gpt(0), tiny_gpt(1)
    data = load_data(f"text:{path}", model=a, batch_size=16)
    sa, sb = dict(a.state_dict()), dict(b.state_dict())
    c32 = interpolation_curve(a, sa, sb, data, points=3)
    c64 = interpolation_curve(a, sa, sb, data, points=3, dtype=torch.float64)
    assert all(abs(x - y) < 1e-5 for x, y in zip(c32.losses, c64.losses))
    assert c32.losses != c64.losses  # really two precisions


def test_unavailable_devices_are_input_errors(tmp_path) -> None:
    path = text_file(tmp_path)
    a = tiny_gpt(0)
    data = load_data(f"text:{path}", model=a, batch_size=16)
    with pytest.raises(PathError, match="unknown device"):
        PathEvaluator(a, data, device="warp-drive")
    if not torch.cuda.is_available():
        with pytest.raises(PathError, match="CUDA is not available"):
            PathEvaluator(a, data, device="cuda")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device: run on a machine with an NVIDIA GPU and a CUDA build of torch")
def test_cuda_curve_matches_cpu(tmp_path) -> None:
    path = text_file(tmp_path)
    a, b = tiny_gpt(0), tiny_gpt(1)
    data = load_data(f"text:{path}", model=a, batch_size=16)
    sa, sb = dict(a.state_dict()), dict(b.state_dict())
    cpu = interpolation_curve(a, sa, sb, data, points=5)
    gpu = interpolation_curve(a, sa, sb, data, points=5, device="cuda")
    assert all(abs(x - y) < 1e-4 for x, y in zip(cpu.losses, gpu.losses))


def test_empty_data_is_refused() -> None:
    a = tiny_gpt(0)
    with pytest.raises(PathError, match="empty"):
        PathEvaluator(a, EvalData("nothing", "hook", "val", [], cross_entropy, None))


@pytest.mark.parametrize("name", ["interpolate", "barrier"])
def test_docstring_examples_run(name: str) -> None:
    # analyzers/ is outside pytest's doctest paths (tests, symspec): run its examples here
    # (the data sources' examples live in symspec/data, where pytest runs them)
    import doctest
    import importlib

    module = importlib.import_module(f"symspec.analyzers.{name}")
    result = doctest.testmod(module)
    assert result.attempted > 0 and result.failed == 0


class _WithBuffers(torch.nn.Module):
    """A persistent integer buffer, a non-persistent float one (like rotary frequencies)."""

    def __init__(self, seed: int) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.lin = torch.nn.Linear(4, 3)
        self.register_buffer("index", torch.arange(4))
        self.register_buffer("scale", torch.full((4,), 2.0), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x[:, self.index] * self.scale)


def test_non_persistent_buffers_come_from_the_module() -> None:
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(30, 4, generator=g), torch.randint(3, (30,), generator=g)
    data = EvalData("toy", "hook", "val", [((x,), y)], cross_entropy, None)
    a, b = _WithBuffers(0), _WithBuffers(1)
    assert "scale" not in a.state_dict()
    curve = interpolation_curve(a, dict(a.state_dict()), dict(b.state_dict()), data, points=3)
    with torch.no_grad():
        assert curve.losses[0] == pytest.approx(float(cross_entropy(a(x), y)), rel=1e-6)
        mid = _WithBuffers(0)
        mid.load_state_dict(lerp_state(dict(a.state_dict()), dict(b.state_dict()), 0.5))
        assert curve.losses[1] == pytest.approx(float(cross_entropy(mid(x), y)), rel=1e-6)
        a.scale.fill_(3.0)  # negative control: the evaluator copied the module, so it used 2.0
        assert curve.losses[0] != pytest.approx(float(cross_entropy(a(x), y)), rel=1e-6)


def test_float64_losses_stay_float64_and_plain_float_losses_are_accepted() -> None:
    logits = torch.randn(5, 3, dtype=torch.float64)
    assert cross_entropy(logits, torch.tensor([0, 1, 2, 0, 1])).dtype == torch.float64
    assert cross_entropy(logits.to(torch.bfloat16), torch.tensor([0, 1, 2, 0, 1])).dtype == torch.float32
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(8, 4, generator=g), torch.randint(3, (8,), generator=g)
    as_float = EvalData("toy", "hook", "val", [((x,), y)], lambda o, t: float(cross_entropy(o, t)), None)
    as_tensor = EvalData("toy", "hook", "val", [((x,), y)], cross_entropy, None)
    m = torch.nn.Linear(4, 3)
    sd = dict(m.state_dict())
    assert PathEvaluator(m, as_float).evaluate(sd).loss == pytest.approx(PathEvaluator(m, as_tensor).evaluate(sd).loss)
