"""Transform records: the group element of every space, saved, re-applied, inverted.

A record says how a model B was transformed: which spec (by name), which
canonicalisation ran first, and for every space its group (text form) and element. It
is written as two files:

- ``transform.safetensors``: one tensor per element field, named ``"{space}/{field}"``
  (``attn[0]/qk.matrix``), with the JSON index also in the file's metadata, so the
  file alone is complete;
- ``transform.json``: the same index, readable without safetensors.

>>> import torch
>>> from symspec.groups import S
>>> rec = TransformRecord("demo", {"ff": "S(3)"}, {"ff": {"perm": torch.tensor([2, 0, 1])}})
>>> rec.inverse().inverse().elements["ff"]["perm"].tolist()
[2, 0, 1]
>>> rec.inverse().elements["ff"]["perm"].tolist()
[1, 2, 0]
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import attrs
import torch
from safetensors import safe_open
from safetensors.torch import save

from .errors import SymspecInputError
from .groups import Element, Group
from .groups import parse as parse_group
from .outputs import atomic_write_bytes, atomic_write_text
from .statedict import element_to_cpu
from .transforms import apply_elements, canonicalize_state_dict, reversed_problem

FORMAT = "symspec-transform"
VERSION = 1
TENSORS = "transform.safetensors"
INDEX = "transform.json"


class RecordError(SymspecInputError):
    """A transform record that cannot be read, or does not fit the model it is applied to."""


def _jsonable(x: Any) -> Any:
    return json.loads(json.dumps(x, default=str))


@attrs.define
class TransformRecord:
    """Elements (space -> element of the space's group) acting on a canonical model.

    ``canonical``: the canonicalisation steps (kind and arguments) that run before the
    elements act; :meth:`apply` runs them unless told not to. ``inverted``: this record
    undoes another; it acts on already transformed (canonical) weights and gives back the
    canonical model, never the raw one (canonicalisation folds norms and is not invertible).
    Its elements are the inverses of the original's, and it applies every factor chain in
    reverse order.
    """

    spec: str
    groups: dict[str, str]
    elements: dict[str, Element]
    canonical: list[dict[str, Any]] = attrs.field(factory=list)
    #: the group actually searched, where it differs from ``groups`` (--groups perm)
    searched: dict[str, str] = attrs.field(factory=dict)
    meta: dict[str, Any] = attrs.field(factory=dict)
    inverted: bool = False

    @classmethod
    def of(cls, bound: Any, elements: Mapping[str, Element], *, canonical: bool = True,
           searched: Mapping[str, str] | None = None, meta: Mapping[str, Any] | None = None) -> TransformRecord:
        """The record of ``elements`` acting on the canonical model of ``bound`` (a
        :class:`~symspec.binding.BoundSpec`): its spec's name, every space's group, the
        elements (on the CPU) and, unless ``canonical=False`` (a method that acts on the raw
        weights), the canonicalisation steps that run first. The one way records are built
        from an alignment (pairs, universe)."""
        problem = bound.problem
        return cls(
            spec=bound.spec.name,
            groups={s: str(si.group) for s, si in problem.spaces.items()},
            elements={s: element_to_cpu(e) for s, e in elements.items()},
            canonical=[{"kind": op.kind, "args": dict(op.args)} for op in bound.canonical] if canonical else [],
            searched=dict(searched or {}),
            meta=dict(meta or {}),
        )

    def group(self, space: str) -> Group:
        try:
            return parse_group(self.groups[space])
        except KeyError:
            raise RecordError(f"the record has no space '{space}'") from None

    # -- algebra -----------------------------------------------------------------------
    def inverse(self) -> TransformRecord:
        """The record that undoes this one (on canonical weights)."""
        elements = {s: self.group(s).inverse(e) for s, e in self.elements.items()}
        return attrs.evolve(self, elements=elements, inverted=not self.inverted)

    def fits(self, problem: Any) -> None:
        """Raise RecordError unless ``problem`` (a Problem or BoundSpec) has these spaces
        with these groups."""
        problem = getattr(problem, "problem", problem)
        missing = [s for s in self.elements if s not in problem.spaces]
        if missing:
            raise RecordError(f"the model's spec has no space {', '.join(missing[:5])} (the record is for spec '{self.spec}')")
        for s in self.elements:
            have = problem.spaces[s].group
            if have != self.group(s):
                raise RecordError(f"space {s}: the record's group is {self.groups[s]}, the model's is {have}")

    def apply(self, bound: Any, state_dict: Mapping[str, torch.Tensor], *, canonicalize: bool | None = None) -> dict[str, torch.Tensor]:
        """Act on ``state_dict`` (a new dict; the input is not modified).

        ``bound``: the :class:`~symspec.binding.BoundSpec` of the model (or, with
        ``canonicalize=False``, its Problem). ``canonicalize`` defaults to True for a
        forward record and False for an inverted one.
        """
        self.fits(bound)
        problem = getattr(bound, "problem", bound)
        canon = (not self.inverted) if canonicalize is None else canonicalize
        sd = dict(state_dict)
        if canon:
            if not hasattr(bound, "canonical"):
                raise RecordError("canonicalising needs the BoundSpec, not just its Problem")
            sd = canonicalize_state_dict(bound, sd)
        # (A B)^-1 = B^-1 A^-1: an inverted record runs every factor chain backwards
        return apply_elements(reversed_problem(problem) if self.inverted else problem, self.elements, sd)

    # -- files -----------------------------------------------------------------------------
    def index(self) -> dict[str, Any]:
        spaces = {}
        for s, e in self.elements.items():
            spaces[s] = {
                "group": self.groups[s],
                **({"searched": self.searched[s]} if s in self.searched else {}),
                "fields": {k: {"dtype": str(v.dtype).removeprefix("torch."), "shape": list(v.shape)} for k, v in e.items()},
            }
        return {
            "format": FORMAT,
            "version": VERSION,
            "spec": self.spec,
            "inverted": self.inverted,
            "direction": ("transformed B -> canonical B" if self.inverted else "canonical B -> B aligned to A"),
            "canonicalization": _jsonable(self.canonical),
            "spaces": spaces,
            "meta": _jsonable(self.meta),
        }

    def save(self, path: str | Path) -> Path:
        """Write ``transform.safetensors`` and ``transform.json`` into the folder ``path``
        (or next to ``path`` when it names a .safetensors file), atomically. Returns the
        safetensors path."""
        p = Path(path)
        target = p if p.suffix == ".safetensors" else p / TENSORS
        index = self.index()
        tensors = {f"{s}/{k}": v.detach().to("cpu").contiguous().clone() for s, e in self.elements.items() for k, v in e.items()}
        text = json.dumps(index, indent=2)
        atomic_write_bytes(target, save(tensors, metadata={"symspec": json.dumps(index)}))
        atomic_write_text(target.with_name(INDEX) if target.name == TENSORS else target.with_suffix(".json"), text + "\n")
        return target

    @classmethod
    def load(cls, path: str | Path) -> TransformRecord:
        """Read a record from its folder, its .safetensors file or its .json index."""
        p = Path(path)
        if p.is_dir():
            p = p / TENSORS
        elif p.suffix == ".json":
            p = p.with_name(TENSORS) if p.name == INDEX else p.with_suffix(".safetensors")
        if not p.exists():
            raise RecordError(f"{path}: no transform record ({p.name} not found)")
        try:
            with safe_open(str(p), framework="pt") as f:
                meta = f.metadata() or {}
                tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 (safe_open is not a dict)
        except Exception as err:
            raise RecordError(f"{p}: not a readable safetensors file: {err}") from err
        if "symspec" in meta:
            index = json.loads(meta["symspec"])
        else:
            j = p.with_name(INDEX) if p.name == TENSORS else p.with_suffix(".json")
            if not j.exists():
                raise RecordError(f"{p}: no index (neither in the file's metadata nor {j.name})")
            index = json.loads(j.read_text())
        if index.get("format") != FORMAT:
            raise RecordError(f"{p}: not a symspec transform record (format {index.get('format')!r})")
        if int(index.get("version", 0)) > VERSION:
            raise RecordError(f"{p}: record version {index['version']} is newer than this symspec reads ({VERSION})")
        elements: dict[str, Element] = {}
        groups: dict[str, str] = {}
        searched: dict[str, str] = {}
        for s, entry in index["spaces"].items():
            groups[s] = entry["group"]
            if "searched" in entry:
                searched[s] = entry["searched"]
            try:
                elements[s] = {k: tensors[f"{s}/{k}"] for k in entry["fields"]}
            except KeyError as missing:
                raise RecordError(f"{p}: space {s} lacks field {missing}") from None
        rec = cls(index["spec"], groups, elements, list(index.get("canonicalization", [])), searched,
                  dict(index.get("meta", {})), bool(index.get("inverted", False)))
        for s, e in rec.elements.items():
            g = rec.group(s)
            if not g.element_ok(e, 1e-6):
                raise RecordError(f"{p}: the element of {s} does not have the structure of {g}")
        return rec
