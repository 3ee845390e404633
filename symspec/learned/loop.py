"""Learned matching's training loop (:func:`learn`) and what it trains through: a
:class:`Mixture` of models of one architecture mixed in weight space, evaluated with one
module instance. :func:`align_pair` is :class:`~.method.LearnedMatching`'s run for a
pair; universe refinement (:mod:`symspec.universe.learned`) and free directions
(:mod:`symspec.width.free`) train through the same loop and mixture. See
:mod:`.method` and docs/learned.md.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Mapping, Sequence
from typing import Any

import attrs
import torch

from ..alignment.mixture import Mixture
from ..alignment.protocol import Alignment, AlignOptions, Endpoint
from ..alignment.registry import get_method
from ..checker import DEFAULT_RTOL
from ..checker.local import Weights, element_values, state_values, stream_difference
from ..data.base import batch_len
from ..errors import SymspecInputError
from ..groups import Element
from ..problem import Problem
from ..solvers import MatchEvent, SolverError, Timer, match_weights
from ..statedict import functional_names
from .method import LearnedOptions, lambda_sampler
from .parametrize import (
    DiagonalParam,
    HeadsParam,
    LinearParam,
    OrthogonalParam,
    ParamSettings,
    RotaryParam,
    parametrize,
)


def _rows(x: Any, i: int, j: int) -> Any:
    """Examples ``i:j`` of batch inputs or targets (tensors, mappings, tuples, lists)."""
    if isinstance(x, torch.Tensor):
        return x[i:j]
    if isinstance(x, Mapping):
        return {k: _rows(v, i, j) for k, v in x.items()}
    if isinstance(x, (tuple, list)):
        return type(x)(_rows(v, i, j) for v in x)
    return x


def _rebatch(batches: list[tuple[Any, Any]], size: int | None) -> list[tuple[Any, Any]]:
    """The data's batches cut into batches of at most ``size`` examples."""
    if size is None:
        return list(batches)
    out = []
    for inputs, targets in batches:
        n = batch_len(targets)
        for i in range(0, n, size):
            out.append((_rows(inputs, i, i + size), _rows(targets, i, i + size)))
    return out


def _schedule(step: int, total: int, warmup: int) -> float:
    """Linear warm-up to 1, then cosine decay to 0 (multiplier of the peak rate)."""
    if warmup and step < warmup:
        return (step + 1) / warmup
    span = max(total - warmup, 1)
    return 0.5 * (1 + math.cos(math.pi * min(step - warmup, span) / span))


def float64_difference(module: torch.nn.Module, device: Any, before: Mapping[str, torch.Tensor],
                       after: Mapping[str, torch.Tensor], batch: tuple[Any, Any], examples: int,
                       outputs: Sequence[str] = ()) -> tuple[float, float]:
    """(max absolute, max relative) difference between ``module``'s outputs (``outputs``
    of them where given: the spec's) with the weights ``before`` and with ``after``
    (functional names) on ``examples`` examples of ``batch``, in float64 throughout:
    casts a model writes (RMSNorm computed in float32) are kept in float64, as the
    checker does. One block at a time (:func:`~symspec.checker.local.stream_difference`):
    neither the module nor the states are copied in float64."""
    _, alias = functional_names(module)
    return stream_difference(module, _rows(batch[0], 0, examples), state_values(before, alias),
                             state_values(after, alias), outputs, device)


def check_function(run: Mixture, b_state: Mapping[str, torch.Tensor], elements: Mapping[str, Element],
                   batch: tuple[Any, Any], examples: int, cond: float) -> dict[str, Any]:
    """``elements`` acting on ``b_state`` keep its function: outputs on ``examples``
    examples of ``batch``, in float64, within 1e-9 relative scaled by ``cond / 10`` (the
    worst condition number of the elements; the checker's elements have at most 10).
    Each block's tensors are upcast and transformed in float64 only while it runs."""
    _, alias = functional_names(run.module)
    named = {n: b_state[alias.get(n, n)] for n in run.module.state_dict(keep_vars=True) if alias.get(n, n) in b_state}
    e64 = {s: {k: (v.to(torch.float64) if v.is_floating_point() else v) for k, v in e.items()} for s, e in elements.items()}
    after = element_values(Weights(run.problem, named), e64)
    max_abs, max_rel = stream_difference(run.module, _rows(batch[0], 0, examples), state_values(named), after,
                                         run.problem.outputs, run.device)
    rtol = DEFAULT_RTOL["float64"] * max(1.0, cond / 10.0)
    return {"examples": examples, "dtype": "float64", "max_abs": max_abs, "max_rel": max_rel, "rtol": rtol,
            "passed": math.isfinite(max_rel) and max_rel <= rtol}


