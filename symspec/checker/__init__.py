"""``check``: do a spec's symmetries really preserve the model's function?

For the canonicalisation and for each declared space (all its instances at once), and
for all spaces together, sample random group elements, apply them to the canonical
weights, and compare the outputs with the canonical model's on the given inputs, in
float64 and in float32. A space whose row fails is drilled into per instance, so the
report names the failing layer.

Tolerances (relative to the largest output magnitude, max-norm): float64 1e-9,
float32 1e-4 (group elements are sampled with condition number <= 10; float32 loses
about one digit per decade of conditioning, DESIGN §6). Override with ``rtol``.

Float64 means float64 throughout: models that cast to float32 internally (Hugging
Face's RMSNorm, eager softmax) are run with those casts kept in float64
(:class:`symspec.precision.KeepFloat64`), and the report says where they were.

Memory: by default the check is local (:mod:`symspec.checker.local`): the model stays in
its own dtype, and each space's samples run the blocks (layers) it acts on, one block at
a time upcast, canonicalised and transformed in the checked precision, on the inputs
recorded from one pass (:mod:`symspec.checker.blocks`). With ``whole=True`` the check
works on one float64 copy of the whole model, canonicalised and transformed in place
(plus a float32 mirror when float32 is checked); see :mod:`symspec.checker.inplace`.

The package: :mod:`~symspec.checker.run` (``check``), :mod:`~symspec.checker.report` (rows
and the report), :mod:`~symspec.checker.inplace` (the working copies, moved in place),
:mod:`~symspec.checker.local` and :mod:`~symspec.checker.blocks` (the local check),
:mod:`~symspec.checker.canonical` (the canonicalisation step by step) and
:mod:`~symspec.checker.forward` (running a model and comparing its outputs).
"""

from __future__ import annotations

from .canonical import canonicalize_inplace, locate_canonical_failure
from .forward import (
    DTYPES,
    call_forward,
    cast_inputs,
    compare,
    copy_as,
    flatten_outputs,
    select_outputs,
)
from .report import DEFAULT_RTOL, CheckReport, CheckRow
from .run import check

__all__ = [
    "DEFAULT_RTOL",
    "DTYPES",
    "CheckReport",
    "CheckRow",
    "call_forward",
    "canonicalize_inplace",
    "cast_inputs",
    "check",
    "compare",
    "copy_as",
    "flatten_outputs",
    "locate_canonical_failure",
    "select_outputs",
]
