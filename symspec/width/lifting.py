"""Lifting a narrower model into the shape of a wider one without changing its function.

For every space of the spec, a pair of maps from the narrow width n_B to the wide width
n_A: ``write`` for the axes that write features (covariant) and ``read`` for the axes
that read them (contravariant), with ``read^T write = I`` so that a reader undoes a
writer:

- a residual stream with an orthogonal group (RMSNorm ``O``, LayerNorm ``OC`` after
  centring, or ``GL`` without norms): a semi-orthogonal (Stiefel) map U, n_A x n_B with
  U^T U = I; ``write = c U``, ``read = U / c`` with c = sqrt(n_A / n_B) for normed
  streams, so that the mean square over the wider stream equals the narrower one's and
  every norm (its epsilon included) computes what it did (the paper's App. E). For ``OC``
  U maps the zero-mean subspace into the zero-mean subspace;
- units (``S``, ``SP``): a semi-permutation T (every narrow unit copied into one or more
  wide units, its outgoing weight shared among the copies): ``write = support(T)`` (the
  copies compute the same activation, for any elementwise function) and ``read = T``;
- heads (``Heads``): a semi-permutation of the key/value heads (query heads follow their
  group), the same copies on the q, k and v sides and shares on the output side; a wider
  head takes a Stiefel map V of its width, scaled on the QK side by
  (dh_A / dh_B)^(1/4) per side so that q.k / sqrt(dh) is unchanged (rotary heads must
  keep their width);
- scalings (``D``, ``Dpos``, ``Sign``): the identity (the unit lift beside them carries
  the width), or, for ``D`` and ``Dpos``, a diagonal map of the wide width applied after
  the unit lift (``write = diag(s)``, ``read = diag(1 / s)``; positive for ``Dpos``): a
  copy of a gated unit's up path (or of a ReLU unit) scaled, its outgoing weight
  unscaled, as a fitted lift chooses (a scaling is a group element of the wide model, so
  the lift followed by it is a lift).

Each kind's lift is its entry in :data:`LIFTS` (one small function per kind); the trivial
group, the RoPE commutant and mixtures of experts have none (a ``NoEntry`` that says why):
their spaces lift only where their group is the same in both models (by the identity).

The lift acts on B's canonical form (norms folded, writers centred) and writes A's
canonical structure (a tie the spec unties stays untied); norm parameters that the fold
made constant take A's width with the same constant.
"""

from __future__ import annotations

import copy
import inspect
import math
from collections.abc import Callable, Collection, Mapping, Sequence
from typing import Any

import attrs
import torch

from ..binding import BoundSpec, bind
from ..checker import call_forward, cast_inputs, compare, copy_as, flatten_outputs, select_outputs
from ..errors import SymspecInputError
from ..groups import Group, Heads, NoEntry, RoPE, centred_basis, kind_entry, make_generator
from ..groups.semiperm import SemiPermutation
from ..precision import KeepFloat64
from ..problem import ParamBinding
from ..spec import load_spec
from ..spec.model import Spec
from ..transforms.canonicalize import canonicalize_state_dict, canonicalize_structure


class LiftError(SymspecInputError):
    """The two models cannot be lifted one into the other (depth, a narrower A, a group
    whose width cannot change exactly)."""


@attrs.define
class SpaceLift:
    """How one space was lifted: its kind, the widths, and the maps (dense)."""

    space: str
    kind: str  # stiefel | semiperm | heads | scale | identity
    narrow: int
    wide: int
    write: torch.Tensor | None = None
    read: torch.Tensor | None = None
    detail: dict[str, Any] = attrs.field(factory=dict)

    def describe(self) -> str:
        if self.narrow == self.wide and self.kind == "identity":
            return f"{self.space}: {self.narrow} (unchanged)"
        return f"{self.space}: {self.narrow} -> {self.wide} ({self.kind})"


@attrs.define
class LiftResult:
    model: torch.nn.Module  # A's class and config, B's function
    lifts: dict[str, SpaceLift]
    bound: BoundSpec  # the spec bound to the lifted model
    #: max relative difference of the lifted model's outputs from B's in float64 (None: no inputs given)
    error: float | None = None

    def changed(self) -> list[SpaceLift]:
        return [s for s in self.lifts.values() if s.narrow != s.wide]


Action = Callable[[torch.Tensor, tuple[str, ...], str], torch.Tensor]


