"""``check``: do a spec's symmetries really preserve the model's function?

For the canonicalisation and for each declared space (all its instances at once), and
for all spaces together, sample random group elements, apply them to the canonical
weights, and compare the outputs with the canonical model's on random inputs, in
float64 and in float32. A space whose row fails is drilled into per instance, so the
report names the failing layer.

Tolerances (relative to the largest output magnitude, max-norm): float64 1e-9,
float32 1e-4 (group elements are sampled with condition number <= 10; float32 loses
about one digit per decade of conditioning, DESIGN §6). Override with ``rtol``.
"""

from __future__ import annotations

import copy
import json
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import attrs
import torch

from .bind import BoundSpec, bind
from .spec.model import Spec
from .transforms import apply_elements, canonicalize_model, sample_elements

DEFAULT_RTOL: dict[str, float] = {"float64": 1e-9, "float32": 1e-4}
DTYPES = {"float64": torch.float64, "float32": torch.float32}


@attrs.frozen
class CheckRow:
    space: str
    group: str
    dtype: str
    samples: int
    max_abs: float
    max_rel: float
    rtol: float
    failing: tuple[str, ...] = ()

    @property
    def passed(self) -> bool:
        return math.isfinite(self.max_rel) and self.max_rel <= self.rtol


@attrs.define
class CheckReport:
    spec: str
    model: str
    rows: list[CheckRow]
    notes: list[str] = attrs.field(factory=list)

    @property
    def passed(self) -> bool:
        return all(r.passed for r in self.rows)

    def failed_rows(self) -> list[CheckRow]:
        return [r for r in self.rows if not r.passed]

    def to_dict(self) -> dict[str, Any]:
        return {
            "spec": self.spec,
            "model": self.model,
            "passed": self.passed,
            "rows": [
                {**attrs.asdict(r), "failing": list(r.failing), "passed": r.passed,
                 "max_abs": _num(r.max_abs), "max_rel": _num(r.max_rel)}
                for r in self.rows
            ],
            "notes": self.notes,
        }

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)

    def render(self) -> str:
        """A plain-text table (the CLI prints a rich one)."""
        head = f"{'space':<16} {'group':<34} {'dtype':<8} {'max abs':>10} {'max rel':>10} {'rtol':>8}  result"
        lines = [f"symspec check: spec '{self.spec}' on {self.model}", head, "-" * len(head)]
        for r in self.rows:
            res = "pass" if r.passed else "FAIL" + (f" ({', '.join(r.failing)})" if r.failing else "")
            lines.append(f"{r.space:<16} {r.group[:34]:<34} {r.dtype:<8} {r.max_abs:>10.2e} {r.max_rel:>10.2e} {r.rtol:>8.0e}  {res}")
        lines += self.notes
        lines.append("all passed" if self.passed else f"{len(self.failed_rows())} row(s) failed")
        return "\n".join(lines)


def _num(x: float) -> float | str:
    return x if math.isfinite(x) else str(x)


def flatten_outputs(out: Any) -> list[torch.Tensor]:
    """Floating-point tensors of a model output (tensor, tuple, dict, HF ModelOutput)."""
    if isinstance(out, torch.Tensor):
        return [out] if out.is_floating_point() else []
    if isinstance(out, Mapping):
        return [t for v in out.values() for t in flatten_outputs(v)]
    if isinstance(out, (tuple, list)):
        return [t for v in out for t in flatten_outputs(v)]
    return []


def _cast_inputs(inputs: Any, dtype: torch.dtype) -> Any:
    if isinstance(inputs, torch.Tensor):
        return inputs.to(dtype) if inputs.is_floating_point() else inputs
    if isinstance(inputs, Mapping):
        return {k: _cast_inputs(v, dtype) for k, v in inputs.items()}
    if isinstance(inputs, (tuple, list)):
        return type(inputs)(_cast_inputs(v, dtype) for v in inputs)
    return inputs


