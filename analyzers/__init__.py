"""Analyzers: models evaluated along interpolation paths, loss barriers, plots and reports.

The pieces, in pipeline order:

- evaluation data and losses live in the core, :mod:`symspec.data` (text, tokenised or
  character-level, image folders, saved ``datasets``, MNIST, scikit-learn digits, a
  model file's own ``data()`` hook); ``symspec.analyzers`` re-exports its loading names;
- :mod:`~symspec.analyzers.interpolate`: one module instance evaluates (1-λ)·A + λ·B at
  K points (``torch.func.functional_call``, data on the device once);
- :mod:`~symspec.analyzers.barrier`: barriers (DESIGN §4), mean ± standard error over
  pairs, alignment methods (``none``, ``weight``);
- :mod:`~symspec.analyzers.report` and :mod:`~symspec.analyzers.plots`: the JSON report,
  its schema, a markdown summary, PNG plots (matplotlib is imported only to draw).

Imports are lazy, so ``import symspec.analyzers`` costs nothing until used.
"""

from __future__ import annotations

from symspec._lazy import lazy_exports

_EXPORTS = {
    "load_data": "symspec.data",
    "parse_source": "symspec.data",
    "check_fits": "symspec.data",
    "EvalData": "symspec.data",
    "DataError": "symspec.data",
    "PathEvaluator": "interpolate",
    "PathError": "interpolate",
    "Curve": "interpolate",
    "interpolation_curve": "interpolate",
    "lerp_state": "interpolate",
    "lambdas": "interpolate",
    "Barrier": "barrier",
    "loss_barrier": "barrier",
    "accuracy_barrier": "barrier",
    "mean_stderr": "barrier",
    "summarize": "barrier",
    "pair_barrier": "barrier",
    "measure": "barrier",
    "Measurer": "barrier",
    "PairResult": "barrier",
    "Summary": "barrier",
    "Aligned": "barrier",
    "align_pair": "barrier",
    "method_label": "barrier",
    "BarrierReport": "report",
    "REPORT_SCHEMA": "report",
    "plot_results": "plots",
    "plot_report": "plots",
}

__getattr__, __all__ = lazy_exports(__name__, {name: module if "." in module else f".{module}"
                                                   for name, module in _EXPORTS.items()})
