"""Spec inference: a checked spec drafted from a model's traced graph (``symspec infer``).

- :mod:`.axes`: axis classes (a union-find over the feature axes of the graph);
- :mod:`.walk`: the exported graph read into classes and :mod:`.facts` (layers, norms,
  attention), one rule per op (:mod:`.walk_shapes`, :mod:`.walk_layers`; what each op is:
  :mod:`symspec.graph.ops`, shared with the activation sites);
- :mod:`.lattice`: the largest group a class's evidence allows, and :data:`CANDIDATES`, what
  inference does with each group kind (keyed by the kind's registry name);
- :mod:`.draft`: spaces, bindings, folds, centring and dims from the facts;
- :mod:`.render`: the draft as a :class:`~symspec.spec.model.Spec`, written by the spec writer;
- :mod:`.api`: :func:`infer`, which checks the draft and shrinks what fails.
"""

from .api import InferError, InferResult, SpaceReport, infer
from .lattice import CANDIDATES, Candidate

__all__ = ["CANDIDATES", "Candidate", "InferError", "InferResult", "SpaceReport", "infer"]
