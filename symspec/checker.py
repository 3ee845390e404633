"""``check``: do a spec's symmetries really preserve the model's function?

For the canonicalisation and for each declared space (all its instances at once), and
for all spaces together, sample random group elements, apply them to the canonical
weights, and compare the outputs with the canonical model's on the given inputs, in
float64 and in float32. A space whose row fails is drilled into per instance, so the
report names the failing layer.

Tolerances (relative to the largest output magnitude, max-norm): float64 1e-9,
float32 1e-4 (group elements are sampled with condition number <= 10; float32 loses
about one digit per decade of conditioning, DESIGN §6). Override with ``rtol``.

Float64 means float64 throughout: models that cast to float32 internally (Hugging
Face's RMSNorm, eager softmax) are run with those casts kept in float64
(:class:`symspec.precision.KeepFloat64`), and the report says where they were.

Memory: the check works on one float64 copy of the model, canonicalised and transformed
in place (plus a float32 mirror when float32 is checked); see ``_InPlace``.
"""

from __future__ import annotations

import contextlib
import copy
import itertools
import json
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import attrs
import torch

from .binding import BoundSpec, bind
from .canonical import CanonOp
from .errors import SymspecInputError, suggest
from .groups import Element
from .precision import KeepFloat64
from .problem import ParamBinding, Problem
from .progress import Step
from .spec.model import Spec
from .statedict import check_finite
from .transforms import inverse_elements, sample_elements, transform_tensor
from .transforms.apply import reversed_binding
from .transforms.canonicalize import canonicalize_structure

DEFAULT_RTOL: dict[str, float] = {"float64": 1e-9, "float32": 1e-4}
DTYPES = {"float64": torch.float64, "float32": torch.float32}


@attrs.frozen
class CheckRow:
    space: str
    group: str
    dtype: str
    samples: int
    max_abs: float
    max_rel: float
    rtol: float
    failing: tuple[str, ...] = ()

    @property
    def passed(self) -> bool:
        return math.isfinite(self.max_rel) and self.max_rel <= self.rtol


@attrs.define
class CheckReport:
    spec: str
    model: str
    rows: list[CheckRow]
    notes: list[str] = attrs.field(factory=list)

    @property
    def passed(self) -> bool:
        return all(r.passed for r in self.rows)

    def failed_rows(self) -> list[CheckRow]:
        return [r for r in self.rows if not r.passed]

    def to_dict(self) -> dict[str, Any]:
        return {
            "spec": self.spec,
            "model": self.model,
            "passed": self.passed,
            "rows": [
                {**attrs.asdict(r), "failing": list(r.failing), "passed": r.passed,
                 "max_abs": _num(r.max_abs), "max_rel": _num(r.max_rel)}
                for r in self.rows
            ],
            "notes": self.notes,
        }

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)

    def render(self) -> str:
        """A plain-text table (the CLI prints a rich one)."""
        head = f"{'space':<16} {'group':<34} {'dtype':<8} {'max abs':>10} {'max rel':>10} {'rtol':>8}  result"
        lines = [f"symspec check: spec '{self.spec}' on {self.model}", head, "-" * len(head)]
        for r in self.rows:
            res = "pass" if r.passed else "FAIL" + (f" ({', '.join(r.failing)})" if r.failing else "")
            lines.append(f"{r.space:<16} {r.group[:34]:<34} {r.dtype:<8} {r.max_abs:>10.2e} {r.max_rel:>10.2e} {r.rtol:>8.0e}  {res}")
        lines += self.notes
        lines.append("all passed" if self.passed else f"{len(self.failed_rows())} row(s) failed")
        return "\n".join(lines)


def _num(x: float) -> float | str:
    return x if math.isfinite(x) else str(x)


def flatten_outputs(out: Any) -> list[torch.Tensor]:
    """Floating-point tensors of a model output (tensor, tuple, dict, HF ModelOutput)."""
    if isinstance(out, torch.Tensor):
        return [out] if out.is_floating_point() else []
    if isinstance(out, Mapping):
        return [t for v in out.values() for t in flatten_outputs(v)]
    if isinstance(out, (tuple, list)):
        return [t for v in out for t in flatten_outputs(v)]
    return []


