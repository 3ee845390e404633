"""N-model analyzers: a merged model against its endpoints and plain averaging, and the
loss over the simplex of convex combinations (the paper's Fig. 4 for three models).

For models θ_1..θ_N and weights w on the simplex, the *deviation* is

    D(w) = L(Σ_i w_i θ_i) - Σ_i w_i L(θ_i)

zero at the vertices; the N-model barrier (DESIGN §4) is its supremum over the simplex,
estimated here on the grid of weights that are multiples of 1/resolution
(:func:`simplex_grid`, vertices, edges and interior included). Where D < 0 the
combination is better than the endpoints' average: the zero contour of a heat map over
the 2-simplex shows how much of the simplex is connected.

One module instance evaluates every point (:class:`~symspec.analyzers.interpolate.PathEvaluator`,
``functional_call``; data on the device once); a combination is written into reused
buffers. The losses of the endpoints and of the plain average stream through the
models one at a time; only the simplex surface holds all N models.

>>> simplex_grid(3, 2)
[(0.0, 0.0, 1.0), (0.0, 0.5, 0.5), (0.0, 1.0, 0.0), (0.5, 0.0, 0.5), (0.5, 0.5, 0.0), (1.0, 0.0, 0.0)]
>>> default_resolution(3), default_resolution(5), default_resolution(30)
(12, 4, 1)
"""

from __future__ import annotations

import io
import math
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import attrs
import torch

from symspec.data import EvalData
from symspec.errors import SymspecInputError
from symspec.outputs import atomic_write_bytes

from .interpolate import PathEvaluator, check_pair

StateLoader = Callable[[int], Mapping[str, torch.Tensor]]
Progress = Callable[[int], None]

LABELS = {"plain": "vanilla averaging", "universe": "universe matching"}


class SimplexError(SymspecInputError):
    """A simplex that cannot be evaluated (too few models, a bad resolution) (exit 2)."""


def simplex_grid(n: int, resolution: int) -> list[tuple[float, ...]]:
    """All weights ``(k_1, ..., k_n) / resolution`` with non-negative integers summing
    to ``resolution``, in lexicographic order of ``k``; exact at the vertices."""
    if n < 1 or resolution < 1:
        raise SimplexError(f"a simplex grid needs n >= 1 and resolution >= 1, got n={n}, resolution={resolution}")
    out: list[tuple[float, ...]] = []

    def rec(prefix: list[int], left: int, slots: int) -> None:
        if slots == 1:
            out.append(tuple(k / resolution for k in (*prefix, left)))
            return
        for k in range(left + 1):
            rec([*prefix, k], left - k, slots - 1)

    rec([], resolution, n)
    return out


def default_resolution(n: int, budget: int = 100, most: int = 12) -> int:
    """The finest resolution (at most ``most``) whose grid has at most ``budget`` points."""
    best = 1
    for r in range(1, most + 1):
        if math.comb(r + n - 1, n - 1) <= budget:
            best = r
    return best


