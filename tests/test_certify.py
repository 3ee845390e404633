"""Certificates: a lower bound on weight matching's global minimum (symspec.certify).

On problems small enough to enumerate every group element: bound <= the brute-force
optimum <= the solver's result; on planted pairs the gap is 0 to rounding; where a
searched group is not norm-preserving (GL) the bound is refused, not guessed.
"""

from __future__ import annotations

import itertools
import sys
from typing import Any

import pytest
import torch
import torch.nn as nn
from hypothesis import given, settings
from hypothesis import strategies as st

from symspec.alignment import align
from symspec.binding import bind
from symspec.spec import loads_spec
from symspec.statedict import squared_distance
from symspec.transforms import apply_elements

from .cli_files import run
from .zoo import EXAMPLES, ZOO

MLP_SPEC = """
symspec: 1
name: mlp
dims:
  d: shape("fc1.weight", 1)
  h: shape("fc1.weight", 0)
  k: shape("fc2.weight", 0)
spaces:
  hid: S(h)
  hid2: S(k)
params:
  fc1.weight: [hid, _]
  fc1.bias: [hid]
  fc2.weight: [hid2, hid*]
  fc2.bias: [hid2]
  fc3.weight: [_, hid2*]
  fc3.bias: invariant
"""


class MLP(nn.Module):
    def __init__(self, d: int, h: int, k: int, seed: int) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.fc1, self.fc2, self.fc3 = nn.Linear(d, h), nn.Linear(h, k), nn.Linear(k, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc3(torch.relu(self.fc2(torch.relu(self.fc1(x)))))


def _brute(spec: Any, a: nn.Module, b: nn.Module) -> float:
    """min over every pair of permutations of the objective."""
    bound = bind(spec, a)
    problem = bound.problem
    sa = {k: v.double() for k, v in a.state_dict().items()}
    sb = {k: v.double() for k, v in b.state_dict().items()}
    h, k = problem.spaces["hid"].group.n, problem.spaces["hid2"].group.n
    best = float("inf")
    for p in itertools.permutations(range(h)):
        for q in itertools.permutations(range(k)):
            moved = apply_elements(problem, {"hid": {"perm": torch.tensor(p)}, "hid2": {"perm": torch.tensor(q)}}, sb)
            best = min(best, squared_distance(sa, moved, problem.params))
    return best


@settings(max_examples=10, deadline=None)
@given(h=st.integers(2, 5), k=st.integers(2, 4), seed=st.integers(0, 2**16))
def test_bound_below_the_brute_force_optimum_below_the_result(h: int, k: int, seed: int) -> None:
    spec = loads_spec(MLP_SPEC, "mlp.yaml")
    a, b = MLP(3, h, k, seed), MLP(3, h, k, seed + 1)
    result = align(a, b, spec)
    cert = result.certify(per_space=False, joint=False)
    assert cert.available
    best = _brute(spec, a, b)
    assert cert.bound <= best + 1e-9
    assert best <= cert.value + 1e-9
    assert abs(cert.value - result.distance("aligned")) < 1e-9


def test_planted_pairs_have_no_gap() -> None:
    """B = g.A for a random g: the bound is 0 and so is the gap of the recovered result."""
    from symspec.planting import plant

    spec = loads_spec(MLP_SPEC, "mlp.yaml")
    a = MLP(4, 6, 5, 0)
    b = plant(a, spec, seed=3).model
    cert = align(a, b, spec).certify()
    assert cert.available and cert.bound < 1e-9 and abs(cert.gap) < 1e-9


def test_independent_pairs_have_a_positive_gap_and_the_bound_is_not_trivial() -> None:
    spec = loads_spec(MLP_SPEC, "mlp.yaml")
    a, b = MLP(8, 16, 12, 0), MLP(8, 16, 12, 1)
    result = align(a, b, spec)
    cert = result.certify()
    assert 0 < cert.bound < cert.value
    assert cert.value < result.distance("canonical")  # matching helped
    assert set(cert.kinds) >= {"procrustes", "von-neumann", "rearrangement"}


def test_no_bound_for_groups_that_are_not_norm_preserving() -> None:
    model_a, _ = ZOO["nanogpt"]()
    model_b, _ = ZOO["nanogpt"](seed=1)
    cert = align(model_a, model_b, "nanogpt").certify(joint=False)  # GL per head: not norm-preserving
    assert not cert.available and cert.bound is None and "GL" in cert.reason
    cert = align(model_a, model_b, "nanogpt", groups="perm").certify(joint=False)
    assert cert.available and 0 <= cert.bound <= cert.value


def nanogpt_pair(tmp_path: Any, **kw: Any) -> tuple[Any, Any, Any]:
    """Two nanoGPT checkpoints of the zoo (seeds 0 and 1; ``kw`` to its builder) and the
    model file that builds them: (a.pt, b.pt, m.py)."""
    a, b = tmp_path / "a.pt", tmp_path / "b.pt"
    model_a, _ = ZOO["nanogpt"](**kw)
    model_b, _ = ZOO["nanogpt"](seed=1, **kw)
    torch.save(model_a.state_dict(), a)
    torch.save(model_b.state_dict(), b)
    factory = tmp_path / "m.py"
    factory.write_text(
        "import sys\n"
        f"sys.path.insert(0, {str(EXAMPLES.parent)!r})\n"
        "from tests.zoo import ZOO\n"
        f"def build():\n    return ZOO['nanogpt'](**{kw!r})[0]\n"
        f"def example_inputs(model, batch=2, seed=0):\n    return ZOO['nanogpt'](seed=seed, **{kw!r})[1]\n")
    return a, b, factory


def test_match_certify_in_the_report(tmp_path: Any) -> None:
    import json

    a, b, factory = nanogpt_pair(tmp_path)
    code, out, err = run("match", a, b, "--model", factory, "--out", tmp_path / "o", "--groups", "perm", "--certify")
    assert code == 0, err
    cert = json.loads((tmp_path / "o" / "match.json").read_text())["certificate"]
    assert cert["available"] and 0 <= cert["lower_bound"] <= cert["objective"] and "certificate:" in out
    assert {s["space"] for s in cert["per_space"]} == {"resid", "attn[0]", "attn[1]", "ff[0]", "ff[1]"}
    assert cert["joint"] and all("available" in j for j in cert["joint"]) and "per space" in out
    # the residual and every layer form a star: one Gram relaxation bounds the global minimum
    (joint,) = cert["joint"]
    assert joint["available"] and joint["whole_objective"] and joint["gram_size"] > 0
    assert joint["bound"] <= joint["value"] and "Gram SDP over the interacting spaces" in out
    code, out, err = run("match", a, b, "--model", factory, "--out", tmp_path / "o2", "--certify")
    assert code == 0, err
    cert = json.loads((tmp_path / "o2" / "match.json").read_text())["certificate"]
    assert not cert["available"]
    assert {s["space"]: s["kind"] for s in cert["per_space"]}["attn[0]"] == "relaxation"


# -- per-space bounds, the joint relaxation, lifted pairs ----------------------------------------

REC_SPEC = """
symspec: 1
name: rec
dims:
  h: shape("fc1.weight", 0)
spaces:
  hid: S(h)
params:
  fc1.weight: [hid, _]
  mix.weight: [hid, hid*]
  fc2.weight: [_, hid*]
"""


class Rec(nn.Module):
    """A hidden layer read by a square one: the space acts on both axes of mix.weight."""

    def __init__(self, h: int, seed: int) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.fc1 = nn.Linear(3, h, bias=False)
        self.mix = nn.Linear(h, h, bias=False)
        self.fc2 = nn.Linear(h, 2, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.mix(torch.relu(self.fc1(x)))))


