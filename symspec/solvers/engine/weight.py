"""Weight matching: coordinate descent over the spaces of a :class:`~symspec.problem.Problem`.

Minimise ``sum_P w_P ||A_P - g.B_P||_F^2`` over one element per space, both state dicts
in canonical form. :func:`match_weights` puts together three parts:

- where the statistics come from (:mod:`.statistics`): by default the weights
  themselves (:mod:`.weight_statistics`; how exact their objective is: :mod:`.rounding`);
- the coordinate descent (:mod:`.descent`): schedule, greedy start, acceptance on
  rounding-aware noise levels, history, convergence;
- how the work is executed (:mod:`.execution`): threads, the background head solve,
  overlap on few cores.
"""

from __future__ import annotations

from collections.abc import Mapping

import attrs
import torch

from ...errors import SymspecInputError
from ...groups import Element
from ...precision import IEEEFloat32
from ...problem import Problem
from ...statedict import widen, working_dtype
from .base import SolveContext, Timer
from .descent import Descent, MatchEvent, Progress, schedule
from .execution import ThreadedExecution
from .rounding import sqdist
from .statistics import ProviderFactory
from .weight_statistics import WeightStatistics, joint_pairs

__all__ = ["MatchEvent", "WeightMatchingResult", "WeightOptions", "joint_pairs", "match_weights", "schedule",
           "sqdist", "widen", "working_dtype"]


#: default ``WeightOptions.trial_bytes``: 256 MiB. A 0.5B model's residual trial (1.4 GB in
#: float32) otherwise set its match's peak memory
TRIAL_BYTES = float(1 << 28)


@attrs.frozen
class WeightOptions:
    """The solver's knobs, none of which changes what is minimised.

    ``max_iter``: Gauss-Newton steps per GL solve (the iteration resumes next round).
    ``greedy_start``: the first round solves each space from the parameters whose other
    spaces are already solved (kept only if that round ends below the starting
    objective). ``lap_workers``: assignments of one schedule class solved at once
    (threads). ``overlap``: batched solves may run beside the statistics on few cores
    (:class:`~.execution.ThreadedExecution`); the result is the same either way.
    ``own_b``: ``sd_b`` is a dict the solver may take tensors out of: B's bound tensors
    become the working copy instead of being copied (for large models: one copy of B
    less), and the result carries B transformed (``aligned``), accumulated round by round
    (equal to applying ``elements`` to B up to rounding). ``trial_bytes``: how much of B's
    parameters transformed by a tried change is kept until the change is taken; the rest
    is measured, let go and built again if it is (the same result; a residual rotation's
    trial is otherwise a second copy of the model).
    """

    max_iter: int = 5
    greedy_start: bool = True
    lap_workers: int = 1
    overlap: bool = True
    own_b: bool = False
    trial_bytes: float = TRIAL_BYTES


@attrs.define
class WeightMatchingResult:
    elements: dict[str, Element]
    #: the objective before the first round, then after each round
    history: list[float]
    timings: dict[str, float]
    #: spaces whose element changed in the last round
    changed: list[str]
    converged: bool
    #: with ``own_b``: B transformed by ``elements`` (one entry per tie representative)
    aligned: dict[str, torch.Tensor] | None = None


@IEEEFloat32()  # TF32 products would stop the descent ~100x short of the planted element
def match_weights(problem: Problem, sd_a: Mapping[str, torch.Tensor], sd_b: Mapping[str, torch.Tensor], *,
                  rounds: int = 10, tol: float = 1e-6, device: str | torch.device = "cpu",
                  dtype: torch.dtype | None = None, init: Mapping[str, Element] | None = None,
                  progress: Progress | None = None, timer: Timer | None = None,
                  options: WeightOptions | None = None, provider: ProviderFactory | None = None) -> WeightMatchingResult:
    """Coordinate descent for ``min_g sum_P ||A_P - g.B_P||^2`` (both in canonical form).

    ``rounds``: at most this many rounds; stop earlier once a round improves the
    objective by less than ``tol`` (relative). ``dtype``: the working precision (default:
    A's, float32 for float16 and bfloat16). ``init``: a starting element per space.
    ``options``: the solver's knobs (:class:`WeightOptions`). Spaces whose group is
    trivial are not searched. Elements come back in ``problem``'s groups, on ``device``.

    ``provider``: where the statistics come from, a factory ``(problem, ctx, init) ->``
    :class:`~.statistics.StatisticsProvider` (activation statistics, say; then ``sd_a``
    and ``sd_b`` are not read). Default: the weights ``sd_a`` and ``sd_b``.
    """
    opts = options or WeightOptions()
    if rounds < 0:
        raise SymspecInputError(f"rounds must be >= 0, got {rounds}")
    if provider is None:
        missing = [p for p in problem.params if p not in sd_a or p not in sd_b]
        if missing:
            raise SymspecInputError(f"parameter(s) missing from a state dict: {', '.join(missing[:5])}")
    elif opts.own_b:
        raise SymspecInputError("own_b is for the weights' own statistics, not for another provider")
    ref = next((sd_a[p] for p in problem.params if p in sd_a), None)
    dt = dtype or (working_dtype(ref.dtype) if ref is not None and ref.is_floating_point() else torch.float64)
    if opts.lap_workers < 1:
        raise SymspecInputError(f"lap_workers must be >= 1, got {opts.lap_workers}")
    if not opts.trial_bytes >= 0:
        raise SymspecInputError(f"trial_bytes must be >= 0, got {opts.trial_bytes}")
    ctx = SolveContext(device=torch.device(device), dtype=dt, timer=timer or Timer(), max_iter=opts.max_iter)
    weights = WeightStatistics(problem, sd_a, sd_b, ctx, init, own_b=opts.own_b, trial_bytes=opts.trial_bytes) if provider is None else None
    source = weights if weights is not None else provider(problem, ctx, init)  # type: ignore[misc]
    descent = Descent(problem, source, ctx, ThreadedExecution(opts.lap_workers, opts.overlap))
    out = descent.run(rounds, tol, opts.greedy_start, progress)
    aligned = weights.aligned() if weights is not None and opts.own_b else None
    return WeightMatchingResult(source.elements, out.history, ctx.timer.as_dict(), out.changed, out.converged, aligned)
