"""The auditor is calibrated: on correct verifiers its p-values are uniform and it false-alarms
at (at most) its stated rate.

Note on these meta-tests: each collects the p-values of many audits of a correct verifier, run
with consecutive fixed seeds, and tests them.  Every meta-test states its own false-alarm rate
(1e-3 unless said otherwise), so the whole file, about a dozen meta-tests, would fail by chance
with probability about 1e-2 under fresh seeds; with the fixed seeds it is deterministic.  If
one fails after a change, the change moved a null distribution: look at which sub-test's
p-values piled up (``collect`` returns them all).
"""

from __future__ import annotations

import numpy as np
import pytest
from scipy import stats

from spectr_audit.registry import load_verifier
from spectr_audit.statistical.audit import sampler_law_agreement, statistical_audit

from tests._models import DRAFT8, DRAFT_MARKOV, TARGET8, TARGET_MARKOV

META_ALPHA = 1e-3

pytestmark = pytest.mark.usefixtures("single_thread")  # one torch thread (tests/conftest.py)


# (id, verifier, draft model, target model, K, L, prefix, samples per audit, audits)
CALIBRATION_CASES = [
    ("speculative-v8", "speculative", DRAFT8, TARGET8, 1, 1, (), 8192, 200),
    ("rrs-v8-k3", "rrs", DRAFT8, TARGET8, 3, 1, (), 4096, 150),
    ("kseq-v8-k2", "kseq", DRAFT8, TARGET8, 2, 1, (), 2048, 60),
    ("speculative-markov-l2", "speculative", DRAFT_MARKOV, TARGET_MARKOV, 1, 2, (1,), 4096, 150),
]


def collect(name, draft_model, target_model, num_drafts, draft_len, prefix, num_samples, num_audits, alpha=0.05,
            first_seed=1000):
    """Raw p-values of every sub-test, and the family p-values, over ``num_audits`` seeds."""
    raw: dict[str, list[float]] = {}
    family = []
    verifier = load_verifier(name)
    for seed in range(first_seed, first_seed + num_audits):
        result = statistical_audit(verifier, draft_model, target_model, num_drafts, draft_len, prefix=prefix,
                                   num_samples=num_samples, seed=seed, alpha=alpha)
        for test in result.subtests:
            raw.setdefault(test.name, []).append(test.pvalue)
        family.append(result.pvalue)
    return raw, np.array(family)


@pytest.fixture(scope="module", params=CALIBRATION_CASES, ids=[c[0] for c in CALIBRATION_CASES])
def calibration(request):
    _, name, draft_model, target_model, num_drafts, draft_len, prefix, num_samples, num_audits = request.param
    return collect(name, draft_model, target_model, num_drafts, draft_len, prefix, num_samples, num_audits)


def test_chi_square_pvalues_are_uniform(calibration):
    raw, _ = calibration
    for name in sorted(raw):
        if name.startswith("g-test") or name == "stratified-pearson":
            # KS against U(0, 1) at META_ALPHA (the chi-square tests are continuous enough at these n)
            assert stats.kstest(raw[name], "uniform").pvalue > META_ALPHA, name


def test_family_false_alarm_rate_is_within_its_bound(calibration):
    # Audits ran at alpha = 0.05: the number with pvalue <= 0.05 is at most Binomial(R, 0.05)
    # under a calibrated (possibly conservative) auditor; fail beyond its 1 - META_ALPHA quantile.
    _, family = calibration
    alarms = int((family <= 0.05).sum())
    assert alarms <= stats.binom.isf(META_ALPHA, family.size, 0.05)


def test_sequential_test_rarely_fires_on_correct_verifiers(calibration):
    raw, _ = calibration
    evalues = np.array(raw["e-process"])
    # anytime-valid: P(p <= 0.05) <= 0.05
    assert (evalues <= 0.05).sum() <= stats.binom.isf(META_ALPHA, evalues.size, 0.05)


def test_acceptance_bound_is_tight_for_single_draft():
    # For K = 1 alpha* = sum min(p, q) is attained by speculative sampling: the one-sided exact
    # binomial p-values are then (discretely) uniform, not stuck at 1.
    raw, _ = collect("speculative", DRAFT8, TARGET8, 1, 1, (), 4096, 120, first_seed=5000)
    pvalues = np.array(raw["acceptance<=optimal"])
    assert (pvalues <= 0.05).sum() <= stats.binom.isf(META_ALPHA, pvalues.size, 0.05)
    assert 0.3 < np.mean(pvalues) < 0.7


@pytest.mark.parametrize("name,num_drafts", [("rrs", 3), ("kseq", 2)])
def test_sampler_law_agreement_is_calibrated(name, num_drafts):
    # 80 checks of correct verifiers (sampler = law): aggregated and per-tuple p-values uniform.
    raw: dict[str, list[float]] = {}
    for seed in range(80):
        result = sampler_law_agreement(load_verifier(name), DRAFT8, TARGET8, num_drafts, num_samples=4096,
                                       seed=7000 + seed)
        for test in result.subtests:
            raw.setdefault(test.name, []).append(test.pvalue)
    for test in ("aggregated-pearson", "per-tuple-pearson"):
        assert stats.kstest(raw[test], "uniform").pvalue > META_ALPHA, test


@pytest.mark.slow
def test_false_alarm_rate_at_the_default_alpha():
    # 3000 audits of correct verifiers at the default alpha = 1e-3 (small samples, so this is the
    # chi-square approximation's worst case).  Fails beyond the 1 - 1e-3 quantile of
    # Binomial(3000, 1e-3), i.e. 9 alarms.
    alarms = 0
    cases = [("speculative", DRAFT8, TARGET8, 1, 1, ()), ("rrs", DRAFT8, TARGET8, 2, 1, ()),
             ("speculative", DRAFT_MARKOV, TARGET_MARKOV, 1, 2, (1,))]
    for index, (name, draft_model, target_model, num_drafts, draft_len, prefix) in enumerate(cases):
        _, family = collect(name, draft_model, target_model, num_drafts, draft_len, prefix, 4096, 1000,
                            alpha=1e-3, first_seed=20_000 + 10_000 * index)
        alarms += int((family <= 1e-3).sum())
    assert alarms <= stats.binom.isf(1e-3, 3000, 1e-3)


@pytest.mark.slow
@pytest.mark.parametrize("name,num_drafts", [("kseq", 4), ("rrs", 4), ("speculative", 1)])
def test_pvalues_are_uniform_over_many_seeds(name, num_drafts):
    raw, _ = collect(name, DRAFT8, TARGET8, num_drafts, 1, (), 20_000, 400, first_seed=40_000)
    for test in sorted(raw):
        if test.startswith("g-test") or test == "stratified-pearson":
            assert stats.kstest(raw[test], "uniform").pvalue > META_ALPHA, test
