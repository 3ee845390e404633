"""``symspec.align(a, b, spec, method=...)``: align model B to model A with any registered method.

>>> import symspec  # doctest: +SKIP
>>> res = symspec.align(model_a, model_b, "nanogpt", method="weight")  # doctest: +SKIP
>>> res.history  # the method's objective before the first round, then after each  # doctest: +SKIP
>>> merged = res.interpolate(0.5)  # doctest: +SKIP
>>> res.canonical_model.load_state_dict(merged)  # doctest: +SKIP

The pipeline is the same for every method, a chain of stages (:mod:`.stages`): both
models are bound to the spec and checked (finite weights, one problem), brought into
canonical form (norm gains folded, residual writers mean-centred, ...; skipped by methods
that work on the raw weights), the searched groups are restricted (``groups``), the
method finds one element per space, they are embedded back into the spec's groups, B is
transformed by them and the result recorded. Extensions add stages before and after
(:mod:`.hooks`: the width lift, the lift's free directions). The result keeps the architecture: ``aligned_b`` loads into
``canonical_model`` (a copy of A's class in canonical form), as does any interpolation.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from ..binding import BoundSpec
from ..data import check_inputs
from ..errors import SymspecInputError
from ..groups import Element
from ..problem import Problem
from ..solvers import Timer
from ..spec.model import Spec
from ..statedict import narrow_like, working_dtype
from .hooks import AlignRequest, run_post_stages, run_pre_stages
from .protocol import Alignment, AlignOptions, Method
from .registry import get_method, load_plugins
from .result import AlignResult, canonical_module, mode_text, no_certificate, weight_distance
from .stages import (
    ModelLike,
    Pair,
    bind_and_check,
    canonicalize,
    check_same_problem,
    embed_elements,
    endpoints,
    record,
    restrict,
    transform_b,
)


def align(model_a: ModelLike, model_b: ModelLike, spec: Spec | BoundSpec | str | Path, *,
          method: str | Method = "weight", groups: str | Mapping[str, str] | None = None, rounds: int = 10,
          tol: float = 1e-6, device: str | torch.device = "cpu", dtype: torch.dtype | None = None,
          data: Any = None, validation: Any = None, progress: Any = None, config: Any = None,
          keep_canonical_b: bool = True, options: Any = None, lift: str = "fitted", lift_seed: int = 0,
          lift_free: int = 0, lift_free_lambda: str = "uniform") -> AlignResult:
    """Align ``model_b`` to ``model_a`` under ``spec`` with a registered ``method``
    (:func:`symspec.alignment.method_names`; ``"weight"``: weight matching, data-free).

    ``model_a``/``model_b``: modules (or state dicts, with ``config`` for the spec's
    dimensions). ``spec``: a Spec, a BoundSpec (of A), a path or a built-in name.
    ``groups``: restrict the search, ``"perm"`` (permutations only, the paper's ablation),
    ``"full"``, or per declared space, ``"perm,attn=full"`` (:mod:`symspec.solvers.engine.restrict`);
    default: the method's own (``"full"`` for most). ``rounds``/``tol``: at most ``rounds``
    rounds, fewer once a round gains less than ``tol`` (relative). ``device``: where the
    dense work runs. ``dtype``: the working precision (default: A's; float32 for float16
    and bfloat16 weights; the state dicts returned keep every input's dtype). ``data``:
    evaluation data for the methods that need it (a train split); ``validation``: held-out
    data for the methods that pick a step (learned matching; None: they hold out part of
    ``data``). ``progress``: called with a
    :class:`~symspec.solvers.MatchEvent` after every solved space and round.
    ``keep_canonical_b=False`` saves one copy of B where the method can work in place
    (``canonical_b`` is then None). ``options``: the method's own knobs (for weight
    matching a :class:`~symspec.solvers.WeightOptions`). Inputs are never modified.

    Models of different widths (modules only; the same depth, B no wider than A in any
    space): B is first lifted into A's shape without changing its function
    (:mod:`symspec.width`), with maps fitted to A's weights (``lift="fitted"``), fitted
    to A's activations on ``data`` (``lift="activation"``: the methods that take data) or
    drawn at random (``lift="random"``, seed ``lift_seed``); ``info["lift"]`` says what was
    lifted, and ``aligned_b`` has A's shapes. ``lift_free``: steps of training the lift's
    free directions (the readers' weights on what B's residual stream never holds) for
    the interpolated model's loss on ``data``, after the alignment, lambda drawn by
    ``lift_free_lambda`` (:func:`symspec.width.free.learn_free`; 0: off, the default).
    """
    load_plugins()  # the extensions' stages, and the methods
    m = method if isinstance(method, Method) else get_method(method)
    request = AlignRequest(model_a, model_b, spec, m, data, validation, device, progress,
                           options={"lift": lift, "lift_seed": lift_seed, "lift_free": lift_free,
                                    "lift_free_lambda": lift_free_lambda})
    _check_data(request)
    run_pre_stages(request)
    timer, t0 = Timer(), time.perf_counter()
    pair = bind_and_check(request.model_a, request.model_b, spec, config, timer)
    # a lifted B is in canonical form; B given up to the method: its working copy all its own
    canonicalize(pair, m, timer, force=request.canonical_input, own_b=not keep_canonical_b)
    problem = pair.bound_a.problem
    modes, searched_problem = restrict(problem, groups if groups is not None else m.groups)
    ea, eb = endpoints(pair, m, request.model_a, request.model_b)
    # the canonical distance, while canonical B is whole (a method may consume it); a method
    # whose first objective value is that distance says so and saves the pass over the weights
    known = getattr(m, "objective_is_distance", False)
    d0 = None if keep_canonical_b or known else weight_distance(pair.bound_a, pair.a, pair.b)
    work_dtype = dtype or working_dtype(next((pair.a[p].dtype for p in problem.params), torch.float64))
    opts = AlignOptions(rounds=rounds, tol=tol, device=device, dtype=dtype, data=data, validation=validation,
                        progress=progress, timer=timer, tuning=options, consume_b=not keep_canonical_b)
    found = m.align(searched_problem, ea, eb, opts)
    if known and not keep_canonical_b and found.history:
        d0 = found.history[0]
    elements = embed_elements(problem, searched_problem, found, work_dtype)
    with timer("transform"):
        aligned = transform_b(pair, found, elements)
    result = _result(request, pair, found, elements, searched_problem, modes, work_dtype, aligned,
                     keep_canonical_b, timer, t0, d0)
    return run_post_stages(result, request)


def _check_data(request: AlignRequest) -> None:
    """Before anything runs: data of the wrong kind (images for a GPT) is one line naming
    the source and what the model reads, not a traceback from its embedding; a method that
    needs data has some."""
    if request.data is not None and isinstance(request.model_a, torch.nn.Module):
        check_inputs(request.model_a, request.data, f"model A ({type(request.model_a).__name__})")
    if request.method.needs_data and request.data is None:
        raise SymspecInputError(f"the method '{request.method.name}' needs data (pass data=, or --data on the command line)")


def _result(request: AlignRequest, pair: Pair, found: Alignment, elements: dict[str, Element], searched_problem: Problem,
            modes: dict[str, str], work_dtype: torch.dtype, aligned: dict[str, torch.Tensor], keep_canonical_b: bool,
            timer: Timer, t0: float, d0: float | None) -> AlignResult:
    """The result and its record, with what the pre-stages reported (``request.info``)."""
    m, problem = request.method, pair.bound_a.problem
    searched = {s: str(searched_problem.spaces[s].group) for s in problem.spaces}
    narrowed = {s: g for s, g in searched.items() if searched_problem.spaces[s].group != problem.spaces[s].group}
    rec = record(pair.bound_a, m, elements, narrowed, found, modes, work_dtype)
    rec.meta.update(request.info)
    # the working copies are the pipeline's own: narrowed entry by entry, not copied whole
    cb = narrow_like(pair.b, pair.raw_b, in_place=True) if keep_canonical_b else None
    ca = narrow_like(pair.a, pair.raw_a, in_place=True)
    timings = timer.as_dict()
    timings["total"] = time.perf_counter() - t0
    model_a = request.model_a if isinstance(request.model_a, torch.nn.Module) else None
    return AlignResult(pair.bound_a, ca, cb, narrow_like(aligned, pair.raw_b, in_place=True), elements,
                       rec, found.history, timings, found.converged, searched, model_a, m.name,
                       {**found.info, **request.info}, d0, m.canonical or request.canonical_input)


__all__ = ["AlignResult", "ModelLike", "align", "canonical_module", "check_same_problem", "mode_text",
           "no_certificate", "weight_distance"]
