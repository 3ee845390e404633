"""``auto``: the candidate methods run, each scored by the loss of the interpolation
midpoint on held-out data, the lowest kept; every candidate's score and time reported.

The pair: a small GPT trained on a counting task over its first 6 tokens (of 48), B a
planted copy of it (``symspec.plant``: the same function, other weights) whose 42 rare
tokens' embedding rows, never seen in the data, are replaced by large noise. Plain
weight matching is pulled off by those rows; token-weighted weight matching (rare rows
count for little) and the activation terms (the data never reads those rows) are not.
"""

from __future__ import annotations

import json
from typing import Any

import attrs
import pytest
import torch

import symspec
from symspec.alignment import Alignment, AutoOptions, registered
from symspec.data.base import EvalData
from symspec.data.losses import cross_entropy
from symspec.errors import SymspecInputError
from tests.zoo import example, randomize_

SEEN, VOCAB = 6, 48


def _counting(gen: torch.Generator, n: int) -> torch.Tensor:
    """Sequences x, x + s, x + 2s, ... mod SEEN (s = 1 or 2 by x's parity): 17 tokens each."""
    x = torch.randint(SEEN, (n, 1), generator=gen)
    return (x + torch.arange(17) * (1 + x % 2)) % SEEN


def _split(seed: int, batches: int, split: str) -> EvalData:
    gen = torch.Generator().manual_seed(seed)
    data = [((seq[:, :-1],), seq[:, 1:]) for seq in (_counting(gen, 4) for _ in range(batches))]
    return EvalData("counting", "hook", split, data, cross_entropy, None)


@pytest.fixture(scope="module")
def pair() -> dict[str, Any]:
    torch.manual_seed(0)
    a = example("nanogpt").build(n_layer=2, n_head=2, n_embd=16, n_ff=32, vocab_size=VOCAB, block_size=16).double()
    randomize_(a, 0)
    opt = torch.optim.Adam(a.parameters(), lr=1e-2)
    gen = torch.Generator().manual_seed(0)
    for _ in range(150):
        seq = _counting(gen, 8)
        loss = cross_entropy(a(seq[:, :-1]), seq[:, 1:])
        opt.zero_grad()
        loss.backward()
        opt.step()
    a.eval()
    planted = symspec.plant(a, "nanogpt", seed=1, cond=3.0)
    b = planted.model
    with torch.no_grad():
        w = b.transformer.wte.weight
        w[SEEN:] = 30 * w[:SEEN].std() * torch.randn(w[SEEN:].shape, generator=torch.Generator().manual_seed(5), dtype=w.dtype)
    return {"a": planted.canonical, "b": b, "train": _split(100, 8, "train"), "val": _split(200, 4, "val"),
            # what brings B back to A: g's inverse
            "element": {s: planted.bound.problem.spaces[s].group.inverse(e) for s, e in planted.elements.items()}}


def _auto(pair: dict[str, Any], **kw: Any) -> Any:
    return symspec.align(pair["a"], pair["b"], "nanogpt", method="auto", data=pair["train"], validation=pair["val"],
                         rounds=5, options=AutoOptions(**kw))


def _scores(res: Any) -> dict[str, float]:
    return {c["method"]: c["midpoint_loss"] for c in res.info["auto"]["candidates"] if "midpoint_loss" in c}


def test_auto_runs_every_candidate_and_keeps_the_lowest_midpoint_loss(pair: dict[str, Any]) -> None:
    res = _auto(pair)
    auto = res.info["auto"]
    scores = _scores(res)
    assert list(scores) == ["weight", "weight-tokens", "activation", "weight+activation"]
    assert auto["winner"] == min(scores, key=scores.__getitem__) and auto["scored_on"] == "validation"
    assert all(c["seconds"] > 0 for c in auto["candidates"])
    # the pair discriminates: plain weight matching is pulled off by the rare tokens' rows
    assert auto["winner"] != "weight" and scores["weight"] > 1.3 * scores[auto["winner"]]
    # the result is the winner's: the same elements as that method alone
    alone = symspec.align(pair["a"], pair["b"], "nanogpt", method=auto["winner"], data=pair["train"], rounds=5)
    assert all(torch.equal(res.aligned_b[k], alone.aligned_b[k]) for k in res.aligned_b)
    assert {"auto: weight", "auto: scoring"} <= set(res.timings)


