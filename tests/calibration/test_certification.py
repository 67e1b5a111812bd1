"""Certification and the TV interval are calibrated: checked over many seeds against exact TVs.

* A verifier whose exact TV on the audited partition is 1.5 EPS is not certified (the
  certificate's error rate is the audit's alpha, 1e-3); a correct one is certified within the
  planned budget (with probability ``power`` = 0.99 by the plan).
* The interval's coverage, on every broken verifier of the library (each with its exact law,
  so its exact TV on the partition is computable), over many seeds.

Each meta-test states its own false-alarm rate, with fixed seeds (deterministic).  The big
sweeps are ``slow``; ``python scripts/tv_intervals.py`` prints the tables they summarise.
"""

from __future__ import annotations

import math

import pytest
import torch
from scipy import stats

from spectr_audit.contract.verifier import FunctionVerifier
from spectr_audit.drafting.models import ContextFreeModel
from spectr_audit.exact.iteration import exact_iteration
from spectr_audit.registry import broken_names, load_broken
from spectr_audit.statistical.audit import statistical_audit
from spectr_audit.statistical.confidence import partition_tv
from spectr_audit.statistical.sampling import build_partition
from spectr_audit.verifiers.speculative import SpeculativeSampling

from tests._models import DRAFT8, TARGET8

pytestmark = pytest.mark.usefixtures("single_thread")  # one torch thread (tests/conftest.py)

DRAFT3 = ContextFreeModel([0.2, 0.3, 0.5])
TARGET3 = ContextFreeModel([0.5, 0.3, 0.2])
ALPHA = 1e-3


def leaky(leak: float, *, exact_law: bool = False) -> FunctionVerifier:
    """Speculative sampling that, with probability ``leak``, emits token 0 at once (K = 1, L = 1).

    Its law is ``(1 - leak) q + leak G`` with G: "token 0, then the target", so its TV to the target
    over V^2 is ``leak (1 - q(0))`` (half the leak at TARGET3's q(0) = 0.5).
    """
    inner = SpeculativeSampling()

    def verify(draft_tokens, draft_probs, target_probs, generator):
        out = inner.verify(draft_tokens, draft_probs, target_probs, generator)
        hit = torch.rand(draft_tokens.shape[0], generator=generator, dtype=torch.float64) < leak
        zero = torch.zeros_like(out.next_token)
        return torch.where(hit, zero, out.num_accepted), out.draft_index, torch.where(hit, zero, out.next_token)

    def output_probs(draft_tokens, draft_probs, target_probs):
        law = (1 - leak) * inner.output_probs(draft_tokens, draft_probs, target_probs)
        law[:, 0, 0, 0] += leak
        return law

    return FunctionVerifier(verify, name=f"leaky-{leak:g}", output_probs=output_probs if exact_law else None,
                            max_drafts=1, max_draft_len=1)


def _leak_for(tv: float) -> float:
    return tv / (1.0 - float(TARGET3.probs[0]))


def test_the_leaky_verifier_has_the_tv_it_is_built_for():
    exact = exact_iteration(leaky(_leak_for(0.075), exact_law=True), DRAFT3, TARGET3, 1, 1)
    assert exact.tv_distance == pytest.approx(0.075, abs=1e-12)


def _certifications(verifier, eps, seeds):
    results = [statistical_audit(verifier, DRAFT3, TARGET3, 1, 1, alpha=ALPHA, certify_tv=eps, seed=seed)
               for seed in seeds]
    assert all(r.partition.startswith("9 cells: every string of V^2") for r in results)
    return results


def test_a_verifier_at_one_and_a_half_eps_is_not_certified():
    # P(certified) <= alpha = 1e-3 per audit: 2 or more certificates in 100 audits has probability <= 5e-3
    eps = 0.05
    results = _certifications(leaky(_leak_for(1.5 * eps)), eps, range(100))
    assert sum(r.certification == "certified" for r in results) <= 1
    # the interval holds the exact TV (coverage >= 1 - alpha; 2 or more misses: probability <= 5e-3)
    assert sum(not r.tv_lower <= 1.5 * eps <= r.tv_upper for r in results) <= 1
    # ... and none is a PASS: refuted (a finding) or, the budget spent, inconclusive
    assert {r.verdict for r in results} <= {"FINDING", "INCONCLUSIVE"}


