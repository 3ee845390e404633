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

from .binding import BoundSpec, CanonOp, bind
from .groups import Element
from .precision import KeepFloat64
from .problem import ParamBinding, Problem
from .spec.model import Spec
from .transforms import inverse_elements, sample_elements, transform_tensor
from .transforms.canonical import STEP_IMPLS, untie_module

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
    for op in bound.canonical:
        if op.kind == "untie":
            untie_module(module, op.args["param"])
    live = _live(module)
    views = {k: v.detach() for k, v in live.items()}
    for op in _one_writer_at_a_time(bound.canonical):
        if op.kind != "untie":  # done on the module above
            _step_inplace(op, live, views)


def _step_inplace(op: CanonOp, live: Mapping[str, torch.Tensor], views: Mapping[str, torch.Tensor]) -> None:
    """One canonicalisation step, its results copied into the module's own tensors (a
    function of its own, so that no rewritten tensor outlives the step)."""
    sd = dict(views)
    STEP_IMPLS[op.kind](op, sd)
    with torch.no_grad():
        for name in [k for k, v in sd.items() if v is not views[k]]:
            live[name].copy_(sd.pop(name))


def _op_subject(op: CanonOp) -> str:
    """What one concrete canonicalisation step acts on: the norm, the writer, the param."""
    if op.kind == "fold_norm":
        return str(op.args["gain"])
    if op.kind == "center":
        return ", ".join(w["param"] for w in op.args["writers"])
    return str(op.args.get("param", ""))


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
    step is named, not only the first. A wrong fold is retried with the other
    ``gain_offset`` (1 instead of none, or none instead of 1) to say whether the norm
    multiplies by (1 + weight)."""
    dt = DTYPES[dtype]
    work = copy_as(model, dt)
    keep = KeepFloat64(rewrite=exact64) if dtype == "float64" else None
    for op in bound.canonical:
        if op.kind == "untie":
            untie_module(work, op.args["param"])
    live = _live(work)
    views = {k: v.detach() for k, v in live.items()}
    before = _forward(work, inputs, dt, keep)
    total: dict[int, int] = {}
    bad: dict[int, list[tuple[CanonOp, float]]] = {}
    hints: dict[int, str] = {}
    for op in bound.canonical:
        if op.kind != "untie":
            total[op.step] = total.get(op.step, 0) + 1
    for op in bound.canonical:
        if op.kind == "untie":
            continue
        rel, prev = 0.0, before
        for part in _one_writer_at_a_time([op]):  # a centred writer at a time, as check() does
            saved = _step_saving(part, live, views)
            after = _forward(work, inputs, dt, keep)
            rel = max(rel, compare(before, after)[1])
            before = after
        if rel <= rtol:
            continue
        if op.step not in bad and op.kind == "fold_norm":
            hints[op.step] = _offset_hint(op, live, views, saved, work, inputs, dt, keep, prev, rtol)
        bad.setdefault(op.step, []).append((op, rel))
    failing: list[str] = []
    notes: list[str] = []
    for step, ops in bad.items():
        first = ops[0][0]
        where = f"canonicalize[{step}]" if step >= 0 else "canonicalize"
        names = [_op_subject(op) for op, _ in ops]
        shown = ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
        decl = bound.spec.canonicalize[step] if 0 <= step < len(bound.spec.canonicalize) else None
        if first.kind == "fold_norm" and len(ops) > 1 and len(ops) == total[step] and decl is not None:
            failing.append(f"{where} {first.kind} {decl.arg('gain')} (all {len(ops)})")
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


def _step_saving(op: CanonOp, live: Mapping[str, torch.Tensor], views: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """:func:`_step_inplace` that returns the old values of what it changed."""
    sd = dict(views)
    STEP_IMPLS[op.kind](op, sd)
    saved = {}
    with torch.no_grad():
        for name in [k for k, v in sd.items() if v is not views[k]]:
            saved[name] = views[name].clone()
            live[name].copy_(sd.pop(name))
    return saved


def _offset_hint(op: CanonOp, live: Mapping[str, torch.Tensor], views: Mapping[str, torch.Tensor], saved: Mapping[str, torch.Tensor],
                 work: torch.nn.Module, inputs: Any, dt: torch.dtype, keep: Any, before: Sequence[torch.Tensor], rtol: float) -> str:
    """Does the fold preserve the function with the other gain_offset? (The weights are
    left as the wrong fold made them, so that later steps are judged as before.)"""
    offset = op.args.get("gain_offset", 0)
    other = 0 if offset else 1
    wrong = {k: views[k].clone() for k in saved}
    with torch.no_grad():
        for k, v in saved.items():
            live[k].copy_(v)
        _step_saving(attrs.evolve(op, args={**op.args, "gain_offset": other}), live, views)
        _, rel = compare(before, _forward(work, inputs, dt, keep))
        for k, v in wrong.items():
            live[k].copy_(v)
    if not rel <= rtol:
        return ""
    if other:
        return f"with 'gain_offset: {other}' it preserves the function: the norm multiplies by ({other} + weight)"
    return "without gain_offset it preserves the function: the norm multiplies by its weight itself"


def _one_writer_at_a_time(ops: Sequence[CanonOp]) -> list[CanonOp]:
    """``center`` centres each writer on its own: split it, so that only one writer's
    centred copy (the embedding, for a language model) exists at a time."""
    out: list[CanonOp] = []
    for op in ops:
        if op.kind == "center":
            out += [attrs.evolve(op, args={**op.args, "writers": [w]}) for w in op.args["writers"]]
        else:
            out.append(op)
    return out


def _reversed_chains(binding: ParamBinding) -> ParamBinding:
    """The binding whose factor chains run backwards: with inverse elements, it undoes
    ``binding`` ((A B)^-1 = B^-1 A^-1)."""
    axes = tuple(attrs.evolve(ab, segments=tuple(attrs.evolve(s, factors=s.factors[::-1]) for s in ab.segments)) for ab in binding.axes)
    return attrs.evolve(binding, axes=axes)


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
                    rev = self._reversed[name] = _reversed_chains(binding)
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
        if self.m32 is not None:
            for op in bound.canonical:
                if op.kind == "untie":
                    untie_module(self.m32, op.args["param"])
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
    bound = spec if isinstance(spec, BoundSpec) else bind(spec, model, example_inputs=inputs, trace=trace)
    problem = bound.problem
    say = progress or (lambda msg: None)
    report = CheckReport(bound.spec.name, type(model).__name__, [])

    declared = problem.declared_spaces()
    if spaces is not None:
        unknown = [s for s in spaces if s not in declared]
        if unknown:
            from .errors import SymspecInputError, suggest

            hint = suggest(unknown[0], declared)
            raise SymspecInputError(f"no space '{unknown[0]}' in spec '{bound.spec.name}'" + (f"; {hint}" if hint else f"; spaces: {', '.join(declared)}"))
        declared = [s for s in declared if s in spaces]
    if bound.graph is not None:
        report.notes.append(_graph_note(bound))

    from .errors import SymspecInputError
    from .match import check_finite

    # NaN or inf weights make every comparison meaningless (a table of failed rows):
    # bad input, not a failed check
    check_finite(model.state_dict(), source or type(model).__name__)
    where = f"{source}: " if source else ""
    say("copying the model")
    models = _Models(model, inputs, dtypes, exact64)
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
    casts = models.keep.summary() if models.keep.count else ""  # one forward pass's worth
    say("canonicalising")
    models.canonicalize(bound)
    canon_out = {dt: models.run(dt) for dt in dtypes}
    if casts:
        if exact64:
            report.notes.append(f"float64: the model casts float64 to float32 internally (per forward pass: {casts}); "
                                "this check kept those casts in float64")
        else:
            tol["float64"] = max(tol["float64"], tol.get("float32", DEFAULT_RTOL["float32"]))
            report.notes.append(f"float64: the model computes parts in float32 (per forward pass: {casts}); "
                                f"float64 rows use rtol {tol['float64']:.0e}")
    if bound.canonical:
        canon_rows = []
        for dt in dtypes:
            a, r = compare(ref[dt], canon_out[dt])
            canon_rows.append(CheckRow("canonicalize", ", ".join(dict.fromkeys(op.kind for op in bound.canonical)), dt, 1, a, r, tol[dt]))
        bad = [r.dtype for r in canon_rows if not r.passed]
        if bad:
            say("locating the failing canonicalisation step")
            failing, notes = locate_canonical_failure(model, bound, inputs, bad[0], tol[bad[0]], exact64)
            canon_rows = [attrs.evolve(r, failing=failing) if not r.passed else r for r in canon_rows]
            report.notes.extend(notes)
        report.rows.extend(canon_rows)
    del ref

    mover = _InPlace(problem, models.t64)
    insts = {d: problem.instances_of(d) for d in declared}
    all_insts = [i for d in declared for i in insts[d]]
    want_all = len(declared) > 1 or (bool(declared) and len(all_insts) > 1)
    worst: dict[str, dict[str, tuple[float, float]]] = {}

    def record(label: str) -> None:
        """Run the model as it stands and keep the worst deviation per dtype."""
        for dt in dtypes:
            a, r = compare(canon_out[dt], models.run(dt))
            w = worst.setdefault(label, {}).get(dt)
            if w is None or r > w[1] or not math.isfinite(r):
                worst[label][dt] = (a, r)

    def measure(label: str, elements: Mapping[str, Element]) -> None:
        token = mover.apply(elements)
        models.dirty.update(token[0])
        record(label)
        models.dirty.update(mover.undo(elements, token))

    # The costliest space (the residual: its elements move the embeddings and every
    # layer) acts once per sample: each sample's element is reached from the previous
    # one's by a single action (g_k g_{k-1}^-1) and serves both its own row and, with
    # every other space on top, the 'all' row. The other spaces' rows run first, with
    # the costliest one at the identity; the last element is undone only if a failure
    # has to be located afterwards.
    cost = {d: sum(math.prod(problem.params[p].shape) for i in insts[d] for p in problem.params_of(i)) for d in declared}
    pivot = max(declared, key=lambda d: cost[d]) if len(declared) > 1 else None
    if pivot is not None and _shares_chain(problem, set(insts[pivot])):
        pivot = None  # its chains mix with other spaces': 'all' must be applied at once
    drawn = [sample_elements(problem, all_insts, seed=seed * 1000 + k, cond=cond) for k in range(samples)]
    rest = [d for d in declared if d != pivot]
    for d in rest:
        walk = _Walk(problem, mover, models, insts[d])
        for k, elems in enumerate(drawn):
            say(f"sample {k + 1}/{samples}: {d}")
            walk.to({i: elems[i] for i in insts[d]})
            record(d)
        walk.home()
    if want_all and pivot is None:
        for k, elems in enumerate(drawn):
            say(f"sample {k + 1}/{samples}: all spaces together")
            measure("all", elems if len(declared) > 1 else sample_elements(problem, all_insts, seed=seed * 1000 + 500 + k, cond=cond))
    pivot_walk = _Walk(problem, mover, models, insts[pivot]) if pivot is not None else None
    if pivot_walk is not None:
        for k, elems in enumerate(drawn):
            say(f"sample {k + 1}/{samples}: {pivot}, then all spaces together")
            pivot_walk.to({i: elems[i] for i in insts[pivot]})
            record(pivot)
            measure("all", {i: elems[i] for d in rest for i in insts[d]})
        # the last element stays applied unless a failure must be located below

    for d in declared:
        label = d if len(insts[d]) == 1 and problem.spaces[insts[d][0]].index is None else f"{d}[*]"
        groups = sorted({str(problem.spaces[i].group) for i in insts[d]})
        rows = [CheckRow(label, " | ".join(groups), dt, samples, *worst[d][dt], tol[dt]) for dt in dtypes]
        if len(insts[d]) > 1 and not all(r.passed for r in rows):
            if pivot_walk is not None:
                pivot_walk.home()
            failing = []
            for inst in insts[d]:
                say(f"locating the failure: {inst}")
                worst.pop(inst, None)
                measure(inst, sample_elements(problem, [inst], seed=seed * 1000, cond=cond))
                if any(not CheckRow(inst, "", dt, 1, *worst[inst][dt], tol[dt]).passed for dt in dtypes):
                    failing.append(inst)
            rows = [attrs.evolve(r, failing=tuple(failing)) if not r.passed else r for r in rows]
        report.rows.extend(rows)
    if want_all:
        report.rows.extend(CheckRow("all", f"{len(all_insts)} spaces", dt, samples, *worst["all"][dt], tol[dt]) for dt in dtypes)
    return report


def _graph_note(bound: BoundSpec) -> str:
    g = bound.graph
    if not g.traced:
        return f"graph: not traced ({g.reason}); bound by parameter names only, graph features (activation sites) are off"
    n = sum(len(v) for v in g.sites.values())
    return f"graph: traced with {g.method}; {n} activation site(s) in {len(g.sites)} space(s)"


def check_model(model: torch.nn.Module, spec: Spec, inputs: Any, **kw: Any) -> CheckReport:
    return check(model, bind(spec, model), inputs, **kw)
