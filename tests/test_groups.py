"""Group axioms, representations and the text form, property-tested over every kind."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from symspec.errors import GroupError
from symspec.groups import GL, OC, REGISTRY, SP, D, Dpos, Heads, O, RoPE, S, SemiPermutation, parse


@st.composite
def simple_groups(draw: st.DrawFn) -> object:
    n = draw(st.integers(1, 7))
    kind = draw(st.sampled_from(["S", "SP", "O", "OC", "GL", "D", "Dpos", "RoPE"]))
    if kind == "RoPE":
        n2 = 2 * draw(st.integers(1, 4))
        rot = 2 * draw(st.integers(0, n2 // 2))
        layout = draw(st.sampled_from(["half", "interleaved"]))
        return RoPE(n2, rot=rot, layout=layout)
    return REGISTRY[kind](n)


@st.composite
def groups(draw: st.DrawFn) -> object:
    if draw(st.booleans()):
        return draw(simple_groups())
    kv = draw(st.integers(1, 3))
    heads = kv * draw(st.integers(1, 3))
    dh = draw(st.integers(1, 4))
    qk = draw(st.sampled_from([GL(dh), O(dh), S(dh), D(dh)] + ([RoPE(dh)] if dh % 2 == 0 else [])))
    ov = draw(st.sampled_from([GL(dh), O(dh), S(dh)]))
    permute = draw(st.booleans())
    if draw(st.booleans()):
        return Heads(heads, (("", qk),), kv, permute)
    return Heads(heads, (("qk", qk), ("ov", ov)), kv, permute)


def _close(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.allclose(a, b, atol=1e-9, rtol=1e-9)


@given(groups(), st.integers(0, 2**16))
def test_text_form_round_trips(g: object, seed: int) -> None:
    assert parse(str(g)) == g
    assert hash(parse(str(g))) == hash(g)


@given(groups(), st.integers(0, 2**16))
def test_group_axioms(g, seed: int) -> None:  # type: ignore[no-untyped-def]
    a, b, c = g.sample(seed), g.sample(seed + 1), g.sample(seed + 2)
    e = g.identity()
    for path in g.rep_paths():
        m = lambda x, path=path: g.matrix(x, path)  # noqa: E731
        eye = torch.eye(g.rep_size(path), dtype=torch.float64)
        assert _close(m(e), eye)
        assert _close(m(g.compose(e, a)), m(a))
        assert _close(m(g.compose(a, e)), m(a))
        assert _close(m(g.compose(a, g.inverse(a))), eye)
        assert _close(m(g.compose(g.compose(a, b), c)), m(g.compose(a, g.compose(b, c))))
        # a homomorphism: rho(ab) = rho(a) rho(b), for co, contra
        for v in ("co", "contra"):
            assert _close(g.matrix(g.compose(a, b), path, v), g.matrix(a, path, v) @ g.matrix(b, path, v))
        # contra is the inverse transpose
        assert _close(g.matrix(a, path, "contra"), torch.linalg.inv(m(a)).mT)
        if g.is_orthogonal(path):
            assert _close(g.matrix(a, path, "contra"), m(a))
    assert g.contains(a) and g.contains(g.compose(a, b)) and g.contains(g.inverse(a)) and g.contains(e)


@given(groups(), st.integers(0, 2**16), st.integers(1, 3))
def test_apply_matches_matrix(g, seed: int, extra: int) -> None:  # type: ignore[no-untyped-def]
    a = g.sample(seed)
    gen = torch.Generator().manual_seed(seed)
    for path in g.rep_paths():
        x = torch.randn(g.rep_size(path), extra, 2, generator=gen, dtype=torch.float64)
        for v in ("co", "contra", "abs"):
            want = torch.einsum("ij,jkl->ikl", g.matrix(a, path, v), x)
            assert _close(g.apply(a, x, path, v), want)


def test_sampling_is_seeded() -> None:
    g = parse("Heads(4, qk=GL(3), ov=GL(3), kv=2)")
    assert g.equal(g.sample(7), g.sample(7))
    assert not g.equal(g.sample(7), g.sample(8))


def test_non_compact_samples_are_well_conditioned() -> None:
    for g in (GL(16), RoPE(16), D(16), Dpos(16)):
        m = g.matrix(g.sample(3, cond=10.0))
        s = torch.linalg.svdvals(m)
        assert float(s[0] / s[-1]) <= 10.0 + 1e-6


@pytest.mark.parametrize(
    ("group", "bad"),
    [
        (S(3), torch.tensor([[1.0, 0, 0], [1, 0, 0], [0, 0, 1]])),  # not a bijection
        (S(2), torch.tensor([[0.0, -1], [1, 0]])),  # a signed permutation is not in S
        (SP(2), torch.tensor([[0.5, 0], [0, 1]])),
        (O(3), torch.eye(3) * 2),
        (OC(3), torch.tensor([[0.0, 1, 0], [1, 0, 0], [0, 0, -1]])),  # orthogonal but moves the ones
        (GL(2), torch.tensor([[1.0, 2], [2, 4]])),  # singular
        (D(2), torch.tensor([[1.0, 1], [0, 1]])),
        (Dpos(2), torch.tensor([[-1.0, 0], [0, 1]])),
        (RoPE(4), torch.tensor([[1.0, 0, 1, 0], [0, 1, 0, 0], [0, 0, 1, 0], [0, 0, 0, 1]])),  # a != a across the pair
    ],
)
def test_membership_rejects_non_members(group, bad) -> None:  # type: ignore[no-untyped-def]
    assert not group.contains(bad.to(torch.float64))


def test_membership_accepts_members_of_natural_matrices() -> None:
    assert S(3).contains(torch.tensor([[0.0, 1, 0], [0, 0, 1], [1, 0, 0]]))
    assert OC(3).contains(OC(3).matrix(OC(3).sample(0)))
    assert not O(3).contains(GL(3).matrix(GL(3).sample(0)))


def test_centred_orthogonal_fixes_ones_and_commutes_with_centring() -> None:
    g = OC(6)
    q = g.matrix(g.sample(1))
    ones = torch.ones(6, dtype=torch.float64)
    assert _close(q @ ones, ones)
    c = torch.eye(6, dtype=torch.float64) - 1 / 6
    assert _close(q @ c, c @ q)


def test_rope_commutant_commutes_with_rotations() -> None:
    for layout in ("half", "interleaved"):
        g = RoPE(8, rot=6, layout=layout)
        m = g.matrix(g.sample(2))
        i1, i2 = g.pairs
        for theta in (0.3, 1.7):
            r = torch.eye(8, dtype=torch.float64)
            for k, (p, q) in enumerate(zip(i1.tolist(), i2.tolist())):
                ang = theta * (k + 1)
                r[p, p], r[p, q], r[q, p], r[q, q] = torch.cos(torch.tensor(ang)), -torch.sin(torch.tensor(ang)), torch.sin(torch.tensor(ang)), torch.cos(torch.tensor(ang))
            # q' = g q and k' = g^-T k keep q^T R k: g^T R g^-T = R
            assert _close(m.T @ r @ torch.linalg.inv(m).T, r)
        # a general GL map does not
        gl = GL(8).matrix(GL(8).sample(5))
        assert not _close(gl.T @ r @ torch.linalg.inv(gl).T, r)


def test_heads_gqa_views_and_sharing() -> None:
    g = parse("Heads(4, qk=GL(2), ov=GL(2), kv=2)")
    assert g.rep_size(("qk",)) == 8 and g.rep_size(("qk", "kv")) == 4
    a = g.sample(0)
    mq = g.matrix(a, ("qk",))
    mkv = g.matrix(a, ("qk", "kv"))
    # the query heads of a key/value group share its within-head block
    blocks = mq.reshape(4, 2, 4, 2).permute(0, 2, 1, 3)
    src = blocks.abs().amax((-1, -2)).argmax(1)
    for j in range(2):
        kv_src = int(mkv.reshape(2, 2, 2, 2).permute(0, 2, 1, 3).abs().amax((-1, -2)).argmax(1)[j])
        for t in range(2):
            i = 2 * j + t
            assert int(src[i]) // 2 == kv_src
            assert _close(blocks[i, src[i]], mkv.reshape(2, 2, 2, 2).permute(0, 2, 1, 3)[j, kv_src])
    assert g.contains(a)
    broken = dict(a)
    broken["perm"] = torch.tensor([0, 0])
    assert not g.contains(broken)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("Orth(4)", "did you mean 'O'"),
        ("S()", "needs size"),
        ("S(0)", "positive integer"),
        ("RoPE(6, rot=3)", "even integer"),
        ("Heads(6, GL(2), kv=4)", "must divide"),
        ("RoPE(4, layout=diagonal)", "half, interleaved"),
        ("GL(n)", "must be an integer"),
        ("S(3", "cannot parse"),
    ],
)
def test_bad_group_text(text: str, message: str) -> None:
    with pytest.raises(GroupError, match=message):
        parse(text)


def test_semi_permutations() -> None:
    rel = SemiPermutation(7, 4)
    for seed in range(5):
        t = rel.sample(seed)
        assert rel.contains(t)
        assert t.sum(0).allclose(torch.ones(4, dtype=torch.float64))
    assert SemiPermutation.parse("SemiPerm(7, 4)") == rel
    bad = rel.sample(0).clone()
    row = int((bad > 0).nonzero()[0, 0])
    bad[row] = 0.5  # two positive entries in a row
    assert not rel.contains(bad)
    assert not rel.contains(torch.ones(7, 4, dtype=torch.float64))  # columns do not sum to 1
    with pytest.raises(ValueError):
        SemiPermutation(3, 4)


def test_semi_permutation_widening_preserves_function() -> None:
    # h = gelu(W_in x), y = W_out h widened from 4 to 7 units: in-weights copied, out-weights shared.
    gen = torch.Generator().manual_seed(0)
    w_in = torch.randn(4, 5, generator=gen, dtype=torch.float64)
    w_out = torch.randn(3, 4, generator=gen, dtype=torch.float64)
    t = SemiPermutation(7, 4).sample(1)
    x = torch.randn(5, 2, generator=gen, dtype=torch.float64)
    y = w_out @ torch.nn.functional.gelu(w_in @ x)
    y2 = (w_out @ t.T) @ torch.nn.functional.gelu(SemiPermutation.support(t) @ w_in @ x)
    assert _close(y, y2)


@pytest.mark.parametrize(
    ("literal", "symbolic"),
    [("Heads(4)", "Heads(H)"), ("Heads(4, a=Heads(2, GL(2)))", "Heads(H, a=Heads(2, GL(2)))"),
     ("Heads(4, GL(2), qk=GL(2))", "Heads(H, GL(2), qk=GL(2))"), ("Heads(4, GL(2), bogus=3)", "Heads(H, GL(2), bogus=3)"),
     ("Heads(4, GL(2), 3)", "Heads(H, GL(2), 3)"), ("Orth(4)", "Orth(d)")],
)
def test_one_parser_reads_literal_and_spec_group_text(literal: str, symbolic: str) -> None:
    """symspec.groups.parse and a spec's group text (symspec.spec.groupexpr) share one
    parser: the same text form, the same refusals in the same words."""
    from symspec.spec.groupexpr import parse_group_expr

    with pytest.raises(GroupError) as lit:
        parse(literal)
    with pytest.raises(GroupError) as sym:
        parse_group_expr(symbolic)
    assert str(lit.value) == str(sym.value)


def test_spec_group_text_evaluates_to_the_literal_group() -> None:
    from symspec.spec.exprs import DimContext
    from symspec.spec.groupexpr import parse_group_expr

    e = parse_group_expr("Heads(H, qk=RoPE(d / H, rot=2), ov=GL(d / H), kv=K)")
    g = e.evaluate(DimContext({"H": 4, "d": 16, "K": 2}))
    assert g == parse("Heads(4, qk=RoPE(4, rot=2), ov=GL(4), kv=2)") and g.rep_paths() == e.rep_paths()
    with pytest.raises(GroupError, match="Heads: heads must be an integer, got 'H'"):  # literals only
        parse("Heads(H, GL(2))")


# -- groups test themselves: testing_elements() and symspec.testing.check_group ------------------------

#: groups of every registered kind, the smallest sizes and odd ones included (a new kind adds its own)
KIND_EXAMPLES: dict[str, list[str]] = {
    "S": ["S(1)", "S(2)", "S(5)"],
    "SP": ["SP(1)", "SP(4)"],
    "Id": ["Id(1)", "Id(3)"],
    "Sign": ["Sign(1)", "Sign(4)"],
    "O": ["O(1)", "O(2)", "O(5)"],
    "OC": ["OC(1)", "OC(2)", "OC(5)"],
    "GL": ["GL(1)", "GL(4)"],
    "D": ["D(1)", "D(3)"],
    "Dpos": ["Dpos(1)", "Dpos(3)"],
    "RoPE": ["RoPE(2)", "RoPE(6)", "RoPE(8, rot=4)", "RoPE(4, rot=0)", "RoPE(6, layout=interleaved)"],
    "Heads": ["Heads(1, GL(2))", "Heads(3, S(2))", "Heads(4, qk=RoPE(4), ov=GL(4), kv=2)", "Heads(2, qk=O(3), ov=OC(3))",
              "Heads(6, D(2), kv=3)", "Heads(4, qk=GL(2), ov=O(2), kv=2, perm=False)"],
    "Experts": ["Experts(1, S(3))", "Experts(3, GL(2))", "Experts(2, Dpos(2))"],
}


def test_every_registered_kind_has_check_group_examples() -> None:
    assert set(KIND_EXAMPLES) == set(REGISTRY), "a new group kind adds its sizes to KIND_EXAMPLES"
    for kind, texts in KIND_EXAMPLES.items():
        assert all(parse(t).kind == kind for t in texts)


@pytest.mark.parametrize("text", [t for texts in KIND_EXAMPLES.values() for t in texts])
def test_every_kind_passes_check_group(text: str) -> None:
    from symspec.testing import check_group

    group = parse(text)
    elements = group.testing_elements()
    assert len(elements) >= 2 and group.equal(elements[0], group.identity())
    assert all(group.equal(a, b) for a, b in zip(elements, group.testing_elements()))  # deterministic
    check_group(group)


def test_check_group_passes_a_correct_toy_kind() -> None:
    """The positive control for the broken variants below: the same toy kind, unbroken."""
    from symspec.testing import check_group

    from .toy_kinds import Cyc, registered

    with registered(Cyc):
        for n in (1, 2, 5):
            check_group(Cyc(n))


@pytest.mark.parametrize("name", ["WrongInverse", "WrongAction", "NotAssociative", "UnseededSample", "AcceptsZero"])
def test_check_group_names_the_law_a_broken_group_breaks(name: str) -> None:
    from symspec.testing import check_group

    from . import toy_kinds

    cls = getattr(toy_kinds, name)
    expected = f"Cyc\\(5\\) is not a valid group:\\n(.|\\n)*{toy_kinds.BROKEN[cls]}"
    with toy_kinds.registered(cls), pytest.raises(AssertionError, match=expected):
        check_group(cls(5))


def test_check_group_needs_a_parsable_text_form() -> None:
    """An unregistered kind cannot round-trip through its text: check_group says so."""
    from symspec.testing import check_group

    from .toy_kinds import Cyc

    with pytest.raises(AssertionError, match="text form: parse\\('Cyc\\(3\\)'\\) fails: unknown group 'Cyc'"):
        check_group(Cyc(3))


def test_heads_that_keep_their_places() -> None:
    """Heads(..., perm=False): per-head maps without a head permutation (a per-head table
    the model does not let move pins the heads: ALiBi's slopes, T5's relative position
    bias). Its elements and matrices never move a head, its samples neither; the same
    element with two heads swapped belongs to Heads(...) but not to it; with identity
    within-head groups it is trivial; perm takes True or False only."""
    fixed = parse("Heads(4, qk=GL(2), ov=GL(2), kv=2, perm=False)")
    free = parse("Heads(4, qk=GL(2), ov=GL(2), kv=2)")
    assert str(fixed) == "Heads(4, qk=GL(2), ov=GL(2), kv=2, perm=False)" and fixed != free
    e = fixed.sample(3)
    assert torch.equal(e["perm"], torch.arange(2)) and torch.equal(e["qperm"], torch.arange(2).expand(2, 2))
    assert fixed.contains(e) and free.contains(e)
    moved = dict(e)
    moved["perm"] = torch.tensor([1, 0])
    assert free.contains(moved) and not fixed.contains(moved)
    single = parse("Heads(2, GL(2), perm=False)")
    m = single.matrix(single.sample(1))
    assert single.contains(m)
    swap = torch.zeros(4, 4, dtype=m.dtype)
    swap[:2, 2:], swap[2:, :2] = m[:2, :2], m[2:, 2:]
    assert parse("Heads(2, GL(2))").contains(swap) and not single.contains(swap)
    assert parse("Heads(4, qk=Id(2), ov=Id(2), perm=False)").is_trivial() and not parse("Heads(4, qk=Id(2), ov=Id(2))").is_trivial()
    assert free.permutation_subgroup().permute and not fixed.permutation_subgroup().permute
    with pytest.raises(GroupError, match="perm must be True or False"):
        parse("Heads(4, GL(2), perm=0)")
