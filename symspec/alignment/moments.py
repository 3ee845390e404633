"""The data-driven methods' work (:mod:`.activation` names them; this module runs them):
activation moments collected by running the model with A's and B's weights, solved by
:mod:`symspec.solvers.engine.activation_statistics`; token counts weighting the
embedding rows for ``weight-tokens``."""

from __future__ import annotations

import contextlib
import math
import os
import warnings
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import attrs
import torch
from torch.utils import _pytree as pytree

from ..checker import cast_inputs
from ..errors import SymspecInputError
from ..graph import SiteRecorder, read_sites
from ..groups import Experts, Heads
from ..problem import Problem, Site
from ..process import available_memory, reused_heap
from ..solvers import MatchEvent, Timer, WeightOptions, match_weights
from ..solvers.engine.activation_statistics import (
    ActivationMoments,
    activation_terms,
    combined_problem,
    head_ridges,
    mix_scale,
    weights_energy,
)
from ..solvers.engine.base import SolveContext
from ..solvers.engine.site_statistics import (
    CombinedStatistics,
    SiteStatistics,
    SiteStats,
    merge_site_stats,
    site_statistics_supported,
    site_stats,
    spill_blocks,
)
from ..solvers.engine.spill import SPILL_MIN_BYTES
from ..solvers.engine.weight_statistics import WeightStatistics
from ..statedict import working_dtype
from .activation import ActivationMatching, TokenWeightedMatching, options_of
from .protocol import Alignment, AlignOptions, Endpoint
from .stage_plan import STAGE_BYTES, _span, kept_bytes, open_spill, plan_stages

__all__ = ["SiteCollection", "align_activation", "align_token_weighted", "collect_moments", "collect_site_stats",
           "micro_batches", "plan_stages", "token_counts"]


def align_activation(method: ActivationMatching, problem: Problem, a: Endpoint, b: Endpoint,
                     options: AlignOptions) -> Alignment:
    """:meth:`ActivationMatching.align`: on the sites' statistics, collected in stages
    (:func:`collect_site_stats`), or -- where a site's factors do not allow that
    (:func:`~symspec.solvers.engine.site_statistics.site_statistics_supported`) -- on
    the moments factored into tensors."""
    opts = options_of(options.tuning)
    timer = options.timer or Timer()
    assert a.module is not None
    shared = opts.moments
    ref = next((t for t in a.state.values() if t.is_floating_point()), None)
    dtype = options.dtype or working_dtype(ref.dtype if ref is not None else torch.float32)
    key = ("sites", opts.batches, opts.sites, opts.normalize, dtype)
    if shared is not None and shared.get("key") == key:
        collection = shared["collection"]
    else:
        with timer("statistics"):
            collection = collect_site_stats(a.module, problem, a.state, b.state, options.data, batches=opts.batches,
                                            device=options.device, sites=opts.sites, normalize=opts.normalize,
                                            dtype=dtype, progress=options.progress, spill=opts.spill)
        if collection is not None and shared is not None:
            shared.update(key=key, collection=collection)
    if collection is not None:
        return _align_on_sites(method, problem, a, b, options, opts, collection, dtype, shared is None, timer)
    return _align_factored(method, problem, a, b, options, opts, timer)


def _align_factored(method: ActivationMatching, problem: Problem, a: Endpoint, b: Endpoint, options: AlignOptions,
                    opts: Any, timer: Timer) -> Alignment:
    """The first design: every site's moments in one pass, factored into bound tensors."""
    assert a.module is not None
    shared = opts.moments
    key = (opts.batches, opts.sites)
    if shared is not None and shared.get("key") == key:
        moments = shared["moments"]
    else:
        with timer("statistics"):
            moments = collect_moments(a.module, problem, a.state, b.state, options.data, batches=opts.batches,
                                      device=options.device, sites=opts.sites, progress=options.progress)
        if shared is not None:
            shared.update(key=key, moments=moments)
    described = moments.describe()
    release = shared is None  # each site's moments are let go as soon as it is factored, unless shared
    with timer("factor"):
        if method.combine:
            terms = combined_problem(problem, a.state, b.state, moments, mix=opts.mix, normalize=opts.normalize,
                                     release=release, progress=options.progress)
        else:
            dtype = options.dtype or next((t.dtype for t in a.state.values() if t.is_floating_point()), torch.float32)
            terms = activation_terms(problem, moments, normalize=opts.normalize, dtype=dtype, ridge=opts.ridge,
                                     release=release, progress=options.progress)
    res = match_weights(terms.problem, terms.sd_a, terms.sd_b, rounds=options.rounds, tol=options.tol,
                        device=options.device, dtype=options.dtype, init=options.init, progress=options.progress,
                        timer=timer, options=opts.solver)
    # the Gram-free sites' tensors count part of A's energy twice: the real objective is lower by that
    history = [h - terms.offset for h in res.history]
    return Alignment(res.elements, history, res.timings, res.converged, None,
                     _info(method, problem, moments.sites.values(), described, opts, "factored"))


