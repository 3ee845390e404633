"""Learned matching: the group element trained for the loss of the interpolated model
(:mod:`.method`: :class:`LearnedMatching`, its options and the training loop) and the
parametrisations it trains, one per group kind (:mod:`.parametrize`). See docs/learned.md.

Importing this package does not import torch: the CLI lists methods cheaply.
"""

from .method import LAMBDA_SAMPLERS, LearnedMatching, LearnedOptions, lambda_sampler

__all__ = ["LAMBDA_SAMPLERS", "LearnedMatching", "LearnedOptions", "lambda_sampler"]
