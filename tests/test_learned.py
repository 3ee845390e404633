"""Learned matching: parametrisations that stay in their groups, and the method end to end.

Every parametrised kind is checked on random latents (seeded by hypothesis): the element
is in the group, equals the start at zero latents, and has gradients; a free
parametrisation (M0 + X) leaves O and is caught by the same membership test. The method
is run on small nanoGPTs: the midpoint loss falls, aligned B computes B's function (a
corrupted element is refused by the final check), runs are deterministic given a seed,
and the CLI writes the usual outputs."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import symspec
from symspec.data import EvalData
from symspec.errors import SymspecInputError
from symspec.groups import GL, OC, SP, D, Dpos, Heads, Id, O, RoPE, S
from symspec.groups.classic import Sign
from symspec.learned import LearnedOptions
from symspec.learned.method import lambda_sampler
from symspec.learned.parametrize import PARAMETRIZATIONS, ParamSettings, parametrize
from symspec.loading import import_file
from symspec.solvers import SolverError
from tests.cli_files import ROOT, gpt_checkpoints, run
from tests.zoo import ZOO

GROUPS = [S(6), O(5), OC(6), GL(4), D(5), Dpos(5), RoPE(6), RoPE(8, rot=4), Id(3), Sign(4), SP(4),
          Heads(4, (("qk", GL(3)), ("ov", O(3)))), Heads(4, (("qk", RoPE(4)), ("ov", GL(4))), kv=2)]
MODES = [("exp", "frozen"), ("polar", "ste"), ("exp", "sinkhorn")]


def _perturb(p: Any, gen: torch.Generator, scale: float = 0.3) -> None:
    with torch.no_grad():
        for t in p.latents():
            t.add_(scale * torch.randn(t.shape, generator=gen, dtype=t.dtype))


def test_every_group_kind_has_a_parametrisation() -> None:
    from symspec.groups.base import REGISTRY

    assert set(REGISTRY) <= set(PARAMETRIZATIONS)


@pytest.mark.parametrize("group", GROUPS, ids=str)
@pytest.mark.parametrize("mode", MODES, ids=lambda m: "-".join(m))
@settings(max_examples=4, deadline=None)
@given(seed=st.integers(0, 10_000))
def test_parametrised_elements_stay_in_the_group(group: Any, mode: tuple[str, str], seed: int) -> None:
    settings_ = ParamSettings(orthogonal=mode[0], permutations=mode[1])
    start = group.sample(seed)
    p = parametrize(group, start, settings_)
    # at the start: the start (sinkhorn's soft matrix hardens to the start's permutation)
    assert group.equal(p.project(), group.to(start, torch.float64), atol=1e-9)
    _perturb(p, torch.Generator().manual_seed(seed))
    e = p.project()
    assert group.contains(e, atol=1e-7), (group, mode)
    if mode[1] == "frozen" or not p.latents():
        assert group.contains(p.element(), atol=1e-7)
    # gradients reach every latent through the action
    if p.latents():
        x = torch.randn(group.rep_size(group.rep_paths()[0]), 3, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
        act = p.action()
        path = group.rep_paths()[0]
        y = act(x, path, "co") if act is not None else group.apply(p.element(), x, path, "co")
        (y * torch.randn_like(y)).sum().backward()
        assert any(t.grad is not None and bool(t.grad.abs().sum() > 0) for t in p.latents())


def test_a_free_parametrisation_leaves_the_group_and_is_caught() -> None:
    """The negative case of the membership test above: M0 + X is not orthogonal."""
    g = O(5)
    m = g.sample(0)["matrix"] + 0.1 * torch.randn(5, 5, dtype=torch.float64)
    assert not g.contains({"matrix": m}, atol=1e-7)


@pytest.mark.parametrize("group", [S(7), Heads(4, (("qk", GL(3)), ("ov", GL(3)))), Heads(6, (("", GL(2)),), kv=3)], ids=str)
def test_straight_through_actions_equal_the_group_action(group: Any) -> None:
    p = parametrize(group, group.sample(3), ParamSettings(permutations="ste"))
    act = p.action()
    assert act is not None
    e = p.element()
    gen = torch.Generator().manual_seed(0)
    for path in group.rep_paths():
        x = torch.randn(group.rep_size(path), 5, dtype=torch.float64, generator=gen)
        for variance in ("co", "contra"):
            torch.testing.assert_close(act(x, path, variance), group.apply(e, x, path, variance))


def test_sinkhorn_anneals_to_the_hard_permutation() -> None:
    g = S(8)
    start = g.sample(5)
    p = parametrize(g, start, ParamSettings(permutations="sinkhorn", temperature=(0.1, 0.001)))
    p.anneal(1.0)
    x = torch.randn(8, 3, dtype=torch.float64)
    torch.testing.assert_close(p.action()(x, (), "co"), g.apply(start, x), atol=1e-6, rtol=0)


def test_lambda_samplers_and_options_refuse_bad_values() -> None:
    assert lambda_sampler("uniform") == (0.0, 1.0)
    for bad in ("wide", "fixed:2", "fixed:x", "fixed:nan"):
        with pytest.raises(SymspecInputError):
            lambda_sampler(bad)
    for kw in ({"steps": 0}, {"lr": 0.0}, {"permutations": "soft"}, {"orthogonal": "cayley"}, {"warmup": 1.0}):
        with pytest.raises(SymspecInputError):
            LearnedOptions(**kw)


# ----------------------------------------------------------------------------- end to end

def _models() -> tuple[torch.nn.Module, torch.nn.Module]:
    ng = import_file(ROOT / "examples" / "nanogpt.py")
    cfg = dict(vocab_size=12, block_size=16, n_layer=1, n_head=2, n_embd=16, n_ff=32)
    torch.manual_seed(0)
    a = ng.build(**cfg)
    torch.manual_seed(1)
    return a, ng.build(**cfg)


def _data(split: str, n: int = 6, seed: int = 0) -> EvalData:
    """Sequences of a repeating pattern: learnable, so the interpolated model has
    something to get better at."""
    ng = import_file(ROOT / "examples" / "nanogpt.py")
    gen = torch.Generator().manual_seed(seed)
    batches = []
    for _ in range(n):
        start = torch.randint(0, 12, (8, 1), generator=gen)
        seq = (start + torch.arange(17)) % 12
        batches.append(((seq[:, :16],), seq[:, 1:]))
    return EvalData("pattern", "hook", split, batches, ng.loss, None)


@pytest.fixture(scope="module")
def learned() -> Any:
    a, b = _models()
    opts = LearnedOptions(steps=40, lr=1e-2, eval_every=10)
    return a, b, symspec.align(a, b, "nanogpt", method="learned", data=_data("train"), validation=_data("val", 2, 1),
                               options=opts)


def test_learned_matching_lowers_the_midpoint_loss_and_keeps_the_function(learned: Any) -> None:
    _, b, res = learned
    info = res.info
    assert info["start"] == "weight matching" and info["validation"] == "val split"
    assert len(res.history) == 5  # the start, then every 10 steps
    assert info["best_val_midpoint_loss"] < res.history[0] - 1e-3, res.history
    assert info["train_loss"][-1][1] < info["train_loss"][0][1]
    assert info["check"]["passed"] and info["check"]["max_rel"] <= info["check"]["rtol"]
    # the elements are in the spec's groups, and aligned B computes B's function
    for s, e in res.elements.items():
        assert res.bound.problem.spaces[s].group.contains(e, atol=1e-6), s
    m = res.canonical_model
    x = torch.randint(0, 12, (2, 16))
    m.load_state_dict(res.aligned_b)
    with torch.no_grad():
        torch.testing.assert_close(m(x), b(x), rtol=1e-4, atol=1e-4)


def test_learned_matching_beats_its_start_on_the_midpoint(learned: Any) -> None:
    """The midpoint of the learned path against weight matching's, on held-out data."""
    a, b, res = learned
    wm = symspec.align(a, b, "nanogpt", method="weight")
    test = _data("test", 3, 7)
    m = res.canonical_model

    def mid(sd_b: Any, r: Any) -> float:
        m.load_state_dict(symspec.statedict.interpolate_state_dicts(r.canonical_a, sd_b, 0.5))
        with torch.no_grad():
            return sum(float(test.loss(m(*x), y)) for x, y in test.batches) / len(test.batches)

    assert mid(res.aligned_b, res) < mid(wm.aligned_b, wm)


