"""``symspec.infer``: a checked spec drafted from the traced graph.

1. Trace the model with ``torch.export`` (ATen ops: the same graph for plain PyTorch,
   Hugging Face and timm models).
2. Read it into axis classes (:mod:`.walk`) and propose, per class, the largest group its
   evidence allows (:mod:`.lattice`): the residual stream, attention heads (QK and OV maps,
   rotary tables, grouped key/value heads), MLP units (and the scalings a gated or ReLU
   unit admits), the norms to fold and the writers to centre.
3. Render the draft (:mod:`.render`) and run :func:`symspec.check` on it. A space whose
   check fails is shrunk to the next smaller group the evidence can justify
   (GL -> O -> S -> identity; RoPE or GL head maps -> identity; scalings -> positive ->
   none) and checked again; a failing canonicalisation is dropped (centring first, then
   folding, which narrows the residual's group). What is written always passed the check.
"""

from __future__ import annotations

import contextlib
import functools
import re
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import attrs
import torch

from ..checker import call_forward, check
from ..errors import DiagnosticsError, GroupError, SymspecInputError
from ..graph import trace
from ..progress import Step
from ..spec import loads_spec
from .builder import build
from .draft import Draft
from .render import render, to_spec
from .walk import Facts, read_graph


class InferError(SymspecInputError):
    """The model could not be traced, or nothing could be verified."""


@attrs.define
class SpaceReport:
    name: str
    group: str
    evidence: list[str]
    shrunk: list[str]

    def to_dict(self) -> dict[str, Any]:
        return attrs.asdict(self)


@attrs.define
class InferResult:
    """What :func:`infer` found: the spec (``spec``, None when the draft's text did not
    load; ``yaml`` its text), the evidence per space, what stayed invariant and why, and
    the final check."""

    spec: Any
    yaml: str
    spaces: list[SpaceReport]
    unexplained: list[tuple[str, str]]
    notes: list[str]
    check: Any
    draft: Draft = attrs.field(repr=False)
    attempts: int = 1
    #: why the draft could not even be checked (it does not bind to the model, a group
    #: cannot be built): its problems, one per line; ``yaml`` is then the draft marked
    #: unverified, each problem in its header and beside the line it names
    error: str | None = None

    @property
    def passed(self) -> bool:
        return self.check is not None and self.check.passed

    @property
    def verified(self) -> bool:
        """The written spec passes its check and declares at least one space."""
        return self.passed and bool(self.spaces)

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.draft.name,
            "model": self.draft.model_class,
            "passed": self.passed,
            "verified": self.verified,
            "spaces": [s.to_dict() for s in self.spaces],
            "invariant": [{"where": w, "why": y} for w, y in self.unexplained],
            "notes": self.notes,
            "attempts": self.attempts,
            "check": self.check.to_dict() if self.check is not None else None,
            "error": self.error,
            "yaml": self.yaml,
        }


def chosen_outputs(model: torch.nn.Module, example_inputs: Any) -> tuple[str, ...]:
    """The outputs a draft's symmetries are read against (its ``outputs:``): a model's
    ``logits`` alone where it returns them beside other outputs (hidden states, a key and
    value cache, an encoder's last state: in the bases the symmetries move, so read as
    outputs they would leave every space acting on them invariant); every output (empty)
    otherwise. Runs the model once."""
    out = call_forward(model, example_inputs)
    if not isinstance(out, Mapping):
        return ()
    logits = out.get("logits")
    others = [k for k, v in out.items() if k != "logits" and v is not None]
    return ("logits",) if isinstance(logits, torch.Tensor) and logits.is_floating_point() and others else ()


@contextlib.contextmanager
def returning(model: torch.nn.Module, keys: Sequence[str]) -> Iterator[None]:
    """``model`` returning only the outputs ``keys`` (a dict of them) while the block runs
    (its forward wrapped on the instance, keeping its signature: the traced graph's
    parameters keep their names); nothing changed where ``keys`` is empty."""
    if not keys:
        yield
        return
    own = model.__dict__.get("forward")
    forward = model.forward

    @functools.wraps(forward)
    def only(*args: Any, **kwargs: Any) -> dict[str, Any]:
        out = forward(*args, **kwargs)
        return {k: out[k] for k in keys}

    model.forward = only  # type: ignore[method-assign]
    try:
        yield
    finally:
        if own is not None:
            model.forward = own  # type: ignore[method-assign]
        else:
            del model.forward


