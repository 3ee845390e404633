"""The extension points of :func:`symspec.align`: stages that extensions add around the
method, and the certifier behind :meth:`AlignResult.certify`.

``align()`` is a chain of stages (bind, check fit, canonicalise, restrict, run the method,
embed, transform, record: :mod:`.api`); an extension adds

- a **pre-stage** (:func:`register_pre_stage`), run before the pair is bound: it reads the
  request and may replace model B (the width lift, :mod:`symspec.width`, brings a narrower
  B into A's shape), and reports what it did in ``request.info`` (copied into the
  result's ``info`` and its record's ``meta``);
- a **post-stage** (:func:`register_post_stage`), run on the finished result, which it may
  replace (the lift's free directions trained for the path, :func:`symspec.width.learn_free`);
- the **certifier** (:func:`register_certifier`): lower bounds on a result's objective
  (:mod:`symspec.certify`).

Extensions register from their own packages (the entry-point group ``symspec.extensions``,
loaded by :mod:`.registry`), so this package imports none of them. A hook is a callable,
or ``"module:attribute"`` resolved on first use, so that registering one imports nothing
(listing the methods, as the CLI's help does, stays free of torch).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import attrs

from ..errors import SymspecInputError
from .protocol import Method

if TYPE_CHECKING:
    from .result import AlignResult

#: a hook: the callable, or where it lives (``"symspec.width.stages:lift_stage"``)
Hook = Callable[..., Any] | str


@attrs.define
class AlignRequest:
    """What :func:`symspec.align` was asked, as the stages see it. ``options``: the
    extensions' own arguments of ``align()`` (``lift``, ``lift_seed``, ``lift_free``,
    ``lift_free_lambda``); ``info``: what the pre-stages report; ``canonical_input``: B
    was written in canonical form by a pre-stage (a lift), so it is canonicalised even for
    a method on raw weights."""

    model_a: Any
    model_b: Any
    spec: Any
    method: Method
    data: Any = None
    validation: Any = None
    device: Any = "cpu"
    progress: Any = None
    options: dict[str, Any] = attrs.field(factory=dict)
    info: dict[str, Any] = attrs.field(factory=dict)
    canonical_input: bool = False


_PRE: dict[str, Hook] = {}
_POST: dict[str, Hook] = {}
_CERTIFIER: dict[str, Hook] = {}


def _register(table: dict[str, Hook], name: str, hook: Hook, replace: bool) -> Hook:
    if name in table and not replace and table[name] != hook:
        raise ValueError(f"an align() hook '{name}' is already registered (pass replace=True)")
    table[name] = hook
    return hook


def register_pre_stage(name: str, hook: Hook, *, replace: bool = False) -> Hook:
    """Run ``hook(request: AlignRequest) -> None`` before the pair is bound (in
    registration order)."""
    return _register(_PRE, name, hook, replace)


def register_post_stage(name: str, hook: Hook, *, replace: bool = False) -> Hook:
    """Run ``hook(result: AlignResult, request: AlignRequest) -> AlignResult`` on every
    finished result (in registration order)."""
    return _register(_POST, name, hook, replace)


def register_certifier(hook: Hook, *, replace: bool = False) -> Hook:
    """``hook(result, *, per_space, joint, joint_limit, gram_limit)``: what
    :meth:`AlignResult.certify` returns (None limits: the certifier's defaults)."""
    return _register(_CERTIFIER, "certifier", hook, replace)


def unregister(name: str) -> None:
    """Withdraw a stage (or ``"certifier"``): tests that add one clean up with this."""
    for table in (_PRE, _POST, _CERTIFIER):
        table.pop(name, None)


def resolve(hook: Hook) -> Callable[..., Any]:
    """The callable a hook names."""
    if callable(hook):
        return hook
    module, _, attr = hook.partition(":")
    return getattr(importlib.import_module(module), attr)  # type: ignore[no-any-return]


def run_pre_stages(request: AlignRequest) -> None:
    for hook in list(_PRE.values()):
        resolve(hook)(request)


def run_post_stages(result: AlignResult, request: AlignRequest) -> AlignResult:
    for hook in list(_POST.values()):
        result = resolve(hook)(result, request)
    return result


def certifier() -> Callable[..., Any]:
    """The registered certifier; a one-line error when none is (symspec.certify not installed)."""
    hook = _CERTIFIER.get("certifier")
    if hook is None:
        raise SymspecInputError("no certifier is registered: the symspec.certify extension is not installed")
    return resolve(hook)


__all__ = ["AlignRequest", "Hook", "certifier", "register_certifier", "register_post_stage", "register_pre_stage",
           "resolve", "run_post_stages", "run_pre_stages", "unregister"]
