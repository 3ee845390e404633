"""Arithmetic and checks on state dicts, shared by alignment, universe matching, merging
and the checker: one implementation each.

>>> import torch
>>> a, b = {"w": torch.zeros(2)}, {"w": torch.ones(2)}
>>> interpolate_state_dicts(a, b, 0.25)["w"].tolist()
[0.25, 0.25]
>>> squared_distance(a, b, ["w"])
2.0
"""

from __future__ import annotations

import ctypes
import ctypes.util
import mmap
from collections.abc import Iterable, Mapping

import torch

from .errors import SymspecInputError
from .groups import Element

#: dtypes matched in a wider working dtype and written back in their own
LOW_PRECISION = (torch.float16, torch.bfloat16)


def working_dtype(dtype: torch.dtype) -> torch.dtype:
    """The precision weights stored in ``dtype`` are aligned in: float32 for float16 and
    bfloat16 (the results are cast back for writing), else ``dtype`` itself.

    >>> working_dtype(torch.bfloat16), working_dtype(torch.float64)
    (torch.float32, torch.float64)
    """
    return torch.float32 if dtype in LOW_PRECISION else dtype


def widen(sd: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``sd`` with its float16/bfloat16 entries in float32 (the others as they are), to be
    canonicalised and aligned in float32."""
    return {k: (v.float() if v.dtype in LOW_PRECISION else v) for k, v in sd.items()}


#: entries per float64 piece of :func:`squared_distance` (32 MiB): an embedding is never
#: copied whole into float64
DISTANCE_CHUNK = 1 << 22


def squared_distance(a: Mapping[str, torch.Tensor], b: Mapping[str, torch.Tensor], names: Iterable[str]) -> float:
    """sum over ``names`` of ||a - b||^2, accumulated in float64 (never negative), in
    pieces of :data:`DISTANCE_CHUNK` entries (an entry at most that large: in one piece).
    A one-element entry of ``b`` (a scalar zero) is broadcast."""
    total = 0.0
    for p in names:
        x, y = a[p].reshape(-1), b[p].reshape(-1)
        for i in range(0, max(x.numel(), 1), DISTANCE_CHUNK):
            piece = y if y.numel() == 1 else y[i : i + DISTANCE_CHUNK]
            total += float((x[i : i + DISTANCE_CHUNK].double() - piece.double()).square().sum())
    return total


def interpolate_state_dicts(a: Mapping[str, torch.Tensor], b: Mapping[str, torch.Tensor], alpha: float,
                            out: dict[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
    """``(1 - alpha) a + alpha b`` for the floating-point entries both hold (exactly ``a``
    at 0 and ``b`` at 1: ``torch.lerp`` is exact at both ends); the others from ``a``.
    With ``out``, writes into its tensors (same shapes and dtypes) instead of new ones."""
    result = out if out is not None else {}
    for k, v in a.items():
        w = b.get(k)
        if w is None or not v.is_floating_point() or not w.is_floating_point():
            result[k] = v
        elif out is not None and k in out:
            torch.lerp(v, w.to(v.dtype), alpha, out=out[k])
        else:
            result[k] = torch.lerp(v, w.to(v.dtype), alpha)
    return result


def _finite(v: torch.Tensor) -> bool:
    # one pass without a temporary: a finite sum means finite entries; an infinite sum
    # may be an overflow of finite entries, so then look at them
    return bool(torch.isfinite(v.sum())) or bool(torch.isfinite(v).all())


def check_finite(sd: Mapping[str, torch.Tensor], which: str) -> None:
    """Refuse a state dict with NaN or inf in a floating-point entry (names the first three)."""
    bad = [k for k, v in sd.items() if isinstance(v, torch.Tensor) and v.is_floating_point() and not _finite(v)]
    if bad:
        more = f" and {len(bad) - 3} more" if len(bad) > 3 else ""
        raise SymspecInputError(f"model {which} has NaN or inf weights in {', '.join(bad[:3])}{more}")


def narrow_like(sd: Mapping[str, torch.Tensor], like: Mapping[str, torch.Tensor], *,
                in_place: bool = False) -> dict[str, torch.Tensor]:
    """``sd`` with the entries that ``like`` stores in float16/bfloat16 cast back to it.
    With ``in_place``, ``sd`` (a dict its caller owns) is the one rewritten and returned,
    each wide entry let go as soon as its narrow copy is made."""
    out = sd if in_place and isinstance(sd, dict) else dict(sd)
    for k, v in sd.items():
        ref = like.get(k)
        if ref is not None and ref.dtype in LOW_PRECISION and v.is_floating_point() and v.dtype != ref.dtype:
            out[k] = v.to(ref.dtype)
    return out


def storage_key(t: torch.Tensor) -> tuple[object, ...]:
    """What tied entries of a state dict share: distinct tensor objects over one storage,
    at one offset, with one shape and stride (meta and fake tensors: the object itself).

    >>> w = torch.zeros(2, 3)
    >>> storage_key(w) == storage_key(w.view(2, 3)), storage_key(w) == storage_key(w[0])
    (True, False)
    """
    try:
        return (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), tuple(t.stride()), t.device)
    except (RuntimeError, NotImplementedError):
        return (id(t),)


#: madvise(2)'s MADV_PAGEOUT (Linux 5.4+): reclaim these pages now
_MADV_PAGEOUT = 21


def _file_ranges() -> list[tuple[int, int]] | None:
    """The address ranges this process maps from files (None: no ``/proc/self/maps``)."""
    try:
        with open("/proc/self/maps") as f:
            return [(int(lo, 16), int(hi, 16)) for lo, _, hi in (line.split()[0].partition("-") for line in f
                                                                 if len(line.split()) >= 6 and line.split()[5].startswith("/"))]
    except (OSError, ValueError):
        return None


def _span(t: torch.Tensor) -> tuple[int, int] | None:
    """The whole pages a CPU tensor's storage covers, or None."""
    if not isinstance(t, torch.Tensor) or t.device.type != "cpu":
        return None
    try:
        storage = t.untyped_storage()
        start, size = storage.data_ptr(), storage.nbytes()
    except (RuntimeError, NotImplementedError):
        return None
    page = mmap.PAGESIZE
    lo, hi = -(-start // page) * page, (start + size) // page * page
    return (lo, hi) if lo < hi else None


def mapped_from_file(tensors: Iterable[torch.Tensor]) -> set[int]:
    """The ``id`` s of the tensors whose memory is a view of a file mapped into memory (a
    checkpoint transformers or safetensors mapped instead of reading it)."""
    ranges = _file_ranges() or []
    out = set()
    for t in tensors:
        span = _span(t)
        if span is not None and any(a < span[1] and span[0] < b for a, b in ranges):
            out.add(id(t))
    return out


def release_file_pages(tensors: Iterable[torch.Tensor]) -> int:
    """Let the kernel take back the resident pages of tensors that are memory-mapped views
    of a file (:func:`mapped_from_file`), once they have been read into working copies:
    they are clean copies of the file, read again from it if ever touched, so no value
    changes and nothing is written. Memory that is not a file's (a tensor of its own, or
    a page written since it was mapped) is left as it is. Returns the bytes advised; 0
    where ``madvise`` or ``/proc/self/maps`` is missing (not Linux)."""
    ranges = _file_ranges()
    if ranges is None:
        return 0
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    except OSError:
        return 0
    done = 0
    seen: set[tuple[int, int]] = set()
    for t in tensors:
        span = _span(t)
        if span is None or span in seen:
            continue
        seen.add(span)
        for a, b in ranges:
            a, b = max(a, span[0]), min(b, span[1])
            if a < b and libc.madvise(ctypes.c_void_p(a), ctypes.c_size_t(b - a), _MADV_PAGEOUT) == 0:
                done += b - a
    return done


def element_to_cpu(e: Element) -> Element:
    """An element's tensors, detached, on the CPU (for records and files)."""
    return {k: v.detach().to("cpu") for k, v in e.items()}


def detached_state(model: torch.nn.Module | Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A module's state dict (detached), or a copy of the mapping given."""
    if isinstance(model, torch.nn.Module):
        return {k: v.detach() for k, v in model.state_dict().items()}
    return dict(model)


def functional_names(module: torch.nn.Module) -> tuple[list[str], dict[str, str]]:
    """The state-dict names ``functional_call`` swaps in (one per tied tensor) and, for
    each other name of a tie, the name it is tied to.

    Only the module's state dict counts: a buffer outside it (non-persistent, such as
    the rotary frequencies of Llama-style models or BERT's position ids) is in no
    checkpoint and no interpolation, so ``functional_call`` keeps the module's own.

    >>> import torch
    >>> m = torch.nn.Linear(2, 2)
    >>> m.register_buffer("scale", torch.ones(1), persistent=False)
    >>> functional_names(m)
    (['weight', 'bias'], {})
    """
    seen: dict[int, str] = {}
    keep: list[str] = []
    alias: dict[str, str] = {}
    # keep_vars: the Parameters themselves, so that tied names share one identity
    named = [(k, v) for k, v in module.state_dict(keep_vars=True).items() if isinstance(v, torch.Tensor)]
    for name, t in named:
        if id(t) in seen:
            alias[name] = seen[id(t)]
        else:
            seen[id(t)] = name
            keep.append(name)
    return keep, alias
