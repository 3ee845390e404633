"""``check`` itself: bind, copy, canonicalise, then every declared space's sampled elements
(:class:`SpaceRun`), row by row."""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import attrs
import torch

from ..binding import BoundSpec, bind
from ..errors import SymspecInputError, suggest
from ..groups import Element
from ..problem import Problem
from ..progress import Step
from ..spec.model import Spec
from ..statedict import check_finite
from ..transforms import sample_elements
from .canonical import locate_canonical_failure
from .forward import DTYPES, compare
from .inplace import InPlace, Models, Walk, shares_chain
from .local import LocalModels
from .report import DEFAULT_RTOL, CheckReport, CheckRow


def check(model: torch.nn.Module, spec: Spec | BoundSpec, inputs: Any, *, samples: int = 3, seed: int = 0,
          dtypes: Sequence[str] = ("float64", "float32"), spaces: Sequence[str] | None = None,
          rtol: Mapping[str, float] | None = None, cond: float = 10.0,
          progress: Callable[[str], None] | None = None, exact64: bool = True, trace: bool = False,
          source: str | None = None, whole: bool = False, device: str = "cpu") -> CheckReport:
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

    ``whole``: check on whole-model copies in float64 and float32 (the model's size
    twice over, more for float32) instead of locally: by default each space is checked
    on the blocks it acts on, one block at a time in the checked precision, without
    copying the model (:mod:`symspec.checker.local`). Both report the same rows.
    ``device``: where the local check runs (``cpu``, ``cuda``).

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
    if not whole:
        local = LocalModels(model, bound, inputs, dtypes, exact64, device)
        opts = dict(samples=samples, seed=seed, cond=cond)
        return _check_local(local, model, bound, inputs, report, declared, tol, say, source, opts)
    say("copying the model")
    models = Models(model, inputs, dtypes, exact64, bound.problem.outputs)
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
    run = SpaceRun(bound.problem, models, dtypes, tol, canon_out, say, samples=samples, seed=seed, cond=cond)
    report.rows.extend(run.rows(declared))
    return report


def _check_local(local: LocalModels, model: torch.nn.Module, bound: BoundSpec, inputs: Any, report: CheckReport,
                 declared: Sequence[str], tol: dict[str, float], say: Callable[[str], None], source: str | None,
                 opts: dict[str, Any]) -> CheckReport:
    """check() on the blocks each space acts on (see :mod:`~symspec.checker.local`)."""
    dtypes = local.dtypes
    say("running the model block by block")
    ref = _reference_outputs(local, dtypes, f"{source}: " if source else "")  # type: ignore[arg-type]
    casts = local.keep.summary() if local.keep.count else ""
    say("canonicalising block by block")
    canon_out = local.record()
    if casts:
        report.notes.append(_casts_note(casts, local.exact64, tol))
    if bound.canonical:
        rows, notes = _canonical_rows(model, bound, inputs, ref, canon_out, tol, local.exact64, say)
        report.notes.extend(notes)
        report.rows.extend(rows)
    del ref
    if local.streamed.blocks[0][1] is model:
        report.notes.append("local check: no stack of layers found, so each space was checked on the whole model")
    elif local.streamed.glue or local.streamed.rest:
        held = sorted(local.streamed.glue | {e.name for e in local.streamed.rest})
        report.notes.append(f"local check: {', '.join(held[:4])}{' and more' if len(held) > 4 else ''} "
                            "read outside the model's blocks: held for whole passes, and a space acting on them is checked on the whole model")
    run = LocalRun(bound.problem, local, dtypes, tol, say, **opts)
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


def _reference_outputs(models: Models, dtypes: Sequence[str], where: str) -> dict[str, list[torch.Tensor]]:
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