def _info(method: ActivationMatching, problem: Problem, sites: Any, described: dict[str, Any],
          opts: Any, form: str) -> dict[str, Any]:
    sites = list(sites)
    seen = {s for site in sites for s in site.spaces()}
    info = {"statistics": described, "normalize": opts.normalize, "form": form,
            "spaces_without_sites": sorted(set(problem.spaces) - seen),
            "parts_without_sites": _parts_without_sites(problem, sites)}
    if method.combine:
        info["mix"] = opts.mix
    return info


@attrs.define
class SiteCollection:
    """The sites' statistics as :func:`collect_site_stats` leaves them: ``stats`` (alike
    sites added into one), ``energy`` (per space, B's mean energy per feature of each
    site: the ridge's scale), ``sites`` (every site found) and ``described`` (what was
    collected, and in how many stages)."""

    stats: list[SiteStats]
    energy: dict[str, list[float]]
    sites: tuple[Site, ...]
    described: dict[str, Any]


def _align_on_sites(method: ActivationMatching, problem: Problem, a: Endpoint, b: Endpoint, options: AlignOptions,
                    opts: Any, collection: SiteCollection, dtype: torch.dtype, own: bool, timer: Timer) -> Alignment:
    """The descent on the sites' statistics (and, combined, the weights' own), added.
    ``own``: the collection is this call's alone (scaled in place)."""
    stats = collection.stats
    with timer("factor"):
        if method.combine:
            s2 = mix_scale(opts.mix, weights_energy(problem, a.state, b.state), math.fsum(s.energy() for s in stats)) ** 2
            stats = [SiteStats(s.name, [blk.scaled(s2, in_place=own) for blk in s.blocks], s.names) for s in stats]
            weights_problem, sd_a, sd_b = problem, a.state, b.state
        else:
            ridges = head_ridges(problem, collection.energy, opts.ridge, dtype) if opts.ridge > 0 else []
            weights_problem = attrs.evolve(problem, params={r.name: r for r, _ in ridges}, ties=(), invariants=())
            sd_a = {r.name: t for r, t in ridges}
            sd_b = {r.name: t.clone() for r, t in ridges}
    solver = opts.solver or WeightOptions()
    # B given up by the caller (options.consume_b): its canonical tensors become the
    # weights' working copy, as in weight matching, instead of a copy beside them
    own_b = bool(options.consume_b and method.combine)
    solver = attrs.evolve(solver, own_b=False)  # match_weights' own provider is not used
    made: list[WeightStatistics] = []

    def factory(prob: Problem, ctx: SolveContext, init: Any) -> Any:
        sites = SiteStatistics(prob, stats, ctx, init)
        if not weights_problem.params:
            return sites
        made.append(WeightStatistics(weights_problem, sd_a, sd_b, ctx, init, own_b=own_b, trial_bytes=solver.trial_bytes))
        return CombinedStatistics(prob, [made[-1], sites])

    res = match_weights(problem, sd_a, sd_b, rounds=options.rounds, tol=options.tol, device=options.device,
                        dtype=dtype, init=options.init, progress=options.progress, timer=timer, options=solver,
                        provider=factory)
    aligned = made[-1].aligned() if own_b and made else None
    return Alignment(res.elements, res.history, res.timings, res.converged, aligned,
                     _info(method, problem, collection.sites, collection.described, opts, "sites"))


