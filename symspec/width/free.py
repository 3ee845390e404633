"""The lift's free directions, learned for the path: after B was lifted into A's widths
and aligned, part of its weights is not seen by its function, and is trained for the
loss of the interpolated model.

A lifted B's residual stream lies in the span of its writers (the Stiefel map's image,
rotated by the alignment): at most n_B of A's n_A directions. A reader of the residual
(a query/key/value or MLP input projection, the head) sees the stream only there; its
components on the other directions multiply zero, so any values there leave B's function
as it is. The lift writes zeros there; on the path from A to B the interpolated model
reads A's stream (which fills every direction) through ``(1 - lambda) A + lambda 0``.
:func:`learn_free` trains those components, ``Z`` projected onto the complement of the
writers' span (``Z (I - U U^T)``, U the top n_B left singular vectors of the writers:
the span itself, whose rank is at most n_B), for the loss of ``(1 - lambda) A + lambda
(B + Z (I - U U^T))`` with lambda ~ U(0, 1) (the whole path; learned matching's
U(0.4, 0.6) leaves the barrier 2-8 times higher on the width benchmark), as learned
matching trains its elements; the validation midpoint loss picks the step. The result keeps B's function,
checked in float64 like learned matching's elements, to the weights' precision (a
failure leaves B as it was and says so).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import attrs
import torch

from ..checker import DEFAULT_RTOL
from ..errors import SymspecInputError
from ..learned.loop import Mixture, float64_difference, shuffled_order, split_batches
from ..learned.method import LearnedOptions, lambda_sampler
from ..solvers import MatchEvent
from ..statedict import functional_names
from ..transforms import apply_elements


def free_readers(problem: Any, sd: Mapping[str, torch.Tensor], lifted: Mapping[str, Mapping[str, Any]]) -> dict[str, tuple[int, torch.Tensor]]:
    """Per reader parameter of a widened residual space (``lifted``: ``info["lift"]["spaces"]``,
    kind ``stiefel``): (its residual axis, the projector onto the complement of the
    writers' span there, float64). A parameter that also writes the stream, or is tied,
    is left out."""
    tied = {n for group in problem.ties for n in group}
    out: dict[str, tuple[int, torch.Tensor]] = {}
    for space, how in lifted.items():
        if how.get("kind") != "stiefel":
            continue
        writers: list[tuple[str, int]] = []
        readers: list[tuple[str, int]] = []
        for name, pb in problem.params.items():
            for ab in pb.axes:
                variances = {f.variance for seg in ab.segments for f in seg.factors if f.space == space}
                if "co" in variances:
                    writers.append((name, ab.axis))
                if "contra" in variances:
                    readers.append((name, ab.axis))
        if not writers or not readers:
            continue
        cols = []
        for name, axis in writers:
            t = sd[name].detach().double().movedim(axis, 0)
            cols.append(t.reshape(t.shape[0], -1))
        u = torch.linalg.svd(torch.cat(cols, 1), full_matrices=False)[0][:, : int(how["from"])]
        complement = torch.eye(u.shape[0], dtype=torch.float64) - u @ u.T
        written = {n for n, _ in writers}
        for name, axis in readers:
            if name not in written and name not in tied and name not in out:
                out[name] = (axis, complement)
    return out


def _project(z: torch.Tensor, axis: int, complement: torch.Tensor) -> torch.Tensor:
    return (z.movedim(axis, -1) @ complement.to(z.dtype)).movedim(-1, axis)


def learn_free(result: Any, data: Any, validation: Any = None, *, steps: int = 300, lr: float = 1e-2,
               batch_size: int | None = 64, seed: int = 0, device: str | torch.device = "cpu",
               lam: str = "uniform", progress: Any = None) -> Any:
    """``result`` (an :class:`~symspec.alignment.AlignResult` whose B was lifted) with the
    lift's free directions trained on ``data`` (a train split; ``validation``: held-out
    data that picks the step, else part of ``data`` is held out) for ``steps`` steps of
    Adam at ``lr``, lambda drawn by ``lam`` (``uniform``: U(0, 1), the whole path;
    ``narrow``: U(0.4, 0.6); ``fixed:X``): ``aligned_b`` and ``canonical_b`` change on those directions only,
    ``info["lift"]["free"]`` says what was done (and the function check). ``progress``:
    called with a :class:`~symspec.solvers.MatchEvent` at the start and after every step,
    as learned matching does."""
    lift = (result.info or {}).get("lift")
    if not lift:
        raise SymspecInputError("learn_free: B was not lifted (A and B have the same widths): nothing is free")
    if result.canonical_model is None:
        raise SymspecInputError("learn_free needs modules (the pair was aligned from state dicts)")
    if steps < 1:
        raise SymspecInputError(f"learn_free: steps must be at least 1, got {steps}")
    problem = result.bound.problem
    readers = free_readers(problem, result.aligned_b, lift["spaces"])
    info: dict[str, Any] = {"steps": steps, "lr": lr, "lambda": lam, "params": sorted(readers)}
    if not readers:
        info["note"] = "no free directions: no widened residual with readers that only read it"
        return _with_free(result, result.aligned_b, result.canonical_b, info)
    opts = LearnedOptions(steps=steps, lr=lr, batch_size=batch_size, seed=seed)
    train, val, held_out = split_batches(data, validation, opts)
    mixture = Mixture(problem, result.canonical_model, [result.canonical_a, result.aligned_b], device)
    best_free = _train(mixture, readers, data, train, val, opts, lambda_sampler(lam), progress, info)
    info["validation"] = "val split" if not held_out else "held out of the train split"
    return _adopt(result, readers, best_free, (val or train)[0], info)


def _train(mixture: Mixture, readers: Mapping[str, tuple[int, torch.Tensor]], data: Any, train: list[Any],
           val: list[Any], opts: LearnedOptions, lam: tuple[float, float], progress: Any,
           info: dict[str, Any]) -> dict[str, torch.Tensor]:
    """Adam on the free directions for the interpolated model's loss at lambda drawn in
    ``lam``; the best step's directions on the validation batches (reported in ``info``)."""
    steps, (lo, hi) = opts.steps, lam
    a_state, b_state = mixture.states
    proj = {n: (axis, c.to(mixture.device)) for n, (axis, c) in readers.items()}
    free = {n: torch.zeros_like(b_state[n], requires_grad=True) for n in proj}
    opt = torch.optim.Adam(list(free.values()), lr=opts.lr)
    gen = torch.Generator().manual_seed(opts.seed)

    def moved() -> dict[str, torch.Tensor]:
        out = dict(b_state)
        for n, z in free.items():
            axis, c = proj[n]
            out[n] = b_state[n] + _project(z, axis, c)
        return out

    def validate() -> float:
        with torch.no_grad():
            return mixture.mean_loss(data, mixture.mix([a_state, moved()], [0.5, 0.5]), val)

    before = best = validate()
    best_free = {n: z.detach().clone() for n, z in free.items()}
    best_step, order = 0, shuffled_order(len(train), gen)
    if progress is not None:
        progress(MatchEvent("start", 0, steps, total=steps, objective=before))
    for step in range(steps):
        if not order:
            order = shuffled_order(len(train), gen)
        t = lo + (hi - lo) * float(torch.rand((), generator=gen, dtype=torch.float64))
        loss = mixture.loss(data, mixture.mix([a_state, moved()], [1.0 - t, t]), train[order.pop()])
        if not math.isfinite(float(loss.detach())):
            info["note"] = f"stopped at step {step + 1}: the interpolated model's loss is not finite"
            break
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if (step + 1) % opts.eval_every == 0 or step + 1 == steps:
            v = validate()
            if v < best:
                best, best_step = v, step + 1
                best_free = {n: z.detach().clone() for n, z in free.items()}
        if progress is not None:
            progress(MatchEvent("step", step + 1, steps, space=f"{float(loss.detach()):.4g}", done=step + 1,
                                total=steps, objective=best))
    info.update({"val_midpoint_loss_before": before, "val_midpoint_loss": best, "best_step": best_step})
    return best_free


