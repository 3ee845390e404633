"""The plan of a staged statistics pass (:func:`~.moments.collect_site_stats`): which
sites each stage collects, what the statistics keep in memory and on disk, and where
the large blocks wait for the descent."""

from __future__ import annotations

import os
import warnings
from collections.abc import Mapping
from typing import Any

import torch

from ..errors import SymspecInputError
from ..problem import Site
from ..process import available_memory
from ..solvers.engine.activation_statistics import ActivationMoments
from ..solvers.engine.spill import SpillStore

__all__ = ["STAGE_BYTES", "STAGE_RESERVE", "kept_bytes", "open_spill", "plan_stages"]

#: memory kept free beside a staged pass's statistics, of what the machine has free: the
#: descent after it holds B's working copy and the objective's temporaries
STAGE_RESERVE = 0.15

#: at most this many bytes of float64 moments and float32 accumulators per stage (or one
#: site's, where larger), whatever the memory free: a stage costs no arithmetic (every
#: node runs once whatever the stages), so a pass holds no more than this beside the
#: statistics (GPT-2 small: 1.4 GB of moments at once in one pass)
STAGE_BYTES = 1 << 29


def kept_bytes(found: tuple[Site, ...], planned: ActivationMoments, dtype: torch.dtype,
               spill_min: int | None = None) -> tuple[int, int]:
    """What the statistics of ``found`` will hold in ``dtype`` once alike sites are added
    into one (:func:`merge_site_stats`: one per structure), in memory and on disk (the
    square blocks of ``spill_min`` bytes or more; None: none)."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    kept: dict[Any, tuple[int, int]] = {}
    for s in found:
        m = planned.moments[s.name]
        shape = _structure(s, planned)
        memory = disk = 0
        for c, g in zip(m.cross, m.gram):
            for t in (c, g):
                if t is None:
                    continue
                n = t.numel() * itemsize
                if spill_min is not None and n >= spill_min:
                    disk += n
                else:
                    memory += n
        memory += 4 * m.size * itemsize  # the vectors: diagonal, energies
        kept[shape] = (memory, disk)
    return sum(m for m, _ in kept.values()), sum(d for _, d in kept.values())


def _structure(site: Site, planned: ActivationMoments) -> tuple[Any, ...]:
    """What alike sites share (:meth:`~symspec.solvers.engine.site_statistics.SiteStats.structure`):
    per block, its segment and whether it keeps a Gram."""
    return tuple((seg, g is not None) for seg, g in zip(site.axis.segments, planned.moments[site.name].gram))


def open_spill(spill: bool | str | os.PathLike[str], need: int) -> SpillStore | None:
    """Where ``need`` bytes of statistics wait for the descent: None (in memory) where
    ``spill`` is False or nothing is large enough; else a store in the folder asked
    (``True``: the system's temporary folder, in memory with a warning where that
    cannot be written or has no room; a folder named: an error)."""
    if spill is False or need == 0:
        return None
    if spill is not True:
        where = os.fspath(spill)
        if not os.path.isdir(where):
            raise SymspecInputError(f"the folder for activation statistics, {where}, is not a folder")
        store = SpillStore(where)
    else:
        try:
            store = SpillStore()
        except SymspecInputError as e:
            warnings.warn(f"activation statistics kept in memory: {e}", stacklevel=3)
            return None
    room = store.free()
    if room < need * 1.1 + (1 << 28):
        store.close()
        text = (f"activation statistics need {_gb(need)} on disk in {store.parent}, which has "
                f"{_gb(room)} free")
        if spill is not True:
            raise SymspecInputError(f"{text}; free space there or name another folder")
        warnings.warn(f"{text}: kept in memory (set TMPDIR to a folder with room)", stacklevel=3)
        return None
    return store


def plan_stages(found: tuple[Site, ...], planned: ActivationMoments, order: Mapping[str, int], dtype: torch.dtype,
                model: str, *, available: int | None = None, features: int = 0,
                stage_bytes: int = STAGE_BYTES, spill_min: int | None = None) -> list[list[str]]:
    """The sites in stages, in the order their nodes run: as many per stage as fit in
    ``stage_bytes`` and in the memory free (``available``, default what the machine has
    free) once the statistics every site keeps in memory (:func:`kept_bytes`, the blocks
    of ``spill_min`` bytes or more on disk), one batch's features and
    :data:`STAGE_RESERVE` are set aside, a site counting its float64 moments and their
    float32 accumulators (1.5 times the moments). Refused in one line where one site
    alone does not fit."""
    names = sorted((s.name for s in found), key=lambda n: order[n])
    work = {n: planned.moments[n].bytes * 3 // 2 for n in names}
    compact = kept_bytes(found, planned, dtype, spill_min)[0]
    kept = {_structure(s, planned) for s in found}
    free = available if available is not None else available_memory()
    biggest = max(names, key=lambda n: work[n])
    room = int(free * (1 - STAGE_RESERVE)) - compact - features if free is not None else stage_bytes
    if work[biggest] > room:
        need = (work[biggest] + compact + features) / (1 - STAGE_RESERVE)
        raise SymspecInputError(
            f"activation statistics of {model} need about {_gb(need)} (the statistics of {len(names)} sites, "
            f"{len(kept)} once alike ones are added, "
            f"in {str(dtype).removeprefix('torch.')}, {_gb(compact)}, and the float64 moments of the largest, "
            f"{biggest}, while they are collected), more than the {_gb(free)} this machine has free; align "
            "with --method weight (data-free), or on a machine with more memory")
    room = min(room, max(stage_bytes, work[biggest]))
    stages: list[list[str]] = [[]]
    held = 0
    for n in names:
        if stages[-1] and held + work[n] > room:
            stages.append([])
            held = 0
        stages[-1].append(n)
        held += work[n]
    return stages


def _gb(n: float) -> str:
    return f"{n / 1e9:.3g} GB"


def _span(order: Mapping[str, int], stages: list[list[str]], k: int) -> tuple[int, int]:
    """Stage ``k``'s span of the nodes of a trace (positions ``order``): from the end of
    the stage before to just after its own last site."""
    lo = max((order[n] for n in stages[k - 1]), default=-1) + 1 if k else 0
    hi = max(order[n] for n in stages[k]) + 1
    if any(not lo <= order[n] < hi for n in stages[k]):
        raise SymspecInputError("the traces of two batch shapes order the activation sites differently; "
                                "give batches of one shape")
    return lo, hi
