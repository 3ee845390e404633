import os
import signal
from collections.abc import Generator

import pytest
import torch
from hypothesis import HealthCheck, settings

# pytester: tests/test_conftest.py runs small suites under this file's hooks
pytest_plugins = ["pytester"]

# The tests' tensors are tiny: one thread per process avoids oversubscription (CI runs
# two pytest workers on two cores).
torch.set_num_threads(1)

# A fast default profile for the suite; SYMSPEC_HYPOTHESIS=thorough runs many more examples.
settings.register_profile("fast", max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("thorough", max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile(os.environ.get("SYMSPEC_HYPOTHESIS", "fast"))

# A suite started in the background by a non-interactive shell inherits SIGINT ignored,
# and so would every command the Ctrl-C tests start: they test symspec's handling of an
# interrupt, which needs Python's own (what a terminal's Ctrl-C meets).
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)


#: the modules the optional extras install (pyproject.toml), and torchvision, which timm needs
OPTIONAL = frozenset({"timm", "torchvision", "transformers", "ray", "cvxpy", "tokenizers", "datasets", "gguf",
                      "accelerate", "sklearn"})


@pytest.hookimpl(wrapper=True)
def pytest_pyfunc_call(pyfuncitem: pytest.Function) -> Generator[None, object, object]:
    """A test that reaches for an optional package that is not installed (CI's fallback
    install has no timm) skips saying how to get it, instead of failing; a missing core
    module still fails."""
    try:
        return (yield)
    except ModuleNotFoundError as e:
        root = (e.name or "").partition(".")[0]
        if root not in OPTIONAL:
            raise
        from tests.needs import optional_missing

        optional_missing(root)
