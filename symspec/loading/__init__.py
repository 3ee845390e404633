"""Loading and saving models: one loader for check, match, merge and the analyzers.

Accepted inputs (``load_model(path, factory=...)``):

- a **model file** ``model.py`` (see below);
- a **Hugging Face folder** (``config.json`` plus ``model.safetensors`` or
  ``pytorch_model.bin``): the class named in ``config.architectures`` is rebuilt from
  ``transformers`` and loaded offline;
- a **GGUF file** (``.gguf``, llama.cpp's format): read through transformers and
  dequantised to float32, then handled as a Hugging Face model (:mod:`symspec.loading.gguf`);
- a **plain PyTorch state dict** (``.pt``, ``.pth``, ``.bin``; read with
  ``weights_only=True``, never unpickling arbitrary objects) or a **safetensors file**,
  together with ``factory``: a model file whose ``build()`` makes the module to load
  it into.

The model-file convention (``symspec check model.py``): a Python file that defines

- ``build(**overrides)`` returning an ``nn.Module`` (or a module-level ``model`` object);
- ``example_inputs(model, batch=2, seed=0)`` returning the inputs of ``model.forward``:
  a tensor, a tuple of positional inputs, or a dict of keyword inputs;
- optionally ``SPEC``, a spec path (relative to the file) or a built-in spec name;
- optionally ``CHECK_RTOL``, tolerances for ``symspec check`` ({"float32": 1e-3});
- optionally ``loss(output, targets)`` and data hooks, used by the analyzers.

``save_model(loaded, state_dict, out)`` writes a model in the format it was read in
(a Hugging Face folder stays one; a state dict stays one) and in the dtypes it was
stored in (``LoadedModel.dtypes``: a float16 checkpoint read into a float32 model file's
module is written as float16), atomically.

The package, one file per source: ``usercode`` (running a user's file guarded),
``modelfile``, ``hf``, ``statedict``, ``gguf``; ``base`` (:class:`LoadedModel`, dtypes,
configs), ``load`` (:func:`load_model`) and ``save`` (:func:`save_model`).
"""

from .base import (
    HARMLESS_CONFIG_FIELDS,
    SAFETENSORS_SUFFIXES,
    STATE_DICT_SUFFIXES,
    LoadedModel,
    config_differences,
    probe_forward,
    source_dtype,
    stored_dtype,
)
from .hf import hf_example_inputs
from .load import load_model
from .modelfile import ModelFile, load_model_file
from .save import save_model
from .statedict import load_state_dict_into
from .usercode import ExitCalled, describe_failure, import_file, user_code, where_in

__all__ = ["HARMLESS_CONFIG_FIELDS", "SAFETENSORS_SUFFIXES", "STATE_DICT_SUFFIXES", "ExitCalled", "LoadedModel",
           "ModelFile", "config_differences", "describe_failure", "hf_example_inputs", "import_file", "load_model",
           "load_model_file", "load_state_dict_into", "probe_forward", "save_model", "source_dtype", "stored_dtype",
           "user_code", "where_in"]