def _cast_inputs(inputs: Any, dtype: torch.dtype) -> Any:
    if isinstance(inputs, torch.Tensor):
        return inputs.to(dtype) if inputs.is_floating_point() else inputs
    if isinstance(inputs, Mapping):
        return {k: _cast_inputs(v, dtype) for k, v in inputs.items()}
    if isinstance(inputs, (tuple, list)):
        return type(inputs)(_cast_inputs(v, dtype) for v in inputs)
    return inputs


def compare(a: Sequence[torch.Tensor], b: Sequence[torch.Tensor]) -> tuple[float, float]:
    """(max |a - b|, that divided by max |a|) over all outputs."""
    if len(a) != len(b) or any(x.shape != y.shape for x, y in zip(a, b)):
        return math.inf, math.inf
    if not a:
        return 0.0, 0.0
    diff = max(float((x.double() - y.double()).abs().max()) if x.numel() else 0.0 for x, y in zip(a, b))
    scale = max(float(x.double().abs().max()) if x.numel() else 0.0 for x in a)
    if math.isnan(diff):
        return math.inf, math.inf
    return diff, diff / max(scale, 1e-30)


# -- working copies, canonicalised and transformed in place ---------------------------------------
#
# check() keeps one float64 copy of the model (plus a float32 one when float32 is checked)
# and moves its weights in place: each row applies sampled elements parameter by
# parameter, runs the model and undoes them (the inverse elements, applied in the reverse
# order of every factor chain; parameters bound with |rho| are restored from a copy, since
# |rho(g)|^-1 is |rho(g^-1)| only for monomial groups). Nothing holds a second full copy of
# the weights: a float64 check of a float32 model needs twice the model's size (more when
# the spec unties a tied head) plus about one parameter's worth of transient memory; the
# float32 mirror adds the model's size once more.


def copy_as(model: torch.nn.Module, dtype: torch.dtype) -> torch.nn.Module:
    """A deep copy of ``model`` (same class) whose floating-point parameters and buffers
    are ``dtype``, made without an intermediate copy in the model's own dtype; tied
    parameters stay tied."""
    memo: dict[int, Any] = {}
    with torch.no_grad():
        for t in itertools.chain(model.parameters(), model.buffers()):
            if id(t) in memo:
                continue
            new = t.detach().to(dtype=dtype, copy=True) if t.is_floating_point() else t.detach().clone()
            memo[id(t)] = torch.nn.Parameter(new, requires_grad=False) if isinstance(t, torch.nn.Parameter) else new
    return copy.deepcopy(model, memo).eval()


