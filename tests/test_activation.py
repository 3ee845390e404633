"""Activation sites, their recorder, and activation matching.

Sites are checked against the group action itself: for a random element g, the
features of g·B at every site must be rho(g) applied to B's features, as the site's
binding says (keys through the dual, fused QKV segments, head-major layouts, GQA). A
site bound the wrong way round is caught. Activation matching then recovers a planted
element (B = g·A gives back A) on every family, from streaming statistics."""

from __future__ import annotations

import json
import math
import subprocess
import sys
import warnings
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import attrs
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import symspec
from symspec.binding import bind
from symspec.graph import SiteRecorder
from symspec.problem import Factor, Site
from symspec.solvers.engine.activation_statistics import (
    ActivationMoments,
    SiteMoments,
    activation_terms,
)
from symspec.transforms import apply_elements, canonicalize_model, sample_elements, transform_tensor
from tests.cli_files import gpt_checkpoints, run
from tests.zoo import ZOO

#: families whose norms compute in float32 whatever the model's dtype (RMSNorm upcasts)
FLOAT32_NORMS = {"llama", "qwen2", "gemma", "llama_tied"}


def _double(x: Any) -> Any:
    if isinstance(x, torch.Tensor):
        return x.double() if x.is_floating_point() else x
    if isinstance(x, dict):
        return {k: _double(v) for k, v in x.items()}
    if isinstance(x, (tuple, list)):
        return type(x)(_double(v) for v in x)
    return x


def _fresh(x: Any, seed: int) -> Any:
    """Inputs shaped like ``x`` with new values (token ids below the largest seen)."""
    torch.manual_seed(seed)
    if isinstance(x, torch.Tensor):
        if x.is_floating_point():
            return torch.randn_like(x)
        if x.dtype == torch.long and int(x.max()) > 1:
            return torch.randint(0, int(x.max()) + 1, x.shape)
        return x
    if isinstance(x, dict):
        return {k: _fresh(v, seed) for k, v in x.items()}
    if isinstance(x, (tuple, list)):
        return type(x)(_fresh(v, seed) for v in x)
    return x


def _family(name: str) -> tuple[torch.nn.Module, Any, Any]:
    model, inputs = ZOO[name]()
    model = model.double().eval()
    bound = bind(symspec.load_spec(name), model)
    return canonicalize_model(bound, model).eval(), _double(inputs), bound


def _moved(site: Site, bound: Any, x: torch.Tensor, g: Any) -> torch.Tensor:
    return transform_tensor(bound.problem, site.binding(x.shape[0]), x.T, g).T


@pytest.mark.parametrize("name", ["nanogpt", "gpt2", "llama", "gpt_neox", "bert", "timm_vit", "opt"])
def test_site_features_move_as_their_binding_says(name: str) -> None:
    canon, inputs, bound = _family(name)
    sd = canon.state_dict()
    g = sample_elements(bound.problem, seed=1, cond=3.0)
    sd_g = apply_elements(bound.problem, g, sd)
    rec = SiteRecorder(canon, bound.problem)
    xb, xg = rec.record(inputs, sd), rec.record(inputs, sd_g)
    assert rec.sites and {s for site in rec.sites for s in site.spaces()} == set(bound.problem.spaces)
    tol = 1e-5 if name in FLOAT32_NORMS else 1e-9
    for site in rec.sites:
        err = (_moved(site, bound, xb[site.name], g) - xg[site.name]).abs().max() / xg[site.name].abs().max()
        assert err < tol, (site.name, float(err))
    # negative case: keys read as queries (the QK maps are not orthogonal: the dual
    # differs) do not predict g·B
    dual = next(s for s in rec.sites if any(f.variance == "contra" for seg in s.axis.segments for f in seg.factors))
    flip = {"co": "contra", "contra": "co"}
    wrong_axis = attrs.evolve(dual.axis, segments=tuple(
        attrs.evolve(seg, factors=tuple(Factor(f.space, f.path, flip[f.variance]) for f in seg.factors))
        for seg in dual.axis.segments))
    wrong = attrs.evolve(dual, axis=wrong_axis)
    err = (_moved(wrong, bound, xb[dual.name], g) - xg[dual.name]).abs().max() / xg[dual.name].abs().max()
    assert err > 1e-3, dual.name


