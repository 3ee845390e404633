"""Mixture-of-experts layers: the Experts group, views that merge stored axes, the
mixtral spec's wrong variants, and the joint expert + unit + scaling solver."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import symspec
from symspec.binding import bind
from symspec.errors import BindError, GroupError, SpecError
from symspec.groups import D, Experts, Id, S, parse
from symspec.problem import AxisView
from symspec.solvers import SolveContext, Timer
from symspec.solvers.engine.base import StatTerm
from symspec.solvers.kinds.experts import solve_experts_scaling
from symspec.spec import builtin_path, dump_spec, loads_spec
from symspec.testing import assert_not_invariant
from tests.zoo import ZOO, variant

# -- the group ---------------------------------------------------------------------------


def test_experts_group_text_paths_and_law() -> None:
    g = parse("Experts(3, S(4))")
    assert isinstance(g, Experts) and str(g) == "Experts(3, S(4))" and parse(str(g)) == g
    assert g.rep_paths() == [(), ("router",)] and g.rep_size(()) == 12 and g.rep_size(("router",)) == 3
    a, b = g.sample(1), g.sample(2)
    assert g.contains(a) and g.contains(g.matrix(a))
    assert torch.allclose(g.matrix(g.compose(a, b)), g.matrix(a) @ g.matrix(b))
    assert torch.allclose(g.matrix(g.inverse(a)) @ g.matrix(a), torch.eye(12, dtype=torch.float64))
    # the router's view is the expert permutation alone
    r = g.matrix(a, ("router",))
    assert torch.equal(r, torch.eye(3, dtype=torch.float64)[a["perm"]])
    # a permutation that mixes units of two experts is not in the group
    mixed = torch.eye(12, dtype=torch.float64)[[4, 1, 2, 3, 0, 5, 6, 7, 8, 9, 10, 11]]
    assert not g.contains(mixed)
    assert g.fixed_subgroup() == Experts.of(3, Id(4)) and g.permutation_subgroup() == g


@pytest.mark.parametrize("text", ["Experts(3)", "Experts(3, S(4), S(4))", "Experts(3, Heads(2, GL(2)))", "Experts(3, within=S(4))"])
def test_experts_group_refuses_bad_text(text: str) -> None:
    with pytest.raises(GroupError):
        parse(text)


# -- views -------------------------------------------------------------------------------


@settings(max_examples=30, deadline=None)
@given(st.permutations([0, 1, 2]), st.integers(0, 2), st.integers(2, 4), st.integers(2, 4), st.integers(2, 4))
def test_a_view_round_trips(order: list[int], cut: int, a: int, b: int, c: int) -> None:
    merge = tuple(tuple(m) for m in (order[:cut], order[cut:]) if m)
    v = AxisView((a, b, c), merge)
    x = torch.randn(a, b, c)
    y = v.to_view(x)
    assert y.shape == v.shape and torch.equal(v.to_stored(y), x)


def test_a_view_merges_row_major_outermost_first() -> None:
    x = torch.randn(2, 3, 4)
    y = AxisView((2, 3, 4), ((1,), (0, 2))).to_view(x)  # [d, E*f]: index e * f + u
    assert y.shape == (3, 8)
    assert all(y[j, e * 4 + u] == x[e, j, u] for e in range(2) for j in range(3) for u in range(4))


MIXTRAL_BASE = builtin_path("mixtral").read_text()


def _mixtral(*replacements: tuple[str, str]) -> str:
    text = MIXTRAL_BASE
    for old, new in replacements:
        assert old in text, old
        text = text.replace(old, new, 1)
    return text


@pytest.mark.parametrize(("old", "new", "message"), [
    ("    view: [[0, 1], 2]", "    view: [[0, 1], 1]", "exactly once"),
    ("    view: [[0, 1], 2]", "    view: [[0, 1]]", "has 1 axes, the list gives 2"),
    ("    view: [[0, 1], 2]", "    view: [[0, 1], 2.5]", "a view lists"),
    ("    view: [[0, 1], 2]", "    view: []", "a view lists"),
    ("    view: [[0, 1], 2]", "    vew: [[0, 1], 2]", "no field 'vew'"),
])
def test_bad_views_are_refused_where_they_are_written(old: str, new: str, message: str) -> None:
    with pytest.raises(SpecError, match=message):
        loads_spec(_mixtral((old, new)), "bad.yaml")


def test_a_view_that_does_not_fit_the_tensor_is_a_bind_error() -> None:
    model, _ = ZOO["mixtral"]()
    text = _mixtral(("    view: [[0, 1], 2]", "    view: [[0, 1, 2, 3]]"), ('axes: ["cat(moe[i], moe[i] @ up[i], heads=E)", resid*]',
                                                                  'axes: ["cat(moe[i], moe[i] @ up[i], heads=E)"]'))
    with pytest.raises(BindError, match="gate_up_proj"):
        bind(loads_spec(text, "bad.yaml"), model)


def test_the_mixtral_spec_round_trips_with_its_views() -> None:
    spec = symspec.load_spec("mixtral")
    again = loads_spec(dump_spec(spec), "again.yaml")
    assert again.params == spec.params
    assert any(p.view == ((0, 1), (2,)) for p in again.params)


# -- wrong mixture-of-experts specs are caught ------------------------------------------------


@pytest.mark.parametrize(("replacements", "space"), [
    # one permutation of all E*f units: moves units between experts
    ([("group: Experts(E, S(f))", "group: S(E * f)"),
      ('model.layers.{i}.mlp.gate.weight: ["moe[i].router", resid*]', "model.layers.{i}.mlp.gate.weight: [_, resid*]")], "moe[*]"),
    # the router left in place while the experts move
    ([('model.layers.{i}.mlp.gate.weight: ["moe[i].router", resid*]', "model.layers.{i}.mlp.gate.weight: [_, resid*]")], "moe[*]"),
    # the scaling on the gate half instead of the up half
    ([('"cat(moe[i], moe[i] @ up[i], heads=E)"', '"cat(moe[i] @ up[i], moe[i], heads=E)"')], "up[*]"),
    # the units laid out as one block of gates then one of ups (no heads=E)
    ([('"cat(moe[i], moe[i] @ up[i], heads=E)"', '"cat(moe[i], moe[i] @ up[i])"')], "moe[*]"),
])
def test_a_wrong_mixture_of_experts_spec_fails_its_check(replacements: list[tuple[str, str]], space: str) -> None:
    model, inputs = ZOO["mixtral"]()
    spec = variant("mixtral", *replacements)
    report = assert_not_invariant(model, spec, inputs, dtypes=("float64",))
    assert space in {r.space for r in report.failed_rows()}
    assert max(r.max_rel for r in report.failed_rows()) > 1e-4


# -- the joint solver ------------------------------------------------------------------------


def _ctx() -> SolveContext:
    return SolveContext(device=torch.device("cpu"), dtype=torch.float64, timer=Timer(), max_iter=5)


@settings(max_examples=20, deadline=None)
@given(seed=st.integers(0, 2**16), n_exp=st.integers(2, 4), f=st.integers(2, 5))
def test_the_joint_solver_recovers_planted_experts_units_and_scales(seed: int, n_exp: int, f: int) -> None:
    """B's units are A's moved by a planted expert permutation, unit permutations and
    scales: gate rows (the experts alone) and up rows (experts after the scales) in the
    statistics; the solver finds them back exactly."""
    gen = torch.Generator().manual_seed(seed)
    outer, inner = Experts.of(n_exp, S(f)), D(n_exp * f)
    planted = outer.sample(gen)
    scales = inner.sample(gen, cond=4.0)
    n = n_exp * f
    gate_b, up_b = torch.randn(n, 7, generator=gen, dtype=torch.float64), torch.randn(n, 7, generator=gen, dtype=torch.float64)
    router_b = torch.randn(n_exp, 7, generator=gen, dtype=torch.float64)
    p = outer.matrix(planted)
    gate_a, up_a = p @ gate_b, p @ inner.matrix(scales) @ up_b
    router_a = outer.matrix(planted, ("router",)) @ router_b

    def term(a: torch.Tensor, b: torch.Tensor, path: tuple[str, ...], role: str) -> StatTerm:
        return StatTerm(path, "co", a @ b.T, b @ b.T, (a * a).sum(1), role=role, inner_variance="co" if role == "pair" else None)

    terms = [term(gate_a, gate_b, (), "outer"), term(up_a, up_b, (), "pair"), term(router_a, router_b, ("router",), "outer")]
    got, d = solve_experts_scaling(outer, inner, terms, (outer.identity(), inner.identity()), _ctx())
    assert outer.equal(got, planted)
    assert torch.allclose(inner.matrix(d), inner.matrix(scales), atol=1e-9)


def test_the_per_space_certificate_of_experts_is_the_brute_force_minimum() -> None:
    """Given the other spaces, the bound for Experts(2, S(3)) is exact: it equals the
    minimum over all 2! * 3!^2 = 72 elements of the terms the space touches, and the
    result is no better than it."""
    import itertools

    from symspec.transforms import apply_elements

    a, _ = ZOO["mixtral"](seed=0, n_ff=3, experts=2, n_layer=1)
    b, _ = ZOO["mixtral"](seed=1, n_ff=3, experts=2, n_layer=1)
    res = symspec.align(a.double(), b.double(), "mixtral", rounds=2)
    sb = next(s for s in res.certify(joint=False).per_space if s.space == "moe[0]")
    problem = res.bound.problem
    group = problem.spaces["moe[0]"].group
    params = problem.params_of("moe[0]")
    best = float("inf")
    for perm in itertools.permutations(range(2)):
        for w0, w1 in itertools.product(itertools.permutations(range(3)), repeat=2):
            e = group._assemble(torch.tensor(perm), torch.zeros(2, 1, dtype=torch.int64),
                                {"": {"perm": torch.tensor([w0, w1])}, "router": Id(1).identity(batch=(2,))})
            moved = apply_elements(problem, {**res.elements, "moe[0]": e}, res.canonical_b)
            best = min(best, sum(float((res.canonical_a[p] - moved[p]).square().sum()) for p in params))
    assert sb.kind == "exact"
    assert sb.bound == pytest.approx(best, rel=1e-9, abs=1e-12)
    assert sb.value >= best - 1e-12


@pytest.mark.parametrize("n_ff, switched", [(6, True), (8, False)])
def test_a_mixtral_folder_with_unaligned_experts_loads_with_batched_products(tmp_path, n_ff: int, switched: bool) -> None:
    """A saved Mixtral loads with transformers' grouped_mm experts, whose CPU kernel needs
    16-byte strides: with 6 units per expert (24-byte rows) every forward failed, so
    `symspec check` on the folder did. The loader switches such a model to batched_mm (the
    same products) and leaves an aligned one (8 units) as it is."""
    from symspec.loading import load_model

    from .cli_files import run

    model, inputs = ZOO["mixtral"](n_ff=n_ff)
    model.save_pretrained(tmp_path / "m")
    loaded = load_model(tmp_path / "m").model
    assert loaded.config._experts_implementation == ("batched_mm" if switched else "grouped_mm")
    with torch.no_grad():
        want = model(**inputs).logits
        got = loaded(**inputs).logits
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    code, out, err = run("check", str(tmp_path / "m"))
    assert code == 0, out + err