def align_token_weighted(method: TokenWeightedMatching, problem: Problem, a: Endpoint, b: Endpoint,
                         options: AlignOptions) -> Alignment:
    """:meth:`TokenWeightedMatching.align`."""
    opts = options_of(options.tuning, batches=None)
    tables = _embeddings(a.module, problem)
    if not tables:  # an image model, say: nothing to weight, plain weight matching
        warnings.warn(f"weight-tokens: {type(a.module).__name__} has no token embedding bound by the spec; "
                      "the rows are not weighted (plain weight matching)", stacklevel=3)
        res = match_weights(problem, a.state, b.state, rounds=options.rounds, tol=options.tol,
                            device=options.device, dtype=options.dtype, init=options.init,
                            progress=options.progress, timer=options.timer, options=opts.solver)
        return Alignment(res.elements, res.history, res.timings, res.converged, None, {"token_weights": None})
    vocab = max(tables.values())
    counts = token_counts(options.data, vocab, opts.batches)
    if float(counts.sum()) == 0:
        raise SymspecInputError(f"the data has no token ids below the vocabulary size {vocab}")
    w = (counts + 1) / (counts + 1).mean()
    root = w.sqrt()
    sa, sb = _row_weighted(problem, a.state, vocab, root), _row_weighted(problem, b.state, vocab, root)
    res = match_weights(problem, sa, sb, rounds=options.rounds, tol=options.tol, device=options.device,
                        dtype=options.dtype, init=options.init, progress=options.progress, timer=options.timer,
                        options=opts.solver)
    seen = int((counts > 0).sum())
    info = {"token_weights": {"vocab": vocab, "tokens": int(counts.sum()), "distinct": seen,
                              "max_weight": float(w.max()), "min_weight": float(w.min())}}
    return Alignment(res.elements, res.history, res.timings, res.converged, None, info)


def _batches(data: Any, limit: int | None) -> list[tuple[Any, Any]]:
    batches = getattr(data, "batches", None)
    if not batches:
        raise SymspecInputError("the data has no batches to align on")
    return list(batches[:limit] if limit is not None else batches)


#: at most this many bytes of the widest site's features per micro-batch (a batch is
#: recorded a few whole samples at a time: the activations stay small enough for the
#: heap to reuse, :func:`~symspec.process.reused_heap`, and one model's features of a
#: micro-batch, not of the whole batch, wait for the other's)
MICRO_BYTES = 8 << 20


def collect_moments(module: torch.nn.Module, problem: Problem, state_a: Mapping[str, torch.Tensor],
                    state_b: Mapping[str, torch.Tensor], data: Any, *, batches: int | None = None,
                    device: torch.device | str = "cpu", sites: str = "read",
                    progress: Callable[[MatchEvent], None] | None = None,
                    micro_bytes: int = MICRO_BYTES) -> ActivationMoments:
    """Run ``module`` with A's and with B's weights over the data's batches and
    accumulate the moments of the activation sites of ``problem`` (``sites="all"``: every
    one; ``"read"``: one per chain of elementwise functions, :func:`~symspec.graph.read_sites`),
    only the blocks and Grams their spaces read (:meth:`SiteMoments.for_site`). Each
    batch runs in micro-batches of whole samples (:func:`micro_batches`: the moments are
    sums over tokens, and in eval mode a sample's features do not depend on the others);
    per micro-batch, A's features are kept and B's are added to the moments site by site
    as B computes them, A's copy dropped right after: one model's features of one
    micro-batch are held, never both. ``progress``: a ``MatchEvent("statistics", batch,
    batches, space="A" or "B", done, total)`` before each model's pass over each
    micro-batch (``done`` passes of ``total`` finished)."""
    say = progress or (lambda event: None)
    with _statistics_pass(module, problem, data, batches, sites, micro_bytes) as run:
        # the sites are known from the trace: refuse before the first forward pass
        refuse_beyond_memory(ActivationMoments.empty(run.found, "meta", problem), type(module).__name__,
                             features=_feature_bytes(run.found, run.pieces[0][0], run.dtype))
        moments = ActivationMoments.empty(run.found, device, problem)
        total, done = 2 * sum(len(p) for p in run.pieces), 0
        for i, micro in enumerate(run.pieces):
            for part in micro:
                say(MatchEvent("statistics", i + 1, len(run.todo), space="A", done=done, total=total))
                fa = run.recorder.record(part, state_a)
                say(MatchEvent("statistics", i + 1, len(run.todo), space="B", done=done + 1, total=total))
                run.recorder.record(part, state_b, sink=_streamed(moments, fa))
                done += 2
                del fa
            moments.end_batch()
        moments.end_batches()
    return moments


@attrs.frozen
class _Pass:
    """What a statistics pass runs on: the recorder, the module's dtype, the batches
    (cast to it), each in micro-batches, and the sites found in the trace."""

    recorder: SiteRecorder
    dtype: torch.dtype
    todo: list[Any]
    pieces: list[list[Any]]
    found: tuple[Site, ...]


