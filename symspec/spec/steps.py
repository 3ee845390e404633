"""The syntax of a spec's ``canonicalize`` steps: each step kind's name, documentation and
arguments are declared here (:data:`STEP_KINDS`), and one entry of the list is read against
them. The spec language owns the syntax; :mod:`symspec.canonical` registers one
implementation per declared kind (binding to a model and applying to a state dict), so
reading a spec never needs the implementations.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import attrs

from ..errors import suggest
from .stepargs import Arg, BoolArg, NumberArg, ReadersArg, TemplateArg, TemplateCheck, WritersArg
from .templates import captures_of
from .yamlsrc import KeyPath, Source

#: checks across a step's arguments, after each is read (records errors on the source)
CrossCheck = Callable[[Source, KeyPath, dict[str, Any]], None]


@attrs.frozen
class StepSyntax:
    """One step kind as a spec writes it: its arguments validate the YAML and describe the
    kind in the JSON Schema."""

    kind: str
    doc: str
    args: tuple[Arg, ...]
    #: the argument a scalar shorthand (``- untie: lm_head.weight``) fills
    shorthand: str | None = None
    check: CrossCheck | None = None

    def arg(self, name: str) -> Arg | None:
        return next((a for a in self.args if a.name == name), None)

    def validate(self, src: Source, path: KeyPath, body: Any, template_check: TemplateCheck) -> dict[str, Any] | None:
        """The step's arguments from its YAML ``body`` (defaults filled in), recording
        errors on ``src``; None when the body is not even a mapping."""
        if not isinstance(body, dict):
            if self.shorthand is None:
                src.error(path, f"{self.kind} takes a mapping of arguments: {', '.join(a.name for a in self.args)}")
                return None
            body = {self.shorthand: body}
        out: dict[str, Any] = {}
        for key in body:
            if self.arg(str(key)) is None:
                src.error((*path, key), f"{self.kind} has no argument '{key}'", suggest(str(key), [a.name for a in self.args]), at_key=True)
        for a in self.args:
            if a.name not in body:
                if a.required:
                    src.error(path, f"{self.kind} needs '{a.name}' ({a.doc})")
                elif a.default is not None:
                    out[a.name] = a.default
                continue
            value = a.read(src, (*path, a.name), body[a.name], template_check)
            if value is not None:
                out[a.name] = value
        if self.check is not None:
            self.check(src, path, out)
        return out

    def json_schema(self) -> dict[str, Any]:
        """The JSON Schema of one ``canonicalize`` entry of this kind."""
        body: dict[str, Any] = {
            "type": "object",
            "description": self.doc,
            "properties": {a.name: a.json() for a in self.args},
            "required": [a.name for a in self.args if a.required],
            "additionalProperties": False,
        }
        if self.shorthand:
            body = {"oneOf": [{"type": "string", "description": f"shorthand for {{{self.shorthand}: ...}}"}, body]}
        return {"type": "object", "properties": {self.kind: body}, "required": [self.kind], "additionalProperties": False}


def _fold_norm_captures(src: Source, path: KeyPath, args: dict[str, Any]) -> None:
    """The norm's bias is filled from the gain's captures. A reader may have captures the
    gain lacks (one final norm read by a layer of every block: T5's encoder output, read
    by every cross-attention's keys and values): the gain is folded into every weight the
    reader's pattern matches, and the reader's bias uses the weight's captures. A reader
    must capture every capture of the gain: else each of the gain's matches folds into
    the same weights (a mistyped ``{j}`` for ``{i}``)."""
    if "gain" not in args:
        return
    primary = set(captures_of(args["gain"]))
    bias = args.get("bias")
    if bias and not set(captures_of(bias)) <= primary:
        src.error(path, f"'{bias}' uses captures that the gain '{args['gain']}' does not have")
    for r in args.get("into", []):
        w, rb = r.get("weight"), r.get("bias")
        missing = sorted(primary - set(captures_of(w))) if w else []
        if missing:  # a mistyped capture ('{j}' for '{i}'): every layer's gain into one reader
            names = ", ".join("{" + m + "}" for m in missing)
            src.error(path, f"the reader '{w}' does not capture {names}, which the gain '{args['gain']}' does: "
                      "every gain it matches would be folded into the same weights (a weight reads one norm); "
                      f"use {names} in the reader's name")
        if w and rb and not set(captures_of(rb)) <= set(captures_of(w)) | primary:
            src.error(path, f"'{rb}' uses captures that neither the gain '{args['gain']}' nor its weight '{w}' has")


UNTIE = StepSyntax(
    "untie",
    "Give a tied parameter its own storage (an explicit, declared untie; the model "
    "keeps its class and its function). Needed before folding a norm into a tied "
    "unembedding.",
    (TemplateArg("param", True, doc="the parameter to untie from its twin"),),
    shorthand="param",
)
FOLD_NORM = StepSyntax(
    "fold_norm",
    "Fold a LayerNorm/RMSNorm gain (and bias) into the weights that read the norm's "
    "output; the norm's gain becomes 1 (and its bias 0). A norm that scales by "
    "(gain_offset + weight), such as Gemma's RMSNorm (1 + weight), folds that factor "
    "and its weight becomes 1 - gain_offset (0 for Gemma).",
    (
        TemplateArg("gain", True, doc="the norm's weight"),
        NumberArg("gain_offset", False,
                  doc="the norm multiplies by (gain_offset + weight); default 0 (1 for Gemma's RMSNorm, x * (1 + w))"),
        TemplateArg("bias", False, doc="the norm's bias, if it has one"),
        BoolArg("fold_bias", False, True, doc="fold the bias into the readers' biases (else keep it)"),
        ReadersArg("into", True, doc="the readers: weight, input axis, bias"),
    ),
    check=_fold_norm_captures,
)
CENTER = StepSyntax(
    "center",
    "Mean-centre the writers of a pre-LN residual stream along their residual axis. "
    "Pre-LN readers subtract the mean anyway, so the all-ones component carries no "
    "function; removing it makes independently trained models comparable there. "
    "The residual then lives in the zero-mean subspace.",
    (WritersArg("writers", True, doc="parameter -> its residual axis"),),
)

#: step kind -> its syntax, in the order error messages and the schema list them (each has
#: one implementation in :data:`symspec.canonical.STEPS`)
STEP_KINDS: dict[str, StepSyntax] = {s.kind: s for s in (UNTIE, FOLD_NORM, CENTER)}


def declare(syntax: StepSyntax) -> StepSyntax:
    """Add a step kind to the language (its implementation registers in
    :mod:`symspec.canonical` under the same name)."""
    STEP_KINDS[syntax.kind] = syntax
    return syntax


def validate_step(src: Source, path: KeyPath, raw: Any, template_check: TemplateCheck) -> tuple[str, dict[str, Any]] | None:
    """Normalise one ``canonicalize`` entry, recording errors on ``src``."""
    if not isinstance(raw, dict) or len(raw) != 1:
        src.error(path, "a step is a mapping with one key, its kind (e.g. '- fold_norm: {...}')")
        return None
    kind, body = next(iter(raw.items()))
    spath = (*path, kind)
    step = STEP_KINDS.get(kind)
    if step is None:
        hint = suggest(str(kind), STEP_KINDS)
        src.error(spath, f"unknown canonicalisation step '{kind}'", hint or f"known: {', '.join(STEP_KINDS)}", at_key=True)
        return None
    args = step.validate(src, spath, body, template_check)
    return None if args is None else (kind, args)


__all__ = ["STEP_KINDS", "Arg", "BoolArg", "NumberArg", "ReadersArg", "StepSyntax", "TemplateArg",
           "WritersArg", "declare", "validate_step"]
