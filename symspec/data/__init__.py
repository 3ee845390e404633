"""Evaluation data and losses: built-in sources, the model-file hook, and a registry.

A *data source* is a short string (the CLI's ``--data``)::

    text:PATH[,block=N][,split=0.8/0.1/0.1][,tokenizer=PATH][,alphabet=PATH]   next-token cross-entropy
    images:DIR[,size=N][,channels=C][,split=...]      one subfolder of images per class
    hf:DIR[,split=A/B/C][,column=NAME][,label=NAME]   a datasets dataset saved with save_to_disk
    mnist:DIR_OR_FILE[,size=N][,channels=C][,split=...]   MNIST idx files (.gz or not)
    digits[,size=N][,channels=C][,split=...]          scikit-learn's bundled 8x8 digits
    hook[,key=value...]                               the model file's own ``data()``

A bare path is recognised too: a ``.txt`` file is ``text:``, a folder or file of idx
files is ``mnist:``. Without ``--data``, a model file that defines ``data`` is used.

- ``text:`` is tokenised with ``tokenizer=PATH`` (a ``tokenizer.json``, or a folder
  holding one), else with the model folder's own tokenizer, else it is character-level
  (the alphabet: the file's sorted characters, or those of ``alphabet=PATH``). An
  example is a window of ``block`` tokens (``context=N`` is the same option; default:
  the model's context, at most 1024 for tokenised text) and its targets, the same
  window shifted by one token (:mod:`symspec.data.text`).
- ``images:`` and image columns of ``hf:`` are resized and normalised as the model
  expects: its config's ``image_size`` and ``num_channels``, a
  ``preprocessor_config.json`` in its folder, else MNIST's normalisation
  (:mod:`symspec.data.images`).
- Splits are contiguous blocks (train first, then val, then test) in the given
  proportions; nothing is shuffled, so a split is the same on every machine. Text is cut
  by characters, image folders per class, ``hf:`` datasets use their own splits.

Batch results are weighted by ``targets.numel()`` (tokens for a language model,
examples for a classifier), so the loss of a split does not depend on the batch size.

A new source is one function and one registration::

    def my_data(request: DataRequest) -> EvalData: ...
    register_source("mine", my_data, options=("size",))     # --data mine:PATH,size=3

>>> src = parse_source("text:input.txt,context=32")
>>> (src.kind, src.arg, src.options)
('text', 'input.txt', {'context': '32'})
"""

from __future__ import annotations

# the built-in sources register themselves on import, in the order messages list them
from symspec.data import text as _text  # noqa: F401  # isort: skip
from symspec.data import images as _images  # noqa: F401  # isort: skip
from symspec.data import hf as _hf  # noqa: F401  # isort: skip
from symspec.data import mnist as _mnist  # noqa: F401  # isort: skip
from symspec.data import hooks as _hooks  # noqa: F401  # isort: skip
from symspec.data.base import (
    DEFAULT_FRACTIONS,
    SOURCES,
    SPLITS,
    AccuracyFn,
    DataError,
    DataRequest,
    DataSource,
    EvalData,
    LossFn,
    SourceKind,
    config_int,
    int_option,
    model_config,
    parse_fractions,
    parse_source,
    register_source,
    split_bounds,
)
from symspec.data.hooks import hook_data, hooks_module
from symspec.data.images import (
    MAX_CHANNELS,
    MAX_IMAGE_SIZE,
    MNIST_MEAN,
    MNIST_STD,
    ImagePrep,
    image_prep,
)
from symspec.data.load import check_fits, check_inputs, load_data
from symspec.data.losses import (
    argmax_accuracy,
    call_model,
    cross_entropy,
    default_accuracy_if_classes,
    logits_of,
)
from symspec.data.mnist import read_idx, write_idx
from symspec.data.tokenizer import TextTokenizer, load_tokenizer

__all__ = [
    "DEFAULT_FRACTIONS", "MAX_CHANNELS", "MAX_IMAGE_SIZE", "MNIST_MEAN", "MNIST_STD", "SOURCES", "SPLITS",
    "AccuracyFn", "DataError", "DataRequest", "DataSource", "EvalData", "ImagePrep", "LossFn", "SourceKind",
    "TextTokenizer", "argmax_accuracy", "call_model", "check_fits", "check_inputs", "config_int", "cross_entropy",
    "default_accuracy_if_classes", "hook_data", "hooks_module", "image_prep", "int_option", "load_data",
    "load_tokenizer", "logits_of", "model_config", "parse_fractions", "parse_source", "read_idx",
    "register_source", "split_bounds", "write_idx",
]