def read_model(model: torch.nn.Module, example_inputs: Any, outputs: Sequence[str] = ()) -> Facts:
    """Trace ``model`` with torch.export (returning ``outputs`` alone where given:
    :func:`returning`) and read the graph (:mod:`.walk`)."""
    with returning(model, outputs):
        mg = trace(model, example_inputs, methods=("export",))
    if not mg.traced:
        hint = ""
        config = getattr(model, "config", None)
        if getattr(config, "_experts_implementation", None) == "eager" and "DataDependent" in str(mg.reason):
            hint = ("; its experts run in a loop over the experts the router picked, which cannot be exported: load it with "
                    "experts_implementation='batched_mm' (or 'grouped_mm') in its config or from_pretrained")
        raise InferError(f"{type(model).__name__}: torch.export could not trace the model ({mg.reason}); "
                         "inference reads the exported graph, so there is nothing to infer from" + hint)
    return read_graph(mg.gm, model)


def _refuse_uncovered(facts: Facts, cls: str, source: str | None) -> None:
    """A model inference does not cover, in one line: no attention and norms of several
    widths (a ConvNeXt's stages) is not a Transformer with one residual stream, and its
    draft could only be many lines of contradicting shapes."""
    if facts.attentions:
        return
    widths = set()
    for norm in facts.norms:
        val = getattr(facts.nodes.get(norm.output), "meta", {}).get("val")
        shape = getattr(val, "shape", None)
        if shape:
            widths.add(int(shape[-1]))  # the normalised axis
    if len(widths) > 1:
        raise InferError(
            f"{source + ': ' if source else ''}{cls} has no attention, and its norms have {len(widths)} widths "
            f"({', '.join(map(str, sorted(widths)))}): inference covers Transformers, whose blocks read and write "
            "one residual stream of one width; write its spec by hand (docs/spec-language.md)")


def name_problem(name: str) -> str | None:
    """Why ``name`` cannot be a spec's name (None when it can): a spec's name is printable
    text on one line, not blank.

    >>> name_problem("a: 'b' # c") is None, name_problem("  ")
    (True, 'the name must not be blank')
    """
    if not name.strip():
        return "the name must not be blank"
    if not name.isprintable():  # line breaks, control characters, bytes that were not UTF-8 (surrogates)
        return f"the name must be printable text on one line; got {name!r}"
    return None


def infer(model: torch.nn.Module, example_inputs: Any, *, name: str | None = None, verify: bool = True,
          samples: int = 2, seed: int = 0, dtypes: tuple[str, ...] = ("float64", "float32"),
          progress: Callable[[str], None] | None = None, max_rounds: int = 12, source: str | None = None) -> InferResult:
    """A spec for ``model`` drafted from its traced graph, and checked (see the module).

    ``example_inputs``: as for :func:`symspec.check` (a tensor, a tuple, a dict of keyword
    inputs). ``verify=False`` returns the draft unchecked (``check`` is then None).
    ``source``: where the model came from, named in errors. A model without parameters
    (nothing for a symmetry to act on) or a ``name`` that cannot be a spec's name
    (:func:`name_problem`) is refused with :class:`InferError`.
    """
    say = progress or (lambda msg: None)
    cls = type(model).__name__
    if next(iter(model.parameters()), None) is None:
        raise InferError(f"{source + ': ' if source else ''}the model ({cls}) has no parameters: "
                         "there are no weight symmetries to infer, and no spec to write")
    if name is not None and name_problem(name):
        raise InferError(f"spec name: {name_problem(name)}")
    name = name or _default_name(model)
    say("tracing with torch.export")
    was_training = model.training
    model.eval()
    try:
        outputs = chosen_outputs(model, example_inputs)
        facts = read_model(model, example_inputs, outputs)
    finally:
        model.train(was_training)
    _refuse_uncovered(facts, cls, source)
    say("reading the graph")
    rounds = _Rounds(model, example_inputs, facts, name, say, dict(samples=samples, seed=seed, dtypes=dtypes))
    rounds.draft.outputs = outputs
    error: DiagnosticsError | GroupError | None = None
    spec: Any = None
    while True:
        text = rounds.draft_text()
        try:  # a draft that does not bind, or names a group that cannot be built, is a draft that failed
            spec = None  # (not an earlier round's, should this one not load)
            spec = loads_spec(text, DRAFT)
            if not verify:
                break
            report = rounds.check(spec)
        except (DiagnosticsError, GroupError) as e:
            error = e
            break
        if report.passed or rounds.attempts >= max_rounds or not rounds.shrink(report):
            break
    draft = rounds.draft
    spaces = [SpaceReport(sp.key(), sp.group_text(), list(sp.evidence),
                          [f"{a} -> {b}: {why}" for a, b, why in sp.history])
              for sp in draft.spaces.values() if sp.alive]
    gone = [(sp.key(), f"every group failed the check ({'; '.join(f'{a}: {w}' for a, _, w in sp.history)})")
            for sp in draft.spaces.values() if not sp.alive and sp.history]  # (one left out unbound is listed already)
    problems: list[str] = []
    if error is not None:
        rounds.report = None
        problems = [str(d) for d in error.diagnostics] if isinstance(error, DiagnosticsError) else [str(error)]
        lines = {d.loc.line: d.message for d in getattr(error, "diagnostics", ()) if d.loc.file == DRAFT and d.loc.line}
        text = unverified(text, problems, lines)
    elif verify and rounds.report is not None and not (rounds.report.passed and spaces):
        failed = [f"{r.space}: max rel err {r.max_rel:.1e}" for r in rounds.report.failed_rows()]
        text = unverified(text, failed or ["the draft declares no symmetry"], {})
    return InferResult(spec, text, spaces, list(draft.unexplained) + gone, list(draft.notes), rounds.report, draft,
                       rounds.attempts, "\n".join(problems) or None)


