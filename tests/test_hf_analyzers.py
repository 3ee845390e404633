"""The analyzers on tiny Hugging Face folders of every family with a built-in spec:
``symspec barrier`` (vanilla and weight matching), ``symspec universe --data``, the Python
analyzers, data hooks lent by ``--model`` beside HF folders, and the warning for two
models whose weights have the same shapes but whose configs differ.

Llama-style models keep their rotary frequencies in non-persistent buffers (in no state
dict); the analyzers must evaluate them with the module's own buffers. The oracle for
every curve is a plain forward pass of the loaded model over the same batches: the loss
at λ=0 and λ=1 must be the endpoints' losses, aligned (function-preserving) or not.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import torch
import torch.nn.functional as F

from symspec.analyzers.report import REPORT_SCHEMA, BarrierReport
from symspec.data import EvalData, call_model, load_data
from symspec.loading import config_differences, import_file, load_model
from symspec.testing import randomize_
from tests.cli_files import run, write_words
from tests.zoo import ZOO

CONTEXT = 8
MAX = 4  # sequences or images per evaluation: the whole file stays fast on one core

#: a model file lending its hooks to Hugging Face folders: masked-token data for any
#: model with a vocabulary, and a loss that is twice the cross-entropy (so that a test
#: can tell it from the built-in loss)
HOOKS = '''
import torch
import torch.nn.functional as F


def data(split, batch_size=4, max_samples=None, seed=0, model=None):
    g = torch.Generator().manual_seed({{"train": 0, "val": 1, "test": 2}}[split] + seed)
    vocab = model.config.vocab_size
    ids = torch.randint(2, vocab, ({n}, {length}), generator=g)
    masked = ids.clone()
    masked[:, ::3] = 1  # a mask token: the model reconstructs every token
    return [({{"input_ids": masked[i : i + batch_size]}}, ids[i : i + batch_size]) for i in range(0, {n}, batch_size)]


def loss(output, targets):
    logits = output.logits if hasattr(output, "logits") else output
    return 2.0 * F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
'''


def hooks_file(folder: Path, name: str = "hooks.py", n: int = 4, length: int = 6) -> Path:
    p = folder / name
    p.write_text(HOOKS.format(n=n, length=length))
    return p


def vit_digits(seed: int = 0) -> torch.nn.Module:
    """A tiny ViT for scikit-learn's 8x8 digits (10 classes, 3 channels: digits grey
    values are repeated, the usual way to feed grey images to RGB models)."""
    import transformers

    torch.manual_seed(seed)
    cfg = transformers.ViTConfig(num_hidden_layers=1, num_attention_heads=2, hidden_size=8, intermediate_size=12,
                                 image_size=8, patch_size=4, num_channels=3, num_labels=10)
    return lively(randomize_(transformers.ViTForImageClassification(cfg), seed).eval(), seed)


def lively(model: torch.nn.Module, seed: int) -> torch.nn.Module:
    """Every matrix redrawn with variance 1/fan_in. At Hugging Face's initialisation
    (std 0.02) attention is almost uniform: halving the rotary frequencies moved a tiny
    Llama's loss by 1e-5, below what the endpoint oracle can see; here by far more
    (test_aligned_module_keeps_the_buffers_outside_the_state_dict checks it)."""
    g = torch.Generator().manual_seed(1000 + seed)
    seen: set[int] = set()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2 and id(p) not in seen:
                seen.add(id(p))
                p.copy_(torch.randn(p.shape, generator=g) / math.sqrt(p.shape[-1]))
    return model


def _builders(vocab: int) -> dict[str, Callable[[int], torch.nn.Module]]:
    def zoo(name: str, **kw: Any) -> Callable[[int], torch.nn.Module]:
        return lambda seed: lively(ZOO[name](seed=seed, n_layer=1, **kw)[0], seed)

    return {
        "llama": zoo("llama", vocab=vocab),  # GQA (4 query heads, 2 key/value heads), rotary, untied head
        "llama_tied": zoo("llama", vocab=vocab, tie=True),
        "qwen2": zoo("qwen2", vocab=vocab),
        "opt": zoo("opt", vocab=vocab),
        "bert": zoo("bert", vocab=vocab),
        "gemma": zoo("gemma", vocab=vocab),  # its embedding scale is a non-persistent buffer too
        "gpt_neox": zoo("gpt_neox", vocab=vocab),  # partial rotary
        "vit": vit_digits,
    }


class Zoo:
    """Saved Hugging Face folders, built on first use: ``zoo.folder(family, seed)``."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.text = root / "words.txt"
        self.vocab = write_words(self.text)
        self.builders = _builders(self.vocab)

    def folder(self, family: str, seed: int = 0, **overrides: Any) -> Path:
        suffix = "".join(f"-{k}{v}" for k, v in sorted(overrides.items()))
        out = self.root / f"{family}{suffix}-{seed}"
        if not out.exists():
            model = (self.builders[family](seed) if not overrides
                     else lively(ZOO[family](seed=seed, n_layer=1, vocab=self.vocab, **overrides)[0], seed))
            model.save_pretrained(out)
        return out

    def data(self, family: str) -> str:
        """The --data source each family is measured on."""
        if family == "vit":
            return "digits"
        if family == "bert":  # a masked LM: the hook's masked tokens, not next-character text
            return "hook"
        return f"text:{self.text},context={CONTEXT}"

    def extra(self, family: str) -> list[Any]:
        return ["--model", hooks_file(self.root)] if family == "bert" else []


