"""``symspec.align(a, b, spec, method=...)``: align model B to model A with any registered method.

>>> import symspec  # doctest: +SKIP
>>> res = symspec.align(model_a, model_b, "nanogpt", method="weight")  # doctest: +SKIP
>>> res.history  # the method's objective before the first round, then after each  # doctest: +SKIP
>>> merged = res.interpolate(0.5)  # doctest: +SKIP
>>> res.canonical_model.load_state_dict(merged)  # doctest: +SKIP

The pipeline is the same for every method: both models are bound to the spec and checked
(finite weights, one problem), brought into canonical form (norm gains folded, residual
writers mean-centred, ...; skipped by methods that work on the raw weights), the searched
groups are restricted (``groups``), the method finds one element per space, and B is
transformed by them. The result keeps the architecture: ``aligned_b`` loads into
``canonical_model`` (a copy of A's class in canonical form), as does any interpolation.
"""

from __future__ import annotations

import copy
import itertools
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import attrs
import torch

from ..binding import BoundSpec, bind
from ..errors import SymspecInputError
from ..groups import Element
from ..record import TransformRecord
from ..solvers import Timer, embed, parse_restriction, restrict_problem
from ..spec.model import Spec
from ..statedict import (
    check_finite,
    detached_state,
    element_to_cpu,
    interpolate_state_dicts,
    narrow_like,
    squared_distance,
    widen,
    working_dtype,
)
from ..transforms import apply_elements, canonicalize_state_dict
from ..transforms.canonical import canonicalize_structure
from .protocol import Alignment, AlignOptions, Endpoint, Method
from .registry import get_method

ModelLike = torch.nn.Module | Mapping[str, torch.Tensor]


@attrs.define
class AlignResult:
    """What :func:`align` found.

    ``method``: the registered name of the method used. ``canonical_a`` and
    ``canonical_b``: both state dicts in canonical form (as they are, for a method that
    works on raw weights); ``aligned_b``: canonical B transformed by ``elements`` (one
    element per space, in the spec's groups); ``record``: the same as a
    :class:`~symspec.record.TransformRecord`; ``history``: the method's objective before
    the first round and after each; ``timings``: seconds per phase; ``canonical_model``:
    A's module in canonical form (same class), into which ``canonical_a``, ``aligned_b``
    and their interpolations load; None for state-dict inputs.
    """

    bound: BoundSpec
    canonical_a: dict[str, torch.Tensor]
    #: None when ``align(keep_canonical_b=False)`` (B's copy became the aligned one)
    canonical_b: dict[str, torch.Tensor] | None
    aligned_b: dict[str, torch.Tensor]
    elements: dict[str, Element]
    record: TransformRecord
    history: list[float]
    timings: dict[str, float]
    converged: bool
    searched: dict[str, str]
    model_a: torch.nn.Module | None = attrs.field(default=None, repr=False)
    method: str = "weight"
    info: dict[str, Any] = attrs.field(factory=dict)
    #: the squared weight distance of canonical A and B, measured before the method ran
    #: (what ``distance("canonical")`` returns when canonical B was not kept)
    canonical_distance: float | None = None
    _canonical_model: torch.nn.Module | None = attrs.field(default=None, init=False, repr=False)

    @property
    def spec(self) -> Spec:
        return self.bound.spec

    @property
    def canonical_model(self) -> torch.nn.Module | None:
        """A's module in canonical form (a copy of the same class; built on first use, so
        that callers who only need the weights do not pay for it). None for state dicts."""
        if self._canonical_model is None and self.model_a is not None:
            self._canonical_model = canonical_module(self.bound, self.model_a, self.canonical_a,
                                                     canonical=get_method(self.method).canonical or "lift" in self.info)
        return self._canonical_model

    def distance(self, which: str = "aligned") -> float:
        """Squared weight distance over the bound parameters between canonical A and
        canonical B (``which="canonical"``) or aligned B (``"aligned"``)."""
        if which == "canonical" and self.canonical_b is None:
            if self.canonical_distance is not None:
                return self.canonical_distance  # measured before B was consumed
            raise SymspecInputError("canonical B was not kept (align(keep_canonical_b=False))")
        other = self.aligned_b if which == "aligned" else self.canonical_b
        assert other is not None
        return weight_distance(self.bound, self.canonical_a, other)

    def certify(self, *, per_space: bool = True, joint: bool = True, joint_limit: int | None = None,
                gram_limit: int | None = None) -> Any:
        """Lower bounds on the objective's minimum over the searched groups, and this
        result's gaps to them (:func:`symspec.certify.certify`): the global
        decoupled bound (not available when a searched group is not norm-preserving), per
        space given the others (``per_space``) and a joint bound (``joint``: exact over
        spaces that share no parameter, a Shor SDP relaxation over those that do, on small
        sizes: each interacting group's lifted size at most ``joint_limit``, default
        :data:`~symspec.certify.joint.JOINT_LIMIT`; a Gram SDP relaxation over a
        star-shaped group, such as the residual with the spaces that read and write it, of
        size at most ``gram_limit``, default
        :data:`~symspec.certify.joint.GRAM_LIMIT`). A B lifted into A's widths is
        certified as lifted (the lift is not part of the group; the reason says so).
        Needs canonical B (``align(keep_canonical_b=True)``, the default)."""
        from ..certify.certificate import GRAM_LIMIT, JOINT_LIMIT, certify
        from ..groups import parse

        if not get_method(self.method).canonical:
            raise SymspecInputError(no_certificate(self.method))
        if self.canonical_b is None:
            raise SymspecInputError("a certificate needs canonical B: align(keep_canonical_b=True)")
        problem = self.bound.problem
        spaces = {n: attrs.evolve(si, group=parse(self.searched[n])) if n in self.searched else si
                  for n, si in problem.spaces.items()}
        searched = attrs.evolve(problem, spaces=spaces)
        return certify(problem, self.canonical_a, self.canonical_b, self.aligned_b, searched, self.elements,
                       per_space=per_space, joint=joint, joint_limit=JOINT_LIMIT if joint_limit is None else joint_limit,
                       gram_limit=GRAM_LIMIT if gram_limit is None else gram_limit, lift=self.info.get("lift"))

    def interpolate(self, alpha: float, *, align: bool = True) -> dict[str, torch.Tensor]:
        """``(1 - alpha) A + alpha B`` (aligned B unless ``align=False``), canonical form."""
        other = self.aligned_b if align else self.canonical_b
        if other is None:
            raise SymspecInputError("canonical B was not kept (align(keep_canonical_b=False))")
        return interpolate_state_dicts(self.canonical_a, other, alpha)

    def summary(self) -> dict[str, Any]:
        """A JSON-able report: method, objective per round, time per phase, groups searched."""
        h0 = self.history[0] if self.history else 0.0
        return {
            "method": self.method,
            "spec": self.spec.name,
            "rounds": max(len(self.history) - 1, 0),
            "converged": self.converged,
            "objective": self.history,
            "relative_objective": [h / h0 if h0 else 0.0 for h in self.history],
            "searched": self.searched,
            "timings": self.timings,
            **({"info": self.info} if self.info else {}),
        }


