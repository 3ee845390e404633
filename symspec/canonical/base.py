"""The canonicalisation step protocol, the records of bound steps, and the registry.

A step kind's syntax (its name and arguments, from which a spec's YAML is validated and
the JSON Schema written) is declared by the spec language (:mod:`symspec.spec.steps`); its
implementation is one :class:`CanonStep` subclass, registered in :data:`STEPS` under the
same name. It binds a spec's step to a model's parameter names and shapes
(one :class:`CanonOp` per match), applies an op to a state dict, and, where the step
changes a model's structure, to the module itself.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence, Set
from typing import TYPE_CHECKING, Any, ClassVar

import attrs
import torch

from ..errors import Diagnostic, Location, SymspecInputError
from ..spec.steps import STEP_KINDS, StepSyntax
from ..spec.templates import example_name, matches

if TYPE_CHECKING:
    from ..spec.model import StepDecl


class CanonicalizationError(SymspecInputError):
    """A model whose weights make a declared canonicalisation impossible."""


@attrs.frozen
class CanonOp:
    """A canonicalisation step with concrete parameter names (what a
    :class:`~symspec.record.TransformRecord` stores as its kind and arguments)."""

    kind: str
    args: Mapping[str, Any]
    loc: Location = attrs.field(default=Location(), eq=False, repr=False)
    #: the index of the spec's step it comes from (one step makes one op per match)
    step: int = attrs.field(default=-1, eq=False, repr=False)

    @property
    def impl(self) -> CanonStep:
        """The step kind that implements it."""
        return STEPS[self.kind]


@attrs.define
class BindContext:
    """What binding a spec's steps sees (the model's parameters and the declared ties),
    and where it reports."""

    tensors: Mapping[str, torch.Tensor]
    shapes: Mapping[str, tuple[int, ...]]
    #: the tie groups the spec declares
    ties: Sequence[tuple[str, ...]]
    diags: list[Diagnostic]
    #: "did you mean" among the parameter names (within the binding's budget of hints)
    hint: Callable[..., str | None]
    #: names untied by the steps bound so far
    untied: set[str] = attrs.field(factory=set)
    _tie_of: dict[str, tuple[str, ...]] = attrs.field(init=False)

    def __attrs_post_init__(self) -> None:
        self._tie_of = {n: g for g in self.ties for n in g}

    def is_tied(self, name: str) -> bool:
        return name in self._tie_of

    def error(self, loc: Location, message: str, hint: str | None = None) -> None:
        self.diags.append(Diagnostic(loc, message, hint))

    def matches(self, template: str) -> list[tuple[str, dict[str, int]]]:
        return matches(template, self.tensors)

    def no_match(self, loc: Location, kind: str, template: str) -> None:
        self.error(loc, f"{kind}: '{template}' matches no parameter", self.hint(example_name(template), self.tensors))

    def lacks(self, loc: Location, kind: str, name: str | None) -> bool:
        """Report a named parameter the model does not have (None: not named, fine)."""
        if name is None or name in self.tensors:
            return False
        self.error(loc, f"{kind}: no parameter {name}", self.hint(name, self.tensors))
        return True

    def touches_tie(self, name: str, loc: Location, kind: str) -> None:
        """Report a step that changes one of tied parameters that are not untied first."""
        group = self._tie_of.get(name)
        if group and name not in self.untied and not (set(group) - {name}) <= self.untied:
            others = ", ".join(x for x in group if x != name)
            self.error(loc, f"{kind} changes {name}, which is tied to {others}; that would untie them",
                       f"declare '- untie: {name}' before this step")


class OwnedState(dict):  # type: ignore[type-arg]
    """A state dict whose tensors listed in ``owned`` (by id) are the caller's own
    scratch copies: a step may write those in place instead of allocating a new tensor
    (a [vocab, d] head is not held twice in float64), where no other entry shares it.
    A plain dict: every step replaces the tensors it changes, as always."""

    owned: set[int]

    def __init__(self, *args: Any, **kw: Any) -> None:
        super().__init__(*args, **kw)
        self.owned = set()


def writable(sd: Mapping[str, torch.Tensor], name: str) -> bool:
    """May ``sd[name]`` be changed in place: the caller owns it (:class:`OwnedState`) and
    no other entry holds the same tensor (a tied twin)."""
    t = sd[name]
    return id(t) in getattr(sd, "owned", ()) and not any(v is t for k, v in sd.items() if k != name)


class CanonStep(ABC):
    """The implementation of one step kind (see the module's docstring); its syntax (doc,
    arguments) is the spec language's declaration of the same name."""

    kind: ClassVar[str]
    #: False for a step that only changes where values live (untie): on a module,
    #: :meth:`apply_module` is all of it
    rewrites_values: ClassVar[bool] = True

    @property
    def syntax(self) -> StepSyntax:
        """How a spec writes this kind (:data:`symspec.spec.steps.STEP_KINDS`)."""
        return STEP_KINDS[self.kind]

    # -- binding ----------------------------------------------------------------------------
    @abstractmethod
    def bind(self, step: StepDecl, index: int, ctx: BindContext) -> list[CanonOp]:
        """The concrete ops of the spec's step number ``index`` on the model in ``ctx``,
        reporting what does not fit on ``ctx``."""

    def unties(self, step: StepDecl, names: Sequence[str]) -> list[str]:
        """The parameters (among ``names``) this step unties."""
        return []

    # -- applying ---------------------------------------------------------------------------
    @abstractmethod
    def apply(self, op: CanonOp, sd: dict[str, torch.Tensor]) -> None:
        """Rewrite the entries of ``sd`` the op changes (new tensors; the old ones are
        left as they were)."""

    def apply_module(self, op: CanonOp, module: torch.nn.Module) -> None:
        """Change the module's structure as the op needs (nothing by default)."""
        return None

    def undo(self, op: CanonOp, sd: dict[str, torch.Tensor], reference: Mapping[str, torch.Tensor]) -> str | None:
        """Undo the op on ``sd`` (a state dict in canonical form: new tensors, in place of
        the dict's entries), with the values it removed taken from ``reference`` (the raw
        weights of a model of the same shapes), keeping the function; a note when it
        cannot or leaves something as it is. Default: nothing to undo (a step that only
        removes what carries no function, such as centring, stays done)."""
        return None

    def rows_apart(self, op: CanonOp, sliced: Set[str]) -> bool:
        """Does applying the op to only some rows (axis 0) of the tensors in ``sliced``, every
        other tensor whole, give exactly those rows of applying it to whole tensors? (The
        local check runs a [vocab, d] embedding on the rows its inputs look up and a head a
        slice of rows at a time.) Default: no, and whole tensors are used."""
        return False

    def pieces(self, op: CanonOp) -> list[CanonOp]:
        """The op as smaller ops applied one after the other (itself by default), so that
        a step over many tensors never holds all their new values at once."""
        return [op]

    # -- reporting --------------------------------------------------------------------------
    @abstractmethod
    def subject(self, op: CanonOp) -> str:
        """What the op acts on, for reports: the norm, the writers, the parameter."""

    def declared_subject(self, step: StepDecl) -> str | None:
        """What the spec's step acts on, as a template, when that names all its ops at once."""
        return None

    def alternative(self, op: CanonOp) -> tuple[CanonOp, str] | None:
        """Another reading of an op that changes the function, and what to tell the user
        when that one preserves it (None: no other reading)."""
        return None


#: step kind -> its implementation (filled by :func:`register`)
STEPS: dict[str, CanonStep] = {}


def register(cls: type[CanonStep]) -> type[CanonStep]:
    """Implement the step kind the spec language declares under ``cls.kind`` (usable as a
    class decorator; declare its syntax first with :func:`symspec.spec.steps.declare`)."""
    if cls.kind not in STEP_KINDS:
        raise ValueError(f"canonical step '{cls.kind}' is not declared in symspec.spec.steps.STEP_KINDS")
    STEPS[cls.kind] = cls()
    return cls
