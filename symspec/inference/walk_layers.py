"""The walk's rules for ops that compute: sums and products, elementwise functions,
reductions and softmax, linear layers, attention, embeddings, convolutions, norms and
mixtures of experts (a mixin of :class:`~.walk.Reader`)."""

from __future__ import annotations

from typing import Any

import torch.fx as fx

from .axes import Layout
from .facts import (
    HOMOGENEOUS,
    NO_TENSOR,
    ODD,
    Attention,
    ExpertUse,
    Linear,
    Norm,
    Sub,
    opname,
    shape_of,
    val_of,
)


class LayerRules:
    """Rules for ops that compute on features (see :mod:`.walk`)."""

    # -- arithmetic --------------------------------------------------------------------
    def op_add(self, n: fx.Node, shape: Any) -> None:
        return self._addsub(n, shape, "add")

    def op_sub(self, n: fx.Node, shape: Any) -> None:
        return self._addsub(n, shape, "sub")

    def op_rsub(self, n: fx.Node, shape: Any) -> None:
        return self._addsub(n, shape, "sub")

    def _addsub(self, n: fx.Node, shape: Any, op: str) -> None:
        if shape is None:
            return self.opaque(n, op)
        a, b = n.args[0], n.args[1]
        tensors = [x for x in (a, b) if isinstance(x, fx.Node) and self.L(x) is not None]
        feats = [x for x in tensors if self.feat(x)]
        # a parameter plus a constant: Gemma's (1 + weight)
        if len(tensors) == 1 and tensors[0].name in self.gainlike:
            other = b if tensors[0] is a else a
            if isinstance(other, (int, float)):
                p, off = self.gainlike[tensors[0].name]
                self.gainlike[n.name] = (p, off + float(other))
                self.lay[n.name] = list(self.L(tensors[0]))
                if tensors[0].name in self.src:
                    self.src[n.name] = self.src[tensors[0].name]
                return None
        if len(feats) == 2 or (len(feats) == 1 and len(tensors) == 1):
            self.lay[n.name] = self.broadcast(shape, feats)
            if len(tensors) == 1 and not isinstance(a if tensors[0] is b else b, fx.Node):
                other = a if tensors[0] is b else b
                if other != 0 and tensors[0].name not in self.gainlike and tensors[0].name not in self.src:  # x + c: moves the all-ones direction
                    self.ax.tag([x for d in self.lay[n.name][-1:] for x in d], "shift")
            for x in feats:  # biases and position tables added to features (role() skips activations)
                shape_x = shape_of(x) or ()
                for j in range(len(shape_x)):
                    self.role(x, j - len(shape_x), "co", n)
            return None
        if len(feats) == 1:  # a feature tensor plus a table that is not one (a mask, a fixed position table)
            f = feats[0]
            self.lay[n.name] = self.broadcast(shape, [f])
            self._tag_along(n, shape, b if f is a else a, "constadd")
            return None
        self.lay[n.name] = self.broadcast(shape, tensors, unify=False)

    def _tag_along(self, n: fx.Node, shape: Any, table: Any, tag: str) -> None:
        """Tag the classes of ``n``'s dims along which ``table`` (a tensor that is no
        feature: a mask, a position table) varies."""
        lay = self.L(table) or []
        off = len(shape) - len(lay)
        for i, d in enumerate(lay):
            if d and shape[off + i] > 1:
                self.ax.tag(self.lay[n.name][off + i], tag)

    def op_mul(self, n: fx.Node, shape: Any) -> None:
        return self._muldiv(n, shape, "mul")

    def op_div(self, n: fx.Node, shape: Any) -> None:
        return self._muldiv(n, shape, "div")

    def _muldiv(self, n: fx.Node, shape: Any, op: str) -> None:
        if shape is None:
            return self.opaque(n, op)
        a, b = n.args[0], n.args[1]
        tensors = [x for x in (a, b) if isinstance(x, fx.Node) and self.L(x) is not None]
        if len(tensors) == 1:  # by a scalar
            x = tensors[0]
            self.lay[n.name] = list(self.L(x)) if len(self.L(x)) == len(shape) else self.broadcast(shape, [x])
            for d in (self.src, self.gainlike, self.linear_out):
                if x.name in d and op == "mul":
                    d[n.name] = d[x.name]
            return None
        # a gain: a feature tensor times a parameter vector (or 1 + parameter) along its last axis
        for g, x in ((a, b), (b, a)):
            if op == "mul" and isinstance(g, fx.Node) and g.name in self.gainlike and self.feat(x) and g is not x \
                    and x.name not in self.gainlike and (shape_of(g) or (0,))[-1] == shape[-1] and shape[-1] > 1:
                pname, off = self.gainlike[g.name]
                self.lay[n.name] = self.broadcast(shape, [x, g])
                self.role(g, -1, "gain", n, x)
                self.gain_at[n.name] = (pname, off, x.name)
                return None
        fa, fb = self.feat(a), self.feat(b)
        if fa and fb:
            out = self.broadcast(shape, [a, b])
            self.lay[n.name] = out
            la, lb = self.L(a), self.L(b)
            both = [j for j in range(len(shape)) if shape[j] > 1 and (len(shape) - j) <= len(la) and (len(shape) - j) <= len(lb)
                    and la[len(la) - len(shape) + j] and lb[len(lb) - len(shape) + j]]
            self.ax.tag([x for j in both for x in out[j]], "product")
            # a per-position scalar (a norm's 1/rms) broadcast along the features is not a product of features
            for x, other in ((a, b), (b, a)):
                if op != "mul" or (shape_of(other) or (1,))[-1] != shape[-1]:
                    continue  # a per-row weight (a router's probability) scales rows, not units
                if x.name in self.linear_out and other.name not in self.linear_out:
                    self.facts.gates.append((n.name, self.linear_out[x.name], other.name))
                elif x.name in self.linear_piece and other.name not in self.linear_piece and other.name not in self.linear_out:
                    weight, piece = self.linear_piece[x.name]
                    self.facts.gates.append((n.name, weight, other.name, piece, x.name))
            return None
        f = a if fa else b if fb else None
        if f is None:
            self.lay[n.name] = self.broadcast(shape, tensors, unify=False)
            return None
        self.lay[n.name] = self.broadcast(shape, [f])
        self._tag_along(n, shape, b if f is a else a, "varying")  # a rotary table, a fixed mask
        if f.name in self.src and op == "mul":
            self.src[n.name] = self.src[f.name]

    # -- mixtures of experts -------------------------------------------------------------
    def op_topk(self, n: fx.Node, shape: Any) -> None:
        """Top-k over a router's scores: the experts it picks depend on the order of the
        scores only, so a permutation of the experts moves the picks with it; the values
        are the picked scores, in their own (sorted) order."""
        x = n.args[0]
        lay = self.L(x)
        val = val_of(n)
        if lay is None or not isinstance(val, (tuple, list)) or len(val) != 2:
            return self.opaque(n, "topk")
        dim = self._dim(n, 2, -1, len(lay))
        self.ax.tag(lay[dim], "topk")
        k = int(val[0].shape[dim])
        out = list(lay)
        out[dim] = (self.ax.fresh(k),) if k > 1 else ()
        self.lay[n.name] = [out, [d if i != dim else ((self.ax.fresh(k),) if k > 1 else ()) for i, d in enumerate(lay)]]
        self.feature[n.name] = self.feat(x)
        if lay[dim] and len(lay[dim]) == 1:
            self.routed[n.name] = (lay[dim][0], self._router_of(x))

    def _router_of(self, x: fx.Node) -> str | None:
        """The weight of the linear layer whose scores reach ``x`` through casts and a softmax."""
        cur = x
        for _ in range(8):
            if cur.name in self.linear_out:
                return self.linear_out[cur.name]
            if not cur.all_input_nodes:
                return None
            cur = cur.all_input_nodes[0]
        return None

    def op_index(self, n: fx.Node, shape: Any) -> None:
        """``x[idx]`` with one index tensor: rows gathered along one dim, every other dim
        as it was. The gathered dim is indexed by data (no symmetry may act on it); an
        expert weight indexed by routed experts is the experts' product (:meth:`op_bmm`)."""
        x, idx = n.args[0], n.args[1]
        lay = self.L(x)
        if lay is None or shape is None or not isinstance(idx, (list, tuple)):
            return self.opaque(n, "index")
        pos = [i for i, t in enumerate(idx) if t is not None]
        if not pos or not all(isinstance(idx[i], fx.Node) for i in pos):
            return self.opaque(n, "index")
        if len(pos) > 1:  # x[rows, cols]: CLIP's pooled token (arange(B), argmax of the ids)
            return self._index_several(n, shape, x, lay, pos, [idx[i] for i in pos])
        i, t = pos[0], idx[pos[0]]
        width = len(shape_of(t) or ())
        if len(shape) != len(lay) - 1 + width:
            return self.opaque(n, "index")
        if i == 0 and x.name in self.src and len(lay) == 3:  # a stack of weights, one picked per row
            pname, amap = self.src[x.name]
            atom: int | None = None
            router = None
            if t.name in self.routed and lay[0] and len(lay[0]) == 1:
                atom, router = self.routed[t.name]
                self.ax.unify(lay[0][0], atom)
                self.role(x, 0, "expert")
            elif lay[0]:
                self.ax.tag(lay[0], "gather")  # picked by something other than a router: no permutation
            self.expert_rows[n.name] = (pname, (None,) * width + tuple(amap[1:]), atom, router)
        elif self.feat(x) and lay[i]:
            self.ax.tag(lay[i], "gather")
        self.lay[n.name] = [*lay[:i], *self.fresh_layouts(shape[i : i + width]), *lay[i + 1 :]]

    def _index_several(self, n: fx.Node, shape: Any, x: fx.Node, lay: list[Any], pos: list[int],
                       tensors: list[fx.Node]) -> None:
        """``x[i0, i1]`` with index tensors on adjacent dims (broadcast together): those dims
        are indexed by data (no symmetry acts on them) and replaced, where the first was,
        by the index tensors' broadcast dims; every other dim as it was. Index tensors on
        dims apart move the result's dims to the front: not read."""
        width = max(len(shape_of(t) or ()) for t in tensors)
        if pos != list(range(pos[0], pos[0] + len(pos))) or len(shape) != len(lay) - len(pos) + width:
            return self.opaque(n, "index")
        if self.feat(x):
            for i in pos:
                if lay[i]:
                    self.ax.tag(lay[i], "gather")
        first, last = pos[0], pos[-1] + 1
        self.lay[n.name] = [*lay[:first], *self.fresh_layouts(shape[first : first + width]), *lay[last:]]

    def op_repeat_interleave(self, n: fx.Node, shape: Any) -> None:
        """Rows repeated (a token copied once per picked expert): the other dims as they were."""
        x = n.args[0] if n.args else None
        lay = self.L(x)
        dim = n.args[2] if len(n.args) > 2 else n.kwargs.get("dim")
        if lay is None or shape is None or dim is None or len(shape) != len(lay):
            return self.opaque(n, "repeat_interleave")
        dim = int(dim) % len(lay)
        if self.feat(x) and lay[dim]:
            self.ax.tag(lay[dim], "gather")
        self.lay[n.name] = [d if j != dim else ((self.ax.fresh(shape[j]),) if shape[j] > 1 else ()) for j, d in enumerate(lay)]

    def op_grouped_mm_fallback(self, n: fx.Node, shape: Any) -> None:
        """A grouped matmul (the experts of a mixture, rows sorted by expert): ``x`` [N, in]
        times the expert weights [E, in, out], the row groups given by routed offsets."""
        x, w = n.args[0], n.args[1]
        offs = n.args[2] if len(n.args) > 2 else n.kwargs.get("offs")
        lx, lw = self.L(x), self.L(w)
        if lx is None or lw is None or shape is None or len(lw) != 3 or len(lx) != 2 or w.name not in self.src \
                or not isinstance(offs, fx.Node) or offs.name not in self.routed:
            return self.opaque(n, opname(n))
        atom, router = self.routed[offs.name]
        pname, amap = self.src[w.name]
        if lw[0] and len(lw[0]) == 1:
            self.ax.unify(lw[0][0], atom)
        self.ax.unify_layouts(lx[-1], lw[1])
        self.lay[n.name] = [lx[0], lw[2]]
        own = self.alias(pname)
        if amap[1] is None or amap[2] is None or amap[0] is None:
            return self.opaque(n, opname(n))
        roles = self.facts.roles.setdefault(own, {})
        roles.setdefault(amap[1], set()).add("contra")
        roles.setdefault(amap[2], set()).add("co")
        roles.setdefault(amap[0], set()).add("expert")
        self.facts.experts.append(ExpertUse(own, amap[0], amap[1], amap[2], router, atom, x.name, n.name))
        self.linear_out[n.name] = own

    op__grouped_mm = op_grouped_mm_fallback

    def _gathered_expert_matmul(self, n: fx.Node, shape: Any, a: fx.Node, b: fx.Node) -> bool:
        """``W[idx] @ x`` [N, out, in] x [N, in, 1]: the experts' product (batched_mm)."""
        if a.name not in self.expert_rows:
            return False
        la, lb = self.L(a), self.L(b)
        if la is None or lb is None or shape is None or len(la) != 3 or len(lb) != 3:
            return False
        pname, amap, atom, router = self.expert_rows[a.name]
        self.ax.unify_layouts(la[-1], lb[-2])
        batch = self.broadcast(shape[:-2], [Sub(a, la[:-2]), Sub(b, lb[:-2])])
        self.lay[n.name] = [*list(batch), la[-2], lb[-1]]
        r_axis, w_axis = amap[-1], amap[-2]
        e_axis = next((i for i in range(len(self.facts.param_atoms.get(pname, []))) if i not in (r_axis, w_axis)), None)
        if r_axis is None or w_axis is None or e_axis is None:
            return False
        own = self.alias(pname)
        roles = self.facts.roles.setdefault(own, {})
        roles.setdefault(r_axis, set()).add("contra")
        roles.setdefault(w_axis, set()).add("co")
        if atom is None:  # not routed: a linear layer whose weight stack is indexed by data
            self.facts.linears.append(Linear(own, r_axis, w_axis, None, b.name, n.name))
        else:
            self.facts.experts.append(ExpertUse(own, e_axis, r_axis, w_axis, router, atom, b.name, n.name))
        self.linear_out[n.name] = own
        return True

    # -- nonlinear and reductions ------------------------------------------------------
    def elementwise(self, n: fx.Node, shape: Any, op: str) -> None:
        ins = [x for x in n.all_input_nodes if self.L(x) is not None and self.feat(x)]
        if shape is None:
            return self.opaque(n, op)
        if not ins:
            self.lay[n.name] = self.broadcast(shape, [x for x in n.all_input_nodes if self.L(x) is not None], unify=False)
            return None
        self.lay[n.name] = self.broadcast(shape, ins)
        tag = "homogeneous" if op in HOMOGENEOUS else f"odd:{op}" if op in ODD else f"nonlinear:{op}"
        atoms = [x for d in self.lay[n.name] for x in d]
        if op == "pow" and len(n.args) > 1 and n.args[1] == 2:
            self.squares.add(n.name)
            tag = "square"
        self.ax.tag(atoms, tag)
        if op in HOMOGENEOUS and ins and ins[0].name in self.linear_out:
            self.facts.homogeneous.append((n.name, self.linear_out[ins[0].name]))

    def reduce(self, n: fx.Node, shape: Any, op: str) -> None:
        x = n.args[0]
        if len(n.args) > 1 and isinstance(n.args[1], fx.Node):  # min.other, max.other: elementwise, of two tensors
            if not self.feat(x) and not self.feat(n.args[1]):  # position arithmetic (T5's relative buckets)
                if shape is not None:
                    self.lay[n.name] = self.fresh_layouts(shape)
                return None
            return self.opaque(n, op)
        lay = self.L(x)
        xs = shape_of(x)
        if lay is None or xs is None:
            return self.opaque(n, op)
        dims = n.args[1] if len(n.args) > 1 else n.kwargs.get("dim")
        if dims is None:
            dims = list(range(len(xs)))
        dims = [int(d) % len(xs) for d in (dims if isinstance(dims, (list, tuple)) else [dims])]
        keep = bool(n.args[2]) if len(n.args) > 2 and isinstance(n.args[2], bool) else bool(n.kwargs.get("keepdim", False))
        if op in ("var", "std"):
            kind = "var"
        elif x.name in self.squares and op in ("mean", "sum"):
            kind = "sumsq"
        elif op in ("mean", "sum"):
            kind = "mean"
        elif op in ("norm", "linalg_vector_norm"):
            kind = "sumsq"
        else:
            kind = f"reduce:{op}"
        for d in dims:
            if self.feat(x):
                self.ax.tag(lay[d], kind)
        if shape is None:
            return None
        out = [lay[i] if i not in dims else () for i in range(len(xs))] if keep else [lay[i] for i in range(len(xs)) if i not in dims]
        self.lay[n.name] = out if len(out) == len(shape) else self.fresh_layouts(shape)

    def op__softmax(self, n: fx.Node, shape: Any) -> None:
        return self.op_softmax(n, shape)

    def op__safe_softmax(self, n: fx.Node, shape: Any) -> None:
        return self.op_softmax(n, shape)

    def op_softmax(self, n: fx.Node, shape: Any) -> None:
        x = n.args[0]
        lay = self.L(x)
        if lay is None:
            return self.opaque(n, "softmax")
        dim = self._dim(n, 1, -1, len(lay))
        self.ax.tag(lay[dim], "softmax")
        self.lay[n.name] = list(lay)

    # -- layers ------------------------------------------------------------------------
    def op_linear(self, n: fx.Node, shape: Any) -> None:
        x, w = n.args[0], n.args[1]
        b = n.args[2] if len(n.args) > 2 else n.kwargs.get("bias")
        return self._linear(n, shape, x, w, b, read=1, write=0)

    def op_addmm(self, n: fx.Node, shape: Any) -> None:
        b, x, w = n.args[0], n.args[1], n.args[2]
        return self._linear(n, shape, x, w, b, read=0, write=1)

    def op_mm(self, n: fx.Node, shape: Any) -> None:
        return self.op_matmul(n, shape)

    def op_bmm(self, n: fx.Node, shape: Any) -> None:
        return self.op_matmul(n, shape)

    def op_baddbmm(self, n: fx.Node, shape: Any) -> None:
        """``beta * input + alpha * (batch1 @ batch2)``: the product read as a matmul, the
        input as a table added to it (Bloom's ALiBi: per-head biases on the scores, built
        from the mask, which no head permutation moves; the check then pins the heads)."""
        table, a, b = n.args[0], n.args[1], n.args[2]
        self._matmul(n, shape, a, b)
        if n.name not in self.lay or shape is None:
            return None  # the product was not read: said there
        if isinstance(table, fx.Node) and self.L(table) is not None:
            if self.feat(table):  # features added to a product of features: not read
                return self.opaque(n, "baddbmm")
            self._tag_along(n, shape, table, "constadd")
        return None

    def _linear(self, n: fx.Node, shape: Any, x: Any, w: Any, b: Any, read: int, write: int) -> None:
        lx, lw = self.L(x), self.L(w)
        if lx is None or lw is None or shape is None or len(lw) != 2:
            return self.opaque(n, "linear")
        self.ax.unify_layouts(lx[-1], lw[read])
        out = [*list(lx[:-1]), lw[write]]
        if len(out) != len(shape):
            out = [*self.ax.regroup(lx[:-1], shape[:-1]), lw[write]]
        bias = None
        if isinstance(b, fx.Node) and self.L(b) is not None:
            self.ax.unify_layouts(self.L(b)[-1], lw[write])
            self.role(b, -1, "co", n)
            bias = self.src.get(b.name, (None,))[0]
        self.role(w, read, "contra", x)
        self.role(w, write, "co", n)
        self.lay[n.name] = out
        if w.name in self.src:
            pname, amap = self.src[w.name]
            pname = self.alias(pname)
            self.facts.param_atoms.setdefault(pname, self.facts.param_atoms[self.src[w.name][0]])
            self.facts.linears.append(Linear(pname, amap[read], amap[write], bias, x.name, n.name))
            self.linear_out[n.name] = pname

    def op_matmul(self, n: fx.Node, shape: Any) -> None:
        return self._matmul(n, shape, n.args[0], n.args[1])

    def _matmul(self, n: fx.Node, shape: Any, a: Any, b: Any) -> None:
        la, lb = self.L(a), self.L(b)
        if la is None or lb is None or shape is None:
            return self.opaque(n, "matmul")
        if isinstance(a, fx.Node) and isinstance(b, fx.Node) and self._gathered_expert_matmul(n, shape, a, b):
            return None
        if b.name in self.src and len(lb) == 2:  # x @ W (a weight stored input-first)
            return self._linear(n, shape, a, b, None, read=0, write=1)
        if len(la) < 2 or len(lb) < 2:
            return self.opaque(n, "matmul")
        # a contraction of two activations: a's features with b's rows are a dual pair
        if la[-1] and lb[-2]:
            if len(la[-1]) == 1 and len(lb[-2]) == 1:
                self.ax.pairs.append((la[-1][0], lb[-2][0]))
            else:
                self.ax.unify_layouts(la[-1], lb[-2])
        batch = self.broadcast(shape[:-2], [Sub(a, la[:-2]), Sub(b, lb[:-2])]) if len(shape) > 2 else []
        self.lay[n.name] = [*list(batch), la[-2], lb[-1]]
        self._attention_from_matmul(n, a, b)

    def _attention_from_matmul(self, n: fx.Node, a: fx.Node, b: fx.Node) -> None:
        """q @ k^T -> (scale, mask, softmax, dropout) -> @ v: one attention."""
        la, lb = self.L(a), self.L(b)
        if len(la) < 3:
            return
        cur, seen_softmax = n, False
        for _ in range(12):
            users = [u for u in cur.users if opname(u) not in NO_TENSOR]
            if len(users) != 1:
                return
            u = users[0]
            op = opname(u)
            if op in ("matmul", "bmm") and u.args[0] is cur and seen_softmax:
                v = u.args[1]
                lv = self.L(v)
                if lv is None or len(lv) < 3:
                    return
                kh, kv = self._kv_source(b, (shape_of(a) or (0, 0, 0))[-3])
                self.facts.attentions.append(Attention(la[-1], lb[-2], lv[-1], la[-3], kh if kv else lb[-3], u.name,
                                                       self.facts.modules.get(n.name, ""), kv))
                return
            seen_softmax |= op in ("softmax", "_softmax", "_safe_softmax")
            cur = u

    def op_scaled_dot_product_attention(self, n: fx.Node, shape: Any) -> None:
        q, k, v = n.args[0], n.args[1], n.args[2]
        lq, lk, lv = self.L(q), self.L(k), self.L(v)
        if lq is None or lk is None or lv is None or shape is None or len(lq) < 3:
            return self.opaque(n, "scaled_dot_product_attention")
        if lq[-1] and lk[-1]:
            self.ax.pairs.append((lq[-1][0], lk[-1][0])) if len(lq[-1]) == 1 and len(lk[-1]) == 1 else \
                self.ax.unify_layouts(lq[-1], lk[-1])
        self.ax.unify_layouts(lk[-2], lv[-2])  # key and value positions
        self.ax.unify_layouts(lk[-3], lv[-3])  # key and value heads
        qs, ks = shape_of(q), shape_of(k)
        if qs[-3] == ks[-3]:
            self.ax.unify_layouts(lq[-3], lk[-3])
        elif lq[-3] and lk[-3] and qs[-3] % ks[-3] == 0:  # enable_gqa: each kv head serves a group of query heads
            group = self.ax.split(lq[-3][0], (ks[-3], qs[-3] // ks[-3])) if len(lq[-3]) == 1 else lq[-3]
            self.ax.unify_layouts((group[0],), lk[-3])
        self.lay[n.name] = [*list(lq[:-1]), lv[-1]]
        kh, kv = self._kv_source(k, qs[-3])
        self.facts.attentions.append(Attention(lq[-1], lk[-1], lv[-1], lq[-3], kh, n.name, self.facts.modules.get(n.name, ""), kv))

    def _kv_source(self, k: fx.Node, heads: int) -> tuple[Layout, int]:
        """The key heads before a repeat for grouped-query attention (unsqueeze, expand,
        reshape): their layout and count (0 when there are as many as query heads)."""
        cur = k
        for _ in range(8):
            op = opname(cur)
            last_two = op == "transpose" and len(cur.args) > 2 and all(int(d) % len(shape_of(cur) or (0,)) >= len(shape_of(cur) or (0,)) - 2 for d in cur.args[1:3])
            if not last_two and (op not in ("reshape", "view", "_unsafe_view", "expand", "unsqueeze", "clone", "contiguous", "alias") or not cur.args):
                break
            cur = cur.args[0]
        shape = shape_of(cur)
        lay = self.L(cur)
        if shape is None or lay is None or len(shape) < 3 or shape[-3] >= heads:
            lk = self.L(k)
            return (lk[-3] if lk else ()), 0
        return lay[-3], shape[-3]

    def op_embedding(self, n: fx.Node, shape: Any) -> None:
        w, ids = n.args[0], n.args[1]
        lw, li = self.L(w), self.L(ids)
        if lw is None or li is None or len(lw) != 2:
            return self.opaque(n, "embedding")
        self.ax.tag(lw[0], "index")
        self.role(w, 0, "index")
        self.role(w, 1, "co", n)
        self.lay[n.name] = [*list(li), lw[1]]
        self.feature[n.name] = True

    def op_conv2d(self, n: fx.Node, shape: Any) -> None:
        x, w = n.args[0], n.args[1]
        b = n.args[2] if len(n.args) > 2 else None
        lx, lw = self.L(x), self.L(w)
        if lx is None or lw is None or shape is None or len(lw) != 4:
            return self.opaque(n, "conv2d")
        self.ax.unify_layouts(lx[-3], lw[1])
        self.ax.tag(lw[2] + lw[3], "kernel")
        self.role(w, 1, "contra", x)
        self.role(w, 0, "co", n)
        self.role(w, 2, "kernel")
        self.role(w, 3, "kernel")
        if isinstance(b, fx.Node) and self.L(b) is not None:
            self.ax.unify_layouts(self.L(b)[-1], lw[0])
            self.role(b, -1, "co", n)
        out = [((self.ax.fresh(s, "data"),) if s > 1 else ()) for s in shape]  # positions come from the input's
        out[-3] = lw[0]
        out[0] = lx[0] if lx[0] and shape[0] > 1 else out[0]
        self.lay[n.name] = out
        if w.name in self.src:
            self.facts.linears.append(Linear(self.src[w.name][0], 1, 0, self.src.get(getattr(b, "name", ""), (None,))[0], x.name, n.name))

    op_convolution = op_conv2d

    def op_layer_norm(self, n: fx.Node, shape: Any) -> None:
        return self._norm(n, shape, "layernorm")

    def op_rms_norm(self, n: fx.Node, shape: Any) -> None:
        return self._norm(n, shape, "rms")

    def _norm(self, n: fx.Node, shape: Any, kind: str) -> None:
        x = n.args[0]
        lx = self.L(x)
        if lx is None:
            return self.opaque(n, kind)
        w = n.args[2] if len(n.args) > 2 else n.kwargs.get("weight")
        b = n.args[3] if kind == "layernorm" and len(n.args) > 3 else n.kwargs.get("bias")
        self.ax.tag(lx[-1], kind)
        gain = bias = None
        if isinstance(w, fx.Node) and self.L(w) is not None:
            self.ax.unify_layouts(self.L(w)[-1], lx[-1])
            self.role(w, -1, "gain", n, x)
            gain = self.gainlike.get(w.name, (None, 0.0))
        if isinstance(b, fx.Node) and self.L(b) is not None:
            self.ax.unify_layouts(self.L(b)[-1], lx[-1])
            self.role(b, -1, "normbias", n)
            bias = self.src.get(b.name, (None,))[0]
        self.lay[n.name] = list(lx)
        atom = lx[-1][0] if lx[-1] else self.ax.fresh(1)
        self.facts.norms.append(Norm(kind, gain[0] if gain else None, gain[1] if gain else 0.0, bias, atom, n.name,
                                     self.facts.modules.get(n.name, "")))

    op_native_layer_norm = op_layer_norm

