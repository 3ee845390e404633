"""Small models for every built-in spec: the tests' shared model zoo.

``ZOO[spec_name]`` builds a small model with random, perturbed weights (no special
values such as LayerNorm gains of exactly 1) and its example inputs. Every spec in
specs/ must have an entry (tests/test_builtin_specs.py enforces it).
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from symspec.loading import import_file
from symspec.testing import randomize_

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples"

Builder = Callable[..., tuple[torch.nn.Module, Any]]
ZOO: dict[str, Builder] = {}


def entry(name: str) -> Callable[[Builder], Builder]:
    def deco(fn: Builder) -> Builder:
        ZOO[name] = fn
        return fn

    return deco


def example(name: str) -> Any:
    return import_file(EXAMPLES / f"{name}.py")


@entry("nanogpt")
def nanogpt(seed: int = 0, n_layer: int = 2, n_head: int = 2, head_dim: int = 4, n_ff: int = 12, **kw: Any) -> tuple[torch.nn.Module, Any]:
    mod = example("nanogpt")
    torch.manual_seed(seed)
    model = mod.build(n_layer=n_layer, n_head=n_head, n_embd=n_head * head_dim, n_ff=n_ff, vocab_size=11, block_size=8, **kw)
    randomize_(model, seed)
    return model.eval(), mod.example_inputs(model, batch=2, seed=seed)


@entry("vit")
def vit(seed: int = 0, n_layer: int = 2, n_head: int = 2, head_dim: int = 4, mlp_ratio: int = 2, **kw: Any) -> tuple[torch.nn.Module, Any]:
    mod = example("vit")
    torch.manual_seed(seed)
    model = mod.build(n_layer=n_layer, n_head=n_head, n_embd=n_head * head_dim, mlp_ratio=mlp_ratio, image_size=8, patch_size=4, **kw)
    randomize_(model, seed)
    return model.eval(), mod.example_inputs(model, batch=2, seed=seed)


__all__ = ["ZOO", "entry", "example", "sys"]
