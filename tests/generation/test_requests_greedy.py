"""Greedy requests with history processors, against a reference generator token for token; the scorer a
request needs (raw logits), refused before any engine call otherwise; and the bad requests named by field.

At temperature 0 the law of each position is the argmax of the processed logits (penalties over the row's own
history, bad words, a constraint): the audit detects it greedy, and a reference makes it the greedy check.
"""

from __future__ import annotations

import dataclasses

import pytest

from spectr_audit.contract.requests import Request, TokenAutomaton
from spectr_audit.errors import InvalidArgument
from spectr_audit.generation.audit import audit_generation
from tests.generation import _request_engines as engines

PROMPTS = [[1, 2, 3], [4, 5], [6], [7, 8, 9]]
GREEDY = [Request(temperature=0.0, repetition_penalty=1.8), Request(temperature=0.0, bad_words=[[2, 3], [5]]),
          Request(temperature=0.0, frequency_penalty=1.0, presence_penalty=0.5)]
# greedy inside a constraint: tokens 4, 5 or 6 forever, the end of sequence (0) after the first
AUTOMATON = TokenAutomaton({0: {4: 1, 5: 1, 6: 1}, 1: {4: 1, 5: 1, 6: 1}}, accepting=[1], end_tokens=[0])


def _audit(engine, requests=GREEDY, **kwargs):
    options = dict(vocab_size=10, max_new_tokens=8, eos_token_id=0, requests=requests, progress=False, rounds=1,
                   reference=engines.RequestSampler())
    options.update(kwargs)
    return audit_generation(engine, engines.RequestSampler(), PROMPTS, **options)


class Ignores(engines.RequestSampler):
    """Runs each request with some of its fields reset to their defaults."""

    def __init__(self, **fields):
        super().__init__()
        self.fields = fields

    def law(self, logits, prompt, emitted, request, row):
        return super().law(logits, prompt, emitted, dataclasses.replace(request, **self.fields), row)


def test_greedy_with_processors_matches_the_reference_token_for_token():
    result = _audit(engines.RequestSampler())
    assert result.greedy and result.decided_by == "greedy" and result.verdict == "PASS"
    assert next(t for t in result.subtests if t.name == "greedy").statistic == 0
    assert result.divergences == ()


@pytest.mark.parametrize("fields", [
    dict(repetition_penalty=1.0, presence_penalty=0.0, frequency_penalty=0.0),
    dict(bad_words=()),
])
def test_a_greedy_engine_that_drops_a_processor_departs_from_the_reference(fields):
    result = _audit(Ignores(**fields))
    assert result.verdict == "FINDING"
    greedy = next(t for t in result.subtests if t.name == "greedy")
    assert greedy.statistic > 0 and greedy.pvalue == 0.0
    # each divergence names its row and position, at a margin above the audit's logit tolerance
    assert all(d.margin is None or d.margin > result.logit_tolerance for d in result.divergences if not d.numerics)


def test_greedy_inside_a_constraint():
    requests = [Request(temperature=0.0, constraint=AUTOMATON), Request(temperature=0.0, repetition_penalty=1.3)]
    good = _audit(engines.RequestSampler(), requests=requests)
    assert good.verdict == "PASS" and good.decided_by == "greedy"
    bad = _audit(Ignores(constraint=None), requests=requests)
    assert bad.verdict == "FINDING"
    assert next(t for t in bad.subtests if t.name == "constraint").pvalue == 0.0
    assert any(f["check"] == "constraint" and f["row"] % 2 == 0 for f in bad.request_findings)


class LawsScorer(engines.RequestSampler):
    """Scores with the laws at temperature 1 (no raw logits)."""

    def score(self, prompts, continuations):
        import torch

        return [torch.softmax(x, -1) for x in super().score(prompts, continuations).logits]


class Counting(engines.RequestSampler):
    def __init__(self):
        super().__init__()
        self.calls = 0

    def generate(self, *args, **kwargs):
        self.calls += 1
        return super().generate(*args, **kwargs)


@pytest.mark.parametrize("requests, message", [
    ([Request(temperature=0.5), Request(repetition_penalty=1.2)],
     (r"score: with requests the scorer must return raw logits \(ScoredLogits\), got list: requests\[1\] "
      r"\(sampled\+penalties\) depends on each row's history")),
    ([Request(temperature=0.5)], r"score: with requests the scorer must return raw logits .*applies each row's"),
])
def test_a_laws_scorer_is_refused_before_any_engine_call(requests, message):
    engine = Counting()
    with pytest.raises(InvalidArgument, match=message):
        audit_generation(engine, LawsScorer(), PROMPTS, vocab_size=10, requests=requests, progress=False)
    assert engine.calls == 0


def test_a_laws_scorer_without_requests_is_as_before():
    result = audit_generation(engines.RequestSampler(), LawsScorer(), PROMPTS, vocab_size=10, max_new_tokens=4,
                              progress=False, rounds=1)
    assert result.verdict != "ERROR"


BAD = [
    (dict(requests=[Request(), Request(), Request(logit_bias={12: 1.0})]),
     r"requests\[2\].logit_bias: token id 12 outside \[0, 10\)"),
    (dict(requests=[Request(stop_token_ids=[10])]), r"requests\[0\].stop_token_ids: token id 10 outside \[0, 10\)"),
    (dict(requests=[Request(logprobs=11)]), (r"requests\[0\].logprobs: 11 top log-probabilities asked of a "
                                             r"vocabulary of 10")),
    (dict(requests=[Request(), Request(stop=["\n"])]), r"requests\[1\].stop: stop strings need the engine.s detokenizer: give detokenize="),
    (dict(requests=Request(), logprob_tolerance=float("nan")), "logprob_tolerance: expected a finite number > 0"),
    (dict(requests=Request(), logprob_tolerance=True), "logprob_tolerance: expected a finite number > 0"),
    (dict(requests=Request(), logprob_tolerance=-0.1), "logprob_tolerance: expected a finite number > 0"),
    (dict(requests=(Request(), None)), r"requests\[1\]: expected a Request, got NoneType"),
    (dict(requests={"temperature": 0.0}), "requests: expected a Request or a non-empty list of Requests, got dict"),
]


@pytest.mark.parametrize("change, message", BAD)
def test_bad_input_is_named_before_any_engine_call(change, message):
    engine = Counting()
    with pytest.raises(InvalidArgument, match=message):
        audit_generation(engine, engines.RequestSampler(), PROMPTS, vocab_size=10, progress=False, **change)
    assert engine.calls == 0