def start_element(problem: Problem, a: Endpoint, b: Endpoint, options: AlignOptions,
                  opts: LearnedOptions) -> tuple[dict[str, Element], dict[str, Any]]:
    """The starting element: ``options.init`` where given, else that of the method
    ``opts.init`` names (weight matching's by default)."""
    if options.init is not None:
        return problem.complete(options.init), {"start": "given"}
    if opts.init != "weight":
        method = get_method(opts.init)
        found = method.align(problem, a, b, attrs.evolve(options, tuning=None, consume_b=False))
        return problem.complete(found.elements), {"start": method.label, "start_method": method.name,
                                                  "start_info": found.info, "start_objective": found.history}
    res = match_weights(problem, a.state, b.state, rounds=options.rounds, tol=options.tol, device=options.device,
                        dtype=options.dtype, progress=options.progress, timer=options.timer, options=opts.solver)
    return problem.complete(res.elements), {"start": "weight matching", "weight_matching_objective": res.history}


def align_pair(problem: Problem, a: Endpoint, b: Endpoint, options: AlignOptions, opts: LearnedOptions) -> Alignment:
    """Learned matching of B to A (:class:`~.method.LearnedMatching`, with its options ``opts``)."""
    timer = options.timer or Timer()
    t_start = time.perf_counter()
    with timer("start"):
        start, info = start_element(problem, a, b, options, opts)
    assert a.module is not None
    mixture = Mixture(problem, a.module, [a.state, b.state], options.device)
    lo, hi = lambda_sampler(opts.lam)

    def weights(gen: torch.Generator) -> list[float]:
        lam = lo + (hi - lo) * float(torch.rand((), generator=gen, dtype=torch.float64))
        return [1.0 - lam, lam]

    found = learn(mixture, {1: start}, weights, [0.5, 0.5], options.data, options.validation, opts,
                  progress=options.progress, timer=timer)
    info.update({"lambda": opts.lam, **found.info})
    info["best_val_midpoint_loss"] = info.pop("best_val_loss")
    info["val_midpoint_loss"] = info.pop("val_loss")
    if "val_loss_average" in info:
        info["val_midpoint_loss_average"] = info.pop("val_loss_average")
    info["check"] = found.checks[1]
    elements = {s: {k: v.detach().to("cpu") for k, v in e.items()} for s, e in found.elements[1].items()}
    return Alignment(elements, found.history, {"total_learned": time.perf_counter() - t_start}, converged=True,
                     aligned=None, info=info)


@attrs.define
class Learned:
    """What :func:`learn` found: per learned model, its best element (one per space) and
    the function check of it; the validation loss before the first step and at every
    validation (``history``); ``info`` (curves, settings, per-space facts)."""

    elements: dict[int, dict[str, Element]]
    checks: dict[int, dict[str, Any]]
    history: list[float]
    info: dict[str, Any]


