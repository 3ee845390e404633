"""Axis classes: a union-find over the feature axes of a traced graph.

Every dimension of every tensor in the graph is described by a *layout*: a tuple of
atoms (outer first) whose sizes multiply to the dimension's size. Two atoms are in one
class when the graph forces them to move together under any symmetry (an addition, an
elementwise product, a layer reading an activation with one axis of its weight). An atom
can be refined two ways, each remembered on its class:

- a product split (``view(B, T, H, dh)``: the atom of size H*dh becomes (h, w));
- segments (``split``, ``slice``, ``cat``: the atom of size 3d is q, k and v side by side).

Classes with the same refinement of the same child classes are one class (congruence:
what acts the same way on every piece acts the same way on the whole), so that a
rotate_half's ``cat`` of the two halves is recognised as the head it was cut from.

Tags record what the graph does to a class (an elementwise nonlinearity, a LayerNorm, a
multiplication by a position-dependent table...); :mod:`.lattice` turns them into the
largest group that can be true.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

Layout = tuple[int, ...]


class Axes:
    """Union-find over atoms with sizes, tags, product splits and segments."""

    def __init__(self) -> None:
        self.parent: list[int] = []
        self.size: list[int] = []
        self.tags: dict[int, set[str]] = {}
        #: root -> product sizes -> child atoms
        self.splits: dict[int, dict[tuple[int, ...], tuple[int, ...]]] = {}
        #: root -> (start, end) -> child atom
        self.segs: dict[int, dict[tuple[int, int], int]] = {}
        #: root -> start -> the atom of every other entry from start (x[..., start::2])
        self.every: dict[int, dict[int, int]] = {}
        #: child atom -> (parent atom, "split" | "seg" | "every", key)
        self.origin: dict[int, tuple[int, str, object]] = {}
        #: dual pairs of classes contracted with each other (q·k)
        self.pairs: list[tuple[int, int]] = []
        self._pending: list[tuple[int, int]] = []

    # -- atoms -------------------------------------------------------------------------
    def fresh(self, size: int, *tags: str) -> int:
        a = len(self.parent)
        self.parent.append(a)
        self.size.append(int(size))
        if tags:
            self.tags[a] = set(tags)
        return a

    def find(self, a: int) -> int:
        root = a
        while self.parent[root] != root:
            root = self.parent[root]
        while self.parent[a] != root:
            self.parent[a], a = root, self.parent[a]
        return root

    def tag(self, atoms: Iterable[int], *tags: str) -> None:
        for a in atoms:
            self.tags.setdefault(self.find(a), set()).update(tags)

    def tags_of(self, a: int) -> set[str]:
        return self.tags.get(self.find(a), set())

    # -- refinements -------------------------------------------------------------------
    def split(self, a: int, sizes: Sequence[int]) -> tuple[int, ...]:
        """The product split of ``a`` into ``sizes`` (outer first), made once per class."""
        sizes = tuple(int(s) for s in sizes)
        r = self.find(a)
        memo = self.splits.setdefault(r, {})
        if sizes not in memo:
            kids = tuple(self.fresh(s) for s in sizes)
            for k, c in enumerate(kids):
                self.origin[c] = (r, "split", (sizes, k))
            memo[sizes] = kids
        return memo[sizes]

    def seg(self, a: int, start: int, end: int) -> int:
        """The segment [start, end) of ``a``: ``a`` itself when it is the whole, else a child
        (inside an existing child that contains it, if there is one)."""
        r = self.find(a)
        if start == 0 and end == self.size[r]:
            return r
        memo = self.segs.setdefault(r, {})
        if (start, end) in memo:
            return memo[(start, end)]
        for (s, e), c in list(memo.items()):
            if s <= start and end <= e and (s, e) != (start, end):
                return self.seg(c, start - s, end - s)
        c = self.fresh(end - start)
        self.origin[c] = (r, "seg", (start, end))
        memo[(start, end)] = c
        return c

    def every_other(self, a: int, start: int) -> int:
        """The atom of ``x[..., start::2]`` along ``a`` (interleaved rotary pairs)."""
        r = self.find(a)
        memo = self.every.setdefault(r, {})
        if start not in memo:
            c = self.fresh(self.size[r] // 2)
            self.origin[c] = (r, "every", start)
            memo[start] = c
        return memo[start]

    def tiling(self, a: int) -> list[tuple[int, int, int]] | None:
        """The segments of ``a`` as (start, end, atom) when they tile it without overlap."""
        r = self.find(a)
        memo = self.segs.get(r)
        if not memo:
            return None
        # the coarsest tiling from 0: at each point the longest segment that starts there
        out, pos = [], 0
        by_start: dict[int, tuple[int, int]] = {}
        for (s, e), c in memo.items():
            if s not in by_start or e > by_start[s][0]:
                by_start[s] = (e, c)
        while pos < self.size[r]:
            if pos not in by_start:
                return None
            e, c = by_start[pos]
            out.append((pos, e, c))
            pos = e
        return out if len(out) > 1 else None

    # -- union -------------------------------------------------------------------------
    def unify(self, a: int, b: int) -> None:
        self._pending.append((a, b))
        while self._pending:
            x, y = self._pending.pop()
            rx, ry = self.find(x), self.find(y)
            if rx == ry:
                continue
            if self.size[rx] != self.size[ry]:
                self.tag([rx, ry], "opaque:size")
                continue
            self.parent[ry] = rx
            if ry in self.tags:
                self.tags.setdefault(rx, set()).update(self.tags.pop(ry))
            for sizes, kids in self.splits.pop(ry, {}).items():
                mine = self.splits.setdefault(rx, {})
                if sizes in mine:
                    self._pending.extend(zip(mine[sizes], kids))
                else:
                    mine[sizes] = kids
            for memo in (self.every, self.segs):  # the same piece of both: one class
                mine_m = memo.setdefault(rx, {})
                for key, kid in memo.pop(ry, {}).items():
                    if key in mine_m:
                        self._pending.append((mine_m[key], kid))
                    else:
                        mine_m[key] = kid

    def unify_layouts(self, la: Layout, lb: Layout) -> bool:
        """Make two layouts of one size the same classes, splitting atoms where their
        boundaries differ; False (and both tagged opaque) where they cannot be aligned."""
        if len(la) == 1 and len(lb) == 1 and self.size[self.find(la[0])] == self.size[self.find(lb[0])]:
            self.unify(la[0], lb[0])  # also two size-1 pieces of a feature axis (a rotated pair's halves)
            return True
        qa, qb = [a for a in la if self.size[a] > 1], [b for b in lb if self.size[b] > 1]
        while qa and qb:
            a, b = qa.pop(0), qb.pop(0)
            na, nb = self.size[self.find(a)], self.size[self.find(b)]
            if na == nb:
                self.unify(a, b)
            elif na > nb and na % nb == 0:
                head, rest = self.split(a, (nb, na // nb))
                self.unify(head, b)
                qa.insert(0, rest)
            elif nb > na and nb % na == 0:
                head, rest = self.split(b, (na, nb // na))
                self.unify(a, head)
                qb.insert(0, rest)
            else:
                self.tag([a, b, *qa, *qb], "opaque:layout")
                return False
        if qa or qb:
            self.tag([*qa, *qb], "opaque:layout")
            return False
        return True

    def regroup(self, layouts: Sequence[Layout], sizes: Sequence[int]) -> list[Layout]:
        """A reshape: the atoms of ``layouts`` (row-major) regrouped into dims of ``sizes``,
        splitting an atom that straddles two dims."""
        queue = [a for lay in layouts for a in lay if self.size[self.find(a)] > 1]
        out: list[Layout] = []
        for s in sizes:
            s = int(s)
            got: list[int] = []
            prod = 1
            while prod < s and queue:
                a = queue.pop(0)
                n = self.size[self.find(a)]
                if prod * n <= s and s % (prod * n) == 0:
                    got.append(a)
                    prod *= n
                elif n % (s // prod) == 0 and s % prod == 0:
                    head, rest = self.split(a, (s // prod, n // (s // prod)))
                    got.append(head)
                    prod = s
                    queue.insert(0, rest)
                else:
                    self.tag([a, *queue, *got], "opaque:reshape")
                    return self._opaque(sizes)
            if prod != s:
                self.tag(got, "opaque:reshape")
                return self._opaque(sizes)
            out.append(tuple(got))
        return out

    def _opaque(self, sizes: Sequence[int]) -> list[Layout]:
        return [(self.fresh(int(v), "opaque:reshape"),) if int(v) > 1 else () for v in sizes]

    # -- congruence --------------------------------------------------------------------
    def close(self) -> None:
        """Classes refined the same way into the same classes become one (to a fixpoint)."""
        changed = True
        while changed:
            changed = False
            seen: dict[tuple, int] = {}
            for r in {self.find(a) for a in range(len(self.parent))}:
                sigs = []
                for sizes, kids in self.splits.get(r, {}).items():
                    sigs.append(("split", sizes, tuple(self.find(k) for k in kids)))
                tiles = self.tiling(r)
                if tiles:
                    sigs.append(("seg", tuple((s, e, self.find(c)) for s, e, c in tiles)))
                for sig in sigs:
                    other = seen.get(sig)
                    if other is None:
                        seen[sig] = r
                    elif self.find(other) != self.find(r):
                        self.unify(other, r)
                        changed = True

    def descendants(self, a: int) -> list[int]:
        """``a``'s class and every class its refinements reach."""
        out, todo, seen = [], [self.find(a)], set()
        while todo:
            r = self.find(todo.pop())
            if r in seen:
                continue
            seen.add(r)
            out.append(r)
            for kids in self.splits.get(r, {}).values():
                todo.extend(kids)
            todo.extend(self.segs.get(r, {}).values())
            todo.extend(self.every.get(r, {}).values())
        return out


def numel(shape: Sequence[int]) -> int:
    return math.prod(int(s) for s in shape)
