"""A small Vision Transformer in plain PyTorch: convolutional patch embedding, class
token, learned positional embedding, pre-LayerNorm blocks with separate q/k/v
projections, GELU MLP and a linear classifier head on the class token.

Model-file convention: see examples/nanogpt.py (``build``, ``example_inputs``, ``loss``).
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass
class ViTConfig:
    image_size: int = 28
    patch_size: int = 7
    channels: int = 1
    n_classes: int = 10
    n_layer: int = 2
    n_head: int = 4
    n_embd: int = 64
    mlp_ratio: int = 4

    @property
    def n_patches(self) -> int:
        return (self.image_size // self.patch_size) ** 2


class Attention(nn.Module):
    def __init__(self, cfg: ViTConfig) -> None:
        super().__init__()
        self.n_head = cfg.n_head
        self.q = nn.Linear(cfg.n_embd, cfg.n_embd)
        self.k = nn.Linear(cfg.n_embd, cfg.n_embd)
        self.v = nn.Linear(cfg.n_embd, cfg.n_embd)
        self.proj = nn.Linear(cfg.n_embd, cfg.n_embd)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        h = self.n_head
        q = self.q(x).view(b, t, h, c // h).transpose(1, 2)
        k = self.k(x).view(b, t, h, c // h).transpose(1, 2)
        v = self.v(x).view(b, t, h, c // h).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v)
        return self.proj(y.transpose(1, 2).reshape(b, t, c))


class Block(nn.Module):
    def __init__(self, cfg: ViTConfig) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(cfg.n_embd)
        self.attn = Attention(cfg)
        self.norm2 = nn.LayerNorm(cfg.n_embd)
        self.fc1 = nn.Linear(cfg.n_embd, cfg.mlp_ratio * cfg.n_embd)
        self.fc2 = nn.Linear(cfg.mlp_ratio * cfg.n_embd, cfg.n_embd)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.fc2(F.gelu(self.fc1(self.norm2(x))))


class ViT(nn.Module):
    def __init__(self, cfg: ViTConfig) -> None:
        super().__init__()
        self.config = cfg
        d = cfg.n_embd
        self.patch_embed = nn.Conv2d(cfg.channels, d, cfg.patch_size, stride=cfg.patch_size)
        self.cls_token = nn.Parameter(torch.zeros(1, 1, d))
        self.pos_embed = nn.Parameter(torch.randn(1, cfg.n_patches + 1, d) * 0.02)
        self.blocks = nn.ModuleList([Block(cfg) for _ in range(cfg.n_layer)])
        self.norm = nn.LayerNorm(d)
        self.head = nn.Linear(d, cfg.n_classes)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        x = self.patch_embed(images).flatten(2).transpose(1, 2)  # [B, N, d]
        cls = self.cls_token.expand(x.shape[0], -1, -1)
        x = torch.cat([cls, x], dim=1) + self.pos_embed
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x)[:, 0])


def build(**overrides: object) -> ViT:
    names = {f.name for f in fields(ViTConfig)}
    unknown = set(overrides) - names
    if unknown:
        raise TypeError(f"unknown ViTConfig fields: {', '.join(sorted(unknown))}")
    return ViT(ViTConfig(**overrides))  # type: ignore[arg-type]


def example_inputs(model: ViT, batch: int = 2, seed: int = 0) -> tuple[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    c = model.config
    return (torch.randn(batch, c.channels, c.image_size, c.image_size, generator=g),)


def loss(output: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(output, targets)