def test_runs_are_deterministic_given_a_seed() -> None:
    a, b = _models()
    data = _data("train")

    def go(seed: int) -> Any:
        return symspec.align(a, b, "nanogpt", method="learned", data=data,
                             options=LearnedOptions(steps=6, lr=1e-2, eval_every=3, seed=seed)).elements["resid"]["matrix"]

    first, again, other = go(0), go(0), go(1)
    assert torch.equal(first, again)
    assert not torch.equal(first, other)


def test_a_wrong_element_is_refused_by_the_final_check(monkeypatch: pytest.MonkeyPatch) -> None:
    """If a parametrisation left its group, the function check must catch it."""
    from symspec.learned import parametrize as pm

    def off(self: Any) -> dict[str, torch.Tensor]:
        m = self.start["matrix"]
        return {"matrix": m + 0.05 * torch.ones_like(m)}  # not orthogonal

    monkeypatch.setattr(pm.CentredOrthogonalParam, "project", off)
    a, b = _models()
    with pytest.raises(SolverError, match="does not compute its model's function"):
        symspec.align(a, b, "nanogpt", method="learned", data=_data("train"),
                      options=LearnedOptions(steps=2, eval_every=1, lr=1e-2))


@pytest.mark.parametrize("perms", ["ste", "sinkhorn"])
def test_learned_permutations_end_in_permutations(perms: str) -> None:
    a, b = _models()
    res = symspec.align(a, b, "nanogpt", method="learned", data=_data("train"),
                        options=LearnedOptions(steps=8, lr=5e-2, eval_every=4, permutations=perms))
    assert res.info["check"]["passed"]
    assert "moved" in res.info["spaces"]["ff[0]"]
    for s, e in res.elements.items():
        assert res.bound.problem.spaces[s].group.contains(e, atol=1e-6), s