def no_certificate(method: str) -> str:
    """Why a method's result has no certificate: it searched no group (vanilla averaging
    works on the raw weights, not on the canonical forms the spec's groups act on, so
    the objective the bounds are about was never its objective)."""
    return (f"--method {method} aligns nothing (it averages the raw weights, not the canonical forms the spec's "
            "groups act on): there is no alignment to certify; use --certify with a method that aligns, "
            "e.g. --method weight")


def weight_distance(bound: BoundSpec, a: Mapping[str, torch.Tensor], b: Mapping[str, torch.Tensor]) -> float:
    """sum over the bound parameters of ||a - b||^2 (float64 accumulation)."""
    return squared_distance(a, b, bound.problem.params)


def check_same_problem(ba: BoundSpec, bb: BoundSpec) -> None:
    """Two bindings of one spec that must describe the same problem (same spaces, groups
    and parameter shapes)."""
    problems = ba.problem.differences(bb.problem, "in A", "in B")
    if problems:
        more = f" (and {len(problems) - 5} more)" if len(problems) > 5 else ""
        raise SymspecInputError(f"A and B do not fit one spec '{ba.spec.name}': " + "; ".join(problems[:5]) + more)


def _resolve_spec(spec: Spec | BoundSpec | str | Path) -> Spec | BoundSpec:
    if isinstance(spec, (Spec, BoundSpec)):
        return spec
    from ..spec import load_spec

    return load_spec(spec)


@attrs.define
class _Pair:
    """The two models on their way through the pipeline."""

    bound_a: BoundSpec
    bound_b: BoundSpec
    raw_a: dict[str, torch.Tensor]
    raw_b: dict[str, torch.Tensor]
    a: dict[str, torch.Tensor] = attrs.field(factory=dict)
    b: dict[str, torch.Tensor] = attrs.field(factory=dict)


