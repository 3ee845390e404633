"""The learned refinement of universe matching (the paper's §4.3, DESIGN §4).

After the rounds of universe (weight) matching, every model's element is refined for
the loss of merged models: at each step, weights ``w ~ Dirichlet(alpha 1)`` over the N
models (``alpha = 0.1``: most draws near the simplex's edges and corners, some inside),
and the loss of ``sum_i w_i h_i g_i theta_i`` on a batch of the train split, trained
over the ``h_i`` (:func:`symspec.learned.loop.learn`, the same parametrisations and
schedule as learned matching of a pair). The reference model's ``h`` stays the identity:
a symmetry applied to every model at once changes no merged model's function, so fixing
one removes that freedom without losing anything. Validation is the uniform merge
(``w = 1/N``) on the val split; the best step wins, and every refined model must compute
its model's function (checked in float64, or the run fails).

The refined models replace the aligned ones, the merged model becomes their uniform
average, and each model's transform record holds ``h_i g_i``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import attrs
import numpy as np
import torch

from ..learned.loop import Mixture, learn
from ..learned.method import LearnedOptions
from ..solvers import embed, restrict_problem
from ..transforms import apply_elements
from .algorithm import RunningMean
from .errors import UniverseError


def refine(result: Any, modes: Mapping[str, str], data: Any, validation: Any, options: LearnedOptions | None, *,
           device: str | torch.device = "cpu", progress: Any = None) -> dict[str, Any]:
    """Refine a :class:`~symspec.universe.UniverseResult` in place (aligned models, merged
    model, records); returns the account of the refinement (JSON-able). ``options``: the
    schedule and ``dirichlet`` (alpha) of :class:`~symspec.learned.LearnedOptions`."""
    if result.canonical_model is None:
        raise UniverseError("learned refinement runs the models: pass modules, model files or folders (not state dicts)")
    if data is None:
        raise UniverseError("learned refinement needs data (pass data=, or --data on the command line)")
    opts = options or LearnedOptions()
    alpha = opts.dirichlet
    problem = result.bound.problem
    searched = restrict_problem(problem, modes)
    n = len(result.models)
    aligned = [result.aligned_state(i) for i in range(n)]
    mixture = Mixture(searched, result.canonical_model, aligned, device)
    rng = np.random.default_rng(opts.seed)

    def sample(gen: torch.Generator) -> list[float]:
        return [float(x) for x in rng.dirichlet(np.full(n, alpha))]

    start = {i: {s: si.group.identity(device=mixture.device) for s, si in searched.spaces.items()}
             for i in range(n) if i != result.start}
    found = learn(mixture, start, sample, [1.0 / n] * n, data, validation, opts, progress=progress)
    # the refined models, their elements h_i g_i, and the merged model (their mean)
    refined = list(aligned)
    for i, h in found.elements.items():
        h_cpu = {s: {k: v.detach().to("cpu") for k, v in e.items()} for s, e in h.items()}
        refined[i] = apply_elements(searched, h_cpu, aligned[i])
        record = result.records[i]
        full = {}
        for s, g in record.elements.items():
            group = problem.spaces[s].group
            hs = embed(group, searched.spaces[s].group, h_cpu[s], _dtype(g))
            full[s] = group.compose(group.to(hs, _dtype(g)), g)
        result.records[i] = attrs.evolve(record, elements=full,
                                         meta={**record.meta, "refined": "learned", "alpha": alpha})
    result.aligned = refined
    mean = RunningMean()  # as the rounds average: float64, in index order
    for sd in refined:
        mean.add(sd)
    result.merged = mean.mean(next(v.dtype for v in result.merged.values() if v.is_floating_point()))
    info = {"alpha": alpha, "history": found.history, **found.info,
            "checks": {result.models[i].name: c for i, c in found.checks.items()}}
    info["best_val_merged_loss"] = info.pop("best_val_loss")
    info["val_merged_loss"] = info.pop("val_loss")
    return info


def _dtype(e: Mapping[str, torch.Tensor]) -> torch.dtype:
    return next((v.dtype for v in e.values() if v.is_floating_point()), torch.float64)