def learn(mixture: Mixture, start: Mapping[int, Mapping[str, Element]], sample: Any, val_weights: list[float],
          data: Any, validation: Any, opts: LearnedOptions, *, progress: Any = None, timer: Any = None) -> Learned:
    """Train the elements of the models ``start`` names (model index -> starting element
    per space; the other models stay as they are) for the loss of
    ``mixture.mix(models, sample(gen))``, validating ``mixture.mix(models, val_weights)``
    with the elements projected exactly; the best validation wins. Every learned model's
    best element is then checked to keep its model's function (a failure raises)."""
    timer = timer or Timer()
    problem = mixture.problem
    train, val, held_out = split_batches(data, validation, opts)
    steps = opts.steps or (max(1, round(opts.epochs * len(train))) if opts.epochs else 500)
    settings = ParamSettings(orthogonal=opts.orthogonal, permutations=opts.permutations, device=mixture.device)
    params = {i: {s: parametrize(problem.spaces[s].group, {k: v.to(mixture.device) for k, v in e[s].items()}, settings)
                  for s in problem.spaces}
              for i, e in start.items()}
    latents = [t for ps in params.values() for p in ps.values() for t in p.latents()]
    gen = torch.Generator().manual_seed(opts.seed)

    def validate() -> float:
        with torch.no_grad():
            return mixture.mean_loss(data, mixture.mix(_models(mixture, _projected_all(params)), val_weights), val)

    # the start, projected: exactly in its groups (weight matching's orthogonal maps are
    # orthogonal to the working precision only)
    best = _Best(validate(), _projected_all(params))
    train_curve: list[tuple[int, float]] = []
    info = _settings_info(opts, steps, train, val, held_out, latents)
    if not latents:  # every space frozen (a permutation-only problem with frozen permutations)
        info["note"] = "nothing to learn: every searched group is frozen (try --permutations ste)"
        steps = 0
    opt = _optimizer(params, opts) if latents else None
    warmup = int(opts.warmup * steps)
    order = shuffled_order(len(train), gen)
    window: list[float] = []
    reached = _max_condition(params)
    average = _Average(latents, opts.average) if opts.average is not None and latents else None
    if progress is not None:
        progress(MatchEvent("start", 0, steps, total=steps, objective=best.val))
    with timer("learn"):
        for step in range(steps):
            assert opt is not None
            _anneal(params, opt, step, steps, warmup, opts)
            if not order:
                order = shuffled_order(len(train), gen)
            batch = train[order.pop()]
            weights = [sample(gen) for _ in range(opts.path_points)]
            last = _train_step(mixture, params, data, opt, batch, weights, step, opts.micro_batch, opts.autocast)
            if average is not None:
                average.update(latents)
            window.append(last)
            done = step + 1
            if done % opts.eval_every == 0 or done == steps:
                train_curve.append((done, sum(window) / len(window)))
                window = []
                with timer("validate"):
                    best.validate(done, validate, params, latents, average)
                    reached = max(reached, _max_condition(params))
            if progress is not None:  # the step's loss, and the last validation's
                progress(MatchEvent("step", done, steps, space=f"{last:.4g}", done=done, total=steps,
                                    objective=best.curve[-1][1]))
    spaces = {i: _describe(ps) for i, ps in params.items()}
    if average is not None:
        info.update({"average": opts.average, "val_loss_average": best.averaged, "best_from": best.source})
    info.update({"best_step": best.step, "best_val_loss": best.val, "val_loss": best.curve, "train_loss": train_curve,
                 "spaces": spaces[next(iter(spaces))] if len(spaces) == 1 else {str(i): d for i, d in spaces.items()}})
    cond = _max_condition(params)  # the last step's
    info["max_condition"] = cond
    info["max_condition_reached"] = max(reached, cond)  # over every validation
    with timer("check"):
        checks = _checked(mixture, best.elements, (val or train)[0], opts.check_examples, cond)
    return Learned(best.elements, checks, best.history, info)


def _models(mixture: Mixture, elements: Mapping[int, Mapping[str, Element]],
            actions: Mapping[int, Mapping[str, Any]] | None = None) -> list[Any]:
    """The mixture's models, those ``elements`` names acted on by their elements."""
    return [mixture.transformed(i, elements[i], (actions or {}).get(i)) if i in elements else mixture.states[i]
            for i in range(len(mixture.states))]


def _settings_info(opts: LearnedOptions, steps: int, train: list[Any], val: list[Any], held_out: bool,
                   latents: list[torch.Tensor]) -> dict[str, Any]:
    """The run's settings, as :func:`learn`'s ``info`` starts."""
    return {
        "steps": steps, "eval_every": opts.eval_every, "permutations": opts.permutations, "orthogonal": opts.orthogonal, "lr": opts.lr,
        **({"lr_scale": dict(opts.lr_scale)} if opts.lr_scale else {}),
        **({"micro_batch": opts.micro_batch} if opts.micro_batch else {}),
        **({"autocast": opts.autocast} if opts.autocast else {}),
        **({"path_points": opts.path_points} if opts.path_points > 1 else {}),
        "batch_size": opts.batch_size, "train_batches": len(train),
        "validation": ("val split" if not held_out
                       else f"the last {sum(batch_len(t) for _, t in val)} train examples, held out"),
        "latents": int(sum(t.numel() for t in latents))}


def latent_kinds(p: Any) -> list[tuple[str, torch.Tensor]]:
    """Each trainable tensor of a space's parametrisation with its kind (``orthogonal``,
    ``linear``, ``diagonal``, ``rotary``, ``permutation``): what
    :attr:`LearnedOptions.lr_scale` scales."""
    if isinstance(p, HeadsParam):
        inner = [kt for part in p.parts.values() for kt in latent_kinds(part)]
        mine = [t for t in p.latents() if not any(t is u for _, u in inner)]
        return inner + [("permutation", t) for t in mine]
    kind = next((k for cls, k in _KINDS if isinstance(p, cls)), "permutation")
    return [(kind, t) for t in p.latents()]


