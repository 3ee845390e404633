"""Learned matching: the group element trained for the loss of the interpolated model
(:mod:`.method`: :class:`LearnedMatching` and its options; :mod:`.loop`: the training
loop and the model mixture it trains through, shared with universe refinement and free
directions) and the parametrisations it trains, one per group kind (:mod:`.parametrize`).
See docs/learned.md.

Importing this package does not import torch: the CLI lists methods cheaply.
"""

from .method import LAMBDA_SAMPLERS, LearnedMatching, LearnedOptions, lambda_sampler

__all__ = ["LAMBDA_SAMPLERS", "LearnedMatching", "LearnedOptions", "lambda_sampler"]
