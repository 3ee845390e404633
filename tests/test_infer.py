"""``symspec infer``: a spec drafted from the traced graph, checked, and as rich as is true.

- every built-in spec's family: the inferred spec binds the same spaces with the same
  groups as the hand-written one (compared parameter axis by parameter axis), and passes
  an independent check;
- architectures the library ships no spec for (tests/infer_zoo.py): the expected groups,
  a passing check, and for every space the next larger group fails its check;
- negative cases: a nonlinearity on the residual stream, a norm that cannot be folded, an
  op inference cannot read, evidence that overclaims (the check shrinks it), a model with
  nothing to verify; and the command's exit codes and outputs.
"""

from __future__ import annotations

import json
import re
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import symspec
from symspec.binding import bind
from symspec.checker import check
from symspec.inference import InferResult, infer
from symspec.spec import load_spec, loads_spec

from .cli_files import run
from .infer_zoo import NEW
from .zoo import EXAMPLES, ZOO, variant

warnings.filterwarnings("ignore", message=".*eos_token_id.*")


def signature(spec: Any, model: nn.Module) -> dict[str, tuple]:
    """Parameter -> per axis, the groups acting on it (space instances renamed by first
    appearance, so that two specs with the same spaces under other names agree)."""
    problem = bind(spec, model).problem
    ids: dict[str, int] = {}
    out = {}
    for pname in sorted(problem.params):
        axes = []
        for ab in sorted(problem.params[pname].axes, key=lambda a: a.axis):
            segs = []
            for seg in ab.segments:
                facs = []
                for f in seg.factors:
                    ids.setdefault(f.space, len(ids))
                    facs.append((ids[f.space], str(problem.spaces[f.space].group), f.path, f.variance))
                segs.append((seg.start, seg.size, tuple(facs)))
            axes.append((ab.axis, tuple(segs), ab.layout is not None))
        if axes:
            out[pname] = tuple(axes)
    return out


def mistral(seed: int = 0) -> tuple[nn.Module, Any]:
    """Mistral shares the Llama spec (and has no zoo entry of its own)."""
    import transformers

    torch.manual_seed(seed)
    cfg = transformers.MistralConfig(num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, hidden_size=16,
                                     intermediate_size=12, vocab_size=23, max_position_embeddings=32, head_dim=4,
                                     bos_token_id=0, eos_token_id=0, pad_token_id=None)
    model = transformers.MistralForCausalLM(cfg).eval()
    symspec.testing.randomize_(model, seed)
    return model, {"input_ids": torch.randint(23, (2, 8), generator=torch.Generator().manual_seed(seed)), "use_cache": False}


#: built-in spec -> the model it is compared on; a tied Llama is compared with 'llama',
#: which unties the head as inference does (llama_tied keeps the tie by giving up rotations)
FAMILIES = {
    "nanogpt": lambda: ZOO["nanogpt"](), "vit": lambda: ZOO["vit"](), "gpt2": lambda: ZOO["gpt2"](),
    "hf_vit": lambda: ZOO["hf_vit"](), "timm_vit": lambda: ZOO["timm_vit"](), "opt": lambda: ZOO["opt"](),
    "bert": lambda: ZOO["bert"](), "llama": lambda: ZOO["llama"](), "llama (tied)": lambda: ZOO["llama_tied"](),
    "qwen2": lambda: ZOO["qwen2"](), "mistral (llama spec)": mistral, "gemma": lambda: ZOO["gemma"](),
    "gpt_neox": lambda: ZOO["gpt_neox"](),
}


def _builtin(family: str) -> str:
    return family.split(" ")[0] if "(llama spec)" not in family else "llama"


@pytest.mark.parametrize("family", list(FAMILIES))
def test_inferred_spec_matches_the_hand_written_one(family: str) -> None:
    model, inputs = FAMILIES[family]()
    result = infer(model, inputs)
    assert result.passed and result.verified, result.check.render()
    assert signature(result.spec, model) == signature(load_spec(_builtin(family)), model)
    # an independent check: more samples, another seed
    report = check(model, result.spec, inputs, samples=3, seed=7)
    assert report.passed, report.render()
    # the YAML round-trips: it validates and loads to the same spec
    assert loads_spec(result.yaml, "again.yaml").name == result.spec.name


def test_the_signature_tells_specs_apart() -> None:
    """The comparison can fail: a hand-written spec of another family, or a group changed."""
    model, _ = ZOO["llama_tied"]()
    llama = signature(load_spec("llama"), model)
    assert llama != signature(load_spec("llama_tied"), model)
    assert llama != signature(variant("llama", ("group: O(d)", "group: SP(d)")), model)


# -- architectures without a built-in spec -----------------------------------------------

#: the next larger group of each inferred one (what must fail), as text replacements
def _larger(group: str) -> str | None:
    if group.startswith("Heads("):
        if "qk=RoPE(" in group:
            return re.sub(r"qk=RoPE\([^)]*\)", "qk=GL(dh)", group)
        if "ov=O(" in group:
            return group.replace("ov=O(", "ov=GL(")
        if "qk=O(" in group:
            return group.replace("qk=O(", "qk=GL(")
        return None  # GL on both circuits: the largest there is
    if group.startswith("Experts("):
        return group.replace(", S(", ", SP(") if ", S(" in group else None
    kind, arg = group.split("(", 1)
    bigger = {"O": "GL", "OC": "O", "SP": "O", "S": "SP", "D": "GL", "Dpos": "D"}.get(kind)
    return f"{bigger}({arg}" if bigger else None


def assert_richest(model: nn.Module, inputs: Any, result: InferResult) -> int:
    """For every inferred space, the same spec with that space's group one step larger
    fails the check on that space. Returns how many spaces were tried."""
    tried = 0
    for sp in result.spaces:
        bigger = _larger(sp.group)
        if bigger is None:
            continue
        text = result.yaml.replace(f"  {sp.name}:\n    group: {json.dumps(sp.group)}", f"  {sp.name}:\n    group: {json.dumps(bigger)}")
        if text == result.yaml:
            text = result.yaml.replace(f"  {sp.name}:\n    group: {sp.group}", f"  {sp.name}:\n    group: {bigger}")
        assert text != result.yaml, sp.name
        report = check(model, loads_spec(text, "bigger.yaml"), inputs, samples=2, dtypes=("float64",))
        failed = {r.space.replace("[*]", "[i]") for r in report.failed_rows()}
        assert sp.name in failed, f"{sp.name}: {bigger} passes too\n{report.render()}"
        tried += 1
    return tried