def test_sites_are_recorded_on_the_problem_when_bound_with_a_trace() -> None:
    model, inputs = ZOO["llama"]()
    bound = bind(symspec.load_spec("llama"), model, example_inputs=inputs, trace=True)
    names = {s.name for s in bound.problem.sites}
    # per-head sites: queries (qk), keys (the kv view of qk, dual), values, head outputs
    assert {"out:model.layers.0.self_attn.q_proj.weight", "out:model.layers.0.self_attn.k_proj.weight",
            "out:model.layers.0.self_attn.v_proj.weight", "in:model.layers.0.self_attn.o_proj.weight"} <= names
    keys = next(s for s in bound.problem.sites if s.name == "out:model.layers.0.self_attn.k_proj.weight")
    (f,) = keys.axis.segments[0].factors
    assert (f.space, f.path, f.variance) == ("attn[0]", ("qk", "kv"), "contra")
    assert bound.problem.sites_of("mlp[0]") and bound.problem.sites_of("resid")


def test_the_graph_is_the_fx_graph_without_networkx() -> None:
    code = "import symspec.graph, symspec.binding, sys; print('networkx' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"


def test_streaming_moments_equal_the_direct_ones_and_stay_the_same_size() -> None:
    torch.manual_seed(0)
    xa, xb = torch.randn(50, 3, dtype=torch.float64), torch.randn(50, 3, dtype=torch.float64)
    m = SiteMoments.zeros(3)
    size = m.bytes
    for i in range(0, 50, 7):
        m.update(xa[i : i + 7], xb[i : i + 7])
    torch.testing.assert_close(m.cross[0], xa.T @ xb)
    torch.testing.assert_close(m.gram[0], xb.T @ xb)
    torch.testing.assert_close(m.sq_a, xa.square().sum(0))
    torch.testing.assert_close(m.sq_b, xb.square().sum(0))
    assert m.count == 50 and m.bytes == size
    with pytest.raises(ValueError, match="expected"):
        m.update(torch.zeros(2, 4), torch.zeros(2, 4))


def test_site_roots_reproduce_the_cross_moments() -> None:
    """Per block of a site (a segment: what the solvers read), ``L_A L_B^T = C``; ``L_B L_B^T
    = G`` where the block has a Gram (GL heads), its diagonal where it has none
    (permutations, the orthogonal residual); the objective is the real one once the
    offset is taken off."""
    canon, inputs, bound = _family("nanogpt")
    rec = SiteRecorder(canon, bound.problem)
    other = {k: v + 0.1 * torch.randn_like(v) for k, v in canon.state_dict().items()}
    fa, fb = rec.record(inputs, canon.state_dict()), rec.record(inputs, other)
    moments = ActivationMoments.empty(rec.sites, problem=bound.problem)
    moments.update(fa, fb)
    terms = activation_terms(bound.problem, moments, normalize="none", dtype=torch.float64)
    la, lb = terms.sd_a, terms.sd_b
    real = 0.0
    for site in rec.sites:
        key = f"site:{site.name}"
        xa, xb = fa[site.name], fb[site.name]
        n = xa.shape[0]
        for idx, gram in zip(moments.moments[site.name].index, moments.moments[site.name].gram):
            torch.testing.assert_close(la[key][idx] @ lb[key][idx].T, xa[:, idx].T @ xb[:, idx] / n)
            want = xb[:, idx].T @ xb[:, idx] / n
            got = lb[key][idx] @ lb[key][idx].T
            torch.testing.assert_close(got if gram is not None else got.diagonal(), want if gram is not None else want.diagonal())
        real += float((xa - xb).square().sum()) / n
    # the objective is the real one: sum ||L_A - L_B||^2 - offset = sum mean ||x^A - x^B||^2
    seen = sum(float((la[k] - lb[k]).square().sum()) for k in terms.problem.params)
    assert seen - terms.offset == pytest.approx(real, rel=1e-9)
    assert set(terms.problem.params) == {f"site:{s.name}" for s in rec.sites}
    assert terms.problem.spaces == bound.problem.spaces