def _bind_and_check(model_a: ModelLike, model_b: ModelLike, spec: Spec | BoundSpec | str | Path,
                    config: Any, timer: Timer) -> _Pair:
    with timer("bind"):
        spec_obj = _resolve_spec(spec)
        bound_a = spec_obj if isinstance(spec_obj, BoundSpec) else bind(spec_obj, model_a, config=config)
        bound_b = bind(bound_a.spec, model_b, config=config)
        check_same_problem(bound_a, bound_b)
    pair = _Pair(bound_a, bound_b, detached_state(model_a), detached_state(model_b))
    with timer("check"):
        check_finite(pair.raw_a, "A")
        check_finite(pair.raw_b, "B")
    return pair


def _canonicalize(pair: _Pair, method: Method, timer: Timer, force: bool = False) -> None:
    """Both models in canonical form, float16/bfloat16 widened to float32 (they come back
    in their own dtype); a method that works on raw weights gets them widened only (unless
    ``force``: B was lifted, and a lift writes canonical form)."""
    wa, wb = widen(pair.raw_a), widen(pair.raw_b)
    if not method.canonical and not force:
        pair.a, pair.b = wa, wb
        return
    with timer("canonicalize"):
        pair.a = canonicalize_state_dict(pair.bound_a, wa)
        pair.b = canonicalize_state_dict(pair.bound_b, wb)
    with timer("check"):
        # the entries canonicalisation rewrote (a finite model can overflow when folded)
        check_finite({k: v for k, v in pair.a.items() if v is not wa.get(k)}, "A (canonical form)")
        check_finite({k: v for k, v in pair.b.items() if v is not wb.get(k)}, "B (canonical form)")


def _endpoints(pair: _Pair, method: Method, model_a: ModelLike, model_b: ModelLike) -> tuple[Endpoint, Endpoint]:
    if not method.needs_module:
        return Endpoint(pair.a), Endpoint(pair.b)
    if not isinstance(model_a, torch.nn.Module) or not isinstance(model_b, torch.nn.Module):
        raise SymspecInputError(f"the method '{method.name}' runs the models: pass modules, not state dicts")
    return (Endpoint(pair.a, canonical_module(pair.bound_a, model_a, pair.a, canonical=method.canonical)),
            Endpoint(pair.b, canonical_module(pair.bound_b, model_b, pair.b, canonical=method.canonical)))


def _transform_b(pair: _Pair, found: Alignment, elements: Mapping[str, Element]) -> dict[str, torch.Tensor]:
    """B transformed by ``elements``: from the tensors the method already transformed when
    it did (one per tie), else by applying the elements to canonical B."""
    problem = pair.bound_a.problem
    if found.aligned is None:
        return apply_elements(problem, {s: element_to_cpu(e) for s, e in elements.items()}, pair.b)
    aligned = dict(pair.b)  # what is left: the entries no space acts on
    tie_of = {n: g for g in problem.ties for n in g}
    for name in problem.params:
        rep = next(n for n in tie_of.get(name, (name,)) if n in found.aligned)
        aligned[name] = found.aligned[rep].to(device=pair.raw_b[name].device, dtype=pair.raw_b[name].dtype)
    found.aligned = None
    return aligned


def _record(bound: BoundSpec, method: Method, elements: Mapping[str, Element], searched: Mapping[str, str],
            found: Alignment, modes: Mapping[str, str], work_dtype: torch.dtype) -> TransformRecord:
    meta = {"method": method.name, "objective": found.history, "rounds": max(len(found.history) - 1, 0),
            "converged": found.converged, "groups": mode_text(modes),
            "dtype": str(work_dtype).removeprefix("torch."), **found.info}
    return TransformRecord.of(bound, elements, canonical=method.canonical, searched=searched, meta=meta)


