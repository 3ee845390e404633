"""Traced graphs and activation sites.

- :mod:`.trace`: a model traced into a torch.fx graph (symbolic trace, else
  ``torch.export``), or why it could not be;
- :mod:`.sites`: the activation sites of each space, found from the weights' bindings;
- :mod:`.recorder`: an ``fx.Interpreter`` that captures the sites' features on a batch,
  for any weights of the model's class (activation matching reads them).
"""

from .recorder import SiteRecorder, record_sites
from .sites import ELEMENTWISE, find_sites, read_sites
from .trace import ModelGraph, Node, by_space, call_args, trace

__all__ = ["ELEMENTWISE", "ModelGraph", "Node", "SiteRecorder", "by_space", "call_args", "find_sites", "read_sites",
           "record_sites", "trace"]
