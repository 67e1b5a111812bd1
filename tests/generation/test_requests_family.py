"""Requests of several kinds are strata of their own, fixed before the engine runs: the Holm family's plan
counts them (its size is the family the analysis builds), the largest family that sets the e-process's
stopping level counts them, and a slip in one kind of request shows in that kind's stratum."""

from __future__ import annotations

import dataclasses

import pytest

from spectr_audit.contract.requests import Request
from spectr_audit.generation import analysis, audit_generation
from spectr_audit.generation.family import DECISIVE_CHECKS, FamilyPlan
from tests.generation import _request_engines as engines

PROMPTS = [[1, 2, 3], [4, 5], [6], [7, 8, 9]]
MIXED = [Request(temperature=0.9, presence_penalty=0.6), Request(top_k=5), Request(temperature=0.0),
         Request(logit_bias={3: 1.5}, seed=1)]
# their kinds, hand-written from the fields each carries, in the order first given
KINDS = ("sampled+penalties", "sampled", "greedy", "sampled+bias")


def _audit(monkeypatch, engine, requests, rounds=2, reference=None):
    plans = []
    made = analysis.family_plan

    def capture(*args, **kwargs):
        plans.append(made(*args, **kwargs))
        return plans[-1]

    monkeypatch.setattr(analysis, "family_plan", capture)
    result = audit_generation(engine, engines.RequestSampler(), PROMPTS, vocab_size=10, max_new_tokens=12,
                              eos_token_id=0, requests=requests, progress=False, rounds=rounds, reference=reference)
    assert len(plans) == 1
    return plans[0], result


def test_the_kinds_are_the_requests_strata():
    assert tuple(dict.fromkeys(r.kind for r in MIXED)) == KINDS


@pytest.mark.parametrize("requests, rounds, reference", [
    (MIXED, 2, None),
    (MIXED, 1, engines.RequestSampler(seed=0)),
    ([Request(temperature=0.7), Request(temperature=0.7, frequency_penalty=0.4)], 1, None),
    ([Request(temperature=0.7, seed=3), Request(temperature=0.7, seed=4)], 1, None),  # one kind: no stratum
])
def test_the_plan_is_the_family_built_with_requests(monkeypatch, requests, rounds, reference):
    plan, result = _audit(monkeypatch, engines.RequestSampler(), requests, rounds, reference)
    assert plan.tests() == tuple(t.name for t in result.subtests)
    assert plan.size == len(result.subtests)
    holm = tuple(t.name for t in result.subtests if t.name not in DECISIVE_CHECKS + ("logprobs", "stopping"))
    assert plan.members() == holm
    kinds = tuple(dict.fromkeys(r.kind for r in requests))
    kinds = kinds if len(kinds) > 1 else ()
    largest = FamilyPlan.largest(plan.orderings, ("single", "equal", "ragged", "repeated"), (16, 64),
                                 len(PROMPTS), reference is not None, kinds)
    assert set(holm) <= set(largest.members())
    filled = {s for s in plan.strata if s.startswith("request ")}
    assert filled <= {f"request {k}" for k in kinds}
    if len(kinds) > 1 and rounds == 2:
        assert filled  # enough tokens: some kind's stratum is tested


def test_the_largest_family_counts_the_request_strata():
    base = FamilyPlan.largest(("probability",), ("single",), (), 1, False)
    more = FamilyPlan.largest(("probability",), ("single",), (), 1, False, KINDS)
    assert more.strata == base.strata + tuple(f"request {k}" for k in KINDS)
    # each stratum: one PIT test per order and one surprisal test
    assert more.holm_size == base.holm_size + 2 * len(KINDS)


class TemperatureIgnoredWhenPenalised(engines.RequestSampler):
    """Samples at temperature 1 on the rows that carry a penalty, right on every other row."""

    def law(self, logits, prompt, emitted, request, row):
        if request.presence_penalty:
            request = dataclasses.replace(request, temperature=1.0)
        return super().law(logits, prompt, emitted, request, row)


def test_a_slip_in_one_kind_of_request_shows_in_its_stratum(monkeypatch):
    requests = [Request(temperature=0.4, presence_penalty=0.3), Request(temperature=0.4)]
    _, result = _audit(monkeypatch, TemperatureIgnoredWhenPenalised(), requests, rounds=3)
    tests = {t.name: t for t in result.subtests}
    slipped = [t for name, t in tests.items() if name.endswith("/ request sampled+penalties")]
    right = [t for name, t in tests.items() if name.endswith("/ request sampled")]
    assert slipped and right
    assert result.verdict == "FINDING"
    assert min(t.pvalue for t in slipped) < 1e-6 < min(t.pvalue for t in right)