def align(model_a: ModelLike, model_b: ModelLike, spec: Spec | BoundSpec | str | Path, *,
          method: str | Method = "weight", groups: str | Mapping[str, str] | None = None, rounds: int = 10,
          tol: float = 1e-6, device: str | torch.device = "cpu", dtype: torch.dtype | None = None,
          data: Any = None, validation: Any = None, progress: Any = None, config: Any = None,
          keep_canonical_b: bool = True, options: Any = None, lift: str = "fitted", lift_seed: int = 0,
          lift_free: int = 0, lift_free_lambda: str = "uniform") -> AlignResult:
    """Align ``model_b`` to ``model_a`` under ``spec`` with a registered ``method``
    (:func:`symspec.alignment.method_names`; ``"weight"``: weight matching, data-free).

    ``model_a``/``model_b``: modules (or state dicts, with ``config`` for the spec's
    dimensions). ``spec``: a Spec, a BoundSpec (of A), a path or a built-in name.
    ``groups``: restrict the search, ``"perm"`` (permutations only, the paper's ablation),
    ``"full"``, or per declared space, ``"perm,attn=full"`` (:mod:`symspec.solvers.engine.restrict`);
    default: the method's own (``"full"`` for most). ``rounds``/``tol``: at most ``rounds``
    rounds, fewer once a round gains less than ``tol`` (relative). ``device``: where the
    dense work runs. ``dtype``: the working precision (default: A's; float32 for float16
    and bfloat16 weights; the state dicts returned keep every input's dtype). ``data``:
    evaluation data for the methods that need it (a train split); ``validation``: held-out
    data for the methods that pick a step (learned matching; None: they hold out part of
    ``data``). ``progress``: called with a
    :class:`~symspec.solvers.MatchEvent` after every solved space and round.
    ``keep_canonical_b=False`` saves one copy of B where the method can work in place
    (``canonical_b`` is then None). ``options``: the method's own knobs (for weight
    matching a :class:`~symspec.solvers.WeightOptions`). Inputs are never modified.

    Models of different widths (modules only; the same depth, B no wider than A in any
    space): B is first lifted into A's shape without changing its function
    (:mod:`symspec.width`), with maps fitted to A's weights (``lift="fitted"``), fitted
    to A's activations on ``data`` (``lift="activation"``: the methods that take data) or
    drawn at random (``lift="random"``, seed ``lift_seed``); ``info["lift"]`` says what was
    lifted, and ``aligned_b`` has A's shapes. ``lift_free``: steps of training the lift's
    free directions (the readers' weights on what B's residual stream never holds) for
    the interpolated model's loss on ``data``, after the alignment, lambda drawn by
    ``lift_free_lambda`` (:func:`symspec.width.free.learn_free`; 0: off, the default).
    """
    m = method if isinstance(method, Method) else get_method(method)
    if data is not None and isinstance(model_a, torch.nn.Module):
        from ..data import check_inputs

        # before any method runs it: data of the wrong kind (images for a GPT) is one line
        # naming the source and what the model reads, not a traceback from its embedding
        check_inputs(model_a, data, f"model A ({type(model_a).__name__})")
    lifted = None
    if isinstance(model_a, torch.nn.Module) and isinstance(model_b, torch.nn.Module):
        model_b, lifted = _lift_if_narrower(model_a, model_b, spec, lift, lift_seed, data)
    if m.needs_data and data is None:
        raise SymspecInputError(f"the method '{m.name}' needs data (pass data=, or --data on the command line)")
    if lift_free and data is None:
        raise SymspecInputError("lift_free trains the lift's free directions on data: pass data=")
    timer, t0 = Timer(), time.perf_counter()
    pair = _bind_and_check(model_a, model_b, spec, config, timer)
    _canonicalize(pair, m, timer, force=lifted is not None)  # a lifted B is in canonical form
    problem = pair.bound_a.problem
    modes = parse_restriction(groups if groups is not None else m.groups, problem)
    searched_problem = restrict_problem(problem, modes)
    ea, eb = _endpoints(pair, m, model_a, model_b)
    # the canonical distance, while canonical B is whole (a method may consume it); a method
    # whose first objective value is that distance says so and saves the pass over the weights
    known = getattr(m, "objective_is_distance", False)
    d0 = None if keep_canonical_b or known else weight_distance(pair.bound_a, pair.a, pair.b)
    work_dtype = dtype or working_dtype(next((pair.a[p].dtype for p in problem.params), torch.float64))
    opts = AlignOptions(rounds=rounds, tol=tol, device=device, dtype=dtype, data=data, validation=validation,
                        progress=progress, timer=timer, tuning=options, consume_b=not keep_canonical_b)
    found = m.align(searched_problem, ea, eb, opts)
    if known and not keep_canonical_b and found.history:
        d0 = found.history[0]
    elements = {s: embed(problem.spaces[s].group, searched_problem.spaces[s].group, e, work_dtype)
                for s, e in found.elements.items()}
    with timer("transform"):
        aligned = _transform_b(pair, found, elements)
    searched = {s: str(searched_problem.spaces[s].group) for s in problem.spaces}
    narrowed = {s: g for s, g in searched.items() if searched_problem.spaces[s].group != problem.spaces[s].group}
    record = _record(pair.bound_a, m, elements, narrowed, found, modes, work_dtype)
    cb = narrow_like(pair.b, pair.raw_b) if keep_canonical_b else None
    timings = timer.as_dict()
    timings["total"] = time.perf_counter() - t0
    info = dict(found.info)
    if lifted is not None:
        info["lift"] = lifted
        record.meta["lift"] = lifted
    result = AlignResult(pair.bound_a, narrow_like(pair.a, pair.raw_a), cb, narrow_like(aligned, pair.raw_b), elements,
                         record, found.history, timings, found.converged, searched,
                         model_a if isinstance(model_a, torch.nn.Module) else None, m.name, info, d0)
    if lift_free and lifted is None:
        result.info["lift_free"] = "not used: B has A's widths, nothing was lifted"
    elif lift_free:
        from ..width.free import learn_free

        t1 = time.perf_counter()
        result = learn_free(result, data, validation, steps=lift_free, device=device, lam=lift_free_lambda,
                            progress=progress)
        result.timings["lift_free"] = time.perf_counter() - t1
        result.record.meta["lift"] = result.info["lift"]
    return result


