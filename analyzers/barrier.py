"""Loss barriers (DESIGN §4) for pairs of models, with and without alignment.

The barrier of a path evaluated at λ_0 = 0 < ... < λ_{K-1} = 1 is

    B = max_k  L(λ_k) - [(1 - λ_k)·L(A) + λ_k·L(B)]

and ``peak_lambda`` is the λ where the maximum is reached (the first, on ties). Both
endpoints have a gap of exactly 0, so ``B >= 0``; ``interior_max`` (the maximum over
0 < λ < 1, ``None`` for K = 2) is negative for a path whose loss is strictly convex.
The accuracy barrier is the same with the sign turned: the largest drop of accuracy
below the endpoints' line.

Several pairs give a mean and its standard error (sample standard deviation / √n),
as the paper reports them.

>>> b = loss_barrier([0.0, 0.5, 1.0], [1.0, 3.0, 2.0])
>>> (b.value, b.peak_lambda)
(1.5, 0.5)
>>> mean_stderr([1.0, 2.0, 3.0])  # standard deviation 1, three values: 1/√3
(2.0, 0.5773502691896258)
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import attrs
import torch

from symspec.alignment import align, get_method, method_names
from symspec.data import EvalData, check_fits
from symspec.errors import SymspecInputError
from symspec.width import lift_needed

from .interpolate import (
    Curve,
    PathError,
    PathEvaluator,
    check_grid,
    check_pair,
    functional_names,
    lambdas,
)


@attrs.frozen
class Barrier:
    """The barrier of one curve: its value, where it peaks and the gap at every λ."""

    value: float
    peak_lambda: float
    gaps: tuple[float, ...]
    interior_max: float | None


def loss_barrier(lambdas: Sequence[float], losses: Sequence[float]) -> Barrier:
    """max over λ of L(λ) - ((1-λ)L(A) + λL(B)) on the evaluated grid."""
    return _barrier(lambdas, losses, sign=1.0)


def accuracy_barrier(lambdas: Sequence[float], accuracies: Sequence[float]) -> Barrier:
    """max over λ of ((1-λ)acc(A) + λacc(B)) - acc(λ): the worst drop below the line."""
    return _barrier(lambdas, accuracies, sign=-1.0)


def _barrier(lambdas: Sequence[float], values: Sequence[float], sign: float) -> Barrier:
    lam = [float(x) for x in lambdas]
    v = [float(x) for x in values]
    if len(lam) != len(v):
        raise PathError(f"{len(lam)} values of λ but {len(v)} losses")
    if len(lam) < 2 or lam[0] != 0.0 or lam[-1] != 1.0:
        raise PathError("a barrier needs a grid of λ from 0 to 1 with both endpoints")
    gaps = tuple(sign * (x - ((1.0 - t) * v[0] + t * v[-1])) for t, x in zip(lam, v))
    # NaN losses (a diverging midpoint) make the barrier infinite, not silently small.
    clean = [g if not math.isnan(g) else math.inf for g in gaps]
    k = max(range(len(clean)), key=lambda i: (clean[i], -i))
    interior = max(clean[1:-1]) if len(clean) > 2 else None
    return Barrier(clean[k], lam[k], tuple(clean), interior)


def mean_stderr(values: Sequence[float]) -> tuple[float, float | None]:
    """Mean and standard error of the mean (None for a single value)."""
    vals = [float(x) for x in values]
    if not vals:
        raise ValueError("mean_stderr of no values")
    mean = statistics.fmean(vals)
    if len(vals) < 2 or not all(math.isfinite(x) for x in vals):
        return mean, None
    return mean, statistics.stdev(vals) / math.sqrt(len(vals))


# --------------------------------------------------------------------------- alignment methods

@attrs.frozen
class Aligned:
    """Two endpoints ready to interpolate: the module to evaluate them in and their weights."""

    module: torch.nn.Module
    sd_a: Mapping[str, torch.Tensor]
    sd_b: Mapping[str, torch.Tensor]
    seconds: float = 0.0
    info: Mapping[str, Any] = attrs.field(factory=dict)


def _state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach() for k, v in model.state_dict().items()}


def method_label(name: str) -> str:
    """How reports and plots name a method: its registered label (the name itself for a
    method no longer registered)."""

    return get_method(name).label if name in method_names() else name


def align_pair(method: str, model_a: torch.nn.Module, model_b: torch.nn.Module, *, spec: Any = None,
               device: str | torch.device = "cpu", data: EvalData | None = None, **kw: Any) -> Aligned:
    """Two endpoints ready to interpolate, aligned by the registered ``method``
    (:func:`symspec.align`): both in canonical form, in A's canonical module. ``data``: the
    examples a data-driven method aligns on (a train split, never the evaluated one).
    ``kw`` goes to :func:`symspec.align` (``groups``, ``rounds``, ``options``, ...).

    Without a spec, a method that does not use canonical forms (vanilla averaging) gets
    the weights as they are; every other method needs the spec."""
    m = get_method(method)
    if spec is None:
        if not m.canonical:
            return Aligned(model_a, _state(model_a), _state(model_b))
        raise SymspecInputError(f"{m.label} needs a spec (--spec, the model file's SPEC, or a built-in spec)")

    start = time.perf_counter()
    result = align(model_a, model_b, spec, method=m, device=device, data=data, **kw)
    seconds = time.perf_counter() - start
    if result.canonical_model is None:
        raise SymspecInputError(f"{m.label} returned no module to evaluate the aligned pair in")
    return Aligned(result.canonical_model, result.canonical_a, result.aligned_b, seconds, result.summary())


# --------------------------------------------------------------------------- results

@attrs.frozen
class PairResult:
    """One pair, one method: its curve and barriers."""

    method: str
    pair: int
    a: str
    b: str
    curve: Curve
    barrier: Barrier
    accuracy_barrier: Barrier | None
    align_seconds: float = 0.0
    align_info: Mapping[str, Any] = attrs.field(factory=dict)


def pair_result(method: str, pair: int, a: str, b: str, curve: Curve, align_seconds: float = 0.0,
                align_info: Mapping[str, Any] | None = None) -> PairResult:
    acc = accuracy_barrier(curve.lambdas, curve.accuracies) if curve.accuracies is not None else None
    return PairResult(method, pair, a, b, curve, loss_barrier(curve.lambdas, curve.losses), acc, align_seconds,
                      dict(align_info or {}))


@attrs.frozen
class Summary:
    """Mean ± standard error over the pairs of one method."""

    method: str
    n: int
    barrier_mean: float
    barrier_stderr: float | None
    peak_lambda_mean: float
    loss_a_mean: float
    loss_b_mean: float
    accuracy_barrier_mean: float | None
    accuracy_barrier_stderr: float | None
    loss_mean: tuple[float, ...]
    loss_stderr: tuple[float | None, ...]
    accuracy_mean: tuple[float, ...] | None

    @property
    def label(self) -> str:
        return method_label(self.method)


def summarize(results: Sequence[PairResult]) -> Summary:
    """Mean ± standard error of the barrier (and the mean curve) over pairs of one method."""
    if not results:
        raise ValueError("summarize of no results")
    methods = {r.method for r in results}
    if len(methods) != 1:
        raise ValueError(f"summarize one method at a time, got {sorted(methods)}")
    grids = {r.curve.lambdas for r in results}
    if len(grids) != 1:
        raise PathError("the pairs were evaluated on different grids of λ; use one --points for all")
    bm, bs = mean_stderr([r.barrier.value for r in results])
    accs = [r.accuracy_barrier.value for r in results if r.accuracy_barrier is not None]
    am, as_ = mean_stderr(accs) if len(accs) == len(results) else (None, None)
    columns = list(zip(*(r.curve.losses for r in results)))
    loss_mean, loss_se = zip(*(mean_stderr(c) for c in columns))
    acc_mean = None
    if all(r.curve.accuracies is not None for r in results):
        acc_mean = tuple(statistics.fmean(c) for c in zip(*(r.curve.accuracies for r in results)))  # type: ignore[misc]
    return Summary(results[0].method, len(results), bm, bs,
                   statistics.fmean(r.barrier.peak_lambda for r in results),
                   statistics.fmean(r.curve.loss_a for r in results), statistics.fmean(r.curve.loss_b for r in results),
                   am, as_, tuple(loss_mean), tuple(loss_se), acc_mean)


# --------------------------------------------------------------------------- running

class Measurer:
    """Measures barriers on one split, reusing one evaluator (module instance, data on the
    device) per architecture variant: the original one for vanilla averaging, the
    canonical one for aligned pairs."""

    def __init__(self, data: EvalData, *, points: int | Sequence[float] = 11, device: str | torch.device = "cpu",
                 dtype: torch.dtype | None = None, align_data: EvalData | None = None,
                 align_validation: EvalData | None = None) -> None:

        self.grid = lambdas(points) if isinstance(points, int) else check_grid(points)
        self.data = data
        #: the examples data-driven methods align on (a train split, not ``data``)
        self.align_data = align_data
        #: where methods that pick a step (learned matching) validate: never ``data``
        #: (None: they hold out part of ``align_data``)
        self.align_validation = align_validation
        self.device = device
        self.dtype = dtype
        self._evaluators: dict[Any, PathEvaluator] = {}

    def evaluator(self, module: torch.nn.Module) -> PathEvaluator:
        names, alias = functional_names(module)
        sd = module.state_dict()
        key = (type(module), tuple((k, tuple(sd[k].shape)) for k in names), tuple(sorted(alias.items())))
        if key not in self._evaluators:
            self._evaluators[key] = PathEvaluator(module, self.data, device=self.device, dtype=self.dtype)
        return self._evaluators[key]

    @property
    def evaluated_dtype(self) -> torch.dtype | None:
        """The precision the curves were evaluated in (None before the first)."""
        return next(iter(self._evaluators.values())).dtype if self._evaluators else self.dtype

    @property
    def batches_per_curve(self) -> int:
        return len(self.grid) * len(self.data.batches)

    def pair(self, model_a: torch.nn.Module, model_b: torch.nn.Module, *, method: str = "none", spec: Any = None,
             pair: int = 0, names: tuple[str, str] = ("A", "B"), progress: Callable[[int], None] | None = None,
             check_data: bool = True, align_kw: Mapping[str, Any] | None = None) -> PairResult:
        """Align (per ``method``), then evaluate the path and its barriers."""
        get_method(method)
        if not _widths_differ(spec, model_a, model_b):  # models of different widths: align() lifts B first
            check_pair(_state(model_a), _state(model_b), names)
        if check_data:
            check_fits(model_a, self.data, names[0])
            check_fits(model_b, self.data, names[1])
        kw = {"validation": self.align_validation, **dict(align_kw or {})}
        aligned = align_pair(method, model_a, model_b, spec=spec, device=self.device, data=self.align_data, **kw)
        curve = self.evaluator(aligned.module).curve(aligned.sd_a, aligned.sd_b, self.grid, progress, names)
        return pair_result(method, pair, names[0], names[1], curve, aligned.seconds, aligned.info)


def _widths_differ(spec: Any, model_a: torch.nn.Module, model_b: torch.nn.Module) -> bool:
    """Do the two models differ only in widths under ``spec`` (B narrower)? A depth
    difference or a narrower A is refused here, in one line."""
    if spec is None:
        return False

    return bool(lift_needed(spec, model_a, model_b))


def measure(pairs: Sequence[tuple[torch.nn.Module, torch.nn.Module]], data: EvalData, *,
            methods: Sequence[str] = ("none",), spec: Any = None, points: int | Sequence[float] = 11,
            device: str | torch.device = "cpu", dtype: torch.dtype | None = None,
            names: Sequence[tuple[str, str]] | None = None, progress: Callable[[int], None] | None = None,
            align_data: EvalData | None = None, align_validation: EvalData | None = None,
            align_kw: Mapping[str, Mapping[str, Any]] | None = None) -> dict[str, list[PairResult]]:
    """Barriers of every pair under every method: ``{method: [PairResult per pair]}``.
    ``align_data``: what data-driven methods align on (a train split);
    ``align_validation``: where those that pick a step validate (a split other than
    ``data``). ``align_kw``: per method, keywords for :func:`symspec.align` (``options``).

    ``progress(n)`` is called after each batch evaluated; the total is
    ``len(pairs) * len(methods) * points * len(data.batches)``.
    """
    if not pairs:
        raise SymspecInputError("no model pairs to measure")
    if not methods:
        raise SymspecInputError("no methods to measure")
    for m in methods:
        get_method(m)
    labels = list(names) if names is not None else [(f"A{i}", f"B{i}") for i in range(len(pairs))]
    m = Measurer(data, points=points, device=device, dtype=dtype, align_data=align_data,
                 align_validation=align_validation)
    out: dict[str, list[PairResult]] = {meth: [] for meth in dict.fromkeys(methods)}
    for i, (a, b) in enumerate(pairs):
        for j, meth in enumerate(out):
            out[meth].append(m.pair(a, b, method=meth, spec=spec, pair=i, names=labels[i], progress=progress,
                                    check_data=j == 0, align_kw=(align_kw or {}).get(meth)))
    return out


def pair_barrier(model_a: torch.nn.Module, model_b: torch.nn.Module, data: EvalData, *, method: str = "none",
                 spec: Any = None, points: int | Sequence[float] = 11, device: str | torch.device = "cpu",
                 dtype: torch.dtype | None = None, align_data: EvalData | None = None) -> PairResult:
    """The barrier between two models on ``data`` (one method, one pair).

    >>> import torch
    >>> from symspec.data import EvalData, cross_entropy
    >>> x = torch.randn(8, 3); y = torch.randint(2, (8,))
    >>> data = EvalData("toy", "hook", "val", [((x,), y)], cross_entropy, None)
    >>> a = torch.nn.Linear(3, 2)
    >>> round(pair_barrier(a, a, data, points=5).barrier.value, 12)
    0.0
    """
    return Measurer(data, points=points, device=device, dtype=dtype,
                    align_data=align_data).pair(model_a, model_b, method=method, spec=spec)
