"""Width as stages of :func:`symspec.align` (registered by :mod:`.extension`): a narrower
B is lifted into A's shape before the pair is bound (:func:`lift_stage`), and the lift's
free directions are trained for the path after the alignment (:func:`free_stage`,
``lift_free`` steps)."""

from __future__ import annotations

import time
from typing import Any

import torch

from ..alignment.hooks import AlignRequest
from ..alignment.result import AlignResult
from ..binding import BoundSpec
from ..errors import SymspecInputError
from ..spec import load_spec
from ..spec.model import Spec
from .fit import fitted_lift
from .free import learn_free
from .lifting import lift, lift_needed

LIFTS = ("fitted", "activation", "random")


def lift_stage(request: AlignRequest) -> None:
    """B lifted into A's shape when it is narrower (modules only): ``request.model_b``
    becomes the lifted model, ``request.info["lift"]`` says what was lifted. ``lift_free``
    needs data either way."""
    opts = request.options
    a, b = request.model_a, request.model_b
    if isinstance(a, torch.nn.Module) and isinstance(b, torch.nn.Module):
        request.model_b, lifted = lift_if_narrower(a, b, request.spec, opts.get("lift", "fitted"),
                                                   opts.get("lift_seed", 0), request.data)
        if lifted is not None:
            request.info["lift"] = lifted
            request.canonical_input = True  # a lift writes canonical form
    if opts.get("lift_free") and request.data is None:
        raise SymspecInputError("lift_free trains the lift's free directions on data: pass data=")


def lift_if_narrower(model_a: torch.nn.Module, model_b: torch.nn.Module, spec: Spec | BoundSpec | str | Any,
                     how: str, seed: int, data: Any = None) -> tuple[torch.nn.Module, dict[str, Any] | None]:
    """B as it is when it has A's widths, else B lifted into A's shape (and what was lifted)."""
    spec_obj = spec if isinstance(spec, (Spec, BoundSpec)) else load_spec(spec)
    plain = spec_obj.spec if isinstance(spec_obj, BoundSpec) else spec_obj
    if not lift_needed(plain, model_a, model_b):
        return model_b, None
    if how not in LIFTS:
        raise SymspecInputError(f"lift={how!r}: use 'fitted', 'activation' or 'random'")
    if how == "activation" and data is None:
        raise SymspecInputError("lift='activation' fits the lift on activations: it needs data (data=, with a method that takes it)")
    if how == "random":
        result = lift(model_b, model_a, plain, seed=seed)
    else:
        result = fitted_lift(model_b, model_a, plain, seed=seed, data=data if how == "activation" else None)
    return result.model, {"how": how, "seed": seed,
                          "spaces": {s.space: {"from": s.narrow, "to": s.wide, "kind": s.kind} for s in result.changed()}}


def free_stage(result: AlignResult, request: AlignRequest) -> AlignResult:
    """``lift_free`` steps of training the lift's free directions (a note when B was not lifted)."""
    steps = request.options.get("lift_free", 0)
    if not steps:
        return result
    if "lift" not in request.info:
        result.info["lift_free"] = "not used: B has A's widths, nothing was lifted"
        return result
    t1 = time.perf_counter()
    result = learn_free(result, request.data, request.validation, steps=steps, device=request.device,
                        lam=request.options.get("lift_free_lambda", "uniform"), progress=request.progress)
    result.timings["lift_free"] = time.perf_counter() - t1
    result.record.meta["lift"] = result.info["lift"]
    return result
