"""Two gaps of the spec language, closed (issue #12, part F):

- norms that store their gain as an offset, x̂ · (1 + w) (Gemma's RMSNorm): ``fold_norm``
  with ``gain_offset: 1`` folds the factor and sets w to 0, and a plain fold of such a
  norm is caught by the check's canonicalize row, which names the step and the norm;
- fused q/k/v projections laid out per head, ``[h0: q k v][h1: q k v]...`` (GPT-NeoX's
  query_key_value): ``cat(q, k, v, heads=H)``, an explicit invertible index map.

The models are small modules written here, so that each symmetry is tested on exactly
the computation it claims; the Hugging Face families (specs/gemma.yaml,
specs/gpt_neox.yaml) are checked in tests/test_arch.py.
"""

from __future__ import annotations

import inspect
import json
import math
import re
from pathlib import Path

import jsonschema
import pytest
import torch
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import symspec
from symspec.binding import bind
from symspec.errors import BindError, SpecError
from symspec.problem import HeadMajor, Segment
from symspec.spec import dump_spec, loads_spec, parse_axis
from symspec.spec.model import AxisSyntaxError
from symspec.spec.schema import json_schema
from symspec.testing import assert_invariant, assert_not_invariant, randomize_
from symspec.transforms import (
    apply_elements,
    canonicalize_model,
    canonicalize_state_dict,
    sample_elements,
)


def failed(report: symspec.CheckReport) -> set[str]:
    return {r.space for r in report.failed_rows()}


# -- (1) norms that scale by (1 + w) -----------------------------------------------------------


class OffsetRMSNorm(nn.Module):
    """RMSNorm that multiplies by (offset + weight): (1 + weight) as Hugging Face's
    GemmaRMSNorm, or a plain RMSNorm with ``offset = 0``; with ``bias``, a bias is added
    after the gain (a LayerNorm-like variant)."""

    def __init__(self, d: int, bias: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(d))
        self.bias = nn.Parameter(torch.zeros(d)) if bias else None
        self.offset = 1.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * (self.offset + self.weight)
        return y + self.bias if self.bias is not None else y