def test_a_correct_verifier_is_certified_within_the_planned_budget():
    # planned for power 0.99 (and a false alarm of the exactness family costs <= 1e-3): 5 or more
    # misses in 100 audits has probability <= 4e-3
    eps = 0.05
    results = _certifications(leaky(0.0), eps, range(100, 200))
    missed = [r for r in results if r.certification != "certified"]
    assert len(missed) <= 4
    assert all(r.num_samples <= r.planned_samples for r in results)
    assert all(r.verdict == "CERTIFIED" for r in results if r not in missed)
    # it stops at the first look that certifies: often before the plan's end, which is conservative
    assert min(r.num_samples for r in results) < results[0].planned_samples


def _library_case(verifier):
    num_drafts = 4 if verifier.supports(4, 1) or verifier.supports(4, 2) else 1
    return num_drafts, 1 if verifier.supports(num_drafts, 1) else 2


def library_coverage(num_samples: int, seeds) -> dict:
    """Per broken verifier: its exact TV on the audited partition and the intervals over ``seeds``."""
    out = {}
    for name in broken_names():
        verifier = load_broken(name)
        num_drafts, draft_len = _library_case(verifier)
        exact = exact_iteration(verifier, DRAFT8, TARGET8, num_drafts, draft_len)
        partition = build_partition(TARGET8, draft_len + 1, num_samples)
        tv = partition_tv(exact.implied_law, partition)
        rows = []
        for seed in seeds:
            result = statistical_audit(verifier, DRAFT8, TARGET8, num_drafts, draft_len, num_samples=num_samples,
                                       stratify=False, seed=seed, alpha=ALPHA)
            assert result.partition == partition.summary()  # the interval is on this partition
            rows.append((result.tv_estimate, result.tv_lower, result.tv_upper, result.num_samples))
        out[name] = (tv, exact.tv_distance, rows)
    return out


def test_the_interval_covers_every_broken_verifiers_exact_tv_on_its_partition():
    # 10 verifiers x 8 seeds = 80 intervals at level 1 - 1e-3: 2 or more misses has probability <= 4e-3
    coverage = library_coverage(8192, range(8))
    misses = sum(not low <= tv <= high for tv, _, rows in coverage.values() for _, low, high, _ in rows)
    assert misses <= 1
    for name, (tv, full_tv, rows) in coverage.items():
        assert tv <= full_tv + 1e-12, name  # a coarsened TV bounds the full one from below
        # a slip as large as these is seen: the interval excludes 0 for every TV above its width
        if tv > 0.15:
            assert all(low > 0 for _, low, _, _ in rows), name


@pytest.mark.slow
def test_interval_coverage_over_many_seeds_and_two_sample_sizes():
    # 10 verifiers x 100 seeds x 2 sizes = 2000 intervals at level 1 - 1e-3: 7 or more misses has
    # probability <= 1e-3 (binomial(2000, 1e-3))
    misses = total = 0
    for num_samples in (8192, 65536):
        for tv, _, rows in library_coverage(num_samples, range(1000, 1100)).values():
            misses += sum(not low <= tv <= high for _, low, high, _ in rows)
            total += len(rows)
    assert misses <= stats.binom.isf(1e-3, total, 1e-3)


@pytest.mark.slow
@pytest.mark.parametrize("eps", [0.05, 0.02])
def test_certification_error_rate_over_many_seeds(eps):
    # TV at 1.05 EPS, just above the tolerance: certified at most at rate alpha (the interval's
    # validity); 1000 audits, 4 or more certificates has probability <= 2e-2 at rate 1e-3
    results = _certifications(leaky(_leak_for(1.05 * eps)), eps, range(5000, 6000))
    assert sum(r.certification == "certified" for r in results) <= 3
    correct = _certifications(leaky(0.0), eps, range(7000, 7300))
    # power 0.99 planned: 10 or more of 300 not certified has probability <= 2e-3
    assert sum(r.certification != "certified" for r in correct) <= 9
    assert not math.isnan(correct[0].tv_estimate)