def _f64(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.double() for k, v in model.state_dict().items()}


def _brute_space(result: Any, space: str) -> float:
    """min over the permutations of one space, the others at the result, of the
    objective of the parameters it touches."""
    problem = result.bound.problem
    params = problem.params_of(space)
    n = problem.spaces[space].group.n
    best = float("inf")
    for p in itertools.permutations(range(n)):
        elems = dict(result.elements)
        elems[space] = {"perm": torch.tensor(p)}
        moved = apply_elements(problem, elems, result.canonical_b)
        best = min(best, squared_distance(result.canonical_a, moved, params))
    return best


@settings(max_examples=6, deadline=None)
@given(h=st.integers(2, 5), k=st.integers(2, 4), seed=st.integers(0, 2**16))
def test_per_space_bounds_equal_the_brute_force_over_that_space(h: int, k: int, seed: int) -> None:
    """Permutation spaces are exact: bound == min over that space (brute force) <= value."""
    spec = loads_spec(MLP_SPEC, "mlp.yaml")
    result = align(MLP(3, h, k, seed), MLP(3, h, k, seed + 1), spec)
    cert = result.certify(joint=False)
    assert {s.space for s in cert.per_space} == {"hid", "hid2"}
    for s in cert.per_space:
        best = _brute_space(result, s.space)
        assert s.kind == "exact"
        assert abs(s.bound - best) < 1e-9 and best <= s.value + 1e-9
        assert s.optimal == (s.value - best <= 1e-9)


