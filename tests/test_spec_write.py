"""The one spec writer (symspec.spec.write.dump_spec): ``loads_spec(dump_spec(s)) == s`` for
the built-in and inferred specs with any names, docs and comments, and inference builds
the spec its YAML reads back as."""

from __future__ import annotations

import functools

import attrs
import pytest
import torch.nn as nn
from hypothesis import given, settings
from hypothesis import strategies as st

from symspec.spec import Spec, builtin_names, dump_spec, load_spec, loads_spec
from symspec.spec.write import scalar

#: text that YAML reads specially, at a scalar's start or inside it
_SPECIALS = ["'", '"', "#", " #", ": ", "- ", "&a", "*a", "!tag", "%", "@", "`", "|", ">", "{", "}", "[", "]", ",", "?",
             "null", "~", "true", "no", "0x1F", "1e3", ".inf", "<<", "---", " ", "\t", "\n", "\u2028", "é", "名"]
_TEXT = st.lists(st.one_of(st.sampled_from(_SPECIALS), st.text(max_size=4)), max_size=5).map("".join)
_NAME = _TEXT.filter(lambda s: bool(s.strip()) and s.isprintable())


@pytest.fixture(scope="module", autouse=True)
def _import_models_first() -> None:
    """tests/test_infer.py defines @given tests at import: imported while a strategy draws
    (_inferred, run alone), hypothesis refuses the nesting."""
    import tests.test_infer  # noqa: F401


@functools.cache
def _inferred() -> tuple[Spec, ...]:
    """Specs inference drafts for the small test models (unchecked: the spec, not its truth)."""
    from symspec.inference import infer

    return tuple(infer(*_tiny_model(name), verify=False).spec for name in ("tiny", "tiny_mystery", "hash_moe"))


@st.composite
def specs(draw: st.DrawFn) -> tuple:
    """A built-in or an inferred spec with another name, description, docs, a subset of
    its parameters, and comments anywhere."""
    spec = draw(st.sampled_from([*map(load_spec, builtin_names()), *_inferred()]))
    spaces = tuple(attrs.evolve(s, doc=draw(_TEXT)) for s in spec.spaces)
    params = tuple(attrs.evolve(p, doc=draw(_TEXT)) for p in spec.params if draw(st.booleans()) or p is spec.params[0])
    used = {s for p in params for s in p.spaces}
    spaces = tuple(s for s in spaces if s.name in used)  # a space no parameter binds is refused
    spec = attrs.evolve(spec, name=draw(_NAME), description=draw(_TEXT), spaces=spaces, params=params)
    notes = {("params", p.pattern): draw(_TEXT) for p in params}
    notes |= {("dims", d.name): draw(_TEXT) for d in spec.dims}
    return spec, draw(st.lists(_TEXT, max_size=3)), notes


@settings(max_examples=60, deadline=None)
@given(case=specs())
def test_a_written_spec_reads_back_equal(case: tuple) -> None:
    spec, header, notes = case
    text = dump_spec(spec, header=header, notes=notes)
    assert loads_spec(text, "written.yaml") == spec
    assert dump_spec(loads_spec(text)) == dump_spec(spec)  # comments are not part of the spec


@pytest.mark.parametrize("name", builtin_names())
def test_every_built_in_spec_reads_back_equal(name: str) -> None:
    spec = load_spec(name)
    assert loads_spec(dump_spec(spec)) == spec


def test_the_comparison_can_fail() -> None:
    """A changed group, doc or step argument is a different spec (the round trip can fail)."""
    spec = load_spec("gpt2")
    again = loads_spec(dump_spec(spec))
    assert again != attrs.evolve(spec, spaces=(attrs.evolve(spec.spaces[0], group="O(d)"), *spec.spaces[1:]))
    assert again != attrs.evolve(spec, spaces=(attrs.evolve(spec.spaces[0], doc="other"), *spec.spaces[1:]))
    assert again != attrs.evolve(spec, canonicalize=spec.canonicalize[1:])


def test_scalars_are_quoted_only_where_yaml_needs_it() -> None:
    assert scalar("resid") == "resid" and scalar("attn[i].qk", flow=True) == "'attn[i].qk'"
    assert scalar("a: b") == "'a: b'" and scalar(1.0) == "1" and scalar(0.5) == "0.5"


def _tiny_model(name: str) -> tuple[nn.Module, object]:
    from .test_infer import _hash_moe, _tiny

    if name == "hash_moe":
        return _hash_moe()
    return _tiny(**{"tiny_post_act": {"post_act": True}, "tiny_shared_norm": {"shared_norm": True},
                    "tiny_mystery": {"mystery": True}}.get(name, {}))


@pytest.mark.parametrize("name", ["tiny", "tiny_post_act", "tiny_shared_norm", "tiny_mystery", "hash_moe"])
def test_inference_builds_the_spec_it_writes(name: str) -> None:
    """The spec inference builds (symspec.inference.render.to_spec) is the one its YAML
    reads back as, and writing that again gives the same text."""
    from symspec.inference import infer
    from symspec.inference.render import to_spec

    model, inputs = _tiny_model(name)
    result = infer(model, inputs, verify=False)
    built, notes = to_spec(result.draft)
    assert result.spec == built
    assert result.yaml.endswith(dump_spec(built, notes=notes))  # the same text below the header
