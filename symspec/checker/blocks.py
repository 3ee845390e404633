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

from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

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
        self.keep: list[Any] = []  # holds what origin's ids refer to, so that no id is reused
        self.placeholders = placeholders
        self.read: set[str] = set()

    def of(self, x: Any) -> frozenset[int]:
        out: frozenset[int] = frozenset()
        for t in _tensors(x):
            out |= self.origin.get(id(t), frozenset())
        return out

    def mark(self, x: Any, origin: frozenset[int]) -> None:
        self.keep.append(x)
        for t in _tensors(x):
            self.origin[id(t)] = origin

    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if any(True for _ in _tensors(out)):
            self.read.update(self.placeholders[id(t)] for t in _tensors((args, kwargs)) if id(t) in self.placeholders)
        if self.depth == 0:
            origin = self.of((args, kwargs))
            if origin:
                self.mark(out, origin)
        return out


@attrs.define
class Recording:
    """One pass: each call's block, output and the calls its inputs came from; the model's output."""

    calls: list[int]
    outputs: list[Any]
    needs: list[frozenset[int]]
    final: Any
    final_needs: frozenset[int]

    def can_stop(self, first: int, last: int) -> bool:
        """Does only call ``last``'s output carry the range's result downstream?"""
        inner = set(range(first, last))
        later = [*self.needs[last + 1:], self.final_needs]
        return not any(n & inner for n in later)


#: the values of one block's (or the glue's) entries for a pass: names -> tensors
Values = Callable[[Sequence[str]], Mapping[str, torch.Tensor]]


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

    def block_of(self) -> dict[str, int]:
        """Parameter name -> block index (names outside every block are absent)."""
        return {e.name: k for k, es in enumerate(self.entries) for e in es}

    def run(self, dtype: torch.dtype, inputs: Any, values: Values, mode: Any = None, *,
            replay: Recording | None = None, span: tuple[int, int] | None = None, follow: _Follow | None = None) -> Any:
        """One pass; returns the model's output, or call ``span[1]``'s output when ``replay``
        allows stopping there. Calls before ``span[0]`` return ``replay``'s outputs."""
        state = [(m, m.training) for m in self.model.modules()]
        self.placeholders.clear()
        self._kept.clear()
        original = {id(e): e.get() for es in self.entries for e in es}
        original.update({id(e): e.get() for e in self.rest})
        self._original = original
        held = [e for es in self.entries for e in es if e.name in self.glue] + self.rest
        calls: list[int] = []
        stop = replay is not None and span is not None and replay.can_stop(*span)
        box: dict[str, Any] = {}

        def wrap(k: int, block: torch.nn.Module) -> Callable[..., Any]:
            def forward(*args: Any, **kwargs: Any) -> Any:
                n = len(calls)
                calls.append(k)
                if replay is not None and span is not None and n < span[0]:
                    return _clone(replay.outputs[n])
                if follow is not None:
                    need, follow.depth = follow.of((args, kwargs)), follow.depth + 1
                mine = [e for e in self.entries[k] if e.name not in self.glue]
                try:
                    for e, v in zip(mine, self._values(values, mine, dtype)):
                        e.put(v)
                    out = type(block).forward(block, *args, **kwargs)
                finally:
                    for e in mine:
                        e.put(self._placeholder(e, original[id(e)], dtype))
                    if follow is not None:
                        follow.depth -= 1
                if follow is not None:
                    box.setdefault("needs", []).append(need)
                    box.setdefault("outputs", []).append(out)
                    follow.mark(out, frozenset({n}))
                if stop and span is not None and n == span[1]:
                    box["stopped"] = out
                    raise _Stop
                return out
            return forward

        try:
            self.model.eval()
            for e, v in zip(held, self._values(values, held, dtype)):
                e.put(v)
            for k, (_, block) in enumerate(self.blocks):
                for e in self.entries[k]:
                    if e.name not in self.glue:
                        e.put(self._placeholder(e, original[id(e)], dtype))
                if block is not self.model:
                    block.forward = wrap(k, block)  # type: ignore[method-assign]
            if self.blocks[0][1] is self.model:
                out = self._whole(dtype, inputs, values, mode)
                self.last = {"calls": [], "final": out}
                return out
            modes = [m for m in (mode, follow) if m is not None]
            try:
                out = call_forward(self.model, cast_inputs(_to(inputs, self.device), dtype), _Stack(modes))
            except _Stop:
                return box["stopped"]
            if follow is not None:
                box["calls"], box["final"] = calls, out
                self.last = box
            return out
        finally:
            for _, block in self.blocks:
                block.__dict__.pop("forward", None)
            self._kept.clear()
            for es in [*self.entries, self.rest]:
                for e in es:
                    e.put(original[id(e)])
            for m, training in state:
                m.training = training

    def _whole(self, dtype: torch.dtype, inputs: Any, values: Values, mode: Any) -> Any:
        """A model without a stack of layers: one block, the whole model."""
        mine = [e for e in self.entries[0] if e.name not in self.glue]
        for e, v in zip(mine, self._values(values, mine, dtype)):
            e.put(v)
        return call_forward(self.model, cast_inputs(_to(inputs, self.device), dtype), mode)

    def _values(self, values: Values, entries: Sequence[Entry], dtype: torch.dtype) -> list[torch.Tensor]:
        got = values([e.name for e in entries])
        out = []
        for e in entries:
            v = got.get(e.name)
            if v is None:  # not bound by the spec and not canonicalised: the model's own value
                v = self._original[id(e)]
            out.append(v.detach().to(device=self.device, dtype=dtype))
        return out

    def _placeholder(self, entry: Entry, like: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """A tensor of ``like``'s shape and ``dtype`` that takes no memory (every entry reads 0)."""
        p = torch.nn.Parameter(torch.zeros((), dtype=dtype, device=self.device).expand(like.shape), requires_grad=False)
        self.placeholders[id(p)] = entry.name
        self._kept.append(p)
        return p

    def record(self, dtype: torch.dtype, inputs: Any, values: Values, mode: Any = None) -> Recording:
        """One pass that keeps each block call's output and where its inputs came from. A
        parameter read between blocks is added to :attr:`glue` and the pass repeated."""
        while True:
            follow = _Follow(self.placeholders)
            self.run(dtype, inputs, values, mode, follow=follow)
            if not follow.read - self.glue:
                break
            self.glue |= follow.read
        box = self.last
        del self.last
        return Recording(box["calls"], box.get("outputs", []), box.get("needs", []), box["final"], follow.of(box["final"]))


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
