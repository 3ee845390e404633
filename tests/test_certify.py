"""Certificates: a lower bound on weight matching's global minimum (symspec.solvers.certify).

On problems small enough to enumerate every group element: bound <= the brute-force
optimum <= the solver's result; on planted pairs the gap is 0 to rounding; where a
searched group is not norm-preserving (GL) the bound is refused, not guessed.
"""

from __future__ import annotations

import itertools
from typing import Any

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
    cert = result.certify()
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
    cert = align(model_a, model_b, "nanogpt").certify()  # GL per head: not norm-preserving
    assert not cert.available and cert.bound is None and "GL" in cert.reason
    cert = align(model_a, model_b, "nanogpt", groups="perm").certify()
    assert cert.available and 0 <= cert.bound <= cert.value


def test_match_certify_in_the_report(tmp_path: Any) -> None:
    import json

    a, b = tmp_path / "a.pt", tmp_path / "b.pt"
    model_a, _ = ZOO["nanogpt"]()
    model_b, _ = ZOO["nanogpt"](seed=1)
    torch.save(model_a.state_dict(), a)
    torch.save(model_b.state_dict(), b)
    factory = tmp_path / "m.py"
    factory.write_text(
        "import sys\n"
        f"sys.path.insert(0, {str(EXAMPLES.parent)!r})\n"
        "from tests.zoo import ZOO\n"
        "def build():\n    return ZOO['nanogpt']()[0]\n"
        "def example_inputs(model, batch=2, seed=0):\n    return ZOO['nanogpt'](seed=seed)[1]\n")
    code, out, err = run("match", a, b, "--model", factory, "--out", tmp_path / "o", "--groups", "perm", "--certify")
    assert code == 0, err
    cert = json.loads((tmp_path / "o" / "match.json").read_text())["certificate"]
    assert cert["available"] and 0 <= cert["lower_bound"] <= cert["objective"] and "certificate:" in out
    code, out, err = run("match", a, b, "--model", factory, "--out", tmp_path / "o2", "--certify")
    assert code == 0, err
    assert not json.loads((tmp_path / "o2" / "match.json").read_text())["certificate"]["available"]