@settings(max_examples=4, deadline=None)
@given(h=st.integers(2, 4), k=st.integers(2, 3), seed=st.integers(0, 2**16))
def test_joint_sdp_below_the_brute_force_optimum(h: int, k: int, seed: int) -> None:
    spec = loads_spec(MLP_SPEC, "mlp.yaml")
    a, b = MLP(3, h, k, seed), MLP(3, h, k, seed + 1)
    cert = align(a, b, spec).certify(per_space=False)
    (joint,) = cert.joint
    assert joint.available and joint.whole and joint.size == h * h + k * k
    best = _brute(spec, a, b)
    assert joint.bound <= best + 1e-9 <= cert.value + 2e-9
    assert cert.bound <= best + 1e-9


def test_joint_sdp_is_tighter_than_the_decoupled_bound() -> None:
    """Measured, not assumed: on these independent pairs the SDP closes most of the
    decoupled bound's gap to the brute-force optimum (here it reaches it to 1e-6)."""
    spec = loads_spec(MLP_SPEC, "mlp.yaml")
    for seed in (0, 2):
        a, b = MLP(3, 5, 4, seed), MLP(3, 5, 4, seed + 1)
        result = align(a, b, spec)
        cert = result.certify(per_space=False)
        best = _brute(spec, a, b)
        sdp = cert.joint[0].bound
        assert cert.bound < 0.5 * best  # the decoupled bound is loose
        assert best - 1e-6 <= sdp <= best + 1e-9
        assert cert.best_bound() == sdp
    # seed 0: weight matching stops above the optimum, and only the SDP proves it
    assert cert.value - sdp > 1e-3 or seed == 2


def test_quadratic_space_relaxation_and_a_wrong_bound_caught() -> None:
    """A space on both axes of a parameter: the doubly stochastic relaxation is below the
    brute-force optimum (and not tight: a relaxation); the SDP is below it too. A
    naive per-space bound from weight matching's linearised terms (each incidence with
    the other one fixed) is not a bound: the brute force catches it."""
    from symspec.solvers.engine.base import SolveContext, objective, solver_for
    from symspec.solvers.engine.weight_statistics import WeightStatistics

    spec = loads_spec(REC_SPEC, "rec.yaml")
    a, b = Rec(5, 0), Rec(5, 1)
    result = align(a, b, spec)
    cert = result.certify()
    best = _brute_space(result, "hid")
    (s,) = cert.per_space
    assert s.kind == "relaxation" and "doubly stochastic" in s.method
    assert s.bound <= best + 1e-9 <= s.value + 2e-9
    assert best - s.bound > 0.1  # not tight here
    assert cert.joint[0].bound <= best + 1e-9 and best - cert.joint[0].bound < 1e-6
    problem = result.bound.problem
    stats = WeightStatistics(problem, result.canonical_a, result.canonical_b, SolveContext(), init=result.elements)
    group = problem.spaces["hid"].group
    terms = stats.terms("hid")
    naive = float(objective(group, terms, solver_for(group).solve(group, terms, group.identity(), SolveContext())))
    assert naive > best + 1.0  # caught


NEEDS = "not available: needs cvxpy (pip install 'symspec[convex]')"


def test_without_cvxpy_every_bound_that_needs_it_is_listed(monkeypatch: Any) -> None:
    """cvxpy hidden: the doubly stochastic per-space bound falls back to the decoupled one
    (still a bound) and the joint Shor relaxation is not available; the certificate lists
    both, each with how to get cvxpy. With cvxpy (the control) it lists none."""
    spec = loads_spec(REC_SPEC, "rec.yaml")
    result = align(Rec(5, 0), Rec(5, 1), spec)
    assert result.certify().not_available == []
    monkeypatch.setitem(sys.modules, "cvxpy", None)  # import cvxpy raises ImportError
    cert = result.certify()
    assert cert.not_available == [f"joint bound (all): the Shor SDP relaxation over hid: {NEEDS}",
                                  f"per-space bound of hid: the doubly stochastic relaxation: {NEEDS}"]
    assert cert.to_dict()["not_available"] == cert.not_available
    (s,) = cert.per_space
    assert s.bound <= _brute_space(result, "hid") + 1e-9 and NEEDS in s.method
    (j,) = cert.joint
    assert not j.available and j.reason.endswith(NEEDS)


