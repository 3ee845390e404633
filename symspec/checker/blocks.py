"""The model as a sequence of blocks, run one block at a time in the checked precision.

:func:`find_blocks` cuts a model along its largest stack of layers (the ``ModuleList``
or ``Sequential`` holding the most parameters): the stack's layers, and every sibling
of the stack and of its ancestors (embeddings, final norm, head), are the blocks.
:class:`Streamed` runs the model's own forward with every block's parameters and
buffers swapped in only while that block runs (a float64 or float32 copy of one block
at a time, computed by a callback); outside its call a block holds a placeholder of
the right dtype and shape that takes no memory. The code between blocks (the model's
own forward: masks, rotary tables, slicing) runs as written.

A recorded pass (:meth:`Streamed.record`) keeps every block call's output and which
earlier calls each call's inputs were computed from (followed through the code between
blocks). A later pass can then replay the calls before a range of blocks, run the range
with other weights, and stop after it when nothing downstream reads the range's inner
outputs: a space inside one layer costs one layer.

A parameter that the code between blocks reads (a tied head written as
``x @ self.wte.weight.T``) is found during the recording and held for the whole pass.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, Protocol

import attrs
import torch
from torch.overrides import TorchFunctionMode

from .forward import call_forward, cast_inputs


@attrs.frozen
class Entry:
    """One parameter or buffer slot of a module: ``owner._parameters[attr]`` (or ``_buffers``)."""

    name: str
    owner: torch.nn.Module
    attr: str
    buffer: bool

    def get(self) -> torch.Tensor:
        return (self.owner._buffers if self.buffer else self.owner._parameters)[self.attr]  # type: ignore[return-value]

    def put(self, value: torch.Tensor) -> None:
        if self.buffer:
            self.owner._buffers[self.attr] = value
        else:
            self.owner._parameters[self.attr] = value if isinstance(value, torch.nn.Parameter) else torch.nn.Parameter(value, requires_grad=False)


def find_blocks(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    """(path, module) of the blocks, in module order (the model itself when it has no stack)."""
    stacks = [(n, m) for n, m in model.named_modules() if isinstance(m, (torch.nn.ModuleList, torch.nn.Sequential)) and len(m) > 1]
    if not stacks:
        return [("", model)]
    path, _ = max(stacks, key=lambda nm: sum(p.numel() for p in nm[1].parameters()))
    return _cut(model, "", path.split("."))


def _cut(module: torch.nn.Module, prefix: str, path: Sequence[str]) -> list[tuple[str, torch.nn.Module]]:
    """``module``'s children as blocks, the one on ``path`` cut further (the stack: into its layers)."""
    out: list[tuple[str, torch.nn.Module]] = []
    for name, child in module.named_children():
        if not path:
            out.append((prefix + name, child))
        elif name == path[0]:
            out += _cut(child, f"{prefix}{name}.", path[1:])
        else:
            out.append((prefix + name, child))
    return out


def _entries(module: torch.nn.Module, prefix: str) -> Iterator[Entry]:
    for mod_name, mod in module.named_modules(prefix=prefix, remove_duplicate=False):
        head = f"{mod_name}." if mod_name else ""
        for attr, p in mod._parameters.items():
            if p is not None and p.is_floating_point():
                yield Entry(head + attr, mod, attr, False)
        for attr, b in mod._buffers.items():
            if b is not None and b.is_floating_point():
                yield Entry(head + attr, mod, attr, True)


def _tensors(x: Any) -> Iterator[torch.Tensor]:
    if isinstance(x, torch.Tensor):
        yield x
    elif isinstance(x, Mapping):
        for v in x.values():
            yield from _tensors(v)
    elif isinstance(x, (tuple, list)):
        for v in x:
            yield from _tensors(v)


class _Stop(Exception):
    """Raised after the last block of a range, when nothing downstream needs running."""


