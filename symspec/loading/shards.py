"""Safetensors checkpoints as they lie on disk: the layout of a Hugging Face folder (one
``model.safetensors``, or shards named by ``model.safetensors.index.json``), read lazily
(headers first; a tensor in its own dtype only when asked for), and written back shard by
shard in the same files, names and dtypes.

>>> import tempfile, torch
>>> from pathlib import Path
>>> from safetensors.torch import save_file
>>> d = Path(tempfile.mkdtemp())
>>> save_file({"w": torch.ones(2, dtype=torch.bfloat16)}, str(d / "model.safetensors"))
>>> layout = read_layout(d)
>>> layout.files, layout.dtypes
({'w': 'model.safetensors'}, {'w': torch.bfloat16})
>>> out = Path(tempfile.mkdtemp())
>>> write_like(layout, {"w": torch.full((2,), 0.5)}, out)
['model.safetensors']
>>> LazyStateDict(read_layout(out))["w"]
tensor([0.5000, 0.5000], dtype=torch.bfloat16)
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import attrs
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from ..errors import ModelLoadError
from ..io_util import read_small_file
from ..outputs import atomic_write_text
from ..statedict import storage_key
from .usercode import describe_failure

#: the file names transformers gives a folder's weights
SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"

#: safetensors' dtype names
DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
          "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
          "U16": torch.uint16, "U32": torch.uint32, "U64": torch.uint64, "BOOL": torch.bool,
          "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2}


@attrs.frozen
class Layout:
    """Where a folder's tensors lie: ``files`` maps each tensor name to its file (in the
    files' order), ``dtypes`` gives the dtype it is stored in, ``index`` the index file's
    JSON (None for a single file)."""

    folder: Path
    files: dict[str, str]
    dtypes: dict[str, torch.dtype]
    index: dict[str, Any] | None = None

    def shards(self) -> list[str]:
        """The files, in the order they first appear."""
        return list(dict.fromkeys(self.files.values()))


def read_layout(folder: Path) -> Layout | None:
    """The safetensors layout of a Hugging Face folder (headers only, no tensor read), or
    None when it stores no safetensors (``pytorch_model.bin``). A corrupt index, a shard
    it names that is missing or unreadable, or a tensor missing from its shard raises
    :class:`ModelLoadError` naming the file and what to do."""
    index_path = folder / INDEX
    if index_path.exists():
        index, files = _read_index(index_path)
    elif (folder / SINGLE).exists():
        index, files = None, None
    else:
        return None
    headers = {name: _header(folder / name, index_path if index is not None else None)
               for name in (dict.fromkeys(files.values()) if files is not None else [SINGLE])}
    if files is None:
        files = {k: SINGLE for k in headers[SINGLE]}
    dtypes: dict[str, torch.dtype] = {}
    for k, name in files.items():
        dt = headers[name].get(k)
        if dt is None:
            raise ModelLoadError(f"{index_path}: maps {k} to {name}, which does not hold it; "
                                 "restore the shard or rewrite the index")
        dtypes[k] = dt
    return Layout(folder, files, dtypes, index)


def _read_index(path: Path) -> tuple[dict[str, Any], dict[str, str]]:
    try:
        index = json.loads(read_small_file(path, "index file", error=ModelLoadError).decode("utf-8"))
    except (OSError, ValueError) as e:  # ValueError: bad JSON, and text that is not UTF-8
        raise ModelLoadError(f"{path}: unreadable index ({describe_failure(e)}); restore it or save the model again") from e
    wmap = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(wmap, dict) or not wmap or not all(isinstance(k, str) and isinstance(v, str) for k, v in wmap.items()):
        raise ModelLoadError(f"{path}: expected a JSON object whose 'weight_map' maps tensor names to shard files; "
                             "restore it or save the model again")
    bad = next((v for v in wmap.values() if Path(v).name != v or v in (".", "..")), None)
    if bad is not None:
        raise ModelLoadError(f"{path}: names the shard {bad!r}, not a file name in the folder; restore the index")
    missing = next((v for v in wmap.values() if not (path.parent / v).is_file()), None)
    if missing is not None:
        n = sum(v == missing for v in wmap.values())
        raise ModelLoadError(f"{path}: names {missing} for {n} tensor(s), but {path.parent / missing} is missing; "
                             "restore the shard (or the whole folder)")
    return index, dict(wmap)


def _header(file: Path, index: Path | None) -> dict[str, torch.dtype]:
    """Each tensor's dtype in ``file``, from its header alone."""
    try:
        with safe_open(str(file), "pt") as f:
            return {k: DTYPES.get(f.get_slice(k).get_dtype(), torch.float32) for k in f.keys()}  # noqa: SIM118
    except Exception as e:
        named = f" (named in {index.name})" if index is not None else ""
        raise ModelLoadError(f"{file}: not a readable safetensors file{named} ({describe_failure(e)}); "
                             "restore it or save the model again") from e


