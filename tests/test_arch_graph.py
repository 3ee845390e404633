"""Tracing real architectures: torch.export where symbolic_trace cannot (every Hugging
Face family), activation sites for every FF space, and the fallback to binding by
names when nothing can trace a model."""

from __future__ import annotations

import pytest
import torch

import symspec
from symspec.binding import bind
from symspec.checker import check
from symspec.graph import trace
from symspec.spec import loads_spec
from symspec.testing import assert_invariant
from tests.zoo import ZOO

#: family -> (expected tracer, the declared spaces of MLP hidden units)
FAMILIES = {
    "gpt2": ("export", ["ff"]),
    "llama": ("export", ["mlp", "up"]),
    "llama_tied": ("export", ["mlp", "up"]),
    "qwen2": ("export", ["mlp", "up"]),
    "opt": ("export", ["mlp", "scale"]),
    "bert": ("export", ["ff"]),
    "hf_vit": ("export", ["ff"]),
    "timm_vit": ("symbolic_trace", ["ff"]),
    "nanogpt": ("symbolic_trace", ["ff"]),
}


@pytest.mark.parametrize("name", list(FAMILIES))
def test_every_family_traces_with_activation_sites_for_its_mlp_units(name: str) -> None:
    method, ff_spaces = FAMILIES[name]
    model, inputs = ZOO[name]()
    bound = bind(symspec.load_spec(name), model, example_inputs=inputs, trace=True)
    g = bound.graph
    assert g.traced and g.method == method, g.reason
    for decl in ff_spaces:
        for inst in bound.problem.instances_of(decl):
            sites = g.sites.get(inst, [])
            kinds = {s.kind for s in sites}
            # pre: the layer output that carries the units; post: what the next layer reads
            assert "post" in kinds, (inst, sites)
            assert "pre" in kinds or decl == "up", (inst, sites)  # up[i] is read through gate * up
            assert len({s.node for s in sites}) == len(sites)
            layer = inst.split("[")[1].rstrip("]")
            assert all(g.has_node(s.node) for s in sites)
            assert any(f".{layer}." in s.module for s in sites), sites  # the layer's own modules


def test_composite_activations_get_the_reading_layers_input_as_post_site() -> None:
    # GPT-2's tanh-GELU is several aten ops; the post site is what c_proj reads
    model, inputs = ZOO["gpt2"]()
    g = bind(symspec.load_spec("gpt2"), model, example_inputs=inputs, trace=True).graph
    post = [s for s in g.sites["ff[1]"] if s.kind == "post"]
    assert [s.module for s in post] == ["transformer.h.1.mlp.c_proj"]
    pre = [s for s in g.sites["ff[1]"] if s.kind == "pre"]
    assert [s.module for s in pre] == ["transformer.h.1.mlp.c_fc"]
    # SwiGLU: silu(gate) is a post site, and so is the product down_proj reads
    model, inputs = ZOO["llama"]()
    g = bind(symspec.load_spec("llama"), model, example_inputs=inputs, trace=True).graph
    mods = {(s.kind, s.module) for s in g.sites["mlp[0]"]}
    assert ("pre", "model.layers.0.mlp.gate_proj") in mods and ("post", "model.layers.0.mlp.act_fn") in mods
    assert ("post", "model.layers.0.mlp") in mods


class Branchy(torch.nn.Module):
    """A model whose forward branches on a tensor's value: neither tracer can follow it."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = torch.nn.Linear(4, 6)
        self.fc2 = torch.nn.Linear(6, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.fc1(x))
        if float(h.sum()) > 0:  # data-dependent Python control flow
            h = h * 1.0
        return self.fc2(h)


BRANCHY_SPEC = """
symspec: 1
name: branchy
spaces:
  ff: S(6)
  scale: Dpos(6)
params:
  fc1.weight: [ff @ scale, _]
  fc1.bias: [ff @ scale]
  fc2.weight: [_, ff* @ scale*]
  fc2.bias: invariant
"""


def test_an_untraceable_model_still_binds_and_checks_with_the_reason_reported() -> None:
    torch.manual_seed(0)
    model = Branchy().eval()
    x = torch.randn(5, 4)
    g = trace(model, x)
    assert g.method == "none" and not g.traced and g.sites == {}
    assert "symbolic_trace:" in g.reason and "export:" in g.reason
    spec = loads_spec(BRANCHY_SPEC, "branchy.yaml")
    bound = bind(spec, model, example_inputs=x, trace=True)
    assert bound.graph.method == "none"
    report = check(model, bound, x)
    assert report.passed, report.render()
    (note,) = [n for n in report.notes if n.startswith("graph:")]
    assert note.startswith("graph: not traced (symbolic_trace: ") and "bound by parameter names only" in note
    # the same through check(trace=True); and the groups still have teeth without a graph
    assert any(n.startswith("graph: not traced") for n in check(model, spec, x, trace=True).notes)
    wrong = loads_spec(BRANCHY_SPEC.replace("scale: Dpos(6)", "scale: D(6)"), "branchy-wrong.yaml")
    assert not check(model, wrong, x, trace=True).passed


def test_traced_check_reports_the_graph() -> None:
    model, inputs = ZOO["qwen2"]()
    report = check(model, symspec.load_spec("qwen2"), inputs, samples=1, trace=True)
    assert report.passed
    (note,) = [n for n in report.notes if n.startswith("graph:")]
    assert note.startswith("graph: traced with export;")
    assert_invariant(model, "qwen2", inputs, samples=1)  # tracing left the model as it was