@pytest.mark.parametrize("name", list(NEW))
def test_new_architectures_get_their_richest_true_groups(name: str) -> None:
    build, want = NEW[name]
    model, inputs = build()
    result = infer(model, inputs)
    assert result.passed, result.check.render()
    assert {s.name.replace("[i]", ""): s.group for s in result.spaces} == want
    assert assert_richest(model, inputs, result) >= 2


@pytest.mark.parametrize("family", ["llama", "gpt2", "bert", "gpt_neox", "opt"])
def test_built_in_families_get_their_richest_true_groups(family: str) -> None:
    model, inputs = FAMILIES[family]()
    result = infer(model, inputs)
    assert assert_richest(model, inputs, result) >= 2


# -- negative cases ------------------------------------------------------------------------


class Block(nn.Module):
    def __init__(self, d: int, post_act: bool = False, shared_norm: bool = False) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(d)
        self.fc1 = nn.Linear(d, 2 * d)
        self.fc2 = nn.Linear(2 * d, d)
        self.post_act = post_act
        self.shared_norm = shared_norm

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.ln(x)
        if self.shared_norm:  # post-norm: the norm's output is the residual stream itself
            return h + self.fc2(F.gelu(self.fc1(h)))
        y = x + self.fc2(F.gelu(self.fc1(h)))
        return F.gelu(y) if self.post_act else y


class Tiny(nn.Module):
    def __init__(self, post_act: bool = False, shared_norm: bool = False, mystery: bool = False, d: int = 8) -> None:
        super().__init__()
        self.emb = nn.Embedding(11, d)
        self.blocks = nn.ModuleList([Block(d, post_act, shared_norm) for _ in range(2)])
        self.norm = nn.LayerNorm(d)
        self.head = nn.Linear(d, 11)
        self.mystery = mystery

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.emb(ids)
        if self.mystery:
            x = torch.ops.symspec_test.mystery(x)
        for b in self.blocks:
            x = b(x)
        return self.head(self.norm(x))


@torch.library.custom_op("symspec_test::mystery", mutates_args=())
def _mystery(x: torch.Tensor) -> torch.Tensor:
    """An op the inference cannot read: it reverses the features' order and squares one."""
    y = x.flip(-1).clone()
    y[..., 0] = y[..., 0] ** 2
    return y


@_mystery.register_fake
def _(x: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x)


def _tiny(**kw: Any) -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    model = Tiny(**kw).eval()
    symspec.testing.randomize_(model, 0)
    return model, torch.randint(11, (2, 6), generator=torch.Generator().manual_seed(0))


def _groups(result: InferResult) -> dict[str, str]:
    return {s.name: s.group for s in result.spaces}


def test_a_nonlinearity_on_the_residual_stream_leaves_permutations() -> None:
    model, ids = _tiny(post_act=True)
    result = infer(model, ids)
    assert result.passed
    assert _groups(result)["resid"] == "S(d)"
    assert any("gelu" in e for s in result.spaces if s.name == "resid" for e in s.evidence)
    plain, ids = _tiny()
    assert _groups(infer(plain, ids))["resid"] == "OC(d)"  # the same model without it keeps rotations


def test_a_norm_that_cannot_be_folded_is_kept_and_narrows_the_group() -> None:
    model, ids = _tiny(shared_norm=True)
    result = infer(model, ids)
    assert result.passed
    groups = _groups(result)
    assert groups["resid"] == "S(d)" and groups["sgn"] == "Sign(d)"
    # the gains of the norms on the stream are bound, not folded
    assert "blocks.{i}.ln.weight: [abs(resid)]" in result.yaml
    assert "gain: blocks.{i}.ln.weight" not in result.yaml
    assert "gain: norm.weight" in result.yaml  # the final norm only feeds the head: it folds


def test_an_op_inference_cannot_read_stays_invariant() -> None:
    model, ids = _tiny(mystery=True)
    result = infer(model, ids)
    assert result.passed
    assert "resid" not in _groups(result)
    assert any("mystery" in why for _, why in result.unexplained)
    assert "mystery" in result.yaml  # the header says what was left invariant and why
    # what is not touched by it keeps its symmetries
    assert _groups(result)["mlp[i]"] == "S(f)"


