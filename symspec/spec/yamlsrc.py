"""YAML that remembers where every value came from.

PyYAML's ``compose`` gives the node tree with marks; we construct plain Python values
from it and record, for every key path, the line and column it sits at, so that
errors can say ``my_spec.yaml:14:5: spaces.ff.group: ...``.

Hostile or broken input is refused with a located :class:`SpecError` before it can
exhaust memory or the stack: nesting deeper than :data:`MAX_DEPTH` (composition and
construction recurse once per level), aliases that would expand to more than
:data:`MAX_ALIAS_NODES` nodes (a "billion laughs" document of a few hundred bytes
expands to 10**9; its expanded size is counted on the shared node graph, before any
value is built), an alias inside its own anchor, scalars that do not read as their
tag says (``!!int abc``), and files that are not UTF-8.
"""

from __future__ import annotations

import codecs
from collections.abc import Iterable, Iterator
from typing import Any

import attrs
import yaml

from ..errors import Diagnostic, Location, SpecError, join_path, suggest

KeyPath = tuple[str | int, ...]

#: the deepest nesting of mappings and lists a spec may have (the built-in specs nest 7
#: levels deep); deeper documents are refused before composition recurses into them
MAX_DEPTH = 64
#: how many nodes aliases may add to a document when expanded
MAX_ALIAS_NODES = 100_000
#: "did you mean" hints computed per file
MAX_HINTS = 50


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
    #: a scalar did not read as its tag says (the document is refused after construction)
    unreadable: bool = False
    #: reads scalars; one per document, as it caches what it built by node
    constructor: yaml.constructor.SafeConstructor = attrs.field(factory=yaml.constructor.SafeConstructor, repr=False, eq=False)
    #: "did you mean" searches left (see :meth:`suggest`)
    hints_left: int = MAX_HINTS

    def loc(self, path: KeyPath, at_key: bool = False) -> Location:
        p = tuple(path)
        table = self.key_marks if at_key and p in self.key_marks else self.marks
        while p and p not in table:
            p = p[:-1]
        line, col = table.get(p, (0, 0))
        return Location(self.file, line, col, path_str(tuple(path)))

    def suggest(self, name: str, candidates: Iterable[str], n: int = 1, aliases: dict[str, str] | None = None) -> str | None:
        """:func:`~symspec.errors.suggest` for the first :data:`MAX_HINTS` calls on this
        file, then None: a file with a million wrong names must not cost a million fuzzy
        searches."""
        if self.hints_left <= 0:
            return None
        self.hints_left -= 1
        return suggest(name, candidates, n=n, aliases=aliases)

    def error(self, path: KeyPath, message: str, hint: str | None = None, at_key: bool = False) -> None:
        self.diagnostics.append(Diagnostic(self.loc(path, at_key), message, hint))

    def walk(self, path: KeyPath = ()) -> Iterator[KeyPath]:
        yield from (p for p in self.marks if p[: len(path)] == path)


def spec_error(file: str, diagnostics: list[Diagnostic]) -> SpecError:
    """The error for a file's problems: one problem is one line; several get a headline
    that counts them."""
    headline = f"{file}: {len(diagnostics)} error(s) in spec" if len(diagnostics) != 1 else ""
    return SpecError(diagnostics, headline=headline)


def decode_spec(data: bytes, file: str) -> str:
    """The text of a spec file read as ``data``: UTF-8 (a UTF-8 byte-order mark is
    allowed); anything else is a located :class:`SpecError`."""
    for bom, name in ((codecs.BOM_UTF32_LE, "UTF-32"), (codecs.BOM_UTF32_BE, "UTF-32"),
                      (codecs.BOM_UTF16_LE, "UTF-16"), (codecs.BOM_UTF16_BE, "UTF-16")):
        if data.startswith(bom):  # UTF-32 LE starts with the UTF-16 LE mark: test it first
            raise SpecError([], headline=f"{file}: the file is {name} text (it starts with a {name} byte-order mark); "
                                         "spec files are UTF-8: save it as UTF-8")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        start = data.rfind(b"\n", 0, e.start) + 1
        line = data.count(b"\n", 0, e.start) + 1
        col = len(data[start : e.start].decode("utf-8", errors="replace")) + 1
        raise SpecError([Diagnostic(Location(file, line, col), f"the file is not UTF-8 text (byte 0x{data[e.start]:02x} is not valid UTF-8)",
                                    "save it as UTF-8")]) from None


