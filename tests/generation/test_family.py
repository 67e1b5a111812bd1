"""The Holm family's plan is the family the analysis builds, for every combination of the options that shape it.

The analysis quotes each test's minimum detectable TV at ``alpha / plan.size`` and the stopping rule stops on
the e-process at ``alpha / largest_family(request).holm_size``: a plan that counted a test the analysis does not
build (or missed one) would quote every power at the wrong level.  Each audit below is a toy run at a tiny
budget (some strata filled, others not); the plan the analysis made is captured and compared, test by test,
with the family in the result.
"""

from __future__ import annotations

import itertools

import pytest

from spectr_audit.contract.sampling import SamplingParams
from spectr_audit.generation import analysis, audit_generation
from spectr_audit.generation.analysis import largest_family
from spectr_audit.generation.family import AGREEMENT_TESTS, DECISIVE_CHECKS, FamilyPlan
from spectr_audit.generation.request import GenerationRequest
from spectr_audit.generation.library import ToyPair, correct_engine

ARM_SETS = (("single",), ("single", "repeated"), ("equal", "ragged"), ("single", "equal", "ragged", "repeated"))
PROMPT_SETS = ([[1, 2, 3]], [[1, 2, 3], [4, 5], [6]])


def _audit(monkeypatch, arms, prompts, reference, ratio, greedy, rounds, eos):
    plans, requests = [], []
    made, build = analysis.family_plan, GenerationRequest.build.__func__

    def capture(*args, **kwargs):
        plan = made(*args, **kwargs)
        plans.append(plan)
        return plan

    def capture_request(cls, *args, **kwargs):
        requests.append(build(cls, *args, **kwargs))
        return requests[-1]

    monkeypatch.setattr(analysis, "family_plan", capture)
    monkeypatch.setattr(GenerationRequest, "build", classmethod(capture_request))
    pair = ToyPair(12, seed=2, params=SamplingParams(temperature=0.0) if greedy else None, eos_token_id=eos)
    result = audit_generation(correct_engine(pair), pair.scorer(), prompts, vocab_size=12, max_new_tokens=8,
                              arms=arms, rounds=rounds, batch_size=2, position_buckets=(4,),
                              reference=pair.reference() if reference else None,
                              draft_score=pair.draft_scorer() if ratio else None, eos_token_id=eos, progress=False)
    assert len(plans) == 1 and len(requests) == 1
    return plans[0], result, requests[0]


def _grid() -> list:
    """Every combination; a quarter of them (ratio tied to the rounds, greedy to the end-of-sequence id, every other
    option free) in the default run, the rest with the slow tests."""
    out = []
    for combo in itertools.product(ARM_SETS, PROMPT_SETS, (False, True), (False, True), (False, True), (1, 2),
                                   (None, 3)):
        _, _, _, ratio, greedy, rounds, eos = combo
        fast = ratio == (rounds == 2) and greedy == (eos is not None)
        out.append(combo if fast else pytest.param(*combo, marks=pytest.mark.slow))
    return out


@pytest.mark.parametrize("arms, prompts, reference, ratio, greedy, rounds, eos", _grid())
def test_the_plan_is_the_family_built(monkeypatch, arms, prompts, reference, ratio, greedy, rounds, eos):
    plan, result, request = _audit(monkeypatch, arms, prompts, reference, ratio, greedy, rounds, eos)
    # every test the result lists shares alpha; Holm runs over all but the decisive checks
    assert plan.tests() == tuple(t.name for t in result.subtests)
    assert plan.size == len(result.subtests)
    holm = tuple(t.name for t in result.subtests if t.name not in DECISIVE_CHECKS)
    assert plan.members() == holm and plan.holm_size == len(holm)
    # the stopping rule's level reads the largest family the planned jobs can give: never smaller than the family
    # built, and the same family when every row runs to its limit (no end-of-sequence id) and every test has data
    largest = largest_family(request, reference)
    assert set(holm) <= set(largest.members())
    if eos is None and not greedy:
        assert plan.members() == largest.members()


def test_the_largest_plan_counts_every_stratum_and_test():
    plan = FamilyPlan.largest(("probability", "token-id"), ("single", "repeated"), (16, 64), 3, True)
    strata = ["all", "arm single", "arm repeated", "positions 0-15", "positions 16-63", "positions 64+",
              "prompt 0", "prompt 1", "prompt 2"]
    assert plan.strata == tuple(strata)
    # 9 strata x 2 orders, 6 surprisal strata, 2 agreement tests, the e-process, 3 two-sample strata x 2 orders
    assert plan.holm_size == 18 + 6 + 2 + 1 + 6
    assert plan.agreement == AGREEMENT_TESTS
    # no position boundary: one bucket, "positions 0+"
    assert FamilyPlan.largest(("probability",), ("single",), (), 1, False).holm_size == 3 + 3 + 2 + 1


def test_an_empty_family_has_size_one():
    assert FamilyPlan(("probability",), ()).size == 1


#: (max_new_tokens, rounds, position buckets) -> the strata and agreement tests the planned jobs can fill, derived by
#: hand for prompts [1, 2, 3], [4, 5], [6] in the single and repeated arms, batches of 2 (a stratum needs 100 tokens:
#: 5 per bin of 20).  At 40 tokens: single 6 rows x 40 = 240, repeated 480, each prompt 240, positions 0-15
#: 18 rows x 16 = 288, positions 16+ 18 x 24 = 432.  At 5 tokens: single 30, repeated 60, each prompt 30,
#: positions 0-3 72, positions 4+ 18: only "all".  Two rounds give each prompt two single (and two repeated) calls.
LARGEST_CASES = [
    (40, 2, (16,), ("all", "arm single", "arm repeated", "positions 0-15", "positions 16+", "prompt 0", "prompt 1",
                    "prompt 2"), AGREEMENT_TESTS),
    (5, 2, (4,), ("all",), AGREEMENT_TESTS),
    (5, 1, (4,), ("all",), AGREEMENT_TESTS[:1]),
]


@pytest.mark.parametrize("max_new_tokens, rounds, buckets, strata, agreement", LARGEST_CASES)
def test_the_largest_family_holds_what_the_planned_jobs_can_fill(monkeypatch, max_new_tokens, rounds, buckets,
                                                                 strata, agreement):
    requests = []
    build = GenerationRequest.build.__func__

    def capture_request(cls, *args, **kwargs):
        requests.append(build(cls, *args, **kwargs))
        return requests[-1]

    monkeypatch.setattr(GenerationRequest, "build", classmethod(capture_request))
    pair = ToyPair(12, seed=2)
    audit_generation(correct_engine(pair), pair.scorer(), [[1, 2, 3], [4, 5], [6]], vocab_size=12,
                     max_new_tokens=max_new_tokens, arms=("single", "repeated"), rounds=rounds, batch_size=2,
                     position_buckets=buckets, progress=False)
    largest = largest_family(requests[0])
    assert largest.strata == strata and largest.agreement == agreement and largest.eprocess
    assert largest.holm_size == 2 * len(strata) + sum(not s.startswith("prompt") for s in strata) + len(agreement) + 1