def _planted_data(name: str, batches: int = 4, seed: int = 3) -> tuple[Any, Any]:
    model, inputs = ZOO[name]()
    model = model.double().eval()
    p = symspec.plant(model, name, seed=seed, cond=3.0)
    data = SimpleNamespace(batches=[(_fresh(_double(inputs), 100 + i), None) for i in range(batches)])
    return p, data


def _relative_distance(res: Any, a: torch.nn.Module) -> float:
    sd = a.state_dict()
    params = res.bound.problem.params
    return sum(float((res.aligned_b[k] - sd[k]).pow(2).sum()) for k in params) / sum(float(sd[k].pow(2).sum()) for k in params)


#: every built-in spec but mixtral: nothing in its graph shows an expert's hidden units as
#: features of one expert (the experts run on gathered rows), see the mixture-of-experts test
SPECS = sorted(p.stem for p in (Path(__file__).resolve().parent.parent / "specs").glob("*.yaml") if p.stem != "mixtral")


@pytest.mark.parametrize("name", SPECS)
@settings(max_examples=2, deadline=None)
@given(seed=st.integers(0, 2**16))
def test_activation_matching_recovers_a_planted_element_for_every_spec(name: str, seed: int) -> None:
    """Exact recovery is a property of the unregularised objective: ridge=0 here (the
    default ridge pulls per-head maps toward the identity; tested below)."""
    from symspec.alignment import ActivationOptions

    p, data = _planted_data(name, seed=seed)
    res = symspec.align(p.canonical, p.model, name, method="activation", data=data, rounds=5,
                        options=ActivationOptions(ridge=0.0))
    assert _relative_distance(res, p.canonical) < 1e-9
    stats = res.info["statistics"]
    assert stats["batches"] == 4 and stats["bytes"] > 0 and not res.info["spaces_without_sites"]
    assert {"statistics", "factor"} <= set(res.timings)


@pytest.mark.parametrize("name", ["nanogpt", "llama", "timm_vit"])
def test_weight_plus_activation_matching_recovers_a_planted_element(name: str) -> None:
    p, data = _planted_data(name)
    res = symspec.align(p.canonical, p.model, name, method="weight+activation", data=data, rounds=5)
    assert _relative_distance(res, p.canonical) < 1e-9 and res.info["mix"] == 1.0


def test_the_head_ridge_is_neutral_to_head_permutations() -> None:
    """With the default ridge, a planted head permutation (identity within heads) is still
    recovered exactly; a planted general element is not (the ridge pulls toward the
    identity: its negative case) while ridge=0 recovers it. (What the ridge does to the
    conditioning of real pairs: docs/activation.md, bench/results/activation_attention.json.)"""
    import copy

    from symspec.alignment import ActivationOptions
    from symspec.groups import Heads
    from symspec.transforms import apply_elements

    base, data = _planted_data("nanogpt")
    a = base.canonical
    problem = symspec.bind(symspec.load_spec("nanogpt"), a).problem
    elements = {}
    gen = torch.Generator().manual_seed(0)
    for s, si in problem.spaces.items():
        g = si.group
        e = g.identity()
        if isinstance(g, Heads):  # a head permutation only
            e["perm"] = torch.arange(g.kv).flip(0)  # every head moves
        elif s.startswith("ff"):
            e = g.sample(gen)
        elements[s] = e
    b = copy.deepcopy(a)
    b.load_state_dict(apply_elements(problem, elements, a.state_dict()))
    res = symspec.align(a, b, "nanogpt", method="activation", data=data, rounds=5)
    assert _relative_distance(res, a) < 1e-9
    general, data = _planted_data("nanogpt", seed=5)
    ridged = symspec.align(general.canonical, general.model, "nanogpt", method="activation", data=data, rounds=5)
    free = symspec.align(general.canonical, general.model, "nanogpt", method="activation", data=data, rounds=5,
                         options=ActivationOptions(ridge=0.0))
    assert _relative_distance(free, general.canonical) < 1e-9 < _relative_distance(ridged, general.canonical)


def test_activation_matching_in_a_subgroup_cannot_recover_a_general_element() -> None:
    p, data = _planted_data("nanogpt")
    res = symspec.align(p.canonical, p.model, "nanogpt", method="activation", data=data, groups="perm", rounds=5)
    assert _relative_distance(res, p.canonical) > 1e-2


