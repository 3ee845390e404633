"""Weight matching keeps IEEE float32 products whatever the caller set (TF32 on a GPU).

No GPU here: TF32 is emulated on the CPU by a torch function mode that rounds every
float32 matmul's inputs to TF32's 10-bit mantissa while the caller's setting allows TF32,
as cuBLAS would. The emulation is strong enough to matter (a negative control: rounding
regardless of the setting stops a planted Mixtral ~1000x further off), and with the
setting at TF32, weight matching's guard (symspec.precision.IEEEFloat32 around
match_weights) keeps the CPU's recovery.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.overrides import TorchFunctionMode

import symspec
from symspec.precision import IEEEFloat32, tf32_setting
from symspec.solvers import match_weights
from symspec.transforms import apply_elements

ROOT = Path(__file__).resolve().parent.parent
MATMULS = {torch.matmul, torch.Tensor.__matmul__, torch.Tensor.__rmatmul__, torch.mm, torch.bmm, torch.Tensor.mm,
           torch.Tensor.bmm, torch.Tensor.matmul, torch.einsum, torch.nn.functional.linear, torch.addmm,
           torch.baddbmm, torch.mv, torch.tensordot}


def to_tf32(x: Any) -> Any:
    """A float32 tensor rounded to TF32 (10 mantissa bits, round to nearest)."""
    if not (isinstance(x, torch.Tensor) and x.dtype == torch.float32):
        return x
    bits = x.contiguous().view(torch.int32)
    return ((bits + 0x1000) & ~0x1FFF).view(torch.float32).view(x.shape)


class EmulatedTF32(TorchFunctionMode):
    """Round float32 matmul inputs to TF32 where the setting allows TF32 (or ``always``)."""

    def __init__(self, always: bool = False) -> None:
        super().__init__()
        self.always = always
        self.rounded = 0

    def __torch_function__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None) -> Any:
        if func in MATMULS and (self.always or tf32_setting() is not None):
            self.rounded += 1
            args = (args[0], *map(to_tf32, args[1:])) if func is torch.einsum else tuple(map(to_tf32, args))
        return func(*args, **(kwargs or {}))


@pytest.fixture
def tf32_allowed() -> Iterator[None]:
    before = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("high")
    try:
        yield
    finally:
        torch.set_float32_matmul_precision(before)


@pytest.fixture(scope="module")
def planted() -> Any:
    transformers = pytest.importorskip("transformers")
    cfg = transformers.MixtralConfig(num_hidden_layers=1, hidden_size=16, num_attention_heads=4, num_key_value_heads=2,
                                     intermediate_size=8, vocab_size=31, num_local_experts=4, num_experts_per_tok=2,
                                     max_position_embeddings=16, tie_word_embeddings=False)
    torch.manual_seed(0)
    return symspec.plant(transformers.MixtralForCausalLM(cfg).eval(), "mixtral", seed=5, cond=3.0)


def recovery(planted: Any, mode: EmulatedTF32 | None = None) -> float:
    """||A - g.B|| / ||A|| (float64) after weight matching canonical B onto canonical A."""
    problem = planted.bound.problem
    sd_a = {k: v.detach() for k, v in planted.canonical.state_dict().items()}
    sd_b = {k: v.detach() for k, v in planted.model.state_dict().items()}
    if mode is None:
        res = match_weights(problem, sd_a, sd_b, rounds=20, tol=1e-10)
    else:
        with mode:
            res = match_weights(problem, sd_a, sd_b, rounds=20, tol=1e-10)
    wide = {k: v.double() for k, v in sd_b.items()}
    elements = {s: {k: v.double() if v.is_floating_point() else v for k, v in e.items()} for s, e in res.elements.items()}
    moved = apply_elements(problem, elements, wide)
    num = sum(float((moved[p] - sd_a[p].double()).square().sum()) for p in problem.params)
    den = sum(float(sd_a[p].double().square().sum()) for p in problem.params)
    return (num / den) ** 0.5


def test_tf32_products_stop_short_and_the_guard_keeps_float32(planted: Any, tf32_allowed: None) -> None:
    exact = recovery(planted)
    assert exact < 1e-5
    # negative control: TF32 products everywhere (no guard can help) leave it far off
    always = EmulatedTF32(always=True)
    assert recovery(planted, always) > 30 * exact and always.rounded > 0
    # TF32 allowed by the caller: match_weights runs its products in IEEE float32
    allowed = EmulatedTF32()
    assert recovery(planted, allowed) < 2 * exact + 1e-7
    assert allowed.rounded == 0
    assert tf32_setting() == ("legacy", "high")  # the caller's setting is back


def guarded_settings() -> list[Any]:
    """The setting before, inside, inside a nested guard, after it, and whether it is back."""
    before = tf32_setting()
    with IEEEFloat32():
        inside = tf32_setting()
        with IEEEFloat32():
            nested = tf32_setting()
        again = tf32_setting()
    return [before, inside, nested, again, tf32_setting() == before]


@pytest.mark.parametrize("way", ["default", "high", "medium", "allow_tf32"])
def test_the_guard_restores_the_callers_setting(way: str) -> None:
    start = torch.get_float32_matmul_precision()
    try:
        if way == "allow_tf32":
            torch.backends.cuda.matmul.allow_tf32 = True
        elif way != "default":
            torch.set_float32_matmul_precision(way)
        before, inside, nested, again, restored = guarded_settings()
        assert (before is None) == (way == "default")
        assert inside is None and nested is None and again is None and restored
    finally:
        torch.set_float32_matmul_precision(start)


def test_the_guard_uses_torchs_newer_api_where_the_caller_did() -> None:
    if not hasattr(torch.backends.cuda.matmul, "fp32_precision"):
        pytest.skip("this torch has only the legacy float32 precision setting")
    # in a child: once the newer API is used, this process's legacy reading refuses
    script = textwrap.dedent("""
        import json, torch
        torch.backends.cuda.matmul.fp32_precision = "tf32"
        from tests.test_gpu_precision import guarded_settings
        print(json.dumps(guarded_settings()))
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-2000:]
    before, inside, nested, again, restored = json.loads(out.stdout.strip().splitlines()[-1])
    assert before == ["new", "tf32"] and inside is None and nested is None and again is None and restored