@contextlib.contextmanager
def _statistics_pass(module: torch.nn.Module, problem: Problem, data: Any, batches: int | None, sites: str,
                     micro_bytes: int) -> Iterator[_Pass]:
    """The set-up both passes share: the module in eval mode (features must be functions
    of the inputs: no dropout) and the heap kept for reuse (:func:`~symspec.process.reused_heap`)
    while the block runs, both restored after; the batches in micro-batches and the sites
    of the trace (none is an error)."""
    recorder = SiteRecorder(module, problem, select=read_sites if sites == "read" else None)
    dtype = next((p.dtype for p in module.parameters() if p.is_floating_point()), torch.float32)
    training = module.training
    module.eval()
    try:
        todo = [cast_inputs(inputs, dtype) for inputs, _ in _batches(data, batches)]
        with reused_heap():
            width = max((pb.shape[ab.axis] for pb in problem.params.values() for ab in pb.axes), default=1)
            pieces = [micro_batches(inputs, width, dtype, micro_bytes) for inputs in todo]
            found = recorder.prepare(pieces[0][0])
            if not found:
                raise SymspecInputError(f"no activation site found in {type(module).__name__} for the spec's spaces")
            yield _Pass(recorder, dtype, todo, pieces, found)
    finally:
        module.train(training)


def collect_site_stats(module: torch.nn.Module, problem: Problem, state_a: Mapping[str, torch.Tensor],
                       state_b: Mapping[str, torch.Tensor], data: Any, *, batches: int | None = None,
                       device: torch.device | str = "cpu", sites: str = "read", normalize: str = "correlation",
                       dtype: torch.dtype = torch.float32, progress: Callable[[MatchEvent], None] | None = None,
                       micro_bytes: int = MICRO_BYTES, available: int | None = None,
                       stage_bytes: int = STAGE_BYTES, spill: bool | str | os.PathLike[str] = True,
                       spill_min: int | None = None) -> SiteCollection | None:
    """The sites' statistics (:class:`~symspec.solvers.engine.site_statistics.SiteStats`,
    per token, in ``dtype``), or None where a site's factors need the factored form
    (:func:`collect_moments`).

    The pass is split into *stages* along the graph (:func:`plan_stages`): the sites are
    taken in the order the model computes them, as many per stage as the memory free
    holds of their float64 moments and float32 accumulators (beside the statistics of
    the stages done), and at most ``stage_bytes`` (:data:`STAGE_BYTES`); each stage runs
    its span of the graph over every micro-batch, A's and B's, from the values the span
    before left (a residual stream, kept per micro-batch), so every node still runs once per micro-batch and model. At the end of
    a stage its sites' moments become statistics in ``dtype`` (alike sites added into
    one) and are let go; their blocks of ``spill_min`` bytes (default
    :data:`~symspec.solvers.engine.spill.SPILL_MIN_BYTES`) or more are written to disk
    (``spill``: :class:`~.activation.ActivationOptions`), read back as the descent
    solves a space over them. ``available``: the bytes free to plan with (default: what
    the machine has free)."""
    say = progress or (lambda event: None)
    spill_min = SPILL_MIN_BYTES if spill_min is None else spill_min
    with _statistics_pass(module, problem, data, batches, sites, micro_bytes) as run:
        found, pieces, recorder = run.found, run.pieces, run.recorder
        if not site_statistics_supported(problem, found):
            return None
        planned = ActivationMoments.empty(found, "meta", problem)
        features = _feature_bytes(found, pieces[0][0], run.dtype)
        store = open_spill(spill, kept_bytes(found, planned, dtype, spill_min)[1])
        stages = plan_stages(found, planned, recorder.order(pieces[0][0]), dtype, type(module).__name__,
                             available=available if available is not None else available_memory(),
                             features=features, stage_bytes=stage_bytes,
                             spill_min=spill_min if store is not None else None)
        by_name = {s.name: s for s in found}
        env_a: list[list[Any]] = [[None] * len(p) for p in pieces]
        env_b: list[list[Any]] = [[None] * len(p) for p in pieces]
        stats: list[SiteStats] = []
        energy: dict[str, list[float]] = {}
        total, done = 2 * len(stages) * sum(len(p) for p in pieces), 0
        peak = 0
        for k, names in enumerate(stages):
            moments = ActivationMoments.empty([by_name[n] for n in names], device, problem)
            peak = max(peak, moments.bytes)
            last = k == len(stages) - 1
            for i, micro in enumerate(pieces):
                for j, part in enumerate(micro):
                    lo, hi = _span(recorder.order(part), stages, k)
                    fa: dict[str, torch.Tensor] = {}
                    say(MatchEvent("statistics", i + 1, len(run.todo), space="A", done=done, total=total))
                    env = recorder.record_span(part, state_a, env_a[i][j], lo, hi, sink=_kept(fa, moments))
                    env_a[i][j] = None if last else env
                    say(MatchEvent("statistics", i + 1, len(run.todo), space="B", done=done + 1, total=total))
                    env = recorder.record_span(part, state_b, env_b[i][j], lo, hi, sink=_streamed(moments, fa))
                    env_b[i][j] = None if last else env
                    done += 2
                    del fa, env
                moments.end_batch()
            moments.end_batches()
            new, e = site_stats(problem, moments, normalize=normalize, dtype=dtype, release=True, progress=progress)
            for space, xs in e.items():
                energy.setdefault(space, []).extend(xs)
            stats = merge_site_stats([*stats, *new])
            if store is not None:
                spill_blocks(stats, store, spill_min)
            del moments, new
    described = {"sites": len(found), "features": sum(s.size for s in found), "batches": len(run.todo),
                 "tokens": _tokens(run.todo), "bytes": planned.bytes, "stage_bytes": peak, "stages": len(stages),
                 "blocks": sum(len(m.gram) for m in planned.moments.values()),
                 "gram_blocks": sum(1 for m in planned.moments.values() for g in m.gram if g is not None),
                 "merged_sites": len(stats), "statistics_bytes": sum(s.bytes + s.disk_bytes for s in stats),
                 "spilled_bytes": sum(s.disk_bytes for s in stats),
                 "spill_folder": store.parent if store is not None else None}
    return SiteCollection(stats, energy, found, described)