@pytest.fixture(scope="module")
def zoo(tmp_path_factory: pytest.TempPathFactory) -> Zoo:
    return Zoo(tmp_path_factory.mktemp("hf_analyzers"))


def direct_loss(model: torch.nn.Module, data: EvalData) -> float:
    """The oracle: the mean loss of a plain forward pass of ``model`` over ``data``."""
    total, count = 0.0, 0
    with torch.no_grad():
        for inputs, targets in data.batches:
            total += float(data.loss(call_model(model, inputs), targets)) * targets.numel()
            count += targets.numel()
    return total / count


def loaded_data(zoo: Zoo, family: str, model: torch.nn.Module) -> EvalData:
    """The batches the CLI evaluates for ``family`` (same source, split and sizes)."""
    source = zoo.data(family)
    module = import_file(hooks_file(zoo.root)) if source == "hook" else None
    return load_data(source, model=model, module=module, split="val", batch_size=64, max_samples=MAX)


def close(x: float, y: float, rtol: float = 1e-4) -> bool:
    return math.isfinite(x) and abs(x - y) <= rtol * max(1.0, abs(y))


# --------------------------------------------------------------------------- the root cause

class Scaled(torch.nn.Module):
    """A linear map times a non-persistent buffer (as rotary frequencies are kept)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(3, 4)
        self.register_buffer("scale", torch.tensor(3.0), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) * self.scale


def test_non_persistent_buffers_stay_the_modules_own() -> None:
    from symspec.analyzers import measure
    from symspec.analyzers.interpolate import functional_names

    torch.manual_seed(0)
    a, b = Scaled(), Scaled()
    x, y = torch.randn(8, 3), torch.randint(4, (8,))
    data = load_data(None, module=type("Hooks", (), {"data": staticmethod(lambda split: [(x, y)])}))
    names, alias = functional_names(a)
    assert "scale" not in names and "scale" not in alias
    assert sorted(names) == sorted(a.state_dict())
    curve = measure([(a, b)], data, points=3)["none"][0].curve
    # the buffer (3.0, not a default) is used at both ends: the plain forward passes agree
    assert close(curve.loss_a, direct_loss(a, data), 1e-6) and close(curve.loss_b, direct_loss(b, data), 1e-6)
    a.scale.fill_(1.0)  # negative control: another buffer value gives another loss
    assert not close(curve.loss_a, direct_loss(a, data), 1e-6)


@pytest.mark.parametrize("family", ["llama", "gemma"])
def test_aligned_module_keeps_the_buffers_outside_the_state_dict(zoo: Zoo, family: str) -> None:
    from symspec.analyzers.barrier import align_pair

    a, b = (load_model(zoo.folder(family, s)).model for s in (0, 1))
    aligned = align_pair("weight", a, b, spec=family)
    own = dict(a.named_buffers())
    moved = dict(aligned.module.named_buffers())
    assert set(own) - set(a.state_dict())  # rotary frequencies (and Gemma's embedding scale)
    assert own.keys() == moved.keys() and all(torch.equal(own[k], moved[k]) for k in own)
    # the oracle sees those buffers: with the frequencies halved, the loss moves by far
    # more than the tolerance the endpoint checks use
    data = loaded_data(zoo, family, a)
    before = direct_loss(a, data)
    with torch.no_grad():
        for k, t in own.items():
            if "inv_freq" in k:
                t.mul_(0.5)
    assert not close(direct_loss(a, data), before, 1e-3)


# --------------------------------------------------------------------------- symspec barrier

FAMILIES = ["llama", "llama_tied", "qwen2", "opt", "bert", "vit", "gemma", "gpt_neox"]


@pytest.mark.parametrize("family", FAMILIES)
def test_barrier_cli_on_hf_folders(zoo: Zoo, family: str) -> None:
    a, b = zoo.folder(family, 0), zoo.folder(family, 1)
    code, out, err = run("barrier", a, b, "--data", zoo.data(family), "--align", "none", "--align", "weight",
                         "--points", 3, "--max-samples", MAX, "--json", *zoo.extra(family))
    assert code == 0, err
    report = json.loads(out)
    jsonschema.validate(report, REPORT_SCHEMA)
    assert report["notes"] == []  # two models of one config: no warning
    assert "warning" not in err
    la, lb = load_model(a).model, load_model(b).model
    data = loaded_data(zoo, family, la)
    assert report["data"]["examples"] == data.examples
    want_a, want_b = direct_loss(la, data), direct_loss(lb, data)
    for method in report["methods"]:
        (pair,) = method["pairs"]
        # vanilla: A and B themselves; weight matching: canonical A and aligned B, same functions
        assert close(pair["loss"][0], want_a), (method["method"], pair["loss"], want_a)
        assert close(pair["loss"][-1], want_b), (method["method"], pair["loss"], want_b)
        assert math.isfinite(pair["loss"][1]) and pair["barrier"] >= 0.0
    assert [m["method"] for m in report["methods"]] == ["none", "weight"]


# --------------------------------------------------------------------------- symspec universe --data

@pytest.mark.parametrize("family", ["llama", "opt"])
def test_universe_data_on_hf_folders(zoo: Zoo, family: str, tmp_path: Path) -> None:
    folders = [zoo.folder(family, s) for s in range(3)]
    out = tmp_path / "u"
    code, _, err = run("universe", *folders, "--out", out, "--data", zoo.data(family), "--max-samples", MAX,
                       "--rounds", 2, "--resolution", 2, "--json")
    assert code == 0, err
    analysis = json.loads((out / "report.json").read_text())["analysis"]
    models = [load_model(f).model for f in folders]
    data = loaded_data(zoo, family, models[0])
    for m, entry in zip(models, analysis["models"]):
        want = direct_loss(m, data)
        assert close(entry["loss"], want)
        assert close(entry["aligned_loss"], want)  # aligned into the universe: the same function
    assert math.isfinite(analysis["merged"]["loss"]) and math.isfinite(analysis["plain_average"]["loss"])
    assert {s["method"] for s in analysis["simplex"]} == {"plain", "universe"}
    assert (out / "simplex.png").exists()


# --------------------------------------------------------------------------- the Python analyzers

def test_python_analyzers_on_llama_folder(zoo: Zoo, tmp_path: Path) -> None:
    from symspec.analyzers import Measurer, interpolation_curve, measure, pair_barrier
    from symspec.analyzers.interpolate import PathEvaluator
    from symspec.analyzers.simplex import simplex_surface

    models = [load_model(zoo.folder("llama", s)).model for s in range(3)]
    data = loaded_data(zoo, "llama", models[0])
    want = [direct_loss(m, data) for m in models]
    states = [{k: v.detach() for k, v in m.state_dict().items()} for m in models]

    res = measure([(models[0], models[1])], data, methods=("none", "weight"), spec="llama", points=3)
    for method in ("none", "weight"):
        curve = res[method][0].curve
        assert close(curve.loss_a, want[0]) and close(curve.loss_b, want[1]), method
    one = pair_barrier(models[0], models[2], data, points=3)
    assert close(one.curve.loss_a, want[0]) and close(one.curve.loss_b, want[2])
    assert one.barrier.value >= 0.0
    curve = interpolation_curve(models[0], states[0], states[1], data, points=[0.0, 0.25, 1.0])
    assert close(curve.loss_a, want[0]) and close(curve.loss_b, want[1])
    m = Measurer(data, points=3)
    assert m.evaluator(models[0]) is m.evaluator(models[1])  # one evaluator per architecture
    surface = simplex_surface(PathEvaluator(models[0], data), states, method="plain", resolution=2)
    assert all(close(x, y) for x, y in zip(surface.endpoint_losses, want))
    assert surface.max_deviation >= 0.0

    report = BarrierReport.build(data, res)
    jsonschema.validate(report.to_dict(), REPORT_SCHEMA)
    assert report.markdown().count("\n| ") == 3  # the header and one row per method
    png = report.plot(tmp_path / "curves.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# --------------------------------------------------------------------------- hooks lent by --model

def test_model_file_hooks_beside_hf_folders(zoo: Zoo, tmp_path: Path) -> None:
    a, b = zoo.folder("llama", 0), zoo.folder("llama", 1)
    hooks = hooks_file(tmp_path)
    module = import_file(hooks)
    model = load_model(a).model
    data = load_data("hook", model=model, module=module, split="val")
    assert data.loss is module.loss
    want = direct_loss(model, data)
    plain = direct_loss(model, EvalData("x", "hook", "val", data.batches,
                                        lambda o, t: F.cross_entropy(o.logits.flatten(0, 1), t.flatten()), None))
    assert not close(want, plain)
    for data_args in (["--data", "hook"], []):  # explicit, and the default when --model defines data()
        code, out, err = run("barrier", a, b, "--model", hooks, *data_args, "--points", 3, "--json")
        assert code == 0, err
        report = json.loads(out)
        assert report["data"]["kind"] == "hook" and report["data"]["source"] == f"hook:{hooks}"
        # the hook's data and loss (twice the cross-entropy) are what the curve measures
        assert close(report["methods"][0]["pairs"][0]["loss"][0], want)


def test_universe_model_file_hooks_beside_hf_folders(zoo: Zoo, tmp_path: Path) -> None:
    folders = [zoo.folder("llama", s) for s in range(2)]
    hooks = hooks_file(tmp_path)
    out_dir = tmp_path / "u"
    code, _, err = run("universe", *folders, "--model", hooks, "--out", out_dir, "--data", "hook", "--rounds", 1, "--json")
    assert code == 0, err
    analysis = json.loads((out_dir / "report.json").read_text())["analysis"]
    assert analysis["data"]["source"] == f"hook:{hooks}"
    model = load_model(folders[0]).model
    data = load_data("hook", model=model, module=import_file(hooks), split="val")
    assert close(analysis["models"][0]["loss"], direct_loss(model, data))  # the hook's data and loss


def test_hook_errors_name_what_is_missing(zoo: Zoo, tmp_path: Path) -> None:
    a, b = zoo.folder("llama", 0), zoo.folder("llama", 1)
    code, _, err = run("barrier", a, b, "--data", "hook")
    assert code == 2 and "--model" in err and "Traceback" not in err
    bare = tmp_path / "bare.py"
    bare.write_text("X = 1\n")
    code, _, err = run("barrier", a, b, "--model", bare, "--data", "hook")
    assert code == 2 and str(bare) in err and "data(split" in err


# --------------------------------------------------------------------------- different configs

def test_config_differences() -> None:
    opt2, _ = ZOO["opt"](seed=0, n_layer=1, n_head=2, head_dim=4)
    opt4, _ = ZOO["opt"](seed=1, n_layer=1, n_head=4, head_dim=2)
    again, _ = ZOO["opt"](seed=2, n_layer=1, n_head=2, head_dim=4)
    assert {k: v.shape for k, v in opt2.state_dict().items()} == {k: v.shape for k, v in opt4.state_dict().items()}
    assert config_differences(opt2, opt4) == {"num_attention_heads": (2, 4)}
    assert config_differences(opt2, again) == {}
    # harmless fields (where it came from, precision, dropout) do not count; nested ones are dotted
    base = {"n_head": 2, "dtype": "float32", "_name_or_path": "a", "dropout": 0.1, "rope": {"theta": 1e4}}
    other = {"n_head": 2, "dtype": "bfloat16", "_name_or_path": "b", "dropout": 0.0, "rope": {"theta": 5e5}}
    assert config_differences(base, other) == {"rope.theta": (1e4, 5e5)}
    assert config_differences(torch.nn.Linear(2, 2), opt2) == {}  # no config: nothing to compare


def test_no_same_shapes_warning_for_models_of_different_widths() -> None:
    """The warning says "same weight shapes": where the widths differ (B lifted into A,
    or A narrower than B, which the command refuses itself) it once preceded the error
    line with that false claim. The control: same shapes, another head count, warned."""
    from symspec.cli._common import config_warning
    from symspec.loading import LoadedModel

    def loaded(**kw: Any) -> LoadedModel:
        return LoadedModel(ZOO["opt"](seed=0, n_layer=1, **kw)[0], Path("m"), "hf")

    narrow, wide = loaded(n_head=2, head_dim=4), loaded(n_head=4, head_dim=4)
    assert config_warning(narrow, wide, ("A", "B"), "average") is None
    assert config_warning(wide, narrow, ("A", "B"), "average") is None
    warned = config_warning(narrow, loaded(n_head=4, head_dim=2), ("A", "B"), "average")
    assert warned is not None and "same weight shapes" in warned and "num_attention_heads: 2 vs 4" in warned


def test_warning_for_same_shapes_different_configs(zoo: Zoo, tmp_path: Path) -> None:
    a = zoo.folder("opt", 0)
    b = zoo.folder("opt", 1, n_head=4, head_dim=2)  # the same shapes as a (2 heads of 4), 4 heads of 2
    data = zoo.data("opt")
    code, out, err = run("barrier", a, b, "--data", data, "--points", 3, "--max-samples", 2, "--json")
    assert code == 0, err
    assert "warning:" in err and "num_attention_heads: 2 vs 4" in err
    notes = json.loads(out)["notes"]
    assert len(notes) == 1 and "num_attention_heads" in notes[0]
    code, _, err = run("merge", a, b, "--no-align", "--out", tmp_path / "m")
    assert code == 0, err
    assert "warning:" in err and "num_attention_heads: 2 vs 4" in err
    # negative: two models of one config (another seed) merge without a word
    code, _, err = run("merge", a, zoo.folder("opt", 1), "--no-align", "--out", tmp_path / "m2")
    assert code == 0, err
    assert "warning" not in err
