"""Small models for every built-in spec: the tests' shared model zoo.

``ZOO[spec_name]`` builds a small model with random, perturbed weights (no special
values such as LayerNorm gains of exactly 1) and its example inputs. Every spec in
specs/ must have an entry (tests/test_arch.py enforces it). ``variant`` makes a
built-in spec with a few lines changed: the tests' way of writing a wrong spec.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from symspec.loading import import_file
from symspec.spec import Spec, loads_spec
from symspec.testing import randomize_

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples"
SPECS = ROOT / "specs"


def variant(name: str, *replacements: tuple[str, str], filename: str | None = None) -> Spec:
    """The built-in spec ``name`` with each ``(old, new)`` replaced (every ``old`` must
    occur in it), parsed as ``filename`` (default ``{name}-variant.yaml``)."""
    text = (SPECS / f"{name}.yaml").read_text()
    for old, new in replacements:
        assert old in text, old
        text = text.replace(old, new)
    return loads_spec(text, filename or f"{name}-variant.yaml")

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


# -- Hugging Face and timm families (random weights from small configs; nothing downloads) --

def _tokens(model: torch.nn.Module, batch: int, length: int, seed: int, *, pad: bool = False) -> dict[str, Any]:
    """Token ids (and, with ``pad``, an attention mask that pads the last sequence)."""
    g = torch.Generator().manual_seed(seed)
    vocab = model.config.vocab_size
    out: dict[str, Any] = {"input_ids": torch.randint(vocab, (batch, length), generator=g)}
    if pad:
        mask = torch.ones(batch, length, dtype=torch.long)
        mask[-1, length - 2 :] = 0
        out["attention_mask"] = mask
    return out


def _hf(model: torch.nn.Module, seed: int) -> torch.nn.Module:
    randomize_(model, seed)
    return model.eval()


@entry("gpt2")
def gpt2(seed: int = 0, n_layer: int = 2, n_head: int = 2, head_dim: int = 4, vocab: int = 23, **kw: Any) -> tuple[torch.nn.Module, Any]:
    import transformers

    torch.manual_seed(seed)
    cfg = transformers.GPT2Config(n_layer=n_layer, n_head=n_head, n_embd=n_head * head_dim, vocab_size=vocab, n_positions=16,
                                  bos_token_id=0, eos_token_id=0, **kw)
    model = _hf(transformers.GPT2LMHeadModel(cfg), seed)
    return model, {**_tokens(model, 2, 8, seed, pad=True), "use_cache": False}


def _llama_config(cls: Any, seed: int, n_layer: int, n_head: int, n_kv: int, head_dim: int, n_ff: int, vocab: int, **kw: Any) -> Any:
    return cls(num_hidden_layers=n_layer, num_attention_heads=n_head, num_key_value_heads=n_kv, hidden_size=n_head * head_dim,
               intermediate_size=n_ff, vocab_size=vocab, max_position_embeddings=32, bos_token_id=0, eos_token_id=0,
               pad_token_id=None, **kw)


@entry("llama")
def llama(seed: int = 0, n_layer: int = 2, n_head: int = 4, n_kv: int = 2, head_dim: int = 4, n_ff: int = 12, vocab: int = 23,
          tie: bool = False, **kw: Any) -> tuple[torch.nn.Module, Any]:
    import transformers

    torch.manual_seed(seed)
    cfg = _llama_config(transformers.LlamaConfig, seed, n_layer, n_head, n_kv, head_dim, n_ff, vocab, tie_word_embeddings=tie, **kw)
    model = _hf(transformers.LlamaForCausalLM(cfg), seed)
    return model, {**_tokens(model, 2, 8, seed, pad=True), "use_cache": False}


@entry("llama_tied")
def llama_tied(seed: int = 0, **kw: Any) -> tuple[torch.nn.Module, Any]:
    return llama(seed, tie=True, **kw)


@entry("qwen2")
def qwen2(seed: int = 0, n_layer: int = 2, n_head: int = 4, n_kv: int = 2, head_dim: int = 4, n_ff: int = 12, vocab: int = 23,
          tie: bool = False, **kw: Any) -> tuple[torch.nn.Module, Any]:
    import transformers

    torch.manual_seed(seed)
    cfg = _llama_config(transformers.Qwen2Config, seed, n_layer, n_head, n_kv, head_dim, n_ff, vocab, tie_word_embeddings=tie, **kw)
    model = _hf(transformers.Qwen2ForCausalLM(cfg), seed)
    return model, {**_tokens(model, 2, 8, seed, pad=True), "use_cache": False}


@entry("mixtral")
def mixtral(seed: int = 0, n_layer: int = 2, n_head: int = 4, n_kv: int = 2, head_dim: int = 4, n_ff: int = 6, vocab: int = 23,
            experts: int = 4, top_k: int = 2, tie: bool = False, experts_implementation: str = "batched_mm",
            **kw: Any) -> tuple[torch.nn.Module, Any]:
    """A sparse mixture of experts. The experts run as batched matmuls: the default grouped
    matmul has no float64 kernel, and the eager loop over experts cannot be traced (its
    control flow depends on the routing), which activation matching needs."""
    import transformers

    torch.manual_seed(seed)
    cfg = _llama_config(transformers.MixtralConfig, seed, n_layer, n_head, n_kv, head_dim, n_ff, vocab, tie_word_embeddings=tie,
                        num_local_experts=experts, num_experts_per_tok=top_k, experts_implementation=experts_implementation, **kw)
    model = _hf(transformers.MixtralForCausalLM(cfg), seed)
    return model, {**_tokens(model, 2, 8, seed, pad=True), "use_cache": False}


@entry("opt")
def opt(seed: int = 0, n_layer: int = 2, n_head: int = 2, head_dim: int = 4, n_ff: int = 12, vocab: int = 23, **kw: Any) -> tuple[torch.nn.Module, Any]:
    import transformers

    torch.manual_seed(seed)
    d = n_head * head_dim
    cfg = transformers.OPTConfig(num_hidden_layers=n_layer, num_attention_heads=n_head, hidden_size=d, word_embed_proj_dim=d,
                                 ffn_dim=n_ff, vocab_size=vocab, max_position_embeddings=16, pad_token_id=1, bos_token_id=2,
                                 eos_token_id=2, **kw)
    model = _hf(transformers.OPTForCausalLM(cfg), seed)
    return model, {**_tokens(model, 2, 8, seed, pad=True), "use_cache": False}


@entry("t5")
def t5(seed: int = 0, n_layer: int = 2, n_head: int = 2, head_dim: int = 4, n_ff: int = 12, vocab: int = 23,
       **kw: Any) -> tuple[torch.nn.Module, Any]:
    import transformers

    torch.manual_seed(seed)
    cfg = transformers.T5Config(vocab_size=vocab, d_model=n_head * head_dim, d_kv=head_dim, d_ff=n_ff, num_layers=n_layer,
                                num_decoder_layers=n_layer, num_heads=n_head, relative_attention_num_buckets=8,
                                decoder_start_token_id=0, pad_token_id=0, eos_token_id=1, **kw)
    model = _hf(transformers.T5ForConditionalGeneration(cfg), seed)
    g = torch.Generator().manual_seed(seed + 1)
    return model, {**_tokens(model, 2, 8, seed, pad=True),
                   "decoder_input_ids": torch.randint(vocab, (2, 6), generator=g), "use_cache": False}


@entry("t5_gated")
def t5_gated(seed: int = 0, n_layer: int = 2, n_head: int = 2, head_dim: int = 4, n_ff: int = 12, vocab: int = 23,
             **kw: Any) -> tuple[torch.nn.Module, Any]:
    """T5 v1.1 (gated GELU) as a checkpoint loads: lm_head a tensor of its own."""
    model, inputs = t5(seed, n_layer, n_head, head_dim, n_ff, vocab, feed_forward_proj="gated-gelu", **kw)
    g = torch.Generator().manual_seed(seed + 7)
    head = model.shared.weight.detach().clone() + 0.1 * torch.randn(model.shared.weight.shape, generator=g)
    model.lm_head.weight = torch.nn.Parameter(head)  # what loading a v1.1 checkpoint leaves
    model.config.scale_decoder_outputs = False  # v1.1 does not scale the decoder's output
    return model, inputs


@entry("bart")
def bart(seed: int = 0, n_layer: int = 2, n_head: int = 2, head_dim: int = 4, n_ff: int = 16, vocab: int = 23,
         **kw: Any) -> tuple[torch.nn.Module, Any]:
    import transformers

    torch.manual_seed(seed)
    cfg = transformers.BartConfig(vocab_size=vocab, d_model=n_head * head_dim, encoder_layers=n_layer, decoder_layers=n_layer,
                                  encoder_attention_heads=n_head, decoder_attention_heads=n_head, encoder_ffn_dim=n_ff,
                                  decoder_ffn_dim=n_ff, max_position_embeddings=16, pad_token_id=1, bos_token_id=0,
                                  eos_token_id=2, decoder_start_token_id=2, **kw)
    # 16 units a layer: with 12, permuting the decoder's units was exact in float64 on this
    # seed (a sum in another order, no rounding), and the family test wants to see them move
    model = _hf(transformers.BartForConditionalGeneration(cfg), seed)
    with torch.no_grad():
        model.final_logits_bias.normal_()  # a buffer: randomize_ leaves it at 0
    g = torch.Generator().manual_seed(seed + 1)
    return model, {**_tokens(model, 2, 8, seed, pad=True),
                   "decoder_input_ids": torch.randint(vocab, (2, 6), generator=g), "use_cache": False}


@entry("whisper")
def whisper(seed: int = 0, n_layer: int = 2, n_head: int = 2, head_dim: int = 4, n_ff: int = 16, vocab: int = 23,
            mel: int = 8, **kw: Any) -> tuple[torch.nn.Module, Any]:
    import transformers

    torch.manual_seed(seed)
    cfg = transformers.WhisperConfig(vocab_size=vocab, d_model=n_head * head_dim, encoder_layers=n_layer,
                                     decoder_layers=n_layer, encoder_attention_heads=n_head,
                                     decoder_attention_heads=n_head, encoder_ffn_dim=n_ff, decoder_ffn_dim=n_ff,
                                     num_mel_bins=mel, max_source_positions=8, max_target_positions=16, pad_token_id=1,
                                     bos_token_id=0, eos_token_id=2, decoder_start_token_id=2, suppress_tokens=None,
                                     begin_suppress_tokens=None, **kw)
    model = _hf(transformers.WhisperForConditionalGeneration(cfg), seed)
    g = torch.Generator().manual_seed(seed + 1)
    # the encoder's convolutions halve 2 x max_source_positions frames into its positions
    return model, {"input_features": torch.randn(2, mel, 16, generator=g),
                   "decoder_input_ids": torch.randint(vocab, (2, 6), generator=g), "use_cache": False}


@entry("bert")
def bert(seed: int = 0, n_layer: int = 2, n_head: int = 2, head_dim: int = 4, n_ff: int = 12, vocab: int = 23, **kw: Any) -> tuple[torch.nn.Module, Any]:
    import transformers

    torch.manual_seed(seed)
    cfg = transformers.BertConfig(num_hidden_layers=n_layer, num_attention_heads=n_head, hidden_size=n_head * head_dim,
                                  intermediate_size=n_ff, vocab_size=vocab, max_position_embeddings=16, type_vocab_size=2, **kw)
    model = _hf(transformers.BertForMaskedLM(cfg), seed)
    inputs = _tokens(model, 2, 8, seed, pad=True)
    inputs["token_type_ids"] = (torch.arange(8) >= 4).long().expand(2, 8).clone()
    return model, inputs


@entry("hf_vit")
def hf_vit(seed: int = 0, n_layer: int = 2, n_head: int = 2, head_dim: int = 4, n_ff: int = 12, **kw: Any) -> tuple[torch.nn.Module, Any]:
    import transformers

    torch.manual_seed(seed)
    cfg = transformers.ViTConfig(num_hidden_layers=n_layer, num_attention_heads=n_head, hidden_size=n_head * head_dim,
                                 intermediate_size=n_ff, image_size=8, patch_size=4, num_channels=3, num_labels=5, **kw)
    model = _hf(transformers.ViTForImageClassification(cfg), seed)
    g = torch.Generator().manual_seed(seed)
    return model, {"pixel_values": torch.randn(2, 3, 8, 8, generator=g)}


@entry("timm_vit")
def timm_vit(seed: int = 0, n_layer: int = 2, n_head: int = 2, head_dim: int = 4, mlp_ratio: float = 1.5, **kw: Any) -> tuple[torch.nn.Module, Any]:
    from timm.models.vision_transformer import VisionTransformer

    torch.manual_seed(seed)
    model = VisionTransformer(img_size=8, patch_size=4, embed_dim=n_head * head_dim, depth=n_layer, num_heads=n_head, mlp_ratio=mlp_ratio,
                              num_classes=5, **kw)
    randomize_(model, seed)
    g = torch.Generator().manual_seed(seed)
    return model.eval(), torch.randn(2, 3, 8, 8, generator=g)


@entry("gemma")
def gemma(seed: int = 0, n_layer: int = 2, n_head: int = 4, n_kv: int = 2, head_dim: int = 4, n_ff: int = 12, vocab: int = 23,
          **kw: Any) -> tuple[torch.nn.Module, Any]:
    import transformers

    torch.manual_seed(seed)
    cfg = _llama_config(transformers.GemmaConfig, seed, n_layer, n_head, n_kv, head_dim, n_ff, vocab, **kw)
    cfg.head_dim = head_dim  # Gemma's config defaults it to 256, not hidden_size / heads
    model = _hf(transformers.GemmaForCausalLM(cfg), seed)  # tied embeddings (Gemma's default)
    return model, {**_tokens(model, 2, 8, seed, pad=True), "use_cache": False}


@entry("gpt_neox")
def gpt_neox(seed: int = 0, n_layer: int = 2, n_head: int = 2, head_dim: int = 4, rotary: int = 2, n_ff: int = 12, vocab: int = 23,
             **kw: Any) -> tuple[torch.nn.Module, Any]:
    """``rotary`` dims of each head rotate (all of them when the head is smaller): partial
    rotary at the default sizes, as in Pythia (rotary_pct 0.25)."""
    import transformers

    torch.manual_seed(seed)
    cfg = transformers.GPTNeoXConfig(num_hidden_layers=n_layer, num_attention_heads=n_head, hidden_size=n_head * head_dim,
                                     intermediate_size=n_ff, vocab_size=vocab, max_position_embeddings=32,
                                     rotary_pct=min(rotary, head_dim) / head_dim, bos_token_id=0, eos_token_id=0, **kw)
    model = _hf(transformers.GPTNeoXForCausalLM(cfg), seed)
    return model, {**_tokens(model, 2, 8, seed, pad=True), "use_cache": False}


__all__ = ["ZOO", "entry", "example", "sys"]
