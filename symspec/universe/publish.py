"""Publishing a universe run: the merged model, the aligned models, the transform records
and the report, written into one folder atomically (:func:`symspec.outputs.publish`).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch

from .. import loading
from ..loading import LoadedModel
from ..outputs import Target, publish
from .errors import UniverseError
from .result import ModelEntry, UniverseResult
from .workdir import write_json

_SUFFIX = {"safetensors": ".safetensors", "modelfile": ".pt", "state_dict": ".pt"}


def output_name(entry: ModelEntry | None, fmt: str, stem: str) -> str:
    """``stem`` with the extension of the model's format (a folder for Hugging Face)."""
    if fmt == "hf":
        return stem
    if fmt == "state_dict" and entry is not None and entry.path is not None and Path(entry.path).suffix in (".pt", ".pth", ".bin", ".ckpt"):
        return stem + Path(entry.path).suffix
    return stem + _SUFFIX.get(fmt, ".pt")


def save_outputs(result: UniverseResult, out: str | Path, *, report: Mapping[str, Any] | None = None,
                 overwrite: bool = False, extra: Callable[[Path], None] | None = None,
                 extra_outputs: Mapping[str, str] | None = None) -> dict[str, Any]:
    """Write the run into the folder ``out``, atomically (staged next to it, renamed into
    place when complete; see :func:`symspec.outputs.publish`):

    - ``merged{.pt,.safetensors,/}``: the universe, in the reference's class and format;
    - ``aligned/{key}{ext}``: each model aligned into the universe, in its own format;
    - ``transforms/{key}/transform.{safetensors,json}``: each model's transform record;
    - ``report.json``: ``report`` (default: :meth:`UniverseResult.summary`).

    ``extra(folder)`` may add files before the rename (``extra_outputs``: their names,
    listed in the report). Returns the written paths (final names), which the report's
    ``outputs`` lists too. A write that fails (a full disk) raises one
    :class:`~symspec.errors.SymspecInputError` line and leaves nothing behind.
    """
    out = Path(out)
    if os.path.lexists(out) and not overwrite:
        raise UniverseError(f"{out} exists; refusing to overwrite it (use --overwrite)")
    module = result.canonical_model if result.canonical_model is not None else torch.nn.Module()
    written: dict[str, Any] = {"aligned": [], "transforms": []}

    def stored(entry: ModelEntry, sd: Mapping[str, torch.Tensor]) -> dict[str, torch.dtype] | None:
        # every floating-point tensor in the dtype the model was stored in (the universe
        # works in float32 for float16/bfloat16 models)
        dt = getattr(torch, entry.dtype, None) if entry.dtype else None
        return {k: dt for k, v in sd.items() if v.is_floating_point()} if isinstance(dt, torch.dtype) else None

    def fill(tmp: Path) -> None:
        ref_entry = result.models[result.start]
        ref_fmt = result.reference.format if result.reference is not None else ref_entry.format
        name = output_name(ref_entry, ref_fmt, "merged")
        loading.save_model(LoadedModel(module, Path(ref_entry.path or "merged"), ref_fmt, dtypes=stored(ref_entry, result.merged)),
                   result.merged, tmp / name, model=module)
        written["merged"] = str(out / name)
        (tmp / "aligned").mkdir()
        for m in result.models:
            fmt = m.format if (m.format != "hf" or result.canonical_model is not None) else "state_dict"
            aname = output_name(m, fmt, m.key)
            state = result.aligned_state(m.index)
            loading.save_model(LoadedModel(module, Path(m.path or m.key), fmt, dtypes=stored(m, state)), state,
                       tmp / "aligned" / aname, model=module)
            written["aligned"].append(str(out / "aligned" / aname))
            result.records[m.index].save(tmp / "transforms" / m.key)
            written["transforms"].append(str(out / "transforms" / m.key))
        written["report"] = str(out / "report.json")
        written.update({k: str(out / v) for k, v in (extra_outputs or {}).items()})
        doc = dict(report) if report is not None else result.summary()
        doc["outputs"] = written
        write_json(tmp / "report.json", doc)
        if extra is not None:
            extra(tmp)

    publish([(Target(out, "--out", folder=True), fill)], force=overwrite, flag="--overwrite")
    return written


__all__ = ["output_name", "save_outputs"]