class SpaceRun:
    """The rows of the declared spaces: sampled elements applied to the canonical weights
    in place, keeping the worst deviation from the canonical outputs per space and dtype."""

    def __init__(self, problem: Problem, models: Models, dtypes: Sequence[str], tol: Mapping[str, float],
                 canon_out: Mapping[str, list[torch.Tensor]], say: Callable[[str], None], *,
                 samples: int, seed: int, cond: float) -> None:
        self.problem = problem
        self.models = models
        self.dtypes = dtypes
        self.tol = tol
        self.canon_out = canon_out
        self.say = say
        self.samples, self.seed, self.cond = samples, seed, cond
        self.mover = InPlace(problem, models.t64)
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

    def sample_all(self, declared: Sequence[str], insts: Mapping[str, list[str]], want_all: bool) -> Walk | None:
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
        if pivot is not None and shares_chain(problem, set(insts[pivot])):
            pivot = None  # its chains mix with other spaces': 'all' must be applied at once
        drawn = [self.sample(all_insts, self.seed * 1000 + k) for k in range(self.samples)]
        rest = [d for d in declared if d != pivot]
        # the steps below, counted for the progress messages: one per sample of each space
        total = self.samples * (len(rest) + (pivot is not None or want_all))
        steps = itertools.count()
        for d in rest:
            walk = Walk(problem, self.mover, self.models, insts[d])
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
        pivot_walk = Walk(problem, self.mover, self.models, insts[pivot])
        for k, elems in enumerate(drawn):
            self.say(Step(f"sample {k + 1}/{self.samples}: {pivot}, then all spaces together", next(steps), total))
            pivot_walk.to({i: elems[i] for i in insts[pivot]})
            self.record(pivot)
            self.measure("all", {i: elems[i] for d in rest for i in insts[d]})
        return pivot_walk

    def space_rows(self, d: str, insts: Sequence[str], pivot_walk: Walk | None) -> list[CheckRow]:
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


class LocalRun(SpaceRun):
    """:class:`SpaceRun`'s rows, each sample measured on the blocks it acts on."""

    def __init__(self, problem: Problem, local: LocalModels, dtypes: Sequence[str], tol: Mapping[str, float],
                 say: Callable[[str], None], *, samples: int, seed: int, cond: float) -> None:
        self.problem = problem
        self.local = local
        self.dtypes = dtypes
        self.tol = tol
        self.say = say
        self.samples, self.seed, self.cond = samples, seed, cond
        self.worst: dict[str, dict[str, tuple[float, float]]] = {}

    def measure(self, label: str, elements: Mapping[str, Element]) -> None:
        self.measure_lanes([(label, elements)], elements)

    def measure_lanes(self, rows: Sequence[tuple[str, Mapping[str, Element]]], common: Mapping[str, Element]) -> None:
        """Several rows' samples in one lockstep pass per block (each in every dtype);
        ``common``: the elements all of them apply, transformed once per block."""
        lanes = [(dt, elements) for _, elements in rows for dt in self.dtypes]
        got = iter(self.local.deviations(lanes, common))
        for label, _ in rows:
            for dt in self.dtypes:
                a, r = next(got)
                w = self.worst.setdefault(label, {}).get(dt)
                if w is None or r > w[1] or not math.isfinite(r):
                    self.worst[label][dt] = (a, r)

    def sample_all(self, declared: Sequence[str], insts: Mapping[str, list[str]], want_all: bool) -> Walk | None:
        """Every space's samples, and all spaces' together: the elements the whole check
        draws. The costliest space (the residual stream) and 'all' run in one pass per
        sample, its transform computed once per block for both (unless its factor
        chains mix with other spaces')."""
        problem = self.problem
        all_insts = [i for d in declared for i in insts[d]]
        cost = {d: sum(math.prod(problem.params[p].shape) for i in insts[d] for p in problem.params_of(i)) for d in declared}
        pivot = max(declared, key=lambda d: cost[d]) if len(declared) > 1 and want_all else None
        if pivot is not None and shares_chain(problem, set(insts[pivot])):
            pivot = None
        drawn = [self.sample(all_insts, self.seed * 1000 + k) for k in range(self.samples)]
        rest = [d for d in declared if d != pivot]
        total = self.samples * (bool(rest) + (pivot is not None or want_all))
        steps = itertools.count()
        for k, elems in enumerate(drawn if rest else []):  # the other spaces: one pass per sample, a lane each
            self.say(Step(f"sample {k + 1}/{self.samples}: {', '.join(rest)}", next(steps), total))
            self.measure_lanes([(d, {i: elems[i] for i in insts[d]}) for d in rest], {})
        for k, elems in enumerate(drawn if want_all or pivot is not None else []):
            if pivot is None:
                self.say(Step(f"sample {k + 1}/{self.samples}: all spaces together", next(steps), total))
                self.measure("all", elems if len(declared) > 1 else self.sample(all_insts, self.seed * 1000 + 500 + k))
                continue
            self.say(Step(f"sample {k + 1}/{self.samples}: {pivot}, and all spaces together", next(steps), total))
            mine = {i: elems[i] for i in insts[pivot]}
            self.measure_lanes([(pivot, mine), ("all", elems)], mine)
        return None