def test_match_certify_without_cvxpy_says_what_it_could_not_bound(tmp_path: Any, monkeypatch: Any) -> None:
    """A permutation-only problem: the Gram relaxation of the residual's star needs cvxpy;
    the CLI prints and match.json lists it (once 'cvxpy is not installed', no bound named)."""
    import json

    a, b, factory = nanogpt_pair(tmp_path, n_layer=1)
    args = ["match", a, b, "--model", factory, "--groups", "perm", "--certify"]
    code, out, err = run(*args, "--out", tmp_path / "with")
    assert code == 0, err
    assert json.loads((tmp_path / "with" / "match.json").read_text())["certificate"]["not_available"] == []
    assert NEEDS not in out
    monkeypatch.setitem(sys.modules, "cvxpy", None)
    code, out, err = run(*args, "--out", tmp_path / "without")
    assert code == 0, err
    cert = json.loads((tmp_path / "without" / "match.json").read_text())["certificate"]
    (line,) = cert["not_available"]
    assert line == f"joint bound (all): the Gram SDP relaxation over resid, attn[0], ff[0]: {NEEDS}"
    assert f"  {line}\n" in out and cert["available"]  # the decoupled bound needs no cvxpy


#: ``symspec ARGS`` in a subprocess whose SCS solves print "solving" and, with
#: SYMSPEC_TEST_HANG=1, never converge (only an interrupt ends them)
SLOW_SCS = """
import os, sys
from symspec.certify import sdp
from symspec.solvers import convex
real = convex.solve
def solve(prob, solver, **opts):
    if os.environ.get("SYMSPEC_TEST_HANG") and solver == "SCS":
        sdp.SCS_ITERS = opts["max_iters"] = 10**9
        opts["eps"] = 1e-300
    print("solving", file=sys.stderr, flush=True)
    return real(prob, solver, **opts)
convex.solve = solve
from symspec.cli.main import main
main(sys.argv[1:])
"""


