"""A draft's bindings (each parameter axis as spaces acting on it), ties, centring and
named dims (a mixin of the draft builder, :mod:`.builder`)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from ..spec.model import AxisExpr
from .draft import UNTOUCHED, Fold, axis_expr, term
from .facts import ACTIVATIONS, ODD, PERMUTE, RESHAPE, TRANSPARENT, opname


class Bindings:
    """Parameter axes described by spaces; ties, mean-centring and dims."""

    # -- bindings ----------------------------------------------------------------------
    def describe(self, atom: int, dual: bool, absval: bool = False) -> AxisExpr | None:
        r = self.ax.find(atom)
        if r in self.within_of and self.within_of[r][0] in self.single_kv:  # multi-query: k and v are one head
            base, idx, part, side = self.within_of[r]
            return axis_expr([[term(base, idx, part + ".kv", dual != side)]])
        if r in self.class_space:
            base, idx = self.class_space[r]
            return axis_expr([[term(base, idx, "", dual, absval)]])
        if r in self.head_of and self.head_uses.get(r, 0) == 1:
            # one entry per head (a relative position bias table): it moves with the heads
            base, idx, kv = self.head_of[r]
            self.spaces[base].table = True
            return axis_expr([[term(base, idx, "pos" + (".kv" if kv else ""), dual)]])
        if r in self.router_of:
            base, idx = self.router_of[r]
            return axis_expr([[term(base, idx, "router", dual)]])
        for _sizes, kids in self.ax.splits.get(r, {}).items():
            if len(kids) != 2:
                continue
            h, w = self.ax.find(kids[0]), self.ax.find(kids[1])
            grouped = self._grouped_heads(h, w, dual)
            if grouped is not None:
                return grouped
            if h in self.head_of and w in self.within_of:
                base, idx, kv = self.head_of[h]
                b2, _, part, side = self.within_of[w]
                if b2 != base:
                    continue
                return axis_expr([[term(base, idx, part + (".kv" if kv else ""), dual != side)]])
            if h in self.head_of:  # per head: [q | k | v] (GPT-NeoX's fused layout)
                tiles = self.ax.tiling(w)
                if tiles:
                    base, idx, kv = self.head_of[h]
                    chains = []
                    for _, _, c in tiles:
                        cw = self.ax.find(c)
                        got = self._group_piece(cw) if kv else None
                        if got is not None:  # a group's query heads: [g0: q q k v][g1: ...] (Falcon)
                            _, (_, _, part, side) = got
                            chains.append([term(base, idx, part, dual != side)])
                            continue
                        if cw not in self.within_of:
                            chains = []
                            break
                        _, _, part, side = self.within_of[cw]
                        chains.append([term(base, idx, part + (".kv" if kv else ""), dual != side)])
                    if chains:
                        sp = self.spaces[base]
                        return axis_expr(chains, cat=True, heads=sp.kv_dim if kv and sp.kv_dim else sp.heads_dim)
        rep = self.replicated(r)
        if rep is not None:  # copies of one class side by side: its expression, once per copy
            sub = self.describe(rep[0], dual, absval)
            if sub is None or sub.cat:
                return None
            return axis_expr([list(sub.segments[0].terms) for _ in range(rep[1])], cat=True)
        tiles = self.ax.tiling(r)
        if tiles:
            chains = []
            for _, _, c in tiles:
                sub = self.describe(c, dual, absval)
                if sub is None or sub.cat:
                    return None
                chains.append(list(sub.segments[0].terms))
            return axis_expr(chains, cat=True)
        return None

    def _grouped_heads(self, g: int, rest: int, dual: bool) -> AxisExpr | None:
        """``(g, rest)`` with ``rest`` one key/value group's query heads (:meth:`_group_piece`)
        and ``g`` that group: the query heads of a grouped layout (Falcon's), group-major
        as ``Heads(H, ..., kv=K)`` orders them."""
        got = self._group_piece(rest)
        if got is None:
            return None
        joined, (_, _, part, side) = got
        if joined not in self.head_of:
            return None
        whole = self.ax.splits.get(self.ax.find(joined), {}).get((self.ax.size[g], self.ax.size[joined] // self.ax.size[g]))
        if whole is None or self.ax.find(whole[0]) != g:
            return None
        base, idx, _ = self.head_of[joined]
        return axis_expr([[term(base, idx, part, dual != side)]])

    def _group_piece(self, a: int) -> tuple[int, tuple[str, int | None, str, bool]] | None:
        """(the query-head class, the width's (base, index, part, side)) when ``a`` holds
        one key/value group's query heads: split into (the heads of the group, a head's
        width)."""
        for kids in self.ax.splits.get(a, {}).values():
            if len(kids) == 2:
                inside, w = self.ax.find(kids[0]), self.ax.find(kids[1])
                if inside in self.group_heads and w in self.within_of:
                    return self.group_heads[inside], self.within_of[w]
        return None

    def bindings(self, folded_gains: set[str], folded_biases: set[str], unfoldable: dict[int, str]) -> dict[str, Any]:
        params: dict[str, Any] = {}
        self.param_notes: dict[str, str] = {}
        for pname in self.tensors:
            atoms = self.f.param_atoms.get(pname)
            roles = self.f.roles.get(pname, {})
            if atoms is None:
                params[pname] = "invariant"
                self.param_notes[pname] = "not used by the traced forward"
                continue
            if pname in folded_gains or pname in folded_biases:
                params[pname] = "invariant"
                self.param_notes[pname] = "1 after fold_norm" if pname in folded_gains else "0 after fold_norm"
                continue
            if pname in self.expert_params:
                params[pname] = self._expert_binding(pname, atoms, roles)
                continue
            axes: list[AxisExpr] = []
            for axis, a in enumerate(atoms):
                rs = roles.get(axis, set())
                per_head = self.head_uses.get(self.ax.find(a), 0) == 1  # a table added to the scores per head
                if self.tensors[pname].shape[axis] == 1 or not (rs & {"co", "contra", "gain", "normbias"} or per_head):
                    axes.append(UNTOUCHED)
                    continue
                dual = "contra" in rs and "co" not in rs
                absval = "gain" in rs
                b = self.describe(a, dual, absval)
                if b is None:
                    axes.append(UNTOUCHED)
                    continue
                chains = [list(c.terms) for c in b.segments]
                sc = self.scaled.get((pname, axis))
                if sc is not None and not b.cat and len(chains[0]) == 1:
                    chains[0].append(term(sc[0], sc[1], "", sc[2]))
                if b.cat:
                    for i, chain in enumerate(chains):
                        sp_ = self.scaled_piece.get((pname, axis, i))
                        if sp_ is not None and len(chain) == 1:
                            chain.append(term(sp_[0], sp_[1], "", sp_[2]))
                if "sgn" in self.spaces and not b.cat and any(t.space == "resid" for t in chains[0]):
                    sign = self._sign_of(pname, axis)
                    if sign is not None:
                        chains[0].insert(0, term("sgn", None, "", sign))
                axes.append(axis_expr(chains, b.cat, b.heads))
            params[pname] = axes
        return params

    def _expert_binding(self, pname: str, atoms: list[int], roles: dict[int, set[str]]) -> list[AxisExpr]:
        """An expert weight, seen through its view: the expert and unit axes merged (the
        experts' units, expert-major; a fused gate/up as ``cat(..., heads=E)``), and the
        residual axis."""
        view, unit_axis, other, pieces, base, idx = self.expert_params[pname]
        unit_dual = "contra" in roles.get(unit_axis, set()) and "co" not in roles.get(unit_axis, set())
        unit = term(base, idx, "", unit_dual)
        chains = [[unit] for _ in range(pieces)]
        for i, chain in enumerate(chains):
            sc = self.scaled_piece.get((pname, unit_axis, i)) if pieces > 1 else self.scaled.get((pname, unit_axis))
            if sc is not None:
                chain.append(term(sc[0], sc[1], "", sc[2]))
        units = axis_expr(chains, cat=True, heads="E") if pieces > 1 else axis_expr(chains)
        rs = roles.get(other, set())
        resid = self.describe(atoms[other], "contra" in rs and "co" not in rs) or UNTOUCHED
        return [units if len(g) == 2 else resid for g in view]

    def _sign_of(self, pname: str, axis: int) -> bool | None:
        """Does the global sign reach this axis, and dually? None: it does not. A sign
        passes adds, copies and LayerNorms (odd), not an activation such as GELU: each
        group of residual-stream activations joined by adds and copies is signed unless
        one of them is an activation's input or output. A gain whose norm turns an
        unsigned input into a signed output carries the sign itself."""
        signed = self._signed_nodes()
        out: set[bool | None] = set()
        for role, node, src in self.f.sites.get((pname, axis), set()):
            if role in ("co", "normbias"):
                out.add(False if signed.get(node, False) else None)
            elif role == "contra":
                out.add(True if signed.get(node, False) else None)
            elif role == "gain":
                out.add(False if signed.get(node, False) != signed.get(src, False) else None)
        return out.pop() if len(out) == 1 else None

    def _signed_nodes(self) -> dict[str, bool]:
        if hasattr(self, "_signed_cache"):
            return self._signed_cache
        roots = {r for r, (b, _) in self.class_space.items() if b == "resid"}
        nodes = [n for n in self.f.nodes.values() if n.name in self.f.node_atom and self.ax.find(self.f.node_atom[n.name]) in roots]
        names = {n.name for n in nodes}
        parent = {n: n for n in names}

        def find(x: str) -> str:
            while parent[x] != x:
                parent[x] = parent[parent[x]]
                x = parent[x]
            return x

        linking = TRANSPARENT | RESHAPE | PERMUTE | {"add", "sub", "getitem", "select", "slice", "cat"}
        bad: set[str] = set()
        for n in nodes:
            op = opname(n)
            if op in ACTIVATIONS and op not in ODD:
                bad.add(n.name)
            for u in n.users:
                uop = opname(u)
                if u.name in names and (uop in linking or (uop in ("mul", "div") and any(not hasattr(a, "name") for a in u.args))):
                    parent[find(u.name)] = find(n.name)
                if uop in ACTIVATIONS and uop not in ODD:
                    bad.add(n.name)
        unsigned = {find(x) for x in bad}
        self._signed_cache = {n: find(n) not in unsigned for n in names}
        return self._signed_cache

    # -- ties and centring -------------------------------------------------------------
    def plan_ties(self, folds: list[Fold]) -> tuple[list[tuple[str, ...]], list[str]]:
        ties: list[tuple[str, ...]] = []
        untie: list[str] = []
        done: set[str] = set()
        folded_into = {w for fold in folds for w, _, _ in fold.into} | {b for fold in folds if fold.fold_bias for _, _, b in fold.into if b}
        for pname, names in self.f.aliases.items():
            if len(names) < 2 or pname in done:
                continue
            done.update(names)
            used = [n for n in names if n in self.f.param_atoms]
            first = names[0]
            ties.append(tuple(names))  # one tie for all the names: a spec declares a shared tensor whole
            # a fold that changes one side of a tie and not the other: the spec unties it
            for n in names[1:]:
                if n in folded_into or (first in folded_into and n not in folded_into):
                    untie.append(n)
            if not untie and len(used) > 1:
                self.notes.append(f"{', '.join(names)} stay tied: the residual's group must act the same on both")
        return ties, untie

    def plan_center(self, folds: list[Fold]) -> dict[str, int]:
        """Writers of an OC residual, mean-centred, when every layer that reads it reads
        a LayerNorm's output."""
        resid = self.spaces.get("resid")
        if resid is None or resid.group != "OC":
            return {}
        roots = [r for r, (b, _) in self.class_space.items() if b == "resid"]
        norm_readers = {(w, a) for cons in self.f.consumers.values() for kind, w, a in cons if kind == "linear"}
        lns = [n for n in self.f.norms if n.kind == "layernorm"]
        if not lns:
            return {}
        out: dict[str, int] = {}
        for r in roots:
            for pname, axis, roles in self._axes_of(r):
                if "contra" in roles and (pname, axis) not in norm_readers:
                    self.notes.append(f"no mean-centring: {pname} reads the residual stream without a LayerNorm")
                    return {}
                if "co" in roles and "normbias" not in roles and "gain" not in roles:
                    out[pname] = axis
        return out

    # -- dims ---------------------------------------------------------------------------
    def name_dims(self) -> None:
        config = getattr(self.model, "config", None)
        cands = {
            "d": ["hidden_size", "n_embd", "d_model", "embed_dim", "dim", "width", "hidden_dim"],
            "H": ["num_attention_heads", "n_head", "num_heads", "n_heads", "encoder_attention_heads", "decoder_attention_heads"],
            "K": ["num_key_value_heads", "n_kv_heads", "num_kv_heads", "multi_query_group_num", "n_head_kv"],
            "dh": ["head_dim", "kv_channels", "d_head", "d_kv"],
            "f": ["intermediate_size", "n_inner", "ffn_dim", "d_ff", "mlp_dim", "ffn_hidden_size", "n_ff", "ffn_dim"],
            "E": ["num_local_experts", "num_experts", "n_routed_experts", "moe_num_experts"],
            "fe": ["moe_intermediate_size", "expert_intermediate_size", "intermediate_size"],
        }
        for sp in self.spaces.values():
            if sp.kind == "plain":
                self.dims.setdefault(sp.dim, ("", sp.size, ""))
        sizes = {k: v[1] for k, v in self.dims.items()}
        out: dict[str, tuple[str, int, str]] = {}
        for sym, (_, size, comment) in self.dims.items():
            expr = ""
            for attr in cands.get(sym, []):
                v = _config_get(config, attr)
                if isinstance(v, int) and not isinstance(v, bool) and v == size:
                    expr = f"config.{attr}"
                    break
            if not expr and sym == "dh" and "d" in sizes and "H" in sizes and sizes["d"] == sizes["H"] * size:
                expr = "d / H"
            if not expr and sym == "H":
                expr = self._module_attr(("num_heads", "n_head", "num_attention_heads", "n_heads"), size)
            if not expr and sym == "r":
                expr = self._module_attr(("rotary_ndims", "rotary_dim", "rot_dim", "rotary_emb_dim"), size)
            if not expr:
                expr = self._shape_expr(sym, size)
            out[sym] = (expr or str(size), size, comment)
        order = ["d", "H", "K", "dh", "f", "E", "fe", "r"]
        self.dims = {k: out[k] for k in sorted(out, key=lambda k: (order.index(k) if k in order else len(order), k))}

    def _module_attr(self, names: Iterable[str], size: int) -> str:
        for mname, mod in self.model.named_modules():
            for a in names:
                v = getattr(mod, a, None)
                if isinstance(v, int) and not isinstance(v, bool) and v == size and mname:
                    return f'attr("{mname}.{a}")'
        return ""

    def _shape_expr(self, sym: str, size: int) -> str:
        bases = [b for b, sp in self.spaces.items() if sp.dim == sym]
        for r, (b, _) in self.class_space.items():
            if b in bases:
                for pname, axis, _ in self._axes_of(r):
                    if self.tensors.get(pname) is not None and self.tensors[pname].shape[axis] == size:
                        return f'shape("{pname}", {axis})'
        return ""


def _config_get(config: Any, attr: str) -> Any:
    if config is None:
        return None
    if isinstance(config, dict):
        return config.get(attr)
    try:
        return getattr(config, attr, None)
    except Exception:
        return None

