"""A generation audit's request is built once: checked, wrapped and planned, then run as it is."""

from __future__ import annotations

import pytest

from spectr_audit.errors import InvalidArgument
from spectr_audit.generation import audit_generation
from spectr_audit.generation.audit import run_request
from spectr_audit.generation.library import ToyPair, correct_engine
from spectr_audit.generation.request import GenerationRequest

PAIR = ToyPair(12, seed=0)
PROMPTS = [[1, 2, 3], [4, 5]]
OPTIONS = dict(max_new_tokens=6, batch_size=2, rounds=1, arms=("single", "repeated"), seed=5, alpha=0.01, power=0.9,
               min_detectable_tv=0.3, orderings=None, position_buckets=(4,), zero_mass_tol=0.0, logit_tol=1e-3,
               max_tokens=None, max_seconds=None, timeout=None, eos_token_id=None)


def _request(**changes) -> GenerationRequest:
    return GenerationRequest.build(correct_engine(PAIR), PAIR.scorer(), PROMPTS, vocab_size=12,
                                   draft_score=PAIR.draft_scorer(), **{**OPTIONS, **changes})


def test_a_request_holds_what_the_audit_runs():
    request = _request()
    assert request.options.orderings == ("probability", "ratio", "token-id")  # a draft scorer: the ratio order
    assert [job.arm for job in request.jobs] == ["single", "single", "repeated", "repeated"]
    assert request.jobs_by_index() == {job.index: job for job in request.jobs}
    assert request.config()["draft_scorer"] is True and request.config()["prompts"] == PROMPTS


def test_running_a_request_is_the_audit():
    kwargs = {k: v for k, v in OPTIONS.items() if v is not None}
    direct = audit_generation(correct_engine(PAIR), PAIR.scorer(), PROMPTS, vocab_size=12,
                              draft_score=PAIR.draft_scorer(), progress=False, **kwargs).to_dict()
    built = run_request(_request(), progress=False).to_dict()
    direct.pop("seconds"), built.pop("seconds")
    assert built == direct


@pytest.mark.parametrize("changes, named", [({"rounds": 0}, "rounds"), ({"orderings": ["nope"]}, "orderings"),
                                            ({"eos_token_id": 12}, "eos_token_id"), ({"greedy": "yes"}, "greedy"),
                                            ({"name": 3}, "name")])
def test_a_bad_argument_is_named(changes, named):
    with pytest.raises(InvalidArgument, match=f"^{named}:"):
        _request(**changes)
