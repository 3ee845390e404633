"""Real architectures: every built-in spec checks against its model family (Hugging Face
and timm models built from small configs with random weights), in float64 and float32,
and a group that is too large is caught for every family."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import symspec
from symspec.binding import bind
from symspec.checker import canonicalize_inplace, check, copy_as
from symspec.errors import BindError
from symspec.spec import loads_spec
from symspec.spec.builtin import builtin_names
from symspec.testing import assert_invariant, assert_not_invariant
from symspec.transforms import canonicalize_model
from tests.zoo import ZOO, variant

FAMILIES = ["gpt2", "llama", "llama_tied", "qwen2", "opt", "bert", "hf_vit", "timm_vit", "gemma", "gpt_neox"]


def failed(report: symspec.CheckReport) -> set[str]:
    return {r.space for r in report.failed_rows()}


def test_every_builtin_spec_has_a_zoo_model() -> None:
    assert set(builtin_names()) <= set(ZOO)
    assert set(FAMILIES) <= set(builtin_names())


@pytest.mark.parametrize("name", builtin_names())
def test_builtin_spec_preserves_its_family_in_float64_and_float32(name: str) -> None:
    model, inputs = ZOO[name]()
    spec = symspec.load_spec(name)
    report = assert_invariant(model, spec, inputs)
    # every declared space has its rows, and the documented tolerances hold with room
    rows = {(r.space.removesuffix("[*]"), r.dtype): r for r in report.rows}
    for s in spec.spaces:
        assert (s.name, "float64") in rows and (s.name, "float32") in rows
    assert max(r.max_rel for r in report.rows if r.dtype == "float64") < 1e-12
    assert max(r.max_rel for r in report.rows if r.dtype == "float32") < 1e-5
    # the symmetries really moved the weights (a check of the identity would pass too);
    # a global sign flip is exact in floating point, so its rows may show exactly 0
    assert all(r.max_abs > 0 for r in report.rows if r.dtype == "float64" and r.space != "canonicalize" and not r.group.startswith("Sign("))


# -- too-large groups are caught, per family --------------------------------------------------

NEGATIVE = {
    "gpt2": ([("group: OC(d)", "group: O(d)")], {"resid"}),  # moves the all-ones direction LayerNorm removes
    "llama": ([("qk=RoPE(dh)", "qk=GL(dh)")], {"attn[*]"}),  # a general map does not commute with the rotations
    "llama_tied": ([("group: SP(d)", "group: O(d)")], {"resid"}),  # unfolded gains commute only with signed perms
    "qwen2": ([("group: S(f)", "group: GL(f)")], {"mlp[*]"}),  # silu is not linear
    "opt": ([("group: Dpos(f)", "group: D(f)")], {"scale[*]"}),  # relu(-z) != -relu(z)
    "bert": ([("group: S(d)", "group: O(d)")], {"resid"}),  # post-LN: no rotation commutes with every LayerNorm gain
    "hf_vit": ([("group: S(f)", "group: D(f)")], {"ff[*]"}),  # gelu is not homogeneous
    "timm_vit": ([("group: OC(d)", "group: O(d)")], {"resid"}),
    "nanogpt": ([("group: S(f)", "group: O(f)")], {"ff[*]"}),  # gelu does not commute with rotations
    "vit": ([("resid: OC(d)", "resid: O(d)")], {"resid"}),
    "gemma": ([("qk=RoPE(dh)", "qk=GL(dh)")], {"attn[*]"}),
    "gpt_neox": ([("group: OC(d)", "group: O(d)")], {"resid"}),
    "mixtral": ([("Experts(E, S(f))", "Experts(E, O(f))")], {"moe[*]"}),  # silu does not commute with rotations
    "bart": ([("group: S(d)", "group: O(d)")], {"resid"}),  # post-LN, as bert
    # a GELU on the encoder stream's every feature: a sign flip does not commute with it
    # a gate's GELU is not homogeneous: its units cannot scale
    "t5_gated": ([("group: S(f)\n    doc: the encoder's gated", "group: D(f)\n    doc: the encoder's gated")],
                 {"mlp[*]"}),
    "whisper": ([("group: S(d)\n    doc: the encoder's residual", "group: SP(d)\n    doc: the encoder's residual")],
                {"eresid"}),
    # a self-attention head moved without its relative position bias column
    "t5": ([("group: Heads(H, qk=GL(dh), ov=GL(dh), perm=False)\n    doc: encoder",
             "group: Heads(H, qk=GL(dh), ov=GL(dh))\n    doc: encoder")], {"attn[*]"}),
}


def test_every_builtin_spec_has_a_negative_case() -> None:
    assert set(NEGATIVE) == set(builtin_names())


@pytest.mark.parametrize("name", sorted(NEGATIVE))
def test_a_too_large_group_is_caught(name: str) -> None:
    model, inputs = ZOO[name]()
    replacements, expected = NEGATIVE[name]
    spec = variant(name, *replacements)
    report = assert_not_invariant(model, spec, inputs, dtypes=("float64",))
    assert expected <= failed(report) <= expected | {"all"}
    worst = max(r.max_rel for r in report.failed_rows())
    assert worst > 1e-4  # a wrong symmetry breaks the function, it does not nudge it


@pytest.mark.parametrize("whole", [False, True])
def test_t5_residual_holds_only_on_the_logits_and_with_the_encoder_norm_folded_everywhere(whole: bool) -> None:
    """T5 returns the encoder's last hidden state beside the logits: a residual map moves
    it, so the spec compares the logits alone (``outputs: [logits]``); and the encoder's
    final norm is read by the keys and values of every cross-attention: its gain is
    folded into all of them (one gain, a reader in every block). Each removed is caught."""
    model, inputs = ZOO["t5"]()
    spec = symspec.load_spec("t5")
    assert spec.outputs == ("logits",)
    report = check(model, spec, inputs, dtypes=["float64"], samples=1, whole=whole)
    assert not failed(report) and {r.space for r in report.rows} >= {"resid", "xattn[*]"}
    every_output = variant("t5", ("outputs: [logits]\n", ""))  # the folded final norm changes that state too
    assert failed(check(model, every_output, inputs, dtypes=["float64"], samples=1, whole=whole)) == {"canonicalize", "resid", "all"}
    fold = ("  - fold_norm:\n      gain: encoder.final_layer_norm.weight\n      into:\n"
            '        - {weight: "decoder.block.{i}.layer.1.EncDecAttention.k.weight", axis: 1}\n'
            '        - {weight: "decoder.block.{i}.layer.1.EncDecAttention.v.weight", axis: 1}\n')
    unfolded = variant("t5", (fold, ""))
    assert failed(check(model, unfolded, inputs, dtypes=["float64"], samples=1, whole=whole)) == {"resid", "all"}
    # an output the model does not return: one line naming those it does
    wrong = variant("t5", ("outputs: [logits]", "outputs: [logits, scores]"))
    with pytest.raises(symspec.SymspecInputError, match=r"outputs name scores, which the model does not return "
                                                        r"\(it returns logits, encoder_last_hidden_state"):
        check(model, wrong, inputs, dtypes=["float64"], samples=1, whole=whole)


def test_bert_surviving_group_is_exactly_permutations_times_a_global_sign() -> None:
    model, inputs = ZOO["bert"]()
    assert_invariant(model, "bert", inputs, dtypes=("float64",))
    # a per-dimension sign does not commute with LayerNorm's centring
    per_dim = variant("bert", ("group: S(d)", "group: SP(d)"))
    assert failed(assert_not_invariant(model, per_dim, inputs, dtypes=("float64",))) >= {"resid"}
    # the encoder's gains must not flip with the sign (LN(-y) = -LN(y) keeps them) ...
    gains_flip = variant("bert", ("bert.embeddings.LayerNorm.weight: [abs(resid)]", "bert.embeddings.LayerNorm.weight: [sgn @ abs(resid)]"))
    assert failed(assert_not_invariant(model, gains_flip, inputs, dtypes=("float64",))) == {"sgn", "all"}
    # ... but the MLM head's must: gelu sits between the sign and that LayerNorm
    head_keeps = variant("bert", ("cls.predictions.transform.LayerNorm.weight: [sgn @ abs(resid)]", "cls.predictions.transform.LayerNorm.weight: [abs(resid)]"))
    assert failed(assert_not_invariant(model, head_keeps, inputs, dtypes=("float64",))) == {"sgn", "all"}
    head_dense = variant("bert", ("cls.predictions.transform.dense.weight: [resid, sgn* @ resid*]", "cls.predictions.transform.dense.weight: [sgn @ resid, sgn* @ resid*]"),
                         ("cls.predictions.transform.dense.bias: [resid]", "cls.predictions.transform.dense.bias: [sgn @ resid]"))
    assert failed(assert_not_invariant(model, head_dense, inputs, dtypes=("float64",))) == {"sgn", "all"}


def test_bert_global_scale_breaks_only_through_the_tie() -> None:
    # A positive global scale of the residual is a symmetry of the encoder (LayerNorm
    # gains absorb it) but the tied decoder would need 1/c where the embeddings need c:
    # with D(d) the binder refuses the tie instead of silently untying it.
    model, _ = ZOO["bert"]()
    spec = variant("bert", ("group: Sign(d)", "group: D(d)"))
    with pytest.raises(BindError, match=r"need different transforms under .*the group would untie them"):
        bind(spec, model)


@settings(max_examples=6, deadline=None)
@given(st.sampled_from([(4, 1), (4, 2), (4, 4), (6, 3)]), st.sampled_from([2, 4]), st.booleans(), st.integers(0, 2**16))
def test_llama_gqa_shapes_and_ties(heads: tuple[int, int], head_dim: int, tie: bool, seed: int) -> None:
    n_head, n_kv = heads
    model, inputs = ZOO["llama"](seed=seed, n_head=n_head, n_kv=n_kv, head_dim=head_dim, tie=tie)
    report = check(model, symspec.load_spec("llama"), inputs, samples=1, seed=seed, dtypes=("float64",))
    assert report.passed, report.render()
    assert max(r.max_rel for r in report.rows) < 1e-12


@settings(max_examples=4, deadline=None)
@given(st.sampled_from([(4, 1), (4, 2), (2, 2)]), st.integers(0, 2**16))
def test_qwen2_biases_with_gqa(heads: tuple[int, int], seed: int) -> None:
    model, inputs = ZOO["qwen2"](seed=seed, n_head=heads[0], n_kv=heads[1])
    report = check(model, symspec.load_spec("qwen2"), inputs, samples=1, seed=seed, dtypes=("float64",))
    assert report.passed, report.render()


def test_qwen2_key_bias_must_use_the_dual_view() -> None:
    model, inputs = ZOO["qwen2"]()
    spec = variant("qwen2", ('k_proj.bias: ["attn[i].qk.kv*"]', 'k_proj.bias: ["attn[i].qk.kv"]'))
    assert failed(assert_not_invariant(model, spec, inputs, dtypes=("float64",))) == {"attn[*]", "all"}


def test_swiglu_scaling_must_reach_down_proj_and_not_gate() -> None:
    model, inputs = ZOO["llama"]()
    no_undo = variant("llama", ('down_proj.weight: [resid, "mlp[i]* @ up[i]*"]', 'down_proj.weight: [resid, "mlp[i]*"]'))
    assert failed(assert_not_invariant(model, no_undo, inputs, dtypes=("float64",))) == {"up[*]", "all"}
    gate_too = variant("llama", ('gate_proj.weight: ["mlp[i]", resid*]', 'gate_proj.weight: ["mlp[i] @ up[i]", resid*]'))
    assert failed(assert_not_invariant(model, gate_too, inputs, dtypes=("float64",))) == {"up[*]", "all"}


def test_gpt2_conv1d_axes_are_input_first() -> None:
    # binding c_fc like an nn.Linear ([out, in]) contradicts Conv1D's [in, out] shapes
    model, _ = ZOO["gpt2"]()
    spec = variant("gpt2", ('transformer.h.{i}.mlp.c_fc.weight: [resid*, "ff[i]"]', 'transformer.h.{i}.mlp.c_fc.weight: ["ff[i]", resid*]'))
    with pytest.raises(BindError, match=r"mlp\.c_fc\.weight: axis 0 has size 8, but 'ff\[i\]' \(ff\[0\]: S\(32\)\) expects 32"):
        bind(spec, model)


# -- tied embeddings -------------------------------------------------------------------------

def test_tied_llama_is_untied_explicitly_by_llama_and_kept_by_llama_tied() -> None:
    model, inputs = ZOO["llama_tied"]()
    assert model.lm_head.weight is model.model.embed_tokens.weight
    bound = bind(symspec.load_spec("llama"), model)
    canon = canonicalize_model(bound, model)
    assert canon.lm_head.weight is not canon.model.embed_tokens.weight
    assert canon.config.tie_word_embeddings is False and model.config.tie_word_embeddings is True
    assert_invariant(model, "llama", inputs)
    kept = bind(symspec.load_spec("llama_tied"), model)
    assert kept.problem.ties == (("model.embed_tokens.weight", "lm_head.weight"),)
    assert_invariant(model, "llama_tied", inputs)
    assert model.lm_head.weight is model.model.embed_tokens.weight  # check() never touches the model


def test_tie_conflicts_are_refused_with_the_reason() -> None:
    model, _ = ZOO["llama_tied"]()
    with pytest.raises(BindError) as info:
        bind(variant("llama_tied", ("group: SP(d)", "group: D(d)")), model)
    (msg,) = [str(d) for d in info.value.diagnostics]
    assert "tied parameters model.embed_tokens.weight (resid) and lm_head.weight (resid*) need different transforms under D(" in msg
    assert "declare '- untie: lm_head.weight' under canonicalize" in msg
    with pytest.raises(BindError) as info:
        bind(variant("llama", ("  - untie: lm_head.weight\n", "")), model)
    (msg,) = [str(d) for d in info.value.diagnostics]
    assert "fold_norm changes lm_head.weight, which is tied to model.embed_tokens.weight; that would untie them" in msg
    assert "declare '- untie: lm_head.weight' before this step" in msg
    untied, _ = ZOO["llama"]()
    with pytest.raises(BindError, match="declared tied, but LlamaForCausalLM stores them separately"):
        bind(symspec.load_spec("llama_tied"), untied)


# -- float64 that is float64 -------------------------------------------------------------------

def test_hf_rmsnorm_float32_casts_are_kept_in_float64_and_reported() -> None:
    model, inputs = ZOO["llama"](attn_implementation="eager")
    report = check(model, symspec.load_spec("llama"), inputs, samples=1, dtypes=("float64",))
    assert report.passed and max(r.max_rel for r in report.rows) < 1e-12
    (note,) = [n for n in report.notes if n.startswith("float64:")]
    assert "LlamaRMSNorm.forward" in note and "eager_attention_forward" in note and "kept those casts in float64" in note
    # without the fix the same check only reaches the model's own float32 rounding ...
    plain = check(model, symspec.load_spec("llama"), inputs, samples=1, dtypes=("float64",), exact64=False, rtol={"float32": 1.0})
    assert next(r for r in plain.rows if r.space == "resid").max_rel > 1e-9
    # ... and, told to only detect, check says so and uses the float32 tolerance
    detected = check(model, symspec.load_spec("llama"), inputs, samples=1, dtypes=("float64",), exact64=False)
    assert detected.passed and {r.rtol for r in detected.rows} == {1e-4}
    assert any("computes parts in float32" in n for n in detected.notes)
    # models without such casts get no note
    gpt, x = ZOO["gpt2"]()
    assert not [n for n in check(gpt, symspec.load_spec("gpt2"), x, samples=1).notes if n.startswith("float64:")]


def test_check_leaves_the_model_alone() -> None:
    model, inputs = ZOO["gpt2"]()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    check(model, symspec.load_spec("gpt2"), inputs, samples=1)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert model.lm_head.weight is model.transformer.wte.weight
    assert model.config.tie_word_embeddings is True


@pytest.mark.parametrize(("name", "family"), [("gpt2", "gpt2"), ("llama", "llama_tied"), ("opt", "opt"), ("hf_vit", "hf_vit")])
def test_in_place_canonicalisation_equals_canonicalize_model(name: str, family: str) -> None:
    model, _ = ZOO[family]()
    bound = bind(symspec.load_spec(name), model)
    expected = canonicalize_model(bound, model.double())
    work = copy_as(model, torch.float64)
    canonicalize_inplace(bound, work)
    got = work.state_dict()
    assert set(got) == set(expected.state_dict())
    for k, v in expected.state_dict().items():
        assert torch.equal(got[k], v), k
    moved = [k for k, v in got.items() if not torch.equal(v, model.state_dict()[k])]
    assert moved  # the canonicalisation did something


def test_partial_rotary_needs_the_matching_rope_group() -> None:
    # Phi rotates only the first rot dims of each head: RoPE(dh, rot=r) (GL on the rest)
    # holds, the full-rotary commutant RoPE(dh) pairs rotated with unrotated dims and fails.
    from tests.test_arch_guide import guide_model, guide_spec

    model, inputs = guide_model()
    text = guide_spec()
    assert "qk=RoPE(dh, rot=r)" in text
    assert_invariant(model, loads_spec(text, "phi.yaml"), inputs)
    full = loads_spec(text.replace("qk=RoPE(dh, rot=r)", "qk=RoPE(dh)"), "phi-full-rotary.yaml")
    assert failed(assert_not_invariant(model, full, inputs, dtypes=("float64",))) == {"attn[*]", "all"}


def test_mistral_binds_the_llama_spec() -> None:
    import transformers

    torch.manual_seed(0)
    cfg = transformers.MistralConfig(num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, hidden_size=16, intermediate_size=12,
                                     vocab_size=23, max_position_embeddings=32, sliding_window=4, bos_token_id=0, eos_token_id=0)
    from symspec.testing import randomize_

    model = randomize_(transformers.MistralForCausalLM(cfg)).eval()
    inputs = {"input_ids": torch.randint(23, (2, 8), generator=torch.Generator().manual_seed(0)), "use_cache": False}
    assert "MistralForCausalLM" in symspec.load_spec("llama").models
    assert_invariant(model, "llama", inputs)
    assert failed(assert_not_invariant(model, variant("llama", ("qk=RoPE(dh)", "qk=GL(dh)")), inputs, dtypes=("float64",))) == {"attn[*]", "all"}


@pytest.mark.parametrize(("old", "new", "space"), [
    ("group: S(d)\n    doc: the GELU channels", "group: SP(d)\n    doc: the GELU channels", "conv"),
    ("group: OC(d)", "group: O(d)", "dresid"),  # the decoder's LayerNorms remove the all-ones direction
    ("outputs: [logits]\n", "", "eresid"),  # the encoder's last hidden state moves with its stream
])
def test_whisper_s_next_larger_groups_fail(old: str, new: str, space: str) -> None:
    """Whisper's two streams: the encoder's carries a permutation only (a GELU on conv2's
    output), the decoder's a rotation of the centred subspace; each next larger group,
    and the check without ``outputs``, fails where it should."""
    model, inputs = ZOO["whisper"]()
    assert not failed(check(model, symspec.load_spec("whisper"), inputs, dtypes=["float64"], samples=1))
    report = check(model, variant("whisper", (old, new)), inputs, dtypes=["float64"], samples=1)
    assert failed(report) == {space, "all"}, failed(report)


def test_t5_v1_1_gets_its_own_spec_by_binding(tmp_path: Path) -> None:
    """Two built-in specs list T5ForConditionalGeneration (the ReLU layout and v1.1's gated
    one): a folder of either is given the one that binds it, and matching a planted v1.1
    copy finds it again; neither spec binds the other's model (the negative case)."""
    from tests.cli_files import run

    gated, _ = ZOO["t5_gated"]()
    plain, _ = ZOO["t5"]()
    with pytest.raises(BindError):
        bind("t5", gated)
    with pytest.raises(BindError):
        bind("t5_gated", plain)
    gated.save_pretrained(tmp_path / "a")
    planted = symspec.plant(gated, symspec.load_spec("t5_gated"), seed=2)
    planted.model.save_pretrained(tmp_path / "b")
    code, out, err = run("match", tmp_path / "a", tmp_path / "b", "--out", tmp_path / "out", "--json")
    assert code == 0, err
    report = json.loads(out)
    assert report["spec"] == "t5_gated" and report["objective"][-1] <= 1e-8 * report["objective"][0]
    plain.save_pretrained(tmp_path / "p")
    code, out, err = run("check", tmp_path / "p", "--samples", "1", "--json")
    assert code == 0, err
    assert json.loads(out)["spec"] == "t5"


def test_a_greedy_start_reads_no_all_zero_terms() -> None:
    """The first round reads a space's terms that no unsolved space moves; for a BART's
    heads those are the biases alone, all zero in an untrained model: the GL head fit was
    0 / 0 and matching stopped with "the assignment scores are not finite". Such terms
    say nothing and are skipped; the planted pair is found again."""
    model, _ = ZOO["bart"]()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(".bias"):
                p.zero_()
    planted = symspec.plant(model, "bart", seed=2)
    res = symspec.align(model, planted.model, "bart", method="weight")
    assert res.history[-1] <= 1e-9 * res.history[0], res.history
