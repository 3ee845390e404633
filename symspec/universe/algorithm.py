"""The rounds of universe matching (DESIGN §4), as in the paper's pseudo-code:

    U <- θ_start                                   (canonical form)
    repeat
        g_i <- align(g_i·θ_i onto U)   for every model i, warm-started from g_i
        U   <- (1/N) Σ_i g_i·θ_i
    until F(U, g) = Σ_i ||U - g_i·θ_i||² stops improving

Both steps lower F, so the objective reported per round never grows; the rounds stop
when it improves by less than ``tol`` (relative) or by no more than its rounding error,
when it reaches the rounding level of the working precision (``eps * n * ||U||^2``), or
after ``rounds``.

A round is one task per model (:mod:`.tasks`), run by any executor of
:mod:`symspec.runtime`. The parent holds the universe and a running float64 sum, and
adds the aligned models in index order as they complete, one at a time: memory does not
grow with the number of models, and the merged model is bitwise the same whichever
executor ran the tasks.
"""

from __future__ import annotations

import functools
import math
import time
from collections.abc import Callable, Mapping
from typing import Any

import attrs
import torch

from ..runtime import Executor, Result
from ..statedict import squared_distance
from .errors import raise_failures
from .progress import Progress, UniverseEvent
from .result import method_history
from .tasks import Task
from .workdir import ALIGNED_FIELDS, WorkFolder, load_tensors, save_tensors


@attrs.define
class Run:
    """What the rounds need: the work folder, the executor, the config file every task
    reads, the models (names, file keys, the start model's index), the bound parameters
    (the objective's terms) and the working dtype."""

    folder: WorkFolder
    executor: Executor
    config: str
    names: list[str]
    keys: list[str]
    start: int
    params: list[str]
    dtype: torch.dtype
    say: Progress
    #: tasks whose result an earlier, interrupted run left (not run again)
    resumed: int = 0
    #: the rounds stop on the method's own objective (a data-driven method's), not on F
    own_objective: bool = False

    @property
    def n(self) -> int:
        return len(self.names)


class RunningMean:
    """A running sum in float64, added to in index order: the mean is bitwise the same
    whatever order the models were aligned in."""

    def __init__(self) -> None:
        self.total: dict[str, torch.Tensor] = {}
        self.count = 0

    def add(self, sd: Mapping[str, torch.Tensor]) -> None:
        if not self.total:
            self.total = {k: (v.to(torch.float64, copy=True) if v.is_floating_point() else v) for k, v in sd.items()}
        else:
            for k, v in self.total.items():
                if v.is_floating_point():
                    v.add_(sd[k].to(torch.float64))
        self.count += 1

    def mean(self, dtype: torch.dtype) -> dict[str, torch.Tensor]:
        return {k: ((v / self.count).to(dtype) if v.is_floating_point() else v) for k, v in self.total.items()}


class _Round:
    """One round's bookkeeping in the parent: results as they complete, and the mean fed
    with the aligned models in index order (read from disk one at a time)."""

    def __init__(self, run: Run, r: int, say: Callable[[int, str], None]) -> None:
        self.run, self.r, self.say = run, r, say
        self.results: dict[int, Result] = {}
        self.failures: list[Result] = []
        self.mean = RunningMean()
        self.next = 0

    def feed(self) -> None:
        while self.next < self.run.n and self.results.get(self.next, {}).get("ok"):
            self.mean.add(load_tensors(self.run.folder.aligned(self.r, self.run.keys[self.next])))
            self.next += 1

    def done(self, task: Task, res: Result) -> None:
        self.results[task.index] = res
        if not res.get("ok"):
            self.failures.append(res)
        self.say(len(self.results), task.name)
        self.feed()


def converged(history: list[float], tol: float, floor: float, noise: float = 0.0) -> bool:
    """The last round gained less than ``tol`` (relative) or no more than ``noise`` (the
    rounding error of the two values: no decision is taken on rounding noise), or the
    objective is at the rounding level of the working precision (``floor``: eps * n *
    ||U||^2)."""
    prev, now = history[-2], history[-1]
    return now <= floor or prev - now <= max(tol * max(prev, 1e-300), noise)