def stiefel(n_wide: int, n_narrow: int, gen: torch.Generator, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """A random n_wide x n_narrow matrix with orthonormal columns (Haar on the Stiefel manifold)."""
    g = torch.randn(n_wide, n_narrow, generator=gen, dtype=torch.float64)
    q, r = torch.linalg.qr(g)
    q = q * torch.sign(torch.diagonal(r)).where(torch.diagonal(r) != 0, torch.ones(()))
    return q.to(dtype)


def _wider(name: str, narrow: Group, wide: Group) -> tuple[int, int]:
    nb, na = narrow.n, wide.n
    if na < nb:
        raise LiftError(f"{name}: the first model ({na}) is narrower than the second ({nb}); lift the narrower one into the wider")
    return nb, na


def _lift_units(name: str, narrow: Group, wide: Group, gen: torch.Generator, *,
                semiperm: torch.Tensor | None = None) -> SpaceLift:
    """S, SP: a semi-permutation T, copies on the writing side and shares on the reading side."""
    nb, na = _wider(name, narrow, wide)
    if na == nb and semiperm is None:
        return SpaceLift(name, "identity", nb, na)
    t = semiperm if semiperm is not None else SemiPermutation(na, nb).sample(gen)
    return SpaceLift(name, "semiperm", nb, na, SemiPermutation.support(t), t)


def _lift_stiefel(name: str, narrow: Group, wide: Group, gen: torch.Generator, *,
                  stiefel_map: torch.Tensor | None = None) -> SpaceLift:
    """O, GL: a semi-orthogonal map, rescaled by sqrt(n_A / n_B) for a normed (orthogonal) stream."""
    nb, na = _wider(name, narrow, wide)
    if na == nb and stiefel_map is None:
        return SpaceLift(name, "identity", nb, na)
    u = stiefel_map if stiefel_map is not None else stiefel(na, nb, gen)
    c = math.sqrt(na / nb) if narrow.is_orthogonal() else 1.0
    return SpaceLift(name, "stiefel", nb, na, c * u, u / c, {"scale": c})


def _lift_centred(name: str, narrow: Group, wide: Group, gen: torch.Generator, *,
                  stiefel_map: torch.Tensor | None = None) -> SpaceLift:
    """OC: as O, with a map that takes the zero-mean subspace into the zero-mean subspace
    and the all-ones direction onto itself."""
    nb, na = _wider(name, narrow, wide)
    if stiefel_map is None and na != nb:
        v = stiefel(na - 1, nb - 1, gen)
        ones = torch.ones(na, nb, dtype=torch.float64) / math.sqrt(na * nb)
        stiefel_map = centred_basis(na) @ v @ centred_basis(nb).T + ones
    return _lift_stiefel(name, narrow, wide, gen, stiefel_map=stiefel_map)


def _lift_scaling(name: str, narrow: Group, wide: Group, gen: torch.Generator, *,
                  scale: torch.Tensor | None = None) -> SpaceLift:
    """D, Dpos: the identity (the unit lift beside them carries the width), or a diagonal
    map of the wide width after it (a fitted lift's scaled copies)."""
    nb, na = _wider(name, narrow, wide)
    if scale is None:
        return SpaceLift(name, "identity", nb, na)
    s = scale.to(torch.float64)
    if s.shape != (na,) or not bool(torch.isfinite(s).all()) or not wide.contains(torch.diag(s), atol=0.0):
        raise LiftError(f"{name}: a scale of shape {tuple(s.shape)} is no element of {wide}")
    return SpaceLift(name, "scale", nb, na, torch.diag(s), torch.diag(1 / s), {"scale": s})


def _lift_beside(name: str, narrow: Group, wide: Group, gen: torch.Generator) -> SpaceLift:
    """Sign: the identity at any width (the unit lift beside it carries the width)."""
    nb, na = _wider(name, narrow, wide)
    return SpaceLift(name, "identity", nb, na)


def heads_lift(name: str, narrow: Heads, wide: Heads, gen: torch.Generator, *, kv_semiperm: torch.Tensor | None = None,
               within: Mapping[str, torch.Tensor] | None = None) -> SpaceLift:
    """The lift of a head space: a semi-permutation of key/value heads (query heads follow
    their group), a Stiefel map per part when the head width grows."""
    if narrow.group_size != wide.group_size:
        raise LiftError(f"{name}: {narrow} -> {wide}: the query heads per key/value head differ "
                        f"({narrow.group_size} and {wide.group_size}); they must be the same to lift")
    kb, ka = narrow.kv, wide.kv
    if ka < kb:
        raise LiftError(f"{name}: the first model has fewer heads ({wide.heads}) than the second ({narrow.heads})")
    t_kv = kv_semiperm if kv_semiperm is not None else (SemiPermutation(ka, kb).sample(gen) if ka != kb else torch.eye(kb, dtype=torch.float64))
    g = narrow.group_size
    eye_g = torch.eye(g, dtype=torch.float64)
    copies_kv = SemiPermutation.support(t_kv)
    parts: dict[str, tuple[torch.Tensor, float]] = {}
    for (pname, gb), (_, ga) in zip(narrow.parts, wide.parts):
        db, da = gb.n, ga.n
        if da < db:
            raise LiftError(f"{name}: head width {da} in the first model is below {db} in the second")
        if isinstance(gb, RoPE) and (da != db or getattr(gb, "rot", db) != getattr(ga, "rot", da)):
            raise LiftError(f"{name}.{pname}: rotary heads keep their width (and rotated dims) when lifted; got {db} -> {da}")
        v = (within or {}).get(pname)
        if v is None:
            v = torch.eye(db, dtype=torch.float64) if da == db else stiefel(da, db, gen)
        scale = (da / db) ** 0.25 if pname == "qk" and da != db else 1.0
        parts[pname] = (v, scale)

    def matrix(path: tuple[str, ...], variance: str) -> torch.Tensor:
        part = path[0] if path and path[0] != "kv" else ""
        kv = bool(path) and path[-1] == "kv"
        key = part if part in parts else next(iter(parts))
        v, scale = parts[key]
        # the side that sums over heads (o_proj's input: the OV circuit read back) takes the
        # shares; every other side is copied
        shares = key == "ov" and variance == "contra"
        heads = t_kv if shares else copies_kv
        if not kv:
            heads = torch.kron(heads, eye_g)
        return torch.kron(heads.contiguous(), (v * scale).contiguous())

    return SpaceLift(name, "heads", narrow.n, wide.n, detail={"kv": t_kv, "parts": parts, "matrix": matrix})


#: a space's lift: ``fn(space name, narrow group, wide group, generator, **fixed maps)``
LiftFn = Callable[..., SpaceLift]

#: group kind -> how a space of that kind changes its width (see the module); a kind whose
#: width cannot change says why. Any space whose group is the same in both models lifts by
#: the identity, whatever its kind.
LIFTS: dict[str, LiftFn | NoEntry] = {
    "S": _lift_units,
    "SP": _lift_units,
    "O": _lift_stiefel,
    "OC": _lift_centred,
    "GL": _lift_stiefel,
    "D": _lift_scaling,
    "Dpos": _lift_scaling,
    "Sign": _lift_beside,
    "Heads": heads_lift,
    "Id": NoEntry("the trivial group has no map between two widths (units that may not be transformed cannot be "
                  "copied either)"),
    "RoPE": NoEntry("rotary dimensions keep their width: the commutant of the position rotations maps no width onto "
                    "another"),
    "Experts": NoEntry("experts keep their number and width: a copied expert changes which experts the router's "
                       "top-k picks"),
}


def space_lift(name: str, narrow: Group, wide: Group, gen: torch.Generator,
               fixed: Mapping[str, Any] | None = None) -> SpaceLift:
    """The lift of one space from its group in the narrow model to its group in the wide
    one, by its kind's entry in :data:`LIFTS`; ``fixed``: maps to use instead of drawn
    ones, by the entry's keyword (``stiefel_map``, ``semiperm``, ``scale``; for heads
    ``kv_semiperm``, ``within``)."""
    fixed = dict(fixed or {})
    if type(narrow) is not type(wide):
        raise LiftError(f"{name}: the narrow model's group {narrow} and the wide model's {wide} are of different kinds")
    entry = LIFTS.get(narrow.kind)
    if narrow == wide and not fixed and not callable(entry):
        return SpaceLift(name, "identity", narrow.n, wide.n)
    fn = kind_entry(LIFTS, narrow, "lift", error=LiftError, prefix=f"{name}: {narrow} -> {wide}: ")
    takes = inspect.signature(fn).parameters
    extra = sorted(k for k in fixed if k not in takes or takes[k].kind is not inspect.Parameter.KEYWORD_ONLY)
    if extra:
        raise LiftError(f"{name}: the lift of {wide} takes no fixed {', '.join(extra)}")
    return fn(name, narrow, wide, gen, **fixed)


def _action(lift: SpaceLift) -> Action:
    def act(x: torch.Tensor, path: tuple[str, ...], variance: str) -> torch.Tensor:
        if lift.kind == "identity":
            return x
        if lift.kind == "heads":
            m = lift.detail["matrix"](path, variance)
        elif variance == "co":
            m = lift.write
        elif variance == "contra":
            m = lift.read
        else:  # a gain (|rho|): copies of a unit keep its gain
            if lift.kind not in ("semiperm", "scale"):
                raise LiftError(f"{lift.space}: a parameter bound with abs() cannot be lifted by a {lift.kind} map")
            m = lift.write.abs() if lift.write is not None else None
        assert m is not None
        m = m.to(dtype=x.dtype, device=x.device)
        return (m @ x.reshape(x.shape[0], -1)).reshape(m.shape[0], *x.shape[1:])

    return act


def canonical_f64(bound: BoundSpec, model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """``model``'s weights in canonical form, in float64 (what lifting and fitting read)."""
    return canonicalize_state_dict(bound, {k: v.detach().double() for k, v in model.state_dict().items()})


def lift_tensor(binding_b: ParamBinding, binding_a: ParamBinding, x: torch.Tensor, actions: Mapping[str, Action],
                late: Collection[str] = (), store: bool = True) -> torch.Tensor:
    """One of B's parameters in A's shape: each bound axis mapped segment by segment.
    The spaces in ``late`` (scalings of the wide width) act after the others. A parameter
    with a ``view`` (fused expert weights) is lifted as the bindings see it and stored in
    A's layout (``store=False``: returned as the bindings see it)."""
    axes_a = {ab.axis: ab for ab in binding_a.axes}
    x = binding_b.viewed(x)
    for ab in binding_b.axes:
        moved = x.movedim(ab.axis, 0)
        if ab.layout is not None:
            moved = ab.layout.to_concat(moved)
        pieces = []
        for seg in ab.segments:
            y = moved[seg.start : seg.stop]
            order = list(reversed(seg.factors))
            for f in [f for f in order if f.space not in late] + [f for f in order if f.space in late]:
                y = actions[f.space](y, f.path, f.variance)
            pieces.append(y)
        moved = torch.cat(pieces, 0) if len(pieces) > 1 else pieces[0]
        layout_a = axes_a[ab.axis].layout if ab.axis in axes_a else None
        if layout_a is not None:
            moved = layout_a.to_storage(moved)
        x = moved.movedim(0, ab.axis)
    return binding_a.stored(x) if store else x


def lift(narrow: torch.nn.Module, wide: torch.nn.Module, spec: Spec, *, seed: int = 0,
         fixed: Mapping[str, Mapping[str, Any]] | None = None, dtype: torch.dtype | None = None,
         inputs: Any = None, rtol: float = 1e-9) -> LiftResult:
    """B (``narrow``) in A's (``wide``) class and config, with B's function (see the
    module). ``wide`` gives the structure only (its weights are not read). ``fixed``: per
    space, the maps to use instead of random ones (``stiefel_map``, ``semiperm``; for
    heads ``kv_semiperm``, ``within``), as a fitted lift provides. ``dtype``: of the lifted
    model (default: the narrow model's). With ``inputs``, the lifted model (in float64) is
    compared with B on them, and a difference above ``rtol`` is a :class:`LiftError` (a
    model-specific constant the spec does not state, such as an embedding scaled by
    sqrt(d), or a residual whose group cannot widen exactly)."""
    bb = bind(spec, narrow)
    ba = bind(spec, wide)
    pb, pa = bb.problem, ba.problem
    missing = sorted(set(pb.spaces) ^ set(pa.spaces))
    if missing:
        raise LiftError(f"the models differ in depth or structure: space(s) {', '.join(missing[:4])} exist in only one "
                        f"of them; a lift keeps the number of layers")
    gen = make_generator(seed)
    lifts: dict[str, SpaceLift] = {}
    for name in pb.spaces:
        lifts[name] = space_lift(name, pb.spaces[name].group, pa.spaces[name].group, gen, (fixed or {}).get(name))
    actions = {name: _action(sl) for name, sl in lifts.items()}
    late = {name for name, sl in lifts.items() if sl.kind == "scale"}
    sd_b = canonical_f64(bb, narrow)
    out = copy.deepcopy(wide).to(torch.float64)
    canonicalize_structure(ba, out)
    target = out.state_dict()
    new: dict[str, torch.Tensor] = {}
    for key, t_a in target.items():
        if key not in sd_b:
            continue
        x = sd_b[key]
        binding_b, binding_a = pb.params.get(key), pa.params.get(key)
        if binding_b is not None and binding_b.axes:
            y = lift_tensor(binding_b, binding_a or binding_b, x, actions, late)
        elif tuple(x.shape) == tuple(t_a.shape):
            y = x
        elif x.numel() and bool((x == x.reshape(-1)[0]).all()):
            y = torch.full_like(t_a, float(x.reshape(-1)[0]), dtype=torch.float64)  # a folded norm's constant
        else:
            raise LiftError(f"{key}: shape {tuple(x.shape)} in the narrow model, {tuple(t_a.shape)} in the wide one, "
                            "and the spec binds no space to the axes that differ")
        if tuple(y.shape) != tuple(t_a.shape):
            raise LiftError(f"{key}: lifted to {tuple(y.shape)}, but the wide model's is {tuple(t_a.shape)}")
        new[key] = y
    out.load_state_dict({**target, **new}, strict=True)
    out.eval()
    error = None
    if inputs is not None:
        error = check_lift(narrow, out, inputs, outputs=ba.problem.outputs)
        if not error <= rtol:
            widths = ", ".join(s.describe() for s in lifts.values() if s.narrow != s.wide)
            raise LiftError(f"the lifted model does not compute what the narrow one does (max rel err {error:.2e} > {rtol:.0e} "
                            f"in float64; lifted {widths}): this family's width cannot change exactly under its spec")
    out.to(dtype or next(iter(narrow.parameters())).dtype)
    return LiftResult(out, lifts, bind(spec, out), error)


def width_changes(spec: Spec, wide: torch.nn.Module, narrow: torch.nn.Module) -> dict[str, tuple[int, int]]:
    """Space -> (narrow width, wide width) for every space whose width differs between the
    two models (empty: the same shapes). A depth difference, or a space that is wider in
    ``narrow``, is a :class:`LiftError` (one line that says which)."""
    sa, sb = wide.state_dict(), narrow.state_dict()
    if sa.keys() == sb.keys() and all(sa[k].shape == sb[k].shape for k in sa):
        return {}  # the same shapes: nothing to lift (a config that differs otherwise is another matter)
    ba, bb = bind(spec, wide), bind(spec, narrow)
    extra = sorted(set(ba.problem.spaces) ^ set(bb.problem.spaces))
    if extra:
        raise LiftError(f"A and B differ in depth or structure: space(s) {', '.join(extra[:4])} exist in only one of "
                        "them; models of different widths can be aligned, of different depths cannot")
    out = {}
    for name, sa in ba.problem.spaces.items():
        ga, gb = sa.group, bb.problem.spaces[name].group
        if str(ga) != str(gb):
            out[name] = (gb.n, ga.n)
    narrower = [f"{n} ({w} < {v})" for n, (v, w) in out.items() if w < v]
    if narrower:
        raise LiftError(f"A is narrower than B in {', '.join(narrower[:3])}: give the wider model as A (B is lifted "
                        "into A's shape)")
    return out


def lift_needed(spec: Any, wide: torch.nn.Module, narrow: torch.nn.Module) -> dict[str, tuple[int, int]]:
    """:func:`width_changes` for a caller about to align the two models: ``spec`` a Spec, a
    BoundSpec, a built-in name or a path; models that do not fit the spec at all give {}
    (the usual check that follows says how), while a depth difference or a narrower
    ``wide`` is still a :class:`LiftError`."""
    try:
        plain = spec if isinstance(spec, Spec) else spec.spec if isinstance(spec, BoundSpec) else load_spec(spec)
        return width_changes(plain, wide, narrow)
    except LiftError:
        raise
    except SymspecInputError:
        return {}


def check_lift(narrow: torch.nn.Module, lifted: torch.nn.Module, inputs: Any, dtype: torch.dtype = torch.float64,
               outputs: Sequence[str] = ()) -> float:
    """Max relative difference of the two models' outputs on ``inputs`` in ``dtype``:
    ``outputs`` of them (the spec's, :func:`~symspec.checker.select_outputs`), all where
    empty. A hidden state in the residual stream's basis is another width once lifted."""
    a, b = copy_as(narrow, dtype), copy_as(lifted, dtype)
    x = cast_inputs(inputs, dtype)
    keep = KeepFloat64() if dtype == torch.float64 else None
    ya = flatten_outputs(select_outputs(call_forward(a, x, keep), outputs))
    yb = flatten_outputs(select_outputs(call_forward(b, x, keep), outputs))
    if [t.shape for t in ya] != [t.shape for t in yb]:
        raise LiftError(f"the lifted model's outputs have other shapes than the narrow one's "
                        f"({[tuple(t.shape) for t in ya]} against {[tuple(t.shape) for t in yb]}); name the outputs "
                        "its symmetries preserve in the spec's 'outputs' (e.g. [logits])")
    return compare(ya, yb)[1]


__all__ = ["LIFTS", "LiftError", "LiftResult", "SpaceLift", "check_lift", "heads_lift", "lift", "lift_needed",
           "lift_tensor", "space_lift", "stiefel", "width_changes"]

