"""Architectures symspec ships no spec for, built small with random weights (nothing
downloads): what ``symspec infer`` must draft a checked spec for on its own.

``NEW[name]`` -> (builder, what the inferred spec must declare: space base name ->
group text). Each entry stands for a feature the built-in families do not all have.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import torch

from symspec.testing import randomize_

COMMON = dict(vocab_size=23, hidden_size=16, num_hidden_layers=2, num_attention_heads=4, intermediate_size=12,
              bos_token_id=0, eos_token_id=0, pad_token_id=None)


def _tokens(model: torch.nn.Module, seed: int = 0) -> dict[str, Any]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(model.config.vocab_size, (2, 8), generator=g)
    mask = torch.ones(2, 8, dtype=torch.long)
    mask[-1, -2:] = 0
    return {"input_ids": ids, "attention_mask": mask, "use_cache": False}


def _hf(cls_name: str, cfg_name: str, **kw: Any) -> Callable[[int], tuple[torch.nn.Module, Any]]:
    def build(seed: int = 0) -> tuple[torch.nn.Module, Any]:
        import transformers

        torch.manual_seed(seed)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            cfg = getattr(transformers, cfg_name)(**{**COMMON, **kw})
            model = getattr(transformers, cls_name)(cfg).eval()
        randomize_(model, seed)
        return model, _tokens(model, seed)

    return build


def _timm(name: str, **kw: Any) -> Callable[[int], tuple[torch.nn.Module, Any]]:
    def build(seed: int = 0) -> tuple[torch.nn.Module, Any]:
        import timm

        torch.manual_seed(seed)
        model = timm.create_model(name, pretrained=False, img_size=16, patch_size=8, embed_dim=16, depth=2, num_heads=2,
                                  num_classes=5, **kw).eval()
        randomize_(model, seed)
        return model, torch.randn(2, 3, 16, 16, generator=torch.Generator().manual_seed(seed))

    return build


def _swin(**kw: Any) -> Callable[[int], tuple[torch.nn.Module, Any]]:
    def build(seed: int = 0) -> tuple[torch.nn.Module, Any]:
        import timm

        torch.manual_seed(seed)
        model = timm.create_model("swin_tiny_patch4_window7_224", pretrained=False, img_size=16, patch_size=4, window_size=2,
                                  embed_dim=8, num_classes=5, **kw).eval()
        randomize_(model, seed)
        return model, torch.randn(2, 3, 16, 16, generator=torch.Generator().manual_seed(seed))

    return build


class _ClipTextEmbeds(torch.nn.Module):
    """CLIP's text tower as its embedding: the end-of-text token's residual, picked by
    ``h[arange(B), ids.argmax(-1)]`` after the final norm, projected."""

    def __init__(self, cfg: Any) -> None:
        import transformers

        super().__init__()
        self.clip = transformers.CLIPTextModelWithProjection(cfg)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.clip(input_ids=input_ids).text_embeds


def _clip_text(seed: int = 0) -> tuple[torch.nn.Module, Any]:
    import transformers

    torch.manual_seed(seed)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cfg = transformers.CLIPTextConfig(vocab_size=23, hidden_size=16, intermediate_size=12, num_hidden_layers=2,
                                          num_attention_heads=4, max_position_embeddings=16, projection_dim=8,
                                          bos_token_id=0, pad_token_id=1, eos_token_id=2)
        model = _ClipTextEmbeds(cfg).eval()
    randomize_(model, seed)
    ids = torch.randint(3, 23, (2, 8), generator=torch.Generator().manual_seed(seed))
    ids[:, -2:] = 2  # the end-of-text token the pooled output picks (its first occurrence)
    return model, (ids,)


NEW: dict[str, tuple[Callable[..., tuple[torch.nn.Module, Any]], dict[str, str]]] = {
    # partial rotary (half of each head rotates), attention and MLP in parallel off one LayerNorm
    "phi": (_hf("PhiForCausalLM", "PhiConfig", partial_rotary_factor=0.5),
            {"resid": "OC(d)", "attn": "Heads(H, qk=RoPE(dh, rot=r), ov=GL(dh))", "mlp": "S(f)"}),
    # partial rotary with grouped-query attention and a gated MLP
    "stablelm": (_hf("StableLmForCausalLM", "StableLmConfig", partial_rotary_factor=0.5, num_key_value_heads=2),
                 {"resid": "OC(d)", "attn": "Heads(H, qk=RoPE(dh, rot=r), ov=GL(dh), kv=K)", "mlp": "S(f)", "up": "D(f)"}),
    # multi-query attention (one key/value head) fused into one projection, parallel blocks
    "falcon": (_hf("FalconForCausalLM", "FalconConfig", new_decoder_architecture=False, multi_query=True, parallel_attn=True,
                   alibi=False, intermediate_size=None, ffn_hidden_size=12),
               {"resid": "OC(d)", "attn": "Heads(H, qk=RoPE(dh), ov=GL(dh), kv=K)", "mlp": "S(f)"}),
    # grouped-query attention fused into one projection stored per key/value group,
    # [g0: q q k v][g1: q q k v] (Falcon's new decoder layout): the query heads are a
    # middle factor's slots of every group
    "falcon_grouped": (_hf("FalconForCausalLM", "FalconConfig", new_decoder_architecture=True, num_kv_heads=2,
                           alibi=False, intermediate_size=None, ffn_hidden_size=12),
                       {"resid": "OC(d)", "attn": "Heads(H, qk=RoPE(dh), ov=GL(dh), kv=K)", "mlp": "S(f)"}),
    # (1 + w) RMSNorms, and norms on each branch's output before it joins the residual stream:
    # those gains cannot be folded, so the residual keeps signed permutations only
    "gemma2": (_hf("Gemma2ForCausalLM", "Gemma2Config", head_dim=4, num_key_value_heads=2),
               {"resid": "SP(d)", "attn": "Heads(H, qk=RoPE(dh), ov=GL(dh), kv=K)", "mlp": "S(f)", "up": "D(f)"}),
    # LayerNorms without parameters
    "olmo": (_hf("OlmoForCausalLM", "OlmoConfig"),
             {"resid": "OC(d)", "attn": "Heads(H, qk=RoPE(dh), ov=GL(dh))", "mlp": "S(f)", "up": "D(f)"}),
    # interleaved rotary pairs (2i, 2i + 1), LayerNorm without bias, parallel blocks
    "cohere": (_hf("CohereForCausalLM", "CohereConfig", num_key_value_heads=2),
               {"resid": "OC(d)", "attn": "Heads(H, qk=RoPE(dh, layout=interleaved), ov=GL(dh), kv=K)", "mlp": "S(f)",
                "up": "D(f)"}),
    # interleaved partial rotary, parallel blocks, a biased output head
    "gptj": (_hf("GPTJForCausalLM", "GPTJConfig", n_embd=16, n_layer=2, n_head=4, rotary_dim=2, vocab_size=23),
             {"resid": "OC(d)", "attn": "Heads(H, qk=RoPE(dh, rot=r, layout=interleaved), ov=GL(dh))", "mlp": "S(f)"}),
    # a sparse mixture of experts: a router's softmax and top-k pick experts whose fused
    # gate/up and down weights [E, ...] run on the rows routed to them (batched matmuls)
    "mixtral": (_hf("MixtralForCausalLM", "MixtralConfig", num_local_experts=4, num_experts_per_tok=2, num_key_value_heads=2,
                    experts_implementation="batched_mm"),
                {"resid": "O(d)", "attn": "Heads(H, qk=RoPE(dh), ov=GL(dh), kv=K)", "moe": "Experts(E, S(f))", "up": "D(E * f)"}),
    # experts beside a dense shared expert (its own MLP, gated by a sigmoid)
    "qwen2_moe": (_hf("Qwen2MoeForCausalLM", "Qwen2MoeConfig", num_experts=4, num_experts_per_tok=2, moe_intermediate_size=8,
                      shared_expert_intermediate_size=12, num_key_value_heads=2, experts_implementation="batched_mm"),
                  {"resid": "O(d)", "attn": "Heads(H, qk=RoPE(dh), ov=GL(dh), kv=K)", "mlp": "S(f)", "up": "D(f)",
                   "moe": "Experts(E, S(fe))", "eup": "D(E * fe)"}),
    # fused q/k/v and a fused gate/up weight split by a chunk: the scaling acts on the up half
    "phi3": (_hf("Phi3ForCausalLM", "Phi3Config", num_key_value_heads=2),
             {"resid": "O(d)", "attn": "Heads(H, qk=RoPE(dh), ov=GL(dh), kv=K)", "mlp": "S(f)", "up": "D(f)"}),
    # timm DeiT: a distillation token beside the class token, two classifier heads
    "deit_distilled": (_timm("deit_tiny_distilled_patch16_224"),
                       {"resid": "OC(d)", "attn": "Heads(H, qk=GL(dh), ov=GL(dh))", "mlp": "S(f)"}),
    # timm ViT without a class token: register tokens and mean pooling before the head
    "vit_registers_avgpool": (_timm("vit_tiny_patch16_224", class_token=False, global_pool="avg", reg_tokens=2),
                              {"resid": "OC(d)", "attn": "Heads(H, qk=GL(dh), ov=GL(dh))", "mlp": "S(f)"}),
    # CLIP's text embedding: the pooled end-of-text token, x[rows, cols] with two index tensors
    # ALiBi: a per-head bias on the scores (baddbmm) that no head permutation moves, so the
    # heads keep their places with their QK and OV maps; the embedding LayerNorm leaves
    # the residual permutations and a sign
    "bloom": (_hf("BloomForCausalLM", "BloomConfig"),
              {"resid": "S(d)", "sgn": "Sign(d)", "attn": "Heads(H, qk=GL(dh), ov=GL(dh), perm=False)", "mlp": "S(f)"}),
    # one stage of Swin: windows cut by reshapes, a feature map padded to whole windows
    # (F.pad) and shifted by torch.roll on the spatial dims only, so the residual stream
    # keeps its permutations; each block's relative position bias table has a column per
    # head, bound as a part of the head group (pos=Id(1)) so that it moves with the heads
    "swin_one_stage": (_swin(depths=(2,), num_heads=(2,)),
                       {"resid": "S(d)", "attn": "Heads(H, qk=GL(dh), ov=GL(dh), pos=Id(1))",
                        "attn2": "Heads(H, qk=GL(dh), ov=GL(dh), pos=Id(1))", "mlp": "S(f)", "mlp2": "S(n_mlp2)"}),
    # two stages of Swin, of widths 8 and 16, joined by patch merging (2 x 2 neighbours'
    # features as one axis of 4C, normed and reduced to 2C): a residual space per stage,
    # heads and units per stage with dimensions of their own, the merging's norm and
    # reduction bound as four copies of the first stage's residual
    "swin": (_swin(depths=(1, 1), num_heads=(2, 4)),
             {"resid": "S(d)", "attn": "Heads(H, qk=GL(dh), ov=GL(dh), pos=Id(1))",
              "attn_2": "Heads(H2, qk=GL(dh2), ov=GL(dh2), pos=Id(1))", "mlp": "S(f)", "hidden": "S(n_hidden)",
              "mlp2": "S(n_mlp2)"}),
    "clip_text": (_clip_text, {"resid": "OC(d)", "attn": "Heads(H, qk=GL(dh), ov=GL(dh))", "mlp": "S(f)"}),
}
