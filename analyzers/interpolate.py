"""Evaluate models along the straight line (1-λ)·A + λ·B between two state dicts.

One module instance serves every point: the interpolated weights are written into
one preallocated buffer per tensor (``torch.lerp(..., out=)``) and swapped in with
``torch.func.functional_call``; the data are moved to the device once. A K-point
curve therefore costs K passes over the data plus K cheap lerps (bench/bench_barrier.py
measures it against K plain forward passes).

>>> import torch
>>> a = {"w": torch.zeros(2)}; b = {"w": torch.ones(2)}
>>> lerp_state(a, b, 0.25)["w"].tolist()
[0.25, 0.25]
>>> lambdas(5)
[0.0, 0.25, 0.5, 0.75, 1.0]
"""

from __future__ import annotations

import copy
import itertools
import math
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import attrs
import torch

from symspec.data import EvalData, call_model
from symspec.errors import SymspecInputError
from symspec.statedict import functional_names, interpolate_state_dicts

Progress = Callable[[int], None]


class PathError(SymspecInputError):
    """Two endpoints that cannot be interpolated, or a bad grid of points (exit 2)."""


def lambdas(points: int) -> list[float]:
    """``points`` evenly spaced values from 0 to 1, with both ends exact."""
    if isinstance(points, bool) or not isinstance(points, int) or points < 2:
        raise PathError(f"an interpolation needs at least 2 points (both endpoints), got {points!r}")
    return [0.0] + [i / (points - 1) for i in range(1, points - 1)] + [1.0]


def check_grid(grid: Sequence[float]) -> list[float]:
    values = [float(x) for x in grid]
    if len(values) < 2:
        raise PathError(f"an interpolation needs at least 2 points, got {len(values)}")
    if values[0] != 0.0 or values[-1] != 1.0:
        raise PathError("the grid of λ must start at 0 and end at 1 (the barrier is measured against the endpoints)")
    if any(b <= a for a, b in itertools.pairwise(values)):
        raise PathError("the grid of λ must be strictly increasing")
    return values


def check_pair(sd_a: Mapping[str, torch.Tensor], sd_b: Mapping[str, torch.Tensor],
               names: tuple[str, str] = ("A", "B")) -> None:
    """Raise :class:`PathError` unless both state dicts have the same names and shapes,
    and their non-floating entries (integer buffers) agree."""
    a, b = names
    only_a = [k for k in sd_a if k not in sd_b]
    only_b = [k for k in sd_b if k not in sd_a]
    problems = []
    if only_a:
        problems.append(f"{len(only_a)} tensor(s) only in {a}: {', '.join(only_a[:4])}")
    if only_b:
        problems.append(f"{len(only_b)} tensor(s) only in {b}: {', '.join(only_b[:4])}")
    shapes = [f"{k} {list(sd_a[k].shape)} vs {list(sd_b[k].shape)}" for k in sd_a
              if k in sd_b and sd_a[k].shape != sd_b[k].shape]
    if shapes:
        problems.append(f"{len(shapes)} shape(s) differ: {'; '.join(shapes[:4])}")
    if problems:
        raise PathError(f"{a} and {b} are not two models of one architecture: " + "; ".join(problems))
    for k, v in sd_a.items():
        w = sd_b[k]
        if v.is_floating_point() != w.is_floating_point():
            raise PathError(f"{k}: floating in one model and not in the other")
        if not v.is_floating_point() and not torch.equal(v, w.to(v.device)):
            raise PathError(f"{k}: a non-floating tensor (e.g. an index buffer) that differs between {a} and {b} "
                            "cannot be interpolated")
        if v.is_floating_point() and not (torch.isfinite(v).all() and torch.isfinite(w).all()):
            raise PathError(f"{k}: holds NaN or inf in {a if not torch.isfinite(v).all() else b}")


