"""What :func:`symspec.align` returns (:class:`AlignResult`), and what it is measured with."""

from __future__ import annotations

import copy
import itertools
from collections.abc import Mapping
from typing import Any

import attrs
import torch

from ..binding import BoundSpec
from ..errors import SymspecInputError
from ..groups import Element
from ..record import TransformRecord
from ..spec.model import Spec
from ..statedict import interpolate_state_dicts, squared_distance
from ..transforms.canonicalize import canonicalize_structure
from .hooks import certifier
from .registry import get_method, load_plugins


@attrs.define
class AlignResult:
    """What :func:`align` found.

    ``method``: the registered name of the method used. ``canonical_a`` and
    ``canonical_b``: both state dicts in canonical form (as they are, for a method that
    works on raw weights); ``aligned_b``: canonical B transformed by ``elements`` (one
    element per space, in the spec's groups); ``record``: the same as a
    :class:`~symspec.record.TransformRecord`; ``history``: the method's objective before
    the first round and after each; ``timings``: seconds per phase; ``canonical_model``:
    A's module in canonical form (same class), into which ``canonical_a``, ``aligned_b``
    and their interpolations load; None for state-dict inputs.
    """

    bound: BoundSpec
    canonical_a: dict[str, torch.Tensor]
    #: None when ``align(keep_canonical_b=False)`` (B's copy became the aligned one)
    canonical_b: dict[str, torch.Tensor] | None
    aligned_b: dict[str, torch.Tensor]
    elements: dict[str, Element]
    record: TransformRecord
    history: list[float]
    timings: dict[str, float]
    converged: bool
    searched: dict[str, str]
    model_a: torch.nn.Module | None = attrs.field(default=None, repr=False)
    method: str = "weight"
    info: dict[str, Any] = attrs.field(factory=dict)
    #: the squared weight distance of canonical A and B, measured before the method ran
    #: (what ``distance("canonical")`` returns when canonical B was not kept)
    canonical_distance: float | None = None
    #: whether the state dicts are in canonical form: the method's ``canonical``, or a
    #: pre-stage wrote B in it (a lifted B), so both were brought into it
    canonical_form: bool = True
    _canonical_model: torch.nn.Module | None = attrs.field(default=None, init=False, repr=False)

    @property
    def spec(self) -> Spec:
        return self.bound.spec

    @property
    def canonical_model(self) -> torch.nn.Module | None:
        """A's module in canonical form (a copy of the same class; built on first use, so
        that callers who only need the weights do not pay for it). None for state dicts."""
        if self._canonical_model is None and self.model_a is not None:
            self._canonical_model = canonical_module(self.bound, self.model_a, self.canonical_a,
                                                     canonical=self.canonical_form)
        return self._canonical_model

    def distance(self, which: str = "aligned") -> float:
        """Squared weight distance over the bound parameters between canonical A and
        canonical B (``which="canonical"``) or aligned B (``"aligned"``)."""
        if which == "canonical" and self.canonical_b is None:
            if self.canonical_distance is not None:
                return self.canonical_distance  # measured before B was consumed
            raise SymspecInputError("canonical B was not kept (align(keep_canonical_b=False))")
        other = self.aligned_b if which == "aligned" else self.canonical_b
        assert other is not None
        return weight_distance(self.bound, self.canonical_a, other)

    def certify(self, *, per_space: bool = True, joint: bool = True, joint_limit: int | None = None,
                gram_limit: int | None = None) -> Any:
        """Lower bounds on the objective's minimum over the searched groups, and this
        result's gaps to them (the registered certifier, :mod:`symspec.certify`): the global
        decoupled bound (not available when a searched group is not norm-preserving), per
        space given the others (``per_space``) and a joint bound (``joint``: exact over
        spaces that share no parameter, a Shor SDP relaxation over those that do, on small
        sizes: each interacting group's lifted size at most ``joint_limit``, default
        :data:`~symspec.certify.joint.JOINT_LIMIT`; a Gram SDP relaxation over a
        star-shaped group, such as the residual with the spaces that read and write it, of
        size at most ``gram_limit``, default
        :data:`~symspec.certify.joint.GRAM_LIMIT`). A B lifted into A's widths is
        certified as lifted (the lift is not part of the group; the reason says so).
        Needs canonical B (``align(keep_canonical_b=True)``, the default)."""
        if not get_method(self.method).canonical:
            raise SymspecInputError(no_certificate(self.method))
        if self.canonical_b is None:
            raise SymspecInputError("a certificate needs canonical B: align(keep_canonical_b=True)")
        load_plugins()  # the certifier is an extension's (symspec.certify)
        return certifier()(self, per_space=per_space, joint=joint, joint_limit=joint_limit, gram_limit=gram_limit)

    def interpolate(self, alpha: float, *, align: bool = True) -> dict[str, torch.Tensor]:
        """``(1 - alpha) A + alpha B`` (aligned B unless ``align=False``), canonical form."""
        other = self.aligned_b if align else self.canonical_b
        if other is None:
            raise SymspecInputError("canonical B was not kept (align(keep_canonical_b=False))")
        return interpolate_state_dicts(self.canonical_a, other, alpha)

    def summary(self) -> dict[str, Any]:
        """A JSON-able report: method, objective per round, time per phase, groups searched."""
        h0 = self.history[0] if self.history else 0.0
        return {
            "method": self.method,
            "spec": self.spec.name,
            "rounds": max(len(self.history) - 1, 0),
            "converged": self.converged,
            "objective": self.history,
            "relative_objective": [h / h0 if h0 else 0.0 for h in self.history],
            "searched": self.searched,
            "timings": self.timings,
            **({"info": self.info} if self.info else {}),
        }


