"""Planning a draft's plain spaces, the norms to fold and the scalings units admit (a
mixin of the draft builder, :mod:`.builder`)."""

from __future__ import annotations

import math
from typing import Any

from .draft import Fold, Space, layer_of, template_of
from .facts import TRANSPARENT
from .lattice import largest, meet, shrink_chain


class SpacePlans:
    """Folds, plain spaces (the largest group each class's evidence allows) and scalings."""

    # -- folding -----------------------------------------------------------------------
    def plan_folds(self) -> tuple[list[Fold], set[str], set[str], dict[int, str]]:
        """Norms whose output only layers read: their gain (and bias) fold into those
        layers. Returns the folds, the folded gains and biases, and the classes whose
        norm could not be folded (class root -> why)."""
        folds: list[Fold] = []
        gains: set[str] = set()
        biases: set[str] = set()
        unfoldable: dict[int, str] = {}
        lin_bias = {(lin.weight, lin.read_axis): lin.bias for lin in self.f.linears}
        for norm in self.f.norms:
            if norm.gain is None and norm.bias is None:
                continue
            cons = self.f.consumers.get(norm.output, [])
            readers = [(w, a) for kind, w, a in cons if kind == "linear"]
            other = sorted({kind for kind, _, _ in cons if kind != "linear"})
            # a reader that is one tensor with two or more others (BART's head with the shared
            # embedding and both stacks' embeddings) would be untied from a tie a config
            # keeps: written apart, transformers 5 loads the embeddings tied to nothing
            shared = sorted(w for w, _ in readers if len(self._tie_of(w)) > 2)
            root = self.ax.find(norm.atom)
            if not self.fold_ok or other or not readers or shared:
                why = (f"its output also goes to {', '.join(other)}" if other else "nothing reads it" if not readers
                       else f"{shared[0]} is one tensor with {len(self._tie_of(shared[0])) - 1} others, kept tied"
                       if shared else "folding it changed the function in the check")
                unfoldable[root] = f"{norm.gain or norm.bias}: {why}"
                continue
            into = [(w, a, lin_bias.get((w, a))) for w, a in dict.fromkeys(readers)]
            fold_bias = norm.bias is not None and all(b is not None for _, _, b in into)
            folds.append(Fold(norm.gain, norm.bias, norm.offset, into, fold_bias))
            if norm.gain:
                gains.add(norm.gain)
            if norm.bias and fold_bias:
                biases.add(norm.bias)
        return folds, gains, biases, unfoldable

    def _tie_of(self, name: str) -> tuple[str, ...]:
        """Every name of the tensor ``name`` is (itself alone where it is tied to nothing)."""
        return next((names for names in self.f.aliases.values() if name in names), (name,))

    # -- plain spaces ------------------------------------------------------------------
    def plain_spaces(self, unfoldable: dict[int, str]) -> None:
        order: list[int] = []
        for _pname, atoms in self.f.param_atoms.items():
            for a in atoms:
                r = self.ax.find(a)
                if r not in order and not self._structured(r):
                    order.append(r)
        emb = self._embedding_class()
        per_layer: dict[int | None, int] = {}
        # per-layer spaces form a family ``base[i]`` by the parameters they bind, as layer
        # templates: a space only one layer has (T5's relative position bias, in the first
        # layer of each stack) is a family of its own, not the next layer's first space
        families: list[tuple[set[str], str, set[int], int]] = []
        for r in order:
            axes = self._axes_of(r)
            if self.ax.size[r] <= 1 or not any(role in ("co", "contra") for _, _, roles in axes for role in roles):
                continue  # gains and biases alone: nothing writes or reads through it
            tiles = self.ax.tiling(r)
            if tiles and all(self.ax.find(c) in order or self._structured(self.ax.find(c)) for _, _, c in tiles):
                continue  # a fused axis (Phi-3's gate_up) is its pieces' spaces, concatenated
            if self.replicated(r) is not None:
                continue  # copies of one class side by side (Swin's patch merging): that class's space
            tags = self.related_tags(r)
            g, why = largest(tags)
            if r in unfoldable:
                kind = "rms" if "rms" in tags or "sumsq" in tags else "layernorm"
                g = meet(g, "SP" if kind == "rms" else "S")
                why.append(f"a norm whose gain cannot be folded ({unfoldable[r]})")
            layers = {layer_of(p) for p, _, _ in axes if layer_of(p) is not None}
            index = layers.pop() if len(layers) == 1 and r != emb and not any(layer_of(p) is None for p, _, _ in axes) else None
            if g == "Id":
                self.unexplained.append((self._where(axes), ", ".join(why) or "no symmetry"))
                continue
            if index is None and r == emb:
                base = "resid"
            elif index is None:
                k = per_layer.get(None, 0)
                per_layer[None] = k + 1
                base = "hidden" if k == 0 else f"hidden{k + 1}"
            else:
                stem = "mlp" if any(t.startswith(("nonlinear", "odd", "homogeneous", "product")) for t in tags) else "hidden"
                templates = {template_of(p) for p, _, _ in axes}
                # a family has one width: a layer of another width (a later stage of Swin)
                # starts a family of its own, with its own dimension
                found = next((fam for fam in families if fam[0] & templates and index not in fam[2]
                              and fam[1].rstrip("0123456789") == stem and fam[3] == self.ax.size[r]), None)
                if found is None:
                    k = len(families)
                    found = ({*templates}, stem if k == 0 else f"{stem}{k + 1}", set(), self.ax.size[r])
                    families.append(found)
                found[0].update(templates)
                found[2].add(index)
                base = found[1]
            sp = self.spaces.get(base)
            if sp is None:
                dim = "d" if base == "resid" else "f" if base == "mlp" else f"n_{base}"
                sp = self.spaces[base] = Space(base, "plain", g, dim, self.ax.size[r], chain=shrink_chain(g))
                sp.evidence.append(f"{self._where(axes)}: " + (", ".join(why) if why else "only linear maps act on it"))
                self.dims.setdefault(dim, ("", self.ax.size[r], ""))
            elif self.ax.size[r] != sp.size:
                self.notes.append(f"{base}: layer {index} has width {self.ax.size[r]}, not {sp.size}; its bindings are kept per layer")
            sp.instances.add(index)
            if meet(sp.group, g) != sp.group:
                sp.group = meet(sp.group, g)
                sp.chain = shrink_chain(sp.group)
            self.class_space[r] = (base, index)
            if base == "resid" and r in unfoldable and "layernorm" in tags:
                self.spaces["sgn"] = Space("sgn", "sign", "Sign", "d", self.ax.size[r], {None}, shrink_chain("Sign"),
                                           ["LayerNorm(-y) = -LayerNorm(y): a global sign of the residual stream passes its norms"])

    def replicated(self, r: int) -> tuple[int, int] | None:
        """(the class, the copies) when ``r`` is copies of one class side by side: split
        into (positions..., features) where no parameter has an axis of the positions'
        classes (Swin's patch merging reads 2 x 2 neighbouring positions' features as one
        axis of 4C). None otherwise."""
        axes = self._param_classes()
        for sizes, kids in self.ax.splits.get(r, {}).items():
            lead = [self.ax.find(k) for k in kids[:-1]]
            last = self.ax.find(kids[-1])
            if len(kids) < 2 or any(k in axes or k in self.head_of for k in lead):
                continue
            if last in axes:
                return last, math.prod(sizes[:-1])
            inner = self.replicated(last)  # (2, (2, C)): split one factor at a time
            if inner is not None:
                return inner[0], inner[1] * math.prod(sizes[:-1])
        return None

    def _param_classes(self) -> set[int]:
        return {self.ax.find(a) for atoms in self.f.param_atoms.values() for a in atoms}

    def _structured(self, r: int) -> bool:
        """A class described by an attention's heads (split into heads and head width), or
        by a mixture of experts (the router's outputs, the experts' units)."""
        if r in self.within_of or r in self.head_of or r in self.expert_classes:
            return True
        for kids in self.ax.splits.get(r, {}).values():
            if len(kids) == 2 and self.ax.find(kids[0]) in self.head_of:
                return True
        tiles = self.ax.tiling(r)
        return bool(tiles and all(self._structured(self.ax.find(c)) for _, _, c in tiles))

    def _embedding_class(self) -> int | None:
        for pname, roles in self.f.roles.items():
            if any("index" in rs for rs in roles.values()):
                for axis, rs in roles.items():
                    if "co" in rs:
                        return self.ax.find(self.f.param_atoms[pname][axis])
        # no embedding (a vision model): the class most parameters write into
        best, count = None, -1
        tally: dict[int, int] = {}
        for pname, roles in self.f.roles.items():
            for axis, rs in roles.items():
                if "co" in rs:
                    r = self.ax.find(self.f.param_atoms[pname][axis])
                    tally[r] = tally.get(r, 0) + 1
        for r, c in tally.items():
            if c > count:
                best, count = r, c
        return best

    def _axes_of(self, r: int) -> list[tuple[str, int, set[str]]]:
        out = []
        for pname, atoms in self.f.param_atoms.items():
            for axis, a in enumerate(atoms):
                if self.ax.find(a) == r:
                    out.append((pname, axis, self.f.roles.get(pname, {}).get(axis, set())))
        return out

    def _where(self, axes: list[tuple[str, int, set[str]]]) -> str:
        names = [f"{p}[{a}]" for p, a, _ in axes]
        return ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")

    # -- scalings ----------------------------------------------------------------------
    def scales(self) -> None:
        """Diagonal scalings: a gated unit's linear factor (``D``), a ReLU-like unit's input
        (``Dpos``). A fused gate/up weight split by a chunk scales the piece that is the
        linear factor only; an expert weight's scaling acts on the experts' units
        (``D(E * f)``)."""
        self.scaled: dict[tuple[str, int], tuple[str, int | None, bool]] = {}
        #: (weight, axis, piece of a concatenated axis) -> the scaling on that piece
        self.scaled_piece: dict[tuple[str, int, int], tuple[str, int | None, bool]] = {}
        lin_by_weight = {lin.weight: lin for lin in self.f.linears}
        readers = self._readers_of_nodes()
        dense_gate = any(g[1] in lin_by_weight for g in self.f.gates)
        names: dict[tuple[str, str], str] = {}  # (stem, the unit space's base) -> the scaling space's name
        for kind, items in (("gate", self.f.gates), ("relu", self.f.homogeneous)):
            for node, weight, *rest in items:
                piece = rest[1] if len(rest) > 2 else None
                piece_node = rest[2] if len(rest) > 2 else None
                lin = lin_by_weight.get(weight)
                expert = self.expert_params.get(weight) if kind == "gate" else None
                if lin is None and expert is None:
                    continue
                axis = expert[1] if expert is not None else lin.write_axis  # type: ignore[union-attr]
                r = self.ax.find(self.f.param_atoms[weight][axis])
                if piece is not None:
                    tiles = self.ax.tiling(r)
                    if not tiles or piece >= len(tiles):
                        continue
                    r = self.ax.find(tiles[piece][2])
                owner = (expert[4], expert[5]) if expert is not None else self.class_space.get(r)
                if owner is None:
                    continue
                output = piece_node or (lin.output if lin is not None else None)
                if kind == "gate" and rest and output and self._depends_on(rest[0], output):
                    continue  # x * f(x): the same layer on both sides (a GELU written out), not a gate
                if kind == "relu":
                    tags = self.related_tags(r)
                    if any(t.startswith(("nonlinear", "odd", "product")) for t in tags):
                        continue
                reads = readers.get(node, [])
                if not reads:
                    continue
                stem = ("eup" if expert is not None and dense_gate else "up") if kind == "gate" else "scale"
                group = "D" if kind == "gate" else "Dpos"
                # one scaling space per unit space it scales: an encoder's and a decoder's MLPs
                # (T5) each get their own, not one diagonal shared by both
                base = names.setdefault((stem, owner[0]), stem if stem not in {v for v in names.values()}
                                        else f"{stem}{sum(1 for v in names.values() if v.startswith(stem)) + 1}")
                sp = self.spaces.get(base)
                if sp is None:
                    if expert is not None:
                        dim, size = f"E * {self.spaces[owner[0]].dim}", self.dims["E"][1] * self.ax.size[r]
                    else:
                        dim, size = self.spaces[owner[0]].dim, self.ax.size[r]
                    sp = self.spaces[base] = Space(base, "scale", group, dim, size, chain=shrink_chain(group))
                    sp.evidence.append(f"{weight}: " + ("its output multiplies an activation of another layer (a gated unit), "
                                                        "so it can be scaled and its readers undo the scale" if kind == "gate"
                                                        else "a ReLU-like unit reads it: f(a x) = a f(x) for a > 0")
                                       + (f" (piece {piece} of its output, split by a chunk)" if piece is not None else "")
                                       + ("; each expert's units are scaled on their own" if expert is not None else ""))
                sp.instances.add(owner[1])
                if piece is None:
                    self.scaled[(weight, axis)] = (base, owner[1], False)
                else:
                    self.scaled_piece[(weight, axis, piece)] = (base, owner[1], False)
                if lin is not None and lin.bias:
                    if piece is None:
                        self.scaled[(lin.bias, 0)] = (base, owner[1], False)
                    else:
                        self.scaled_piece[(lin.bias, 0, piece)] = (base, owner[1], False)
                for w, a in reads:
                    self.scaled[(w, a)] = (base, owner[1], True)

    def _readers_of_nodes(self) -> dict[str, list[tuple[str, int]]]:
        """Node -> the layers that read it (through ops that only copy or reshape)."""
        graph_nodes = self.f.nodes
        out: dict[str, list[tuple[str, int]]] = {}
        by_input: dict[str, list[Any]] = {}
        for lin in [*self.f.linears, *self.f.experts]:
            by_input.setdefault(lin.input, []).append(lin)
        for name in [n for n, *_ in self.f.gates] + [n for n, _ in self.f.homogeneous]:
            todo, seen, got = [graph_nodes[name]], set(), []
            while todo:
                n = todo.pop()
                if n.name in seen:
                    continue
                seen.add(n.name)
                got += [(lin.weight, lin.read_axis) for lin in by_input.get(n.name, [])]
                for u in n.users:
                    op = getattr(u.target, "__name__", "").split(".")[0]
                    if op in TRANSPARENT or op in ("view", "reshape", "_unsafe_view", "unsqueeze"):
                        todo.append(u)
            out[name] = got
        return out

    def _depends_on(self, node: str, target: str) -> bool:
        todo, seen = [self.f.nodes[node]], set()
        while todo:
            n = todo.pop()
            if n.name == target:
                return True
            if n.name in seen:
                continue
            seen.add(n.name)
            todo.extend(n.all_input_nodes)
        return False

