"""Registers the certificates with alignment (entry point ``symspec.extensions``):
:meth:`symspec.alignment.AlignResult.certify` runs :func:`.aligned.certify_result`
(resolved on first use: registering imports neither torch nor cvxpy)."""

from ..alignment.hooks import register_certifier

register_certifier("symspec.certify.aligned:certify_result")