class OffsetBlock(nn.Module):
    def __init__(self, d: int, f: int) -> None:
        super().__init__()
        self.norm = OffsetRMSNorm(d)
        self.fc1 = nn.Linear(d, f)
        self.fc2 = nn.Linear(f, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(torch.nn.functional.gelu(self.fc1(self.norm(x))))


class OffsetNormNet(nn.Module):
    """Embedding, pre-norm MLP blocks with (1 + w) RMSNorms, a final (1 + w) norm (with a
    bias when ``final_bias``) and an unbiased head."""

    def __init__(self, vocab: int = 11, d: int = 8, f: int = 12, n_layer: int = 2, final_bias: bool = False) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.layers = nn.ModuleList(OffsetBlock(d, f) for _ in range(n_layer))
        self.norm = OffsetRMSNorm(d, bias=final_bias)
        self.head = nn.Linear(d, vocab, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        for layer in self.layers:
            x = layer(x)
        return self.head(self.norm(x))


OFFSET_SPEC = """\
symspec: 1
name: offset_norm
dims:
  d: shape("embed.weight", 1)
  f: shape("layers.0.fc1.weight", 0)
spaces:
  resid: O(d)
  ff[i]: S(f)
canonicalize:
  - fold_norm:
      gain: layers.{i}.norm.weight
      gain_offset: 1
      into: [{weight: "layers.{i}.fc1.weight", axis: 1}]
  - fold_norm:
      gain: norm.weight
      gain_offset: 1
      into: [{weight: head.weight, axis: 1}]
params:
  embed.weight: [_, resid]
  layers.{i}.norm.weight: invariant
  layers.{i}.fc1.weight: ["ff[i]", resid*]
  layers.{i}.fc1.bias: ["ff[i]"]
  layers.{i}.fc2.weight: [resid, "ff[i]*"]
  layers.{i}.fc2.bias: [resid]
  norm.weight: invariant
  head.weight: [_, resid*]
"""


def offset_model(seed: int = 0, **kw: int | bool) -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(seed)
    model = randomize_(OffsetNormNet(**kw), seed).eval()  # w away from 0: a zero offset hides nothing
    return model, torch.randint(11, (2, 6), generator=torch.Generator().manual_seed(seed))


def test_offset_fold_preserves_the_function_and_the_residuals_orthogonal_group() -> None:
    model, ids = offset_model()
    spec = loads_spec(OFFSET_SPEC, "offset.yaml")
    report = assert_invariant(model, spec, ids)
    assert {r.space for r in report.rows} == {"canonicalize", "resid", "ff[*]", "all"}
    assert all(r.max_abs > 0 for r in report.rows if r.space != "canonicalize")  # the group moved the weights
    # the canonical form: the factor (1 + w) sits in the reader, the norm's w is 0
    bound = bind(spec, model)
    sd = {k: v.detach() for k, v in model.state_dict().items()}
    canon = canonicalize_state_dict(bound, sd)
    assert torch.equal(canon["layers.0.norm.weight"], torch.zeros(8))
    assert torch.allclose(canon["layers.0.fc1.weight"], sd["layers.0.fc1.weight"] * (1 + sd["layers.0.norm.weight"]))
    assert torch.allclose(canon["head.weight"], sd["head.weight"] * (1 + sd["norm.weight"]))


def test_a_plain_fold_of_an_offset_norm_is_caught_and_the_row_names_the_step_and_the_norm() -> None:
    model, ids = offset_model()
    plain = loads_spec(OFFSET_SPEC.replace("      gain_offset: 1\n", ""), "plain.yaml")
    report = assert_not_invariant(model, plain, ids)
    # the residual is still a symmetry of the (wrong) canonical model: only the fold fails
    assert failed(report) == {"canonicalize"}
    for row in report.failed_rows():
        assert row.failing == ("canonicalize[0] fold_norm layers.{i}.norm.weight (all 2)", "canonicalize[1] fold_norm norm.weight")
    notes = [n for n in report.notes if n.startswith("canonicalize:")]
    # each note locates the step in the spec file and says what would fix it
    assert len(notes) == 2
    assert notes[0].startswith("canonicalize: plain.yaml:10:5: canonicalize[0]: fold_norm of layers.0.norm.weight, layers.1.norm.weight changes the function")
    assert notes[1].startswith("canonicalize: plain.yaml:13:5: canonicalize[1]: fold_norm of norm.weight changes the function")
    assert all("with 'gain_offset: 1' it preserves the function" in n for n in notes)
    # on the table too (the CLI prints 'FAIL at ...' from the same field)
    assert "FAIL (canonicalize[0] fold_norm layers.{i}.norm.weight (all 2), canonicalize[1] fold_norm norm.weight)" in report.render()


def test_only_the_wrong_norm_is_named() -> None:
    model, ids = offset_model()
    # the final norm folded without its offset; the blocks' folds are right
    text = OFFSET_SPEC.replace("      gain: norm.weight\n      gain_offset: 1\n", "      gain: norm.weight\n")
    report = assert_not_invariant(model, loads_spec(text, "one.yaml"), ids, dtypes=("float64",))
    assert [r.failing for r in report.failed_rows()] == [("canonicalize[1] fold_norm norm.weight",)]


def test_a_fold_that_is_wrong_for_another_reason_gets_no_offset_hint() -> None:
    model, ids = offset_model()
    # the blocks' folds forget their reader: (1 + w) is then lost whatever the offset
    text = OFFSET_SPEC.replace('      into: [{weight: "layers.{i}.fc1.weight", axis: 1}]', '      into: [{weight: "layers.{i}.fc2.weight", axis: 0}]')
    report = assert_not_invariant(model, loads_spec(text, "reader.yaml"), ids, dtypes=("float64",))
    row = report.failed_rows()[0]
    assert row.space == "canonicalize" and row.failing == ("canonicalize[0] fold_norm layers.{i}.norm.weight (all 2)",)
    note = next(n for n in report.notes if "canonicalize[0]" in n)
    assert "gain_offset" not in note


def test_an_offset_fold_of_a_plain_norm_is_caught_with_the_reverse_hint() -> None:
    # plain (x̂ · w) RMSNorms, declared with gain_offset: 1
    from symspec.checker import check

    model, ids = offset_model()
    for m in model.modules():
        if isinstance(m, OffsetRMSNorm):
            m.offset = 0.0
    assert_invariant(model, loads_spec(OFFSET_SPEC.replace("      gain_offset: 1\n", ""), "plain.yaml"), ids, dtypes=("float64",))
    report = check(model, loads_spec(OFFSET_SPEC, "offset.yaml"), ids, dtypes=("float64",))
    # (the wrong fold zeroes every gain, so the canonical model's rows may fail as well)
    assert "canonicalize" in failed(report)
    assert any("without gain_offset it preserves the function" in n for n in report.notes)


def test_offset_fold_with_a_kept_bias() -> None:
    # fold_bias: false keeps the norm's bias, which must become bias / (1 + w); it moves
    # with the residual like GPT-2's ln_f.bias
    model, ids = offset_model(final_bias=True)
    text = OFFSET_SPEC.replace("      gain: norm.weight\n      gain_offset: 1\n",
                               "      gain: norm.weight\n      gain_offset: 1\n      bias: norm.bias\n      fold_bias: false\n")
    text = text.replace("  norm.weight: invariant\n", "  norm.weight: invariant\n  norm.bias: [resid]\n")
    spec = loads_spec(text, "bias.yaml")
    assert_invariant(model, spec, ids)
    canon = canonicalize_model(bind(spec, model), model)
    assert torch.allclose(canon.norm.bias, model.norm.bias / (1 + model.norm.weight))
    # forgetting the offset is caught here too
    assert_not_invariant(model, loads_spec(text.replace("      gain_offset: 1\n      bias", "      bias"), "bias.yaml"), ids, dtypes=("float64",))


MODEL_FILE = """
import torch
from torch import nn

from symspec.testing import randomize_

{classes}

SPEC = "plain.yaml"


def build():
    torch.manual_seed(0)
    return randomize_(OffsetNormNet(), 0).eval()


def example_inputs(model, batch=2, seed=0):
    return torch.randint(11, (batch, 6), generator=torch.Generator().manual_seed(seed))
"""


def test_symspec_check_names_the_wrong_fold_on_the_command_line(tmp_path: Path) -> None:
    from tests.cli_files import run

    classes = "\n\n".join(inspect.getsource(c) for c in (OffsetRMSNorm, OffsetBlock, OffsetNormNet))
    (tmp_path / "offset_model.py").write_text(MODEL_FILE.format(classes=classes))
    (tmp_path / "plain.yaml").write_text(OFFSET_SPEC.replace("      gain_offset: 1\n", ""))
    code, out, _ = run("check", tmp_path / "offset_model.py", "--dtype", "float64")
    assert code == 1
    text = " ".join(out.split())  # the table and the notes wrap at the console's width
    assert "FAIL at canonicalize[0]" in text and "…" not in out  # folded, not cut off
    assert "plain.yaml:10:5: canonicalize[0]: fold_norm of layers.0.norm.weight, layers.1.norm.weight changes the function" in text
    assert "with 'gain_offset: 1' it preserves the function" in text
    code, out, _ = run("check", tmp_path / "offset_model.py", "--dtype", "float64", "--json")
    rows = {r["space"]: r for r in json.loads(out)["rows"]}
    assert code == 1 and rows["canonicalize"]["failing"] == ["canonicalize[0] fold_norm layers.{i}.norm.weight (all 2)",
                                                             "canonicalize[1] fold_norm norm.weight"]
    # the right spec passes, from the same command
    (tmp_path / "plain.yaml").write_text(OFFSET_SPEC)
    assert run("check", tmp_path / "offset_model.py")[0] == 0


@pytest.mark.parametrize(("value", "message"), [
    ('"one"', "expected a number, got 'one'"),
    ("true", "expected a number, got True"),
    (".nan", "expected a number, got nan"),
])
def test_gain_offset_is_validated_with_a_location(value: str, message: str) -> None:
    text = OFFSET_SPEC.replace("      gain: norm.weight\n      gain_offset: 1\n", f"      gain: norm.weight\n      gain_offset: {value}\n")
    with pytest.raises(SpecError) as info:
        loads_spec(text, "spec.yaml")
    assert [str(d) for d in info.value.diagnostics] == [f"spec.yaml:16:20: canonicalize[1].fold_norm.gain_offset: {message}"]


def test_gain_offset_is_in_the_json_schema_and_round_trips() -> None:
    schema = json_schema()
    jsonschema.validate(yaml.safe_load(OFFSET_SPEC), schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(yaml.safe_load(OFFSET_SPEC.replace("gain_offset: 1", "gain_offset: one")), schema)
    spec = loads_spec(OFFSET_SPEC)
    assert spec.canonicalize[0].arg("gain_offset") == 1
    assert loads_spec(dump_spec(spec)) == spec
    # a plain fold stays as it was: no gain_offset in its arguments or bound op
    plain = loads_spec(OFFSET_SPEC.replace("      gain_offset: 1\n", ""))
    assert plain.canonicalize[0].arg("gain_offset") is None
    model, _ = offset_model()
    assert all("gain_offset" not in op.args for op in bind(plain, model).canonical)


# -- (2) fused q/k/v laid out per head ----------------------------------------------------------


class FusedHeadMajorAttention(nn.Module):
    """Causal attention whose fused projection is laid out per key/value head:
    ``[g0: q (H/K heads) k v][g1: ...]...``; with K = H that is GPT-NeoX's
    ``[h0: q k v][h1: q k v]...``."""

    def __init__(self, d: int, heads: int, kv: int, dh: int) -> None:
        super().__init__()
        self.heads, self.kv, self.dh = heads, kv, dh
        self.qkv = nn.Linear(d, (heads + 2 * kv) * dh)
        self.o = nn.Linear(heads * dh, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        gs, dh = self.heads // self.kv, self.dh
        blocks = self.qkv(x).view(b, t, self.kv, (gs + 2) * dh)
        q = blocks[..., : gs * dh].reshape(b, t, self.heads, dh)
        k = blocks[..., gs * dh : (gs + 1) * dh].repeat_interleave(gs, dim=2)  # query head h reads kv head h // gs
        v = blocks[..., (gs + 1) * dh :].repeat_interleave(gs, dim=2)
        scores = torch.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(dh)
        scores = scores.masked_fill(torch.ones(t, t, dtype=torch.bool).triu(1), float("-inf"))
        y = torch.einsum("bhqk,bkhd->bqhd", scores.softmax(-1), v).reshape(b, t, self.heads * dh)
        return self.o(y)


class HeadMajorNet(nn.Module):
    def __init__(self, heads: int, kv: int, dh: int = 3, d: int = 8, vocab: int = 11, n_layer: int = 2) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.layers = nn.ModuleList(FusedHeadMajorAttention(d, heads, kv, dh) for _ in range(n_layer))
        self.head = nn.Linear(d, vocab)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        for layer in self.layers:
            x = x + layer(x)
        return self.head(x)


HEAD_MAJOR_SPEC = """\
symspec: 1
name: head_major
dims:
  H: {heads}
  K: {kv}
  dh: shape("layers.0.o.weight", 1) / H
spaces:
  attn[i]: Heads(H, qk=GL(dh), ov=GL(dh), kv=K)
params:
  embed.weight: invariant
  head.weight: invariant
  head.bias: invariant
  layers.{{i}}.qkv.weight: ["{fused}", _]
  layers.{{i}}.qkv.bias: ["{fused}"]
  layers.{{i}}.o.weight: [_, "attn[i].ov*"]
  layers.{{i}}.o.bias: invariant
"""
HEAD_MAJOR = "cat(attn[i].qk, attn[i].qk.kv*, attn[i].ov.kv, heads=K)"
BLOCK = "cat(attn[i].qk, attn[i].qk.kv*, attn[i].ov.kv)"
SHAPES = [(2, 2), (4, 2), (4, 1), (3, 3)]


def head_major_model(heads: int, kv: int, seed: int = 0, dh: int = 3) -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(seed)
    model = randomize_(HeadMajorNet(heads, kv, dh), seed).eval()
    return model, torch.randint(11, (2, 5), generator=torch.Generator().manual_seed(seed))


def head_major_spec(heads: int, kv: int, fused: str = HEAD_MAJOR) -> symspec.Spec:
    return loads_spec(HEAD_MAJOR_SPEC.format(heads=heads, kv=kv, fused=fused), "head_major.yaml")


@pytest.mark.parametrize(("heads", "kv"), SHAPES)
def test_head_major_fused_qkv_with_per_head_gl_preserves_the_function(heads: int, kv: int) -> None:
    model, ids = head_major_model(heads, kv)
    report = assert_invariant(model, head_major_spec(heads, kv), ids)
    assert all(r.max_abs > 0 for r in report.rows)  # the per-head maps really moved the weights


# (with one key/value head, K = 1, the two layouts are the same: [q q q q k v])
@pytest.mark.parametrize(("heads", "kv"), [s for s in SHAPES if s[1] > 1])
def test_the_same_model_bound_with_the_block_layout_fails(heads: int, kv: int) -> None:
    model, ids = head_major_model(heads, kv)
    # [q all heads][k][v] has the same sizes, so it binds; only the check can tell
    report = assert_not_invariant(model, head_major_spec(heads, kv, BLOCK), ids, dtypes=("float64",))
    assert failed(report) == {"attn[*]", "all"}
    assert max(r.max_rel for r in report.failed_rows()) > 1e-3


def test_counting_query_heads_instead_of_key_value_blocks_fails() -> None:
    # grouped layout [g0: q q k v][g1: q q k v]: blocks are key/value groups, not heads
    model, ids = head_major_model(4, 2, dh=4)
    wrong = head_major_spec(4, 2, HEAD_MAJOR.replace("heads=K", "heads=H"))  # parts of 16, 8, 8 rows split in 4: it binds
    assert failed(assert_not_invariant(model, wrong, ids, dtypes=("float64",))) == {"attn[*]", "all"}


def test_head_major_binding_and_its_text_form() -> None:
    model, _ = head_major_model(4, 2)
    spec = head_major_spec(4, 2)
    ax = spec.params[3].axes[0]  # type: ignore[index]
    assert ax is not None and ax.heads == "K" and str(ax) == HEAD_MAJOR and parse_axis(str(ax)) == ax
    assert loads_spec(dump_spec(spec)) == spec
    pb = bind(spec, model).problem.params["layers.0.qkv.weight"]
    assert pb.axes[0].layout == HeadMajor(2, (6, 3, 3))  # per block: 2 query heads of 3, one key, one value head
    assert str(pb.axes[0]).endswith(", heads=2)")
    # every incidence knows the layout, so the solvers read the right rows
    assert all(inc.layout == pb.axes[0].layout for inc in bind(spec, model).problem.incidences("attn[0]") if inc.param == pb.name)


def test_weight_matching_recovers_a_planted_head_major_pair() -> None:
    model, _ = head_major_model(4, 2)
    model = model.double()
    spec = head_major_spec(4, 2)
    bound = bind(spec, model)
    g = sample_elements(bound.problem, seed=5)
    b = HeadMajorNet(4, 2).double()
    b.load_state_dict(apply_elements(bound.problem, g, model.state_dict()))
    res = symspec.align(model, b, spec, method="weight", rounds=30, tol=1e-12)
    for p in bound.problem.params:
        assert torch.allclose(res.aligned_b[p], res.canonical_a[p], atol=1e-6, rtol=0), p
    assert res.history[-1] <= 1e-12 * res.history[0]


# -- the index map -------------------------------------------------------------------------------


@st.composite
def layouts(draw: st.DrawFn) -> HeadMajor:
    return HeadMajor(draw(st.integers(1, 5)), tuple(draw(st.lists(st.integers(1, 4), min_size=1, max_size=4))))


@settings(max_examples=60, deadline=None)
@given(layouts())
def test_head_major_index_map_is_a_bijection_with_reverse_forward_identity(m: HeadMajor) -> None:
    fwd = [m.forward(i) for i in range(m.size)]
    assert sorted(fwd) == list(range(m.size))
    assert all(m.reverse(m.forward(i)) == i for i in range(m.size))
    assert all(m.forward(m.reverse(s)) == s for s in range(m.size))
    assert m.index().tolist() == fwd
    with pytest.raises(IndexError):
        m.forward(m.size)
    with pytest.raises(IndexError):
        m.reverse(-1)


@settings(max_examples=40, deadline=None)
@given(layouts(), st.integers(1, 3))
def test_head_major_reads_what_a_per_head_view_reads(m: HeadMajor, cols: int) -> None:
    # the oracle: view storage as [heads, block], split each head's block into the parts,
    # and concatenate the parts, each head-major (what a model's view + chunk computes)
    x = torch.randn(m.size, cols, dtype=torch.float64)
    per_head = x.reshape(m.heads, m.block, cols).split(list(m.widths), dim=1)
    want = torch.cat([p.reshape(-1, cols) for p in per_head])
    assert torch.equal(m.to_concat(x), want)
    assert torch.equal(m.to_storage(m.to_concat(x)), x)
    start = 0
    for w in m.widths:
        seg = Segment(start, m.heads * w, ())
        assert torch.equal(m.take(x, seg), want[start : start + m.heads * w])
        start += m.heads * w


# -- located errors of the new syntax -------------------------------------------------------------


@pytest.mark.parametrize(("fused", "message"), [
    ("cat(attn[i].qk, attn[i].qk.kv*, attn[i].ov.kv, head=K)", "cat() has no keyword 'head'; did you mean 'heads'?"),
    ("cat(attn[i].qk, heads=K)", "heads= lays out two or more parts per head"),
    ("cat(attn[i].qk, attn[i].qk.kv*, attn[i].ov.kv, heads=0)", "the number of heads must be positive"),
])
def test_layout_syntax_errors_are_located(fused: str, message: str) -> None:
    with pytest.raises(SpecError) as info:
        head_major_spec(4, 2, fused)
    weight, bias = (str(d) for d in info.value.diagnostics)
    assert weight.startswith("head_major.yaml:13:27: params[layers.{i}.qkv.weight][0]: cannot parse axis") and message in weight
    assert bias.startswith("head_major.yaml:14:25: params[layers.{i}.qkv.bias][0]: cannot parse axis") and message in bias


def test_an_unknown_dimension_in_heads_is_located_with_a_suggestion() -> None:
    with pytest.raises(SpecError) as info:
        head_major_spec(4, 2, HEAD_MAJOR.replace("heads=K", "heads=KK"))
    assert [str(d) for d in info.value.diagnostics] == [
        f"head_major.yaml:{line}:{col}: params[layers.{{i}}.qkv.{what}][0]: '{HEAD_MAJOR.replace('heads=K', 'heads=KK')}': unknown dimension 'KK' in heads=; did you mean 'K'?"
        for line, col, what in ((13, 27, "weight"), (14, 25, "bias"))
    ]


def test_heads_that_do_not_split_the_parts_are_a_located_bind_error() -> None:
    model, _ = head_major_model(4, 2)
    # parts of 12, 6 and 6 rows cannot come in 5 blocks
    spec = head_major_spec(4, 2, HEAD_MAJOR.replace("heads=K", "heads=5"))
    with pytest.raises(BindError) as info:
        bind(spec, model)
    msgs = [str(d) for d in info.value.diagnostics]
    assert len(msgs) == 4  # weight and bias, two layers
    assert msgs[0] == ("head_major.yaml:13:27: params[layers.{i}.qkv.weight][0]: layers.0.qkv.weight: "
                       "'cat(attn[i].qk, attn[i].qk.kv*, attn[i].ov.kv, heads=5)': parts of sizes 12, 6, 6 do not split into heads=5 (5) "
                       "equal head slices; heads= counts the blocks of the stored layout: each part holds one slice per block")


def test_heads_keyword_only_inside_cat() -> None:
    with pytest.raises(AxisSyntaxError, match=re.escape("unexpected '='")):
        parse_axis("heads=H")
    with pytest.raises(AxisSyntaxError, match=re.escape("expected ')' closing cat(")):
        parse_axis("cat(a, b, heads=H, c)")


# -- the Hugging Face families: Gemma (1 + w) and GPT-NeoX (head-major query_key_value) ----------


def test_gemma_plain_fold_is_caught_and_named() -> None:
    from tests.zoo import ZOO, variant

    model, inputs = ZOO["gemma"]()
    plain = variant("gemma", ("      gain_offset: 1\n", ""))
    report = assert_not_invariant(model, plain, inputs, dtypes=("float64",))
    assert failed(report) == {"canonicalize"}
    (row,) = report.failed_rows()
    assert row.failing == (
        "canonicalize[1] fold_norm model.layers.{i}.input_layernorm.weight (all 2)",
        "canonicalize[2] fold_norm model.layers.{i}.post_attention_layernorm.weight (all 2)",
        "canonicalize[3] fold_norm model.norm.weight",
    )
    assert sum("with 'gain_offset: 1' it preserves the function" in n for n in report.notes) == 3


@pytest.mark.parametrize("overrides", [
    {"use_parallel_residual": False},            # sequential blocks
    {"tie_word_embeddings": True},               # the tie is declared and untied explicitly
    {"n_head": 4, "head_dim": 2},                # heads of 2 dims: every dim rotates
    {"head_dim": 6, "rotary": 4},                # 4 of 6 dims rotate
])
def test_gpt_neox_variants(overrides: dict[str, object]) -> None:
    from tests.zoo import ZOO

    model, inputs = ZOO["gpt_neox"](**overrides)
    assert_invariant(model, "gpt_neox", inputs, dtypes=("float64",))


@pytest.mark.parametrize(("old", "new"), [
    (", heads=H)", ")"),                               # the block layout [q all heads][k][v]
    ("qk=RoPE(dh, rot=r)", "qk=RoPE(dh)"),             # full rotary where only r dims rotate
])
def test_gpt_neox_needs_the_head_major_layout_and_partial_rotary(old: str, new: str) -> None:
    from tests.zoo import ZOO, variant

    model, inputs = ZOO["gpt_neox"]()
    report = assert_not_invariant(model, variant("gpt_neox", (old, new)), inputs, dtypes=("float64",))
    assert failed(report) == {"attn[*]", "all"}
