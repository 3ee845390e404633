"""specs/README.md walks through writing a spec for Phi; this replays it against the
current code: its model file builds the model, its draft fails to bind with exactly the
messages it shows, each fix it describes moves the check the way it says, and its
finished spec passes."""

from __future__ import annotations

import atexit
import re
import shutil
import tempfile
from functools import cache
from pathlib import Path
from typing import Any

import pytest
import torch

from symspec.binding import bind
from symspec.checker import check
from symspec.errors import BindError, SpecError
from symspec.loading import import_file
from symspec.spec import loads_spec
from symspec.testing import assert_invariant

GUIDE = Path(__file__).resolve().parent.parent / "specs" / "README.md"


@cache
def _text() -> str:
    return GUIDE.read_text(encoding="utf-8")


def block(marker: str) -> str:
    """The fenced block right after ``<!-- guide:marker -->``."""
    m = re.search(rf"<!-- guide:{marker} -->\n```[a-z]*\n(.*?)```", _text(), re.S)
    assert m, f"no guide:{marker} block in specs/README.md"
    return m.group(1)


def guide_spec() -> str:
    return block("spec")


@cache
def _model_module() -> Any:
    path = Path(tempfile.mkdtemp(prefix="symspec-guide-")) / "phi_model.py"
    atexit.register(shutil.rmtree, path.parent, True)  # each run once left its folder in /tmp
    path.write_text(block("model"))
    return import_file(path)


def guide_model(**overrides: Any) -> tuple[torch.nn.Module, Any]:
    """The model built by the guide's model file."""
    mod = _model_module()
    model = mod.build(**overrides)
    return model, mod.example_inputs(model)


def test_the_guides_draft_fails_to_bind_with_the_messages_it_shows() -> None:
    model, _ = guide_model()
    draft = loads_spec(block("draft"), "phi.yaml")
    with pytest.raises(BindError) as info:
        bind(draft, model)
    shown = block("bind-errors")
    assert f"error: {info.value.headline}" in shown
    for d in info.value.diagnostics:
        assert str(d) in shown, str(d)
    assert len(info.value.diagnostics) == shown.count("\nphi.yaml")


def _fixed(text: str, *, fc1: bool, rope: str) -> str:
    text = text.replace('["attn[i].qk*"', '["attn[i].qk.kv*"').replace('lm_head.weight: [_, resid*]\n', 'lm_head.weight: [_, resid*]\n  lm_head.bias: invariant\n')
    if fc1:
        v = '        - {weight: "model.layers.{i}.self_attn.v_proj.weight", axis: 1, bias: "model.layers.{i}.self_attn.v_proj.bias"}\n'
        text = text.replace(v, v + '        - {weight: "model.layers.{i}.mlp.fc1.weight", axis: 1, bias: "model.layers.{i}.mlp.fc1.bias"}\n')
    if rope:
        text = text.replace("qk=GL(dh)", f"qk={rope}").replace("  f: config.intermediate_size\n",
                                                              '  f: config.intermediate_size\n  r: attr("model.layers.0.self_attn.rotary_ndims")\n')
    return text


def test_each_fix_moves_the_check_as_the_guide_says() -> None:
    model, inputs = guide_model()
    draft = block("draft")
    steps = [
        ("check-1", _fixed(draft, fc1=False, rope=""), {"canonicalize", "attn[*]", "all"}),
        ("check-2", _fixed(draft, fc1=True, rope="RoPE(dh)"), {"attn[*]", "all"}),
        ("check-3", _fixed(draft, fc1=True, rope="RoPE(dh, rot=r)"), set()),
    ]
    for marker, text, failing in steps:
        report = check(model, loads_spec(text, "phi.yaml"), inputs, dtypes=("float64",))
        assert {r.space for r in report.failed_rows()} == failing, marker
        shown = block(marker)
        for r in report.rows:
            assert re.search(rf"│ {re.escape(r.space)} +│ {re.escape(r.group)} +│ float64 .*│ {'pass' if r.passed else 'FAIL'}", shown), (marker, r.space)
        if failing:
            assert f"{len(report.failed_rows()) * (2 if marker == 'check-1' else 1)} row(s) failed" in shown
        else:
            assert "all symmetries preserve the function" in shown


def test_the_finished_spec_passes_on_other_phi_shapes() -> None:
    spec = loads_spec(guide_spec(), "phi.yaml")
    for overrides in ({}, {"num_key_value_heads": 1, "partial_rotary_factor": 0.25}, {"num_key_value_heads": 4, "partial_rotary_factor": 1.0}):
        model, inputs = guide_model(**overrides)
        assert_invariant(model, spec, inputs)


def test_the_typo_messages_are_the_ones_shown(tmp_path: Path) -> None:
    text = block("draft").replace("  ff[i]: S(f)", "  ff[i]: Perm(f)").replace("  dh: d / H", "  dh: d / heads")
    with pytest.raises(SpecError) as info:
        loads_spec(text, "typo.yaml")
    guide = _text()
    for d in info.value.diagnostics:
        assert str(d) in guide, str(d)
