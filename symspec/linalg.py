"""Linear algebra that works around faults of the libraries below torch.

Batched LU (inverse, solve) on the CPU is done one matrix at a time where torch's batched
call is known to return wrong results (:data:`LU_SERIAL_ABOVE`)."""

from __future__ import annotations

import math

import torch

#: CPU batches of matrices wider than this go through LU (inverse, solve) one matrix at a
#: time when torch runs more than one thread. torch's batched LU runs the batch in a
#: parallel loop, each thread calling MKL's getrf; from about n = 150 (float32 and float64
#: alike; torch 2.14.1 with MKL 2024.2, 2 threads) the concurrent getrf calls corrupt each
#: other (``Intel oneMKL ERROR: Parameter 6 was incorrect on entry to DLASWP``) and return
#: wrong inverses, raise, or hang (pytorch/pytorch#142815 and #141358; an open fix:
#: #181570). Two GL(256) head maps inverted wrong as one batch were why planted heads of
#: width 256 were not recovered. The threshold keeps a margin below 150 (MKL's own switch
#: may lie elsewhere on other CPUs); heads of 64 and less take the batched call as before.
#: One matrix at a time costs a Python loop over the batch (MKL threads each matrix).
LU_SERIAL_ABOVE = 64


def _lu_serial(m: torch.Tensor) -> bool:
    return (m.device.type == "cpu" and m.ndim > 2 and m.shape[-1] > LU_SERIAL_ABOVE
            and math.prod(m.shape[:-2]) > 1 and torch.get_num_threads() > 1)


def lu_inv(m: torch.Tensor) -> torch.Tensor:
    """``torch.linalg.inv`` safe from the batched-LU fault (:data:`LU_SERIAL_ABOVE`)."""
    if not _lu_serial(m):
        return torch.linalg.inv(m)
    n = m.shape[-1]
    return torch.stack([torch.linalg.inv(x) for x in m.reshape(-1, n, n)]).reshape(m.shape)


def lu_inv_ex(m: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``torch.linalg.inv_ex`` (inverse, info) safe from the batched-LU fault."""
    if not _lu_serial(m):
        return torch.linalg.inv_ex(m)
    n = m.shape[-1]
    outs = [torch.linalg.inv_ex(x) for x in m.reshape(-1, n, n)]
    inv = torch.stack([o[0] for o in outs]).reshape(m.shape)
    return inv, torch.stack([o[1] for o in outs]).reshape(m.shape[:-2])


def lu_solve(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``torch.linalg.solve(a, b)`` for a matrix right-hand side ``b`` [*, n, k], safe from
    the batched-LU fault (the batch dimensions broadcast)."""
    batch = torch.broadcast_shapes(a.shape[:-2], b.shape[:-2])
    if b.ndim < 2 or not _lu_serial(a.expand(*batch, *a.shape[-2:])):
        return torch.linalg.solve(a, b)
    n, k = a.shape[-1], b.shape[-1]
    aa = a.expand(*batch, n, n).reshape(-1, n, n)
    bb = b.expand(*batch, n, k).reshape(-1, n, k)
    return torch.stack([torch.linalg.solve(x, y) for x, y in zip(aa, bb)]).reshape(*batch, n, k)
