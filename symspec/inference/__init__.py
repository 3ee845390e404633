"""Spec inference: a checked spec drafted from a model's traced graph (``symspec infer``).

- :mod:`.axes`: axis classes (a union-find over the feature axes of the graph);
- :mod:`.walk`: the exported graph read into classes and facts (layers, norms, attention);
- :mod:`.lattice`: the largest group a class's evidence allows;
- :mod:`.draft`: spaces, bindings, folds, centring and dims from the facts;
- :mod:`.render`: the draft as spec YAML;
- :mod:`.api`: :func:`infer`, which checks the draft and shrinks what fails.
"""

from .api import InferError, InferResult, SpaceReport, infer

__all__ = ["InferError", "InferResult", "SpaceReport", "infer"]
