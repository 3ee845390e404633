"""Registers width with alignment (entry point ``symspec.extensions``): the lift of a
narrower B as a stage before the pair is bound, the lift's free directions as a stage
after the alignment (:mod:`.stages`, resolved on first use: registering imports no torch)."""

from ..alignment.hooks import register_post_stage, register_pre_stage

register_pre_stage("width-lift", "symspec.width.stages:lift_stage")
register_post_stage("lift-free", "symspec.width.stages:free_stage")
