"""Models of one architecture mixed in weight space and evaluated with one module
instance: learned matching trains through a :class:`Mixture`, and ``auto`` scores each
candidate method's element by the mixture's loss at the midpoint."""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any

import torch

from ..data import call_model
from ..data.base import move
from ..errors import SymspecInputError
from ..groups import Element
from ..problem import Problem
from ..statedict import functional_names
from ..transforms import apply_elements


class Mixture:
    """Models of one architecture mixed in weight space and evaluated with one module
    instance (``functional_call``): what learned matching trains through, for a pair
    (weights ``1 - lambda, lambda``) and for universe refinement (Dirichlet weights).
    ``states``: canonical state dicts, moved to ``device`` in the module's dtypes."""

    def __init__(self, problem: Problem, module: torch.nn.Module, states: list[Mapping[str, torch.Tensor]],
                 device: str | torch.device) -> None:
        self.problem = problem
        self.device = torch.device(device)
        if any(p.device != self.device for p in module.parameters()):
            module = copy.deepcopy(module).to(self.device)
        self.module = module.eval()
        self.names, _ = functional_names(self.module)
        self.dtype = next((p.dtype for p in self.module.parameters() if p.is_floating_point()), torch.float32)
        own = self.module.state_dict()
        self.states = []
        for i, sd in enumerate(states):
            missing = [k for k in self.names if k not in sd]
            if missing:
                raise SymspecInputError(f"learned matching: model {i} lacks {', '.join(missing[:3])}")
            self.states.append({k: sd[k].detach().to(self.device, own[k].dtype) for k in self.names})

    def inputs(self, x: Any) -> Any:
        return move(x, self.device, self.dtype)

    def transformed(self, i: int, elements: Mapping[str, Element],
                    actions: Mapping[str, Any] | None = None) -> dict[str, torch.Tensor]:
        """Model ``i`` acted on by ``elements`` (differentiable in them)."""
        return apply_elements(self.problem, elements, self.states[i], actions)

    def mix(self, states: list[Mapping[str, torch.Tensor]], weights: list[float]) -> dict[str, torch.Tensor]:
        """sum_i w_i states[i] (the first state's entries where they are not floating point)."""
        out = {}
        for k, v0 in states[0].items():
            if not v0.is_floating_point():
                out[k] = v0
                continue
            acc = v0 * weights[0]
            for sd, w in zip(states[1:], weights[1:]):
                acc = acc + sd[k].to(v0.dtype) * w
            out[k] = acc
        return out

    def loss(self, data: Any, weights: Mapping[str, torch.Tensor], batch: tuple[Any, Any]) -> torch.Tensor:
        inputs, targets = batch
        out = call_model(lambda *x, **k: torch.func.functional_call(self.module, dict(weights), x, k), self.inputs(inputs))
        return data.loss(out, targets.to(self.device))

    def mean_loss(self, data: Any, weights: Mapping[str, torch.Tensor], batches: list[tuple[Any, Any]]) -> float:
        """Mean loss over ``batches`` (weighted by their targets), no gradients."""
        with torch.no_grad():
            total, count = 0.0, 0
            for batch in batches:
                n = int(batch[1].numel())
                total += float(self.loss(data, weights, batch)) * n
                count += n
        return total / max(count, 1)
