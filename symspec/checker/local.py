"""The local check: each space verified on the blocks it acts on, one block at a time.

The model is never copied. A recorded pass per checked precision runs the canonical
model block by block (:class:`~symspec.checker.blocks.Streamed`: each block's weights
upcast, canonicalised and dropped after its call) and keeps every block call's output.
A space's sample then replays the calls before the first block it acts on, runs the
blocks from the first to the last one it acts on with the transformed weights, and
compares the last one's output with the recorded one (or the model's output, when
something downstream reads the range's inner outputs or the space acts on weights
outside the blocks). A space inside one layer recomputes that layer; the residual
stream still runs every block, one at a time. Peak memory: the model in its own dtype,
one block (with whatever a canonicalisation step reads beside it) in float64, and the
activations.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from ..binding import BoundSpec
from ..canonical import CanonOp, OwnedState
from ..groups import Element
from ..precision import KeepFloat64
from ..problem import ParamBinding, Problem
from ..transforms import transform_tensor
from .blocks import Lane, Recording, Rows, Streamed, Values, take_rows
from .canonical import _value_steps
from .forward import DTYPES, compare, flatten_outputs, select_outputs

#: canonical values kept between passes when at most this many entries (norm gains, biases)
_CACHE_NUMEL = 1 << 16
#: entries of a big tensor transformed at once (8M: 64 MB in float64)
_CHUNK = 1 << 23


def _names_in(args: Any) -> list[str]:
    """Every string in a step's arguments (the parameter names it reads and writes)."""
    if isinstance(args, str):
        return [args]
    if isinstance(args, Mapping):
        return [n for v in args.values() for n in _names_in(v)]
    if isinstance(args, (list, tuple)):
        return [n for v in args for n in _names_in(v)]
    return []


