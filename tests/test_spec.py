"""The spec language: parsing, the print/parse round trip, located errors, the schema."""

from __future__ import annotations

import json
import keyword
import re
from pathlib import Path

import jsonschema
import pytest
import yaml
from hypothesis import given
from hypothesis import strategies as st

from symspec.errors import GroupError, SpecError
from symspec.spec import builtin_names, dump_spec, load_spec, loads_spec, parse_axis
from symspec.spec.exprs import DimContext
from symspec.spec.groupexpr import parse_group_expr
from symspec.spec.model import (
    AxisExpr,
    AxisSyntaxError,
    Chain,
    DimDecl,
    ParamDecl,
    SpaceDecl,
    Spec,
    StepDecl,
    Term,
)
from symspec.spec.schema import json_schema

MINIMAL = """\
symspec: 1
name: tiny
dims:
  d: 4
spaces:
  resid: O(d)
params:
  w: [resid, resid*]
"""


def errors_of(text: str, file: str = "spec.yaml") -> list[str]:
    with pytest.raises(SpecError) as info:
        loads_spec(text, file)
    return [str(d) for d in info.value.diagnostics]


# -- round trip ---------------------------------------------------------------------------

names = st.from_regex(r"[a-z][a-z0-9_]{0,6}", fullmatch=True).filter(
    lambda s: s not in ("cat", "dual", "abs", "config") and not keyword.iskeyword(s))


@st.composite
def specs(draw: st.DrawFn) -> Spec:
    dim_names = draw(st.lists(names, min_size=1, max_size=3, unique=True))
    dims = tuple(DimDecl(n, str(draw(st.integers(1, 64)))) for n in dim_names)
    space_names = draw(st.lists(names, min_size=1, max_size=3, unique=True))
    spaces = []
    for n in space_names:
        d = draw(st.sampled_from(dim_names))
        group = draw(st.sampled_from([f"S({d})", f"O({d})", f"OC({d})", f"GL({d})", f"Heads(2, qk=GL({d}), ov=GL({d}))"]))
        indexed = draw(st.booleans())
        spaces.append(SpaceDecl(n, "i" if indexed else None, group, draw(st.sampled_from(["", "a doc"]))))
    params = []
    for k in range(draw(st.integers(1, 4))):
        pattern = f"layer.{{i}}.p{k}.weight" if draw(st.booleans()) else f"p{k}.weight"
        if draw(st.booleans()):
            params.append(ParamDecl(pattern, None, True))
            continue
        axes = []
        for _ in range(draw(st.integers(1, 3))):
            if draw(st.booleans()):
                axes.append(None)
                continue
            terms = []
            for _t in range(draw(st.integers(1, 2))):
                s = draw(st.sampled_from(spaces))
                index = ("i" if "{i}" in pattern else draw(st.integers(0, 3))) if s.index else None
                path = (draw(st.sampled_from(["qk", "ov"])),) if s.group.startswith("Heads") else ()
                terms.append(Term(s.name, index, path, draw(st.sampled_from(["co", "contra", "abs"]))))
            cat = len(terms) > 1 and draw(st.booleans())
            chains = tuple(Chain((t,)) for t in terms) if cat else (Chain(tuple(terms)),)
            axes.append(AxisExpr(chains, cat=cat))
        if all(a is None for a in axes):
            axes[0] = AxisExpr((Chain((Term(spaces[0].name, ("i" if "{i}" in pattern else 0) if spaces[0].index else None, ("qk",) if spaces[0].group.startswith("Heads") else ()),)),))
        params.append(ParamDecl(pattern, tuple(axes), False))
    steps = ()
    if draw(st.booleans()):
        steps = (StepDecl.make("center", {"writers": {params[0].pattern: 0}}),)
    used = {s for p in params for s in p.spaces}
    spaces = [s for s in spaces if s.name in used]  # a space no parameter binds is refused
    return Spec(name=draw(names), dims=dims, spaces=tuple(spaces), params=tuple(params), canonicalize=steps)


@given(specs())
def test_dump_then_parse_round_trips(spec: Spec) -> None:
    text = dump_spec(spec)
    again = loads_spec(text)
    assert again == spec
    assert dump_spec(again) == text


