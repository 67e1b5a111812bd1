"""The generation audit with whole requests: each row judged under its own request and history, and the decisive
checks of returned logprobs, stopping and constraints, and the determinism line.

The correct engine (tests/generation/_request_engines.py: it samples each row from its request's law) passes;
each broken one is found by the check meant for it.  The requests mix greedy and sampled rows, penalties,
min_tokens with a stop token, max_tokens, bad words, a logit bias, logprobs and seeds in every batch.
"""

from __future__ import annotations

import pytest

from spectr_audit.contract.requests import Request, TokenAutomaton
from spectr_audit.errors import InvalidArgument
from spectr_audit.generation.audit import audit_generation
from spectr_audit.generation.contract import GenerationContractError, GenerationOutput
from tests.generation import _request_engines as engines

PROMPTS = [[1, 2, 3], [4, 5], [6], [7, 8, 9]]
REQUESTS = [
    Request(temperature=0.0, repetition_penalty=1.5, logprobs=2),
    Request(temperature=0.8, frequency_penalty=0.7, min_tokens=3, stop_token_ids=[1], logprobs=0, seed=5),
    Request(top_k=4, presence_penalty=0.5, max_tokens=6),
    Request(bad_words=[[2, 3]], logit_bias={4: 1.0}, seed=9),
]


def _audit(engine, requests=REQUESTS, **kwargs):
    options = dict(vocab_size=10, max_new_tokens=12, eos_token_id=0, requests=requests, progress=False, rounds=2)
    options.update(kwargs)
    return audit_generation(engine, engines.RequestSampler(), PROMPTS, **options)


def test_the_correct_engine_passes_every_request_check():
    result = _audit(engines.RequestSampler())
    assert result.verdict in ("PASS", "INCONCLUSIVE") and result.pvalue > 0.001
    checks = {t.name: t for t in result.subtests}
    assert {"logprobs", "stopping"} <= set(checks) and "constraint" not in checks
    assert checks["logprobs"].pvalue == checks["stopping"].pvalue == 1.0
    assert result.request_findings == ()
    assert result.determinism == {"checked": result.determinism["checked"], "differing": 0, "rows": [], "passed": True}
    assert result.determinism["checked"] > 0
    assert [r["kind"] for r in result.requests] == [r.kind for r in REQUESTS]
    assert "requests" in result.to_dict() and "determinism" in result.to_dict()


@pytest.mark.parametrize("engine, check", [
    (engines.PenaltiesIgnored, "support"),
    (engines.ProcessedLogprobs, "logprobs"),
    (engines.ZeroLogprobs, "logprobs"),
    (engines.GoesOnAfterStop, "stopping"),
    (engines.MinTokensInSteps, None),
    (engines.WrongFinishReason, "stopping"),
])
def test_each_broken_engine_is_found_by_its_check(engine, check):
    result = _audit(engine())
    assert result.verdict == "FINDING"
    if check is not None:
        assert next(t for t in result.subtests if t.name == check).pvalue == 0.0
    if check in ("logprobs", "stopping"):
        assert any(f["check"] == check for f in result.request_findings)


def test_min_tokens_broken_is_named_a_stopping_finding():
    result = _audit(engines.MinTokensInSteps())
    assert any(f["check"] == "stopping" and "min_tokens" in f["what"] for f in result.request_findings)


def test_an_ignored_seed_is_its_own_line_not_the_verdict():
    result = _audit(engines.SeedIgnored())
    assert result.determinism["differing"] > 0 and not result.determinism["passed"]
    assert result.verdict in ("PASS", "INCONCLUSIVE")  # the law of each row is still right


def test_a_token_outside_the_constraint_is_a_finding():
    # allowed: tokens 5 or 6 forever, the end of sequence (0) any time after the first
    automaton = TokenAutomaton({0: {5: 1, 6: 1}, 1: {5: 1, 6: 1}}, accepting=[1], end_tokens=[0])
    constrained = [Request(constraint=automaton), Request(temperature=0.0)]

    class IgnoresConstraint(engines.RequestSampler):
        def law(self, logits, prompt, emitted, request, row):
            import dataclasses

            return super().law(logits, prompt, emitted, dataclasses.replace(request, constraint=None), row)

    good = _audit(engines.RequestSampler(), requests=constrained)
    assert next(t for t in good.subtests if t.name == "constraint").pvalue == 1.0 and good.verdict != "FINDING"
    bad = _audit(IgnoresConstraint(), requests=constrained)
    assert bad.verdict == "FINDING" and any(f["check"] == "constraint" for f in bad.request_findings)


def test_without_requests_nothing_changes_in_the_result_form():
    result = _audit(engines.RequestSampler(), requests=None)
    names = {t.name for t in result.subtests}
    assert not names & {"logprobs", "stopping", "constraint"}
    assert not {"requests", "request_findings", "determinism"} & set(result.to_dict())


