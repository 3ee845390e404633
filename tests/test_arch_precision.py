"""The pieces real architectures needed in the core: float64 kept float64 inside models
that cast down (symspec.precision), the global sign group of post-LN residuals, and
attr() for models without a config."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from symspec.errors import BindError, GroupError
from symspec.groups import parse
from symspec.precision import KeepFloat64
from symspec.spec import loads_spec
from tests.zoo import ZOO

F64 = torch.float64


def test_keep_float64_keeps_every_kind_of_downcast() -> None:
    x = torch.linspace(-1, 1, 7, dtype=F64) / 3
    other32 = torch.zeros(2)
    with KeepFloat64() as keep:
        outs = [x.float(), x.half(), x.bfloat16(), x.to(torch.float32), x.to(dtype=torch.float32), x.to("cpu", torch.float32),
                x.to(other32), torch.softmax(x, 0, dtype=torch.float32), torch.nn.functional.softmax(x, dim=0, dtype=torch.float32)]
        untouched = [x.to(torch.int64), other32.to(torch.float16), x.to(F64), x * other32[0]]
    assert all(o.dtype == F64 for o in outs)
    assert torch.equal(outs[0], x) and torch.allclose(outs[-1], torch.softmax(x, 0))
    assert [u.dtype for u in untouched] == [torch.int64, torch.float16, F64, F64]
    assert keep.count == len(outs)
    assert set(keep.sites) == {"test_arch_precision.py:test_keep_float64_keeps_every_kind_of_downcast"}
    # outside the block nothing changed
    assert x.float().dtype == torch.float32


def test_keep_float64_can_only_count() -> None:
    x = torch.ones(3, dtype=F64)
    with KeepFloat64(rewrite=False) as seen:
        y = x.float()
        z = torch.softmax(x, 0, dtype=torch.float32)
    assert y.dtype == torch.float32 and z.dtype == torch.float32 and seen.count == 2


def test_hf_rmsnorm_is_float64_only_inside_the_mode() -> None:
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    norm = LlamaRMSNorm(16, eps=1e-6).double()
    with torch.no_grad():
        norm.weight.copy_(torch.linspace(0.5, 1.5, 16, dtype=F64))
        x = torch.randn(4, 16, dtype=F64, generator=torch.Generator().manual_seed(0)) * 3
        exact = norm.weight * x / torch.sqrt((x * x).mean(-1, keepdim=True) + 1e-6)  # the formula, in float64
        plain = norm(x)
        with KeepFloat64() as keep:
            kept = norm(x)
    assert plain.dtype == kept.dtype == F64
    assert float((kept - exact).abs().max()) < 1e-14
    assert float((plain - exact).abs().max()) > 1e-9  # the float32 cast inside LlamaRMSNorm
    assert set(keep.sites) == {"modeling_llama.py:LlamaRMSNorm.forward"}


@given(st.integers(1, 9), st.integers(0, 2**16))
def test_sign_group_axioms(n: int, seed: int) -> None:
    g = parse(f"Sign({n})")
    assert parse(str(g)) == g and str(g) == f"Sign({n})"
    a, b = g.sample(seed), g.sample(seed + 1)
    eye = torch.eye(n, dtype=F64)
    m = g.matrix
    assert torch.equal(m(g.compose(a, b)), m(a) @ m(b))
    assert torch.equal(m(g.compose(a, g.inverse(a))), eye)
    assert torch.equal(m(g.identity()), eye)
    assert g.contains(a) and g.contains(m(a)) and g.is_orthogonal()
    assert torch.equal(m(a, (), "contra"), m(a)) and torch.equal(m(a, (), "abs"), eye)
    assert not g.contains(2 * eye) and (n == 1 or not g.contains(torch.diag(torch.tensor([1.0] * (n - 1) + [-1.0], dtype=F64))))
    batched = g.sample(seed, batch=(3,))
    assert g.batch_shape(batched) == (3,) and g.apply(batched, torch.ones(3, n, 2)).shape == (3, n, 2)


def test_sign_group_samples_both_signs() -> None:
    g = parse("Sign(4)")
    assert {float(g.sample(s)["sign"]) for s in range(16)} == {-1.0, 1.0}


def test_attr_reads_model_attributes_and_says_what_is_missing() -> None:
    model, _ = ZOO["timm_vit"](n_head=4, head_dim=2)
    base = """
symspec: 1
name: t
dims:
  H: {expr}
spaces:
  s: S(H)
params:
  "{{p}}": invariant
  pos_embed: [_, _, s]
"""
    from symspec.binding import bind

    spec = loads_spec(base.format(expr='attr("blocks.0.attn.num_heads")').replace('"{p}"', "'{x}'"), "t.yaml")
    assert spec.dims[0].expr == 'attr("blocks.0.attn.num_heads")'
    ok = loads_spec(base.format(expr='attr("blocks.0.attn.num_heads") * 2').replace('  "{p}": invariant', "  cls_token: invariant"), "t.yaml")
    with pytest.raises(BindError) as info:
        bind(ok, model)  # every other parameter unbound: but H itself resolved
    assert not any("dimension H" in str(d) for d in info.value.diagnostics)
    missing = loads_spec(base.format(expr='attr("blocks.0.attn.heads")').replace('  "{p}": invariant', "  cls_token: invariant"), "t.yaml")
    with pytest.raises(BindError, match=r"dimension H = attr\(\"blocks.0.attn.heads\"\): attr\(\): the model has no 'blocks.0.attn.heads'"):
        bind(missing, model)
    private = loads_spec(base.format(expr='attr("blocks.0._private")').replace('  "{p}": invariant', "  cls_token: invariant"), "t.yaml")
    with pytest.raises(BindError, match="is not a path of public attribute names"):
        bind(private, model)
    with pytest.raises(GroupError):
        parse("Sign(0)")