def test_a_state_dict_or_missing_data_is_refused() -> None:
    a, b = _models()
    with pytest.raises(SymspecInputError, match="needs data"):
        symspec.align(a, b, "nanogpt", method="learned")
    (x,), y = _data("train").batches[0]
    one = EvalData("x", "hook", "train", [((x[:1],), y[:1])], _data("train").loss, None)
    with pytest.raises(SymspecInputError, match="validation"):
        symspec.align(a, b, "nanogpt", method="learned", data=one, options=LearnedOptions(steps=1))
    # one batch of 8 sequences: the last one is held out for validation
    single = EvalData("x", "hook", "train", _data("train").batches[:1], _data("train").loss, None)
    res = symspec.align(a, b, "nanogpt", method="learned", data=single, options=LearnedOptions(steps=2, eval_every=1))
    assert res.info["validation"] == "the last 1 train examples, held out" and res.info["train_batches"] == 1


def _checkpoints(tmp_path: Path) -> tuple[Path, list[Any]]:
    """Two nanoGPT checkpoints of a model file and a word text: (the model file, the CLI
    arguments ``m0.pt m1.pt --model FILE --data text:WORDS``)."""
    f = gpt_checkpoints(tmp_path)
    return f["model"], [f["m0"], f["m1"], "--model", f["model"], "--data", f"text:{f['text']}"]


def test_cli_match_learned_writes_the_usual_outputs(tmp_path: Path) -> None:
    from symspec.loading import load_model

    mf, args = _checkpoints(tmp_path)
    code, _, err = run("match", *args, "--method", "learned", "--steps", 4, "--lr", 0.01, "--lambda", "fixed:0.5",
                       "--out", tmp_path / "m", "--json")
    assert code == 0, err
    report = json.loads((tmp_path / "m" / "match.json").read_text())
    assert report["method"] == "learned" and report["info"]["check"]["passed"]
    assert report["info"]["steps"] == 4 and report["info"]["lambda"] == "fixed:0.5"
    assert report["info"]["validation"] == "val split"
    # the canonical distance is the weights' (not the method's first objective value)
    code, out, err = run("match", tmp_path / "m0.pt", tmp_path / "m1.pt", "--model", mf, "--out", tmp_path / "wm", "--json")
    assert code == 0, err
    assert report["distance"]["canonical"] == pytest.approx(json.loads(out)["distance"]["canonical"], rel=1e-6)
    assert report["distance"]["canonical"] != pytest.approx(report["objective"][0])
    b = load_model(tmp_path / "m1.pt", factory=mf).model
    aligned = load_model(tmp_path / "m" / "model.pt", factory=mf).model
    x = torch.randint(0, 10, (2, 8))
    torch.testing.assert_close(aligned(x), b(x), rtol=1e-4, atol=1e-4)
    # learned-matching flags with another method, and bad values, are one line and exit 2
    code, _, err = run("match", *args, "--method", "weight+activation", "--steps", 3, "--out", tmp_path / "x")
    assert code == 2 and "--steps: for --method learned (or learned-perm)" in err and not (tmp_path / "x").exists()
    code, _, err = run("match", *args, "--method", "learned", "--lambda", "wide", "--out", tmp_path / "y")
    assert code == 2 and "--lambda wide" in err
    code, _, err = run("match", *args, "--method", "learned", "--steps", 3, "--epochs", 1, "--out", tmp_path / "e")
    assert code == 2 and "--steps and --epochs: give one of them" in err and not (tmp_path / "e").exists()
    code, _, err = run("merge", *args, "--no-align", "--lr", 0.1, "--out", tmp_path / "z")
    assert code == 2 and "--lr: for --method learned (or learned-perm)" in err