#: the name the draft's problems are located in (it is not a file until it is written)
DRAFT = "the draft"


def unverified(text: str, problems: list[str], lines: dict[int, str]) -> str:
    """``text`` (a draft's YAML) marked unverified: a header that says so and lists
    ``problems``, and each line that ``lines`` names (1-based line -> message) with its
    problem beside it as a comment. The YAML reads the same (comments only)."""
    body = text.splitlines()
    for n, message in lines.items():
        if 1 <= n <= len(body):
            body[n - 1] += f"  # FAILS: {' '.join(message.split())}"
    head = ["# UNVERIFIED: `symspec infer` could not verify this draft. Fix what is listed here, then run",
            "# `symspec check MODEL --spec THIS_FILE` until it passes; do not align models with it before.",
            *(f"#   - {' '.join(p.split())}" for p in problems), "#"]
    return "\n".join([*head, *body]) + "\n"


class _Rounds:
    """The rounds of :func:`infer`: write the draft, check it, shrink what failed (or drop
    a canonicalisation that changed the function, rebuilding the draft without it)."""

    def __init__(self, model: torch.nn.Module, inputs: Any, facts: Facts, name: str, say: Callable[[str], None],
                 options: dict[str, Any]) -> None:
        self.model, self.inputs, self.facts, self.name, self.say, self.options = model, inputs, facts, name, say, options
        self.fold, self.center = True, True
        self.draft = build(facts, model, name, fold=True, center=True)
        self.report: Any = None
        self.attempts = 0
        self.history: dict[str, list[tuple[str, str, str]]] = {}

    def draft_text(self) -> str:
        """The draft as it stands, written (a new round). A space the graph showed but
        no parameter's binding carries is left out (a spec refuses it: nothing would
        check it), and listed with what stayed invariant."""
        self.attempts += 1
        _restore_history(self.draft, self.history)
        spec, _ = to_spec(self.draft)
        used = {s for p in spec.params for s in p.spaces}
        for sp in self.draft.spaces.values():
            if sp.alive and sp.base not in used:
                self.draft.unexplained.append((sp.key(), f"{sp.group_text()} was read from the graph, but no parameter's "
                                               "binding carries it (a layout inference does not read): left out"))
                sp.group = "Id"
        return render(self.draft, _header(self.draft))

    def check(self, spec: Any) -> Any:
        r = self.attempts
        self.say(f"checking the draft (round {r})")

        def checking(msg: str) -> None:  # the check's steps, counted, within the round
            self.say(Step.of(msg, f"round {r}: "))

        try:
            self.report = check(self.model, spec, self.inputs, progress=checking, **self.options)
        except SymspecInputError as e:
            # a model that cannot run in float64 (a float32-only kernel) is checked in float32 alone
            dtypes = self.options["dtypes"]
            if "float64" not in dtypes or len(dtypes) == 1 or "in float64" not in str(e):
                raise
            self.options["dtypes"] = dtypes = tuple(d for d in dtypes if d != "float64")
            self.draft.notes.append(f"the model cannot run in float64 ({str(e).split(': ', 1)[-1][:160]}); "
                                    f"checked in {', '.join(dtypes)} only")
            self.report = check(self.model, spec, self.inputs, progress=checking, **self.options)
        return self.report

    def shrink(self, report: Any) -> bool:
        """Shrink what failed; False when nothing is left to shrink."""
        failed = {r.space.replace("[*]", "") for r in report.failed_rows()}
        if "canonicalize" in failed:
            return self._drop_canonicalization(next(r for r in report.failed_rows() if r.space == "canonicalize"))
        draft = self.draft
        targets = [s for s in failed if s in draft.spaces and draft.spaces[s].alive]
        if not targets:  # only the 'all' row: shrink the largest group left
            targets = [s for s, sp in draft.spaces.items() if sp.alive][:1]
        if not targets:
            return False
        if self.fold and draft.folds and "sgn" in targets and draft.spaces["sgn"].group == "Sign":
            # a fold takes a norm's gain, which may be what carries the stream's sign (BERT's
            # head norm after a GELU): before the sign goes, the draft goes without folds
            why = next((r for r in report.failed_rows() if r.space == "sgn"), None)
            self.fold = False
            err = f" (max rel err {why.max_rel:.1e} with them folded)" if why else ""
            return self._rebuild(f"folding the norms took the gains that carry the residual's sign{err}: left out")
        for s in targets:
            rows = [r for r in report.failed_rows() if r.space.replace("[*]", "") == s]
            _shrink(draft.spaces[s], f"max rel err {max(r.max_rel for r in rows):.1e}" if rows else "with the others")
        return True

    def _drop_canonicalization(self, why: Any) -> bool:
        """Centring first, then folding: left out, and the draft rebuilt without it."""
        if self.center and self.draft.center:
            self.center = False
            return self._rebuild(f"mean-centring changed the function (max rel err {why.max_rel:.1e}): left out")
        if self.fold:
            self.fold = False
            return self._rebuild(f"folding the norms changed the function (max rel err {why.max_rel:.1e}): left out")
        return False

    def _rebuild(self, note: str) -> bool:
        """The draft built again with the canonicalisation now chosen (``self.fold``,
        ``self.center``), keeping what shrank and the notes so far, ``note`` among them."""
        self.history = {k: v.history for k, v in self.draft.spaces.items()}
        notes = [*self.draft.notes, note]
        self.draft = build(self.facts, self.model, self.name, fold=self.fold, center=self.center)
        self.draft.notes[:0] = [n for n in notes if n not in self.draft.notes]
        return True