def test_statistics_memory_does_not_grow_with_the_batches() -> None:
    p, few = _planted_data("nanogpt", batches=2)
    _, many = _planted_data("nanogpt", batches=8)
    a = symspec.align(p.canonical, p.model, "nanogpt", method="activation", data=few, rounds=1)
    b = symspec.align(p.canonical, p.model, "nanogpt", method="activation", data=many, rounds=1)
    assert a.info["statistics"]["bytes"] == b.info["statistics"]["bytes"]
    assert b.info["statistics"]["tokens"] == 4 * a.info["statistics"]["tokens"]


def test_token_weights_count_the_data_and_fall_back_without_an_embedding() -> None:
    from symspec.alignment.moments import token_counts

    ids = torch.tensor([[1, 1, 2], [0, 1, 5]])
    data = SimpleNamespace(batches=[({"input_ids": ids, "attention_mask": torch.ones_like(ids)}, None), (ids, None)])
    assert token_counts(data, 6).tolist() == [2, 6, 2, 0, 0, 2]
    a, _ = ZOO["nanogpt"](seed=0)
    b, _ = ZOO["nanogpt"](seed=1)
    tokens = SimpleNamespace(batches=[(torch.randint(0, 5, (2, 8)), None)])
    res = symspec.align(a, b, "nanogpt", method="weight-tokens", data=tokens, rounds=2)
    info = res.info["token_weights"]
    assert info["distinct"] <= 5 and info["min_weight"] < 1 < info["max_weight"]
    plain = symspec.align(a, b, "nanogpt", method="weight", rounds=2)
    assert res.history[0] != pytest.approx(plain.history[0])  # the objective is reweighted
    vit, x = ZOO["vit"]()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = symspec.align(vit, ZOO["vit"](seed=1)[0], "vit", method="weight-tokens",
                            data=SimpleNamespace(batches=[(x, None)]), rounds=1)
    assert out.info["token_weights"] is None and any("no token embedding" in str(w.message) for w in caught)


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return gpt_checkpoints(tmp_path_factory.mktemp("activation"))


def test_cli_match_with_activation_matching_writes_the_usual_outputs(files: dict[str, Path], tmp_path: Path) -> None:
    from symspec.loading import load_model

    args = [files["m0"], files["m1"], "--model", files["model"], "--data", f"text:{files['text']}"]
    code, _, err = run("match", *args, "--method", "activation", "--out", tmp_path / "m", "--json")
    assert code == 0, err
    report = json.loads((tmp_path / "m" / "match.json").read_text())
    assert report["method"] == "activation" and report["info"]["statistics"]["tokens"] > 0
    assert "statistics" in report["timings"]
    # aligned B computes B's function
    b = load_model(files["m1"], factory=files["model"]).model
    aligned = load_model(tmp_path / "m" / "model.pt", factory=files["model"]).model
    x = torch.randint(0, 10, (2, 8))
    torch.testing.assert_close(aligned(x), b(x), rtol=1e-4, atol=1e-4)
    code, _, err = run("match", files["m0"], files["m1"], "--model", files["model"], "--method", "activation",
                       "--out", tmp_path / "n")
    assert code == 2 and "no data: pass --data" in err and not (tmp_path / "n").exists()


def test_universe_matching_aligns_with_a_data_driven_method(files: dict[str, Path]) -> None:
    from symspec.data import load_data
    from symspec.loading import load_model
    from symspec.universe import UniverseError, universe_match

    paths = [files["m0"], files["m1"]]
    data = load_data(f"text:{files['text']}", model=load_model(files["m0"], factory=files["model"]).model, split="train")
    res = universe_match(paths, "nanogpt", factory=files["model"], method="activation", rounds=2, jobs=1, data=data)
    assert res.method == "activation" and len(res.history) >= 2
    # every model aligned into the universe still computes its own function
    x = torch.randint(0, 10, (2, 8))
    for path, aligned in zip(paths, res.aligned):
        own = load_model(path, factory=files["model"]).model
        model = res.canonical_model
        model.load_state_dict(aligned)
        torch.testing.assert_close(model(x), own(x), rtol=1e-4, atol=1e-4)
    with pytest.raises(UniverseError, match="needs data"):
        universe_match(paths, "nanogpt", factory=files["model"], method="activation", rounds=1, jobs=1)
    # the rounds are measured, and stop, on activation matching's own objective: the sum of
    # what each model's alignment left of it, per round
    summary = res.summary()
    assert res.converged_on == "method" and summary["converged_on"] == "method"
    own = summary["method_objective"]
    assert len(own) == len(res.history) and all(x >= 0 for x in own)
    assert own[-1] < own[0] and own != pytest.approx(res.history, rel=0.5)  # another objective than F
    weight = universe_match(paths, "nanogpt", factory=files["model"], method="weight", rounds=2, jobs=1)
    assert weight.converged_on == "weights"
    for r in weight.rounds:  # weight matching's own objective is the distance each alignment left
        assert r["method_objective"] == pytest.approx(r["target_objective"], rel=1e-6)


