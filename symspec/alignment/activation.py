"""Data-driven alignment methods built on the weights' solvers.

- ``activation``: activation matching (:mod:`symspec.solvers.engine.activation_statistics`):
  both models run over the same batches, the second moments of their features at every
  activation site are accumulated, and each space is solved from them;
- ``weight+activation``: the weights' terms and the activation terms in one objective;
- ``weight-tokens``: weight matching whose embedding and unembedding rows are weighted
  by how often each token occurs in the data (rare tokens' rows, barely trained, count
  for little).

All three read ``options.data`` (evaluation data, its train split: an object with
``batches``, a list of ``(inputs, targets)``) and, for the first two, run the models:
``a.module`` in canonical form, with A's and B's canonical weights in turn. This module
only names them (it is imported when methods are listed, without torch); their work is
in :mod:`.moments`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import attrs

from .protocol import Alignment, AlignOptions, Endpoint

if TYPE_CHECKING:
    from ..problem import Problem

__all__ = ["ActivationMatching", "ActivationOptions", "TokenWeightedMatching", "options_of"]


@attrs.frozen
class ActivationOptions:
    """Knobs of the data-driven methods. ``batches``: at most this many batches of the
    data are read (None: all). ``normalize``: ``correlation`` standardises the sites of
    permutation-only spaces (Git Re-Basin's correlation matching), ``none`` uses raw
    second moments everywhere. ``sites``: ``read`` (default) records one site per chain of
    elementwise functions (what the next layer reads), ``all`` every site. ``mix``: in
    ``weight+activation``, the activation terms' energy relative to the weights'.
    ``ridge``: in ``activation``, a ridge toward the identity on the per-head maps that
    are not orthogonal, relative to the sites' energy
    (:func:`~symspec.solvers.engine.activation_statistics.head_ridges`; 0: none, which exact
    recovery of a planted element needs). ``solver``: the descent's knobs (:class:`~symspec.solvers.WeightOptions`).
    ``moments``: a dict shared by the methods that read the same statistics (``auto``
    gives one to ``activation`` and ``weight+activation``): the first collects them into
    it, the next reuses them, and none lets them go while factoring (None: collected and
    released as factored). ``spill``: where the statistics' large blocks (16 MiB or more
    each) wait for the descent: ``True`` a private folder under the system's temporary
    folder (``TMPDIR``), where it has room for them (else in memory, with a warning);
    a folder's path, there (an error where it cannot hold them); ``False`` in memory
    (:mod:`symspec.solvers.engine.spill`)."""

    batches: int | None = 32
    normalize: str = "correlation"
    sites: str = "read"
    mix: float = 1.0
    ridge: float = 1e-3
    solver: Any = None
    moments: dict[str, Any] | None = None
    spill: bool | str = True


def options_of(tuning: Any, **defaults: Any) -> ActivationOptions:
    """``tuning`` as :class:`ActivationOptions`: itself, or the solver's knobs alone (a
    :class:`~symspec.solvers.WeightOptions`, what universe matching passes every method)."""
    if isinstance(tuning, ActivationOptions):
        return tuning
    return ActivationOptions(**defaults, solver=tuning)


@attrs.frozen
class ActivationMatching:
    """Activation matching (``combine=False``) or weight plus activation matching
    (``combine=True``): see the module and :mod:`symspec.solvers.engine.activation_statistics`.
    ``options.tuning``: an :class:`ActivationOptions`."""

    name: str = "activation"
    label: str = "activation matching"
    combine: bool = False
    canonical: bool = True
    needs_data: bool = True
    needs_module: bool = True
    groups: str | None = None
    #: ``auto`` tries it
    candidate: bool = True

    def align(self, problem: Problem, a: Endpoint, b: Endpoint, options: AlignOptions) -> Alignment:
        # deferred: this module is imported when methods are listed (the CLI's help), without torch
        from .moments import align_activation

        return align_activation(self, problem, a, b, options)


@attrs.frozen
class TokenWeightedMatching:
    """Weight matching with the rows of the embedding and the unembedding weighted by the
    data's token frequencies (``(count + 1) / mean(count + 1)``, so the weights' total is
    unchanged). The objective is only reweighted: the element still acts on B as it is."""

    name: str = "weight-tokens"
    label: str = "weight matching, token-weighted embeddings"
    canonical: bool = True
    needs_data: bool = True
    needs_module: bool = True
    groups: str | None = None
    #: ``auto`` tries it
    candidate: bool = True

    def align(self, problem: Problem, a: Endpoint, b: Endpoint, options: AlignOptions) -> Alignment:
        # deferred: this module is imported when methods are listed (the CLI's help), without torch
        from .moments import align_token_weighted

        return align_token_weighted(self, problem, a, b, options)