@pytest.mark.parametrize("name", builtin_names())
def test_builtin_specs_round_trip_and_validate_against_schema(name: str) -> None:
    spec = load_spec(name)
    assert loads_spec(dump_spec(spec)) == spec
    raw = yaml.safe_load(Path(f"specs/{name}.yaml").read_text()) if Path(f"specs/{name}.yaml").exists() else None
    if raw is not None:
        jsonschema.validate(raw, json_schema())


@given(st.sampled_from([
    "resid", "resid*", "abs(resid)", "dual(resid)", "ff[i]", "ff[3]*", "attn[i].qk", "attn[i].qk.kv*",
    "mlp[i] @ up[i]", "cat(attn[i].qk, attn[i].qk*, attn[i].ov)", "cat(a @ b*, abs(c[j]))",
]))
def test_axis_expressions_round_trip(text: str) -> None:
    ax = parse_axis(text)
    assert ax is not None
    assert parse_axis(str(ax)) == ax


def test_axis_expression_structure() -> None:
    ax = parse_axis("cat(attn[i].qk, attn[i].qk*, attn[i].ov)")
    assert ax is not None and ax.cat and len(ax.segments) == 3
    assert ax.segments[1].terms[0] == Term("attn", "i", ("qk",), "contra")
    assert parse_axis("dual(resid)") == parse_axis("resid*")
    assert parse_axis("_") is None and parse_axis(None) is None
    chain = parse_axis("mlp[i] @ up[i]")
    assert chain is not None and [t.space for t in chain.segments[0].terms] == ["mlp", "up"]


@pytest.mark.parametrize(("text", "col", "message"), [
    ("cat(a, b", 9, "')' closing cat("),
    ("ff[", 4, "a layer index"),
    ("a $ b", 3, "unexpected character"),
    ("a b", 3, "unexpected 'b'"),
])
def test_axis_syntax_errors_have_columns(text: str, col: int, message: str) -> None:
    with pytest.raises(AxisSyntaxError, match=re.escape(message)) as info:
        parse_axis(text)
    assert info.value.column == col


# -- located errors ------------------------------------------------------------------------

def test_minimal_spec_parses() -> None:
    spec = loads_spec(MINIMAL)
    assert spec.name == "tiny" and spec.params[0].axes is not None


def test_unknown_group_is_located_with_a_suggestion() -> None:
    text = MINIMAL.replace("resid: O(d)", "resid: Orth(d)")
    errs = errors_of(text)
    assert errs == ["spec.yaml:6:10: spaces.resid: unknown group 'Orth'; did you mean 'O'?"]


def test_all_errors_of_a_file_are_reported() -> None:
    text = """\
symspec: 1
name: broken
dims:
  d: 4
  h: d / nheads
spaces:
  resid: O(d)
  ff[i]: Perm(d)
params:
  layer.{i}.w: [ff[j], resid*]
  layer.{i}.v:
    - ff[i]
    - residd
  bias: invarient
canonicalize:
  - fold_norms: {gain: x}
  - center: {writers: {a: 0}, extra: 1}
extra_key: 1
"""
    # flow lists cannot hold brackets unquoted: that YAML error comes alone, with a hint
    errs = errors_of(text)
    assert len(errs) == 1 and "quote axis expressions" in errs[0] and errs[0].startswith("spec.yaml:10:")
    errs = errors_of(text.replace("[ff[j], resid*]", '["ff[j]", resid*]'))
    joined = "\n".join(errs)
    expected = [
        "spec.yaml:5:6: dims.h: unknown dimension 'nheads'",
        "spec.yaml:8:10: spaces.ff[i]: unknown group 'Perm'; did you mean 'S'?",
        "spec.yaml:10:17: params[layer.{i}.w][0]: 'ff[j]' uses '{j}', which 'layer.{i}.w' does not capture; captures: i",
        "spec.yaml:13:7: params[layer.{i}.v][1]: unknown space 'residd'; did you mean 'resid'?",
        "spec.yaml:14:9: params.bias: expected a list of axes or 'invariant', got 'invarient'; did you mean 'invariant'?",
        "spec.yaml:16:5: canonicalize[0].fold_norms: unknown canonicalisation step 'fold_norms'; did you mean 'fold_norm'?",
        "spec.yaml:17:31: canonicalize[1].center.extra: center has no argument 'extra'",
        "spec.yaml:18:1: extra_key: unknown key 'extra_key'",
    ]
    for e in expected:
        assert any(x.startswith(e) for x in errs), f"missing {e!r} in:\n{joined}"
    assert len(errs) == len(expected), joined


