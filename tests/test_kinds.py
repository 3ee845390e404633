"""What a group kind needs, in one table per concern: every registered kind has an entry in
each table, or an explicit NoEntry with the reason, and each consumer refuses a kind it
has no entry for in one line naming the kind and the concern. The recipe for a new group
kind (docs/architecture.md) is complete: a toy kind registered from a test goes through
match, lifting and certify, each working or refusing it clearly."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from symspec.errors import GroupError
from symspec.groups import REGISTRY, NoEntry, S, has_entry, kind_entry

from .test_certify import MLP, MLP_SPEC
from .toy_kinds import Cyc, registered


def _tables() -> dict[str, dict[str, Any]]:
    """Concern -> its table keyed by group kind (each imported where it lives)."""
    from symspec.certify.certificate import ENTRYWISE
    from symspec.certify.model import VARIABLES
    from symspec.certify.space import BOUNDS
    from symspec.inference.lattice import CANDIDATES
    from symspec.learned.parametrize import PARAMETRIZATIONS
    from symspec.solvers import SOLVERS
    from symspec.width.fit import FITS
    from symspec.width.lifting import LIFTS

    return {"weight-matching solver": SOLVERS, "learned parametrisation": PARAMETRIZATIONS, "lift": LIFTS,
            "fitted lift": FITS, "per-space bound": BOUNDS, "decoupled bound's entrywise moves": ENTRYWISE,
            "joint relaxation's variable": VARIABLES, "inference candidate": CANDIDATES}


@pytest.mark.parametrize("concern", sorted(_tables()))
def test_every_registered_kind_has_an_entry_or_says_why_not(concern: str) -> None:
    table = _tables()[concern]
    missing = _uncovered(table)
    assert not missing, f"{concern}: no entry (nor a NoEntry with the reason) for the kind(s) {missing}"
    stale = sorted(set(table) - set(REGISTRY))
    assert not stale, f"{concern}: entries for kinds that are not registered: {stale}"
    for kind, value in table.items():
        if isinstance(value, NoEntry):
            assert len(value.reason) > 20, f"{concern}: {kind}'s NoEntry needs a reason a user can act on"


def _uncovered(table: dict[str, Any]) -> list[str]:
    return sorted(set(REGISTRY) - set(table))


def test_a_newly_registered_kind_is_uncovered_in_every_table_until_it_says_otherwise() -> None:
    """The negative case of the completeness test: the toy kind, registered, is missing
    from every table (and from none once it is gone again)."""
    with registered(Cyc):
        assert all(_uncovered(t) == ["Cyc"] for t in _tables().values())
    assert all(_uncovered(t) == [] for t in _tables().values())


def test_kind_entry_refuses_a_missing_kind_and_a_no_entry_in_one_line() -> None:
    table: dict[str, Any] = {"S": "solve", "RoPE": NoEntry("no permutations in a commutant")}
    assert kind_entry(table, "S", "toy") == "solve" and has_entry(table, "S") and not has_entry(table, "RoPE")
    with pytest.raises(GroupError, match=r"^no toy for group kind 'RoPE': no permutations in a commutant$"):
        kind_entry(table, "RoPE", "toy")
    with pytest.raises(GroupError, match=r"^x: no toy for group kind 'Cyc' \(Cyc\(3\)\): none registered \(kinds with one: S\)$"):
        kind_entry(table, Cyc(3), "toy", prefix="x: ")


# -- lifting -------------------------------------------------------------------------------------------

def test_a_kind_without_a_lift_is_refused_naming_the_space_kind_and_reason() -> None:
    """Experts has NoEntry in LIFTS: a wider expert is refused in one line (it once went
    through the head lift and failed deep inside); the same model widened elsewhere is
    the positive control (its unchanged experts lift by the identity)."""
    from symspec.spec import load_spec
    from symspec.width import LiftError, lift

    from .zoo import ZOO

    narrow, inputs = ZOO["mixtral"]()
    wide, _ = ZOO["mixtral"](seed=1, n_ff=8)
    with pytest.raises(LiftError, match=r"^moe\[0\]: Experts\(4, S\(6\)\) -> Experts\(4, S\(8\)\): no lift for group kind "
                                        r"'Experts': experts keep their number and width"):
        lift(narrow, wide, load_spec("mixtral"))
    # more heads and a wider residual: the fused expert weights are lifted through their view
    # (they once failed with an IndexError, read in their stored layout)
    more_heads, _ = ZOO["mixtral"](seed=1, n_head=8, n_kv=4)
    out = lift(narrow, more_heads, load_spec("mixtral"), inputs=inputs)
    assert out.error < 1e-12 and out.lifts["moe[0]"].kind == "identity" and out.lifts["resid"].kind == "stiefel"


# -- the recipe: a toy kind registered from a test --------------------------------------------------------

#: the MLP of the certificate tests with its first hidden layer under the toy kind
TOY_SPEC = MLP_SPEC.replace("name: mlp", "name: toy").replace("hid: S(h)", "hid: Cyc(h)")
assert "Cyc(h)" in TOY_SPEC


@pytest.fixture
def toy() -> Any:
    from symspec.spec import loads_spec

    with registered(Cyc):
        yield loads_spec(TOY_SPEC, "toy.yaml")


def test_the_toy_kind_is_a_valid_group(toy: Any) -> None:
    from symspec.testing import check_group

    check_group(Cyc(5))


def test_lifting_the_toy_kind_works_where_it_keeps_its_width_and_is_refused_where_not(toy: Any) -> None:
    from symspec.width import LiftError, lift

    x = torch.randn(7, 3, dtype=torch.float64)
    narrow = MLP(3, 5, 4, 0)
    out = lift(narrow, MLP(3, 5, 6, 1), toy, inputs=x)  # hid (Cyc) unchanged, hid2 (S) wider
    assert out.lifts["hid"].kind == "identity" and out.lifts["hid2"].kind == "semiperm" and out.error < 1e-12
    with pytest.raises(LiftError, match=r"^hid: Cyc\(5\) -> Cyc\(7\): no lift for group kind 'Cyc': none registered"):
        lift(narrow, MLP(3, 7, 4, 1), toy)


def test_match_refuses_the_toy_kind_without_a_solver_naming_it(toy: Any) -> None:
    from symspec import align
    from symspec.solvers import SolverError

    with pytest.raises(SolverError, match=r"^no weight-matching solver for group kind 'Cyc' \(Cyc\(5\)\): none registered"):
        align(MLP(3, 5, 4, 0), MLP(3, 5, 4, 1), toy)


def test_learned_matching_refuses_the_toy_kind_naming_the_missing_parametrisation(toy: Any) -> None:
    from symspec.learned.parametrize import ParamSettings, parametrize
    from symspec.solvers import SolverError

    with pytest.raises(SolverError, match=r"^no learned parametrisation for group kind 'Cyc' \(Cyc\(5\)\): none registered"):
        parametrize(Cyc(5), Cyc(5).identity(), ParamSettings())
    assert parametrize(S(5), S(5).identity(), ParamSettings()) is not None  # a registered kind has one


def _brute_force(group: Any, terms: Any, current: Any, ctx: Any) -> Any:
    """The toy kind's solver: every shift tried."""
    from symspec.solvers import objective

    best = min(range(group.n), key=lambda k: float(objective(group, terms, {"shift": torch.tensor(k)})))
    return {"shift": torch.tensor(best)}