def test_learned_starts_from_the_method_init_names(monkeypatch: pytest.MonkeyPatch) -> None:
    import symspec.learned.loop as loop

    a, b = _models()
    started: list[str] = []
    real = loop.match_weights
    monkeypatch.setattr(loop, "match_weights", lambda *x, **k: started.append("weight") or real(*x, **k))
    res = symspec.align(a, b, "nanogpt", method="learned", data=_data("train"), validation=_data("val", 2, 1),
                        options=LearnedOptions(steps=2, eval_every=1, init="auto"))
    assert res.info["start_method"] == "auto"
    assert res.info["start_info"]["auto"]["winner"] in {"weight", "weight-tokens", "activation", "weight+activation"}
    assert res.info["check"]["passed"] and not started  # auto's own candidates ran, not the default start
    weight = symspec.align(a, b, "nanogpt", method="learned", data=_data("train"), options=LearnedOptions(steps=2, eval_every=1))
    assert weight.info["start"] == "weight matching" and started == ["weight"]
    for bad, message in (("learned", "starts from a closed-form alignment"), ("none", "closed-form"), ("wieght", "unknown alignment method")):
        with pytest.raises(SymspecInputError, match=message):
            LearnedOptions(init=bad)


def test_per_kind_learning_rates_scale_each_kind_of_latent() -> None:
    from symspec.learned.loop import _optimizer, latent_kinds
    from symspec.learned.parametrize import ParamSettings, parametrize

    a, b = _models()
    bound = symspec.binding.bind(symspec.load_spec("nanogpt"), a)
    problem = bound.problem
    start = {s: problem.spaces[s].group.identity() for s in problem.spaces}
    params = {1: {s: parametrize(problem.spaces[s].group, start[s], ParamSettings()) for s in problem.spaces}}
    kinds = {k for p in params[1].values() for k, _ in latent_kinds(p)}
    assert kinds == {"orthogonal", "linear"}  # the residual's rotation, the heads' GL maps (permutations frozen)
    opt = _optimizer(params, LearnedOptions(lr_scale=(("linear", 0.25),)))
    assert sorted(g["lr_factor"] for g in opt.param_groups) == [0.25, 1.0]
    # a tiny rate for the GL maps keeps them at the start; the default moves them (the negative)
    moved = {}
    for scale in ((), (("linear", 1e-9),)):
        res = symspec.align(a, b, "nanogpt", method="learned", data=_data("train"),
                            options=LearnedOptions(steps=4, eval_every=4, lr=5e-2, lr_scale=scale))
        start_res = symspec.align(a, b, "nanogpt", method="weight")
        moved[scale] = max(float((res.elements[s]["qk.matrix"] - start_res.elements[s]["qk.matrix"]).abs().max())
                           for s in res.elements if s.startswith("attn"))
    assert moved[()] > 1e-3 and moved[(("linear", 1e-9),)] < 1e-6
    for bad, message in ((("gl", 1.0),), "unknown kind"), ((("linear", 0.0),), "positive number"):
        with pytest.raises(SymspecInputError, match=message):
            LearnedOptions(lr_scale=bad)


def test_cli_learned_init_flag(tmp_path: Path) -> None:
    _, args = _checkpoints(tmp_path)
    code, out, err = run("match", *args, "--method", "learned", "--steps", 2, "--init", "weight-tokens",
                         "--out", tmp_path / "m", "--json")
    assert code == 0, err
    assert json.loads(out)["info"]["start_method"] == "weight-tokens"
    code, _, err = run("match", *args, "--method", "weight", "--init", "auto", "--out", tmp_path / "x")
    assert code == 2 and "--init: for --method learned" in err


def test_cli_learned_lr_scale_flag(tmp_path: Path) -> None:
    _, args = _checkpoints(tmp_path)
    code, out, err = run("match", *args, "--method", "learned", "--steps", 2, "--lr-scale", "orthogonal=3, linear=0.3",
                         "--out", tmp_path / "m", "--json")
    assert code == 0, err
    assert json.loads(out)["info"]["lr_scale"] == {"orthogonal": 3.0, "linear": 0.3}
    for bad, says in [("orthogonal", "is not KIND=FACTOR"), ("spin=2", "unknown kind 'spin'"),
                      ("linear=0", "must be a positive number"), ("linear=nan", "must be a positive number"),
                      ("linear=x", "must be a positive number"), ("linear=1,linear=2", "given twice")]:
        code, _, err = run("match", *args, "--method", "learned", "--lr-scale", bad, "--out", tmp_path / "x")
        assert code == 2 and "--lr-scale" in err and says in err, (bad, err)
    code, _, err = run("match", *args, "--method", "weight", "--lr-scale", "linear=2", "--out", tmp_path / "x")
    assert code == 2 and "--lr-scale: for --method learned" in err, err
    assert not (tmp_path / "x").exists()