class _Follow(TorchFunctionMode):
    """Between blocks, which block calls each tensor was computed from (by identity); and
    anywhere, which block's weights are read outside its own call (an operation on a
    placeholder that gives a tensor: ``w.T``, ``x @ w``, not ``w.shape`` or ``w.size()``)."""

    def __init__(self, placeholders: Mapping[int, str]) -> None:
        super().__init__()
        self.depth = 0
        self.origin: dict[int, frozenset[int]] = {}
        #: the same by tensor: (call, index of the tensor among that call's outputs)
        self.parts: dict[int, frozenset[tuple[int, int]]] = {}
        self.keep: list[Any] = []  # holds what origin's ids refer to, so that no id is reused
        self.placeholders = placeholders
        self.read: set[str] = set()

    def of(self, x: Any) -> frozenset[int]:
        out: frozenset[int] = frozenset()
        for t in _tensors(x):
            out |= self.origin.get(id(t), frozenset())
        return out

    def parts_of(self, x: Any) -> frozenset[tuple[int, int]]:
        out: frozenset[tuple[int, int]] = frozenset()
        for t in _tensors(x):
            out |= self.parts.get(id(t), frozenset())
        return out

    def mark(self, x: Any, origin: frozenset[int], parts: frozenset[tuple[int, int]] | None = None) -> None:
        """``x``'s tensors come from the calls ``origin`` (and their ``parts``; None: the
        call ``origin`` names alone, each tensor its own part)."""
        self.keep.append(x)
        for j, t in enumerate(_tensors(x)):
            self.origin[id(t)] = origin
            self.parts[id(t)] = parts if parts is not None else frozenset((n, j) for n in origin)

    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if any(True for _ in _tensors(out)):
            self.read.update(self.placeholders[id(t)] for t in _tensors((args, kwargs)) if id(t) in self.placeholders)
        if self.depth == 0:
            origin = self.of((args, kwargs))
            if origin:
                self.mark(out, origin, self.parts_of((args, kwargs)))
        return out


@attrs.define
class Recording:
    """One pass: each call's block, output and the calls its inputs came from; the model's output."""

    calls: list[int]
    outputs: list[Any]
    needs: list[frozenset[int]]
    final: Any
    final_needs: frozenset[int]
    #: per call, and for the model's output: the (call, output tensor) pairs read
    part_needs: list[frozenset[tuple[int, int]]] = attrs.field(factory=list)
    final_part_needs: frozenset[tuple[int, int]] = frozenset()

    def can_stop(self, first: int, last: int) -> bool:
        """Does only call ``last``'s output carry the range's result downstream?"""
        inner = set(range(first, last))
        later = [*self.needs[last + 1:], self.final_needs]
        return not any(n & inner for n in later)

    def stops_at(self, first: int, last: int) -> bool:
        """A pass over the calls ``first..last`` may stop after ``last``: only its output
        carries the range's result downstream, and something downstream reads it."""
        return self.can_stop(first, last) and bool(self.read_after(last))

    def read_after(self, call: int) -> set[int]:
        """The indices (in :func:`_tensors` order) of call ``call``'s output tensors that a
        later call or the model's output reads: a decoder layer's position bias passed on
        to the next layer is read, the last layer's is not (and under a head permutation
        it moves, as the heads do)."""
        later = [*self.part_needs[call + 1:], self.final_part_needs]
        return {j for n in later for c, j in n if c == call}

    def read_of(self, call: int, out: Any) -> list[torch.Tensor]:
        """The tensors of ``out`` (call ``call``'s output, or another pass's in its place)
        that downstream reads (:meth:`read_after`)."""
        read = self.read_after(call)
        return [t for j, t in enumerate(_tensors(out)) if j in read]


#: some rows (axis 0) of a tensor: a range, or the indices of a lookup
Rows = slice | torch.Tensor


def take_rows(x: torch.Tensor, rows: Rows) -> torch.Tensor:
    """``rows`` of ``x`` (axis 0)."""
    return x[rows] if isinstance(rows, slice) else x.index_select(0, rows.to(x.device))