@attrs.define
class RoundLog:
    """The finished rounds (their JSON-able account) and the objective: F before the
    first round, then after each.

    Each round also records the method's own objective (``method_objective``): the sum
    over the models of what their alignment onto the round's universe left of the
    objective it minimises (``method_objective_start``: before the first round's). For
    weight matching that is F before the universe moves; a data-driven method minimises
    another objective (the distance of the activations), which F does not measure. With
    ``own``, the rounds stop when that objective stops improving."""

    rounds: list[dict[str, Any]]
    history: list[float]
    #: seconds spent aligning in this call (not in the run it resumed)
    seconds: float = 0.0
    own: bool = False

    @property
    def method_history(self) -> list[float]:
        """The method's own objective before the first round, then after each (empty where
        a round did not record it)."""
        return method_history(self.rounds)

    @property
    def converged_on(self) -> str:
        """What the rounds stop on: ``method`` (its own objective) or ``weights`` (F)."""
        return "method" if self.own and len(self.method_history) >= 2 else "weights"

    def noise(self, eps: float) -> float:
        """The rounding error of the last two objectives. Each is float64 arithmetic on
        sums of per-model distances that the working precision (``eps``) computed to
        about 2 eps of their size (``target_objective``, before the universe's own change
        is taken off; the first value is such a sum itself)."""
        now = self.rounds[-1]["target_objective"]
        prev = self.rounds[-2]["target_objective"] if len(self.rounds) > 1 else self.history[-2]
        return 2 * eps * (abs(prev) + abs(now))

    def converged(self, tol: float, eps: float) -> bool:
        if self.converged_on == "method":  # no floor of its own: a distance of activations has no rounding level
            own = self.method_history
            return converged(own, tol, 0.0, 2 * eps * (abs(own[-2]) + abs(own[-1])))
        return converged(self.history, tol, self.rounds[-1]["floor"], self.noise(eps))

    def stop(self, rounds: int, tol: float, eps: float) -> bool:
        return bool(self.rounds) and (len(self.rounds) >= rounds or self.converged(tol, eps))

    def add(self, r: int, names: list[str], results: Mapping[int, Result], delta: float, floor: float,
            seconds: float) -> None:
        """Round ``r``: each model's distance to the round's target before and after its
        alignment, and the universe's change ``delta`` = ||U_new - U_old||^2."""
        n = len(names)
        before = math.fsum(results[i]["before"] for i in range(n))
        after = math.fsum(results[i]["after"] for i in range(n))
        if not self.history:
            self.history.append(before)
        # sum_i ||U_new - a_i||^2 = sum_i ||U_old - a_i||^2 - n ||U_new - U_old||^2 (U_new is their mean)
        self.history.append(max(0.0, after - n * delta))
        self.seconds += seconds
        own = [results[i].get("match_objective") or [] for i in range(n)]
        method = {"method_objective_start": math.fsum(h[0] for h in own),
                  "method_objective": math.fsum(h[-1] for h in own)} if all(own) else {}
        self.rounds.append({
            "round": r, "objective": self.history[-1], "target_objective": after, "universe_change": delta,
            "floor": floor, "seconds": seconds, **method,
            "models": [{"name": names[i], "before": results[i]["before"], "after": results[i]["after"],
                        "match_rounds": results[i].get("match_rounds"), "seconds": results[i].get("seconds")}
                       for i in range(n)],
        })


def align_all(run: Run, r: int, rounds: int) -> _Round:
    """Round ``r``'s alignments: one task per model not aligned yet (a resumed round keeps
    its finished tasks), each warm-started from the model's element of round ``r - 1``."""
    folder = run.folder
    say = functools.partial(_say_align, run.say, r, rounds, run.n)
    rnd = _Round(run, r, say)
    tasks = []
    for i, (name, key) in enumerate(zip(run.names, run.keys)):
        marker = folder.marker(r, key)
        done = folder.finished(marker, [folder.aligned(r, key), folder.elements(r, key)], ALIGNED_FIELDS)
        if done is not None:
            rnd.results[i] = done
            run.resumed += 1
            continue
        init = str(folder.elements(r - 1, key)) if r > 1 else ""
        tasks.append(Task("align", i, name, run.config, canonical=str(folder.canonical(key)),
                          universe=str(folder.universe(r)), init=init, aligned=str(folder.aligned(r, key)),
                          elements=str(folder.elements(r, key)), done=str(marker)))
    rnd.feed()
    run.executor.run(tasks, rnd.done)
    raise_failures(rnd.failures, f"round {r}", folder.path, folder.temporary)
    rnd.feed()
    return rnd


def _say_align(say: Progress, r: int, rounds: int, n: int, done: int, name: str) -> None:
    say(UniverseEvent("align", r, rounds, done, n, name))


def iterate(run: Run, rounds: int, tol: float) -> tuple[RoundLog, dict[str, torch.Tensor]]:
    """Run the rounds (see the module's pseudo-code) on the prepared canonical models;
    return the log and the universe after the last round.

    A resumed run continues from the rounds it has done (their files are gone but for
    the last), even where these settings would have stopped earlier."""
    folder = run.folder
    log = RoundLog(*folder.read_state(), own=run.own_objective)
    if log.rounds:
        # what the finished rounds left: the last one's alignments (the outputs and the
        # next round's warm start) and the universe they made. Without the previous
        # round's elements a lost file cannot be recomputed alone: start over
        last = len(log.rounds)
        lost = folder.first_damage([folder.universe(last + 1), *(p for k in run.keys for p in
                                                                   (folder.aligned(last, k), folder.elements(last, k)))])
        if lost is not None:
            folder.restart_rounds(lost)
            log = RoundLog([], [], own=run.own_objective)
    if not log.rounds and folder.first_damage([folder.universe(1)]) is not None:
        save_tensors(folder.universe(1), load_tensors(folder.canonical(run.keys[run.start])))  # U <- θ_start
    merged: dict[str, torch.Tensor] | None = None
    eps = torch.finfo(run.dtype).eps
    zero = dict.fromkeys(run.params, torch.zeros((), dtype=torch.float64))
    while not log.stop(rounds, tol, eps):
        r = len(log.rounds) + 1
        tick = time.perf_counter()
        universe = load_tensors(folder.universe(r))
        rnd = align_all(run, r, rounds)  # g_i for every model
        merged = rnd.mean.mean(run.dtype)  # U <- mean_i g_i·θ_i
        delta = squared_distance(merged, universe, run.params)
        del universe
        save_tensors(folder.universe(r + 1), merged)
        floor = eps * run.n * squared_distance(merged, zero, run.params)
        log.add(r, run.names, rnd.results, delta, floor, time.perf_counter() - tick)
        folder.write_state(log.rounds, log.history)
        folder.drop_rounds_before(r)
        run.say(UniverseEvent("round", r, rounds, run.n, run.n, objective=log.history[-1], seconds=log.rounds[-1]["seconds"]))
    if merged is None:
        merged = load_tensors(folder.universe(len(log.rounds) + 1))
    return log, merged


__all__ = ["RoundLog", "Run", "align_all", "converged", "iterate"]