def _lift_if_narrower(model_a: torch.nn.Module, model_b: torch.nn.Module, spec: Spec | BoundSpec | str | Path,
                      how: str, seed: int, data: Any = None) -> tuple[torch.nn.Module, dict[str, Any] | None]:
    """B as it is when it has A's widths, else B lifted into A's shape (and what was lifted)."""
    from ..width import fitted_lift, lift_needed
    from ..width import lift as random_lift

    spec_obj = _resolve_spec(spec)
    plain = spec_obj.spec if isinstance(spec_obj, BoundSpec) else spec_obj
    if not lift_needed(plain, model_a, model_b):
        return model_b, None
    if how not in ("fitted", "activation", "random"):
        raise SymspecInputError(f"lift={how!r}: use 'fitted', 'activation' or 'random'")
    if how == "activation" and data is None:
        raise SymspecInputError("lift='activation' fits the lift on activations: it needs data (data=, with a method that takes it)")
    if how == "random":
        result = random_lift(model_b, model_a, plain, seed=seed)
    else:
        result = fitted_lift(model_b, model_a, plain, seed=seed, data=data if how == "activation" else None)
    return result.model, {"how": how, "seed": seed,
                          "spaces": {s.space: {"from": s.narrow, "to": s.wide, "kind": s.kind} for s in result.changed()}}


def canonical_module(bound: BoundSpec, model: torch.nn.Module, state: Mapping[str, torch.Tensor], *,
                     canonical: bool = True) -> torch.nn.Module:
    """A copy of ``model`` (same class) holding ``state`` (its canonical weights, or with
    ``canonical=False`` any weights of the model's own form): what
    :func:`~symspec.transforms.canonicalize_model` returns, without canonicalising again
    and without first copying the old weights."""
    memo: dict[int, Any] = {}
    # Fresh (uninitialised) storage only for what ``state`` overwrites: a buffer in no
    # state dict (rotary frequencies, Gemma's embedding scale) is copied as it is, else it
    # would stay uninitialised memory.
    written = {id(t) for k, t in model.state_dict(keep_vars=True).items() if k in state}
    for t in itertools.chain(model.parameters(), model.buffers()):
        if t.is_floating_point() and id(t) in written and id(t) not in memo:
            empty = torch.empty(t.shape, dtype=t.dtype, device=t.device)
            memo[id(t)] = torch.nn.Parameter(empty, requires_grad=t.requires_grad) if isinstance(t, torch.nn.Parameter) else empty
    out = copy.deepcopy(model, memo)
    if canonical:
        canonicalize_structure(bound, out)
    own = out.state_dict()
    out.load_state_dict({k: v for k, v in state.items() if k in own}, strict=False)
    return out.eval() if not model.training else out


def mode_text(modes: Mapping[str, str]) -> str:
    """The searched groups as one string: ``"full"``, ``"perm"`` or ``"perm,attn=full"``."""
    kinds = set(modes.values())
    if len(kinds) <= 1:
        return next(iter(kinds), "full")
    return ",".join(f"{s}={m}" for s, m in modes.items())