class _Refused(Exception):
    """A document refused while it is composed (too deep, an alias inside its anchor)."""

    def __init__(self, mark: Any, message: str, hint: str | None = None) -> None:
        super().__init__(message)
        self.mark, self.message, self.hint = mark, message, hint


class _Limited:
    """PyYAML's composer with a depth limit, no alias inside its own anchor, and a record
    of the first alias: mixed in before a loader's composer."""

    def _start_limits(self) -> None:
        self.depth = 0
        self.open_anchors: list[str] = []
        #: the first alias's mark (where an oversized expansion is reported)
        self.first_alias: Any = None

    def compose_node(self, parent: Any, index: Any) -> Any:
        event = self.peek_event()
        if isinstance(event, yaml.AliasEvent):
            if event.anchor in self.open_anchors:  # a cycle: expanding it would never end
                raise _Refused(event.start_mark, f"the alias *{event.anchor} is inside its own anchor &{event.anchor}",
                               "a spec is a tree: an alias may only repeat a finished value")
            if self.first_alias is None:
                self.first_alias = event.start_mark
            return super().compose_node(parent, index)  # type: ignore[misc]
        if self.depth >= MAX_DEPTH:
            raise _Refused(event.start_mark, f"the document nests deeper than {MAX_DEPTH} levels",
                           "a spec nests a few levels deep; is this the right file?")
        anchor = getattr(event, "anchor", None)
        self.depth += 1
        if anchor is not None:
            self.open_anchors.append(anchor)
        try:
            return super().compose_node(parent, index)  # type: ignore[misc]
        finally:
            self.depth -= 1
            if anchor is not None:
                self.open_anchors.pop()


class _Loader(_Limited, yaml.SafeLoader):
    """PyYAML's parser and composer, with the limits."""

    def __init__(self, stream: str) -> None:
        yaml.SafeLoader.__init__(self, stream)
        self._start_limits()


_FastLoader: Any = None
if yaml.__with_libyaml__:

    class _FastLoader(_Limited, yaml.cyaml.CParser, yaml.composer.Composer, yaml.resolver.Resolver):  # type: ignore[no-redef]
        """libyaml's parser under PyYAML's composer, with the limits: the parser is most of
        the time (a spec with 100,000 parameters loads in 2 s instead of 9), and libyaml's
        own composer, in C, is out of reach of the limits."""

        def __init__(self, stream: str) -> None:
            yaml.cyaml.CParser.__init__(self, stream)
            yaml.composer.Composer.__init__(self)
            yaml.resolver.Resolver.__init__(self)
            self._start_limits()

        get_single_node = yaml.composer.Composer.get_single_node
        compose_document = yaml.composer.Composer.compose_document
        check_node = yaml.composer.Composer.check_node
        get_node = yaml.composer.Composer.get_node


def _expanded_size(root: yaml.Node) -> tuple[int, int]:
    """(nodes once every alias is expanded, distinct nodes) of a composed document,
    counted on the shared node graph without expanding it (iteratively: no recursion)."""
    sizes: dict[int, int] = {}
    stack: list[tuple[yaml.Node, bool]] = [(root, False)]
    while stack:
        node, children_done = stack.pop()
        if children_done:
            sizes[id(node)] = 1 + sum(sizes[id(c)] for c in _children(node))
        elif id(node) not in sizes:
            stack.append((node, True))
            stack.extend((c, False) for c in _children(node) if id(c) not in sizes)
    return sizes[id(root)], len(sizes)


def _children(node: yaml.Node) -> list[yaml.Node]:
    if isinstance(node, yaml.MappingNode):
        return [n for pair in node.value for n in pair]
    if isinstance(node, yaml.SequenceNode):
        return list(node.value)
    return []


def _mark_loc(file: str, mark: Any) -> Location:
    return Location(file, (mark.line + 1) if mark else 0, (mark.column + 1) if mark else 0)


def load_source(text: str, file: str = "<string>") -> Source:
    """Parse ``text``; YAML syntax errors become a located :class:`SpecError`."""
    node, first_alias = _compose(text, file)
    src = Source(file, None)
    if node is None:
        src.data = None
        return src
    total, distinct = _expanded_size(node) if first_alias is not None else (0, 0)  # no alias: nothing to expand
    if total - distinct > MAX_ALIAS_NODES:
        raise SpecError([Diagnostic(_mark_loc(file, first_alias),
                                    f"the document's aliases expand to {total:,} values; at most {MAX_ALIAS_NODES:,} may come from aliases",
                                    "write the repeated parts out, or repeat fewer of them")])
    src.data = _construct(node, (), src)
    if src.unreadable:  # the structure would only repeat these errors in other words
        raise spec_error(file, src.diagnostics)
    return src