def lerp_state(sd_a: Mapping[str, torch.Tensor], sd_b: Mapping[str, torch.Tensor], lam: float,
               out: dict[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
    """(1-λ)·A + λ·B for every floating tensor (exactly A at λ=0 and B at λ=1); other
    tensors are taken from A. With ``out``, writes into its tensors. The one
    implementation is :func:`symspec.statedict.interpolate_state_dicts`."""
    return interpolate_state_dicts(sd_a, sd_b, lam, out)


@attrs.frozen
class PointResult:
    loss: float
    accuracy: float | None


@attrs.frozen
class Curve:
    """Loss (and accuracy) at each λ of a path from A (λ=0) to B (λ=1)."""

    lambdas: tuple[float, ...]
    losses: tuple[float, ...]
    accuracies: tuple[float, ...] | None = None
    seconds: float = 0.0

    def __attrs_post_init__(self) -> None:
        if len(self.lambdas) != len(self.losses) or (self.accuracies is not None and len(self.accuracies) != len(self.losses)):
            raise PathError("a curve needs one loss (and accuracy) per λ")

    @property
    def loss_a(self) -> float:
        return self.losses[0]

    @property
    def loss_b(self) -> float:
        return self.losses[-1]


class PathEvaluator:
    """Evaluates state dicts of one architecture on one split with one module instance.

    ``module`` gives the architecture (its own weights are never used or changed; a
    private copy is moved to ``device``). ``data`` is an :class:`EvalData`.
    """

    def __init__(self, module: torch.nn.Module, data: EvalData, *, device: str | torch.device = "cpu",
                 dtype: torch.dtype | None = None) -> None:
        self.device = resolve_device(device)
        param = next(iter(module.parameters()), None)
        self.dtype = dtype or (param.dtype if param is not None and param.is_floating_point() else torch.float32)
        if not data.batches:
            raise PathError(f"{data.name}: the {data.split} split is empty")
        self.module = copy.deepcopy(module).to(self.device, self.dtype).eval()
        # Non-persistent buffers (rotary frequencies, causal masks) are not among the
        # names: functional_call keeps the module's own for them.
        self.names, self.alias = functional_names(self.module)
        self.data = data.to(self.device, self.dtype)
        self.calls = 0  # batches evaluated (forward passes)

    def prepare(self, sd: Mapping[str, torch.Tensor], label: str = "the state dict") -> dict[str, torch.Tensor]:
        """``sd`` on the device, in the evaluator's dtype, one entry per tied tensor."""
        own = self.module.state_dict()
        missing = [k for k in self.names if k not in sd]
        if missing:
            raise PathError(f"{label} lacks {len(missing)} tensor(s) of {type(self.module).__name__}: {', '.join(missing[:4])}")
        unexpected = [k for k in sd if k not in own]
        if unexpected:
            raise PathError(f"{label} has {len(unexpected)} tensor(s) that {type(self.module).__name__} does not: {', '.join(unexpected[:4])}")
        out = {}
        for k in self.names:
            v = sd[k]
            if v.shape != own[k].shape:
                raise PathError(f"{label}: {k} has shape {list(v.shape)}, the model {list(own[k].shape)}")
            out[k] = v.detach().to(self.device, self.dtype if v.is_floating_point() else v.dtype)
        for k, target in self.alias.items():
            if k in sd and target in sd and not torch.equal(sd[k].to(out[target].device, out[target].dtype), out[target]):
                raise PathError(f"{label}: {k} differs from {target}, but the model ties them; evaluate it in an "
                                "untied (canonical) module")
        return out

    @torch.inference_mode()
    def evaluate(self, sd: Mapping[str, torch.Tensor], progress: Progress | None = None, *, prepared: bool = False) -> PointResult:
        """Mean loss (and accuracy) of the weights ``sd`` over the split."""
        weights = sd if prepared else self.prepare(sd)
        total = torch.zeros((), dtype=torch.float64, device=self.device)
        correct = torch.zeros((), dtype=torch.float64, device=self.device)
        count = 0
        has_acc = self.data.accuracy is not None
        for inputs, targets in self.data.batches:
            out = _call(self.module, weights, inputs)
            self.calls += 1
            n = int(targets.numel())
            value = self.data.loss(out, targets)
            total += (value.double() if isinstance(value, torch.Tensor) else float(value)) * n
            if has_acc:
                acc = self.data.accuracy(out, targets)  # type: ignore[misc]
                if isinstance(acc, torch.Tensor):
                    correct += acc.double() * n
                elif math.isnan(acc):
                    has_acc = False
                else:
                    correct += float(acc) * n
            count += n
            if progress is not None:
                progress(1)
        loss = float(total) / count
        if not math.isfinite(loss):
            loss = math.inf if math.isnan(loss) else loss
        return PointResult(loss, float(correct) / count if has_acc else None)

    def curve(self, sd_a: Mapping[str, torch.Tensor], sd_b: Mapping[str, torch.Tensor],
              points: int | Sequence[float] = 11, progress: Progress | None = None,
              names: tuple[str, str] = ("A", "B")) -> Curve:
        """Loss and accuracy at each λ of ``points`` (a count, or the λ grid itself)."""
        grid = lambdas(points) if isinstance(points, int) else check_grid(points)
        a = self.prepare(sd_a, names[0])
        b = self.prepare(sd_b, names[1])
        check_pair(a, b, names)
        start = time.perf_counter()
        buf = {k: torch.empty_like(v) if v.is_floating_point() else v for k, v in a.items()}
        losses, accs = [], []
        for lam in grid:
            lerp_state(a, b, lam, out=buf)
            r = self.evaluate(buf, progress, prepared=True)
            losses.append(r.loss)
            accs.append(r.accuracy)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        seconds = time.perf_counter() - start
        accuracies = tuple(float(x) for x in accs) if all(x is not None for x in accs) else None
        return Curve(tuple(grid), tuple(losses), accuracies, seconds)


def _call(module: torch.nn.Module, weights: Mapping[str, torch.Tensor], inputs: Any) -> Any:
    return call_model(lambda *a, **k: torch.func.functional_call(module, weights, a, k), inputs)


def resolve_device(device: str | torch.device) -> torch.device:
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as e:
        raise PathError(f"unknown device {device!r}: {e}") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise PathError(f"device {device!r} asked for, but CUDA is not available here")
    if dev.type == "mps" and not torch.backends.mps.is_available():
        raise PathError(f"device {device!r} asked for, but MPS is not available here")
    return dev


def interpolation_curve(module: torch.nn.Module, sd_a: Mapping[str, torch.Tensor], sd_b: Mapping[str, torch.Tensor],
                        data: EvalData, *, points: int | Sequence[float] = 11, device: str | torch.device = "cpu",
                        dtype: torch.dtype | None = None, progress: Progress | None = None) -> Curve:
    """Loss (and accuracy) of (1-λ)·A + λ·B at ``points`` values of λ, evaluated in ``module``.

    ``module`` is any instance of the architecture (for aligned pairs: the canonical
    module, whose ties may differ from the original's).
    """
    return PathEvaluator(module, data, device=device, dtype=dtype).curve(sd_a, sd_b, points, progress)
