"""Registers learned matching with alignment (entry point ``symspec.extensions``):
``learned``, and ``learned-perm``: the same over the permutations only, learned with a
straight-through estimator (the paper's ablation)."""

from ..alignment.registry import register_method
from .method import LearnedMatching

LEARNED = register_method(LearnedMatching())
LEARNED_PERM = register_method(LearnedMatching(name="learned-perm", label="learned matching, permutations only",
                                               groups="perm", permutations="ste"))