class LazyStateDict(Mapping[str, torch.Tensor]):
    """A folder's tensors as a read-only mapping: each read from its shard, in its stored
    dtype, only when asked for (and not kept)."""

    def __init__(self, layout: Layout) -> None:
        self.layout = layout
        self._open: dict[str, Any] = {}

    def __getitem__(self, name: str) -> torch.Tensor:
        file = self.layout.files[name]
        handle = self._open.get(file)
        if handle is None:
            handle = self._open[file] = safe_open(str(self.layout.folder / file), "pt")
        return handle.get_tensor(name)

    def __iter__(self) -> Iterator[str]:
        return iter(self.layout.files)

    def __len__(self) -> int:
        return len(self.layout.files)


def plan_shards(layout: Layout, state: Mapping[str, torch.Tensor],
                ties: Sequence[Sequence[str]] = ()) -> dict[str, list[str]] | None:
    """Which entries of ``state`` go into which file of ``layout``: the names it stored,
    where they were; a tied twin it did not store is written only where its values now
    differ (next to its twin). None when ``state`` lacks a name the layout stores (another
    naming): the caller writes it another way."""
    if any(k not in state for k in layout.files):
        return None
    plan: dict[str, list[str]] = {f: [] for f in layout.shards()}
    for k, f in layout.files.items():
        plan[f].append(k)
    twin_of = {n: g for g in ties for n in g}
    for k, v in state.items():
        if k in layout.files or not v.is_floating_point():
            continue  # a buffer the checkpoint does not store stays unstored
        stored = [t for t in twin_of.get(k, ()) if t in layout.files]
        if stored and (storage_key(state[stored[0]]) == storage_key(v) or torch.equal(state[stored[0]], v)):
            continue  # still tied: stored once, as in the input
        plan[layout.files[stored[0]] if stored else layout.shards()[-1]].append(k)
    return plan


def write_like(layout: Layout, state: Mapping[str, torch.Tensor], folder: Path,
               plan: Mapping[str, Sequence[str]] | None = None) -> list[str]:
    """Write ``state`` into ``folder`` in ``layout``'s files, one shard at a time, each
    floating-point tensor in the dtype the layout stores it in (a new name: the dtype of
    the entries beside it), plus the index when the layout had one. Returns the names of
    the files written. ``folder`` is a staging folder (:func:`symspec.outputs.atomic_write`)."""
    plan = plan if plan is not None else plan_shards(layout, state)
    if plan is None:
        raise ModelLoadError(f"{layout.folder}: the weights do not have the names its checkpoint stores")
    fallback = _one_dtype(layout.dtypes)
    weight_map: dict[str, str] = {}
    total = 0
    for file, names in plan.items():
        shard: dict[str, torch.Tensor] = {}
        seen: set[tuple[object, ...]] = set()
        for k in names:
            v = state[k].detach()
            dt = layout.dtypes.get(k, fallback) if v.is_floating_point() else None
            t = v.to(device="cpu", dtype=dt if dt is not None and dt.is_floating_point else v.dtype).contiguous()
            key = storage_key(t)
            shard[k] = t.clone() if key in seen else t  # safetensors refuses shared storage
            seen.add(key)
            total += t.numel() * t.element_size()
            weight_map[k] = file
        save_file(shard, str(folder / file), metadata={"format": "pt"})
        del shard
    written = list(plan)
    if layout.index is not None:
        index = dict(layout.index)
        meta = dict(index.get("metadata") or {}) if isinstance(index.get("metadata"), dict) else {}
        meta["total_size"] = total
        index["metadata"] = meta
        index["weight_map"] = dict(sorted(weight_map.items()))
        atomic_write_text(folder / INDEX, json.dumps(index, indent=2) + "\n")
        written.append(INDEX)
    return written


def _one_dtype(dtypes: Mapping[str, torch.dtype]) -> torch.dtype | None:
    floats = {d for d in dtypes.values() if d.is_floating_point}
    return next(iter(floats)) if len(floats) == 1 else None