def _compose(text: str, file: str) -> tuple[yaml.Node | None, Any]:
    """The document's node graph (aliases shared, not expanded) and its first alias's
    mark; libyaml's parser when it is there, PyYAML's for the messages of a broken file."""
    if _FastLoader is not None:
        fast = _FastLoader(text)
        try:
            return fast.get_single_node(), fast.first_alias
        except _Refused as e:
            raise SpecError([Diagnostic(_mark_loc(file, e.mark), e.message, e.hint)]) from None
        except yaml.YAMLError:
            pass  # PyYAML's messages are the documented ones (and the hints read them): parse again
        finally:
            fast.dispose()
    try:
        loader = _Loader(text)  # it reads the whole text at once and refuses control characters here
    except yaml.reader.ReaderError as e:
        line = text.count("\n", 0, e.position) + 1
        col = e.position - text.rfind("\n", 0, e.position)
        raise SpecError([Diagnostic(Location(file, line, col), f"invalid YAML: character {e.character if isinstance(e.character, int) else ord(e.character):#06x} is not allowed in a YAML file",
                                    "is this a text file?")]) from None
    try:
        node = loader.get_single_node()
    except _Refused as e:
        raise SpecError([Diagnostic(_mark_loc(file, e.mark), e.message, e.hint)]) from None
    except yaml.MarkedYAMLError as e:
        mark = e.problem_mark
        loc = Location(file, (mark.line + 1) if mark else 0, (mark.column + 1) if mark else 0)
        hint = None
        if e.problem and "'['" in e.problem:
            hint = 'inside a [...] list, quote axis expressions with an index: ["ff[i]", "resid*"] (or use a block list)'
        raise SpecError([Diagnostic(loc, f"invalid YAML: {e.problem or e}", hint)]) from None
    except yaml.YAMLError as e:  # pragma: no cover - the reader checked the text; the rest is marked
        raise SpecError([Diagnostic(Location(file), f"invalid YAML: {e}")]) from None
    finally:
        loader.dispose()
    return node, loader.first_alias


def _mark(node: yaml.Node) -> tuple[int, int]:
    return node.start_mark.line + 1, node.start_mark.column + 1


def _construct(node: yaml.Node, path: KeyPath, src: Source) -> Any:
    src.marks[path] = _mark(node)
    if isinstance(node, yaml.MappingNode):
        out: dict[Any, Any] = {}
        for key_node, value_node in node.value:
            if not isinstance(key_node, yaml.ScalarNode):
                src.diagnostics.append(Diagnostic(Location(src.file, *_mark(key_node), path_str(path)), "keys must be plain values"))
                continue
            key = _construct_scalar(key_node, path, src)
            if key is _UNREADABLE:
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
    return _construct_scalar(node, path, src)


_UNREADABLE = object()


def _construct_scalar(node: yaml.Node, path: KeyPath, src: Source) -> Any:
    """The scalar's value, or (with a located diagnostic) ``_UNREADABLE`` when it does
    not read as its tag says: ``!!int abc``, ``!!bool maybe``, an unknown ``!tag``."""
    try:
        return src.constructor.construct_object(node, deep=True)
    except (yaml.YAMLError, ValueError, KeyError, TypeError, OverflowError) as e:
        tag = str(node.tag).replace("tag:yaml.org,2002:", "!!")
        if tag == "!!merge":
            message, hint = "YAML merge keys ('<<') are not supported", "write the merged keys out"
        elif isinstance(e, yaml.constructor.ConstructorError) and "could not determine a constructor" in str(e):
            message, hint = f"unknown tag '{tag}'", "a spec holds plain YAML values: strings, numbers, lists, mappings"
        else:
            shown = node.value if len(node.value) <= 40 else node.value[:37] + "..."
            message, hint = f"{shown!r} is not a valid {tag}", None
        src.diagnostics.append(Diagnostic(Location(src.file, *_mark(node), path_str(path)), message, hint))
        src.unreadable = True
        return _UNREADABLE