def _rows_key(rows: Rows | None) -> Any:
    if rows is None:
        return None
    return (rows.start, rows.stop) if isinstance(rows, slice) else tuple(rows.tolist())


class Values(Protocol):
    """The values of one block's (or the glue's) entries for a pass: names -> tensors;
    with ``rows``, only those rows (axis 0) of each."""

    def __call__(self, names: Sequence[str], rows: Rows | None = None) -> Mapping[str, torch.Tensor]: ...


#: a leaf ``Embedding`` block whose weight takes at least this many bytes in a pass's
#: dtype runs on the rows its inputs look up (less work and memory than the whole table)
ROWS_BYTES = 1 << 26
#: a leaf ``Linear`` block (a head) whose weight takes at least this many bytes in a pass's
#: dtype runs a slice of output rows at a time: a [vocab, d] head is never held whole in
#: float64. Below it the whole weight is computed once for every pass in lockstep, which
#: is faster (slices are computed per pass)
SLICES_BYTES = 1 << 29
#: entries of such a head computed at once (4M: 32 MB in float64)
ROWS_CHUNK = 1 << 22


class Streamed:
    """Runs ``model``'s forward in ``dtype`` with each block's values swapped in only
    during its call. The model is left as it was after every pass."""

    def __init__(self, model: torch.nn.Module, device: torch.device | str = "cpu") -> None:
        self.model = model
        self.device = torch.device(device)
        self.blocks = find_blocks(model)
        self.entries = [list(_entries(m, path)) for path, m in self.blocks]
        inside = {id(e.owner) for es in self.entries for e in es}
        inside |= {id(m) for _, b in self.blocks for m in b.modules()}
        self.rest = [e for e in _entries(model, "") if id(e.owner) not in inside]
        #: names read outside their block's call (found by :meth:`record`): held for the whole pass
        self.glue: set[str] = set()
        #: the placeholders of this pass (by id), kept alive so that no id is reused
        self.placeholders: dict[int, str] = {}
        self._kept: list[torch.Tensor] = []
        self._tls = threading.local()

    def block_of(self) -> dict[str, int]:
        """Parameter name -> block index (names outside every block are absent)."""
        return {e.name: k for k, es in enumerate(self.entries) for e in es}

    def run(self, dtype: torch.dtype, inputs: Any, values: Values, mode: Any = None, *,
            replay: Recording | None = None, span: tuple[int, int] | None = None, follow: _Follow | None = None) -> Any:
        """One pass; returns the model's output, or call ``span[1]``'s output when ``replay``
        allows stopping there. Calls before ``span[0]`` return ``replay``'s outputs."""
        return self.run_lanes(inputs, [Lane(dtype, values, mode, replay, span, follow)])[0]

    def run_lanes(self, inputs: Any, lanes: Sequence[Lane], keep_errors: bool = False) -> list[Any]:
        """Several passes in lockstep, one thread each, one running at a time: every lane
        runs block call ``n`` before any runs call ``n + 1`` (so what the lanes' values
        share for a call, :meth:`shared`, is computed once and dropped after it). A lane's
        error is raised, or with ``keep_errors`` left in its :attr:`Lane.error`."""
        if len(lanes) > 1 and (self.rest or self.glue or self.blocks[0][1] is self.model):
            # what the glue holds is per pass: one pass after the other
            return [self.run_lanes(inputs, [lane], keep_errors)[0] for lane in lanes]
        state = [(m, m.training) for m in self.model.modules()]
        self.placeholders.clear()
        self._kept.clear()
        self._original = {id(e): e.get() for es in [*self.entries, self.rest] for e in es}
        self._memo: dict[tuple[int, tuple[str, ...]], Any] = {}
        self._own: dict[int, Any] = {}
        self._ph: dict[torch.dtype, list[torch.Tensor]] = {}
        self._ph_dtype: torch.dtype | None = None
        self._baton = _Baton(len(lanes))
        try:
            self.model.eval()
            for k, (_, block) in enumerate(self.blocks):
                if block is not self.model:
                    # a forward set on the instance (accelerate's hooks) is kept, called and put back
                    self._own[k] = block.__dict__.get("forward")
                    block.forward = self._wrap(k, block)  # type: ignore[method-assign]
            if len(lanes) == 1:
                self._lane_pass(0, lanes[0], inputs)
            else:
                # daemons: an interrupt (Ctrl-C in the caller's thread) does not wait for the lanes
                threads = [threading.Thread(target=self._lane_pass, args=(i, lane, inputs), daemon=True) for i, lane in enumerate(lanes)]
                for t in threads:
                    t.start()
                for t in threads:
                    t.join()
            for lane in lanes:
                if lane.error is not None and not keep_errors:
                    raise lane.error
            return [lane.out for lane in lanes]
        finally:
            for _, block in self.blocks:
                block.__dict__.pop("forward", None)
            for k, own in self._own.items():
                if own is not None:
                    self.blocks[k][1].forward = own  # type: ignore[method-assign]
            self._kept.clear()
            self._memo.clear()
            for es in [*self.entries, self.rest]:
                for e in es:
                    e.put(self._original[id(e)])
            for m, training in state:
                m.training = training

    def shared(self, names: Sequence[str], compute: Callable[[], Any], rows: Rows | None = None) -> Any:
        """What every lane's values of ``names`` (``rows`` of them) for the current block
        call share, computed once."""
        key = (len(self._tls.lane.calls) - 1, tuple(names), _rows_key(rows))
        if key not in self._memo:
            self._memo.clear()
            self._memo[key] = compute()
        return self._memo[key]

    def _lane_pass(self, i: int, lane: Lane, inputs: Any) -> None:
        """One lane's forward pass (in its own thread when there are several)."""
        self._tls.lane, self._tls.index = lane, i
        try:
            self._take(i, lane)
            held = [e for es in self.entries for e in es if e.name in self.glue] + self.rest
            for e, v in zip(held, self._values(lane.values, held, lane.dtype)):
                e.put(v)
            if self.blocks[0][1] is self.model:
                lane.out = self._whole(lane.dtype, inputs, lane.values, lane.mode)
                lane.final = lane.out
                return
            modes = [m for m in (lane.mode, lane.follow) if m is not None]
            with contextlib.suppress(_Stop):
                lane.out = lane.final = call_forward(self.model, cast_inputs(_to(inputs, self.device), lane.dtype), _Stack(modes))
        except BaseException as e:  # handed to the caller's thread; the other lanes go on
            lane.error = e
        finally:
            self._baton.leave(i)

    def _take(self, i: int, lane: Lane) -> None:
        """Wait for lane ``i``'s turn; the blocks not running hold placeholders of its dtype."""
        self._baton.wait(i)
        if self._ph_dtype != lane.dtype:
            if lane.dtype not in self._ph:
                self._ph[lane.dtype] = [self._placeholder(e, self._original[id(e)], lane.dtype)
                                        for es in self.entries for e in es]
            for e, p in zip((e for es in self.entries for e in es), self._ph[lane.dtype]):
                if e.name not in self.glue:
                    e.put(p)
            self._ph_dtype = lane.dtype

    def _wrap(self, k: int, block: torch.nn.Module) -> Callable[..., Any]:
        def forward(*args: Any, **kwargs: Any) -> Any:
            return self._call(k, block, args, kwargs)
        return forward

    def _call(self, k: int, block: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """Block ``k`` called by the current lane: replayed, or run on the lane's values in its turn."""
        lane, i = self._tls.lane, self._tls.index
        n = len(lane.calls)
        lane.calls.append(k)
        if lane.replay is not None and lane.span is not None and n < lane.span[0]:
            return _clone(lane.replay.outputs[n])
        self._baton.pass_on(i)
        self._take(i, lane)
        follow = lane.follow
        if follow is not None:
            need, follow.depth = follow.of((args, kwargs)), follow.depth + 1
            part_need = follow.parts_of((args, kwargs))
        mine = [e for e in self.entries[k] if e.name not in self.glue]
        saved = [e.get() for e in mine]
        try:
            by_rows = self._by_rows(k, block, mine, lane.dtype)
            if by_rows is not None:
                out = by_rows(lane.values, args, kwargs)
            else:
                for e, v in zip(mine, self._values(lane.values, mine, lane.dtype)):
                    e.put(v)
                own = self._own.get(k)
                out = own(*args, **kwargs) if own is not None else type(block).forward(block, *args, **kwargs)
        finally:
            for e, p in zip(mine, saved):
                e.put(p)
            if follow is not None:
                follow.depth -= 1
        if follow is not None:
            lane.needs.append(need)
            lane.part_needs.append(part_need)
            lane.outputs.append(out)
            follow.mark(out, frozenset({n}))
        if lane.stops() and lane.span is not None and n == lane.span[1]:
            lane.out = out
            raise _Stop
        return out

    def _whole(self, dtype: torch.dtype, inputs: Any, values: Values, mode: Any) -> Any:
        """A model without a stack of layers: one block, the whole model."""
        mine = [e for e in self.entries[0] if e.name not in self.glue]
        for e, v in zip(mine, self._values(values, mine, dtype)):
            e.put(v)
        return call_forward(self.model, cast_inputs(_to(inputs, self.device), dtype), mode)

    def _values(self, values: Values, entries: Sequence[Entry], dtype: torch.dtype, rows: Rows | None = None) -> list[torch.Tensor]:
        if not entries:
            return []
        got = values([e.name for e in entries], rows)
        out = []
        for e in entries:
            v = got.get(e.name)
            if v is None:  # not bound by the spec and not canonicalised: the model's own value
                v = self._original[id(e)]
                v = v if rows is None else take_rows(v, rows)
            out.append(v.detach().to(device=self.device, dtype=dtype))
        return out

    def _by_rows(self, k: int, block: torch.nn.Module, mine: Sequence[Entry], dtype: torch.dtype) -> Callable[..., Any] | None:
        """How block ``k`` runs on some rows of its weight at a time (:data:`ROWS_BYTES`,
        :data:`SLICES_BYTES`), or None: a plain ``Embedding`` (no ``max_norm``) or ``Linear`` with no children, no
        forward of its own and nothing but its weight (and bias) to swap in."""
        kind = type(block).forward
        if kind not in (torch.nn.Embedding.forward, torch.nn.Linear.forward) or self._own.get(k) is not None:
            return None
        if any(True for _ in block.children()) or getattr(block, "max_norm", None) is not None:
            return None
        by_attr = {e.attr: e for e in mine if not e.buffer}
        weight = by_attr.get("weight")
        if weight is None or len(by_attr) != len(mine) or set(by_attr) - {"weight", "bias"}:
            return None
        w = self._original[id(weight)]
        least = ROWS_BYTES if kind is torch.nn.Embedding.forward else SLICES_BYTES
        if w.ndim != 2 or w.numel() * dtype.itemsize < least:
            return None
        entries = [weight, *([by_attr["bias"]] if "bias" in by_attr else [])]
        if kind is torch.nn.Embedding.forward:
            def embedding(values: Values, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
                ids = args[0] if args else kwargs["input"]
                rows, inverse = torch.unique(ids, return_inverse=True)
                (table,) = self._values(values, entries, dtype, rows)
                return torch.nn.functional.embedding(inverse, table)
            return embedding

        def linear(values: Values, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
            x = args[0] if args else kwargs["input"]
            n, step = w.shape[0], max(1, ROWS_CHUNK // max(1, w.shape[1]))
            out = None
            for s in range(0, n, step):
                part = self._values(values, entries, dtype, slice(s, min(n, s + step)))
                y = torch.nn.functional.linear(x, *part)
                if out is None:
                    out = y.new_empty((*y.shape[:-1], n))
                out.narrow(-1, s, y.shape[-1]).copy_(y)
            return out
        return linear

    def _placeholder(self, entry: Entry, like: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """A tensor of ``like``'s shape and ``dtype`` that takes no memory (every entry reads 0)."""
        p = torch.nn.Parameter(torch.zeros((), dtype=dtype, device=self.device).expand(like.shape), requires_grad=False)
        self.placeholders[id(p)] = entry.name
        self._kept.append(p)
        return p

    def record(self, dtypes: Sequence[torch.dtype], inputs: Any, values: Values, modes: Sequence[Any]) -> list[Recording]:
        """One pass per dtype (in lockstep) that keeps each block call's output and where its
        inputs came from. A parameter read outside its block's call is added to
        :attr:`glue` and the passes repeated."""
        while True:
            lanes = [Lane(dt, values, mode, follow=_Follow(self.placeholders)) for dt, mode in zip(dtypes, modes)]
            self.run_lanes(inputs, lanes)
            read = set().union(*(lane.follow.read for lane in lanes if lane.follow is not None))
            if not read - self.glue:
                break
            self.glue |= read
        return [Recording(lane.calls, lane.outputs, lane.needs, lane.final, lane.follow.of(lane.final),  # type: ignore[union-attr]
                          lane.part_needs, lane.follow.parts_of(lane.final))  # type: ignore[union-attr]
                for lane in lanes]


@attrs.define(eq=False)
class Lane:
    """One pass of :meth:`Streamed.run_lanes`: its precision, values and range, and what it gave."""

    dtype: torch.dtype
    values: Values
    mode: Any = None
    replay: Recording | None = None
    span: tuple[int, int] | None = None
    follow: _Follow | None = None
    calls: list[int] = attrs.field(factory=list)
    outputs: list[Any] = attrs.field(factory=list)
    needs: list[frozenset[int]] = attrs.field(factory=list)
    part_needs: list[frozenset[tuple[int, int]]] = attrs.field(factory=list)
    out: Any = None
    final: Any = None
    error: BaseException | None = None

    def stops(self) -> bool:
        return self.replay is not None and self.span is not None and self.replay.stops_at(*self.span)


class _Baton:
    """Whose turn it is among the lanes: passed round, skipping the lanes that are done."""

    def __init__(self, n: int) -> None:
        self.cv = threading.Condition()
        self.holder = 0
        self.alive = [True] * n

    def wait(self, i: int) -> None:
        with self.cv:
            self.cv.wait_for(lambda: self.holder == i)

    def pass_on(self, i: int) -> None:
        with self.cv:
            n = len(self.alive)
            self.holder = next((j for j in ((i + d) % n for d in range(1, n + 1)) if self.alive[j]), i)
            self.cv.notify_all()

    def leave(self, i: int) -> None:
        with self.cv:
            self.alive[i] = False
            if self.holder == i:
                n = len(self.alive)
                self.holder = next((j for j in ((i + d) % n for d in range(1, n + 1)) if self.alive[j]), -1)
            self.cv.notify_all()


class _Stack:
    """Several torch function modes entered together."""

    def __init__(self, modes: Sequence[Any]) -> None:
        self.modes = modes

    def __enter__(self) -> None:
        for m in self.modes:
            m.__enter__()

    def __exit__(self, *exc: Any) -> None:
        for m in reversed(self.modes):
            m.__exit__(*exc)


def _clone(x: Any) -> Any:
    if isinstance(x, torch.Tensor):
        return x.clone()
    if isinstance(x, tuple) and hasattr(x, "_fields"):
        return type(x)(*(_clone(v) for v in x))
    if isinstance(x, (tuple, list)):
        return type(x)(_clone(v) for v in x)
    return x


def _to(x: Any, device: torch.device) -> Any:
    if isinstance(x, torch.Tensor):
        return x.to(device)
    if isinstance(x, Mapping):
        return {k: _to(v, device) for k, v in x.items()}
    if isinstance(x, (tuple, list)):
        return type(x)(_to(v, device) for v in x)
    return x