_KINDS = ((OrthogonalParam, "orthogonal"), (LinearParam, "linear"), (DiagonalParam, "diagonal"), (RotaryParam, "rotary"))


def _optimizer(params: Mapping[int, Mapping[str, Any]], opts: LearnedOptions) -> torch.optim.Optimizer:
    """AdamW over every latent, one parameter group per learning-rate factor of its kind."""
    scale = dict(opts.lr_scale)
    groups: dict[float, list[torch.Tensor]] = {}
    for ps in params.values():
        for p in ps.values():
            for kind, t in latent_kinds(p):
                groups.setdefault(scale.get(kind, 1.0), []).append(t)
    return torch.optim.AdamW([{"params": ts, "lr_factor": f} for f, ts in groups.items()], lr=opts.lr,
                             weight_decay=opts.weight_decay)


def _anneal(params: Mapping[int, Mapping[str, Any]], opt: torch.optim.Optimizer, step: int, steps: int, warmup: int,
            opts: LearnedOptions) -> None:
    """Before step ``step``: every parametrisation's annealing, and the learning rate."""
    for ps in params.values():
        for p in ps.values():
            p.anneal(step / max(steps - 1, 1))
    for g in opt.param_groups:
        g["lr"] = opts.lr * g.get("lr_factor", 1.0) * _schedule(step, steps, warmup)


def pieces(batch: tuple[Any, Any], micro: int | None) -> list[tuple[tuple[Any, Any], float]]:
    """``batch`` in pieces of at most ``micro`` examples, each with its share of the
    batch's targets: a mean loss over the batch is the pieces' mean losses so weighted."""
    inputs, targets = batch
    n = batch_len(targets)
    if micro is None or micro >= n:
        return [(batch, 1.0)]
    total = int(targets.numel())
    out = []
    for i in range(0, n, micro):
        t = _rows(targets, i, i + micro)
        out.append(((_rows(inputs, i, i + micro), t), int(t.numel()) / total))
    return out


def _train_step(mixture: Mixture, params: Mapping[int, Mapping[str, Any]], data: Any, opt: torch.optim.Optimizer,
                batch: tuple[Any, Any], ws: list[list[float]], step: int, micro: int | None = None,
                autocast: str | None = None) -> float:
    """One optimiser step on the mean loss over the mixing weights ``ws`` of the models
    so mixed on ``batch`` (run in pieces of ``micro`` examples, their gradients added; the
    forward passes under ``autocast``); the loss (a loss that is not finite raises)."""
    opt.zero_grad(set_to_none=True)
    last = 0.0
    for w in ws:
        for piece, share in pieces(batch, micro):
            share /= len(ws)
            # the elements again per piece: each backward frees the graph from the latents
            elements = {i: {s: p.element() for s, p in ps.items()} for i, ps in params.items()}
            actions = {i: {s: act for s, p in ps.items() if (act := p.action()) is not None} for i, ps in params.items()}
            mixed = mixture.mix(_models(mixture, elements, actions), w)
            with _autocast(mixture.device, autocast):
                loss = mixture.loss(data, mixed, piece)
            value = float(loss.detach())
            if not math.isfinite(value):
                raise SolverError(f"learned matching: the interpolated model's loss at step {step + 1} is not finite "
                                  "(lower --lr?)")
            (loss.float() * share).backward()
            last += value * share
    opt.step()
    return last


class _Best:
    """The best validated element so far (``source``: the start, the iterate or the
    average of the latents), and the validation curves."""

    def __init__(self, val: float, elements: dict[int, dict[str, Element]]) -> None:
        self.val, self.elements, self.step, self.source = val, elements, 0, "start"
        self.curve: list[tuple[int, float]] = [(0, val)]
        self.averaged: list[tuple[int, float]] = []
        self.history = [val]

    def offer(self, v: float, step: int, params: Mapping[int, Mapping[str, Any]], source: str) -> None:
        if v < self.val:
            self.val, self.step, self.elements, self.source = v, step, _projected_all(params), source

    def validate(self, step: int, validate: Any, params: Mapping[int, Mapping[str, Any]], latents: list[torch.Tensor],
                 average: _Average | None) -> None:
        """The validation at ``step``: the iterate, and the latents' average where kept."""
        v = va = validate()
        if average is not None:
            with average.swapped(latents):
                va = validate()
                if va < v:  # projected while the latents hold the average
                    self.offer(va, step, params, "average")
            self.averaged.append((step, va))
        self.curve.append((step, v))
        self.history.append(min(v, va))
        self.offer(v, step, params, "iterate")


