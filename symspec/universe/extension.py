"""Registers universe matching with alignment (entry point ``symspec.extensions``): the
pair method ``universe`` (:mod:`.method`)."""

from ..alignment.registry import register_method
from .method import UniverseMatching

UNIVERSE = register_method(UniverseMatching())