def test_representation_paths_are_validated() -> None:
    text = MINIMAL.replace("resid: O(d)", "resid: O(d)\n  attn: Heads(2, qk=GL(2), ov=GL(2))").replace("w: [resid, resid*]", "w: [attn.kq, resid*]")
    errs = errors_of(text)
    assert len(errs) == 1 and "has no representation 'kq'" in errs[0] and "did you mean 'qk'" in errs[0]


def test_duplicate_keys_and_missing_sections() -> None:
    errs = errors_of("symspec: 1\nname: a\nname: b\n")
    assert any("duplicate key 'name'" in e and e.startswith("spec.yaml:3:1") for e in errs)
    assert any("declares no 'spaces'" in e for e in errs)
    assert any("declares no 'params'" in e for e in errs)


def test_wrong_version_and_empty_file() -> None:
    assert any("unsupported format version 2" in e for e in errors_of(MINIMAL.replace("symspec: 1", "symspec: 2")))
    assert errors_of("") == ["spec.yaml: the spec is empty"]
    assert any("invalid YAML" in e for e in errors_of("a: [b"))


def test_index_rules() -> None:
    text = MINIMAL.replace("resid: O(d)", "resid: O(d)\n  ff[i]: S(d)").replace("w: [resid, resid*]", "w: [ff, resid*]\n  v: ['resid[0]', _]")
    errs = errors_of(text)
    assert any("space 'ff' is per layer (ff[i]); write ff[i]" in e for e in errs)
    assert any("space 'resid' has no layer index" in e for e in errs)


def test_load_spec_errors() -> None:
    with pytest.raises(SpecError, match="no such spec file"):
        load_spec("does/not/exist.yaml")
    with pytest.raises(SpecError, match="did you mean 'nanogpt'"):
        load_spec("nanogtp")


def test_json_schema_accepts_valid_and_rejects_invalid_documents() -> None:
    schema = json_schema()
    jsonschema.Draft202012Validator.check_schema(schema)
    jsonschema.validate(yaml.safe_load(MINIMAL), schema)
    bad = yaml.safe_load(MINIMAL)
    bad["spacez"] = {}
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(bad, schema)
    bad = yaml.safe_load(MINIMAL)
    bad["canonicalize"] = [{"fold_norm": {"gain": "x"}}]  # missing 'into'
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(bad, schema)
    json.dumps(schema)


# -- group expressions: parsed once, checked without dimensions, evaluated with them -------

def test_group_text_is_parsed_once_and_evaluates_with_the_dimensions() -> None:
    spec = loads_spec(MINIMAL.replace("resid: O(d)", "resid: O(d)\n  attn: Heads(2, qk=GL(d / 2), ov=GL(d / 2), kv=1)")
                      + "  q: [attn.qk, resid*]\n")
    attn = spec.space("attn")
    assert attn.expr is parse_group_expr(attn.group)  # the parsed form is reused
    assert attn.expr.names == {"d"}
    assert attn.expr.rep_paths() == [("qk",), ("qk", "kv"), ("ov",), ("ov", "kv")]
    assert str(attn.expr.evaluate(DimContext({"d": 8}))) == "Heads(2, qk=GL(4), ov=GL(4), kv=1)"
    with pytest.raises(GroupError, match="must divide"):  # sizes are checked with the dimensions
        parse_group_expr("Heads(d, GL(2), kv=3)").evaluate(DimContext({"d": 8}))


def test_a_space_no_parameter_binds_is_refused() -> None:
    # a Falcon draft declared head maps no parameter carried, and its check passed with no row for them
    errs = errors_of(MINIMAL.replace("resid: O(d)", "resid: O(d)\n  attn[i]: Heads(2, qk=GL(2), ov=GL(2))"))
    assert errs == ["spec.yaml:7:3: spaces.attn[i]: space 'attn[i]' is declared but no parameter is bound to it, so "
                    "nothing would check it; bind it on the axes it acts on under params, or remove it"], errs
    loads_spec(MINIMAL.replace("resid: O(d)", "resid: O(d)\n  attn: Heads(2, qk=GL(2), ov=GL(2))")
               + "  q: [attn.qk, resid*]\n")  # the control: bound, it loads