@pytest.mark.parametrize("hang", [True, False], ids=["interrupted", "control"])
def test_ctrl_c_during_the_sdp_solve_exits_130(tmp_path: Any, hang: bool) -> None:
    """SCS catches SIGINT itself and returns "interrupted", which cvxpy reports as a
    failed solve: the certificate retried with Clarabel, which on a small GPT-2 tried to
    allocate 218 GB and aborted (exit -6). Now Ctrl-C in the solve exits 130 with
    'interrupted' and writes nothing; the control (no interrupt) finishes and writes."""
    import os
    import signal
    import subprocess
    import time

    a, b, factory = nanogpt_pair(tmp_path, n_layer=1)
    env = {**os.environ, "SYMSPEC_TEST_HANG": "1" if hang else ""}
    proc = subprocess.Popen([sys.executable, "-c", SLOW_SCS, "match", str(a), str(b), "--model", str(factory), "--groups",
                             "perm", "--certify", "--out", "out"], cwd=tmp_path, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stderr is not None
        assert proc.stderr.readline() == "solving\n"
        if hang:
            time.sleep(0.5)  # inside SCS's iterations
            proc.send_signal(signal.SIGINT)
        err = proc.communicate(timeout=120)[1]
    finally:
        proc.kill()
    if not hang:
        assert proc.returncode == 0, err
        assert (tmp_path / "out" / "match.json").exists()
        return
    assert proc.returncode == 130, (proc.returncode, err)
    assert err.strip().splitlines()[-1] == "interrupted" and "Traceback" not in err
    assert not [p.name for p in tmp_path.iterdir() if p.name == "out" or p.name.startswith(".symspec-staging")]


def test_vanilla_averaging_has_no_certificate() -> None:
    """--method none searched no group (raw weights, no elements): its certificate was
    KeyError: 'resid' from the per-space bounds; now one input error. Weight matching's
    result (the control) is certified."""
    from symspec.errors import SymspecInputError

    spec = loads_spec(REC_SPEC, "rec.yaml")
    assert align(Rec(4, 0), Rec(4, 1), spec).certify().per_space
    with pytest.raises(SymspecInputError, match=r"^--method none aligns nothing"):
        align(Rec(4, 0), Rec(4, 1), spec, method="none").certify()


def test_a_failed_scs_solve_is_retried_with_clarabel_only_where_it_fits(monkeypatch: Any) -> None:
    """Clarabel's KKT system is dense in a PSD cone's entries: for the 574 x 574 Gram
    matrix of the report exactly the 217866005000 bytes it failed to allocate. A failed
    SCS solve is retried with Clarabel where that fits, else the bound is not available."""
    from symspec.solvers import convex

    from .needs import optional

    cp = optional("cvxpy")
    y = cp.Variable((574, 574), PSD=True)
    assert convex.interior_point_bytes(cp.Problem(cp.Maximize(cp.trace(y)), [cp.trace(y) <= 1])) == 217866005000
    result = align(Rec(5, 0), Rec(5, 1), loads_spec(REC_SPEC, "rec.yaml"))

    def fails(*a: Any, **k: Any) -> None:
        raise cp.error.SolverError("Solver 'SCS' failed")

    monkeypatch.setattr(convex, "solve", fails)
    (j,) = result.certify().joint
    assert j.available and "CLARABEL" in j.reason  # small: retried
    monkeypatch.setattr(convex, "INTERIOR_POINT_MAX_BYTES", 0)
    (j,) = result.certify().joint
    assert not j.available and "SCS failed" in j.reason and "Clarabel would need" in j.reason


def test_an_inaccurate_sdp_solve_still_gives_a_valid_bound(monkeypatch: Any) -> None:
    """The joint bound is certified by weak duality with the multipliers the solver
    returns: three SCS iterations give a loose bound, never a wrong one."""
    import symspec.certify.sdp as sdp

    spec = loads_spec(REC_SPEC, "rec.yaml")
    result = align(Rec(5, 0), Rec(5, 1), spec)
    monkeypatch.setattr(sdp, "SCS_ITERS", 3)
    loose = result.certify(per_space=False).joint[0].bound
    assert 0 <= loose < _brute_space(result, "hid") - 1.0


def test_planted_pairs_give_zero_gaps_everywhere() -> None:
    from symspec.planting import plant

    spec = loads_spec(MLP_SPEC, "mlp.yaml")
    a = MLP(4, 5, 4, 0)
    cert = align(a, plant(a, spec, seed=3).model, spec).certify()
    assert all(abs(s.gap) < 1e-9 and s.optimal for s in cert.per_space)
    (joint,) = cert.joint
    assert joint.available and joint.value < 1e-9 and abs(joint.gap) < 1e-6


def test_gl_heads_get_a_per_space_bound() -> None:
    """nanoGPT's default groups (GL per head): per-space bounds instead of 'not
    available'; a planted pair has gap 0 in every space; the GL relaxation is below the
    objective at random within-head elements (its minimum is not known)."""
    from symspec.planting import plant

    model_a, _ = ZOO["nanogpt"]()
    model_b, _ = ZOO["nanogpt"](seed=1)
    result = align(model_a, model_b, "nanogpt")
    cert = result.certify(joint=False)
    assert not cert.available  # the global decoupled bound still needs orthogonal groups
    kinds = {s.space: s for s in cert.per_space}
    assert set(kinds) == {"resid", "attn[0]", "attn[1]", "ff[0]", "ff[1]"}
    assert kinds["attn[0]"].kind == "relaxation" and kinds["resid"].kind == "exact" and kinds["ff[0]"].kind == "exact"
    assert all(0 <= s.bound <= s.value + s.noise for s in cert.per_space)
    problem = result.bound.problem
    group = problem.spaces["attn[0]"].group
    params = problem.params_of("attn[0]")
    for seed in range(5):
        elems = dict(result.elements)
        elems["attn[0]"] = group.sample(seed)
        moved = apply_elements(problem, elems, result.canonical_b)
        assert kinds["attn[0]"].bound <= squared_distance(result.canonical_a, moved, params)
    planted = align(model_a, plant(model_a, "nanogpt", seed=2).model, "nanogpt").certify(joint=False)
    assert all(s.gap < 1e-6 * max(1.0, s.value) for s in planted.per_space)


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 2**16), positive=st.booleans())
def test_diagonal_scaling_bound_is_the_minimum_per_unit(seed: int, positive: bool) -> None:
    """D/Dpos per unit: the quartic's roots give the minimum of f(d) = -2 c d + g d^2 -
    2 c'/d + g'/d^2; a dense grid never goes below it and comes close to it."""
    from symspec.certify.space import _unit_min

    gen = torch.Generator().manual_seed(seed)
    a, b, a2, b2 = (torch.randn(4, generator=gen, dtype=torch.float64) for _ in range(4))
    c1, g2, cc, gc = float(a @ b), float(b @ b), float(a2 @ b2), float(b2 @ b2)
    signs = (1.0,) if positive else (1.0, -1.0)
    bound = min(_unit_min(c1, g2, cc, gc, s) for s in signs)
    d = torch.logspace(-3, 3, 200001, dtype=torch.float64)
    d = d if positive else torch.cat([d, -d])
    grid = float((-2 * c1 * d + g2 * d * d - 2 * cc / d + gc / (d * d)).min())
    assert bound <= grid + 1e-9 and grid - bound < 1e-4 * (1 + abs(bound))


