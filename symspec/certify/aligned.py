"""The certifier of :meth:`symspec.alignment.AlignResult.certify` (registered by
:mod:`.extension`): an alignment's result certified over the groups it searched."""

from __future__ import annotations

from typing import Any

import attrs

from ..groups import parse
from .certificate import Certificate, certify
from .joint import GRAM_LIMIT, JOINT_LIMIT


def certify_result(result: Any, *, per_space: bool = True, joint: bool = True, joint_limit: int | None = None,
                   gram_limit: int | None = None) -> Certificate:
    """:func:`~.certificate.certify` on an :class:`~symspec.alignment.AlignResult` with
    canonical B, over the groups it searched (a lifted B certified as lifted)."""
    problem = result.bound.problem
    spaces = {n: attrs.evolve(si, group=parse(result.searched[n])) if n in result.searched else si
              for n, si in problem.spaces.items()}
    searched = attrs.evolve(problem, spaces=spaces)
    return certify(problem, result.canonical_a, result.canonical_b, result.aligned_b, searched, result.elements,
                   per_space=per_space, joint=joint, joint_limit=JOINT_LIMIT if joint_limit is None else joint_limit,
                   gram_limit=GRAM_LIMIT if gram_limit is None else gram_limit, lift=result.info.get("lift"))
