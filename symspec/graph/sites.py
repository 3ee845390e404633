"""Activation sites: where data shows a space.

A site is a traced node whose last axis carries features on which the spaces act as on
one axis of a bound weight (:class:`~symspec.problem.Site`), found from the weights'
bindings, so that a new spec gets sites for free:

- ``out:W`` (kind ``pre``): the output of a linear-like layer with weight W (a linear,
  an addmm of a Conv1D, a matmul, an embedding, a convolution: its channels, the
  output's axis 1, ``Site.dim``), whose output axis is bound: features
  move as that axis (fused QKV outputs keep their segments and head layout; keys move
  by the dual of the QK map, as W's rows do);
- ``post:W:k`` (kind ``post``): the k-th elementwise function (GELU, SiLU, ReLU,
  dropout) of ``out:W`` in a chain of single users, where every space of the axis is a
  permutation group (only those commute with an elementwise nonlinearity);
- ``in:W`` (kind ``post``): the input of a layer whose weight's input axis is bound:
  what the layer reads, moving by the dual of that axis (GPT-2's composite tanh-GELU,
  SwiGLU's ``silu(gate) * up``, a head's attention output before ``o_proj``, a norm's
  output before ``q_proj``).

One site per node (the first found).
"""

from __future__ import annotations

import attrs

from ..problem import AxisBinding, Factor, ParamBinding, Problem, Site
from .ops import CONV_OUT, EMBEDDING_WEIGHT, LAYER_IN, LAYER_OUT, ops_with
from .trace import ModelGraph, Node

#: ops that map features elementwise (the last axis keeps its meaning)
ELEMENTWISE = ops_with("site_elementwise")


def find_sites(mg: ModelGraph, problem: Problem) -> tuple[Site, ...]:
    """Every activation site of ``problem``'s spaces in the traced graph (see the module)."""
    if not mg.traced:
        return ()
    found: dict[str, Site] = {}
    for pname, binding in problem.params.items():
        # weights only (a bias's user is the same layer): a matrix, or a convolution's kernel
        if len(binding.shape) < 2:
            continue
        for user in mg.param_users.get(pname, []):
            node = mg.nodes[user]
            if len(binding.shape) != 2 and node.target not in CONV_OUT:
                continue  # a stack of experts' matrices, say: no layer of one weight
            for site in _output_sites(mg, problem, node, pname, binding) + _input_sites(mg, node, pname, binding):
                found.setdefault(site.node, site)
    return tuple(found.values())


def _reads_at(mg: ModelGraph, node: Node, pname: str, position: int | None) -> bool:
    """Whether ``node`` reads parameter ``pname`` as its weight operand."""
    if position is None:
        return node.op == "call_module"
    args = node.fx.args
    if position >= len(args) or not hasattr(args[position], "name"):
        return False
    return pname in mg.nodes[args[position].name].params


def _axis(binding: ParamBinding, axis: int, dual: bool = False) -> AxisBinding | None:
    ab = next((a for a in binding.axes if a.axis == axis), None)
    if ab is None:
        return None
    segments = ab.segments
    if dual:
        flip = {"co": "contra", "contra": "co"}
        segments = tuple(attrs.evolve(s, factors=tuple(Factor(f.space, f.path, flip[f.variance]) for f in s.factors))
                         for s in segments)
    return AxisBinding(0, segments, ab.layout)


def _output_sites(mg: ModelGraph, problem: Problem, node: Node, pname: str, binding: ParamBinding) -> list[Site]:
    if node.target not in LAYER_OUT and node.target not in CONV_OUT:
        return []
    dim = 1 if node.target in CONV_OUT else -1  # a convolution's channels: its output's axis 1
    position, axis = CONV_OUT[node.target] if dim == 1 else LAYER_OUT[node.target]
    if node.target == "embedding":
        position = EMBEDDING_WEIGHT[mg.method]
    if not _reads_at(mg, node, pname, position):
        return []
    ab = _axis(binding, axis)
    if ab is None:
        return []
    sites = [Site(f"out:{pname}", node.name, "pre", pname, ab, node.module, dim)]
    groups = [problem.spaces[f.space].group for s in ab.segments for f in s.factors]
    if all(g.permutation_subgroup() == g for g in groups):
        k, cur = 0, node
        while len(cur.users) == 1 and mg.nodes[cur.users[0]].target in ELEMENTWISE:
            cur, k = mg.nodes[cur.users[0]], k + 1
            sites.append(Site(f"post:{pname}:{k}", cur.name, "post", pname, ab, cur.module, dim))
    return sites


def _input_sites(mg: ModelGraph, node: Node, pname: str, binding: ParamBinding) -> list[Site]:
    if node.target not in LAYER_IN:
        return []
    position, axis, source = LAYER_IN[node.target]
    if not _reads_at(mg, node, pname, position):
        return []
    args = node.fx.args
    if source >= len(args) or not hasattr(args[source], "name") or mg.nodes[args[source].name].params:
        return []
    ab = _axis(binding, axis, dual=True)
    if ab is None:
        return []
    src = mg.nodes[args[source].name]
    return [Site(f"in:{pname}", src.name, "post", pname, ab, src.module)]


def read_sites(sites: tuple[Site, ...]) -> tuple[Site, ...]:
    """One site per chain: where a layer's output goes through elementwise functions, the
    last of them (what the next layer reads, Git Re-Basin's post-activation site) and
    not the output itself. Activation matching's default: a space's statistics once,
    not once per function of the chain (half the memory on an MLP)."""
    last: dict[str, int] = {}
    for s in sites:
        if s.name.startswith("post:"):
            last[s.param] = max(last.get(s.param, 0), int(s.name.rsplit(":", 1)[1]))

    def keep(s: Site) -> bool:
        if s.param not in last:
            return True
        return s.name == f"post:{s.param}:{last[s.param]}" or s.name.startswith("in:")

    return tuple(s for s in sites if keep(s))