def test_micro_batches_add_up_to_the_whole_batch_s_step() -> None:
    """A step's batch run in pieces (gradients accumulated) learns what the whole batch
    learns, to rounding; smaller batches without accumulation learn something else (the
    negative case: the pieces are really one step's)."""
    a, b = _models()
    data = _data("train")

    def go(**kw: Any) -> Any:
        return symspec.align(a, b, "nanogpt", method="learned", data=data,
                             options=LearnedOptions(steps=5, lr=2e-2, eval_every=5, **kw))

    whole, micro, small = go(), go(micro_batch=3), go(batch_size=3)
    assert micro.info["micro_batch"] == 3 and "micro_batch" not in whole.info
    for s, e in whole.elements.items():
        for k, v in e.items():
            if v.is_floating_point():
                torch.testing.assert_close(micro.elements[s][k], v, rtol=1e-5, atol=1e-6, msg=f"{s}.{k}")
    assert not torch.allclose(small.elements["resid"]["matrix"], whole.elements["resid"]["matrix"], atol=1e-5)
    assert micro.info["check"]["passed"]


def test_autocast_trains_in_low_precision_and_checks_in_float64() -> None:
    """The forward passes under bfloat16 autocast: another path than float32's (so it was
    applied), a finite loss, the elements in their groups,
    and the function check in float64 as always."""
    a, b = _models()
    data = _data("train")
    opts = dict(steps=10, lr=1e-2, eval_every=5)
    full = symspec.align(a, b, "nanogpt", method="learned", data=data, options=LearnedOptions(**opts))
    low = symspec.align(a, b, "nanogpt", method="learned", data=data,
                        options=LearnedOptions(**opts, autocast="bfloat16"))
    assert low.info["autocast"] == "bfloat16" and low.info["check"]["passed"]
    assert low.info["check"]["dtype"] == "float64"
    r_low, r_full = low.elements["resid"]["matrix"], full.elements["resid"]["matrix"]
    assert not torch.equal(r_low, r_full)
    assert all(math.isfinite(x) for _, x in low.info["train_loss"])
    for s, e in low.elements.items():
        assert low.bound.problem.spaces[s].group.contains(e, atol=1e-5), s
    for bad, says in (({"micro_batch": 0}, "micro-batch must be at least 1"), ({"autocast": "int8"}, "autocast")):
        with pytest.raises(SymspecInputError, match=says):
            LearnedOptions(**bad)


def test_cli_learned_micro_batch_and_autocast_flags(tmp_path: Path) -> None:
    _, args = _checkpoints(tmp_path)
    code, out, err = run("match", *args, "--method", "learned", "--steps", 2, "--micro-batch", 2,
                         "--autocast", "bfloat16", "--out", tmp_path / "m", "--json")
    assert code == 0, err
    info = json.loads(out)["info"]
    assert info["micro_batch"] == 2 and info["autocast"] == "bfloat16"
    for flag, value in (("--micro-batch", 0), ("--autocast", "int8")):
        code, _, err = run("match", *args, "--method", "learned", flag, value, "--out", tmp_path / "x")
        assert code == 2 and flag in err, err
    code, _, err = run("match", *args, "--method", "weight", "--micro-batch", 2, "--out", tmp_path / "x")
    assert code == 2 and "--micro-batch: for --method learned" in err, err
    assert not (tmp_path / "x").exists()


def test_an_average_of_the_latents_is_validated_beside_the_iterate() -> None:
    """--average: the training path is the iterate's, unchanged (the average is swapped in
    for its validation and out again), each validation also scores the average, and the
    result is the better of all candidates: never worse than without it. Bad decays are
    refused."""
    a, b = _models()
    data, val = _data("train"), _data("val", 2, 1)

    def go(**kw: Any) -> Any:
        return symspec.align(a, b, "nanogpt", method="learned", data=data, validation=val,
                             options=LearnedOptions(steps=12, lr=3e-2, eval_every=3, **kw))

    plain, avg = go(), go(average=0.5)
    curve, averaged = avg.info["val_midpoint_loss"], avg.info["val_midpoint_loss_average"]
    assert curve == plain.info["val_midpoint_loss"]  # the same iterates: the swap left them alone
    assert [s for s, _ in averaged] == [3, 6, 9, 12]
    assert averaged != curve[1:]  # the average is another model
    assert avg.info["best_from"] in ("start", "iterate", "average")
    assert avg.info["best_val_midpoint_loss"] <= plain.info["best_val_midpoint_loss"]
    best = min(v for _, v in curve + averaged)
    assert avg.info["best_val_midpoint_loss"] == best
    assert avg.info["check"]["passed"]
    for bad in (0.0, 1.0, -0.5):
        with pytest.raises(SymspecInputError, match="decay of the moving average"):
            LearnedOptions(average=bad)


