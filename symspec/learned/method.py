"""Learned matching: the group element trained for the loss of the interpolated model.

The paper's Algorithm 1 (DESIGN §7), as a method of the registry, for any spec:

    minimise over g:  E_{lambda, batch} L( f( (1 - lambda) A + lambda g.B ; batch ) )

with A and B in canonical form and ``g`` one element per space, parametrised so that
every iterate is an element of the space's group (:mod:`symspec.learned.parametrize`),
started at weight matching's solution (or at ``options.init``). The model is evaluated
with ``torch.func.functional_call`` on one module instance (A's class in canonical form)
holding the interpolated tensors, so the path is one of the architecture's own models
(the paper's code widens every head and replaces LayerNorm to interpolate).

- lambda from a sampler: ``narrow`` (U(0.4, 0.6), the paper's and the default),
  ``uniform`` (U(0, 1)), ``fixed:X``;
- AdamW on the latents, linear warm-up then cosine decay; ``steps`` or ``epochs`` over
  the train split, in batches of ``batch_size`` examples (the data's own by default);
- every ``eval_every`` steps the loss at the midpoint (lambda = 0.5) on the validation
  split (``options.validation``; without one the last tenth of the train examples is
  held out), with the element projected exactly onto its group; the best element seen
  (weight matching's included) is the result;
- deterministic given ``seed`` (batch order and lambdas from one generator);
- at the end, aligned B must compute B's function on a few examples (float64, relative
  tolerance 1e-9 scaled by the worst condition number reached): a failure raises, it is
  never returned. The check is in ``info["check"]``.

The training loop and its model mixture are :mod:`.loop`; this module (the method and
its options) imports neither torch nor the solvers, so that listing the methods (the
CLI's help) stays light.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import attrs

from ..alignment.protocol import Alignment, AlignOptions, Endpoint
from ..errors import SymspecInputError

if TYPE_CHECKING:
    from ..problem import Problem

__all__ = ["LAMBDA_SAMPLERS", "LearnedMatching", "LearnedOptions", "lambda_sampler"]

LAMBDA_SAMPLERS = ("narrow", "uniform", "fixed:X")
#: the kinds of latents a learning-rate factor can be given to (LearnedOptions.lr_scale)
LR_KINDS = ("orthogonal", "linear", "diagonal", "rotary", "permutation")


def lambda_sampler(text: str) -> tuple[float, float]:
    """The interval lambda is drawn from: ``narrow`` (0.4, 0.6), ``uniform`` (0, 1),
    ``fixed:X`` (X, X).

    >>> lambda_sampler("narrow"), lambda_sampler("fixed:0.5")
    ((0.4, 0.6), (0.5, 0.5))
    """
    t = text.strip().lower()
    if t == "narrow":
        return 0.4, 0.6
    if t == "uniform":
        return 0.0, 1.0
    if t.startswith("fixed:"):
        try:
            x = float(t.split(":", 1)[1])
        except ValueError:
            x = math.nan
        if not 0.0 <= x <= 1.0:  # also refuses NaN
            raise SymspecInputError(f"--lambda {text}: fixed:X needs a number X in [0, 1]")
        return x, x
    raise SymspecInputError(f"--lambda {text}: use narrow, uniform or fixed:X")


@attrs.frozen
class LearnedOptions:
    """Knobs of learned matching (see the module). ``steps``/``epochs``: the length of the
    run (``steps`` wins; neither: 500 steps). ``lr``: AdamW's peak learning rate (the
    latents are angles and log-scales, so the rate is in their units);
    ``warmup``: the fraction of steps of linear warm-up; ``weight_decay`` on the latents
    (toward the start). ``batch_size``: examples per step (None: the data's batches).
    ``lam``: the lambda sampler. ``permutations``: ``frozen``, ``ste`` or ``sinkhorn``;
    ``orthogonal``: ``exp`` or ``polar``. ``eval_every``: steps between validations;
    ``val_batches``: at most this many validation batches per validation. ``seed``.
    ``check_examples``: examples of the final function check. ``dirichlet``: the
    concentration alpha of the merging weights in universe refinement (Dirichlet(alpha 1),
    the paper's 0.1). ``solver``: weight matching's knobs for the start
    (:class:`~symspec.solvers.WeightOptions`). ``init``: the registered method whose
    element the run starts from (``weight``, the default; ``auto``: the candidate with
    the lowest midpoint loss; any closed-form method), unless the caller gives a start.
    ``lr_scale``: per kind of latent, a factor of ``lr`` (``(("orthogonal", 3.0),
    ("linear", 0.3))``; kinds: orthogonal, linear, diagonal, rotary, permutation), since
    the residual's rotation and the per-head GL maps move at different scales.
    ``micro_batch``: examples per forward pass (None: the step's whole batch): a step's
    batch is run in pieces whose gradients add up to the whole batch's (activations of
    one piece held at a time: a batch that does not fit). ``autocast``: ``bfloat16`` or
    ``float16`` runs the training forward passes under :func:`torch.autocast` (the
    latents, the elements and their action on the weights stay float32, validation and
    the function check full precision; on a CPU without bfloat16 units it is slower).
    ``average``: a decay beta in (0, 1) keeps an exponential moving average of the
    latents (``avg <- beta avg + (1 - beta) latents`` after every step), validated beside
    the iterate at every validation; the better of the two is a candidate for the
    result (None: no average). ``path_points``: the lambdas (merging weights) drawn per
    step, the loss their mean: the path's loss rather than one point's."""

    steps: int | None = None
    epochs: float | None = None
    lr: float = 1e-2
    warmup: float = 0.05
    weight_decay: float = 0.0
    batch_size: int | None = None
    lam: str = "narrow"
    permutations: str = "frozen"
    orthogonal: str = "exp"
    eval_every: int = 50
    val_batches: int | None = 8
    seed: int = 0
    check_examples: int = 8
    dirichlet: float = 0.1
    solver: Any = None
    init: str = "weight"
    lr_scale: tuple[tuple[str, float], ...] = ()
    micro_batch: int | None = None
    autocast: str | None = None
    average: float | None = None
    path_points: int = 1

    def __attrs_post_init__(self) -> None:
        from .parametrize import ORTHOGONAL, PERMUTATIONS  # optional: torch (CLI help stays light)

        lambda_sampler(self.lam)
        if self.steps is not None and self.steps < 1:
            raise SymspecInputError(f"steps must be at least 1, got {self.steps}")
        if self.epochs is not None and not self.epochs > 0:
            raise SymspecInputError(f"epochs must be positive, got {self.epochs}")
        if not (self.lr > 0 and math.isfinite(self.lr)):
            raise SymspecInputError(f"lr must be a positive number, got {self.lr}")
        if not 0 <= self.warmup < 1:
            raise SymspecInputError(f"warmup is a fraction of the steps in [0, 1), got {self.warmup}")
        if self.batch_size is not None and self.batch_size < 1:
            raise SymspecInputError(f"batch size must be at least 1, got {self.batch_size}")
        if self.micro_batch is not None and self.micro_batch < 1:
            raise SymspecInputError(f"micro-batch must be at least 1 example, got {self.micro_batch}")
        if self.autocast not in (None, "bfloat16", "float16"):
            raise SymspecInputError(f"autocast: bfloat16 or float16, got {self.autocast!r}")
        if self.average is not None and not 0 < self.average < 1:
            raise SymspecInputError(f"average: the decay of the moving average is in (0, 1), got {self.average}")
        if self.path_points < 1:
            raise SymspecInputError(f"path points: at least 1 lambda per step, got {self.path_points}")
        if not (self.dirichlet > 0 and math.isfinite(self.dirichlet)):
            raise SymspecInputError(f"the Dirichlet concentration must be a positive number, got {self.dirichlet}")
        if self.eval_every < 1:
            raise SymspecInputError(f"eval_every must be at least 1, got {self.eval_every}")
        if self.permutations not in PERMUTATIONS:
            raise SymspecInputError(f"permutations: use {', '.join(PERMUTATIONS)}, got {self.permutations!r}")
        if self.orthogonal not in ORTHOGONAL:
            raise SymspecInputError(f"orthogonal: use {', '.join(ORTHOGONAL)}, got {self.orthogonal!r}")
        for kind, factor in self.lr_scale:
            if kind not in LR_KINDS:
                raise SymspecInputError(f"lr_scale: unknown kind {kind!r}; kinds: {', '.join(LR_KINDS)}")
            if not (factor > 0 and math.isfinite(factor)):
                raise SymspecInputError(f"lr_scale: the factor of {kind} must be a positive number, got {factor}")
        if self.init != "weight":
            from ..alignment import get_method  # deferred: the registry loads this extension

            start = get_method(self.init)  # an unknown name: the registry's one-line error
            if isinstance(start, LearnedMatching) or not start.canonical:
                raise SymspecInputError(f"--init {self.init}: learned matching starts from a closed-form alignment "
                                        "(weight, auto, weight-tokens, activation, weight+activation, ...)")


def as_options(tuning: Any, permutations: str) -> LearnedOptions:
    """``tuning`` as :class:`LearnedOptions`: itself, or weight matching's knobs alone
    (None: the defaults), with the method's own default ``permutations``."""
    if isinstance(tuning, LearnedOptions):
        return tuning
    return LearnedOptions(solver=tuning, permutations=permutations)


@attrs.frozen
class LearnedMatching:
    """Learned matching (see the module). ``options.tuning``: a :class:`LearnedOptions`
    (None: its defaults, with ``permutations`` as the method says)."""

    name: str = "learned"
    label: str = "learned matching"
    canonical: bool = True
    needs_data: bool = True
    needs_module: bool = True
    groups: str | None = None
    #: picks its result on held-out data (``options.validation``)
    validates: bool = True
    #: how permutations are learned when the options do not say
    permutations: str = "frozen"

    def align(self, problem: Problem, a: Endpoint, b: Endpoint, options: AlignOptions) -> Alignment:
        from .loop import align_pair  # optional: torch (CLI help stays light)

        return align_pair(problem, a, b, options, as_options(options.tuning, self.permutations))
