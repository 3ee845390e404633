"""What a loaded model is (:class:`LoadedModel`: the module and where it came from), and
what is asked of one: example inputs, the dtypes it is stored in, its config."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import attrs
import torch

from ..checker import call_forward, flatten_outputs
from ..errors import ModelLoadError
from .hf import hf_example_inputs
from .modelfile import ModelFile
from .usercode import describe_failure, user_code, where_in

STATE_DICT_SUFFIXES = (".pt", ".pth", ".bin", ".ckpt")
SAFETENSORS_SUFFIXES = (".safetensors",)

@attrs.define
class LoadedModel:
    """A model and where it came from, so that results can be written in its format."""

    model: torch.nn.Module
    source: Path
    format: str  # "modelfile" | "hf" | "state_dict" | "safetensors"
    model_file: ModelFile | None = None
    #: the dtype each floating-point tensor has where it is stored, where that is not the
    #: module's (a float16 checkpoint loaded into the float32 module of a model file):
    #: :func:`save_model` writes them back in it. None: the module's own.
    dtypes: dict[str, torch.dtype] | None = None
    #: where the model came from when ``format`` does not say it (a GGUF file read as a
    #: Hugging Face model, dequantised: :mod:`symspec.loading.gguf`)
    note: str | None = None

    @property
    def name(self) -> str:
        return self.source.name

    def example_inputs(self, batch: int = 2, seed: int = 0, *, probe: bool = True) -> Any:
        """The model file's example inputs (for a Hugging Face folder: random ones from
        its config). With ``probe``, the model is run on them once, so that inputs it
        cannot take (a wrong shape, token ids outside the vocabulary) or an output with
        no floating-point tensor are reported here, naming the file, and not as a
        traceback from deep inside a check."""
        mf = self.model_file
        if mf is not None and (mf.attr("example_inputs") or mf.attr("example_input")) is not None:
            inputs = mf.example_inputs(batch=batch, seed=seed, model=self.model)
            origin = "its example inputs" if mf.path == self.source else f"the example inputs of {mf.path}"
        elif self.format == "hf":
            inputs = hf_example_inputs(self.model, batch=batch, seed=seed)
            origin = "example inputs drawn from its config"
        else:
            raise ModelLoadError(f"{self.source}: no example inputs; give a model file that defines example_inputs(model, batch, seed)")
        if probe:
            probe_forward(self.model, inputs, f"{self.source}", origin, mf.path if mf is not None else None)
        return inputs

    def spec_hint(self) -> str | None:
        return self.model_file.spec_hint() if self.model_file is not None else None


def probe_forward(model: torch.nn.Module, inputs: Any, name: str, origin: str = "its example inputs",
                  model_file: Path | None = None) -> None:
    """Run ``model`` once on ``inputs`` (no gradients, in eval mode, restored after) and
    raise :class:`ModelLoadError` naming ``name`` when the forward fails or returns no
    floating-point tensor (a check would compare nothing and pass)."""
    training = model.training
    model.eval()  # no batch-norm statistics are updated by the probe
    try:
        with user_code(model_file or name, f"in the model's forward on {origin}"):
            out = call_forward(model, inputs)
    except (Exception, SystemExit) as e:
        where = where_in(e, model_file) if model_file is not None else ""
        at = f" (at {where})" if where and where != str(model_file) else ""
        raise ModelLoadError(f"{name}: the model's forward failed on {origin}{at}: {describe_failure(e)}") from e
    finally:
        model.train(training)
    if not flatten_outputs(out):
        raise ModelLoadError(f"{name}: the model's forward returned {_kind(out)} on {origin}; expected a tensor "
                             "(or a tuple, dict or model output holding floating-point tensors)")


def _kind(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"a {value.dtype} tensor"
    return "None" if value is None else f"a {type(value).__name__}"


#: config fields that do not change what an evaluated model computes: where it came
#: from, its storage precision, output and cache switches, label names, generation token
#: ids, and what only training reads (initialisation, dropout and layer drop are off in
#: eval mode)
HARMLESS_CONFIG_FIELDS = frozenset({
    "_name_or_path", "name_or_path", "architectures", "dtype", "torch_dtype", "transformers_version", "_commit_hash",
    "_attn_implementation", "_attn_implementation_autoset", "_attn_implementation_internal", "use_cache",
    "output_attentions", "output_hidden_states", "return_dict", "id2label", "label2id", "bos_token_id",
    "eos_token_id", "decoder_start_token_id", "initializer_range", "initializer_factor", "layerdrop",
    "problem_type", "finetuning_task", "tokenizer_class", "task_specific_params", "chunk_size_feed_forward",
    "gradient_checkpointing",
})


def config_differences(a: Any, b: Any) -> dict[str, tuple[Any, Any]]:
    """The config fields whose values differ between two models: ``{field: (value in a,
    value in b)}``, nested fields dotted (``rope_parameters.rope_theta``), in name order.

    ``a`` and ``b`` are :class:`LoadedModel` s, modules (their ``.config``) or configs (a
    Hugging Face config, a mapping, a dataclass or attrs instance). Two models with the
    same weight shapes may still compute different functions (another head count, norm
    epsilon, activation or rotary base), so averaging their weights means nothing; this
    names what differs. Fields in :data:`HARMLESS_CONFIG_FIELDS` and dropout rates are
    ignored. A model without a config has nothing to compare: ``{}``.

    >>> config_differences({"n_head": 2, "dropout": 0.1, "d": 8}, {"n_head": 4, "dropout": 0.0, "d": 8})
    {'n_head': (2, 4)}
    """
    def as_dict(obj: Any) -> dict[str, Any] | None:
        if isinstance(obj, LoadedModel):
            obj = obj.model
        if isinstance(obj, torch.nn.Module):
            obj = getattr(obj, "config", None)
        if obj is None:
            return None
        if isinstance(obj, Mapping):
            return dict(obj)
        if callable(getattr(obj, "to_dict", None)):  # Hugging Face configs, sub-configs included
            return dict(obj.to_dict())
        if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
            return dataclasses.asdict(obj)
        if attrs.has(type(obj)):
            return attrs.asdict(obj)
        fields = getattr(obj, "__dict__", None)
        return {k: v for k, v in fields.items() if not k.startswith("__")} if isinstance(fields, dict) else None

    def flat(d: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
        out: dict[str, Any] = {}
        for k, v in d.items():
            key = str(k)
            if key in HARMLESS_CONFIG_FIELDS or "dropout" in key:
                continue
            if isinstance(v, Mapping) and v:
                out.update(flat(v, f"{prefix}{key}."))
            else:
                out[f"{prefix}{key}"] = v
        return out

    def same(x: Any, y: Any) -> bool:
        try:
            return bool(x == y)
        except Exception:  # a tensor or array in a config: compare identities, do not fail
            return x is y

    da, db = as_dict(a), as_dict(b)
    if da is None or db is None:
        return {}
    fa, fb = flat(da), flat(db)
    absent = "<absent>"
    return {k: (fa.get(k, absent), fb.get(k, absent)) for k in sorted(set(fa) | set(fb))
            if not same(fa.get(k, absent), fb.get(k, absent))}


def source_dtype(model: Any) -> str | None:
    """The one dtype (``"bfloat16"``) a model's floating-point tensors are stored in: a
    :class:`LoadedModel`'s checkpoint (else its module), a module or a state dict; None
    when they are mixed or there are none."""
    if isinstance(model, LoadedModel) and model.dtypes:
        kinds = set(model.dtypes.values())
    else:
        if isinstance(model, LoadedModel):
            model = model.model
        sd = model.state_dict() if isinstance(model, torch.nn.Module) else model
        kinds = {v.dtype for v in sd.values() if isinstance(v, torch.Tensor) and v.is_floating_point()}
    return str(next(iter(kinds))).removeprefix("torch.") if len(kinds) == 1 else None


def stored_dtype(dtypes: Mapping[str, torch.dtype] | None, name: str) -> torch.dtype | None:
    """The dtype to write floating-point entry ``name`` in: its own in ``dtypes``, else
    (a tied twin the checkpoint stored once) the one dtype of all of them, if there is one."""
    if not dtypes:
        return None
    if name in dtypes:
        return dtypes[name]
    kinds = set(dtypes.values())
    return next(iter(kinds)) if len(kinds) == 1 else None