def no_certificate(method: str) -> str:
    """Why a method's result has no certificate: it searched no group (vanilla averaging
    works on the raw weights, not on the canonical forms the spec's groups act on, so
    the objective the bounds are about was never its objective)."""
    return (f"--method {method} aligns nothing (it averages the raw weights, not the canonical forms the spec's "
            "groups act on): there is no alignment to certify; use --certify with a method that aligns, "
            "e.g. --method weight")


def weight_distance(bound: BoundSpec, a: Mapping[str, torch.Tensor], b: Mapping[str, torch.Tensor]) -> float:
    """sum over the bound parameters of ||a - b||^2 (float64 accumulation)."""
    return squared_distance(a, b, bound.problem.params)


def canonical_module(bound: BoundSpec, model: torch.nn.Module, state: Mapping[str, torch.Tensor], *,
                     canonical: bool = True, share: bool = False) -> torch.nn.Module:
    """A copy of ``model`` (same class) holding ``state`` (its canonical weights, or with
    ``canonical=False`` any weights of the model's own form): what
    :func:`~symspec.transforms.canonicalize_model` returns, without canonicalising again
    and without first copying the old weights.

    ``share``: the copy's parameters are ``state``'s tensors themselves, not copies of
    them (a method's endpoint module, which runs with weights passed to
    ``functional_call`` and is only read: a second float32 copy of each model was what
    killed weight+activation on a 1.1B model). Without it, the copy owns its weights."""
    memo: dict[int, Any] = {}
    # Fresh storage (or ``state``'s own) only for what ``state`` overwrites: a buffer in no
    # state dict (rotary frequencies, Gemma's embedding scale) is copied as it is, else it
    # would stay uninitialised memory. The storage has the dtype of the weights written
    # into it (a bfloat16 model's float32 working copy stays float32: a copy in the stored
    # dtype would round the weights, and a graph traced from it would cast activations
    # back to bfloat16).
    written: dict[int, list[torch.Tensor]] = {}
    for k, t in model.state_dict(keep_vars=True).items():
        if k in state and state[k].is_floating_point():
            written.setdefault(id(t), []).append(state[k])
    for t in itertools.chain(model.parameters(), model.buffers()):
        if t.is_floating_point() and id(t) in written and id(t) not in memo:
            src = written[id(t)][0]
            fits = share and src.shape == t.shape and src.device == t.device
            if fits and len(written[id(t)]) == 1:
                data = src.detach()
            elif fits and canonical:
                # tied under several names (an embedding and its head): a placeholder, no
                # storage; once canonical form has untied the names, each takes its own
                # state tensor (_adopt_states). Never one name's tensor for all: loading
                # another name's value would write over it
                data = torch.empty(t.shape, dtype=src.dtype, device="meta")
            else:
                data = torch.empty(t.shape, dtype=src.dtype, device=t.device)
            memo[id(t)] = torch.nn.Parameter(data, requires_grad=t.requires_grad) if isinstance(t, torch.nn.Parameter) else data
    out = copy.deepcopy(model, memo)
    if canonical:
        canonicalize_structure(bound, out)
    adopted = _adopt_states(out, state) if share else []
    own = out.state_dict()
    shared = {id(v) for v in [*memo.values(), *adopted]} if share else set()
    out.load_state_dict({k: v for k, v in state.items() if k in own and not _same_storage(own[k], v, shared)},
                        strict=False)
    return out.eval() if not model.training else out


def _adopt_states(module: torch.nn.Module, state: Mapping[str, torch.Tensor]) -> list[torch.Tensor]:
    """Every placeholder (meta) tensor of ``module`` given storage: ``state``'s own tensor
    where one name holds it (no copy), else fresh storage that loading will fill (a tie
    canonical form keeps: one tensor for its names). Returns the tensors shared."""
    names: dict[int, list[str]] = {}
    held: dict[int, torch.Tensor] = {}
    for k, t in module.state_dict(keep_vars=True).items():
        if t.is_meta:
            names.setdefault(id(t), []).append(k)
            held[id(t)] = t
    shared = []
    for tid, ks in names.items():
        t = held[tid]
        src = state.get(ks[0]) if len(ks) == 1 else None
        if src is not None and src.shape == t.shape and src.dtype == t.dtype:
            data = src.detach()
            shared.append(data)
        else:
            device = next((state[k].device for k in ks if k in state), torch.device("cpu"))
            data = torch.empty(t.shape, dtype=t.dtype, device=device)
        new = torch.nn.Parameter(data, requires_grad=t.requires_grad) if isinstance(t, torch.nn.Parameter) else data
        for k in ks:
            prefix, _, attr = k.rpartition(".")
            owner = module.get_submodule(prefix) if prefix else module
            if attr in owner._parameters:
                owner._parameters[attr] = new  # type: ignore[assignment]
            else:
                owner._buffers[attr] = new
    return shared


def _same_storage(a: torch.Tensor, b: torch.Tensor, shared: set[int]) -> bool:
    """``a`` (a module's tensor) is ``b`` already (shared, same storage): no copy needed."""
    return bool(shared) and a.data_ptr() == b.data_ptr() and a.shape == b.shape and a.dtype == b.dtype


def mode_text(modes: Mapping[str, str]) -> str:
    """The searched groups as one string: ``"full"``, ``"perm"`` or ``"perm,attn=full"``."""
    kinds = set(modes.values())
    if len(kinds) <= 1:
        return next(iter(kinds), "full")
    return ",".join(f"{s}={m}" for s, m in modes.items())