def test_path_points_average_the_losses_of_several_lambdas() -> None:
    """--path-points N: a step's gradient is the mean of the gradients at its N lambdas
    (to rounding), not the first lambda's (the negative case)."""
    from symspec.alignment.mixture import Mixture
    from symspec.learned.loop import _optimizer, _train_step
    from symspec.learned.parametrize import ParamSettings, parametrize

    a, b = _models()
    res = symspec.align(a, b, "nanogpt", method="weight")
    problem = res.bound.problem
    mixture = Mixture(problem, res.canonical_model, [res.canonical_a, res.canonical_b], "cpu")
    data = _data("train")
    batch = data.batches[0]
    ws = [[0.7, 0.3], [0.4, 0.6]]

    def grads(weights: list[list[float]]) -> list[torch.Tensor]:
        settings = ParamSettings(device=mixture.device)
        params = {1: {s: parametrize(problem.spaces[s].group, res.elements[s], settings) for s in problem.spaces}}
        lat = [t for p in params[1].values() for t in p.latents()]
        with torch.no_grad():  # away from the start, where a gradient could vanish by symmetry
            for i, t in enumerate(lat):
                t.add_(0.01 * torch.randn(t.shape, generator=torch.Generator().manual_seed(i), dtype=t.dtype))
        opt = _optimizer(params, LearnedOptions(lr=1e-12))
        _train_step(mixture, params, data, opt, batch, weights, 0)
        return [t.grad.clone() for t in lat]

    both, first, second = grads(ws), grads(ws[:1]), grads(ws[1:])
    for g, g1, g2 in zip(both, first, second):
        torch.testing.assert_close(g, (g1 + g2) / 2, rtol=1e-5, atol=1e-8)
    assert any(not torch.allclose(g, g1, rtol=1e-3, atol=1e-6) for g, g1 in zip(both, first))
    with pytest.raises(SymspecInputError, match="at least 1 lambda per step"):
        LearnedOptions(path_points=0)


def test_cli_learned_average_and_path_points_flags(tmp_path: Path) -> None:
    _, args = _checkpoints(tmp_path)
    code, out, err = run("match", *args, "--method", "learned", "--steps", 2, "--average", 0.9, "--path-points", 2,
                         "--out", tmp_path / "m", "--json")
    assert code == 0, err
    info = json.loads(out)["info"]
    assert info["average"] == 0.9 and info["path_points"] == 2 and "val_midpoint_loss_average" in info
    for flag, value in (("--average", 1.5), ("--path-points", 0)):
        code, _, err = run("match", *args, "--method", "learned", flag, value, "--out", tmp_path / "x")
        assert code == 2 and (flag in err or "decay" in err), err
    code, _, err = run("match", *args, "--method", "weight", "--average", 0.9, "--out", tmp_path / "x")
    assert code == 2 and "--average: for --method learned" in err, err
    assert not (tmp_path / "x").exists()


# ----------------------------------------------------------------------------- universe refinement

def test_universe_learned_refinement_lowers_the_merged_loss_and_keeps_every_function() -> None:
    from symspec.universe import universe_match

    ng = import_file(ROOT / "examples" / "nanogpt.py")
    cfg = dict(vocab_size=12, block_size=16, n_layer=1, n_head=2, n_embd=16, n_ff=32)
    models = []
    for seed in range(3):
        torch.manual_seed(seed)
        models.append(ng.build(**cfg))
    opts = LearnedOptions(steps=30, lr=2e-2, eval_every=10)
    res = universe_match(models, "nanogpt", method="learned", rounds=3, data=_data("train"),
                         validation=_data("val", 2, 1), options=opts)
    ref = res.refinement
    assert res.method == "learned" and ref["alpha"] == 0.1 and ref["validation"] == "val split"
    assert ref["best_val_merged_loss"] < ref["history"][0] - 1e-3, ref["history"]
    assert set(ref["checks"]) == {"model1", "model2"} and all(c["passed"] for c in ref["checks"].values())
    x = torch.randint(0, 12, (2, 16))
    m = res.canonical_model
    mean = {k: sum(sd[k].double() for sd in res.aligned) / 3 for k in res.merged if res.merged[k].is_floating_point()}
    for i, own in enumerate(models):
        # the record (h_i g_i) takes the model's canonical form to its refined, aligned form
        canon = res.records[i].apply(res.bound, own.state_dict())
        for k, v in res.aligned[i].items():
            torch.testing.assert_close(canon[k].to(v.dtype), v, rtol=1e-5, atol=1e-5)
        m.load_state_dict(res.aligned[i])
        with torch.no_grad():
            torch.testing.assert_close(m(x), own(x), rtol=1e-4, atol=1e-4)
    for k, v in mean.items():
        torch.testing.assert_close(res.merged[k].double(), v, rtol=1e-6, atol=1e-6)
    # the reference model (index 0) is the gauge: its record stays weight matching's
    assert "refined" not in res.records[0].meta and res.records[1].meta["refined"] == "learned"