class _Average:
    """An exponential moving average of the latents (decay ``beta``), from the start's."""

    def __init__(self, latents: list[torch.Tensor], beta: float) -> None:
        self.beta = beta
        self.values = [t.detach().clone() for t in latents]

    def update(self, latents: list[torch.Tensor]) -> None:
        with torch.no_grad():
            for a, t in zip(self.values, latents):
                a.mul_(self.beta).add_(t.detach(), alpha=1.0 - self.beta)

    @contextlib.contextmanager
    def swapped(self, latents: list[torch.Tensor]) -> Any:
        """The latents hold the average inside the block, their own values again after."""
        saved = [t.detach().clone() for t in latents]
        with torch.no_grad():
            for t, a in zip(latents, self.values):
                t.copy_(a)
        try:
            yield
        finally:
            with torch.no_grad():
                for t, v in zip(latents, saved):
                    t.copy_(v)


def _autocast(device: torch.device, dtype: str | None) -> Any:
    """:func:`torch.autocast` to ``dtype`` on ``device``'s kind (a no-op context for None)."""
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=getattr(torch, dtype))


def _checked(mixture: Mixture, best: Mapping[int, Mapping[str, Element]], batch: tuple[Any, Any], examples: int,
             cond: float) -> dict[int, dict[str, Any]]:
    """The function check of every learned model's best element (a failure raises)."""
    checks = {}
    for i in best:
        checks[i] = check_function(mixture, mixture.states[i], best[i], batch, examples, cond)
        if not checks[i]["passed"]:
            c = checks[i]
            raise SolverError(f"learned matching: the aligned model {i} does not compute its model's function (max "
                              f"relative error {c['max_rel']:.2e} > {c['rtol']:.0e} in float64); the element is not "
                              "returned")
    return checks


def _max_condition(params: Mapping[int, Mapping[str, Any]]) -> float:
    """The worst condition number of the learned GL maps now (1 without any)."""
    worst = 1.0
    with torch.no_grad():
        for ps in params.values():
            for p in ps.values():
                for q in [p, *getattr(p, "parts", {}).values()]:
                    if isinstance(q, LinearParam):
                        worst = max(worst, float(torch.linalg.cond(q.element()["matrix"]).max()))
    return worst


def _projected_all(params: Mapping[int, Mapping[str, Any]]) -> dict[int, dict[str, Element]]:
    return {i: _projected(ps) for i, ps in params.items()}


def _projected(params: Mapping[str, Any]) -> dict[str, Element]:
    with torch.no_grad():
        return {s: p.project() for s, p in params.items()}


def _describe(params: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    """Per space, facts about the current element (the last step's)."""
    with torch.no_grad():
        return {s: d for s, p in params.items() if (d := p.describe())}


def shuffled_order(n: int, gen: torch.Generator) -> list[int]:
    """A random order of ``n`` batches (from ``gen``), to pop from its end."""
    return torch.randperm(n, generator=gen).tolist()


def split_batches(data: Any, validation: Any, opts: LearnedOptions) -> tuple[list[Any], list[Any], bool]:
    """(train batches, validation batches, whether validation was held out of train).
    Without validation data, the last tenth of the train examples (at least one) is held
    out, cutting a batch where needed."""
    batches = list(getattr(data, "batches", None) or [])
    if not batches:
        raise SymspecInputError("learned matching: the data has no batches to learn on")
    val = list(getattr(validation, "batches", None) or [])
    held_out = False
    if not val:
        sizes = [batch_len(t) for _, t in batches]
        total = sum(sizes)
        if total < 2:
            raise SymspecInputError("learned matching needs validation data, or at least 2 train examples to hold one out")
        keep = total - max(1, total // 10)  # examples left to train on
        train: list[Any] = []
        for (inputs, targets), n in zip(batches, sizes):
            take = min(n, keep)
            if take == n:
                train.append((inputs, targets))
            else:
                if take > 0:
                    train.append((_rows(inputs, 0, take), _rows(targets, 0, take)))
                val.append((_rows(inputs, take, n), _rows(targets, take, n)))
            keep -= take
        batches, held_out = train, True
    if opts.val_batches is not None:
        val = val[: opts.val_batches]
    return _rebatch(batches, opts.batch_size), val, held_out
