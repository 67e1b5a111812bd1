"""check_verifier: the one-call conformance check for third-party verifiers.

Correct verifiers (built-ins, and a plain function with and without an exact law) must pass;
each broken verifier in BROKEN must fail with a message naming what broke.  The contract checks
are deterministic; the statistical ones run with fixed seeds at level alpha = 1e-3 (a correct
verifier fails at most at that rate; ``test_sampler_law_check_false_alarm_rate`` measures it).
If a statistical case here fails after a change elsewhere, rerun with another seed first: a
failure that repeats is a finding.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import pytest
import torch

from spectr_audit.run.conformance import (
    ConformanceFailure,
    ConformanceResult,
    _law_checks,
    check_verifier,
    standard_suite,
)
from spectr_audit.errors import InvalidArgument, SpectrAuditError
from spectr_audit.exact.iteration import MAX_TUPLES
from spectr_audit.verifiers.speculative import SpeculativeSampling

SAMPLES = 3000


def speculative_sampling(draft_tokens, draft_probs, target_probs, generator):
    """Single-draft speculative sampling (K = 1, L = 1), written as a third party would."""
    batch_size = draft_tokens.shape[0]
    token = draft_tokens[:, 0, 0]
    draft = draft_probs[:, 0, 0].double()
    target = target_probs[:, 0, 0].double()
    ratio = target.gather(1, token[:, None])[:, 0] / draft.gather(1, token[:, None])[:, 0]
    accept = torch.rand(batch_size, generator=generator, dtype=torch.float64) < ratio.clamp(max=1)
    residual = (target - draft).clamp(min=0)
    residual = torch.where(residual.sum(-1, keepdim=True) > 0, residual, target)
    correction = torch.multinomial(residual, 1, generator=generator)[:, 0]
    bonus = torch.multinomial(target_probs[:, 0, 1].double(), 1, generator=generator)[:, 0]
    zeros = torch.zeros(batch_size, dtype=torch.int64)
    return accept.long(), zeros, torch.where(accept, bonus, correction)


def _patched(transform: Callable) -> Callable:
    def verify(draft_tokens, draft_probs, target_probs, generator):
        return transform(speculative_sampling(draft_tokens, draft_probs, target_probs, generator),
                         draft_tokens, draft_probs, target_probs, generator)
    return verify


def _ignores_generator(draft_tokens, draft_probs, target_probs, generator):
    return speculative_sampling(draft_tokens, draft_probs, target_probs, None)


def _modifies_inputs(draft_tokens, draft_probs, target_probs, generator):
    out = speculative_sampling(draft_tokens, draft_probs, target_probs, generator)
    target_probs.copy_(target_probs.flip(-1))
    return out


def _always_accepts(draft_tokens, draft_probs, target_probs, generator):
    _, index, _ = speculative_sampling(draft_tokens, draft_probs, target_probs, generator)
    bonus = torch.multinomial(target_probs[:, 0, 1].double(), 1, generator=generator)[:, 0]
    return torch.ones_like(index), index, bonus


def _correction_from_target(draft_tokens, draft_probs, target_probs, generator):
    """A plausible bug: on rejection, sample from the target instead of the residual."""
    accepted, index, next_token = speculative_sampling(draft_tokens, draft_probs, target_probs, generator)
    fresh = torch.multinomial(target_probs[:, 0, 0].double(), 1, generator=generator)[:, 0]
    return accepted, index, torch.where(accepted == 0, fresh, next_token)


def _raises(draft_tokens, draft_probs, target_probs, generator):
    raise IndexError("index 7 is out of bounds")


@dataclasses.dataclass(frozen=True)
class Broken:
    name: str
    verify: Callable
    messages: tuple
    kwargs: dict = dataclasses.field(default_factory=dict)


BROKEN = [
    Broken("int32 fields", _patched(lambda out, *a: tuple(t.int() for t in out)),
           ("output contract", "must have dtype torch.int64")),
    Broken("wrong shape", _patched(lambda out, *a: (out[0][:, None], out[1], out[2])),
           ("output contract", "num_accepted must have shape [64]")),
    Broken("next token out of range", _patched(lambda out, tokens, dp, *a: (out[0], out[1], out[2] + dp.shape[-1])),
           ("output contract", "next_token[0] = ", "is outside [0, 4]")),
    Broken("returns two fields", _patched(lambda out, *a: out[:2]),
           ("verify must return VerifyOutput or (num_accepted, draft_index, next_token)",)),
    Broken("raises", _raises, ("verify raised IndexError: index 7 is out of bounds",)),
    Broken("ignores the generator", _ignores_generator,
           ("deterministic under a fixed generator", "two calls with torch.Generator().manual_seed(0) differ")),
    Broken("modifies its inputs", _modifies_inputs, ("inputs unchanged", "verify modified target_probs in place")),
    Broken("accepts every draft", _always_accepts,
           ("emitted tokens have target mass", "emit a token whose target probability is 0",
            "fidelity on case 'target-forbids-draft/K=1/L=1'")),
    Broken("correction from the target", _correction_from_target,
           ("fidelity on case 'seed-spectr/K=1/L=1'", "check statistical failed",
            "worst cells (observed vs expected count)")),
    Broken("sampler off its own law", _patched(lambda out, *a: (torch.zeros_like(out[0]), out[1], out[2])),
           ("sampler follows the exact law", "which its own output_probs gives probability 0"),
           {"output_probs": SpeculativeSampling().output_probs}),
]


@pytest.mark.parametrize("broken", BROKEN, ids=[b.name for b in BROKEN])
def test_broken_verifiers_fail_with_a_message_naming_the_problem(broken):
    with pytest.raises(ConformanceFailure) as info:
        check_verifier(broken.verify, num_drafts=1, num_samples=SAMPLES, **broken.kwargs)
    message = str(info.value)
    assert message.startswith(f"check_verifier({broken.verify.__qualname__}): ")
    for fragment in broken.messages:
        assert fragment in message
    assert isinstance(info.value, AssertionError) and isinstance(info.value, SpectrAuditError)
    assert not info.value.report.passed


def test_an_inexact_rule_with_an_exact_law_names_the_case_and_worst_strings():
    from spectr_audit.verifiers.kseq import KSeq, KSeqRule

    class LowRho(KSeq):
        name = "kseq-low-rho"
        rule = KSeqRule(rho_scale=0.9)

    with pytest.raises(ConformanceFailure) as info:
        check_verifier(LowRho(), num_drafts=2, num_samples=SAMPLES)
    message = str(info.value)
    assert "fidelity on case 'seed-spectr/K=2/L=1':" in message
    assert "check exact failed: value 0.01926" in message
    assert "worst cells (string: implied law vs target law): [0, 1]: 0.229267 vs 0.21" in message
    # The contract itself holds: only fidelity fails.
    assert all(c.passed for c in info.value.report.checks)


@pytest.mark.parametrize("verifier,kwargs", [
    ("kseq", {"num_drafts": (1, 2)}),
    ("speculative", {"num_drafts": 1, "draft_len": (1, 2)}),
    ("rrs-wor", {"num_drafts": 2}),
    ("spectr-tree", {"num_drafts": 2, "draft_len": 2}),
], ids=["kseq", "speculative", "rrs-wor", "spectr-tree"])
def test_builtin_verifiers_conform(verifier, kwargs):
    report = check_verifier(verifier, num_samples=SAMPLES, **kwargs)
    assert isinstance(report, ConformanceResult) and report.passed
    names = {c.name for c in report.checks}
    assert {"output contract", "inputs unchanged", "deterministic under a fixed generator",
            "emitted tokens have target mass", "float32 inputs", "exact law is a distribution",
            "sampler follows the exact law"} <= names
    assert all("tv_distance" in r.metrics for r in report.audit.results)
    assert report.message().startswith(f"check_verifier({verifier}): all ")


def test_a_plain_function_without_a_law_is_audited_from_its_samples():
    report = check_verifier(speculative_sampling, num_drafts=1, num_samples=SAMPLES)
    assert report.passed
    assert "sampler follows the exact law" not in {c.name for c in report.checks}
    for result in report.audit.results:
        assert "tv_distance" not in result.metrics
        # the budget counts every verification: the contract probe's 4 x 16 rows, then the audit's sample
        assert result.metrics["pvalue"] > 1e-3 and result.metrics["num_samples"] == SAMPLES - 64


def test_a_black_box_under_a_small_budget_is_inconclusive_and_a_cheap_certificate_is_reached():
    from spectr_audit.run.suite import parse_suite

    one = parse_suite({"case": [{"name": "seed", "draft": [0.6, 0.4], "target": [0.3, 0.7], "num_drafts": 1}]})
    report = check_verifier(speculative_sampling, num_drafts=1, max_samples=SAMPLES, suite=one)
    (result,) = report.audit.results
    assert report.passed and report.inconclusive == [result] and result.verdict == "INCONCLUSIVE"
    assert "INCONCLUSIVE" in report.message() and not report.certified
    assert result.metrics["tv_lower"] <= result.metrics["tv_estimate"] <= result.metrics["tv_upper"]
    # max_samples is num_samples under the name the other faces use; max_seconds cuts the sampling short
    timed = check_verifier(speculative_sampling, num_drafts=1, max_seconds=1e-6, suite=one).audit.results[0]
    assert timed.metrics["stop_reason"] == "max_seconds"
    certified = check_verifier(speculative_sampling, num_drafts=1, max_samples=100_000, certify_tv=0.1, suite=one)
    assert certified.passed and certified.certified and not certified.inconclusive
    assert certified.audit.results[0].metrics["tv_upper"] <= 0.1
    # an exact law certifies by its exact TV
    exact = check_verifier("speculative", num_drafts=1, certify_tv=0.01, suite=one)
    assert exact.certified


def test_a_plain_function_with_a_law_is_audited_exactly():
    report = check_verifier(speculative_sampling, num_drafts=1, num_samples=SAMPLES,
                            output_probs=SpeculativeSampling().output_probs, name="spec-with-law")
    assert report.passed and report.verifier == "spec-with-law"
    assert all(r.metrics["tv_distance"] < 1e-12 for r in report.audit.results)


def test_an_object_with_a_verify_method():
    class Mine:
        name = "mine"
        max_drafts = 1

        def verify(self, draft_tokens, draft_probs, target_probs, generator):
            return speculative_sampling(draft_tokens, draft_probs, target_probs, generator)

    assert check_verifier(Mine(), num_drafts=1, num_samples=SAMPLES).passed


def test_report_without_raising():
    report = check_verifier(_always_accepts, num_drafts=1, num_samples=SAMPLES, raise_on_failure=False)
    assert not report.passed
    assert any(not c.passed for c in report.checks)
    assert report.message() == str(report)


BAD_ARGUMENTS = [
    ({"num_drafts": 0}, "num_drafts: expected an integer >= 1"),
    ({"num_drafts": []}, "num_drafts: expected an integer >= 1"),
    ({"draft_len": "2"}, "draft_len: expected an integer >= 1"),
    ({"num_samples": 10}, "num_samples: expected an integer >= 100"),
    ({"alpha": 1.5}, "alpha: expected a number in (0, 1)"),
    ({"seed": 1.0}, "seed: expected an integer"),
    ({"batch_size": 0}, "batch_size: expected a positive integer"),
    ({"draft_scheme": "sorted"}, "draft_scheme: expected 'iid' or 'without_replacement'"),
    ({"num_drafts": (1, 2)}, "num_drafts, draft_len: verifier 'speculative' supports num_drafts in [1, 1]"),
    ({"suite": 3}, "suite: expected a Suite or a suite name/path"),
    ({"max_seconds": 0}, "max_seconds: expected a positive number"),
    ({"certify_tv": 1.0}, "certify_tv: expected a number in (0, 1)"),
]


@pytest.mark.parametrize("kwargs,message", BAD_ARGUMENTS, ids=[m.split(":")[0] + str(k) for k, m in BAD_ARGUMENTS])
def test_bad_arguments(kwargs, message):
    with pytest.raises(InvalidArgument) as info:
        check_verifier("speculative", **kwargs)
    assert message in str(info.value)


def test_default_num_drafts_are_those_the_verifier_supports():
    report = check_verifier("speculative", num_samples=SAMPLES)
    assert {r.case.split("/")[1] for r in report.audit.results} == {"K=1"}
    report = check_verifier("kseq", num_samples=SAMPLES)
    assert {r.case.split("/")[1] for r in report.audit.results} == {"K=1", "K=2"}


def test_output_probs_only_for_a_plain_function():
    with pytest.raises(InvalidArgument, match="output_probs: only for a plain verify function"):
        check_verifier("kseq", output_probs=SpeculativeSampling().output_probs)


@pytest.mark.parametrize("num_drafts,draft_len", [((1, 2, 3, 4), 1), ((1, 2, 3), (2, 3)), (4, 3)])
def test_standard_suite_fits_the_exact_audit(num_drafts, draft_len):
    suite = standard_suite(num_drafts, draft_len)
    names = [c.name for c in suite.cases]
    assert len(names) == len(set(names))
    for case in suite.cases:
        support = int((case.draft_model(torch.zeros(1, 0, dtype=torch.int64)) > 0).sum())
        assert support ** (case.num_drafts * case.draft_len) <= MAX_TUPLES, case.name
        assert (f"K={case.num_drafts}" in case.name) and (f"L={case.draft_len}" in case.name)


@pytest.mark.slow
def test_sampler_law_check_false_alarm_rate():
    """A correct sampler fails the sampler-vs-law check at most at rate alpha (Bonferroni: below it)."""
    from spectr_audit.run.conformance import _contract_models
    from spectr_audit.drafting.harness import draft
    from spectr_audit.registry import load_verifier

    verifier = load_verifier("kseq")
    draft_model, target_model = _contract_models(1, "iid")
    alpha, trials, failures = 0.1, 40, 0
    for seed in range(trials):
        batch = draft(draft_model, target_model, torch.zeros(8, 0, dtype=torch.int64), 2, 1,
                      torch.Generator().manual_seed(seed))
        checks = _law_checks(verifier, batch, 3000, alpha, seed, "K=2")
        failures += not checks[-1].passed
    # P(Binomial(40, 0.1) >= 11) < 3e-3: a miscalibrated test fails here.
    assert failures <= 10
