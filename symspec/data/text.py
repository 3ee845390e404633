"""Text for language models: ``text:PATH``, character-level or tokenised.

With a tokenizer (``tokenizer=PATH``, else the model folder's own) the text is cut into
splits by characters, each split is tokenised, and cut into blocks of ``block`` tokens
(default: the model's context, at most 1024). Without one, every character is a token
of the alphabet (the sorted characters of the file, or of ``alphabet=PATH``). Either
way an example is a window of ``block`` inputs whose targets are the next tokens
(inputs = ids[i:i+block], targets = ids[i+1:i+block+1]); consecutive windows follow one
another, so a split of n tokens gives (n - 1) // block examples.

An encoder-decoder (a config with ``is_encoder_decoder``: T5, BART) reads each window as
a continuation task instead: the encoder reads its first half, the decoder is given the
second half shifted right behind the config's ``decoder_start_token_id`` and is scored
on predicting it (inputs ``{input_ids, decoder_input_ids, use_cache=False}``, targets
the second half).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from symspec.data.base import (
    Batch,
    DataError,
    DataRequest,
    EvalData,
    config_int,
    int_option,
    make_batches,
    model_config,
    parse_fractions,
    read_text,
    register_source,
    split_bounds,
)
from symspec.data.losses import argmax_accuracy, cross_entropy
from symspec.data.tokenizer import TextTokenizer, find_tokenizer

#: the longest default block of tokenised text (a model's context may be far longer)
MAX_DEFAULT_BLOCK = 1024
TEXT_OPTIONS = ("context", "block", "split", "alphabet", "tokenizer")
_CONTEXT_NAMES = ("block_size", "n_positions", "max_position_embeddings")


def text_data(req: DataRequest) -> EvalData:
    """``text:PATH``: one split of a text file, cut by characters."""
    path = Path(req.source.arg or "")
    text = read_text(path)
    if not text:
        raise DataError(f"{path}: the file is empty")
    fractions = parse_fractions(req.source)
    start, stop = split_bounds(len(text), fractions, req.split)
    return sequence_data(req, f"text:{path}", path, text[start:stop], lambda: text,
                         {"characters": stop - start, "fractions": list(fractions)})


def sequence_data(req: DataRequest, name: str, where: Path | str, part: str, whole: Callable[[], str],
                  details: dict[str, Any]) -> EvalData:
    """Next-token windows of ``part`` (one split's text): tokenised when a tokenizer is
    given or found, else character-level with the alphabet of ``whole()`` (every split's
    text) or ``alphabet=``. ``where`` names the data in messages."""
    tok = find_tokenizer(req.source, req.model_dir)
    if tok is None:
        ids, facts = _character_ids(req, where, part, whole)
    else:
        ids, facts = _token_ids(req, where, part, tok)
    length = facts["context"]
    unit = "tokens" if tok is not None else "characters"
    windows = (len(ids) - 1) // length if len(ids) > 1 else 0
    if windows == 0:
        raise DataError(f"{where}: the {req.split} split holds {len(ids)} {unit}, fewer than one window of "
                        f"{length} + 1; use a larger file, a smaller context (block=N) or other split fractions")
    if req.max_samples is not None:
        windows = min(windows, req.max_samples)
    body = ids[: windows * length + 1]
    x = body[:-1].view(windows, length)
    y = body[1:].view(windows, length)
    if getattr(model_config(req.model), "is_encoder_decoder", False) is True:
        batches, facts = _continuations(req, where, x, facts)
    else:
        batches = make_batches(x, y, req.batch_size)
    return EvalData(name, "text", req.split, batches, cross_entropy, argmax_accuracy, {**facts, **details})


def _continuations(req: DataRequest, where: Path | str, x: torch.Tensor,
                   facts: dict[str, Any]) -> tuple[list[Batch], dict[str, Any]]:
    """An encoder-decoder's batches: each window's first half to the encoder, its second
    half to predict, given to the decoder shifted right behind the start token."""
    length = x.shape[1]
    if length < 2:
        raise DataError(f"--data {req.source}: an encoder-decoder needs windows of at least 2 tokens "
                        f"(one to read, one to predict); give block=N with N >= 2")
    start = config_int(req.model, "decoder_start_token_id")
    if start is None:
        raise DataError(f"{where}: {type(req.model).__name__} is an encoder-decoder without "
                        "config.decoder_start_token_id: the token its decoder starts from is unknown")
    half = length // 2
    source, target = x[:, :half].contiguous(), x[:, half:].contiguous()
    shifted = torch.cat([torch.full_like(target[:, :1], start), target[:, :-1]], dim=1)
    # no key/value cache: nothing is generated, and a cache in the output is no tensor a
    # traced graph can return (the activation methods record through one)
    batches: list[Batch] = [({"input_ids": source[i:i + req.batch_size],
                              "decoder_input_ids": shifted[i:i + req.batch_size], "use_cache": False},
                             target[i:i + req.batch_size])
                            for i in range(0, len(x), req.batch_size)]
    return batches, {**facts, "encoder_tokens": half, "decoder_tokens": length - half}


def _block_option(req: DataRequest, default: int | None) -> int | None:
    src = req.source
    if "block" in src.options and "context" in src.options:
        raise DataError(f"--data {src}: block= and context= are the same option; give one")
    key = "block" if "block" in src.options else "context"
    return int_option(src, key, default)


def _context(req: DataRequest, default_cap: int | None) -> int:
    """The window length: ``block=``/``context=``, else the model's context (capped at
    ``default_cap``), never longer than the model's positions."""
    model_ctx = config_int(req.model, *_CONTEXT_NAMES)
    default = model_ctx if model_ctx is None or default_cap is None else min(model_ctx, default_cap)
    context = _block_option(req, default)
    if context is None:
        raise DataError(f"--data {req.source}: the model's context length is unknown (no config.block_size, "
                        f"n_positions or max_position_embeddings); give the window length as block=N: "
                        f"--data {_with_option(req.source, 'block', '32')}")
    if model_ctx is not None and context > model_ctx:
        raise DataError(f"--data {req.source}: context {context} is longer than the model's {model_ctx} positions")
    return context