def test_llama_scalings_and_rope_heads() -> None:
    """Llama's default groups: O residual and permutations exact, D scalings exact per
    unit, GQA heads with RoPE/GL parts relaxed; every bound below its value."""
    model_a, _ = ZOO["llama"](n_ff=6)
    model_b, _ = ZOO["llama"](seed=1, n_ff=6)
    cert = align(model_a, model_b, "llama").certify()
    kinds = {s.space: s.kind for s in cert.per_space}
    assert kinds["up[0]"] == "exact" and kinds["mlp[0]"] == "exact" and kinds["attn[0]"] == "relaxation"
    assert all(0 <= s.bound <= s.value + s.noise for s in cert.per_space)
    # the joint bound models the residual O(16) with the units (their scaling fixed at the
    # result, acting before the permutation): a star for the Gram relaxation, N = 256 + 72
    # being far too large to lift; the RoPE/GL heads and the scalings stay fixed
    (joint,) = cert.joint
    assert joint.available and joint.spaces == ("resid", "mlp[0]", "mlp[1]") and joint.size == 0
    assert "Gram SDP" in joint.reason and {"attn[0]", "up[0]"} <= set(joint.fixed)
    assert joint.bound <= joint.value + joint.noise
    # without the Gram relaxation, one layer at a time: its units alone, exactly
    (first, _) = align(model_a, model_b, "llama").certify(per_space=False, gram_limit=0).joint
    mlp = next(s for s in cert.per_space if s.space == "mlp[0]")
    assert first.spaces == ("mlp[0]",) and "exact" in first.reason
    assert abs(first.bound - mlp.bound) <= first.noise + mlp.noise


def test_width_lifted_pairs_are_certified_as_lifted() -> None:
    model_a, _ = ZOO["nanogpt"](n_ff=8)
    model_b, _ = ZOO["nanogpt"](seed=1, n_ff=4)
    result = align(model_a, model_b, "nanogpt", groups="perm")
    assert "lift" in result.info
    cert = result.certify(joint=False)
    assert cert.available and "lifted" in cert.reason and "not part of the group" in cert.reason
    assert cert.to_dict()["lift"]["spaces"]["ff[0]"] == {"from": 4, "to": 8, "kind": "semiperm"}
    assert 0 <= cert.bound <= cert.value and all(s.bound <= s.value + s.noise for s in cert.per_space)
    assert abs(cert.value - result.distance("aligned")) < 1e-9


# -- spaces that interact with none: exact at any size ----------------------------------------

ONE_SPEC = """
symspec: 1
name: one
dims:
  h: shape("fc1.weight", 0)
spaces:
  hid: S(h)
params:
  fc1.weight: [hid, _]
  fc1.bias: [hid]
  fc2.weight: [_, hid*]
  fc2.bias: invariant
  fc3.weight: invariant
  fc3.bias: invariant
"""