BAD = [
    (dict(requests=[Request(stop=["END"])]),
     r"requests\[0\].stop: stop strings need the engine.s detokenizer: give detokenize="),
    (dict(requests=[Request(stop=["END"])], detokenize="decode"), "detokenize: expected a callable"),
    (dict(requests=[Request(stop=["END"])], detokenize=lambda ids: ids), "detokenize: expected it to return a str"),
    (dict(requests=[Request(stop=["END"])], detokenize=lambda ids: {}[0]), "detokenize: failed on the first prompt"),
    (dict(requests=None, detokenize=str), "detokenize: only for requests with stop strings"),
    (dict(requests=[Request(), Request(bad_words=[[11]])]), r"requests\[1\].bad_words\[0\]: token id 11"),
    (dict(requests=[Request(), "greedy"]), r"requests\[1\]: expected a Request"),
    (dict(requests=[]), "requests: expected a Request or a non-empty list"),
    (dict(logprob_tolerance=0.0), "logprob_tolerance"),
]


@pytest.mark.parametrize("change, message", BAD)
def test_bad_requests_are_named_before_any_engine_call(change, message):
    calls = []

    class Counting(engines.RequestSampler):
        def generate(self, *args, **kwargs):
            calls.append(1)
            return super().generate(*args, **kwargs)

    with pytest.raises(InvalidArgument, match=message):
        _audit(Counting(), **change)
    assert calls == []


def test_a_generator_without_requests_takes_only_one():
    def plain(prompts, max_new_tokens, seed):
        return [[0]] * len(prompts)

    with pytest.raises(InvalidArgument, match="does not take per-row requests"):
        audit_generation(plain, engines.RequestSampler(), PROMPTS, vocab_size=10, requests=REQUESTS, progress=False)
    with pytest.raises(InvalidArgument, match="logprobs asked of a generator that does not take requests"):
        audit_generation(plain, engines.RequestSampler(), PROMPTS, vocab_size=10, requests=[Request(logprobs=1)],
                         progress=False)


@pytest.mark.parametrize("field, change, message", [
    ("logprobs", None, "asked for logprobs and the engine returned none"),
    ("finish_reasons", None, "no finish reason"),
    ("logprobs", "short", "one value per emitted token"),
    ("completion_tokens", [-1], "completion_tokens must be an integer"),
])
def test_an_engine_that_returns_less_than_asked_is_a_contract_error(field, change, message):
    class Short(engines.RequestSampler):
        def generate(self, prompts, max_new_tokens, seed, requests=None):
            out = super().generate(prompts, max_new_tokens, seed, requests)
            value = change
            if change == "short":
                value = [None if v is None else v[:-1] for v in out.logprobs]
            elif isinstance(change, list):
                value = change * len(prompts)
            return GenerationOutput(**{**out.__dict__, field: value})

    result = _audit(Short(), allow_failed_calls=100)
    assert result.failed_calls and message in result.failed_calls[0]["error"]
    with pytest.raises(GenerationContractError, match=message):
        Short_gen = __import__("spectr_audit.generation.contract", fromlist=["as_generator"]).as_generator(Short())
        Short_gen([[1]], 4, 0, vocab_size=10, case="test", requests=[Request(logprobs=0, temperature=0.0)])


def test_reports_name_the_request_checks_and_the_determinism_line():
    from spectr_audit.reports.generation import render_generation_junit, render_generation_markdown

    broken = _audit(engines.WrongFinishReason())
    junit = render_generation_junit(broken)
    assert 'message="FINDING: stopping: FINDING:' in junit and "broke a stopping rule" in junit
    assert "## Whole requests" in render_generation_markdown(broken)
    seeds = _audit(engines.SeedIgnored())
    junit = render_generation_junit(seeds)
    assert 'type="Determinism"' in junit
    assert "seeded rows gave other tokens" in render_generation_markdown(seeds)
    correct = render_generation_markdown(_audit(engines.RequestSampler()))
    assert "No finding of the request checks" in correct and "gave the same tokens" in correct


def test_logprobs_over_a_constraint_s_mask_are_judged_as_declared():
    """vLLM's "raw" logprobs under structured outputs are over the grammar's allowed tokens: declared
    ``raw-masked`` they pass, declared ``raw`` they are a finding of the logprobs check."""
    from spectr_audit.contract.requests import TokenAutomaton

    # tokens 1..4 allowed, 0 (the end of sequence) once three tokens are in
    automaton = TokenAutomaton({0: {t: 1 for t in range(1, 5)}, 1: {t: 2 for t in range(1, 5)},
                                2: {t: 3 for t in range(1, 5)}, 3: {t: 3 for t in range(1, 5)}},
                               accepting=[3], end_tokens=[0])
    requests = [Request(temperature=1.0, constraint=automaton, logprobs=2), Request(temperature=1.0, logprobs=0)]
    masked = _audit(engines.MaskedLogprobs(), requests=requests)
    assert masked.request_findings == () and masked.verdict != "FINDING"
    declared_raw = _audit(engines.MaskedLogprobsDeclaredRaw(), requests=requests)
    assert declared_raw.verdict == "FINDING" and declared_raw.test == "logprobs"