def test_cli_universe_learned(tmp_path: Path) -> None:
    _, args = _checkpoints(tmp_path)
    code, out, err = run("universe", *args, "--method", "learned", "--steps", 4, "--alpha", 0.5, "--rounds", 2,
                         "--out", tmp_path / "u", "--json")
    assert code == 0, err
    report = json.loads(out)
    refinement = report["refinement"]
    import jsonschema

    from symspec.analyzers.simplex import ANALYSIS_SCHEMA
    from symspec.universe import report_schema

    jsonschema.validate(report, report_schema(ANALYSIS_SCHEMA))
    assert refinement["steps"] == 4 and refinement["alpha"] == 0.5
    # evaluated on the val split: the refinement validated on part of train, not on val
    assert refinement["validation"].endswith("held out")
    code, _, err = run("universe", *args, "--steps", 3, "--out", tmp_path / "w")
    assert code == 2 and "--steps: for --method learned" in err
    code, out, err = run("universe", *args, "--method", "learned", "--steps", 2, "--rounds", 1, "--micro-batch", 2,
                         "--autocast", "bfloat16", "--out", tmp_path / "v", "--json")
    assert code == 0, err
    refinement = json.loads(out)["refinement"]
    assert refinement["micro_batch"] == 2 and refinement["autocast"] == "bfloat16"
    code, _, err = run("universe", *args, "--micro-batch", 2, "--out", tmp_path / "x")
    assert code == 2 and "--micro-batch: for --method learned" in err


# ----------------------------------------------------------------------------- every family

