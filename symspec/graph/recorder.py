"""Recording the features of activation sites on a batch.

:class:`SiteRecorder` traces a module (once per input signature: an exported program is
specialised to its example shapes), finds the sites of a problem in each trace by their
stable names, and runs the graph with an ``fx.Interpreter`` (:class:`Capture`) that hands
each site's output to the caller as it is computed: nothing but the batch's own features
is kept. The weights come from a state dict (``torch.func.functional_call``), so one
module of the class records both endpoints of an alignment.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping
from typing import Any

import torch
import torch.fx as fx
from torch.utils import _pytree as pytree

from ..errors import SymspecInputError
from ..problem import Problem, Site
from .sites import find_sites
from .trace import call_args, trace

__all__ = ["Capture", "SiteRecorder", "record_sites"]


class Capture(fx.Interpreter):
    """Runs a GraphModule node by node; ``sink(site_name, value)`` receives the output of
    every node in ``wanted`` (node name -> the site names it holds)."""

    def __init__(self, gm: fx.GraphModule, wanted: Mapping[str, list[str]], sink: Callable[[str, torch.Tensor], None]):
        super().__init__(gm, garbage_collect_values=True)
        self.wanted = wanted
        self.sink = sink
        self.left = {n.name for n in gm.graph.nodes if n.name in wanted}

    def run_node(self, n: fx.Node) -> Any:
        out = super().run_node(n)
        for name in self.wanted.get(n.name, ()):
            self.sink(name, out)
        self.left.discard(n.name)
        if not self.left:
            # every site is recorded: what follows (a language model's logits, batch x
            # tokens x vocabulary, gigabytes for a 150k vocabulary) is not computed
            raise _Recorded
        return out


class _Recorded(Exception):
    """Raised by :class:`Capture` once the last wanted node has run."""


class _Runner(torch.nn.Module):
    """The GraphModule as a submodule ``gm``, run by :class:`Capture`, so that
    ``functional_call`` swaps its weights."""

    def __init__(self, gm: fx.GraphModule, wanted: Mapping[str, list[str]], flat: bool) -> None:
        super().__init__()
        self.gm = gm
        self.wanted = wanted
        #: the graph's inputs are the flattened (args, kwargs) (an exported program), else
        #: the positional arguments (a symbolic trace)
        self.flat = flat
        self.sink: Callable[[str, torch.Tensor], None] = lambda name, value: None

    def forward(self, *flat: Any) -> Any:
        try:
            return Capture(self.gm, self.wanted, self.sink).run(*flat)
        except _Recorded:
            return None


def _signature(inputs: Any) -> tuple[Any, ...]:
    leaves, spec = pytree.tree_flatten(inputs)
    return (str(spec), *((tuple(x.shape), x.dtype) if isinstance(x, torch.Tensor) else repr(x) for x in leaves))


class SiteRecorder:
    """Features of ``problem``'s activation sites (all, or those named in ``names``) of
    ``module``'s class. :meth:`record` runs one batch with a state dict and returns site
    name -> features as a (tokens, features) matrix."""

    def __init__(self, module: torch.nn.Module, problem: Problem, names: Collection[str] | None = None,
                 select: Callable[[tuple[Site, ...]], tuple[Site, ...]] | None = None) -> None:
        self.module = module
        self.problem = problem
        self.names = None if names is None else set(names)
        #: which of the sites found to record (e.g. :func:`~.sites.read_sites`)
        self.select = select
        self._runners: dict[tuple[Any, ...], tuple[_Runner, dict[str, Site]]] = {}
        self.sites: tuple[Site, ...] | None = None  # those of the first trace
        self.method = ""

    def _runner(self, inputs: Any) -> tuple[_Runner, dict[str, Site]]:
        key = _signature(inputs)
        if key not in self._runners:
            mg = trace(self.module, inputs)
            if not mg.traced:
                raise SymspecInputError(f"{type(self.module).__name__} could not be traced, so its activations cannot "
                                        f"be recorded: {mg.reason}")
            found = find_sites(mg, self.problem)
            if self.select is not None:
                found = self.select(found)
            sites = {s.name: s for s in found if self.names is None or s.name in self.names}
            if self.sites is None:
                self.sites, self.method = tuple(sites.values()), mg.method
            wanted: dict[str, list[str]] = {}
            for s in sites.values():
                wanted.setdefault(s.node, []).append(s.name)
            self._runners[key] = (_Runner(mg.runnable(), wanted, mg.method == "export"), sites)
        return self._runners[key]

    def prepare(self, inputs: Any) -> tuple[Site, ...]:
        """Trace for inputs like ``inputs`` (nothing is run) and return the sites that
        :meth:`record` will record: what their statistics will cost is known before the
        first forward pass."""
        return tuple(self._runner(inputs)[1].values())

    def record(self, inputs: Any, state: Mapping[str, torch.Tensor] | None = None,
               sink: Callable[[str, torch.Tensor], None] | None = None) -> dict[str, torch.Tensor]:
        """One batch: site name -> (tokens, features), the features of the model with
        ``state`` (default: the module's own weights). With ``sink``, each site's features
        go to ``sink(name, features)`` as they are computed and none is kept (empty result)."""
        runner, sites = self._runner(inputs)
        out: dict[str, torch.Tensor] = {}

        def keep(name: str, value: torch.Tensor) -> None:
            features = value.detach().reshape(-1, sites[name].size)
            if sink is None:
                out[name] = features
            else:
                sink(name, features)

        runner.sink = keep
        args, kwargs = call_args(inputs)
        flat = pytree.tree_flatten((args, kwargs))[0] if runner.flat else list(args)
        with torch.no_grad():
            if state is None:
                runner(*flat)
            else:
                own = dict(runner.named_parameters(remove_duplicate=False)) | dict(runner.named_buffers(remove_duplicate=False))
                swap = {k: state[k[3:]] for k in own if k[3:] in state}
                torch.func.functional_call(runner, swap, tuple(flat), strict=False, tie_weights=False)
        runner.sink = lambda name, value: None
        return out


def record_sites(module: torch.nn.Module, problem: Problem, inputs: Any,
                 state: Mapping[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
    """The features of every site of ``problem`` on one batch (see :class:`SiteRecorder`)."""
    return SiteRecorder(module, problem).record(inputs, state)