def test_weight_tokens_wins_where_rare_tokens_differ(pair: dict[str, Any]) -> None:
    res = _auto(pair, candidates=("weight", "weight-tokens"))
    scores = _scores(res)
    assert res.info["auto"]["winner"] == "weight-tokens" and scores["weight-tokens"] < scores["weight"]
    assert res.info["token_weights"]["distinct"] == SEEN  # the winner's own report comes along


def test_weight_plus_activation_wins_over_the_weights_alone_where_the_data_tells(pair: dict[str, Any]) -> None:
    res = _auto(pair, candidates=("weight+activation", "weight"))  # run cheapest first, whatever the order given
    assert [c["method"] for c in res.info["auto"]["candidates"]] == ["weight", "weight+activation"]
    assert res.info["auto"]["winner"] == "weight+activation"


def test_the_activation_candidates_share_one_pass_of_statistics(pair: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    import symspec.alignment.moments as moments

    calls: list[int] = []
    real = moments.collect_site_stats
    monkeypatch.setattr(moments, "collect_site_stats", lambda *a, **k: calls.append(1) or real(*a, **k))
    res = _auto(pair, candidates=("activation", "weight+activation"))
    assert len(calls) == 1 and len(_scores(res)) == 2
    calls.clear()  # the negative: each alone collects its own
    symspec.align(pair["a"], pair["b"], "nanogpt", method="activation", data=pair["train"], rounds=2)
    symspec.align(pair["a"], pair["b"], "nanogpt", method="weight+activation", data=pair["train"], rounds=2)
    assert len(calls) == 2


# -- the mechanics, with toy candidates whose answers are known ---------------------------------

@attrs.frozen
class _Fixed:
    """A candidate that returns a given element (or raises)."""

    name: str
    elements: Any = None
    error: str | None = None
    label: str = "toy"
    canonical: bool = True
    needs_data: bool = False
    needs_module: bool = False
    groups: str | None = None
    candidate: bool = True

    def align(self, problem: Any, a: Any, b: Any, options: Any) -> Alignment:
        if self.error:
            raise SymspecInputError(self.error)
        return Alignment(elements=dict(self.elements or {}), history=[1.0])


def test_the_planted_element_beats_the_identity_and_a_budget_skips_the_rest(pair: dict[str, Any]) -> None:
    with registered(_Fixed("toy-identity")), registered(_Fixed("toy-planted", pair["element"])):
        res = _auto(pair, candidates=("toy-identity", "toy-planted"))
        scores = _scores(res)
        assert res.info["auto"]["winner"] == "toy-planted" and scores["toy-planted"] < scores["toy-identity"]
        first = _auto(pair, candidates=("toy-identity", "toy-planted"), budget=0)
        skipped = [c for c in first.info["auto"]["candidates"] if "skipped" in c]
        assert first.info["auto"]["winner"] == "toy-identity" and [c["method"] for c in skipped] == ["toy-planted"]


def test_a_candidate_that_cannot_run_is_reported_and_all_failing_is_an_error(pair: dict[str, Any]) -> None:
    with registered(_Fixed("toy-broken", error="no room")), registered(_Fixed("toy-identity")):
        res = _auto(pair, candidates=("toy-broken", "toy-identity"))
        broken = next(c for c in res.info["auto"]["candidates"] if c["method"] == "toy-broken")
        assert broken["error"] == "no room" and res.info["auto"]["winner"] == "toy-identity"
        with pytest.raises(SymspecInputError, match=r"no candidate method gave a usable alignment.*toy-broken: no room"):
            _auto(pair, candidates=("toy-broken",))


@pytest.mark.parametrize(("kw", "message"), [
    ({"candidates": ("auto",)}, "cannot be a candidate of itself"),
    ({"candidates": ("none",)}, "aligns nothing"),
    ({"candidates": ("wieght",)}, "unknown alignment method 'wieght'"),
    ({"candidates": ()}, "at least one candidate"),
    ({"budget": -1.0}, "time budget"),
    ({"val_batches": 0}, "val_batches"),
])
def test_bad_auto_options_are_one_line_errors(pair: dict[str, Any], kw: dict[str, Any], message: str) -> None:
    with pytest.raises(SymspecInputError, match=message):
        _auto(pair, **kw)


def test_auto_takes_its_own_options_or_the_solvers_knobs_only(pair: dict[str, Any]) -> None:
    from symspec.alignment import ActivationOptions
    from symspec.solvers import WeightOptions

    run = dict(data=pair["train"], validation=pair["val"], rounds=2)
    res = symspec.align(pair["a"], pair["b"], "nanogpt", method="auto", options=WeightOptions(), **run)
    assert len(_scores(res)) == 4
    with pytest.raises(SymspecInputError, match=r"AutoOptions \(or WeightOptions\), not a ActivationOptions"):
        symspec.align(pair["a"], pair["b"], "nanogpt", method="auto", options=ActivationOptions(), **run)
    from types import SimpleNamespace

    no_loss = SimpleNamespace(batches=pair["train"].batches)
    with pytest.raises(SymspecInputError, match="the data has no loss"):
        symspec.align(pair["a"], pair["b"], "nanogpt", method="auto", data=no_loss, rounds=1)


def test_without_validation_data_auto_scores_on_train_and_says_so(pair: dict[str, Any]) -> None:
    res = symspec.align(pair["a"], pair["b"], "nanogpt", method="auto", data=pair["train"], rounds=2,
                        options=AutoOptions(candidates=("weight",)))
    assert res.info["auto"]["scored_on"].startswith("train") and json.dumps(res.info)


# -- the CLI: auto is the default with --data; its table; its flags belong to it -----------------

@pytest.fixture(scope="module")
def cli_pair(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    from tests.cli_files import gpt_checkpoints

    return gpt_checkpoints(tmp_path_factory.mktemp("auto_cli"))


def test_cli_match_with_data_runs_auto_and_shows_every_candidate(cli_pair: dict[str, Any], tmp_path: Any) -> None:
    from tests.cli_files import run

    args = [cli_pair["m0"], cli_pair["m1"], "--model", cli_pair["model"], "--data", f"text:{cli_pair['text']}"]
    code, out, err = run("match", *args, "--candidates", "weight,weight-tokens", "--out", tmp_path / "t")
    assert code == 0, err
    assert "auto: the candidates" in out and "weight-tokens" in out and "winner" in out
    code, out, err = run("match", *args, "--out", tmp_path / "j", "--json", "--budget", "0")
    assert code == 0, err
    doc = json.loads(out)
    assert doc["method"] == "auto" and doc["info"]["auto"]["scored_on"] == "validation"
    ran = [c["method"] for c in doc["info"]["auto"]["candidates"] if "midpoint_loss" in c]
    assert ran == ["weight"]  # a zero budget: the first candidate only, the rest skipped and listed
    assert json.loads((tmp_path / "j" / "match.json").read_text())["info"]["auto"]["winner"] == "weight"
    # auto's flags with another method: one line, exit 2, nothing written
    for flag in (["--candidates", "weight"], ["--budget", "5"]):
        code, _, err = run("match", *args, "--method", "activation", *flag, "--out", tmp_path / "x")
        assert code == 2 and "for --method auto" in err and err.count("\n") == 1 and not (tmp_path / "x").exists()
    code, _, err = run("match", *args, "--candidates", "wieght", "--out", tmp_path / "y")
    assert code == 2 and "unknown alignment method 'wieght'" in err


def test_cli_barrier_align_auto_says_which_method_won(cli_pair: dict[str, Any], tmp_path: Any) -> None:
    from tests.cli_files import run

    args = [cli_pair["m0"], cli_pair["m1"], "--model", cli_pair["model"], "--data", f"text:{cli_pair['text']}"]
    code, out, err = run("barrier", *args, "--points", 3, "--align", "auto", "--align", "weight",
                         "--report", tmp_path / "r.json")
    assert code == 0, err
    winner = json.loads((tmp_path / "r.json").read_text())
    assert "auto: aligned with " in out and "weight: aligned with" not in out
    assert "auto" in json.dumps(winner)


def test_cli_universe_with_data_aligns_with_auto_by_default(cli_pair: dict[str, Any], tmp_path: Any) -> None:
    """As match and merge: --data without --method is auto; without --data, or with a
    --method, what it was."""
    from tests.cli_files import run

    base = ["universe", cli_pair["m0"], cli_pair["m1"], "--model", cli_pair["model"], "--rounds", "1", "--json"]
    data = ["--data", f"text:{cli_pair['text']}", "--max-samples", "32", "--resolution", "2"]
    got = {}
    for name, extra in {"data": data, "none": [], "weight": [*data, "--method", "weight"]}.items():
        code, out, err = run(*base, *extra, "--out", tmp_path / name)
        assert code == 0, err
        got[name] = json.loads(out)["method"]
    assert got == {"data": "auto", "none": "weight", "weight": "weight"}


def test_universe_matching_rounds_can_align_with_auto(cli_pair: dict[str, Any]) -> None:
    from symspec.data import load_data
    from symspec.loading import load_model
    from symspec.universe import universe_match

    paths = [cli_pair["m0"], cli_pair["m1"]]
    model = load_model(cli_pair["m0"], factory=cli_pair["model"]).model
    data = load_data(f"text:{cli_pair['text']}", model=model, split="train")
    res = universe_match(paths, "nanogpt", factory=cli_pair["model"], method="auto", rounds=2, jobs=1, data=data)
    assert res.method == "auto" and len(res.history) >= 2
    x = torch.randint(0, 10, (2, 8))
    for path, aligned in zip(paths, res.aligned):  # every model in the universe still computes its own function
        own = load_model(path, factory=cli_pair["model"]).model
        res.canonical_model.load_state_dict(aligned)
        torch.testing.assert_close(res.canonical_model(x), own(x), rtol=1e-4, atol=1e-4)


def test_cli_universe_with_data_runs_on_bfloat16_folders(tmp_path: Any) -> None:
    """A bfloat16 Hugging Face Llama pair (rotary, grouped-query heads), aligned by the
    data-driven methods in universe rounds: the reference module each round runs is in
    the run's working dtype (float32), as its states are. Failed before with 'Tensor
    dtype mismatch' (activation) and 'linalg.inv: Low precision dtypes' (auto, the
    default with --data)."""
    pytest.importorskip("transformers")
    from tests.cli_files import run
    from tests.zoo import ZOO

    for seed in (0, 1):
        model, _ = ZOO["llama"](seed=seed)
        model.to(torch.bfloat16).save_pretrained(tmp_path / f"m{seed}", max_shard_size="20KB")
    vocab = model.config.vocab_size
    (tmp_path / "t.txt").write_text("".join(chr(48 + (i * 7919) % vocab) for i in range(4000)))
    base = ["universe", tmp_path / "m0", tmp_path / "m1", "--rounds", "1", "--data", f"text:{tmp_path / 't.txt'},block=8",
            "--max-samples", "32", "--json"]
    for method in ([], ["--method", "activation"]):
        code, out, err = run(*base, *method, "--out", tmp_path / f"u{len(method)}")
        assert code == 0, err
        assert json.loads(out)["method"] == ("activation" if method else "auto")