class _Scaled(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(4, 6), nn.Linear(6, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.tanh(self.fc1(x)) * 2.0)  # the product the failing rule reads


def test_a_node_no_rule_can_read_is_named_with_its_source_line_and_message(monkeypatch: pytest.MonkeyPatch) -> None:
    """A rule that raises leaves that node's axes invariant (never wrong), and says which
    node, where in the user's code, and the error's message (as fx's Interpreter does)."""
    from symspec.inference.walk_layers import LayerRules

    model, x = _Scaled().eval(), torch.randn(3, 4)
    control = infer(model, x)  # the control: the product is read, nothing is unreadable
    assert control.passed and not any("could not read" in n for n in control.notes), control.notes

    def fails(self: Any, n: Any, shape: Any) -> None:
        raise ValueError("no rule for this product\n(second line)")

    monkeypatch.setattr(LayerRules, "op_mul", fails)
    result = infer(model, x)
    assert result.passed, result.check.render()
    note = next(n for n in result.notes if "could not read" in n)
    line = next(i for i, t in enumerate(Path(__file__).read_text().splitlines(), 1) if "the product the failing rule reads" in t)
    assert "%mul" in note and "aten.mul" in note, note
    assert f"test_infer.py:{line}, in forward" in note, note
    assert "ValueError: no rule for this product (second line)" in note, note
    assert "stay invariant" in note and "could not read" in result.yaml
    # the evidence names the op and the message, where the classes it touched stay invariant
    assert any("cannot read (mul (ValueError: no rule for this product" in why for _, why in result.unexplained) \
        or any("cannot read (mul (ValueError" in e for s in result.spaces for e in s.evidence), result.unexplained


def _lattice_problems(table: dict[str, Any], kinds: set[str]) -> list[str]:
    """What is wrong with a candidate table: kinds missing or unknown, an order that is no
    lattice (a kind below another contains more than it), a shrink to a kind that contains it."""
    problems = [f"{k}: no entry" for k in sorted(kinds - set(table))]
    for kind, c in table.items():
        named = {kind, *c.below, *c.shrink, *([c.larger] if c.larger else [])}
        problems += [f"{kind}: unknown kind {k}" for k in sorted(named - kinds)]
        problems += [f"{kind}: {b} contains more" for b in sorted(c.below) if b in table and not table[b].below <= c.below]
        if any(t == kind or (t in table and kind in table[t].below) for t in c.shrink):  # a shrink that grows
            problems.append(f"{kind}: shrinks to {c.shrink}")
    return problems


def test_the_candidate_lattice_has_every_group_kind() -> None:
    """CANDIDATES is keyed by the group registry's names and its order is a lattice; the
    check finds a missing kind, an unknown one and a broken order."""
    from symspec.groups import REGISTRY
    from symspec.inference import CANDIDATES, Candidate

    assert _lattice_problems(CANDIDATES, set(REGISTRY)) == []
    broken = {**{k: v for k, v in CANDIDATES.items() if k != "Sign"},
              "O": Candidate(True, frozenset({"O", "GL"}), ("GL",)), "Cyc": Candidate(False)}
    assert _lattice_problems(broken, set(REGISTRY)) == ["Sign: no entry", "GL: shrinks to ('O', 'S', 'Id')", "O: GL contains more",
                                                        "O: shrinks to ('GL',)", "Cyc: unknown kind Cyc"]


def test_a_wrong_claim_is_shrunk_by_the_check(monkeypatch: pytest.MonkeyPatch) -> None:
    """Evidence that overclaims (every class GL) is caught by the check, space by space."""
    import symspec.inference.builder as builder
    import symspec.inference.draft_spaces as draft_spaces

    for module in (builder, draft_spaces):  # every class that evidence would narrow
        monkeypatch.setattr(module, "largest", lambda tags: ("GL", []))
    model, inputs = ZOO["llama"]()
    result = infer(model, inputs)
    assert result.passed
    groups = _groups(result)
    assert groups["mlp[i]"] == "S(f)"
    assert groups["resid"] in ("O(d)", "S(d)")
    shrunk = {s.name: s.shrunk for s in result.spaces}
    assert shrunk["mlp[i]"] and "GL(f)" in shrunk["mlp[i]"][0]
    assert result.attempts > 1


def test_nothing_verifiable_is_said_so() -> None:
    class Opaque(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = nn.Linear(4, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.ops.symspec_test.mystery(self.a(torch.ops.symspec_test.mystery(x)))

    result = infer(Opaque().eval(), torch.randn(2, 4))
    assert result.passed and not result.verified and result.spaces == []


def test_infer_is_exported_with_its_report() -> None:
    model, inputs = ZOO["gpt2"]()
    result = symspec.infer(model, inputs)
    assert isinstance(result.spec, symspec.Spec)
    d = result.to_dict()
    assert d["verified"] and {s["name"] for s in d["spaces"]} == {"resid", "attn[i]", "mlp[i]"}
    assert all(s["evidence"] for s in d["spaces"])


# -- the command ----------------------------------------------------------------------------


def test_cli_writes_a_spec_that_validates_and_checks(tmp_path: Path) -> None:
    out = tmp_path / "nanogpt.yaml"
    code, _, err = run("infer", EXAMPLES / "nanogpt.py", "--out", out)
    assert code == 0, err
    assert "the spec passes its check" in err and "attn[i]: Heads(H, qk=GL(dh), ov=GL(dh))" in err
    assert "UNVERIFIED" not in out.read_text()  # only what failed is marked
    assert run("validate", out)[0] == 0
    assert run("check", EXAMPLES / "nanogpt.py", "--spec", out)[0] == 0
    # an existing output needs --force; an input is never an output, even with --force
    assert run("infer", EXAMPLES / "nanogpt.py", "--out", out)[0] == 2
    model_copy = tmp_path / "model.py"
    model_copy.write_text((EXAMPLES / "nanogpt.py").read_text())
    code, _, err = run("infer", model_copy, "--out", model_copy, "--force")
    assert code == 2 and model_copy.read_text() == (EXAMPLES / "nanogpt.py").read_text(), err
    # without --out the spec goes to stdout
    code, text, _ = run("infer", EXAMPLES / "nanogpt.py", "--name", "mine")
    assert code == 0 and loads_spec(text).name == "mine"


def test_cli_json_and_hf_folder(tmp_path: Path) -> None:
    model, _ = ZOO["llama"]()
    folder = tmp_path / "llama"
    model.save_pretrained(folder)
    code, text, err = run("infer", folder, "--json")
    assert code == 0, err
    d = json.loads(text)
    assert d["verified"] and "Heads(H, qk=RoPE(dh), ov=GL(dh), kv=K)" in {s["group"] for s in d["spaces"]}
    assert d["error"] is None and d["out"] is None
    assert loads_spec(d["yaml"]).name == d["name"]


def test_cli_bad_input_and_nothing_verified(tmp_path: Path) -> None:
    assert run("infer", tmp_path / "missing.py")[0] == 2
    f = tmp_path / "opaque.py"
    f.write_text(
        "import torch\n"
        "import tests.test_infer  # registers the op\n"
        "class Wrap(torch.nn.Module):\n"
        "    def __init__(self):\n"
        "        super().__init__()\n"
        "        self.a = torch.nn.Linear(4, 4)\n"
        "    def forward(self, x):\n"
        "        return torch.ops.symspec_test.mystery(self.a(torch.ops.symspec_test.mystery(x)))\n"
        "model = Wrap().eval()\n"
        "def example_inputs(model, batch=2, seed=0):\n"
        "    return (torch.randn(batch, 4, generator=torch.Generator().manual_seed(seed)),)\n"
    )
    out = tmp_path / "s.yaml"
    code, _, err = run("infer", f, "--out", out)
    assert code == 1, err
    assert "no symmetry could be verified" in err and "marked unverified" in err
    assert out.read_text().startswith("# UNVERIFIED: ")  # written, for the user to read, marked


BART = """
import torch, transformers
cfg = transformers.BartConfig(vocab_size=23, d_model=16, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
                              decoder_attention_heads=4, encoder_ffn_dim=12, decoder_ffn_dim=12, max_position_embeddings=32,
                              pad_token_id=1, bos_token_id=0, eos_token_id=2, decoder_start_token_id=2)
torch.manual_seed(0)
model = transformers.BartForConditionalGeneration(cfg).eval()

def example_inputs(model, batch=2, seed=0):
    ids = torch.randint(3, 23, (batch, 8), generator=torch.Generator().manual_seed(seed))
    return {"input_ids": ids, "decoder_input_ids": ids[:, :6], "use_cache": False}
"""


def test_a_draft_that_does_not_fit_is_written_unverified_and_exits_1(tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    # BART's draft did not bind (final_logits_bias, a buffer, was not declared): infer exited
    # 2, wrote nothing, printed nothing with --json, and named a file that did not exist.
    # Buffers are declared now (the control below); the old draft stands for any draft that
    # does not fit
    pytest.importorskip("transformers")
    from symspec.inference.builder import _Builder

    f = tmp_path / "bart.py"
    f.write_text(BART)
    code, _, err = run("infer", f, "--samples", "1")  # the control: today's draft fits and passes
    assert code == 0 and "the spec passes its check" in err, err
    monkeypatch.setattr(_Builder, "buffers_invariant", lambda self, params: None)
    out = tmp_path / "bart.yaml"
    code, stdout, err = run("infer", f, "--out", out, "--samples", "1", "--json")
    assert code == 1, err
    report = json.loads(stdout)
    assert report["verified"] is False and report["out"] == str(out) and report["check"] is None
    assert "final_logits_bias" in report["error"] and "_inferred.yaml" not in report["error"]
    text = out.read_text()
    assert text == report["yaml"] and text.startswith("# UNVERIFIED: ")
    head = text.split("\n#\n", 1)[0]
    assert "final_logits_bias" in head and "neither bound nor declared invariant" in head
    loads_spec(text, "bart.yaml")  # still a spec file (the marks are comments) ...
    code, _, err = run("check", f, "--spec", out, "--samples", "1")
    assert code == 2 and "final_logits_bias" in err  # ... that fails as the header says
    # without --out: the draft on stdout, the problems on stderr
    code, stdout, err = run("infer", f, "--samples", "1")
    assert code == 1 and stdout.startswith("# UNVERIFIED: ") and "could not be checked" in err, err


def test_a_line_that_fails_is_marked_beside_it() -> None:
    from symspec.inference.api import unverified

    text = "symspec: 1\nname: x\nspaces:\n  a: S(4)\n"
    marked = unverified(text, ["the draft:4:3: spaces.a: no"], {4: "spaces.a: no\n more"})
    assert marked.splitlines()[-1] == "  a: S(4)  # FAILS: spaces.a: no more"
    assert marked.startswith("# UNVERIFIED: ") and "#   - the draft:4:3: spaces.a: no" in marked
    import yaml

    assert yaml.safe_load(marked) == yaml.safe_load(text)  # comments only


def test_infer_on_the_guides_phi_model_finds_the_guides_finished_spec() -> None:
    """specs/README.md writes a Phi spec by hand in eight steps; inference finds the same
    spaces and groups on every parameter axis at once."""
    from .test_arch_guide import guide_model, guide_spec

    model, inputs = guide_model()
    result = infer(model, inputs)
    assert result.passed
    assert signature(result.spec, model) == signature(loads_spec(guide_spec(), "phi.yaml"), model)


def test_the_guides_infer_output_is_what_the_command_prints(tmp_path: Path) -> None:
    """specs/README.md quotes `symspec infer phi_model.py --out phi.yaml`: replayed here."""
    from .test_arch_guide import block

    model_file = tmp_path / "phi_model.py"
    model_file.write_text(block("model").replace('SPEC = "phi.yaml"\n', ""))
    code, _, err = run("infer", model_file, "--out", tmp_path / "phi.yaml")
    assert code == 0, err

    def norm(text: str) -> str:  # the terminal's width decides where lines break
        return "".join(text.split())

    assert norm(err) == norm(block("infer").replace("wrote phi.yaml", f"wrote {tmp_path / 'phi.yaml'}"))


def test_a_model_that_cannot_run_in_float64_is_checked_in_float32() -> None:
    """A float32-only kernel (Mixtral's grouped matmul has none in float64): the draft is
    checked in float32 alone, and the notes say so."""

    class Float32Only(Tiny):
        def forward(self, ids: torch.Tensor) -> torch.Tensor:
            if self.head.weight.dtype == torch.float64:
                raise RuntimeError("Expected a Float32 matrix, got Double")
            return super().forward(ids)

    torch.manual_seed(0)
    model = Float32Only().eval()
    symspec.testing.randomize_(model, 0)
    ids = torch.randint(11, (2, 6), generator=torch.Generator().manual_seed(0))
    result = infer(model, ids)
    assert result.passed and _groups(result)["resid"] == "OC(d)"
    assert {r.dtype for r in result.check.rows} == {"float32"}
    assert any("cannot run in float64" in n for n in result.notes)


# -- mixtures of experts ---------------------------------------------------------------------


@pytest.mark.parametrize("implementation", ["batched_mm", "grouped_mm"])
def test_a_mixture_of_experts_is_read_from_its_router_and_its_expert_products(implementation: str) -> None:
    """Mixtral: the router's rows and the expert weights' expert axis are one permutation,
    each expert's units another, seen through views that merge the expert and unit axes,
    and the up half of the fused gate/up weight a scaling: the inferred spec is the
    hand-written one. Both ways transformers runs the experts (a gathered batched matmul;
    a grouped matmul, float32 only) read alike."""
    # the grouped matmul wants rows of a multiple of 16 bytes
    model, inputs = ZOO["mixtral"](experts_implementation=implementation, n_ff=8)
    result = infer(model, inputs)
    assert result.passed, result.check.render()
    assert _groups(result)["moe[i]"] == "Experts(E, S(f))" and _groups(result)["up[i]"] == "D(E * f)"
    assert "view: [[0, 1], 2]" in result.yaml and "moe[i].router" in result.yaml
    assert signature(result.spec, model) == signature(load_spec("mixtral"), model)
    # the comparison can fail: the same spec without the up scaling differs
    no_scaling = variant("mixtral", ('"cat(moe[i], moe[i] @ up[i], heads=E)"', '"cat(moe[i], moe[i], heads=E)"'),
                         ('"moe[i]* @ up[i]*"', '"moe[i]*"'),
                         ("  up[i]:\n    group: D(E * f)\n    doc: scaling of each expert's linear 'up' path (silu(gate) * up is linear in up)\n", ""))
    assert signature(result.spec, model) != signature(no_scaling, model)


def _hash_moe() -> tuple[nn.Module, torch.Tensor]:
    class HashMoE(nn.Module):
        """Experts picked by a hash of the token (no router): a stack of weights indexed by data."""

        def __init__(self, vocab: int = 11, d: int = 8, f: int = 6, n_exp: int = 3) -> None:
            super().__init__()
            self.emb = nn.Embedding(vocab, d)
            self.up = nn.Parameter(torch.randn(n_exp, f, d) / d**0.5)
            self.down = nn.Parameter(torch.randn(n_exp, d, f) / f**0.5)
            self.norm = nn.LayerNorm(d)
            self.head = nn.Linear(d, vocab)
            self.n_exp = n_exp

        def forward(self, ids: torch.Tensor) -> torch.Tensor:
            x = self.emb(ids)
            b, t, d = x.shape
            h = x.reshape(-1, d)
            idx = (ids % self.n_exp).reshape(-1)
            u = torch.bmm(self.up[idx], self.norm(h).unsqueeze(-1)).squeeze(-1)
            y = torch.bmm(self.down[idx], F.gelu(u).unsqueeze(-1)).squeeze(-1)
            return self.head(self.norm(h + y)).reshape(b, t, -1)

    torch.manual_seed(0)
    model = HashMoE().eval()
    symspec.testing.randomize_(model, 0)
    return model, torch.randint(11, (2, 6), generator=torch.Generator().manual_seed(0))


def test_experts_picked_by_data_get_no_expert_permutation() -> None:
    """Negative case: weight stacks indexed by a hash of the tokens are no routed experts.
    Inference declares no expert permutation (a permutation of the units shared by every
    expert is still true, and is found), and a spec that does permute the experts fails
    its check."""
    model, ids = _hash_moe()
    result = infer(model, ids)
    assert result.passed, result.check.render()
    assert not any(g.startswith("Experts") for g in _groups(result).values())
    assert "up: [_, " in result.yaml and "down: [_, " in result.yaml  # the expert axis stays as it is
    wrong = loads_spec("""
symspec: 1
name: hash_moe_as_experts
dims:
  f: shape("up", 1)
  E: shape("up", 0)
spaces: {moe: "Experts(E, S(f))"}
params:
  up: {view: [[0, 1], 2], axes: [moe, _]}
  down: {view: [1, [0, 2]], axes: [_, moe*]}
  emb.weight: invariant
  norm.weight: invariant
  norm.bias: invariant
  head.weight: invariant
  head.bias: invariant
""", "wrong.yaml")
    report = check(model, wrong, ids, samples=2, dtypes=("float64",))
    assert "moe" in {r.space for r in report.failed_rows()}
    assert max(r.max_rel for r in report.failed_rows()) > 1e-3


def test_an_experts_loop_that_cannot_be_exported_says_how_to_load_it() -> None:
    model, inputs = ZOO["mixtral"](experts_implementation="eager")
    with pytest.raises(symspec.inference.InferError, match="experts_implementation"):
        infer(model, inputs)


# -- names and models that cannot give a spec ---------------------------------------------------

#: what YAML reads specially at a scalar's start or inside it
_YAML_SPECIALS = ["'", '"', "#", " #", ": ", ":", "- ", "-", "&a", "*a", "!tag", "!!int ", "%", "@", "`", "|", ">", "{", "}",
                  "[", "]", ",", "?", "null", "~", "true", "no", "0x1F", "1e3", ".inf", "<<", "...", "---", " ", "\t",
                  "\n", "\r", "\x85", "\u2028", "\ufeff", "\x00", "\ud800", "é", "名"]


@pytest.fixture(scope="module")
def tiny_draft() -> Any:
    model, inputs = _tiny()
    return infer(model, inputs, verify=False).draft


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(name=st.lists(st.one_of(st.sampled_from(_YAML_SPECIALS), st.text(max_size=4)), max_size=6).map("".join))
def test_any_name_is_written_so_that_the_spec_reads_it_back(tiny_draft: Any, name: str) -> None:
    # `--name "a: 'b' # c"` once wrote `name: a: 'b' # c`, which does not parse
    from symspec.inference.api import name_problem
    from symspec.inference.render import render

    if name_problem(name) is not None:  # blank, or not printable on one line: refused before anything runs
        with pytest.raises(symspec.inference.InferError, match=r"^spec name: the name must"):
            infer(nn.Linear(2, 2), torch.randn(1, 2), name=name)
        return
    tiny_draft.name = name
    assert loads_spec(render(tiny_draft, ["header"]), "named.yaml").name == name


def test_cli_quotes_the_name_and_refuses_one_that_cannot_be_a_name(tmp_path: Path) -> None:
    out = tmp_path / "named.yaml"
    code, _, err = run("infer", EXAMPLES / "nanogpt.py", "--name", "a: 'b' # c", "--out", out)
    assert code == 0, err
    assert load_spec(out).name == "a: 'b' # c" and run("validate", out)[0] == 0
    for bad, why in (("two\nlines", "printable text on one line"), ("  ", "must not be blank")):
        code, _, err = run("infer", EXAMPLES / "nanogpt.py", "--name", bad, "--out", tmp_path / "bad.yaml")
        assert code == 2 and err.startswith("error: Invalid value for --name: the name ") and why in err, err
        assert len(err.strip().splitlines()) == 1 and not (tmp_path / "bad.yaml").exists()


def test_a_model_without_parameters_is_named_and_nothing_is_written(tmp_path: Path) -> None:
    # it once named a spec file that does not exist: "m_inferred.yaml:3:1: the spec declares no 'params'"
    f = tmp_path / "act.py"
    f.write_text("import torch\n"
                 "class Act(torch.nn.Module):\n"
                 "    def forward(self, x):\n"
                 "        return torch.relu(x) * 2\n"
                 "model = Act()\n"
                 "def example_inputs(model, batch=2, seed=0):\n"
                 "    return (torch.randn(batch, 4),)\n")
    out = tmp_path / "act.yaml"
    code, _, err = run("infer", f, "--out", out)
    assert code == 2, err
    assert err.strip() == (f"error: {f}: the model (Act) has no parameters: there are no weight symmetries to infer, "
                           "and no spec to write")
    assert not out.exists() and sorted(p.name for p in tmp_path.iterdir()) == ["act.py"]
    # the control: with a parameter, the same file gives a spec (under another name: files are imported once)
    f = f.rename(tmp_path / "act2.py")
    f.write_text(f.read_text().replace("return torch.relu(x) * 2", "return self.fc2(torch.relu(self.fc1(x)))")
                 .replace("class Act(torch.nn.Module):\n",
                          "class Act(torch.nn.Module):\n"
                          "    def __init__(self):\n"
                          "        super().__init__()\n"
                          "        self.fc1, self.fc2 = torch.nn.Linear(4, 6), torch.nn.Linear(6, 4)\n"))
    code, _, err = run("infer", f, "--out", out)
    assert code == 0 and out.exists(), err


def test_a_space_no_binding_carries_is_left_out_and_said(monkeypatch: pytest.MonkeyPatch) -> None:
    # Falcon's new decoder layout (GQA in one fused projection) was once read as heads no
    # parameter's binding carried: the draft declared 'attn[i]: Heads(...)' and its check
    # passed without a row for it. Inference reads that layout now; a layout it does not
    # read is simulated here by describing no axis with the heads. A spec refuses such a
    # space, so inference leaves it out and says why
    pytest.importorskip("transformers")
    from symspec.inference.draft_bindings import Bindings

    from .infer_zoo import _hf

    describe = Bindings.describe

    def unread(self: Any, atom: int, dual: bool, absval: bool = False) -> Any:
        got = describe(self, atom, dual, absval)
        return None if got is not None and any(t.space == "attn" for c in got.segments for t in c.terms) else got

    monkeypatch.setattr(Bindings, "describe", unread)
    model, inputs = _hf("FalconForCausalLM", "FalconConfig", new_decoder_architecture=True, num_kv_heads=2,
                        num_attention_heads=4, hidden_size=16)(0)
    result = infer(model, inputs, samples=1)
    assert result.verified, result.yaml
    assert "attn" not in {s.name.split("[")[0] for s in result.spaces}
    why = dict(result.unexplained)
    assert "no parameter's binding carries it" in why.get("attn[i]", ""), result.unexplained
    assert {r.space for r in result.check.rows} >= {"resid", "mlp[*]"}
    assert "no parameter's binding carries it" in result.yaml  # in the header, for the reader


@pytest.mark.parametrize(("heads", "kv", "binding"), [
    (4, 2, "cat(attn[i].qk, attn[i].qk.kv*, attn[i].ov.kv, heads=K)"),
    (8, 2, "cat(attn[i].qk, attn[i].qk.kv*, attn[i].ov.kv, heads=K)"),
    (4, 1, "cat(attn[i].qk, attn[i].qk.kv*, attn[i].ov.kv)"),  # one group: the layouts coincide
    (4, 4, "cat(attn[i].qk, attn[i].qk*, attn[i].ov, heads=H)"),  # a group per head: GPT-NeoX's layout
], ids=["gqa", "gqa-4-per-group", "one-group", "group-per-head"])
def test_falcon_s_grouped_fused_heads_are_read_per_group(heads: int, kv: int, binding: str) -> None:
    """Falcon's new layout stores [g0: q.. k v][g1: q.. k v]...: the draft binds the
    fused rows per key/value group, and the check passes; stored one part after the
    other (the layout without heads=, the negative case) the heads' row fails."""
    pytest.importorskip("transformers")
    from .infer_zoo import _hf

    model, inputs = _hf("FalconForCausalLM", "FalconConfig", new_decoder_architecture=True, num_kv_heads=kv,
                        num_attention_heads=heads, hidden_size=4 * heads, alibi=False, intermediate_size=None,
                        ffn_hidden_size=12)(0)
    result = infer(model, inputs, samples=1)
    assert result.verified and result.passed, result.yaml
    assert f"query_key_value.weight: ['{binding}', resid*]" in result.yaml, result.yaml
    groups = _groups(result)
    assert groups["attn[i]"] == ("Heads(H, qk=RoPE(dh), ov=GL(dh), kv=K)" if kv < heads else "Heads(H, qk=RoPE(dh), ov=GL(dh))")
    if kv in (1, heads):
        return
    flat = result.yaml.replace(binding, binding.replace(", heads=K", ""))
    report = check(model, loads_spec(flat, "flat.yaml"), inputs, samples=2, dtypes=("float64",))
    assert "attn[*]" in {r.space for r in report.failed_rows()}, report.render()


CONVNEXT = """
import torch, timm
torch.manual_seed(0)
model = timm.create_model("convnext_atto", pretrained=False, num_classes=5, dims=(8, 16, 32, 64), depths=(1, 1, 1, 1)).eval()

def example_inputs(model, batch=2, seed=0):
    return (torch.randn(batch, 3, 32, 32, generator=torch.Generator().manual_seed(seed)),)
"""


def test_a_model_inference_does_not_cover_is_one_line_and_nothing_written(tmp_path: Path) -> None:
    # ConvNeXt: 42 lines of contradicting shapes before; now one line, exit 2, nothing written
    pytest.importorskip("timm")
    f = tmp_path / "convnext.py"
    f.write_text(CONVNEXT)
    out = tmp_path / "cn.yaml"
    code, out_text, err = run("infer", f, "--out", out, "--samples", "1")
    assert code == 2 and len(err.strip().splitlines()) == 1 and err.startswith("error: ") and not out_text, err
    assert "ConvNeXt has no attention" in err and "4 widths (8, 16, 32, 64)" in err and not out.exists()


class _NormedMLP(nn.Module):
    """No attention, one width: inference covers it (the control of the refusal above)."""

    def __init__(self) -> None:
        super().__init__()
        self.norms = nn.ModuleList(nn.LayerNorm(6) for _ in range(2))
        self.ups = nn.ModuleList(nn.Linear(6, 10) for _ in range(2))
        self.downs = nn.ModuleList(nn.Linear(10, 6) for _ in range(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for norm, up, down in zip(self.norms, self.ups, self.downs):
            x = x + down(F.relu(up(norm(x))))
        return x


def test_no_attention_with_one_width_is_still_inferred() -> None:
    torch.manual_seed(0)
    result = infer(_NormedMLP().eval(), (torch.randn(3, 6),), samples=1)
    assert result.verified and result.spaces, result.yaml


def _encoder_decoder(name: str) -> torch.nn.Module:
    """A tiny encoder-decoder of two layers a stack (T5 keeps its relative position bias in
    the first layer of each: one layer hid that its spaces were numbered by order in a layer)."""
    import transformers

    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if name == "t5":
            cfg = transformers.T5Config(vocab_size=23, d_model=16, d_kv=4, d_ff=12, num_layers=2, num_decoder_layers=2,
                                        num_heads=4, relative_attention_num_buckets=8, decoder_start_token_id=0,
                                        pad_token_id=0, eos_token_id=1)
            return transformers.T5ForConditionalGeneration(cfg).eval()
        if name == "bart":
            cfg = transformers.BartConfig(vocab_size=23, d_model=16, encoder_layers=2, decoder_layers=2,
                                          encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=12,
                                          decoder_ffn_dim=12, max_position_embeddings=32, pad_token_id=1, bos_token_id=0,
                                          eos_token_id=2, decoder_start_token_id=2)
            return transformers.BartForConditionalGeneration(cfg).eval()
        cfg = transformers.WhisperConfig(vocab_size=23, d_model=16, encoder_layers=2, decoder_layers=2,
                                         encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=12,
                                         decoder_ffn_dim=12, num_mel_bins=8, max_source_positions=8, max_target_positions=16,
                                         pad_token_id=1, bos_token_id=0, eos_token_id=2, decoder_start_token_id=2,
                                         suppress_tokens=None, begin_suppress_tokens=None)
        return transformers.WhisperForConditionalGeneration(cfg).eval()


@pytest.mark.parametrize("name", ["t5", "bart", "whisper"])
def test_encoder_decoder_folders_get_inputs_from_their_config(name: str, tmp_path: Path) -> None:
    # T5's folder failed before anything was traced: 'You must specify exactly one of input_ids
    # or inputs_embeds' (the decoder had no ids); Whisper's main input is audio features
    pytest.importorskip("transformers")
    from symspec.loading.hf import hf_example_inputs

    model = _encoder_decoder(name)
    inputs = hf_example_inputs(model)
    assert "decoder_input_ids" in inputs and inputs["use_cache"] is False
    if name == "whisper":
        assert inputs["input_features"].shape == (2, 8, 16)  # num_mel_bins, 2 x max_source_positions
    model.save_pretrained(tmp_path / name)
    code, stdout, err = run("infer", tmp_path / name, "--samples", "1", "--json")
    assert code == 0, err
    report = json.loads(stdout)
    groups = {s["name"]: s["group"] for s in report["spaces"]}
    assert any(g.startswith("Heads(") for g in groups.values()), groups  # cross-attention heads at least
    assert not [n for n in report["notes"] if "could not read a node" in n]  # T5's min(buckets, other) is read
    spec = loads_spec(report["yaml"])
    # read against the logits (the encoder's last hidden state moves with the stream): the
    # streams of T5 and BART carry their groups (Whisper's encoder is read through conv1d)
    assert spec.outputs == ("logits",)
    if name in ("t5", "bart"):
        assert groups.get("resid") in ("SP(d)", "S(d)"), groups
    if name == "bart":  # the head is one tensor with the shared embedding and both stacks'
        assert not any(st.kind == "untie" for st in spec.canonicalize), report["yaml"]
    if name == "t5":  # one tensor shared four ways is one tie, not three pairs
        assert [set(t.params) for t in spec.ties] == [{"shared.weight", "encoder.embed_tokens.weight",
                                                       "decoder.embed_tokens.weight", "lm_head.weight"}]
        # its self-attention heads share one relative position bias table per stack: moving
        # a head fails the check (the history says so), per-head maps in place hold
        selfs = [n for n, g in groups.items() if g == "Heads(H, qk=GL(dh), ov=GL(dh), perm=False)"]
        assert len(selfs) == 2, groups
        assert "Heads(H, qk=Id(dh), ov=Id(dh)) failed the check" in report["yaml"]


@pytest.mark.parametrize("name", ["t5", "bart", "whisper", "bloom", "falcon_grouped"])
def test_an_inferred_encoder_decoder_spec_recovers_a_planted_copy(name: str, tmp_path: Path) -> None:
    """The inferred spec is one that matching can use: B = g.A planted with it, saved as
    a folder, is found again by `symspec match` to float32 precision (Bloom: ALiBi's heads
    kept in place, with their QK and OV maps)."""
    pytest.importorskip("transformers")
    from safetensors.torch import load_file

    from symspec.transforms import canonicalize_state_dict

    model = NEW[name][0]()[0] if name in NEW else _encoder_decoder(name)
    model.save_pretrained(tmp_path / "a")
    code, _, err = run("infer", tmp_path / "a", "--samples", "1", "--out", tmp_path / "spec.yaml")
    assert code == 0, err
    spec = symspec.spec.load_spec(str(tmp_path / "spec.yaml"))
    planted = symspec.plant(model, spec, seed=2)
    planted.model.save_pretrained(tmp_path / "b")
    code, _, err = run("match", tmp_path / "a", tmp_path / "b", "--spec", tmp_path / "spec.yaml",
                       "--out", tmp_path / "out")
    assert code == 0, err
    bound = symspec.bind(spec, model)
    ca = canonicalize_state_dict(bound, {k: v.detach() for k, v in model.state_dict().items()})
    num = den = moved = 0.0
    b0 = planted.model.state_dict()
    for shard in sorted((tmp_path / "out").glob("*.safetensors")):
        for k, v in load_file(shard).items():
            if k in bound.problem.params:
                ref = ca[k].double()
                num += float((v.double() - ref).square().sum())
                den += float(ref.square().sum())
                moved += float((b0[k].double() - ref).square().sum())
    assert den > 0 and moved / den > 1e-4, "the planted copy did not move"  # the negative: B differs from A
    assert (num / den) ** 0.5 <= 1e-5, (num / den) ** 0.5


@pytest.mark.parametrize("name", ["t5", "bart", "whisper"])
def test_the_built_in_encoder_decoder_specs_recover_a_planted_copy_through_the_cli(name: str, tmp_path: Path) -> None:
    """Where inference leaves the residual invariant (the encoder's hidden state is an
    output), the built-in specs (``outputs: [logits]``) align it too: B = g.A planted with
    every space, saved as a folder, is found again by `symspec match` (no --spec: picked
    by the class) to float32 precision, and the written model computes B's logits."""
    pytest.importorskip("transformers")
    from safetensors.torch import load_file

    from symspec.transforms import canonicalize_state_dict

    model, inputs = ZOO[name]()
    model.save_pretrained(tmp_path / "a")
    spec = load_spec(name)
    planted = symspec.plant(model, spec, seed=2)
    planted.model.save_pretrained(tmp_path / "b")
    code, out, err = run("match", tmp_path / "a", tmp_path / "b", "--out", tmp_path / "out", "--json")
    assert code == 0, err
    assert json.loads(out)["spec"] == name
    bound = symspec.bind(spec, model)
    ca = canonicalize_state_dict(bound, {k: v.detach() for k, v in model.state_dict().items()})
    got = {k: v for shard in sorted((tmp_path / "out").glob("model*.safetensors")) for k, v in load_file(shard).items()}
    num = den = moved = 0.0
    b0 = planted.model.state_dict()
    for k in bound.problem.params:
        if k in got:
            ref = ca[k].double()
            num += float((got[k].double() - ref).square().sum())
            den += float(ref.square().sum())
            moved += float((b0[k].double() - ref).square().sum())
    assert "xattn[0]" in planted.elements and moved / den > 1e-4  # the negative: B differs from A
    assert (num / den) ** 0.5 <= 1e-5, (num / den) ** 0.5
    import transformers

    auto = transformers.AutoModelForSpeechSeq2Seq if name == "whisper" else transformers.AutoModelForSeq2SeqLM
    written = auto.from_pretrained(tmp_path / "out").eval()
    with torch.no_grad():
        want = planted.model.eval()(**inputs).logits
        torch.testing.assert_close(written(**inputs).logits, want, rtol=1e-4, atol=1e-5)


def test_a_model_returning_hidden_states_gets_outputs_logits() -> None:
    """A model that returns its hidden states beside its logits (in the residual stream's
    basis, which a residual map moves): the draft is read against the logits alone and
    says so (``outputs: [logits]``), keeping the residual's rotation; the same draft
    without that line fails the check (the hidden states move: the negative case). A
    model returning its logits alone gets no such line."""
    import attrs

    model, inputs = ZOO["llama"](n_layer=2)
    plain = infer(model, inputs)
    assert plain.passed and plain.spec.outputs == () and "outputs:" not in plain.yaml
    model.config.output_hidden_states = True
    result = infer(model, inputs)
    assert result.passed, result.check.render()
    assert result.spec.outputs == ("logits",) and "outputs: [logits]" in result.yaml
    assert {s.name: s.group for s in result.spaces} == {s.name: s.group for s in plain.spaces}
    assert {s.name: s.group for s in result.spaces}["resid"] == "O(d)"
    assert loads_spec(result.yaml, "again.yaml").outputs == ("logits",)
    assert not check(model, attrs.evolve(result.spec, outputs=()), inputs).passed
    assert check(model, result.spec, inputs, samples=3, seed=7).passed


def test_a_rebuilt_draft_keeps_its_notes_and_says_why() -> None:
    """BERT's head norm after a GELU carries the residual's sign: folded, the sign fails
    the check, and the draft is built again without folds. The result keeps the sign and
    says why the folds went (the note survives the rebuild); without the rebuild the sign
    would be lost (the hand-written spec has it)."""
    model, inputs = FAMILIES["bert"]()
    result = infer(model, inputs)
    assert _groups(result).get("sgn") == "Sign(d)"
    assert not any(st.kind == "fold_norm" for st in result.spec.canonicalize)
    assert any("carry the residual's sign" in n and "max rel err" in n for n in result.notes), result.notes


@pytest.mark.parametrize("name", ["swin_one_stage", "swin", "clip_text", "deit_distilled"])
def test_an_inferred_vision_or_pooled_spec_recovers_a_planted_copy(name: str) -> None:
    """Models with no folder to save (timm, a wrapper module): B = g.A planted with the
    inferred spec is found again by weight matching to float32 precision."""
    build, _ = NEW[name]
    model, inputs = build()
    result = infer(model, inputs, samples=1)
    assert result.verified, result.yaml
    spec = loads_spec(result.yaml, "inferred.yaml")
    planted = symspec.plant(model, spec, seed=2)
    res = symspec.align(model, planted.model, spec, method="weight")
    num = den = moved = 0.0
    for k, ref in res.canonical_a.items():
        if not ref.is_floating_point():
            continue
        num += float((res.aligned_b[k].double() - ref.double()).square().sum())
        den += float(ref.double().square().sum())
        moved += float((res.canonical_b[k].double() - ref.double()).square().sum())
    assert den > 0 and moved / den > 1e-4, "the planted copy did not move"  # the negative: B differs from A
    assert (num / den) ** 0.5 <= 1e-5, (num / den) ** 0.5


def test_swin_s_bias_tables_move_with_their_heads() -> None:
    """Each Swin block's relative position bias table has a column per head: bound as a
    part of the head group (pos=Id(1)) it moves with the head permutation and the check
    passes; left in place (the negative case) moving a head fails the check."""
    pytest.importorskip("timm")
    model, inputs = NEW["swin_one_stage"][0]()
    result = infer(model, inputs, samples=1)
    assert result.verified, result.yaml
    assert "relative_position_bias_table: [_, 'attn[i].pos']" in result.yaml, result.yaml
    pinned = (result.yaml.replace("[_, 'attn[i].pos']", "invariant").replace("[_, 'attn2[i].pos']", "invariant")
              .replace(", pos=Id(1))", ")"))
    report = check(model, loads_spec(pinned, "pinned.yaml"), inputs, samples=2, dtypes=("float64",))
    assert "attn[*]" in {r.space for r in report.failed_rows()}, report.render()
