"""The walk's rules for ops that move axes: copies, reshapes, permutations, slices,
splits, selections, concatenations and stacks (a mixin of :class:`~.walk.Reader`)."""

from __future__ import annotations

import math
from typing import Any

import torch.fx as fx

from .axes import Layout
from .facts import (
    opname,
    shape_of,
)


class ShapeRules:
    """Rules for ops that regroup, reorder, cut or join axes (see :mod:`.walk`)."""

    # -- shape ops ---------------------------------------------------------------------
    def transparent(self, n: fx.Node, shape: Any) -> None:
        x = n.args[0] if n.args else None
        lay = self.L(x)
        if lay is None or shape is None or len(lay) != len(shape):
            return self.opaque(n, opname(n)) if self.feature[n.name] else None
        self.lay[n.name] = list(lay)
        if isinstance(x, fx.Node):
            for d in (self.src, self.gainlike, self.linear_out):
                if x.name in d:
                    d[n.name] = d[x.name]

    def reshape(self, n: fx.Node, shape: Any) -> None:
        x = n.args[0]
        lay = self.L(x)
        if lay is None or shape is None:
            return self.opaque(n, opname(n))
        op = opname(n)
        if op in ("expand", "expand_as", "broadcast_to"):
            off = len(shape) - len(lay)
            out = [((self.ax.fresh(s),) if s > 1 else ()) for s in shape[:off]]
            for i, d in enumerate(lay):
                s = shape[off + i]
                out.append(d if d or s <= 1 else (self.ax.fresh(s),))
            self.lay[n.name] = out
            if x.name in self.src:
                p, amap = self.src[x.name]
                self.src[n.name] = (p, (None,) * off + tuple(amap))
            return None
        self.lay[n.name] = self.ax.regroup(lay, shape)
        if x.name in self.src:  # a parameter viewed with only size-1 dims added or removed
            p, amap = self.src[x.name]
            xs = shape_of(x) or ()
            big_in = [amap[i] for i, s in enumerate(xs) if s > 1]
            big_out = [i for i, s in enumerate(shape) if s > 1]
            if len(big_in) == len(big_out) and [xs[i] for i, s in enumerate(xs) if s > 1] == [shape[i] for i in big_out]:
                m: list[int | None] = [None] * len(shape)
                for i, a in zip(big_out, big_in):
                    m[i] = a
                self.src[n.name] = (p, tuple(m))
        if x.name in self.linear_out:
            self.linear_out[n.name] = self.linear_out[x.name]

    def permute(self, n: fx.Node, shape: Any) -> None:
        x = n.args[0]
        lay = self.L(x)
        if lay is None:
            return self.opaque(n, opname(n))
        nd = len(lay)
        op = opname(n)
        order = list(range(nd))
        if op in ("transpose", "swapaxes"):
            i, j = (int(a) % nd for a in n.args[1:3])
            order[i], order[j] = order[j], order[i]
        elif op in ("t", "numpy_T", "mT"):
            order = order[::-1] if nd <= 2 or op != "mT" else [*order[:-2], nd - 1, nd - 2]
        elif op == "permute":
            order = [int(a) % nd for a in n.args[1]]
        elif op == "movedim":
            src, dst = int(n.args[1]) % nd, int(n.args[2]) % nd
            order.pop(src)
            order.insert(dst, src)
        self.lay[n.name] = [lay[i] for i in order]
        if x.name in self.src:
            p, amap = self.src[x.name]
            self.src[n.name] = (p, tuple(amap[i] for i in order))

    def op_getitem(self, n: fx.Node, shape: Any) -> None:
        x, idx = n.args[0], n.args[1]
        if isinstance(x, fx.Node) and x.name in self.routed and opname(x) == "topk":
            if idx == 1:
                self.routed[n.name] = self.routed[x.name]  # the chosen experts, not their weights
        elif isinstance(x, fx.Node) and x.name in self.routed:
            self.routed[n.name] = self.routed[x.name]
        seq = self.lay.get(x.name) if isinstance(x, fx.Node) else None
        if isinstance(idx, int) and isinstance(seq, list) and seq and isinstance(seq[0], list):
            self.lay[n.name] = seq[idx]
            self.feature[n.name] = self.feat(x)
            if x.name in self.pieces_of:
                self.linear_piece[n.name] = (self.pieces_of[x.name][0], idx)
            return None
        if shape is not None:
            self.lay[n.name] = self.fresh_layouts(shape)

    def _moved_dims(self, n: fx.Node, dims: list[int], name: str) -> None:
        """An op that moves or adds positions along ``dims`` only (a spatial pad, a shifted
        window's roll): those dims lose their classes (tagged, so that a feature axis among
        them keeps no symmetry), the others keep theirs."""
        x = n.args[0]
        lay = self.L(x)
        shape = shape_of(n)
        if lay is None or shape is None or len(lay) != len(shape):
            return self.opaque(n, name)
        out = list(lay)
        for d in dims:
            if lay[d] and self.feat(x):
                self.ax.tag(lay[d], f"opaque:{name}")
            out[d] = (self.ax.fresh(shape[d], f"opaque:{name}"),) if shape[d] > 1 else ()
        self.lay[n.name] = out

    def op_constant_pad_nd(self, n: fx.Node, shape: Any) -> None:
        """``F.pad(x, (l_last, r_last, l_prev, r_prev, ...))`` with a constant: the dims with
        padding get new positions (Swin pads its feature map to whole windows)."""
        xs = shape_of(n.args[0])
        pad = list(n.args[1]) if len(n.args) > 1 else []
        if xs is None:
            return self.opaque(n, "pad")
        dims = [len(xs) - 1 - k for k in range(len(pad) // 2) if pad[2 * k] or pad[2 * k + 1]]
        return self._moved_dims(n, dims, "pad")

    op_pad = op_constant_pad_nd

    def op_roll(self, n: fx.Node, shape: Any) -> None:
        """``torch.roll(x, shifts, dims)``: positions move along ``dims`` (Swin's shifted windows)."""
        xs = shape_of(n.args[0])
        dims = n.args[2] if len(n.args) > 2 else n.kwargs.get("dims", ())
        if xs is None or dims in (None, ()):
            return self.opaque(n, "roll")
        dims = [int(d) % len(xs) for d in (dims if isinstance(dims, (list, tuple)) else [dims])]
        return self._moved_dims(n, dims, "roll")

    def _dim(self, n: fx.Node, pos: int, default: int, nd: int) -> int:
        d = n.args[pos] if len(n.args) > pos else n.kwargs.get("dim", default)
        return int(d) % nd

    def op_slice(self, n: fx.Node, shape: Any) -> None:
        x = n.args[0]
        lay = self.L(x)
        xs = shape_of(x)
        if lay is None or xs is None or shape is None:
            return self.opaque(n, "slice")
        dim = self._dim(n, 1, 0, len(lay))
        start = n.args[2] if len(n.args) > 2 and n.args[2] is not None else 0
        end = n.args[3] if len(n.args) > 3 and n.args[3] is not None else xs[dim]
        step = n.args[4] if len(n.args) > 4 else 1
        start, end = int(start), min(int(end), xs[dim])
        start = start + xs[dim] if start < 0 else start
        end = end + xs[dim] if end < 0 else end
        out = list(lay)
        if (start, end, step) == (0, xs[dim], 1):
            pass
        elif step == 2 and start in (0, 1) and end >= xs[dim] - 1 and len(lay[dim]) == 1 and xs[dim] % 2 == 0:
            out[dim] = (self.ax.every_other(lay[dim][0], start),)  # x[..., 0::2], x[..., 1::2]
        elif step == 1 and self._outer_piece(lay, dim, start, end) is not None:
            out = self._outer_piece(lay, dim, start, end)
        elif step == 1 and self._middle_piece(lay, dim, start, end) is not None:
            out = self._middle_piece(lay, dim, start, end)
        elif step != 1 or len(lay[dim]) != 1:
            if self.feat(x):
                self.ax.tag(lay[dim], "opaque:slice")
            out[dim] = (self.ax.fresh(shape[dim], "opaque:slice"),) if shape[dim] > 1 else ()
        else:
            out[dim] = (self.ax.seg(lay[dim][0], start, end),) if end > start else ()
        self.lay[n.name] = out
        if x.name in self.src and out[dim] == lay[dim]:
            self.src[n.name] = self.src[x.name]

    def _pieces(self, n: fx.Node, sizes: list[int], dim: int) -> None:
        x = n.args[0]
        lay = self.L(x)
        if lay is None:
            return self.opaque(n, opname(n))
        if isinstance(x, fx.Node) and x.name in self.linear_out and dim == len(lay) - 1:
            self.pieces_of[n.name] = (self.linear_out[x.name], len(sizes))  # a fused gate/up split in two
        out, pos = [], 0
        for s in sizes:
            piece = list(lay)
            outer = self._outer_piece(lay, dim, pos, pos + s) if s > 0 else None
            if outer is not None:
                piece = outer
            elif len(lay[dim]) == 1:
                piece[dim] = (self.ax.seg(lay[dim][0], pos, pos + s),) if s > 0 else ()
            elif lay[dim]:
                self.ax.tag(lay[dim], "opaque:split")
                piece[dim] = (self.ax.fresh(s, "opaque:split"),) if s > 1 else ()
            out.append(piece)
            pos += s
        self.lay[n.name] = out

    def op_split(self, n: fx.Node, shape: Any) -> None:
        xs = shape_of(n.args[0])
        size = n.args[1]
        dim = self._dim(n, 2, 0, len(xs or ()))
        if isinstance(size, int):
            sizes = [min(size, xs[dim] - p) for p in range(0, xs[dim], size)]
        else:
            sizes = [int(s) for s in size]
        return self._pieces(n, sizes, dim)

    op_split_with_sizes = op_split

    def op_chunk(self, n: fx.Node, shape: Any) -> None:
        xs = shape_of(n.args[0])
        dim = self._dim(n, 2, 0, len(xs or ()))
        k = int(n.args[1])
        size = -(-xs[dim] // k)
        return self._pieces(n, [min(size, xs[dim] - p) for p in range(0, xs[dim], size)], dim)

    def op_unbind(self, n: fx.Node, shape: Any) -> None:
        x = n.args[0]
        lay = self.L(x)
        if lay is None:
            return self.opaque(n, "unbind")
        dim = self._dim(n, 1, 0, len(lay))
        self.lay[n.name] = [self._select(lay, dim, i) for i in range(shape_of(x)[dim])]

    def op_select(self, n: fx.Node, shape: Any) -> None:
        x = n.args[0]
        lay = self.L(x)
        if lay is None:
            return self.opaque(n, "select")
        dim = self._dim(n, 1, 0, len(lay))
        idx = int(n.args[2]) % shape_of(x)[dim]
        self.lay[n.name] = self._select(lay, dim, idx)

    def _select(self, lay: list[Layout], dim: int, idx: int) -> list[Layout]:
        """Index ``idx`` of dim ``dim`` (the dim goes away)."""
        piece = self._outer_piece(lay, dim, idx, idx + 1)
        if piece is None:
            piece = self._middle_piece(lay, dim, idx, idx + 1)
        if piece is None:
            return lay[:dim] + lay[dim + 1 :]
        return piece[:dim] + piece[dim + 1 :]

    def _outer_piece(self, lay: list[Layout], dim: int, start: int, end: int) -> list[Layout] | None:
        """Positions [start, end) of dim ``dim`` when that dim is the outer factor of a
        product split (timm's qkv: (3, H, dh); Falcon's fused heads: (H + 2, dh)): the
        piece is a segment of the split atom, with inner classes of its own (q, k and v
        do not share a head width class). None when the dim is no such factor."""
        if len(lay[dim]) != 1:
            return None
        a = lay[dim][0]
        org = self.ax.origin.get(a)
        if org is None or org[1] != "split" or org[2][1] != 0:
            return None
        parent, _, (sizes, _) = org
        return self._piece(lay, dim, parent, start, end, self.ax.split(parent, sizes)[1:])

    def _middle_piece(self, lay: list[Layout], dim: int, start: int, end: int) -> list[Layout] | None:
        """Positions [start, end) of dim ``dim`` when that dim is the inner factor of the
        outer factor of a product: the fused axis P was viewed as (P', w...) and P' as
        (g..., s), and ``dim`` holds s with w... in the dims after it (Falcon's grouped
        fused heads, P = K x (H/K + 2) x dh: the query heads are slots [0, H/K) of every
        group). P is given the split (g..., s*w) whose last factor holds the piece as a
        segment, with inner classes of its own (as :meth:`_outer_piece` gives an outer
        factor's piece). None when the dim is no such factor."""
        if len(lay[dim]) != 1:
            return None
        s_atom = lay[dim][0]
        org = self.ax.origin.get(s_atom)
        if org is None or org[1] != "split":
            return None
        mid, _, (mid_sizes, k) = org
        if len(mid_sizes) < 2 or k != len(mid_sizes) - 1:
            return None
        up = self.ax.origin.get(self.ax.find(mid))
        if up is None or up[1] != "split" or up[2][1] != 0:
            return None
        top, _, (top_sizes, _) = up
        inner = tuple(top_sizes[1:])
        top_kids = self.ax.split(top, top_sizes)
        # the dims after ``dim`` hold P's inner factors, one per dim, in order
        after = lay[dim + 1 : dim + 1 + len(inner)]
        if len(after) != len(inner) or any(len(d) != 1 or self.ax.find(d[0]) != self.ax.find(t)
                                           for d, t in zip(after, top_kids[1:])):
            return None
        ns = mid_sizes[-1]
        kids = self.ax.split(top, (*mid_sizes[:-1], ns * math.prod(inner)))
        for a, b in zip(kids[:-1], self.ax.split(mid, mid_sizes)[:-1]):
            self.ax.unify(a, b)
        for a, b in zip(self.ax.split(kids[-1], (ns, *inner)), (s_atom, *top_kids[1:])):
            self.ax.unify(a, b)
        return self._piece(lay, dim, kids[-1], start, end, top_kids[1:])

    def _piece(self, lay: list[Layout], dim: int, holder: int, start: int, end: int,
               old: tuple[int, ...]) -> list[Layout]:
        """``lay`` with positions [start, end) of dim ``dim`` taken, where ``holder`` is
        those positions times the inner factors ``old`` (row-major): the piece is a
        segment of ``holder`` split into (end - start, inner...) with inner classes of its
        own, mirrored from ``old`` wherever ``lay`` has them."""
        inner = tuple(self.ax.size[self.ax.find(o)] for o in old)
        width = math.prod(inner)
        seg = self.ax.seg(holder, start * width, end * width)
        if end - start > 1:
            new = self.ax.split(seg, (end - start, *inner))
            outer, new = new[0], new[1:]
        else:
            outer = None
            new = self.ax.split(seg, inner) if len(inner) > 1 else (seg,)
        remap: dict[int, int] = {}
        for o, m in zip(old, new):
            self._mirror(o, m, remap)
        out = [tuple(remap.get(self.ax.find(x), x) for x in d) for d in lay]
        out[dim] = (outer,) if outer is not None else ()
        return out

    def _mirror(self, old: int, new: int, remap: dict[int, int]) -> None:
        """Map ``old`` and the pieces it was split into onto ``new``'s same pieces."""
        r = self.ax.find(old)
        if r in remap:
            return
        remap[r] = new
        for sizes, kids in list(self.ax.splits.get(r, {}).items()):
            for k, m in zip(kids, self.ax.split(new, sizes)):
                self._mirror(k, m, remap)

    def op_cat(self, n: fx.Node, shape: Any) -> None:
        xs = [x for x in n.args[0]]
        lays = [self.L(x) for x in xs]
        if shape is None or any(lay is None for lay in lays):
            return self.opaque(n, "cat")
        nd = len(shape)
        dim = (int(n.args[1]) if len(n.args) > 1 else int(n.kwargs.get("dim", 0))) % nd
        out = [None] * nd
        for j in range(nd):
            if j == dim:
                continue
            for lay in lays:
                if lay[j] and shape[j] > 1:
                    if out[j] is None:
                        out[j] = lay[j]
                    else:
                        self.ax.unify_layouts(out[j], lay[j])
        whole = self.ax.fresh(shape[dim]) if shape[dim] > 1 else None
        pos = 0
        for x, lay in zip(xs, lays):
            s = shape_of(x)[dim]
            if whole is not None and s > 0:
                piece = self.ax.seg(whole, pos, pos + s)
                if lay[dim]:
                    self.ax.unify_layouts((piece,), lay[dim])
            if x.name in self.src:  # a class token or register token joining the features
                for j in range(nd):
                    if j != dim:
                        self.role(x, j, "co", n)
            pos += s
        out[dim] = (whole,) if whole is not None else ()
        self.lay[n.name] = [o if o is not None else ((self.ax.fresh(s),) if s > 1 else ()) for o, s in zip(out, shape)]

    op_concat = op_cat

    def op_stack(self, n: fx.Node, shape: Any) -> None:
        """Tensors stacked along a new dim move together on every other dim."""
        xs = list(n.args[0])
        lays = [self.L(x) for x in xs]
        if shape is None or any(lay is None for lay in lays) or len({len(lay) for lay in lays}) != 1:
            return self.opaque(n, "stack")
        nd = len(shape)
        dim = (int(n.args[1]) if len(n.args) > 1 else int(n.kwargs.get("dim", 0))) % nd
        base = list(lays[0])
        for lay in lays[1:]:
            for j, d in enumerate(lay):
                if base[j] and d:
                    self.ax.unify_layouts(base[j], d)
        new = (self.ax.fresh(shape[dim]),) if shape[dim] > 1 else ()
        self.lay[n.name] = [*base[:dim], new, *base[dim:]]