def combine(states: Sequence[Mapping[str, torch.Tensor]], weights: Sequence[float],
            out: dict[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
    """Σ_i w_i θ_i for every floating tensor (others from the first state); with ``out``,
    written into its tensors."""
    if len(states) != len(weights):
        raise SimplexError(f"{len(states)} models but {len(weights)} weights")
    result = out if out is not None else {}
    for k, first in states[0].items():
        if not first.is_floating_point():
            result[k] = first
            continue
        buf = result.get(k) if out is not None else None
        if buf is None:
            buf = torch.empty_like(first)
            result[k] = buf
        torch.mul(first, float(weights[0]), out=buf)
        for s, w in zip(states[1:], weights[1:]):
            if w:
                buf.add_(s[k], alpha=float(w))
    return result


@attrs.frozen
class Loss:
    """Mean loss (and accuracy, where it applies) of one model on the split."""

    loss: float
    accuracy: float | None = None

    def to_dict(self) -> dict[str, Any]:
        return {"loss": _num(self.loss), "accuracy": _num(self.accuracy) if self.accuracy is not None else None}


@attrs.frozen
class SimplexSurface:
    """Losses at the points of a simplex grid for one family of models."""

    method: str  # "plain" (the models as given) or "universe" (aligned into the universe)
    names: tuple[str, ...]
    resolution: int
    weights: tuple[tuple[float, ...], ...]
    losses: tuple[float, ...]
    accuracies: tuple[float, ...] | None
    seconds: float = 0.0

    @property
    def label(self) -> str:
        return LABELS.get(self.method, self.method)

    @property
    def endpoint_losses(self) -> tuple[float, ...]:
        n = len(self.names)
        out = [math.nan] * n
        for w, loss in zip(self.weights, self.losses):
            for i in range(n):
                if w[i] == 1.0:
                    out[i] = loss
        return tuple(out)

    @property
    def deviations(self) -> tuple[float, ...]:
        """L(Σ w θ) - Σ w L(θ_i) at every point (0 at the vertices; NaN losses count as +inf)."""
        ends = self.endpoint_losses
        devs = []
        for w, loss in zip(self.weights, self.losses):
            d = loss - math.fsum(wi * li for wi, li in zip(w, ends))
            devs.append(math.inf if math.isnan(d) else d)
        return tuple(devs)

    @property
    def max_deviation(self) -> float:
        """The N-model barrier on this grid: the largest deviation (>= 0, the vertices' value)."""
        return max(self.deviations)

    @property
    def argmax(self) -> tuple[float, ...]:
        devs = self.deviations
        return self.weights[max(range(len(devs)), key=lambda k: (devs[k], -k))]

    @property
    def centroid_deviation(self) -> float | None:
        """The deviation at equal weights (the merged model), when it is on the grid."""
        n = len(self.names)
        for w, d in zip(self.weights, self.deviations):
            if all(abs(x - 1.0 / n) < 1e-12 for x in w):
                return d
        return None

    def to_dict(self) -> dict[str, Any]:
        return {
            "method": self.method,
            "label": self.label,
            "resolution": self.resolution,
            "weights": [list(w) for w in self.weights],
            "loss": [_num(x) for x in self.losses],
            "deviation": [_num(x) for x in self.deviations],
            "accuracy": [_num(x) for x in self.accuracies] if self.accuracies is not None else None,
            "endpoint_loss": [_num(x) for x in self.endpoint_losses],
            "max_deviation": _num(self.max_deviation),
            "argmax": list(self.argmax),
            "centroid_deviation": _num(self.centroid_deviation) if self.centroid_deviation is not None else None,
            "seconds": self.seconds,
        }


def simplex_surface(evaluator: PathEvaluator, states: Sequence[Mapping[str, torch.Tensor]], *, method: str,
                    names: Sequence[str] | None = None, resolution: int | None = None,
                    progress: Progress | None = None) -> SimplexSurface:
    """Evaluate Σ w_i θ_i at every point of the simplex grid (``resolution`` default:
    :func:`default_resolution`). ``states`` are evaluated in ``evaluator``'s module."""
    n = len(states)
    if n < 2:
        raise SimplexError(f"a simplex needs at least 2 models, got {n}")
    labels = list(names) if names is not None else [f"model{i}" for i in range(n)]
    res = resolution or default_resolution(n)
    prepared = [evaluator.prepare(s, labels[i]) for i, s in enumerate(states)]
    for i in range(1, n):
        check_pair(prepared[0], prepared[i], (labels[0], labels[i]))
    grid = simplex_grid(n, res)
    start = time.perf_counter()
    buf: dict[str, torch.Tensor] = {}
    losses, accs = [], []
    for w in grid:
        combine(prepared, w, out=buf)
        r = evaluator.evaluate(buf, progress, prepared=True)
        losses.append(r.loss)
        accs.append(r.accuracy)
    accuracies = tuple(float(a) for a in accs if a is not None) if all(a is not None for a in accs) else None
    return SimplexSurface(method, tuple(labels), res, tuple(grid), tuple(losses), accuracies, time.perf_counter() - start)


class RunningMean:
    """Σ θ_i / N over models added one at a time (float64 sums)."""

    def __init__(self) -> None:
        self.total: dict[str, torch.Tensor] = {}
        self.count = 0

    def add(self, sd: Mapping[str, torch.Tensor]) -> None:
        if not self.total:
            self.total = {k: (v.detach().to(torch.float64, copy=True) if v.is_floating_point() else v) for k, v in sd.items()}
        else:
            for k, v in self.total.items():
                if v.is_floating_point():
                    v.add_(sd[k].detach().to(v.device, torch.float64))
        self.count += 1

    def mean(self, like: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        if not self.count:
            raise SimplexError("the mean of no models")
        return {k: ((v / self.count).to(like[k].dtype) if v.is_floating_point() else v) for k, v in self.total.items()}


@attrs.define
class MergeAnalysis:
    """Losses of N models, of their plain average, of the merged (universe) model, and
    the simplex surfaces, on one split."""

    data: Mapping[str, Any]
    names: list[str]
    endpoints: list[Loss]
    aligned: list[Loss]
    merged: Loss
    plain: Loss
    surfaces: list[SimplexSurface]
    device: str = "cpu"
    dtype: str = "float32"
    seconds: float = 0.0

    @property
    def endpoint_mean(self) -> float:
        return math.fsum(e.loss for e in self.endpoints) / len(self.endpoints)

    def surface(self, method: str) -> SimplexSurface | None:
        return next((s for s in self.surfaces if s.method == method), None)

    def to_dict(self) -> dict[str, Any]:
        mean = self.endpoint_mean
        accs = [e.accuracy for e in self.endpoints]
        return {
            "data": dict(self.data),
            "device": self.device,
            "dtype": self.dtype,
            "models": [{"name": n, **e.to_dict(), "aligned_loss": _num(a.loss)}
                       for n, e, a in zip(self.names, self.endpoints, self.aligned)],
            "endpoints_mean": {"loss": _num(mean),
                               "accuracy": _num(math.fsum(accs) / len(accs)) if all(a is not None for a in accs) else None},  # type: ignore[arg-type]
            "merged": self.merged.to_dict(),
            "plain_average": self.plain.to_dict(),
            "merged_gap": _num(self.merged.loss - mean),
            "plain_gap": _num(self.plain.loss - mean),
            "simplex": [s.to_dict() for s in self.surfaces],
            "seconds": self.seconds,
        }

    def plot(self, path: str | Path, *, title: str | None = None) -> Path:
        return plot_simplex(self.surfaces, path, title=title or _title(self))


def _title(a: MergeAnalysis) -> str:
    d = a.data
    return f"{d.get('source', '')} ({d.get('split', '')}): L(Σ wᵢθᵢ) − Σ wᵢL(θᵢ); black line: 0"


def analyze_merge(*, module: torch.nn.Module, canonical_module: torch.nn.Module, n: int, names: Sequence[str],
                  load_raw: StateLoader, load_aligned: StateLoader, merged: Mapping[str, torch.Tensor], data: EvalData,
                  device: str | torch.device = "cpu", dtype: torch.dtype | None = None, simplex: bool | None = None,
                  resolution: int | None = None, progress: Progress | None = None) -> MergeAnalysis:
    """Evaluate N models, their plain average (``module``), each aligned model and the
    merged one (``canonical_module``), and, when ``simplex`` (default: N <= 3), the loss
    over the simplex for both families.

    ``load_raw(i)``/``load_aligned(i)`` give model i as it came and aligned into the
    universe (canonical form); they are called once each, in order.
    """
    if n < 2:
        raise SimplexError(f"merging needs at least 2 models, got {n}")
    start = time.perf_counter()
    plain_ev = PathEvaluator(module, data, device=device, dtype=dtype)
    canon_ev = PathEvaluator(canonical_module, data, device=device, dtype=dtype)
    want_simplex = n <= 3 if simplex is None else simplex
    raws: list[Mapping[str, torch.Tensor]] = []
    aligned: list[Mapping[str, torch.Tensor]] = []
    ends: list[Loss] = []
    aligned_losses: list[Loss] = []
    mean = RunningMean()
    first: Mapping[str, torch.Tensor] | None = None
    for i in range(n):
        raw = plain_ev.prepare(load_raw(i), names[i])
        if first is None:
            first = raw
        else:
            check_pair(first, raw, (names[0], names[i]))
        r = plain_ev.evaluate(raw, progress, prepared=True)
        ends.append(Loss(r.loss, r.accuracy))
        mean.add(raw)
        al = canon_ev.prepare(load_aligned(i), f"{names[i]} (aligned)")
        r = canon_ev.evaluate(al, progress, prepared=True)
        aligned_losses.append(Loss(r.loss, r.accuracy))
        if want_simplex:
            raws.append(raw)
            aligned.append(al)
    assert first is not None
    r = plain_ev.evaluate(mean.mean(first), progress, prepared=True)
    plain = Loss(r.loss, r.accuracy)
    r = canon_ev.evaluate(merged, progress)
    merged_loss = Loss(r.loss, r.accuracy)
    surfaces = []
    if want_simplex:
        surfaces.append(simplex_surface(plain_ev, raws, method="plain", names=names, resolution=resolution, progress=progress))
        surfaces.append(simplex_surface(canon_ev, aligned, method="universe", names=names, resolution=resolution, progress=progress))
    return MergeAnalysis(data.describe(), list(names), ends, aligned_losses, merged_loss, plain, surfaces, str(device),
                         str(canon_ev.dtype).removeprefix("torch."), time.perf_counter() - start)


def evaluations(n: int, data: EvalData, *, simplex: bool | None = None, resolution: int | None = None) -> int:
    """Forward passes (batches) :func:`analyze_merge` will run: for a progress bar."""
    points = 2 * n + 2
    if (n <= 3 if simplex is None else simplex):
        points += 2 * len(simplex_grid(n, resolution or default_resolution(n)))
    return points * len(data.batches)


# --------------------------------------------------------------------------- plot


def _cartesian(w: Sequence[float]) -> tuple[float, float]:
    # vertices: model 0 bottom left, model 1 bottom right, model 2 on top
    return w[1] + 0.5 * w[2], w[2] * math.sqrt(3) / 2


def plot_simplex(surfaces: Sequence[SimplexSurface], path: str | Path, *, title: str | None = None, dpi: int = 120) -> Path:
    """Heat maps of the deviation over the 2-simplex (three models), one panel per
    surface, on one colour scale centred at 0, with the zero-deviation contour."""
    # optional to load: plotting stays off the import path of every command that does not plot
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.colors import TwoSlopeNorm
    from matplotlib.figure import Figure
    from matplotlib.tri import Triangulation


    surfaces = [s for s in surfaces if len(s.names) == 3]
    if not surfaces:
        raise SimplexError("a simplex heat map needs surfaces of three models")
    devs = [[d if math.isfinite(d) else math.nan for d in s.deviations] for s in surfaces]
    finite = [d for ds in devs for d in ds if math.isfinite(d)]
    lo, hi = min([*finite, 0.0]), max([*finite, 0.0])
    span = max(hi - lo, 1e-12)
    vmin, vmax = min(lo, -1e-3 * span), max(hi, 1e-3 * span)
    norm = TwoSlopeNorm(vcenter=0.0, vmin=vmin, vmax=vmax)
    # one set of levels for every panel, with 0 among them: the colours mean the same everywhere
    levels = sorted({vmin + (0.0 - vmin) * k / 8 for k in range(9)} | {vmax * k / 16 for k in range(17)})
    fig = Figure(figsize=(4.4 * len(surfaces) + 1.0, 4.2))
    FigureCanvasAgg(fig)
    axes = fig.subplots(1, len(surfaces), squeeze=False)[0]
    mappable = None
    for ax, s, d in zip(axes, surfaces, devs):
        xy = [_cartesian(w) for w in s.weights]
        tri = Triangulation([p[0] for p in xy], [p[1] for p in xy])
        values = [v if math.isfinite(v) else hi for v in d]
        mappable = ax.tricontourf(tri, values, levels=levels, cmap="RdBu_r", norm=norm, extend="neither")
        if min(values) < 0.0 < max(values):
            ax.tricontour(tri, values, levels=[0.0], colors="black", linewidths=1.4)
        ax.plot([0, 1, 0.5, 0], [0, 0, math.sqrt(3) / 2, 0], color="0.3", linewidth=0.8)
        cx, cy = _cartesian((1 / 3, 1 / 3, 1 / 3))
        ax.plot([cx], [cy], marker="*", color="black", markersize=9, linestyle="none")
        for name, (vx, vy), (dx, dy) in zip(s.names, [(0, 0), (1, 0), (0.5, math.sqrt(3) / 2)],
                                            [(-0.02, -0.07), (0.02, -0.07), (0, 0.04)]):
            label = Path(name).name if len(name) > 18 else name
            ax.text(vx + dx, vy + dy, label[:24], ha="center", fontsize=8)
        ax.set_title(f"{s.label}: max {s.max_deviation:.3f}", fontsize=10)
        ax.set_aspect("equal")
        ax.set_xlim(-0.12, 1.12)
        ax.set_ylim(-0.14, 0.98)
        ax.axis("off")
    if mappable is not None:
        ticks = [vmax * k / 4 for k in range(5)] + ([vmin / 2, vmin] if lo < 0 else [])
        fig.colorbar(mappable, ax=list(axes), shrink=0.8, spacing="proportional", format="%.3g", ticks=sorted(ticks),
                     label="deviation from the endpoints' average")
    if title:
        fig.suptitle(title, fontsize=10)
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=dpi)
    out = Path(path)
    atomic_write_bytes(out, buf.getvalue())
    return out


# --------------------------------------------------------------------------- JSON


def _num(x: float | None) -> Any:
    if x is None:
        return None
    x = float(x)
    if math.isfinite(x):
        return x
    return "nan" if math.isnan(x) else ("inf" if x > 0 else "-inf")


_NUM: dict[str, Any] = {"oneOf": [{"type": "number"}, {"enum": ["inf", "-inf", "nan"]}]}
_NUM_OR_NULL: dict[str, Any] = {"oneOf": [{"type": "number"}, {"enum": ["inf", "-inf", "nan"]}, {"type": "null"}]}
_NUMS: dict[str, Any] = {"type": "array", "items": _NUM}
_LOSS: dict[str, Any] = {"type": "object", "required": ["loss", "accuracy"],
                         "properties": {"loss": _NUM, "accuracy": _NUM_OR_NULL}}

#: JSON Schema of :meth:`MergeAnalysis.to_dict` (docs/universe.md)
ANALYSIS_SCHEMA: dict[str, Any] = {
    "type": "object",
    "required": ["data", "device", "dtype", "models", "endpoints_mean", "merged", "plain_average", "merged_gap",
                 "plain_gap", "simplex", "seconds"],
    "properties": {
        "data": {"type": "object", "required": ["source", "kind", "split", "examples"]},
        "device": {"type": "string"},
        "dtype": {"type": "string"},
        "models": {"type": "array", "minItems": 2, "items": {
            "type": "object", "required": ["name", "loss", "accuracy", "aligned_loss"],
            "properties": {"name": {"type": "string"}, "loss": _NUM, "accuracy": _NUM_OR_NULL, "aligned_loss": _NUM}}},
        "endpoints_mean": _LOSS,
        "merged": _LOSS,
        "plain_average": _LOSS,
        "merged_gap": _NUM,
        "plain_gap": _NUM,
        "simplex": {"type": "array", "items": {
            "type": "object",
            "required": ["method", "label", "resolution", "weights", "loss", "deviation", "accuracy", "endpoint_loss",
                         "max_deviation", "argmax", "centroid_deviation", "seconds"],
            "properties": {
                "method": {"enum": ["plain", "universe"]},
                "label": {"type": "string"},
                "resolution": {"type": "integer", "minimum": 1},
                "weights": {"type": "array", "items": {"type": "array", "items": {"type": "number", "minimum": 0, "maximum": 1}}},
                "loss": _NUMS,
                "deviation": _NUMS,
                "accuracy": {"oneOf": [_NUMS, {"type": "null"}]},
                "endpoint_loss": _NUMS,
                "max_deviation": _NUM,
                "argmax": {"type": "array", "items": {"type": "number"}},
                "centroid_deviation": _NUM_OR_NULL,
                "seconds": {"type": "number", "minimum": 0},
            },
        }},
        "seconds": {"type": "number", "minimum": 0},
    },
}


__all__ = [
    "ANALYSIS_SCHEMA",
    "Loss",
    "MergeAnalysis",
    "RunningMean",
    "SimplexSurface",
    "analyze_merge",
    "combine",
    "default_resolution",
    "evaluations",
    "plot_simplex",
    "simplex_grid",
    "simplex_surface",
]
