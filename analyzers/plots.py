"""PNG plots of interpolation curves (matplotlib, imported only when a plot is drawn).

The figures are drawn with matplotlib's object-oriented API on an Agg canvas, so no
pyplot state or global backend is touched (safe inside notebooks and servers).

One line per method: the mean loss over pairs at each λ (a band of ± one standard
error when there are several pairs, thin lines for the single pairs), and, dashed in
the same colour, the endpoints' line (1-λ)·L(A) + λ·L(B) that the barrier is measured
against. With accuracies, a second panel shows accuracy against λ.
"""

from __future__ import annotations

import io
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from symspec.outputs import atomic_write_bytes

from .barrier import PairResult, mean_stderr, method_label, summarize

if TYPE_CHECKING:
    from .report import BarrierReport


def plot_results(results: Mapping[str, Sequence[PairResult]], path: str | Path, *, title: str | None = None,
                 dpi: int = 120) -> Path:
    """Draw every method's curves on one figure and write it as PNG (atomically)."""
    # optional to load: plotting stays off the import path of every command that does not plot
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure


    methods = {m: list(rs) for m, rs in results.items() if rs}
    if not methods:
        raise ValueError("nothing to plot")
    with_acc = all(r.curve.accuracies is not None for rs in methods.values() for r in rs)
    rows = (len(methods) + 2) // 3
    fig = Figure(figsize=(11 if with_acc else 6.5, 4.2 + 0.25 * rows))
    FigureCanvasAgg(fig)
    axes = fig.subplots(1, 2 if with_acc else 1, squeeze=False)[0]
    colors = [f"C{i}" for i in range(10)]
    for i, (m, rs) in enumerate(methods.items()):
        color = colors[i % len(colors)]
        s = summarize(rs)
        lam = list(rs[0].curve.lambdas)
        label = f"{method_label(m)}: barrier {s.barrier_mean:.3f}" + (f" ± {s.barrier_stderr:.3f}" if s.barrier_stderr is not None else "")
        _panel(axes[0], lam, [list(r.curve.losses) for r in rs], list(s.loss_mean), list(s.loss_stderr), color, label,
               line=(s.loss_a_mean, s.loss_b_mean))
        if with_acc and s.accuracy_mean is not None:
            accs = [list(r.curve.accuracies or ()) for r in rs]

            se = [mean_stderr(c)[1] for c in zip(*accs)]
            _panel(axes[1], lam, accs, list(s.accuracy_mean), se, color, method_label(m),
                   line=(s.accuracy_mean[0], s.accuracy_mean[-1]))
    axes[0].set_ylabel("loss")
    handles, labels = axes[0].get_legend_handles_labels()
    # below the panels, so that no curve is hidden behind it
    fig.legend(handles, labels, loc="lower center", ncol=min(3, len(labels)), fontsize=8, frameon=False)
    if with_acc:
        axes[1].set_ylabel("accuracy")
    for ax in axes:
        ax.set_xlabel("λ  (0: model A, 1: model B)")
        ax.set_xlim(0, 1)
        ax.grid(alpha=0.3)
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout(rect=(0, 0.05 + 0.05 * rows, 1, 1))
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=dpi)
    out = Path(path)
    atomic_write_bytes(out, buf.getvalue())
    return out


def _panel(ax: Any, lam: list[float], curves: list[list[float]], mean: list[float], se: list[float | None],
           color: str, label: str, line: tuple[float, float]) -> None:
    if len(curves) > 1:
        for c in curves:
            ax.plot(lam, c, color=color, alpha=0.25, linewidth=0.8)
        if all(x is not None for x in se):
            lo = [m - s for m, s in zip(mean, se)]  # type: ignore[operator]
            hi = [m + s for m, s in zip(mean, se)]  # type: ignore[operator]
            ax.fill_between(lam, lo, hi, color=color, alpha=0.15, linewidth=0)
    ax.plot(lam, mean, color=color, marker="o", markersize=3.5, linewidth=1.6, label=label)
    ax.plot([0.0, 1.0], list(line), color=color, linestyle="--", linewidth=1.0, alpha=0.8)


def plot_report(report: BarrierReport, path: str | Path, *, title: str | None = None) -> Path:
    """Plot a :class:`BarrierReport`'s curves (title: the data source and split)."""
    d = report.data
    default = f"{d.get('source', '')} ({d.get('split', '')}), {len(report.pairs)} pair(s); dashed: endpoints' line"
    return plot_results(report.results, path, title=title or default)
