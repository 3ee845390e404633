"""``auto``: run the closed-form candidate methods and keep the one whose interpolation
midpoint has the lowest loss on held-out data.

Which method aligns a pair best depends on the pair: token-weighted weight matching wins
where rare tokens' embeddings (barely trained) differ, activation statistics where the
weights carry much the data never excites. ``auto`` does not guess: it runs every
registered method that declares itself a ``candidate`` (``weight``, ``weight-tokens``,
``activation``, ``weight+activation`` and any plugin that says so), cheapest first, and
scores each one's element by the loss of ``(A + g.B) / 2`` on the validation split
(``options.validation``; without one, on the train batches, which ``info`` says). The
best score wins; every candidate's score, time and objective is in ``info["auto"]``.

Cheap first: the two activation methods share one pass of statistics (collected for
the first, kept for the second). ``AutoOptions.budget``: once that many seconds have
gone, the candidates not yet run are skipped (the first always runs).
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import attrs

from ..errors import SymspecInputError
from .protocol import Alignment, AlignOptions, Endpoint

if TYPE_CHECKING:
    from ..problem import Problem

__all__ = ["AutoMatching", "AutoOptions"]


@attrs.frozen
class AutoOptions:
    """Knobs of ``auto``. ``candidates``: the methods to try, by name (None: every
    registered method with ``candidate = True``). ``budget``: seconds after which the
    candidates not yet run are skipped (None: no limit; the first candidate always runs).
    ``val_batches``: at most this many validation batches score each candidate.
    ``solver``: the descent's knobs (:class:`~symspec.solvers.WeightOptions`) every
    candidate gets (what universe matching passes every method)."""

    candidates: tuple[str, ...] | None = None
    budget: float | None = None
    val_batches: int | None = 8
    solver: Any = None

    def __attrs_post_init__(self) -> None:
        if self.budget is not None and not self.budget >= 0:
            raise SymspecInputError(f"auto: the time budget must be a number of seconds >= 0, got {self.budget}")
        if self.val_batches is not None and self.val_batches < 1:
            raise SymspecInputError(f"auto: val_batches must be at least 1, got {self.val_batches}")
        if self.candidates is not None and not self.candidates:
            raise SymspecInputError("auto: give at least one candidate method")


@attrs.frozen
class AutoMatching:
    """The method ``auto`` (see the module). ``options.tuning``: an :class:`AutoOptions`."""

    name: str = "auto"
    label: str = "auto (the candidate with the lowest midpoint loss)"
    canonical: bool = True
    needs_data: bool = True
    needs_module: bool = True
    groups: str | None = None
    #: it picks its result on ``options.validation``
    validates: bool = True

    def align(self, problem: Problem, a: Endpoint, b: Endpoint, options: AlignOptions) -> Alignment:
        return _align_auto(problem, a, b, options)


#: the order candidates run in when they are all asked for: the cheap ones first, and the
#: two that share statistics one after the other
_ORDER = ("weight", "weight-tokens", "activation", "weight+activation")


def candidate_names(requested: Sequence[str] | None = None) -> list[str]:
    """The candidates ``auto`` runs, in order: ``requested`` (checked, cheapest first), or
    every registered method that declares ``candidate = True``."""
    # deferred: the registry imports this module (through .builtin)
    from .registry import get_method, method_names

    if requested is None:
        names = [n for n in method_names() if getattr(get_method(n), "candidate", False)]
    else:
        names = list(dict.fromkeys(requested))
        for n in names:
            m = get_method(n)  # an unknown name: the registry's one-line error
            if m.name == "auto":
                raise SymspecInputError("auto cannot be a candidate of itself")
            if not m.canonical:
                raise SymspecInputError(f"auto: '{n}' ({m.label}) aligns nothing; its midpoint is vanilla averaging")
    rank = {n: i for i, n in enumerate(_ORDER)}
    return sorted(names, key=lambda n: rank.get(n, len(_ORDER)))


def _align_auto(problem: Problem, a: Endpoint, b: Endpoint, options: AlignOptions) -> Alignment:
    # deferred: methods are listed without torch (the CLI's help); the registry imports this module
    from ..solvers import MatchEvent, Timer
    from .activation import ActivationOptions
    from .mixture import Mixture
    from .registry import get_method

    opts = _options(options.tuning)
    if a.module is None:
        raise SymspecInputError("auto scores each candidate by running the model: it needs modules, not state dicts")
    names = candidate_names(opts.candidates)
    val, scored_on = _scoring_batches(options, opts.val_batches)
    scorer = options.validation if getattr(options.validation, "loss", None) is not None else options.data
    if getattr(scorer, "loss", None) is None:
        raise SymspecInputError("auto scores each candidate by the loss of its midpoint: the data has no loss "
                                "(symspec.data.load_data gives one; so does an EvalData)")
    mixture = Mixture(problem, a.module, [a.state, b.state], options.device)
    timer = options.timer or Timer()
    # the two activation methods read the same statistics: one pass, kept for the second
    shared: dict[str, Any] | None = {} if {"activation", "weight+activation"} <= set(names) else None
    tried: list[dict[str, Any]] = []
    found: dict[str, Alignment] = {}
    t_start = time.perf_counter()
    for k, name in enumerate(names):
        m = get_method(name)
        if opts.budget is not None and k > 0 and time.perf_counter() - t_start > opts.budget:
            tried.append({"method": name, "skipped": f"the time budget of {opts.budget:g} s was spent"})
            continue
        if options.progress is not None:
            options.progress(MatchEvent("auto", k + 1, len(names), space=name))
        if name in ("activation", "weight+activation", "weight-tokens"):
            tuning: Any = ActivationOptions(moments=shared if name != "weight-tokens" else None, solver=opts.solver,
                                            **({"batches": None} if name == "weight-tokens" else {}))
        else:
            tuning = opts.solver
        sub = attrs.evolve(options, consume_b=False, tuning=tuning, timer=Timer())
        t0 = time.perf_counter()
        try:
            res = m.align(problem, a, b, sub)
        except SymspecInputError as e:  # a candidate that cannot run here (memory, no token table): said, not fatal
            tried.append({"method": name, "error": str(e), "seconds": time.perf_counter() - t0})
            continue
        seconds = time.perf_counter() - t0
        timer.seconds[f"auto: {name}"] += seconds
        with timer("auto: scoring"):
            score = _midpoint_loss(mixture, problem, res.elements, val, scorer)
        tried.append({"method": name, "label": m.label, "midpoint_loss": score, "seconds": seconds,
                      "objective": res.history[-1] if res.history else None})
        found[name] = res
        if shared and name == "weight+activation":  # the last to read the statistics: let them go
            shared.clear()
    scored = [t for t in tried if "midpoint_loss" in t and math.isfinite(t["midpoint_loss"])]
    if not scored:
        why = "; ".join(f"{t['method']}: {t.get('error') or t.get('skipped') or 'a non-finite midpoint loss'}" for t in tried)
        raise SymspecInputError(f"auto: no candidate method gave a usable alignment ({why})")
    best = min(scored, key=lambda t: t["midpoint_loss"])
    winner = found[best["method"]]
    info = {**winner.info, "auto": {"winner": best["method"], "scored_on": scored_on, "batches": len(val),
                                    "candidates": tried}}
    return Alignment(winner.elements, winner.history, timer.as_dict(), winner.converged, None, info)


def _options(tuning: Any) -> AutoOptions:
    """``tuning`` as :class:`AutoOptions`: itself, or the solver's knobs alone."""
    # deferred: methods are listed without torch (the CLI's help)
    from ..solvers import WeightOptions

    if tuning is None or isinstance(tuning, AutoOptions):
        return tuning or AutoOptions()
    if isinstance(tuning, WeightOptions):
        return AutoOptions(solver=tuning)
    raise SymspecInputError(f"auto's options are an AutoOptions (or WeightOptions), not a {type(tuning).__name__}")


def _scoring_batches(options: AlignOptions, limit: int | None) -> tuple[list[Any], str]:
    """The batches the candidates are scored on, and which split they are."""
    val = list(getattr(options.validation, "batches", None) or [])
    if val:
        return val[:limit] if limit is not None else val, "validation"
    train = list(getattr(options.data, "batches", None) or [])
    if not train:
        raise SymspecInputError("auto scores the candidates on data: give it data (--data)")
    return train[:limit] if limit is not None else train, "train (no validation split was given)"


def _midpoint_loss(mixture: Any, problem: Problem, elements: dict[str, Any], batches: list[Any], data: Any) -> float:
    """The mean loss of ``(A + g.B) / 2`` over ``batches``."""
    weights = mixture.mix([mixture.states[0], mixture.transformed(1, problem.complete(elements))], [0.5, 0.5])
    return mixture.mean_loss(data, weights, batches)
