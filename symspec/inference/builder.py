"""Building a :class:`~.draft.Draft` from the graph's facts: the attention and expert
spaces here, the plain spaces, folds and scalings in :mod:`.draft_spaces`, the bindings,
ties, centring and dims in :mod:`.draft_bindings`."""

from __future__ import annotations

import math
import re
from typing import Any

import torch

from .draft import Draft, Space, layer_of
from .draft_bindings import Bindings
from .draft_spaces import SpacePlans
from .facts import Facts
from .lattice import HEAD_PARTS, largest, meet, shrink_chain


def build(facts: Facts, model: torch.nn.Module, name: str, *, fold: bool = True, center: bool = True) -> Draft:
    """The draft for ``model`` from its graph's facts (``fold``/``center``: plan those steps)."""
    return _Builder(facts, model, name, fold=fold, center=center).build()


class _Builder(SpacePlans, Bindings):
    def __init__(self, facts: Facts, model: torch.nn.Module, name: str, *, fold: bool, center: bool) -> None:
        self.f = facts
        self.ax = facts.axes
        self.model = model
        self.name = name
        self.fold_ok = fold
        self.center_ok = center
        self.tensors = dict(model.named_parameters(remove_duplicate=False))
        self.spaces: dict[str, Space] = {}
        self.class_space: dict[int, tuple[str, int | None]] = {}  # class root -> (base, index)
        self.head_of: dict[int, tuple[str, int | None, bool]] = {}  # head class -> (base, index, kv view)
        #: the query heads of one key/value group (Falcon's grouped layout) -> the query-head class
        self.group_heads: dict[int, int] = {}
        #: head class -> the attentions whose heads it is (T5's stack shares one bias table: all)
        self.head_uses: dict[int, int] = {}
        self.within_of: dict[int, tuple[str, int | None, str, bool]] = {}  # within-head class -> (base, index, part, dual side)
        self.notes: list[str] = []
        self.unexplained: list[tuple[str, str]] = []
        self.dims: dict[str, tuple[str, int, str]] = {}
        self.single_kv: set[str] = set()  # attentions with one key/value head (multi-query)
        self.rope_layout = "half"
        self.router_of: dict[int, tuple[str, int | None]] = {}  # router output class -> (base, index)
        #: expert weight -> (view, unit axis, resid axis, pieces, base, index)
        self.expert_params: dict[str, tuple[tuple[tuple[int, ...], ...], int, int, int, str, int | None]] = {}
        self.expert_classes: set[int] = set()
        self.views: dict[str, tuple[tuple[int, ...], ...]] = {}

    # -- tags ------------------------------------------------------------------------
    def related_tags(self, atom: int) -> set[str]:
        """Tags of a class, of every class its refinements reach, and of the classes it
        is a piece of."""
        out: set[str] = set()
        for r in self.ax.descendants(atom):
            out |= self.ax.tags_of(r)
        a = self.ax.find(atom)
        seen = set()
        while a in self.ax.origin and a not in seen:
            seen.add(a)
            a = self.ax.find(self.ax.origin[a][0])
            out |= self.ax.tags_of(a)
        # a child's origin is recorded on the child atom, which may not be its class's root
        for child, (parent, _, _) in self.ax.origin.items():
            if self.ax.find(child) == self.ax.find(atom):
                out |= self.ax.tags_of(parent)
        return out

    # -- the pieces ------------------------------------------------------------------
    def build(self) -> Draft:
        self.attention_spaces()
        experts = self.expert_groups()
        folds, folded_gains, folded_biases, unfoldable = self.plan_folds()
        self.plain_spaces(unfoldable)
        self.expert_spaces(experts)
        self.scales()
        params = self.bindings(folded_gains, folded_biases, unfoldable)
        self.buffers_invariant(params)
        ties, untie = self.plan_ties(folds)
        self.bind_tied_alike(params, ties, untie)
        centre = self.plan_center(folds) if self.center_ok else {}
        self.name_dims()
        self.notes += [f"inference could not read a node, {why}; the axes it touches stay invariant"
                       for why in self.f.unreadable.values()]
        draft = Draft(self.name, type(self.model).__name__, self.dims, self.spaces, params, self.param_notes,
                      ties, untie, folds, centre, self.notes, self.unexplained, self.views)
        return draft

    def bind_tied_alike(self, params: dict[str, Any], ties: list[tuple[str, ...]], untie: list[str]) -> None:
        """A name of a tie the graph never reads (T5's ``shared.weight``: the stacks read
        it as their ``embed_tokens``) is the same tensor as the names it does read: it
        takes their binding, not ``invariant`` (a tie of two transforms does not bind)."""
        def acts(binding: Any) -> bool:
            return binding != "invariant" and any(c.terms for e in binding for c in e.segments)

        for tie in ties:
            kept = [n for n in tie if n not in untie]
            bound = [n for n in kept if acts(params.get(n, "invariant"))]
            for n in kept:
                if bound and n in params and not acts(params[n]):
                    params[n] = params[bound[0]]
                    self.param_notes[n] = f"tied to {bound[0]}: one tensor, one transform"

    def buffers_invariant(self, params: dict[str, Any]) -> None:
        """The model's floating-point buffers that its state dict keeps (BART's
        ``final_logits_bias``): a spec accounts for every such entry. The graph shows them
        as fixed tables, which leave the classes they touch invariant, so they are
        declared invariant; the check verifies it like everything else."""
        own = {n for n, _ in self.model.named_parameters(remove_duplicate=False)}
        for name, t in self.model.state_dict(keep_vars=True).items():
            if name not in own and name not in params and isinstance(t, torch.Tensor) and t.is_floating_point():
                params[name] = "invariant"
                self.param_notes[name] = "a buffer the state dict keeps: a fixed table"

    # -- mixtures of experts -------------------------------------------------------------
    def expert_groups(self) -> list[dict[str, Any]]:
        """The mixtures of experts: per router, its output class (one per expert), the
        experts' unit class and how each expert weight binds. Their classes are set aside
        (they are not plain spaces); what does not fit the pattern is left to the rest."""
        by_atom: dict[int, list[Any]] = {}
        for use in self.f.experts:
            by_atom.setdefault(self.ax.find(use.expert_atom), []).append(use)
        out = []
        for e_root, uses in by_atom.items():
            router = next((u.router for u in uses if u.router), None)
            r_atoms = self.f.param_atoms.get(router or "")
            if router is None or r_atoms is None or len(r_atoms) != 2 or self.ax.find(r_atoms[0]) != e_root:
                self.notes.append(f"experts {', '.join(sorted({u.weight for u in uses}))}: no router found whose scores pick them; left invariant")
                continue
            resid = self.ax.find(r_atoms[1])
            units: set[int] = set()
            binds = []
            for u in uses:
                atoms = self.f.param_atoms[u.weight]
                unit_axis = u.write_axis if self.ax.find(atoms[u.write_axis]) != resid else u.read_axis
                other = u.read_axis if unit_axis == u.write_axis else u.write_axis
                cls = self.ax.find(atoms[unit_axis])
                tiles = self.ax.tiling(cls)
                pieces = [self.ax.find(c) for _, _, c in tiles] if tiles else [cls]
                if self.ax.find(atoms[other]) != resid or len(atoms) != 3:
                    units.clear()
                    break
                units.update(pieces)
                binds.append((u, unit_axis, other, len(pieces)))
            if len(units) != 1:
                self.notes.append(f"experts of {router}: their hidden units do not form one class; left invariant")
                continue
            unit = units.pop()
            self.expert_classes |= {e_root, unit}
            out.append({"router": router, "experts": e_root, "unit": unit, "binds": binds})
        return out

    def expert_spaces(self, groups: list[dict[str, Any]]) -> None:
        for grp in groups:
            router, unit = grp["router"], grp["unit"]
            layer = layer_of(router)
            tags = self.related_tags(unit)
            g, why = largest(tags)
            within = meet(g, "SP")
            n_exp, f = self.ax.size[grp["experts"]], self.ax.size[unit]
            base = "moe"
            sp = self.spaces.get(base)
            if sp is None:
                dim = "f" if "f" not in self.dims or self.dims["f"][1] == f else "fe"
                sp = self.spaces[base] = Space(base, "experts", "Experts", dim, f, within=within, chain=["Id"] if within != "Id" else [])
                weights = sorted({u.weight for u, *_ in grp["binds"]})
                sp.evidence.append(f"{router}: a router (softmax, top-k) picks experts among {n_exp}; {', '.join(weights)}: "
                                   f"expert weights applied to the rows routed to each expert, so the experts may be "
                                   f"permuted with the router's rows")
                sp.evidence.append(f"each expert's {f} hidden units: " + (", ".join(why) if why else "only linear maps act on them"))
                self.dims.setdefault("E", ("", n_exp, "experts"))
                self.dims.setdefault(dim, ("", f, ""))
            sp.instances.add(layer)
            self.router_of[grp["experts"]] = (base, layer)
            for u, unit_axis, other, pieces in grp["binds"]:
                merged = (u.expert_axis, unit_axis)
                view = (merged, (other,)) if unit_axis < other else ((other,), merged)
                self.expert_params[u.weight] = (view, unit_axis, other, pieces, base, layer)
                self.views[u.weight] = view

    def attention_spaces(self) -> None:
        count: dict[int | None, int] = {}
        for att in self.f.attentions:
            if not (att.q and att.k and att.v and att.qh):
                continue
            qw, kw, vw = (self.ax.find(x[0]) for x in (att.q, att.k, att.v))
            # heads merged with the batch ([batch * heads, seq, dh], Bloom's baddbmm): the heads
            # are the inner part of the merged axis
            qh = self.ax.find(att.qh[-1])
            kh = self.ax.find(att.kh[-1]) if att.kh else None
            if len(att.qh) == 2 and kh is not None and self.ax.find(att.qh[0]) == kh:
                # query heads laid out as (key/value group, head in the group): Falcon's
                # grouped fused heads. One class for them all, split the same way
                qh = self._joined(att.qh)
                self.group_heads[self.ax.find(att.qh[1])] = qh
            layer = self._layer_of_module(att.module)
            k = count.get(layer, 0)
            count[layer] = k + 1
            base = "attn" if k == 0 else f"attn{k + 1}"
            H, dh = self.ax.size[qh], self.ax.size[qw]
            K = att.kv or H
            gqa = K != H
            # heads of other sizes (a later stage of Swin) are a family of their own, with
            # dimensions of their own
            v = 1
            while (other := self.spaces.get(base if v == 1 else f"{base}_{v}")) is not None and \
                    (other.size, other.dh_size, other.kv_size) != (H, dh, K):
                v += 1
            base, sfx = (base, "") if v == 1 else (f"{base}_{v}", str(v))
            sp = self.spaces.get(base)
            if sp is None:
                sp = self.spaces[base] = Space(base, "heads", "Heads", "H" + sfx, H, heads_dim="H" + sfx,
                                               kv_dim="K" + sfx if gqa else None, dh_dim="dh" + sfx)
                sp.dh_size, sp.kv_size = dh, K
                qk_tags = self.related_tags(qw) | self.related_tags(kw)
                sp.qk, sp.rot, why_qk = self.qk_group(qw, kw, qk_tags)
                sp.rope_layout = self.rope_layout
                sp.ov, why_ov = largest(self.related_tags(vw) - {"product"})
                sp.ov = meet(sp.ov, "GL")
                sp.qk_chain = shrink_chain(sp.qk, HEAD_PARTS)
                sp.ov_chain = shrink_chain(sp.ov, HEAD_PARTS)
                sp.evidence.append(f"{att.node} in {att.module or 'the model'}: {H} query heads of width {dh}"
                                   + (f", {K} key/value heads (grouped-query attention)" if gqa else ""))
                if sp.qk == "RoPE":
                    pairs = "dims (2i, 2i + 1)" if sp.rope_layout == "interleaved" else "dims i and i + half"
                    sp.evidence.append(f"rotary embeddings: {pairs} of each query and key head are rotated together by a position-dependent table"
                                       + (f"; only the first {sp.rot} dims of a head rotate" if sp.rot and sp.rot < dh else ""))
                elif why_qk:
                    sp.evidence.append(f"QK maps limited to {sp.qk}: {', '.join(why_qk)}")
                if why_ov:
                    sp.evidence.append(f"OV maps limited to {sp.ov}: {', '.join(why_ov)}")
                if sp.rot and sp.rot < dh:
                    sp.rot_dim = "r" + sfx
                    self.dims.setdefault("r" + sfx, ("", sp.rot, "rotated dims of each head"))
                self.dims.setdefault("H" + sfx, ("", H, "attention heads"))
                self.dims.setdefault("dh" + sfx, ("", dh, "width of a head"))
                if gqa:
                    self.dims.setdefault("K" + sfx, ("", K, "key/value heads"))
            sp.instances.add(layer)
            self.head_uses[qh] = self.head_uses.get(qh, 0) + 1
            self.head_of[qh] = (base, layer, False)
            if gqa and kh is not None:
                self.head_of[kh] = (base, layer, True)
            elif gqa:  # a single key/value head: its projection has no head axis
                self.single_kv.add(base)
            self.within_of[qw] = (base, layer, "qk", False)
            self.within_of.setdefault(kw, (base, layer, "qk", True))
            self.within_of[vw] = (base, layer, "ov", False)

    def _joined(self, atoms: tuple[int, ...]) -> int:
        """A class of the size of ``atoms``' product whose split is ``atoms`` (made once)."""
        key = tuple(self.ax.find(a) for a in atoms)
        for r, memo in self.ax.splits.items():
            kids = memo.get(tuple(self.ax.size[a] for a in key))
            if kids is not None and tuple(self.ax.find(k) for k in kids) == key:
                return self.ax.find(r)
        whole = self.ax.fresh(math.prod(self.ax.size[a] for a in key))
        for a, b in zip(self.ax.split(whole, [self.ax.size[a] for a in key]), key):
            self.ax.unify(b, a)  # the existing classes keep their roots
        return self.ax.find(whole)

    def qk_group(self, qw: int, kw: int, tags: set[str]) -> tuple[str, int | None, list[str]]:
        rot = self._rope(qw)
        layout = self.rope_layout
        if rot is not None and self._rope(kw) == rot and self.rope_layout == layout:
            rest = tags - {"varying", "product"}
            g, why = largest(rest)
            return ("RoPE", rot, []) if g == "GL" else ("Id", None, why)
        g, why = largest(tags)
        return meet(g, "GL"), None, why

    def _rope_interleaved(self, w: int) -> bool:
        """Pairs (2i, 2i + 1) rotated by a position-dependent table (GPT-J's rotate_every_two)."""
        ev = self.ax.every.get(self.ax.find(w), {})
        return (0 in ev and 1 in ev and self.ax.find(ev[0]) == self.ax.find(ev[1])
                and "varying" in self.related_tags(w))

    def _rope(self, w: int) -> int | None:
        """The rotated width of a head class whose halves are paired by a rotary table:
        the class (or its first segment) is cut into two halves that are one class, and it
        is multiplied by a position-dependent table."""
        n = self.ax.size[self.ax.find(w)]
        self.rope_layout = "half"
        if self._rope_interleaved(w):
            self.rope_layout = "interleaved"
            return n
        tiles = self.ax.tiling(w)
        if tiles and len(tiles) == 2 and self._rope_interleaved(tiles[0][2]) \
                and "varying" not in self.related_tags(tiles[1][2]):
            self.rope_layout = "interleaved"
            return tiles[0][1]
        if tiles and len(tiles) == 2 and tiles[0][1] * 2 == n and self.ax.find(tiles[0][2]) == self.ax.find(tiles[1][2]):
            return n if "varying" in self.related_tags(w) else None
        if tiles and len(tiles) == 2:
            first = tiles[0][2]
            r = tiles[0][1]
            sub = self.ax.tiling(first)
            if sub and len(sub) == 2 and sub[0][1] * 2 == r and self.ax.find(sub[0][2]) == self.ax.find(sub[1][2]) \
                    and "varying" in self.related_tags(first) and "varying" not in self.related_tags(tiles[1][2]):
                return r
        return None

    def _layer_of_module(self, module: str) -> int | None:
        m = re.search(r"\.(\d+)(\.|$)", module)
        return int(m.group(1)) if m else None