def _live(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Name -> the module's own floating-point parameter or buffer (tied names share one)."""
    return {k: v for k, v in module.state_dict(keep_vars=True).items() if isinstance(v, torch.Tensor) and v.is_floating_point()}


def canonicalize_inplace(bound: BoundSpec, module: torch.nn.Module) -> None:
    """Bring ``module`` into canonical form in place: the same steps as
    :func:`~symspec.transforms.canonicalize_model`, one step at a time, so that only the
    tensors one step rewrites exist twice."""
    canonicalize_structure(bound, module)
    live = _live(module)
    views = {k: v.detach() for k, v in live.items()}
    for op in _value_steps(bound.canonical):
        _step_saving(op, live, views, keep=False)


def _value_steps(ops: Sequence[CanonOp]) -> list[CanonOp]:
    """The ops that rewrite values (untie only restructures the module), each in the
    pieces it applies in (``center``: one writer at a time)."""
    return [piece for op in ops if op.impl.rewrites_values for piece in op.impl.pieces(op)]


def _step_saving(op: CanonOp, live: Mapping[str, torch.Tensor], views: Mapping[str, torch.Tensor],
                 keep: bool = True) -> dict[str, torch.Tensor]:
    """One canonicalisation step, its results copied into the module's own tensors; the
    old values of what it changed when ``keep``. (A function of its own, so that no
    rewritten tensor outlives the step.)"""
    sd = dict(views)
    op.impl.apply(op, sd)
    saved = {}
    with torch.no_grad():
        for name in [k for k, v in sd.items() if v is not views[k]]:
            if keep:
                saved[name] = views[name].clone()
            live[name].copy_(sd.pop(name))
    return saved


def locate_canonical_failure(model: torch.nn.Module, bound: BoundSpec, inputs: Any, dtype: str, rtol: float,
                             exact64: bool = True) -> tuple[tuple[str, ...], list[str]]:
    """Which canonicalisation steps change ``model``'s function: one label per failing
    step of the spec, naming the step and its norms (``canonicalize[1] fold_norm
    model.layers.{i}.input_layernorm.weight (all 2)``, or the concrete names when only some
    of its matches fail), and a note per failing step with its place in the spec.

    Each step alone must preserve the function whatever the weights are (a fold is an
    identity of the computation; centring one writer adds a multiple of the all-ones
    vector that every pre-LN reader removes), so a fresh copy is canonicalised one step
    at a time and each step's output is compared with the one before it: every wrong
    step is named, not only the first. A wrong step is retried in the step's other
    reading, if it has one (a fold with the other ``gain_offset``: does the norm
    multiply by (1 + weight)?)."""
    trial = _StepByStep(model, bound, inputs, dtype, exact64)
    bad, hints = trial.failing(rtol)
    total: dict[int, int] = {}
    for op in bound.canonical:
        if op.impl.rewrites_values:
            total[op.step] = total.get(op.step, 0) + 1
    failing: list[str] = []
    notes: list[str] = []
    for step, ops in bad.items():
        first = ops[0][0]
        where = f"canonicalize[{step}]" if step >= 0 else "canonicalize"
        names = [op.impl.subject(op) for op, _ in ops]
        shown = ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
        decl = bound.spec.canonicalize[step] if 0 <= step < len(bound.spec.canonicalize) else None
        declared = first.impl.declared_subject(decl) if decl is not None else None
        if declared is not None and len(ops) > 1 and len(ops) == total[step]:
            failing.append(f"{where} {first.kind} {declared} (all {len(ops)})")
        else:
            failing.append(f"{where} {first.kind} {shown}")
        note = (f"canonicalize: {first.loc}: {first.kind} of {shown} changes the function "
                f"({dtype} max rel err {max(r for _, r in ops):.2e} > {rtol:.0e})")
        if hints.get(step):
            note += f"; {hints[step]}"
        notes.append(note)
    if not failing:
        notes.append(f"canonicalize: no single step changes the function beyond rtol {rtol:.0e} in {dtype}; the steps fail together")
    return tuple(failing), notes


class _StepByStep:
    """A fresh copy of the model in one dtype, canonicalised one step at a time, with the
    output compared after each."""

    def __init__(self, model: torch.nn.Module, bound: BoundSpec, inputs: Any, dtype: str, exact64: bool) -> None:
        self.bound = bound
        self.inputs = inputs
        self.dt = DTYPES[dtype]
        self.work = copy_as(model, self.dt)
        self.keep = KeepFloat64(rewrite=exact64) if dtype == "float64" else None
        canonicalize_structure(bound, self.work)
        self.live = _live(self.work)
        self.views = {k: v.detach() for k, v in self.live.items()}

    def forward(self) -> list[torch.Tensor]:
        return _forward(self.work, self.inputs, self.dt, self.keep)

    def failing(self, rtol: float) -> tuple[dict[int, list[tuple[CanonOp, float]]], dict[int, str]]:
        """The ops that change the function, with their error, by the spec's step; and for
        each such step, what its other reading tells (see :meth:`alternative_hint`)."""
        before = self.forward()
        bad: dict[int, list[tuple[CanonOp, float]]] = {}
        hints: dict[int, str] = {}
        for op in self.bound.canonical:
            if not op.impl.rewrites_values:
                continue
            rel, prev, saved = 0.0, before, {}
            for piece in op.impl.pieces(op):  # as check() applies it
                saved = _step_saving(piece, self.live, self.views)
                after = self.forward()
                rel = max(rel, compare(before, after)[1])
                before = after
            if rel <= rtol:
                continue
            alternative = op.impl.alternative(op)
            if op.step not in bad and alternative is not None:
                hints[op.step] = self.alternative_hint(*alternative, saved, prev, rtol)
            bad.setdefault(op.step, []).append((op, rel))
        return bad, hints

    def alternative_hint(self, other: CanonOp, told: str, saved: Mapping[str, torch.Tensor],
                         before: Sequence[torch.Tensor], rtol: float) -> str:
        """``told`` if the other reading of the op that just ran preserves the function, else
        "". (The weights are left as the wrong op made them, so that later steps are judged
        as before.)"""
        wrong = {k: self.views[k].clone() for k in saved}
        with torch.no_grad():
            for k, v in saved.items():
                self.live[k].copy_(v)
            _step_saving(other, self.live, self.views)
            _, rel = compare(before, self.forward())
            for k, v in wrong.items():
                self.live[k].copy_(v)
        return told if rel <= rtol else ""


class _InPlace:
    """Applies group elements to a module's weights in place, and undoes them (LIFO)."""

    def __init__(self, problem: Problem, tensors: Mapping[str, torch.Tensor]) -> None:
        self.problem = problem
        self.tensors = tensors
        self._reversed: dict[str, ParamBinding] = {}

    def _targets(self, spaces: set[str]) -> list[tuple[str, ParamBinding]]:
        return [(n, b) for n, b in self.problem.params.items() if n in self.tensors and b.spaces() & spaces]

    @staticmethod
    def has_abs(binding: ParamBinding, spaces: set[str]) -> bool:
        return any(f.variance == "abs" and f.space in spaces for a in binding.axes for s in a.segments for f in s.factors)

    def apply(self, elements: Mapping[str, Element]) -> tuple[list[str], dict[str, torch.Tensor]]:
        """Act with ``elements``; returns the changed names and what undo() needs."""
        spaces = set(elements)
        changed: list[str] = []
        saved: dict[str, torch.Tensor] = {}
        seen: set[int] = set()
        with torch.no_grad():
            for name, binding in self._targets(spaces):
                t = self.tensors[name]
                changed.append(name)
                if id(t) in seen:  # a tied twin: one tensor, transformed once
                    continue
                seen.add(id(t))
                if self.has_abs(binding, spaces):
                    saved[name] = t.detach().clone()
                t.copy_(transform_tensor(self.problem, binding, t.detach(), elements))
        return changed, saved

    def undo(self, elements: Mapping[str, Element], token: tuple[list[str], dict[str, torch.Tensor]]) -> list[str]:
        changed, saved = token
        spaces = set(elements)
        inverse = inverse_elements(self.problem, elements)
        seen: set[int] = set()
        with torch.no_grad():
            for name, binding in self._targets(spaces):
                t = self.tensors[name]
                if id(t) in seen:
                    continue
                seen.add(id(t))
                if name in saved:
                    t.copy_(saved[name])
                    continue
                rev = self._reversed.get(name)
                if rev is None:
                    rev = self._reversed[name] = reversed_binding(binding)
                t.copy_(transform_tensor(self.problem, rev, t.detach(), inverse))
        return changed


def call_forward(module: torch.nn.Module, inputs: Any, mode: Any = None) -> Any:
    """``module`` on ``inputs`` without gradients: a dict is keyword inputs, a tuple the
    positional ones, anything else the one input."""
    if isinstance(inputs, Mapping):
        args: tuple[Any, ...] = ()
        kwargs = dict(inputs)
    else:
        args, kwargs = (inputs if isinstance(inputs, tuple) else (inputs,)), {}
    with torch.no_grad(), (mode if mode is not None else contextlib.nullcontext()):
        return module(*args, **kwargs)


def _forward(module: torch.nn.Module, inputs: Any, dtype: torch.dtype, mode: Any = None) -> list[torch.Tensor]:
    out = call_forward(module, _cast_inputs(inputs, dtype), mode)
    return [t.detach() for t in flatten_outputs(out)]


class _Models:
    """The float64 working copy and, when float32 is checked, a float32 mirror of it."""

    def __init__(self, model: torch.nn.Module, inputs: Any, dtypes: Sequence[str], exact64: bool) -> None:
        self.inputs = inputs
        self.work = copy_as(model, torch.float64)
        self.m32 = copy_as(model, torch.float32) if "float32" in dtypes else None
        self.keep = KeepFloat64(rewrite=exact64)
        self.dirty: set[str] = set()
        self.refresh()

    def refresh(self) -> None:
        self.t64 = _live(self.work)
        self.t32 = _live(self.m32) if self.m32 is not None else {}
        self.dirty = set(self.t32)

    def run(self, dt: str) -> list[torch.Tensor]:
        if dt == "float64":
            return _forward(self.work, self.inputs, torch.float64, self.keep)
        assert self.m32 is not None
        if self.dirty:
            with torch.no_grad():
                for name in self.dirty:
                    self.t32[name].copy_(self.t64[name])
            self.dirty.clear()
        return _forward(self.m32, self.inputs, torch.float32)

    def canonicalize(self, bound: BoundSpec) -> None:
        canonicalize_inplace(bound, self.work)
        if self.m32 is not None:  # its values come from the float64 copy
            canonicalize_structure(bound, self.m32)
        self.refresh()


class _Walk:
    """One space's elements, sample after sample, in place: g_1, then g_2 g_1^-1, ...

    Each step is a single action instead of an undo and an apply; spaces bound with
    |rho| anywhere are walked by undo and apply, since |rho| is not a representation.
    """

    def __init__(self, problem: Problem, mover: _InPlace, models: _Models, names: Sequence[str]) -> None:
        self.problem = problem
        self.mover = mover
        self.models = models
        self.direct = not any(mover.has_abs(problem.params[p], set(names)) for i in names for p in problem.params_of(i))
        self.current: dict[str, Element] = {}
        self.token: Any = None

    def to(self, target: dict[str, Element]) -> None:
        if self.current and self.direct:
            g = self.problem.spaces
            step = {i: g[i].group.compose(target[i], g[i].group.inverse(self.current[i])) for i in target}
            self.models.dirty.update(self.mover.apply(step)[0])
        else:
            self.home()
            self.token = self.mover.apply(target)
            self.models.dirty.update(self.token[0])
        self.current = target

    def home(self) -> None:
        """Back to the identity."""
        if self.current:
            changed = self.token[0] if self.token is not None else []
            self.models.dirty.update(self.mover.undo(self.current, (changed, self.token[1] if not self.direct else {})))
            self.current, self.token = {}, None


def _shares_chain(problem: Problem, names: set[str]) -> bool:
    """Do these space instances share a factor chain (one segment) with other spaces?"""
    for p in problem.params.values():
        for a in p.axes:
            for s in a.segments:
                here = {f.space for f in s.factors}
                if here & names and here - names:
                    return True
    return False


def check(model: torch.nn.Module, spec: Spec | BoundSpec, inputs: Any, *, samples: int = 3, seed: int = 0,
          dtypes: Sequence[str] = ("float64", "float32"), spaces: Sequence[str] | None = None,
          rtol: Mapping[str, float] | None = None, cond: float = 10.0,
          progress: Callable[[str], None] | None = None, exact64: bool = True, trace: bool = False,
          source: str | None = None) -> CheckReport:
    """Check that every declared symmetry of ``spec`` preserves ``model``'s function.

    ``inputs``: the positional inputs of ``model.forward`` (a tensor, a tuple) or a
    dict of keyword inputs. ``spaces``: restrict to these declared spaces.

    ``exact64``: during float64 runs, casts of float64 tensors to float32 inside the
    model (Hugging Face's RMSNorm, eager softmax) keep float64 (:mod:`symspec.precision`),
    and the report says where. With ``exact64=False`` they are only detected, and the
    float64 rows then use the float32 tolerance. ``model`` itself is never modified.

    ``trace``: also trace the model (:func:`symspec.graph.trace`) and say in a note how
    (or why not: the check itself needs no graph). A ``BoundSpec`` bound with
    ``trace=True`` gets the same note.

    ``progress(message)`` is called as each step starts; a message that can count is a
    :class:`~symspec.progress.Step` with ``done`` of ``total`` samples.

    A model that cannot be checked raises :class:`~symspec.errors.SymspecInputError`
    (naming ``source``, where the model came from, when given): NaN or inf weights, a
    forward that fails on ``inputs`` in a checked precision, an output without a
    floating-point tensor.
    """
    tol = {**DEFAULT_RTOL, **(rtol or {})}
    if samples < 1:
        raise ValueError(f"samples must be at least 1, got {samples}")
    for dt in dtypes:
        if dt not in DTYPES:
            raise ValueError(f"unknown dtype {dt!r}; use float64 or float32")
    say = progress or (lambda msg: None)
    if not isinstance(spec, BoundSpec):
        say("binding the spec")
    bound = spec if isinstance(spec, BoundSpec) else bind(spec, model, example_inputs=inputs, trace=trace)
    report = CheckReport(bound.spec.name, type(model).__name__, [])
    declared = _chosen_spaces(bound, spaces)
    if bound.graph is not None:
        report.notes.append(_graph_note(bound))
    # NaN or inf weights make every comparison meaningless (a table of failed rows):
    # bad input, not a failed check
    check_finite(model.state_dict(), source or type(model).__name__)
    say("copying the model")
    models = _Models(model, inputs, dtypes, exact64)
    ref = _reference_outputs(models, dtypes, f"{source}: " if source else "")
    casts = models.keep.summary() if models.keep.count else ""  # one forward pass's worth
    say("canonicalising")
    models.canonicalize(bound)
    canon_out = {dt: models.run(dt) for dt in dtypes}
    if casts:
        report.notes.append(_casts_note(casts, exact64, tol))
    if bound.canonical:
        rows, notes = _canonical_rows(model, bound, inputs, ref, canon_out, tol, exact64, say)
        report.notes.extend(notes)
        report.rows.extend(rows)
    del ref
    run = _SpaceRun(bound.problem, models, dtypes, tol, canon_out, say, samples=samples, seed=seed, cond=cond)
    report.rows.extend(run.rows(declared))
    return report


def _chosen_spaces(bound: BoundSpec, spaces: Sequence[str] | None) -> list[str]:
    """The declared spaces to check: all, or those asked for (which must exist)."""
    declared = bound.problem.declared_spaces()
    if spaces is None:
        return declared
    unknown = [s for s in spaces if s not in declared]
    if unknown:
        hint = suggest(unknown[0], declared)
        raise SymspecInputError(f"no space '{unknown[0]}' in spec '{bound.spec.name}'" + (f"; {hint}" if hint else f"; spaces: {', '.join(declared)}"))
    return [s for s in declared if s in spaces]


def _reference_outputs(models: _Models, dtypes: Sequence[str], where: str) -> dict[str, list[torch.Tensor]]:
    """The model's outputs before any change, per dtype; a model that cannot run the
    inputs, or returns nothing to compare, is bad input."""
    ref = {}
    for dt in dtypes:
        try:
            ref[dt] = models.run(dt)
        except Exception as e:
            # the reference forward, before any transform: the model cannot run these
            # inputs in this precision (a dtype it hard-codes, inputs of the wrong shape)
            lines = str(e).strip().splitlines()
            raise SymspecInputError(f"{where}the model's forward failed in {dt} on the example inputs: {type(e).__name__}"
                                    + (f": {lines[0][:300]}" if lines else "")
                                    + ("; a model that cannot run in float64 can be checked in float32 only" if dt == "float64" else "")) from e
        if not ref[dt]:
            raise SymspecInputError(f"{where}the model's output holds no floating-point tensor: there is nothing to compare "
                                    "(forward must return a tensor, or a tuple, dict or model output of tensors)")
    return ref


def _casts_note(casts: str, exact64: bool, tol: dict[str, float]) -> str:
    """What the report says of a model that casts to float32 inside; without ``exact64``
    the float64 rows get the float32 tolerance (``tol`` is updated)."""
    if exact64:
        return (f"float64: the model casts float64 to float32 internally (per forward pass: {casts}); "
                "this check kept those casts in float64")
    tol["float64"] = max(tol["float64"], tol.get("float32", DEFAULT_RTOL["float32"]))
    return (f"float64: the model computes parts in float32 (per forward pass: {casts}); "
            f"float64 rows use rtol {tol['float64']:.0e}")


def _canonical_rows(model: torch.nn.Module, bound: BoundSpec, inputs: Any, ref: Mapping[str, list[torch.Tensor]],
                    canon_out: Mapping[str, list[torch.Tensor]], tol: Mapping[str, float], exact64: bool,
                    say: Callable[[str], None]) -> tuple[list[CheckRow], list[str]]:
    """The canonicalize row per dtype, and where it fails, the failing steps and notes."""
    kinds = ", ".join(dict.fromkeys(op.kind for op in bound.canonical))
    rows = [CheckRow("canonicalize", kinds, dt, 1, *compare(ref[dt], canon_out[dt]), tol[dt]) for dt in ref]
    bad = [r.dtype for r in rows if not r.passed]
    if not bad:
        return rows, []
    say("locating the failing canonicalisation step")
    failing, notes = locate_canonical_failure(model, bound, inputs, bad[0], tol[bad[0]], exact64)
    return [attrs.evolve(r, failing=failing) if not r.passed else r for r in rows], notes


class _SpaceRun:
    """The rows of the declared spaces: sampled elements applied to the canonical weights
    in place, keeping the worst deviation from the canonical outputs per space and dtype."""

    def __init__(self, problem: Problem, models: _Models, dtypes: Sequence[str], tol: Mapping[str, float],
                 canon_out: Mapping[str, list[torch.Tensor]], say: Callable[[str], None], *,
                 samples: int, seed: int, cond: float) -> None:
        self.problem = problem
        self.models = models
        self.dtypes = dtypes
        self.tol = tol
        self.canon_out = canon_out
        self.say = say
        self.samples, self.seed, self.cond = samples, seed, cond
        self.mover = _InPlace(problem, models.t64)
        self.worst: dict[str, dict[str, tuple[float, float]]] = {}

    def record(self, label: str) -> None:
        """Run the model as it stands and keep the worst deviation per dtype."""
        for dt in self.dtypes:
            a, r = compare(self.canon_out[dt], self.models.run(dt))
            w = self.worst.setdefault(label, {}).get(dt)
            if w is None or r > w[1] or not math.isfinite(r):
                self.worst[label][dt] = (a, r)

    def measure(self, label: str, elements: Mapping[str, Element]) -> None:
        """Apply ``elements``, record, undo."""
        token = self.mover.apply(elements)
        self.models.dirty.update(token[0])
        self.record(label)
        self.models.dirty.update(self.mover.undo(elements, token))

    def sample(self, insts: Sequence[str], seed: int) -> dict[str, Element]:
        return sample_elements(self.problem, list(insts), seed=seed, cond=self.cond)

    def rows(self, declared: Sequence[str]) -> list[CheckRow]:
        insts = {d: self.problem.instances_of(d) for d in declared}
        all_insts = [i for d in declared for i in insts[d]]
        want_all = len(declared) > 1 or (bool(declared) and len(all_insts) > 1)
        pivot_walk = self.sample_all(declared, insts, want_all)
        rows = []
        for d in declared:
            rows += self.space_rows(d, insts[d], pivot_walk)
        if want_all:
            rows += [CheckRow("all", f"{len(all_insts)} spaces", dt, self.samples, *self.worst["all"][dt], self.tol[dt]) for dt in self.dtypes]
        return rows

    def sample_all(self, declared: Sequence[str], insts: Mapping[str, list[str]], want_all: bool) -> _Walk | None:
        """Every space's samples, and all spaces' together; the walk of the pivot space,
        whose last element is still applied (None without a pivot).

        The costliest space (the residual: its elements move the embeddings and every
        layer) acts once per sample: each sample's element is reached from the previous
        one's by a single action (g_k g_{k-1}^-1) and serves both its own row and, with
        every other space on top, the 'all' row. The other spaces' rows run first, with
        the costliest one at the identity; the last element is undone only if a failure
        has to be located afterwards."""
        problem = self.problem
        all_insts = [i for d in declared for i in insts[d]]
        cost = {d: sum(math.prod(problem.params[p].shape) for i in insts[d] for p in problem.params_of(i)) for d in declared}
        pivot = max(declared, key=lambda d: cost[d]) if len(declared) > 1 else None
        if pivot is not None and _shares_chain(problem, set(insts[pivot])):
            pivot = None  # its chains mix with other spaces': 'all' must be applied at once
        drawn = [self.sample(all_insts, self.seed * 1000 + k) for k in range(self.samples)]
        rest = [d for d in declared if d != pivot]
        # the steps below, counted for the progress messages: one per sample of each space
        total = self.samples * (len(rest) + (pivot is not None or want_all))
        steps = itertools.count()
        for d in rest:
            walk = _Walk(problem, self.mover, self.models, insts[d])
            for k, elems in enumerate(drawn):
                self.say(Step(f"sample {k + 1}/{self.samples}: {d}", next(steps), total))
                walk.to({i: elems[i] for i in insts[d]})
                self.record(d)
            walk.home()
        if want_all and pivot is None:
            for k, elems in enumerate(drawn):
                self.say(Step(f"sample {k + 1}/{self.samples}: all spaces together", next(steps), total))
                self.measure("all", elems if len(declared) > 1 else self.sample(all_insts, self.seed * 1000 + 500 + k))
        if pivot is None:
            return None
        pivot_walk = _Walk(problem, self.mover, self.models, insts[pivot])
        for k, elems in enumerate(drawn):
            self.say(Step(f"sample {k + 1}/{self.samples}: {pivot}, then all spaces together", next(steps), total))
            pivot_walk.to({i: elems[i] for i in insts[pivot]})
            self.record(pivot)
            self.measure("all", {i: elems[i] for d in rest for i in insts[d]})
        return pivot_walk

    def space_rows(self, d: str, insts: Sequence[str], pivot_walk: _Walk | None) -> list[CheckRow]:
        """The rows of one declared space; when they fail and it has several instances,
        each instance is checked alone to name the failing ones."""
        problem = self.problem
        label = d if len(insts) == 1 and problem.spaces[insts[0]].index is None else f"{d}[*]"
        groups = sorted({str(problem.spaces[i].group) for i in insts})
        rows = [CheckRow(label, " | ".join(groups), dt, self.samples, *self.worst[d][dt], self.tol[dt]) for dt in self.dtypes]
        if len(insts) <= 1 or all(r.passed for r in rows):
            return rows
        if pivot_walk is not None:
            pivot_walk.home()
        failing = []
        for n, inst in enumerate(insts):
            self.say(Step(f"locating the failure: {inst}", n, len(insts)))
            self.worst.pop(inst, None)
            self.measure(inst, self.sample([inst], self.seed * 1000))
            if any(not CheckRow(inst, "", dt, 1, *self.worst[inst][dt], self.tol[dt]).passed for dt in self.dtypes):
                failing.append(inst)
        return [attrs.evolve(r, failing=tuple(failing)) if not r.passed else r for r in rows]


def _graph_note(bound: BoundSpec) -> str:
    g = bound.graph
    if not g.traced:
        return f"graph: not traced ({g.reason}); bound by parameter names only, graph features (activation sites) are off"
    n = sum(len(v) for v in g.sites.values())
    return f"graph: traced with {g.method}; {n} activation site(s) in {len(g.sites)} space(s)"
