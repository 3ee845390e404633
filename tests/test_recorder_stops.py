"""The site recorder stops once the last site is recorded: a language model's logits
(batch x tokens x vocabulary, gigabytes for a 150k vocabulary) read by no site are never
computed, and the features recorded are the same."""

from __future__ import annotations

import pytest
import torch

from symspec.graph import SiteRecorder, read_sites
from symspec.graph.trace import call_args
from tests.test_activation import _family


@pytest.mark.parametrize("name", ["nanogpt", "llama"])
def test_nothing_after_the_last_site_runs(name: str) -> None:
    canon, inputs, bound = _family(name)
    state = canon.state_dict()
    head = next(k for k in state if k.endswith("head.weight"))
    rec = SiteRecorder(canon, bound.problem, select=read_sites)
    features = rec.record(inputs, state)
    assert features
    # an output head of the wrong shape fails any forward that computes the logits ...
    broken = {**state, head: torch.zeros(3, 5)}
    with pytest.raises(RuntimeError):
        args, kwargs = call_args(inputs)
        torch.func.functional_call(canon, broken, args, kwargs)
    # ... but not the recorder, which never reaches them, and its features are the same
    again = SiteRecorder(canon, bound.problem, select=read_sites).record(inputs, broken)
    assert set(again) == set(features)
    assert all(torch.equal(again[k], features[k]) for k in features)