def test_universe_rounds_stop_on_the_objective_they_are_told_to() -> None:
    """F still improving, the method's own objective not (or the other way round): the
    rounds stop on the one they watch, and only on it (each is the other's negative case)."""
    from symspec.universe.algorithm import RoundLog

    def log(own: bool, f: list[float], m: list[float]) -> RoundLog:
        rounds = [{"round": i + 1, "objective": f[i + 1], "target_objective": f[i + 1], "floor": 0.0,
                   "method_objective_start": m[0], "method_objective": m[i + 1]} for i in range(len(f) - 1)]
        return RoundLog(rounds, f, own=own)

    f_improves, m_stalls = [10.0, 8.0, 5.0], [3.0, 2.0, 2.0]
    assert log(True, f_improves, m_stalls).converged(1e-3, 1e-16)
    assert not log(False, f_improves, m_stalls).converged(1e-3, 1e-16)
    f_stalls, m_improves = [10.0, 8.0, 8.0], [3.0, 2.0, 1.0]
    assert not log(True, f_stalls, m_improves).converged(1e-3, 1e-16)
    assert log(False, f_stalls, m_improves).converged(1e-3, 1e-16)


def test_read_sites_keep_one_site_per_chain_of_elementwise_functions() -> None:
    from symspec.graph import read_sites

    canon, inputs, bound = _family("nanogpt")
    everything = SiteRecorder(canon, bound.problem)
    everything.record(inputs)
    read = SiteRecorder(canon, bound.problem, select=read_sites)
    read.record(inputs)
    all_names, read_names = {s.name for s in everything.sites}, {s.name for s in read.sites}
    fc = next(s.param for s in everything.sites if s.name.startswith("post:"))
    assert f"out:{fc}" in all_names and f"out:{fc}" not in read_names and f"post:{fc}:1" in read_names
    # every space keeps a site
    assert {x for s in read.sites for x in s.spaces()} == set(bound.problem.spaces)


def _train_gpt2_folder(folder: Path, tokens: torch.Tensor, vocab: int, seed: int) -> Path:
    """A tiny GPT-2 of the tokenizer's vocabulary, trained a few steps on ``tokens``."""
    from tests.test_data_sources import CONTEXT, save_gpt2

    save_gpt2(folder, vocab, seed=seed)
    transformers = pytest.importorskip("transformers")
    model = transformers.GPT2LMHeadModel.from_pretrained(folder)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    gen = torch.Generator().manual_seed(seed)
    for _ in range(40):
        starts = torch.randint(0, len(tokens) - CONTEXT - 1, (8,), generator=gen)
        x = torch.stack([tokens[s : s + CONTEXT] for s in starts])
        loss = model(input_ids=x, labels=x).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.save_pretrained(folder)
    return folder