def _adopt(result: Any, readers: Mapping[str, tuple[int, torch.Tensor]], best_free: Mapping[str, torch.Tensor],
           batch: Any, info: dict[str, Any]) -> Any:
    """``result`` with the trained directions added to aligned B (and canonical B) when B
    still computes its function with them on ``batch``; else as it was, with a note why."""
    problem = result.bound.problem
    aligned = dict(result.aligned_b)
    for n, z in best_free.items():
        axis, c = readers[n]
        delta = _project(z.to("cpu", torch.float64), axis, c)
        aligned[n] = (result.aligned_b[n].double() + delta).to(result.aligned_b[n].dtype)
    check = keeps_function(result.canonical_model, result.aligned_b, aligned, batch)
    info["check"] = check
    if not check["passed"]:
        info["note"] = (f"not used: B with the trained directions does not compute B's function (max relative error "
                        f"{check['max_rel']:.2e} > {check['rtol']:.0e} in float64)")
        return _with_free(result, result.aligned_b, result.canonical_b, info)
    inverse = {s: problem.spaces[s].group.inverse(e) for s, e in result.elements.items()}
    canonical = None
    if result.canonical_b is not None:
        back = apply_elements(problem, inverse, {k: v.double() for k, v in aligned.items()})
        canonical = {k: back[k].to(v.dtype) if k in back else v for k, v in result.canonical_b.items()}
    return _with_free(result, aligned, canonical, info)


def _with_free(result: Any, aligned: dict[str, torch.Tensor], canonical: dict[str, torch.Tensor] | None,
               info: dict[str, Any]) -> Any:
    new_info = dict(result.info)
    new_info["lift"] = {**new_info["lift"], "free": info}
    return attrs.evolve(result, aligned_b=aligned, canonical_b=canonical, info=new_info)


def keeps_function(module: torch.nn.Module, before: Mapping[str, torch.Tensor], after: Mapping[str, torch.Tensor],
                   batch: tuple[Any, Any], examples: int = 8) -> dict[str, Any]:
    """Whether ``after`` computes what ``before`` does in ``module`` (canonical form) on
    ``examples`` examples of ``batch``, evaluated in float64, to the checker's tolerance
    of the weights' dtype (1e-9 relative for float64 weights, 1e-4 for float32)."""
    names, _ = functional_names(module)
    max_abs, max_rel = float64_difference(module, "cpu", {k: before[k] for k in names}, {k: after[k] for k in names},
                                          batch, examples)
    # the stream lies in the writers' span to the weights' own precision (float32 writers:
    # 1e-7 relative), so the unseen directions are unseen to that precision
    dtype = next((v.dtype for v in before.values() if v.is_floating_point()), torch.float64)
    rtol = DEFAULT_RTOL["float64" if dtype == torch.float64 else "float32"]
    return {"examples": examples, "dtype": "float64", "max_abs": max_abs, "max_rel": max_rel, "rtol": rtol,
            "passed": math.isfinite(max_rel) and max_rel <= rtol}
