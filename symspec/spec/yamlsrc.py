"""YAML that remembers where every value came from.

PyYAML's ``compose`` gives the node tree with marks; we construct plain Python values
from it and record, for every key path, the line and column it sits at, so that
errors can say ``specs/gpt.yaml:14:5: spaces.ff.group: ...``.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import attrs
import yaml

from ..errors import Diagnostic, Location, SpecError, join_path

KeyPath = tuple[str | int, ...]


def path_str(path: KeyPath) -> str:
    out = ""
    for k in path:
        out = join_path(out, k)
    return out


@attrs.define
class Source:
    """The parsed document and the location of each key path in it."""

    file: str
    data: Any
    #: where each value starts
    marks: dict[KeyPath, tuple[int, int]] = attrs.field(factory=dict)
    #: where each mapping key starts
    key_marks: dict[KeyPath, tuple[int, int]] = attrs.field(factory=dict)
    diagnostics: list[Diagnostic] = attrs.field(factory=list)

    def loc(self, path: KeyPath, at_key: bool = False) -> Location:
        p = tuple(path)
        table = self.key_marks if at_key and p in self.key_marks else self.marks
        while p and p not in table:
            p = p[:-1]
        line, col = table.get(p, (0, 0))
        return Location(self.file, line, col, path_str(tuple(path)))

    def error(self, path: KeyPath, message: str, hint: str | None = None, at_key: bool = False) -> None:
        self.diagnostics.append(Diagnostic(self.loc(path, at_key), message, hint))

    def walk(self, path: KeyPath = ()) -> Iterator[KeyPath]:
        yield from (p for p in self.marks if p[: len(path)] == path)


def load_source(text: str, file: str = "<string>") -> Source:
    """Parse ``text``; YAML syntax errors become a located :class:`SpecError`."""
    try:
        node = yaml.compose(text, Loader=yaml.SafeLoader)
    except yaml.MarkedYAMLError as e:
        mark = e.problem_mark
        loc = Location(file, (mark.line + 1) if mark else 0, (mark.column + 1) if mark else 0)
        hint = None
        if e.problem and "'['" in e.problem:
            hint = 'inside a [...] list, quote axis expressions with an index: ["ff[i]", "resid*"] (or use a block list)'
        raise SpecError([Diagnostic(loc, f"invalid YAML: {e.problem or e}", hint)]) from None
    except yaml.YAMLError as e:  # pragma: no cover - composer errors are marked
        raise SpecError([Diagnostic(Location(file), f"invalid YAML: {e}")]) from None
    src = Source(file, None)
    if node is None:
        src.data = None
        return src
    src.data = _construct(node, (), src)
    return src


def _mark(node: yaml.Node) -> tuple[int, int]:
    return node.start_mark.line + 1, node.start_mark.column + 1


_scalar_constructor = yaml.SafeLoader("")


def _construct(node: yaml.Node, path: KeyPath, src: Source) -> Any:
    src.marks[path] = _mark(node)
    if isinstance(node, yaml.MappingNode):
        out: dict[Any, Any] = {}
        for key_node, value_node in node.value:
            key = _construct_scalar(key_node) if isinstance(key_node, yaml.ScalarNode) else None
            if key is None and not isinstance(key_node, yaml.ScalarNode):
                src.diagnostics.append(Diagnostic(Location(src.file, *_mark(key_node), path_str(path)), "keys must be plain values"))
                continue
            if not isinstance(key, (str, int)):
                key = str(key)
            child = (*path, key)
            if key in out:
                src.diagnostics.append(Diagnostic(Location(src.file, *_mark(key_node), path_str(child)), f"duplicate key '{key}'"))
            src.key_marks[child] = _mark(key_node)
            out[key] = _construct(value_node, child, src)
        return out
    if isinstance(node, yaml.SequenceNode):
        items = []
        for i, item in enumerate(node.value):
            items.append(_construct(item, (*path, i), src))
        return items
    return _construct_scalar(node)


def _construct_scalar(node: yaml.Node) -> Any:
    return _scalar_constructor.construct_object(node, deep=True)
