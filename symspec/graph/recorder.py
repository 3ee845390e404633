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

__all__ = ["Capture", "SiteRecorder", "SpanCapture", "record_sites"]


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


class SpanCapture(Capture):
    """:class:`Capture` over one span of the graph's nodes (``lo`` to ``hi``, in order),
    from the values live at its start (``env``: node -> value; none for the first span,
    whose placeholders read the inputs); :meth:`run_span` returns the values live after
    it (those a later node reads). A pass split into spans runs every node once, as a
    whole pass does, with only the live values (a residual stream) kept in between."""

    def __init__(self, gm: fx.GraphModule, wanted: Mapping[str, list[str]], sink: Callable[[str, torch.Tensor], None]):
        super().__init__(gm, wanted, sink)
        self.left = {"never empty"}  # a span ends at its own end, not at its last site
        self.nodes = list(gm.graph.nodes)
        index = {n: i for i, n in enumerate(self.nodes)}
        #: the index of each node's last reader (-1: none)
        self.last_read = {n: max((index[u] for u in n.users), default=-1) for n in self.nodes}

    def run_span(self, args: tuple[Any, ...], env: Mapping[fx.Node, Any], lo: int, hi: int) -> dict[fx.Node, Any]:
        """Run the span (one object serves every span of its graph: the weights are read
        from the module at each call, as ``functional_call`` swaps them)."""
        self.env = dict(env)
        self.args_iter = iter(args)
        for node in self.nodes[lo:hi]:
            self.env[node] = self.run_node(node)
            for done in self.user_to_last_uses.get(node, []):
                self.env.pop(done, None)
        return {n: v for n, v in self.env.items() if self.last_read[n] >= hi}


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
        #: (env, lo, hi): run that span only (:class:`SpanCapture`); forward returns the env after it
        self.span: tuple[Mapping[fx.Node, Any], int, int] | None = None
        self._spans: SpanCapture | None = None
        #: site name -> the position of its node (:meth:`SiteRecorder.order`)
        self.order: dict[str, int] | None = None

    def forward(self, *flat: Any) -> Any:
        if self.span is not None:
            env, lo, hi = self.span
            if self._spans is None:  # built once: the graph's last uses are a pass over its nodes
                self._spans = SpanCapture(self.gm, self.wanted, self.sink)
            self._spans.sink = self.sink
            return self._spans.run_span(flat, env, lo, hi)
        try:
            return Capture(self.gm, self.wanted, self.sink).run(*flat)
        except _Recorded:
            return None


def _signature(inputs: Any) -> tuple[Any, ...]:
    leaves, spec = pytree.tree_flatten(inputs)
    return (str(spec), *((tuple(x.shape), x.dtype) if isinstance(x, torch.Tensor) else repr(x) for x in leaves))


def features_of(value: torch.Tensor, site: Site) -> torch.Tensor:
    """A site's node output as (positions, features): its feature axis (``site.dim``)
    moved last, every other axis a position."""
    value = value.detach()
    if site.dim != -1 and site.dim != value.ndim - 1:
        value = value.movedim(site.dim, -1)
    return value.reshape(-1, site.size)


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

    def order(self, inputs: Any) -> dict[str, int]:
        """Site name -> the position of its node in the trace for inputs like ``inputs``."""
        runner, sites = self._runner(inputs)
        if runner.order is None:
            index = {n.name: i for i, n in enumerate(runner.gm.graph.nodes)}
            runner.order = {name: index[s.node] for name, s in sites.items()}
        return runner.order

    def record_span(self, inputs: Any, state: Mapping[str, torch.Tensor], env: Mapping[Any, Any] | None,
                    lo: int, hi: int, sink: Callable[[str, torch.Tensor], None]) -> dict[Any, Any]:
        """The nodes ``lo`` to ``hi`` of the trace for ``inputs`` (positions, as
        :meth:`order` gives them), from ``env`` (what the span before returned; None for
        the first), the sites among them handed to ``sink`` as computed; returns the
        values live after the span, for the next one."""
        runner, sites = self._runner(inputs)

        def keep(name: str, value: torch.Tensor) -> None:
            sink(name, features_of(value, sites[name]))

        runner.sink = keep
        runner.span = (env or {}, lo, hi)
        args, kwargs = call_args(inputs)
        flat = pytree.tree_flatten((args, kwargs))[0] if runner.flat else list(args)
        try:
            with torch.no_grad():
                own = dict(runner.named_parameters(remove_duplicate=False)) | dict(runner.named_buffers(remove_duplicate=False))
                swap = {k: state[k[3:]] for k in own if k[3:] in state}
                out = torch.func.functional_call(runner, swap, tuple(flat), strict=False, tie_weights=False)
        finally:
            runner.span = None
            runner.sink = lambda name, value: None
        return out

    def record(self, inputs: Any, state: Mapping[str, torch.Tensor] | None = None,
               sink: Callable[[str, torch.Tensor], None] | None = None) -> dict[str, torch.Tensor]:
        """One batch: site name -> (tokens, features), the features of the model with
        ``state`` (default: the module's own weights). With ``sink``, each site's features
        go to ``sink(name, features)`` as they are computed and none is kept (empty result)."""
        runner, sites = self._runner(inputs)
        out: dict[str, torch.Tensor] = {}

        def keep(name: str, value: torch.Tensor) -> None:
            features = features_of(value, sites[name])
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
