"""Certificates: how far a weight-matching result can be from the best one, as lower
bounds on the objective's global minimum over the searched group (``--certify``,
:meth:`symspec.alignment.AlignResult.certify`).

- :mod:`.certificate`: :func:`certify`, the decoupled global bound and the composition of
  the others into a :class:`Certificate`;
- :mod:`.space`: the bound per space, the other spaces fixed at the result;
- :mod:`.joint`: the joint bound over interacting spaces (Shor and Gram SDP relaxations,
  with cvxpy, an optional dependency imported only when a relaxation is solved).

A bound on a result, not a solver: it sits above the solvers and the alignment methods.
See docs/matching.md.

Names are imported on first use: registering the certifier with alignment
(:mod:`.extension`, when methods are listed) does not import torch.
"""

from __future__ import annotations

from .._lazy import lazy_exports

__getattr__, __all__ = lazy_exports(__name__, {
    "Certificate": ".certificate", "certify": ".certificate", "certify_result": ".aligned",
    "GRAM_LIMIT": ".joint", "JOINT_LIMIT": ".joint", "NEEDS_CVXPY": ".joint", "JointBound": ".joint",
    "SpaceBound": ".space",
})
