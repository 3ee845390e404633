"""Universe matching: align many models to one shared universe, average, repeat (DESIGN §4).

>>> import symspec.universe as U  # doctest: +SKIP
>>> res = U.universe_match(["seed0.pt", "seed1.pt", "seed2.pt"], "nanogpt", factory="model.py", jobs=2)  # doctest: +SKIP
>>> res.merged, res.history, res.transform(0, 2)  # doctest: +SKIP

The package, in the order of a run:

- :mod:`.inputs`: the models (paths, globs, ``@lists``, modules, state dicts) and the
  reference model, bound to the spec, that every other model must match;
- :mod:`.workdir`: the resumable work folder, with its lock, and the files in it;
- :mod:`.tasks`: the per-model tasks (``prepare``, ``align``: any registered
  alignment method), run by the executors of :mod:`symspec.runtime`;
- :mod:`.algorithm`: the rounds, as in the paper's pseudo-code, and when they stop;
- :mod:`.api`: :func:`universe_match` (models under a spec) and :func:`state_universe`
  (canonical state dicts under a problem);
- :mod:`.result`: :class:`UniverseResult`, :func:`transform_between`;
- :mod:`.report`: the JSON report and its schema; :mod:`.publish`: the output folder;
- :mod:`.method`: ``"universe"``, a pair alignment method in :mod:`symspec.alignment`
  (registered by :mod:`.extension`).

Names are imported on first use: registering the ``universe`` method (listing methods
for the CLI's help) does not import torch.
"""

from __future__ import annotations

from .._lazy import lazy_exports

__getattr__, __all__ = lazy_exports(__name__, {
    "UniverseError": ".errors", "WorkerError": ".errors",
    "UniverseEvent": ".progress",
    "expand_models": ".inputs",
    "ModelEntry": ".result", "StateUniverse": ".result", "UniverseResult": ".result",
    "transform_between": ".result",
    "state_universe": ".api", "universe_match": ".api", "round_method": ".api",
    "SCHEMA_ID": ".report", "build_report": ".report", "report_schema": ".report",
    "output_name": ".publish", "save_outputs": ".publish",
    "UniverseMatching": ".method", "UniverseOptions": ".method",
})