def _kept(fa: dict[str, torch.Tensor], moments: ActivationMoments) -> Callable[[str, torch.Tensor], None]:
    """A sink for A's features: those of the stage's sites are kept until B's arrive."""

    def sink(name: str, xa: torch.Tensor) -> None:
        if name in moments.moments:
            fa[name] = xa

    return sink


def _tokens(todo: list[Any]) -> int:
    ids = [_token_ids(x) for x in todo]
    return sum(int(t.numel()) for t in ids if t is not None)


def micro_batches(inputs: Any, width: int, dtype: torch.dtype, limit: int = MICRO_BYTES) -> list[Any]:
    """``inputs`` split along the batch axis into equal micro-batches of whole samples, the
    largest in which ``width`` features per token (the widest bound axis: no site is
    wider) hold at most ``limit`` bytes, never less than one sample (equal sizes, a
    divisor of the batch: one trace serves them all). Inputs that do not say their batch
    axis are one piece: no tensor, tensors of different first sizes, or one of fewer than
    two axes (an unbatched sequence: its first axis is its tokens, which attend to each
    other)."""
    leaves, spec = pytree.tree_flatten(inputs)
    tensors = [x for x in leaves if isinstance(x, torch.Tensor)]
    if not tensors or any(x.ndim < 2 for x in tensors) or len({x.shape[0] for x in tensors}) != 1:
        return [inputs]
    n = tensors[0].shape[0]
    ids = _token_ids(inputs)
    rows = max(1, ids.numel() // n) if ids is not None else 1
    cap = max(1, limit // (rows * width * torch.empty((), dtype=dtype).element_size()))
    per = max(d for d in range(1, min(cap, n) + 1) if n % d == 0)
    if per == n:
        return [inputs]
    return [pytree.tree_unflatten([x[j:j + per] if isinstance(x, torch.Tensor) else x for x in leaves], spec)
            for j in range(0, n, per)]


def refuse_beyond_memory(planned: ActivationMoments, model: str, available: int | None = None,
                         features: int = 0) -> None:
    """Refuse statistics whose float64 moments, and their factors after them (about as
    much again), with one model's features of a batch (``features`` bytes) beside them,
    would not fit in the memory this machine has free: the process was killed without a
    word instead (Qwen2-0.5B: 4864 x 4864 blocks for every layer at once). ``planned``:
    the moments, allocated on the meta device. Called before the first forward pass."""
    free = available if available is not None else available_memory()
    need = 2 * planned.bytes + features
    if free is not None and need > free:
        held = f", and one batch's features of {features / 1e9:.2g} GB" if features else ""
        raise SymspecInputError(
            f"activation statistics of {model} need about {need / 1e9:.1f} GB ({len(planned.moments)} sites' float64 "
            f"moments and their factors{held}), more than the {free / 1e9:.1f} GB this machine has free; align "
            "with --method weight (data-free), or on a machine with more memory")


def _feature_bytes(sites: tuple[Any, ...], inputs: Any, dtype: torch.dtype) -> int:
    """What one model's features of the batch ``inputs`` will hold (A's, kept until B's
    arrive), where the batch says how many tokens it has: token ids (an integer tensor,
    or ``input_ids``), one feature row per id. 0 where it does not say (images)."""
    ids = _token_ids(inputs)
    if ids is None:
        return 0
    itemsize = torch.empty((), dtype=dtype).element_size()
    return ids.numel() * sum(s.size for s in sites) * itemsize


def _token_ids(inputs: Any) -> torch.Tensor | None:
    """The batch's token ids (an integer tensor, or ``input_ids``, or the first of a
    tuple), None where it has none (images)."""
    ids = inputs.get("input_ids") if isinstance(inputs, Mapping) else inputs
    if isinstance(ids, (tuple, list)) and ids:
        ids = ids[0]
    if not isinstance(ids, torch.Tensor) or ids.is_floating_point() or ids.dtype == torch.bool:
        return None
    return ids


def _streamed(moments: ActivationMoments, fa: dict[str, torch.Tensor]) -> Any:
    """A sink for B's features: each site's moments take them with A's, whose copy goes."""

    def sink(name: str, xb: torch.Tensor) -> None:
        xa = fa.pop(name, None)
        if xa is not None:
            moments.update_site(name, xa, xb)

    return sink


def _parts_without_sites(problem: Problem, sites: Any) -> list[str]:
    """Parts of head and expert groups that no site shows although their space has one
    (a mixture of experts: the router's logits show the expert permutation, nothing shows
    each expert's units, whose elements then stay where they started)."""
    paths: dict[str, set[tuple[str, ...]]] = {}
    for site in sites:
        for seg in site.axis.segments:
            for f in seg.factors:
                paths.setdefault(f.space, set()).add(f.path)
    out = []
    for space, seen in sorted(paths.items()):
        group = problem.spaces[space].group
        if not isinstance(group, Heads):
            continue
        for name, _ in group.parts:
            shown = any(p[:1] == (name,) for p in seen) if name else any(not p or p == ("kv",) for p in seen)
            if not shown:
                label = name or ("each expert's units" if isinstance(group, Experts) else "the within-head maps")
                out.append(f"{space}: {label}")
    return out


def _embeddings(module: torch.nn.Module | None, problem: Problem) -> dict[str, int]:
    """Bound embedding tables of ``module``: parameter name -> vocabulary size."""
    if module is None:
        return {}
    return {f"{n}.weight": m.num_embeddings for n, m in module.named_modules()
            if isinstance(m, torch.nn.Embedding) and f"{n}.weight" in problem.params}


def token_counts(data: Any, vocab: int, batches: int | None = None) -> torch.Tensor:
    """How often each token id occurs in the data's inputs (integer tensors: ids)."""
    counts = torch.zeros(vocab, dtype=torch.float64)

    def add(x: Any) -> None:
        if isinstance(x, torch.Tensor) and not x.is_floating_point() and x.dtype != torch.bool and x.numel():
            ids = x.reshape(-1).long().cpu()
            if int(ids.min()) < 0 or int(ids.max()) >= vocab:
                return  # not token ids (a mask, positions beyond the table)
            counts.add_(torch.bincount(ids, minlength=vocab).double())
        elif isinstance(x, Mapping):
            if "input_ids" in x:
                add(x["input_ids"])
            else:
                for v in x.values():
                    add(v)
        elif isinstance(x, (tuple, list)):
            for v in x:
                add(v)

    for inputs, _ in _batches(data, batches):
        add(inputs)
    return counts


def _row_weighted(problem: Problem, state: Mapping[str, torch.Tensor], vocab: int,
                  root: torch.Tensor) -> dict[str, torch.Tensor]:
    """``state`` with every bound parameter's unbound axis of size ``vocab`` scaled by
    ``root`` (the embedding and the unembedding)."""

    out = dict(state)
    for name, pb in problem.params.items():
        bound = {ab.axis for ab in pb.axes}
        for axis, n in enumerate(pb.shape):
            if n == vocab and axis not in bound:
                shape = [1] * len(pb.shape)
                shape[axis] = n
                t = out[name]
                out[name] = t * root.to(t.device, t.dtype).reshape(shape)
    return out