@pytest.fixture
def toy_solver(toy: Any) -> Any:
    from symspec.solvers import SOLVERS, solver

    solver("Cyc", cheap_apply=True)(_brute_force)
    try:
        yield toy
    finally:
        del SOLVERS["Cyc"]


def test_with_a_solver_the_toy_kind_matches_a_planted_pair_and_certify_says_what_it_cannot_bound(toy_solver: Any) -> None:
    """A solver registered for the toy kind recovers B = g.A exactly; certify bounds the
    S space exactly and says, in one line naming the kind, that the toy space has no
    per-space bound; the decoupled bound (orthogonal actions) and the joint relaxation
    (the toy space held fixed, named) still hold."""
    from symspec import align
    from symspec.planting import plant

    a = MLP(3, 5, 4, 0)
    planted = plant(a, toy_solver, seed=3)
    result = align(a, planted.model, toy_solver)
    assert result.distance("aligned") < 1e-12 < result.distance("canonical")
    cert = result.certify()
    per_space = {sb.space: sb for sb in cert.per_space}
    assert per_space["hid2"].kind == "exact" and per_space["hid2"].optimal
    assert per_space["hid"].kind == "not available"
    assert per_space["hid"].method.startswith("no per-space bound for group kind 'Cyc' (Cyc(5)): none registered")
    assert cert.available and cert.bound is not None and cert.bound <= cert.value + 1e-9
    assert any("not modelled by the relaxation: Cyc(5)" in j.reason for j in cert.joint)