class Weights:
    """Canonical and transformed values of named tensors, computed on demand in float64
    from the model's own tensors (any dtype); nothing holds a float64 copy of the model.
    ``ops``: the canonicalisation's steps (none: ``original`` is canonical already)."""

    def __init__(self, problem: Problem, original: Mapping[str, torch.Tensor], ops: Sequence[CanonOp] = ()) -> None:
        self.problem = problem
        self.original = original
        self.ops: list[CanonOp] = list(ops)
        self.touch = [set(_names_in(dict(op.args))) & set(original) for op in self.ops]
        self.twins: dict[str, tuple[str, ...]] = {n: g for g in self.problem.ties for n in g}
        self.cache: dict[str, torch.Tensor] = {}
        order = {n: i for i, n in enumerate(self.problem.params)}
        self.order = order

    @classmethod
    def of(cls, bound: BoundSpec, original: Mapping[str, torch.Tensor]) -> Weights:
        """The canonical values ``bound``'s canonicalisation gives ``original``, taken in
        the pieces check() applies (a centring, one writer at a time): a block's closure
        holds the writers it reads, not every layer's."""
        return cls(bound.problem, original, _value_steps(bound.canonical))

    def group(self, name: str) -> tuple[str, ...]:
        return self.twins.get(name, (name,))

    def canonical(self, names: Sequence[str], rows: Rows | None = None) -> dict[str, torch.Tensor]:
        """float64 canonical values of ``names`` (only ``rows`` of each, axis 0, when given):
        only the steps that reach them, on only the tensors those steps read (only those
        rows of ``names`` and their tied twins, where every such step works row by row)."""
        want = [n for n in names if n in self.original and (rows is not None or n not in self.cache)]
        need = {t for n in want for t in self.group(n)}
        chosen = []
        for i in reversed(range(len(self.ops))):
            if self.touch[i] & need:
                need |= {t for n in self.touch[i] for t in self.group(n)}
                chosen.append(i)
        sliced = {t for n in want for t in self.group(n)} if rows is not None else set()
        if rows is not None and not all(self.ops[i].impl.rows_apart(self.ops[i], sliced) for i in chosen):
            return {n: take_rows(v, rows) for n, v in self.canonical(names).items()}
        # float64 scratch copies the steps may change in place (OwnedState): a fold into a
        # [vocab, d] head, a centred embedding, an untie of a twin no one reads after it
        # do not hold a second float64 copy of it
        sd = OwnedState()
        for n in need:
            first = self.group(n)[0] if self.group(n)[0] in sd else n
            if first in sd:
                sd[n] = sd[first]
            else:
                x = self.original[n].detach()
                sd[n] = (take_rows(x, rows) if n in sliced else x).to(torch.float64, copy=True)
                sd.owned.add(id(sd[n]))
        order = list(reversed(chosen))
        for k, i in enumerate(order):
            later = set().union(*(self.touch[j] for j in order[k:]))
            for n in [n for n in sd if n not in want and n not in later]:  # read by no step left
                del sd[n]
            before = {n: id(sd[n]) for n in self.touch[i]}  # ids: an old value is freed once replaced
            self.ops[i].impl.apply(self.ops[i], sd)
            for n in self.touch[i]:
                if id(sd[n]) != before[n]:
                    for t in self.group(n):
                        sd[t] = sd[n]
        out = {n: sd[n] for n in want}
        if rows is None:
            for n, v in out.items():
                if v.numel() <= _CACHE_NUMEL:
                    self.cache[n] = v
            out.update({n: self.cache[n] for n in names if n in self.cache})
        return out

    def acting(self, name: str, spaces: set[str]) -> str | None:
        """The bound name (``name`` or a tied twin) whose binding moves ``name`` under ``spaces``."""
        found = [t for t in self.group(name) if t in self.problem.params and self.problem.params[t].spaces() & spaces]
        return min(found, key=self.order.__getitem__) if found else None

    def affected(self, spaces: set[str]) -> list[str]:
        return [n for n in self.original if self.acting(n, spaces) is not None]

    def rows_apart(self, names: Sequence[str], elements: Mapping[str, Element]) -> bool:
        """Do ``elements`` leave axis 0 of each of ``names`` alone (so that they transform
        any of its rows on their own)?"""
        spaces = set(elements)
        for n in names:
            rep = self.acting(n, spaces)
            if rep is not None and (self.problem.params[rep].view is not None or 0 in self._moved(self.problem.params[rep], elements)):
                return False
        return True

    def transformed(self, names: Sequence[str], elements: Mapping[str, Element],
                    start: Mapping[str, torch.Tensor] | None = None, rows: Rows | None = None) -> dict[str, torch.Tensor]:
        """Canonical values of ``names`` (or ``start``'s) with ``elements`` applied (tied
        twins once); ``rows`` of each only, where :meth:`rows_apart` (``start``: those rows already)."""
        if rows is not None and not self.rows_apart(names, elements):
            raise ValueError("transformed(rows=...): an element moves axis 0 of one of these tensors")
        vals = dict(start) if start is not None else self.canonical(names, rows)
        spaces = set(elements)
        done: dict[str, torch.Tensor] = {}
        for n in list(vals):
            rep = self.acting(n, spaces)
            if rep is None:
                continue
            if rep not in done:
                x = vals[n]
                owned = start is None and x.numel() > _CACHE_NUMEL and x.data_ptr() != self.original[n].data_ptr()
                done[rep] = self._transform(self.problem.params[rep], x, elements, owned)
            vals[n] = done[rep]
        return vals

    def _transform(self, binding: ParamBinding, x: torch.Tensor, elements: Mapping[str, Element], owned: bool) -> torch.Tensor:
        """:func:`transform_tensor`, a slice at a time along an axis no element acts on (an
        embedding's rows), into ``x`` itself when ``owned``: a [vocab, d] matrix is not
        held twice in float64."""
        moved = self._moved(binding, elements)
        free = [a for a in range(x.ndim) if a not in moved]
        if binding.view is not None or not free or x.numel() <= _CHUNK:
            return transform_tensor(self.problem, binding, x, elements)
        axis = max(free, key=lambda a: x.shape[a])
        step = max(1, _CHUNK * x.shape[axis] // x.numel())
        out = x if owned else torch.empty_like(x)
        for s in range(0, x.shape[axis], step):
            k = min(step, x.shape[axis] - s)
            out.narrow(axis, s, k).copy_(transform_tensor(self.problem, binding, x.narrow(axis, s, k), elements))
        return out

    @staticmethod
    def _moved(binding: ParamBinding, elements: Mapping[str, Element]) -> set[int]:
        """The axes of the bound tensor that ``elements`` act on."""
        return {ab.axis for ab in binding.axes if any(f.space in elements for sg in ab.segments for f in sg.factors)}


class LocalModels:
    """The streamed model, its weights and the recorded canonical passes, per dtype."""

    def __init__(self, model: torch.nn.Module, bound: BoundSpec, inputs: Any, dtypes: Sequence[str], exact64: bool,
                 device: str = "cpu") -> None:
        self.streamed = Streamed(model, device)
        original = {e.name: e.get() for es in self.streamed.entries for e in es}
        original.update({e.name: e.get() for e in self.streamed.rest})
        self.weights = Weights.of(bound, original)
        self.inputs = inputs
        self.dtypes = dtypes
        self.outputs = bound.problem.outputs  # the spec's outputs: those compared (all where empty)
        self.keep = KeepFloat64(rewrite=exact64)
        self.exact64 = exact64
        self.recs: dict[str, Recording] = {}
        self.block_of = self.streamed.block_of()

    def mode(self, dt: str) -> Any:
        return KeepFloat64(rewrite=self.exact64) if dt == "float64" else None

    def run(self, dt: str) -> list[torch.Tensor]:
        """The model's own outputs (not canonicalised), streamed; counts float64 casts. The
        first call runs every dtype, in lockstep; an error is raised for its own dtype."""
        if not hasattr(self, "_plain"):
            lanes = [Lane(DTYPES[d], self._shared(lambda ns, rows=None: {}), self.keep if d == "float64" else None) for d in self.dtypes]
            self.streamed.run_lanes(self.inputs, lanes, keep_errors=True)
            self._plain = {d: lane for d, lane in zip(self.dtypes, lanes)}
        lane = self._plain.pop(dt)
        if lane.error is not None:
            raise lane.error
        return [t.detach() for t in flatten_outputs(select_outputs(lane.out, self.outputs))]

    def record(self) -> dict[str, list[torch.Tensor]]:
        """The canonical model's pass per dtype, recorded; its outputs."""
        recs = self.streamed.record([DTYPES[dt] for dt in self.dtypes], self.inputs, self._shared(self.weights.canonical),
                                    [self.mode(dt) for dt in self.dtypes])
        self.recs = dict(zip(self.dtypes, recs))
        return {dt: [t.detach() for t in flatten_outputs(select_outputs(r.final, self.outputs))]
                for dt, r in self.recs.items()}

    def _shared(self, values: Values) -> Values:
        """``values``, computed once per block call for all lanes."""
        return lambda ns, rows=None: self.streamed.shared(ns, lambda: values(ns, rows), rows)

    def span(self, names: Sequence[str], rec: Recording) -> tuple[int, int] | None:
        """The calls from the first to the last that read ``names`` (None: the whole pass)."""
        if any(n not in self.block_of or n in self.streamed.glue for n in names) or not rec.calls:
            return None
        blocks = {self.block_of[n] for n in names}
        calls = [i for i, k in enumerate(rec.calls) if k in blocks]
        return (calls[0], calls[-1]) if calls else None

    def deviations(self, lanes: Sequence[tuple[str, Mapping[str, Element]]],
                   common: Mapping[str, Element]) -> list[tuple[float, float]]:
        """(max abs, max rel) deviation of the transformed model from the canonical one, per
        lane (a dtype and the elements to apply), all lanes in one lockstep pass; the
        ``common`` elements (every lane's) are applied once per block for all lanes."""
        out: list[tuple[float, float]] = [(0.0, 0.0)] * len(lanes)
        todo, refs, finals = [], [], []
        for dt, elements in lanes:
            names = self.weights.affected(set(elements))
            rec = self.recs[dt]
            if not names:
                todo.append(None)
                continue
            span = self.span(names, rec)
            extra = {k: v for k, v in elements.items() if k not in common}
            todo.append(Lane(DTYPES[dt], self._values(names, extra, common), self.mode(dt), rec if span else None, span))
            stops = span is not None and rec.stops_at(*span)
            refs.append((rec, span[1]) if stops and span else rec.final)
            finals.append(not stops)  # the model's own outputs: only the spec's are compared
        running = [lane for lane in todo if lane is not None]
        got = iter(zip(self.streamed.run_lanes(self.inputs, running), refs, finals)) if running else iter(())
        for k, lane in enumerate(todo):
            if lane is not None:
                result, ref, final = next(got)
                if final:
                    out[k] = compare_outputs(ref, result, self.outputs)
                else:  # the range's last call: only what downstream reads of it
                    rec, last = ref
                    out[k] = compare(rec.read_of(last, rec.outputs[last]), rec.read_of(last, result))
        return out

    def _values(self, names: Sequence[str], extra: Mapping[str, Element], common: Mapping[str, Element]) -> Values:
        weights, streamed = self.weights, self.streamed

        def values(ns: Sequence[str], rows: Rows | None = None) -> Mapping[str, torch.Tensor]:
            if rows is not None and not weights.rows_apart(ns, {**common, **extra}):
                return {n: take_rows(v, rows) for n, v in values(ns).items()}
            base = streamed.shared(ns, lambda: weights.transformed(ns, common, rows=rows), rows)
            return weights.transformed(ns, extra, base, rows) if extra else base
        return values


def state_values(state: Mapping[str, torch.Tensor], alias: Mapping[str, str] | None = None) -> Values:
    """The values of a state dict (a tied name reads the name it is tied to, ``alias``),
    in float64; a name the state lacks keeps the module's own value."""
    alias = alias or {}

    def values(names: Sequence[str], rows: Rows | None = None) -> Mapping[str, torch.Tensor]:
        out = {}
        for n in names:
            v = state.get(alias.get(n, n))
            if v is not None:
                out[n] = (v if rows is None else take_rows(v, rows)).detach().to(torch.float64)
        return out
    return values


def element_values(weights: Weights, elements: Mapping[str, Element]) -> Values:
    """``weights``' canonical values with ``elements`` applied, a block's at a time."""
    def values(names: Sequence[str], rows: Rows | None = None) -> Mapping[str, torch.Tensor]:
        if rows is not None and not weights.rows_apart(names, elements):
            return {n: take_rows(v, rows) for n, v in values(names).items()}
        return weights.transformed(names, elements, rows=rows)
    return values


def stream_difference(model: torch.nn.Module, inputs: Any, before: Values, after: Values,
                      outputs: Sequence[str] = (), device: torch.device | str = "cpu") -> tuple[float, float]:
    """(max abs, max rel) difference between ``model``'s outputs (``outputs`` of them where
    given) with the values ``before`` and with ``after``, in float64 (casts to float32
    inside the model kept in float64), one block at a time: the model is never copied, and
    no more than one block's values are held in float64 beside it."""
    streamed = Streamed(model, device)
    (rec,) = streamed.record([torch.float64], inputs, before, [KeepFloat64(rewrite=True)])
    got = streamed.run(torch.float64, inputs, after, KeepFloat64(rewrite=True))
    return compare_outputs(rec.final, got, outputs)


def compare_outputs(ref: Any, got: Any, outputs: Sequence[str]) -> tuple[float, float]:
    """(max abs, max rel) difference of two model outputs, ``outputs`` of them (all where empty)."""
    return compare(flatten_outputs(select_outputs(ref, outputs)), flatten_outputs(select_outputs(got, outputs)))