@settings(max_examples=6, deadline=None)
@given(h=st.integers(2, 6), seed=st.integers(0, 2**16))
def test_a_space_that_interacts_with_none_is_bounded_by_its_exact_minimum(h: int, seed: int) -> None:
    """One permutation space, no parameter carrying it twice: the objective is linear in
    it, and the joint bound is its assignment optimum, equal to the brute-force minimum
    (not merely below it), over the whole objective."""
    spec = loads_spec(ONE_SPEC, "one.yaml")
    result = align(MLP(3, h, 3, seed), MLP(3, h, 3, seed + 1), spec)
    (joint,) = result.certify(per_space=False).joint
    assert joint.available and joint.whole and joint.size == 0 and "exact" in joint.reason
    best = _brute_space(result, "hid") + squared_distance(
        result.canonical_a, result.canonical_b, [p for p in result.bound.problem.params if not p.startswith("fc1")
                                                 and p != "fc2.weight"])
    assert abs(joint.bound - best) <= 1e-9 * max(1.0, best) + joint.noise
    assert joint.bound <= joint.value + joint.noise


def test_a_layers_spaces_with_the_residual_fixed_are_bounded_exactly_at_64_units() -> None:
    """nanoGPT with 64 units per layer (N = 4096 for one layer's units alone, far beyond
    the SDP): with the residual fixed, a layer's heads and units share no parameter, so
    the joint bound over the layer is exact: the sum of the per-space minima (computed
    by another code path), and no element of the layer's units goes below it."""
    model_a, _ = ZOO["nanogpt"](n_ff=64)
    model_b, _ = ZOO["nanogpt"](seed=1, n_ff=64)
    result = align(model_a, model_b, "nanogpt", groups="perm")
    cert = result.certify(gram_limit=0)  # no Gram relaxation: the residual cannot join a layer
    per = {s.space: s for s in cert.per_space}
    assert [j.scope for j in cert.joint] == ["layer 0", "layer 1"]
    problem = result.bound.problem
    for i, j in enumerate(cert.joint):
        assert j.available and j.spaces == (f"attn[{i}]", f"ff[{i}]") and "resid" in j.fixed and j.size == 0
        assert abs(j.value - sum(per[s].value for s in j.spaces)) <= 1e-9 * j.value
        assert abs(j.bound - sum(per[s].bound for s in j.spaces)) <= j.noise + sum(per[s].noise for s in j.spaces)
        params = list({p for s in j.spaces for p in problem.params_of(s)})
        for seed in range(4):
            elems = dict(result.elements)
            elems[f"ff[{i}]"] = problem.spaces[f"ff[{i}]"].group.sample(seed)
            moved = apply_elements(problem, elems, result.canonical_b)
            assert j.bound <= squared_distance(result.canonical_a, moved, params)
    from symspec.planting import plant

    twin = plant(model_a, "nanogpt", seed=2, spaces=["ff[0]", "ff[1]"]).model
    planted = align(model_a, twin, "nanogpt", groups="perm").certify(gram_limit=0)
    assert all(j.available and abs(j.gap) <= 1e-6 * max(1.0, j.value) for j in planted.joint)


def test_interacting_spaces_are_lifted_and_a_wrong_split_is_refused(monkeypatch: Any) -> None:
    """hid and hid2 both act on fc2.weight: they interact and go to the SDP together.
    Past the limit (11 + 11 units: N = 242) the bound says so. Split wrongly into two
    exact problems (each counting fc2.weight), the model no longer reproduces the
    objective and the bound is refused, not reported."""
    import symspec.certify.joint as cj

    spec = loads_spec(MLP_SPEC, "mlp.yaml")
    small = align(MLP(3, 3, 3, 0), MLP(3, 3, 3, 1), spec)
    assert cj.components(small.bound.problem, ["hid", "hid2"]) == [(("hid", "hid2"), True)]
    big = align(MLP(3, 11, 11, 0), MLP(3, 11, 11, 1), spec)
    (joint,) = big.certify(per_space=False, gram_limit=32).joint
    assert not joint.available and "too large" in joint.reason and "N = 242" in joint.reason
    assert "Gram size 33 > 32" in joint.reason
    (gram,) = big.certify(per_space=False).joint  # a star of two: the Gram relaxation takes it
    assert gram.available and "Gram SDP" in gram.reason and gram.gram_size == 33
    assert gram.bound <= gram.value + gram.noise
    (good,) = small.certify(per_space=False).joint
    assert good.available and "Shor" in good.reason
    monkeypatch.setattr(cj, "components", lambda problem, chosen: [((s,), False) for s in chosen])
    (wrong,) = small.certify(per_space=False).joint
    assert not wrong.available and "does not reproduce the objective" in wrong.reason