def _with_option(src: Any, key: str, value: str) -> str:
    """The full ``--data`` text of ``src`` with ``key=value`` added (``small.txt`` ->
    ``text:small.txt,block=32``): what to type, not what to infer."""
    head = f"{src.kind}:{src.arg}" if src.arg else src.kind
    return ",".join([head, *(f"{k}={v}" for k, v in src.options.items() if k != key), f"{key}={value}"])


def _character_ids(req: DataRequest, where: Path | str, part: str,
                   whole: Callable[[], str]) -> tuple[torch.Tensor, dict[str, Any]]:
    alphabet_path = req.source.options.get("alphabet")
    alphabet_text = read_text(Path(alphabet_path), "alphabet file") if alphabet_path else whole()
    chars = sorted(set(alphabet_text))
    index = {c: i for i, c in enumerate(chars)}
    missing = sorted(set(whole()) - set(index)) if alphabet_path else []
    if missing:
        raise DataError(f"{where}: {len(missing)} character(s) not in the alphabet of {alphabet_path}: "
                        + ", ".join(repr(c) for c in missing[:8]))
    vocab = len(chars)
    model_vocab = config_int(req.model, "vocab_size")
    if model_vocab is not None and model_vocab != vocab:
        folder = f" (none in {req.model_dir})" if req.model_dir is not None else ""
        raise DataError(f"{where}: its alphabet has {vocab} characters but the model's vocabulary has {model_vocab}; "
                        "a character model must be evaluated with the alphabet it was trained on "
                        "(use the same text, or text:PATH,alphabet=TRAINING_TEXT), a token model with its "
                        f"tokenizer (text:PATH,tokenizer=DIR{folder})")
    context = _context(req, None)
    if req.max_samples is not None:  # the windows kept, not the whole split
        part = part[: req.max_samples * context + 1]
    ids = torch.tensor([index[c] for c in part], dtype=torch.long)
    return ids, {"vocab": vocab, "context": context}


def _token_ids(req: DataRequest, where: Path | str, part: str,
               tok: TextTokenizer) -> tuple[torch.Tensor, dict[str, Any]]:
    if "alphabet" in req.source.options:
        raise DataError(f"--data {req.source}: alphabet= is for character text, but the text is tokenised with "
                        f"{tok.source}")
    context = _context(req, MAX_DEFAULT_BLOCK)
    ids = _encode(tok, part, None if req.max_samples is None else req.max_samples * context + 1)
    model_vocab = config_int(req.model, "vocab_size")
    top = int(ids.max()) if len(ids) else -1
    if model_vocab is not None and top >= model_vocab:
        raise DataError(f"{where}: the tokenizer {tok.source} gives ids up to {top} but the model's vocabulary has "
                        f"{model_vocab} (ids 0-{model_vocab - 1}); use the model's own tokenizer")
    facts = {"vocab": model_vocab if model_vocab is not None else tok.vocab_size, "context": context,
             "tokenizer": str(tok.source), "tokenizer_vocab": tok.vocab_size, "tokens": len(ids), "max_id": top}
    return ids, facts


#: tokens encoded beyond a prefix's cut and dropped (a word cut in two tokenises differently)
_CUT_MARGIN = 64


def _encode(tok: TextTokenizer, text: str, needed: int | None) -> torch.Tensor:
    """The token ids of ``text``, or with ``needed``, its first ``needed`` ids (at least;
    all of them when the text has fewer) from the shortest prefix that holds them plus a
    margin: --max-samples does not tokenise a whole split. Tokenizers act locally, so the
    ids before the margin are those of the whole text."""
    if needed is None:
        return tok.encode(text)
    size = max(4 * needed, 1024)  # characters: a token is rarely shorter than a quarter of one
    while True:
        ids = tok.encode(text[:size])
        if size >= len(text):
            return ids
        if len(ids) >= needed + _CUT_MARGIN:
            return ids[: len(ids) - _CUT_MARGIN]
        size *= 2


register_source("text", text_data, options=TEXT_OPTIONS,
                detect=lambda p: p.suffix == ".txt" and not p.is_dir() and "idx" not in p.name)