def test_cli_barrier_on_trained_hf_gpt2_folders_with_a_word_level_tokenizer(tmp_path: Path) -> None:
    from tests.test_data_sources import PARAGRAPH, train_tokenizer

    pytest.importorskip("tokenizers")
    tok_dir = tmp_path / "tokenizer"
    tok_dir.mkdir()
    tok = train_tokenizer(tok_dir / "tokenizer.json")
    text = tmp_path / "story.txt"
    text.write_text(PARAGRAPH * 30, encoding="utf-8")
    tokens = torch.tensor(tok.encode(PARAGRAPH * 30).ids)
    a = _train_gpt2_folder(tmp_path / "a", tokens, tok.get_vocab_size(), seed=0)
    b = _train_gpt2_folder(tmp_path / "b", tokens, tok.get_vocab_size(), seed=1)
    methods = ["none", "weight", "activation", "weight+activation", "weight-tokens"]
    code, out, err = run("barrier", a, b, "--data", f"text:{text},tokenizer={tok_dir}", "--points", 3,
                         *[x for m in methods for x in ("--align", m)], "--json")
    assert code == 0, err
    doc = json.loads(out)
    assert [m["method"] for m in doc["methods"]] == methods
    for m in doc["methods"]:
        assert math.isfinite(m["summary"]["barrier_mean"]), m
    # a tokenizer whose ids do not fit the models is one located line, exit 2
    big = tmp_path / "big"
    big.mkdir()
    tokenizers = pytest.importorskip("tokenizers")
    wide = tokenizers.Tokenizer(tokenizers.models.WordLevel(unk_token="[UNK]"))
    wide.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    words = " ".join(f"w{i}" for i in range(200)) + " " + PARAGRAPH
    wide.train_from_iterator([words], tokenizers.trainers.WordLevelTrainer(special_tokens=["[UNK]"]))
    wide.save(str(big / "tokenizer.json"))
    text2 = tmp_path / "wide.txt"
    text2.write_text(words * 5, encoding="utf-8")
    code, _, err = run("barrier", a, b, "--data", f"text:{text2},tokenizer={big}", "--points", 3, "--align", "weight")
    assert code == 2 and "vocab" in err.lower()


def test_cli_match_defaults_to_the_best_data_method_when_given_data(files: dict[str, Path], tmp_path: Path) -> None:
    from symspec.alignment import DATA_DEFAULT, get_method

    assert get_method(DATA_DEFAULT).needs_data
    args = [files["m0"], files["m1"], "--model", files["model"]]
    code, out, err = run("match", *args, "--data", f"text:{files['text']}", "--out", tmp_path / "d", "--json")
    assert code == 0 and json.loads(out)["method"] == DATA_DEFAULT, err
    code, out, err = run("match", *args, "--out", tmp_path / "w", "--json")
    assert code == 0 and json.loads(out)["method"] == "weight", err
    # an explicit data-free method with --data is refused, not silently changed
    code, _, err = run("match", *args, "--method", "weight", "--data", f"text:{files['text']}", "--out", tmp_path / "x")
    assert code == 2 and "--data is for data-driven methods" in err


def test_activation_matching_on_a_mixture_of_experts_says_what_no_site_shows() -> None:
    """Mixtral: the router's logits show the expert permutation and the residual and
    attention sites show theirs, recovered exactly; nothing shows an expert's own hidden
    units (the experts run on gathered rows), so activation matching leaves them where they
    started and says so; weight + activation matching recovers the whole element."""
    from symspec.alignment import ActivationOptions

    p, data = _planted_data("mixtral", seed=5)
    res = symspec.align(p.canonical, p.model, "mixtral", method="activation", data=data, rounds=5,
                        options=ActivationOptions(ridge=0.0))
    spaces = res.bound.problem.spaces
    for name, group in ((s, si.group) for s, si in spaces.items()):
        want = group.inverse(group.to(p.elements[name], dtype=torch.float64))
        got = group.to(res.elements[name], dtype=torch.float64)
        if name.startswith(("resid", "attn")):
            assert group.equal(want, got, atol=1e-6), name
        elif name.startswith("moe"):
            assert torch.equal(want["perm"], got["perm"]), name  # the experts, from the router
            assert not group.equal(want, got, atol=1e-6), name  # each expert's units: not shown
    assert res.info["spaces_without_sites"] == ["up[0]", "up[1]"]
    assert res.info["parts_without_sites"] == ["moe[0]: each expert's units", "moe[1]: each expert's units"]
    assert _relative_distance(res, p.canonical) > 1e-3
    both = symspec.align(p.canonical, p.model, "mixtral", method="weight+activation", data=data, rounds=10,
                         options=ActivationOptions(ridge=0.0))
    assert _relative_distance(both, p.canonical) < 1e-9
