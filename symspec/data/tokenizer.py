"""Tokenizers for text data: ``tokenizer=PATH``, else the model folder's own.

A ``tokenizer.json`` (a file, or inside a folder) is read with the ``tokenizers``
library (``pip install 'symspec[text]'``); a folder without one but with other tokenizer
files (``vocab.json``, ``tokenizer.model``, ...) is read with transformers' AutoTokenizer
when transformers is installed. Nothing is downloaded. Text is encoded without special
tokens, with truncation and padding off: it becomes one long run of token ids.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import attrs
import torch

from symspec.data.base import DataError, DataSource
from symspec.loading import describe_failure

#: files whose presence in a model folder means it ships a tokenizer
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "vocab.txt", "tokenizer.model",
                   "spiece.model", "merges.txt")


@attrs.frozen
class TextTokenizer:
    """A loaded tokenizer: where it came from, its vocabulary size and an encoder."""

    source: Path
    vocab_size: int
    encode_fn: Callable[[str], list[int]]

    def encode(self, text: str) -> torch.Tensor:
        """The token ids of ``text`` (no special tokens added), a 1-D long tensor."""
        try:
            ids = self.encode_fn(text)
        except Exception as e:  # the tokenizer's own failure on this text
            raise DataError(f"{self.source}: the tokenizer fails on the text: {type(e).__name__}: {e}") from e
        return torch.tensor(ids, dtype=torch.long)


def find_tokenizer(src: DataSource, model_dir: Path | None) -> TextTokenizer | None:
    """``tokenizer=`` of ``src``, else the tokenizer in ``model_dir``, else None
    (character-level text)."""
    given = src.options.get("tokenizer")
    if given:
        return load_tokenizer(Path(given))
    if model_dir is not None and any((model_dir / f).is_file() for f in TOKENIZER_FILES):
        return load_tokenizer(model_dir)
    return None


def load_tokenizer(path: Path) -> TextTokenizer:
    """The tokenizer at ``path``: a ``tokenizer.json`` file, or a folder holding one (or
    other tokenizer files AutoTokenizer reads)."""
    if path.is_file():
        return _from_json(path)
    if not path.is_dir():
        raise DataError(f"{path}: no such tokenizer file or folder")
    if (path / "tokenizer.json").is_file():
        return _from_json(path / "tokenizer.json")
    others = [f for f in TOKENIZER_FILES if (path / f).is_file()]
    if not others:
        raise DataError(f"{path}: no tokenizer here (expected tokenizer.json, or {', '.join(TOKENIZER_FILES[1:])} "
                        "for transformers' AutoTokenizer)")
    return _from_transformers(path, others)


def _from_json(path: Path) -> TextTokenizer:
    try:
        from tokenizers import Tokenizer  # optional: the text extra
    except ImportError as e:
        raise DataError(f"{path}: tokenised text needs the tokenizers library (pip install 'symspec[text]')") from e
    try:
        tok = Tokenizer.from_file(str(path))
    except Exception as e:  # tokenizers raises a plain Exception on a bad file
        raise DataError(f"{path}: not a tokenizer file ({describe_failure(e)})") from None
    tok.no_truncation()
    tok.no_padding()
    return TextTokenizer(path, int(tok.get_vocab_size(with_added_tokens=True)),
                         lambda text: tok.encode(text, add_special_tokens=False).ids)


def _from_transformers(path: Path, found: list[str]) -> TextTokenizer:
    try:
        from transformers import AutoTokenizer  # optional: the hf extra
    except ImportError:
        raise DataError(f"{path}: holds {', '.join(found)} but no tokenizer.json; reading it needs transformers "
                        "(pip install 'symspec[hf]'), or give tokenizer=PATH to a tokenizer.json") from None
    try:
        tok: Any = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    except Exception as e:
        raise DataError(f"{path}: AutoTokenizer cannot read the tokenizer files here ({describe_failure(e)})") from None
    backend = getattr(tok, "backend_tokenizer", None)
    if backend is not None:  # a fast tokenizer: the tokenizers object itself, without length warnings
        backend.no_truncation()
        backend.no_padding()
        return TextTokenizer(path, len(tok), lambda text: backend.encode(text, add_special_tokens=False).ids)
    return TextTokenizer(path, len(tok), lambda text: tok.encode(text, add_special_tokens=False, verbose=False))