@pytest.mark.parametrize(("group", "message"), [
    # the structure of a head group does not depend on its (symbolic) number of heads
    ("Heads(d)", "Heads: Heads needs a within-head group"),
    ("Heads(d, GL(2), qk=GL(2))", "Heads: part names must be distinct"),
    ("Heads(d, qk=Heads(2, GL(2)))", "Heads: a within-head group cannot itself be a head group"),
    ("RoPE(d, layout=diagonal)", "RoPE: option layout must be one of half, interleaved, got 'diagonal'"),
    ("S(d, 2)", "S takes at most 1 positional argument(s), got 2"),
    ("S(d // x)", "unknown dimension 'x' in group 'S(d // x)'"),
])
def test_group_structure_is_checked_at_load_whatever_the_dimensions(group: str, message: str) -> None:
    errs = errors_of(MINIMAL.replace("resid: O(d)", f"resid: O(d)\n  g: {group}"))
    assert errs == [f"spec.yaml:7:6: spaces.g: {message}"], errs


def test_every_unknown_dimension_of_a_group_is_reported() -> None:
    errs = errors_of(MINIMAL.replace("resid: O(d)", "resid: O(d)\n  g: Heads(h, qk=GL(q), kv=z)"))
    assert [e.split(": ", 2)[2].split(" in group")[0] for e in errs] == [f"unknown dimension '{n}'" for n in "hqz"]


# -- outputs: which of the model's outputs the symmetries preserve ------------------------


def test_outputs_are_read_written_and_checked_against_the_schema() -> None:
    import jsonschema
    import yaml

    def with_line(line: str) -> str:
        return MINIMAL.replace("name: tiny\n", f"name: tiny\n{line}\n")

    spec = loads_spec(with_line("outputs: [logits]"))
    assert spec.outputs == ("logits",) and loads_spec(MINIMAL).outputs == ()
    assert loads_spec(dump_spec(spec)) == spec and "outputs: [logits]" in dump_spec(spec)
    jsonschema.validate(yaml.safe_load(with_line("outputs: [logits]")), json_schema())
    assert loads_spec(with_line("outputs: logits")).outputs == ("logits",)
    for bad in ("outputs: [logits, logits]", "outputs: [1]", "outputs: {a: 1}", "outputs: ['']"):
        errs = errors_of(with_line(bad))
        assert len(errs) == 1 and "outputs must be a list of distinct output names" in errs[0], (bad, errs)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(yaml.safe_load(with_line("outputs: [a, a]")), json_schema())


def test_a_fold_norm_reader_may_have_captures_the_gain_lacks_but_its_bias_no_others() -> None:
    base = MINIMAL.replace("  w: [resid, resid*]\n", """\
  blocks.{i}.w: [resid, resid*]
  blocks.{i}.b: [resid]
  norm.weight: invariant
canonicalize:
  - fold_norm:
      gain: norm.weight
      fold_bias: false
      into:
        - {weight: "blocks.{i}.w", axis: 1%s}
""")
    assert loads_spec(base % "").canonicalize  # one gain, a reader in every block
    assert loads_spec(base % ', bias: "blocks.{i}.b"').canonicalize
    errs = errors_of(base % ', bias: "blocks.{j}.b"')
    assert len(errs) == 1 and "'blocks.{j}.b' uses captures that neither the gain 'norm.weight' nor its weight" in errs[0]


def test_a_fold_norm_reader_lacking_a_capture_of_the_gain_is_refused_at_load() -> None:
    """A mistyped capture ('{j}' for '{i}') would fold every layer's norm into every
    layer's reader: refused when the spec is read, naming the capture; the reader that
    captures what the gain does (the control) loads."""
    base = MINIMAL.replace("  w: [resid, resid*]\n", """\
  blocks.{i}.w: [resid, resid*]
  blocks.{i}.norm: invariant
  head.w: [resid, resid*]
canonicalize:
  - fold_norm:
      gain: "blocks.{i}.norm"
      fold_bias: false
      into:
        - {weight: "%s", axis: 1}
""")
    assert loads_spec(base % "blocks.{i}.w").canonicalize
    for reader, missing in (("blocks.{j}.w", "{i}"), ("head.w", "{i}")):
        errs = errors_of(base % reader)
        assert len(errs) == 1, errs
        assert f"the reader '{reader}' does not capture {missing}, which the gain 'blocks.{{i}}.norm' does" in errs[0]