def _dedupe_tied(module: torch.nn.Module, sd: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """functional_call wants one value per tied tensor: keep the first name of each tie."""
    seen: dict[int, str] = {}
    drop = set()
    for name, p in list(module.named_parameters(remove_duplicate=False)) + list(module.named_buffers(remove_duplicate=False)):
        if id(p) in seen:
            drop.add(name)
        else:
            seen[id(p)] = name
    return {k: v for k, v in sd.items() if k not in drop}


class _Runner:
    """Runs one module instance with swapped-in weights (torch.func.functional_call)."""

    def __init__(self, module: torch.nn.Module, inputs: Any) -> None:
        self.module = module.eval()
        self.inputs = inputs
        self._base: dict[torch.dtype, dict[str, torch.Tensor]] = {}

    def base(self, dtype: torch.dtype) -> dict[str, torch.Tensor]:
        if dtype not in self._base:
            sd = self.module.state_dict()
            self._base[dtype] = _dedupe_tied(self.module, {k: (v.detach().to(dtype) if v.is_floating_point() else v) for k, v in sd.items()})
        return self._base[dtype]

    def __call__(self, sd: Mapping[str, torch.Tensor], dtype: torch.dtype) -> list[torch.Tensor]:
        full = dict(self.base(dtype))
        full.update({k: v.to(dtype) for k, v in sd.items() if k in full})
        inputs = _cast_inputs(self.inputs, dtype)
        args, kwargs = (inputs, {}) if not isinstance(inputs, Mapping) else ((), dict(inputs))
        if not isinstance(args, tuple):
            args = (args,)
        with torch.no_grad():
            out = torch.func.functional_call(self.module, full, args, kwargs)
        return [t.detach() for t in flatten_outputs(out)]


def compare(a: Sequence[torch.Tensor], b: Sequence[torch.Tensor]) -> tuple[float, float]:
    """(max |a - b|, that divided by max |a|) over all outputs."""
    if len(a) != len(b) or any(x.shape != y.shape for x, y in zip(a, b)):
        return math.inf, math.inf
    if not a:
        return 0.0, 0.0
    diff = max(float((x.double() - y.double()).abs().max()) if x.numel() else 0.0 for x, y in zip(a, b))
    scale = max(float(x.double().abs().max()) if x.numel() else 0.0 for x in a)
    if math.isnan(diff):
        return math.inf, math.inf
    return diff, diff / max(scale, 1e-30)


def check(model: torch.nn.Module, spec: Spec | BoundSpec, inputs: Any, *, samples: int = 3, seed: int = 0,
          dtypes: Sequence[str] = ("float64", "float32"), spaces: Sequence[str] | None = None,
          rtol: Mapping[str, float] | None = None, cond: float = 10.0,
          progress: Callable[[str], None] | None = None) -> CheckReport:
    """Check that every declared symmetry of ``spec`` preserves ``model``'s function.

    ``inputs``: the positional inputs of ``model.forward`` (a tensor, a tuple) or a
    dict of keyword inputs. ``spaces``: restrict to these declared spaces.
    """
    tol = {**DEFAULT_RTOL, **(rtol or {})}
    for dt in dtypes:
        if dt not in DTYPES:
            raise ValueError(f"unknown dtype {dt!r}; use float64 or float32")
    bound = spec if isinstance(spec, BoundSpec) else bind(spec, model)
    problem = bound.problem
    say = progress or (lambda msg: None)
    report = CheckReport(bound.spec.name, type(model).__name__, [])

    declared = problem.declared_spaces()
    if spaces is not None:
        unknown = [s for s in spaces if s not in declared]
        if unknown:
            from .errors import SymspecInputError, suggest

            hint = suggest(unknown[0], declared)
            raise SymspecInputError(f"no space '{unknown[0]}' in spec '{bound.spec.name}'" + (f"; {hint}" if hint else f"; spaces: {', '.join(declared)}"))
        declared = [s for s in declared if s in spaces]

    say("canonicalising")
    base = copy.deepcopy(model).to(torch.float64).eval()
    ref = {dt: _Runner(base, inputs)({}, DTYPES[dt]) for dt in dtypes}
    canon = canonicalize_model(bound, base)
    del base
    runner = _Runner(canon, inputs)
    sd_c = {k: v.detach() for k, v in canon.state_dict().items()}
    canon_out = {dt: runner({}, DTYPES[dt]) for dt in dtypes}
    if bound.canonical:
        for dt in dtypes:
            a, r = compare(ref[dt], canon_out[dt])
            report.rows.append(CheckRow("canonicalize", ", ".join(dict.fromkeys(op.kind for op in bound.canonical)), dt, 1, a, r, tol[dt]))

    def run_rows(label: str, group_text: str, names: list[str], n: int) -> list[CheckRow]:
        worst = {dt: (0.0, 0.0) for dt in dtypes}
        for k in range(n):
            elems = sample_elements(problem, names, seed=seed * 1000 + k, cond=cond)
            sd_t = apply_elements(problem, elems, sd_c)
            changed = {name: sd_t[name] for name in sd_t if sd_t[name] is not sd_c[name]}
            for dt in dtypes:
                a, r = compare(canon_out[dt], runner(changed, DTYPES[dt]))
                if r > worst[dt][1] or not math.isfinite(r):
                    worst[dt] = (a, r)
            del sd_t, changed
        return [CheckRow(label, group_text, dt, n, worst[dt][0], worst[dt][1], tol[dt]) for dt in dtypes]

    for decl in declared:
        insts = problem.instances_of(decl)
        groups = sorted({str(problem.spaces[i].group) for i in insts})
        label = decl if len(insts) == 1 and problem.spaces[insts[0]].index is None else f"{decl}[*]"
        say(f"space {label}: {len(insts)} instance(s), {samples} sample(s)")
        rows = run_rows(label, " | ".join(groups), insts, samples)
        if len(insts) > 1 and not all(r.passed for r in rows):
            failing = []
            for inst in insts:
                sub = run_rows(inst, str(problem.spaces[inst].group), [inst], 1)
                if not all(r.passed for r in sub):
                    failing.append(inst)
            rows = [attrs.evolve(r, failing=tuple(failing)) if not r.passed else r for r in rows]
        report.rows.extend(rows)

    if len(declared) > 1 or (declared and len(problem.instances_of(declared[0])) > 1):
        all_insts = [i for d in declared for i in problem.instances_of(d)]
        say(f"all spaces together: {len(all_insts)} instance(s)")
        report.rows.extend(run_rows("all", f"{len(all_insts)} spaces", all_insts, samples))
    return report


def check_model(model: torch.nn.Module, spec: Spec, inputs: Any, **kw: Any) -> CheckReport:
    return check(model, bind(spec, model), inputs, **kw)
