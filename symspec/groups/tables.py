"""Per-kind tables: what one concern knows of each group kind, and how it says it knows nothing.

Every concern that depends on the group kind (the weight-matching solver, the learned
parametrisation, the width lift, the certificate's bound, inference's candidate groups)
keeps one dict keyed by the kind's registry name (``"S"``, ``"Heads"``), next to its own
code. A kind the concern cannot serve gets an explicit :class:`NoEntry` with the reason,
so that ``tests/test_kinds.py`` can check that every registered kind is covered by every
table, and so that a consumer refuses such a kind in one line that names the kind, the
concern and why (:func:`kind_entry`), instead of falling through an isinstance chain.

>>> table = {"S": "assignment", "RoPE": NoEntry("a commutant has no permutations")}
>>> kind_entry(table, "S", "toy solver")
'assignment'
>>> kind_entry(table, "RoPE", "toy solver")
Traceback (most recent call last):
...
symspec.errors.GroupError: no toy solver for group kind 'RoPE': a commutant has no permutations
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TypeVar

import attrs

from ..errors import GroupError
from .base import Group

T = TypeVar("T")


@attrs.frozen
class NoEntry:
    """A table's explicit "this kind has none": ``reason`` says why, for the error message."""

    reason: str


def has_entry(table: Mapping[str, object], kind: str) -> bool:
    """True when ``table`` serves ``kind`` (an entry that is not a :class:`NoEntry`)."""
    return kind in table and not isinstance(table[kind], NoEntry)


def missing_entry(table: Mapping[str, object], group: Group | str, concern: str, prefix: str = "") -> str | None:
    """None when ``table`` serves ``group``'s kind; else the one line that says it does not:
    ``prefix``, the concern, the kind, and the table's reason or the kinds that have an entry."""
    kind = group if isinstance(group, str) else group.kind
    value = table.get(kind)
    if value is not None and not isinstance(value, NoEntry):
        return None
    if isinstance(value, NoEntry):
        why = value.reason
    else:
        served = sorted(k for k in table if has_entry(table, k))
        why = f"none registered (kinds with one: {', '.join(served) or 'none'})"
    shown = "" if isinstance(group, str) or str(group) in prefix else f" ({group})"
    return f"{prefix}no {concern} for group kind '{kind}'{shown}: {why}"


def kind_entry(table: Mapping[str, T | NoEntry], group: Group | str, concern: str, *,
               error: type[Exception] = GroupError, prefix: str = "") -> T:
    """The entry of ``group``'s kind in ``table``, or ``error`` with :func:`missing_entry`'s line."""
    why = missing_entry(table, group, concern, prefix)
    if why is not None:
        raise error(why)
    return table[group if isinstance(group, str) else group.kind]  # type: ignore[return-value]


__all__ = ["NoEntry", "has_entry", "kind_entry", "missing_entry"]