def _restore_history(draft: Draft, history: dict[str, list[tuple[str, str, str]]]) -> None:
    """After a rebuild, shrink again what had shrunk."""
    for key, hist in history.items():
        sp = draft.spaces.get(key)
        if sp is None or sp.history:
            continue
        for _, _, why in hist:
            _shrink(sp, why)
    history.clear()


def _shrink(sp: Any, why: str) -> None:
    before = sp.group_text()
    if sp.kind == "experts":
        if sp.within != "Id":  # each expert's units first, then the expert permutation itself
            sp.within = "Id"
        else:
            sp.group = "Id"
    elif sp.kind == "heads":
        if sp.start is None:
            sp.start = (sp.qk, sp.ov, list(sp.qk_chain), list(sp.ov_chain))
        if sp.qk_chain:
            sp.qk = sp.qk_chain.pop(0)
        elif sp.ov_chain:
            sp.ov = sp.ov_chain.pop(0)
        elif sp.permute:
            # the head permutation alone breaks the function (a per-head table it does not
            # move: ALiBi's slopes, T5's relative position bias): per-head maps may still
            # hold with every head in its place, from the largest ones down again
            sp.permute = False
            sp.qk, sp.ov, qk_chain, ov_chain = sp.start
            sp.qk_chain, sp.ov_chain = list(qk_chain), list(ov_chain)
        else:
            sp.group = "Id"
    elif sp.chain:
        sp.group = sp.chain.pop(0)
    else:
        sp.group = "Id"
    after = sp.group_text() if sp.alive else "identity"
    sp.history.append((before, after, why))


def _default_name(model: torch.nn.Module) -> str:
    cls = type(model).__name__
    return re.sub(r"(?<=[a-z0-9])(?=[A-Z][a-z])|(?<=[a-z]{2})(?=[A-Z]{2})|(?<=[A-Z])(?=[A-Z][a-z])", "_", cls).lower() + "_inferred"


def _header(draft: Draft) -> list[str]:
    lines = [f"Inferred by `symspec infer` from the traced graph of {draft.model_class}; read it, then refine.", ""]
    for sp in draft.spaces.values():
        if not sp.alive:
            continue
        lines.append(f"{sp.key()}: {sp.group_text()}")
        for e in sp.evidence:
            lines.append(f"  - {e}")
        for a, b, why in sp.history:
            lines.append(f"  - {a} failed the check ({why}); shrunk to {b}")
    dead = [sp for sp in draft.spaces.values() if not sp.alive and sp.history]
    if draft.unexplained or dead:
        lines += ["", "Left invariant (no symmetry declared):"]
        for where, why in draft.unexplained:
            lines.append(f"  - {where}: {why}")
        for sp in dead:
            lines.append(f"  - {sp.key()}: every candidate group failed the check")
    if draft.notes:
        lines += ["", *draft.notes]
    return lines
