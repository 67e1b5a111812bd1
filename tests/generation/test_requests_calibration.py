"""False alarms of the correct engine with whole requests, at fixed seeds.

The engine (tests/generation/_request_engines.py) samples each row from its own request's law, so the decisive
checks (support, end-of-sequence, logprobs, stopping, constraint) hold by construction: any finding of theirs is
a false alarm of the audit itself, and none is allowed.  The statistical tests are Holm-adjusted at the
familywise level alpha: a FINDING has probability at most alpha per audit.

* default: 6 audits at the default alpha 0.001 (a false alarm at most 0.6% over the six); none at these seeds.
* slow: 40 audits at alpha 0.05; the FINDINGs are binomial(40, <= 0.05) (mean <= 2), and 7 or more has
  probability below 0.004 under calibration.  Measured at seeds 0-59: see docs/generation.md, "Whole requests".
"""

from __future__ import annotations

import pytest

from spectr_audit.contract.requests import Request, TokenAutomaton
from spectr_audit.generation.audit import audit_generation
from tests.generation import _request_engines as engines

PROMPTS = [[1, 2, 3], [4, 5], [6], [7, 8, 9]]
AUTOMATON = TokenAutomaton({0: {4: 1, 5: 1, 6: 1, 7: 1}, 1: {4: 1, 5: 1, 6: 1, 7: 1}}, accepting=[1],
                           end_tokens=[0])
REQUESTS = [
    Request(temperature=0.8, frequency_penalty=0.7, min_tokens=3, stop_token_ids=[1], logprobs=1, seed=5),
    Request(top_k=4, presence_penalty=0.5, max_tokens=6),
    Request(bad_words=[[2, 3]], logit_bias={4: 1.0}, repetition_penalty=1.3),
    Request(temperature=0.0, repetition_penalty=1.5, logprobs=0),
    Request(top_p=0.9, constraint=AUTOMATON),
]
DECISIVE = ("support", "end-of-sequence", "logprobs", "stopping", "constraint")


def _run(seed: int, alpha: float):
    return audit_generation(engines.RequestSampler(seed=seed), engines.RequestSampler(seed=seed), PROMPTS,
                            vocab_size=10, max_new_tokens=8, eos_token_id=0, requests=REQUESTS, progress=False,
                            rounds=1, seed=100 + seed, alpha=alpha)


def _false_alarms(seeds, alpha: float) -> tuple:
    findings, decisive = 0, []
    for seed in seeds:
        result = _run(seed, alpha)
        assert {t.name for t in result.subtests} >= set(DECISIVE)
        decisive += [(seed, t.name) for t in result.subtests if t.name in DECISIVE and t.pvalue == 0.0]
        findings += result.verdict == "FINDING"
    return findings, decisive


def test_no_false_alarm_at_the_default_alpha():
    findings, decisive = _false_alarms(range(6), 0.001)
    assert decisive == [] and findings == 0


@pytest.mark.slow
def test_the_false_alarm_rate_at_alpha_0_05():
    findings, decisive = _false_alarms(range(40), 0.05)
    assert decisive == []
    assert findings <= 6  # binomial(40, 0.05): P(>= 7) < 0.004