def _family_data(model: torch.nn.Module, x: Any, seed: int) -> EvalData:
    """The example inputs with random regression targets for the model's logits: a
    loss every family's output has (token logits, class logits, hidden states)."""
    from symspec.data import call_model, logits_of

    with torch.no_grad():
        out = logits_of(call_model(model, x))
    gen = torch.Generator().manual_seed(seed)
    targets = torch.randn(out.shape, generator=gen, dtype=out.dtype)

    def loss(output: Any, t: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.mse_loss(logits_of(output), t)

    return EvalData("family", "hook", "train", [(x, targets)] * 2, loss, None)


@pytest.mark.parametrize("name", sorted(ZOO))
def test_learned_matching_runs_on_every_family(name: str) -> None:
    """RoPE and partial rotary, GQA, tied and untied heads, post-norm BERT, ViTs: a few
    steps, then every element in its group and aligned B computing B's function."""
    from symspec.data import call_model, logits_of

    a, x = ZOO[name](seed=0)
    b, _ = ZOO[name](seed=1)
    data = _family_data(a, x, 0)
    res = symspec.align(a, b, name, method="learned", data=data, validation=_family_data(a, x, 1),
                        options=LearnedOptions(steps=3, eval_every=1, lr=1e-2, lam="uniform"))
    assert res.info["check"]["passed"], res.info["check"]
    assert res.info["latents"] > 0
    for s, e in res.elements.items():
        assert res.bound.problem.spaces[s].group.contains(e, atol=1e-5), (name, s)
    m = res.canonical_model
    m.load_state_dict(res.aligned_b, strict=False)
    with torch.no_grad():
        torch.testing.assert_close(logits_of(call_model(m, x)), logits_of(call_model(b, x)), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_cli_learned_on_hugging_face_llama_folders(tied: bool, tmp_path: Path) -> None:
    """What a user runs on Llama-family checkpoints (rotary buffers, GQA, tied or untied
    head): match, then barrier with --align learned, on tokenised text."""
    from tests.test_data_sources import PARAGRAPH, train_tokenizer

    transformers = pytest.importorskip("transformers")
    tok_dir = tmp_path / "tokenizer"
    tok_dir.mkdir()
    vocab = train_tokenizer(tok_dir / "tokenizer.json").get_vocab_size()
    text = tmp_path / "story.txt"
    text.write_text(PARAGRAPH * 30, encoding="utf-8")
    folders = []
    for seed in range(2):
        torch.manual_seed(seed)
        cfg = transformers.LlamaConfig(num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2, hidden_size=16,
                                       intermediate_size=12, vocab_size=vocab, max_position_embeddings=16,
                                       tie_word_embeddings=tied, bos_token_id=0, eos_token_id=0, pad_token_id=None)
        folders.append(tmp_path / f"m{seed}")
        transformers.LlamaForCausalLM(cfg).save_pretrained(folders[-1])
    data = f"text:{text},tokenizer={tok_dir}"
    code, _, err = run("match", *folders, "--data", data, "--method", "learned", "--steps", 3, "--out", tmp_path / "out")
    assert code == 0, err
    report = json.loads((tmp_path / "out" / "match.json").read_text())
    assert report["info"]["check"]["passed"] and report["method"] == "learned"
    b = transformers.LlamaForCausalLM.from_pretrained(folders[1]).eval()
    aligned = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "out").eval()
    x = torch.randint(0, vocab, (2, 8))
    with torch.no_grad():
        torch.testing.assert_close(aligned(x).logits, b(x).logits, rtol=1e-4, atol=1e-4)
    code, out, err = run("barrier", *folders, "--data", data, "--split", "test", "--points", 3, "--align", "weight",
                         "--align", "learned", "--json")
    assert code == 0, err
    assert [m["method"] for m in json.loads(out)["methods"]] == ["weight", "learned"]


def _whole_float64_difference(module: torch.nn.Module, before: Any, after: Any, inputs: Any, outputs: Any) -> tuple[float, float]:
    """The reference: the whole model copied in float64, run on both states."""
    import copy

    from symspec.checker import compare, flatten_outputs, select_outputs
    from symspec.data import call_model
    from symspec.data.base import move
    from symspec.precision import KeepFloat64

    m64 = copy.deepcopy(module).to(torch.float64)
    x = move(inputs, "cpu", torch.float64)

    def forward(sd: Any) -> Any:
        w = {k: v.to(torch.float64) if v.is_floating_point() else v for k, v in sd.items()}
        with torch.no_grad(), KeepFloat64():
            return flatten_outputs(select_outputs(call_model(lambda *a, **k: torch.func.functional_call(m64, w, a, k), x), outputs))
    return compare(forward(before), forward(after))


@pytest.mark.parametrize("name", sorted(ZOO))
def test_the_block_by_block_float64_check_agrees_with_the_whole_model(name: str) -> None:
    """Learned matching's function check runs one block at a time in float64 (no float64
    copy of the model): on every family it passes a group element as the whole-model
    float64 check does, and a matrix off the group (the negative case) fails it with
    the same deviation."""
    from symspec.alignment.mixture import Mixture
    from symspec.learned.loop import check_function
    from symspec.transforms import apply_elements, sample_elements

    a, x = ZOO[name](seed=0)
    b, _ = ZOO[name](seed=1)
    res = symspec.align(a, b, name, method="weight")
    problem = res.bound.problem
    mixture = Mixture(problem, res.canonical_model, [res.canonical_a, res.canonical_b], "cpu")
    good = sample_elements(problem)
    # off the group: the first space's orthogonal map with one entry moved, or its
    # permutation sending two indices to one
    bad = {s: {k: v.clone() for k, v in e.items()} for s, e in good.items()}
    for s, e in bad.items():
        if "matrix" in e and e["matrix"].ndim == 2 and problem.spaces[s].group.is_orthogonal():
            e["matrix"][0, 0] += 0.5
            break
        if "perm" in e and e["perm"].ndim == 1 and len(e["perm"]) > 1:
            e["perm"][0] = e["perm"][1]
            break
    else:
        raise AssertionError(f"{name}: no space to move off its group")
    b_state = mixture.states[1]
    for elements, passes in ((good, True), (bad, False)):
        got = check_function(mixture, b_state, elements, (x, None), 2, cond=10.0)
        e64 = {s: {k: v.double() if v.is_floating_point() else v for k, v in e.items()} for s, e in elements.items()}
        b64 = {k: v.double() for k, v in b_state.items()}
        ref_abs, ref_rel = _whole_float64_difference(mixture.module, b64, apply_elements(problem, e64, b64),
                                                     _first(x, 2), problem.outputs)
        assert got["passed"] is passes and (ref_rel <= got["rtol"]) is passes, (name, got, ref_rel)
        if not passes:
            assert got["max_rel"] == pytest.approx(ref_rel, rel=1e-6) and got["max_abs"] == pytest.approx(ref_abs, rel=1e-6)


def _first(x: Any, n: int) -> Any:
    from symspec.learned.loop import _rows
    return _rows(x, 0, n)
