"""Every test family holds its stated false-alarm rate on the partitions the audit builds, by construction.

Counts are drawn from each partition's own null law (spectr_audit.statistical.calibration): no
verifier is involved, so the null holds and every rejection is a false alarm.  A family fails
when its rejections exceed the upper quantile of Binomial(draws, alpha) at a meta-level of 1%
over the whole table (Bonferroni over its rows), so each of these tests has a false-alarm rate of
at most 1% of its own, and is deterministic (fixed seeds).  The sweep down to 2.5e-4 on the
largest partitions is slow; ``python scripts/calibration_table.py`` prints the full table.
"""

from __future__ import annotations

import numpy as np
import pytest

from spectr_audit.drafting.models import random_markov
from spectr_audit.registry import load_verifier
from spectr_audit.statistical.calibration import (
    acceptance_pvalues,
    audit_partitions,
    block_efficiency_pvalues,
    calibration_table,
    eprocess_pvalues,
    null_rejections,
    rejections,
    stratified_null,
    stratified_pvalues,
)
from spectr_audit.statistical.partition import build_partition

pytestmark = pytest.mark.usefixtures("single_thread")

META = 0.01


def _above(rows):
    meta = META / len(rows)
    return [(r.family, r.case, r.alpha, r.rejections, r.limit(meta)) for r in rows if r.exceeds(meta)]


def test_the_g_tests_hold_their_level_on_every_partition_the_audit_builds():
    rows = calibration_table("fast", draws=1000, alphas=(0.05, 0.01), families=("g-test", "depth family"))
    assert len(rows) >= 40 and max(r.num_cells for r in rows) > 6000
    assert _above(rows) == []


def test_the_check_catches_the_plain_chi_square_g_test():
    # what the audit used before: the G statistic against chi2(C - 1) rejects an exact verifier's
    # counts at several times its level on a depth-5 tree's 7,709 cells
    partition = build_partition(random_markov(5, seed=2), 6, 200_000)
    probs = partition.cell_probs.numpy()
    rows = null_rejections("g-test (chi-square)", probs[probs > 0], 200_000, alphas=(0.05, 0.01), draws=400, seed=1)
    assert all(r.exceeds() and r.rate > 3 * r.alpha for r in rows)
    fixed = null_rejections("g-test", probs[probs > 0], 200_000, alphas=(0.05, 0.01), draws=400, seed=1)
    assert not any(r.exceeds() for r in fixed)


def test_the_other_families_hold_their_level():
    rng = np.random.default_rng(3)
    rows = []
    null = stratified_null(load_verifier("kseq"), rng.dirichlet(np.ones(8)), rng.dirichlet(np.ones(8)), 2)
    for family in ("stratified-pearson", "conditional-g", "aggregated-pearson"):
        rows += rejections(family, null.case, stratified_pvalues(family, null, 20_000, 300, seed=2), (0.05, 0.01),
                           num_cells=64, num_samples=20_000, min_expected=5.0)
    rows += rejections("block-efficiency", "at the bound", block_efficiency_pvalues((0.6, 0.3), 5_000, 2000, 4),
                       (0.05, 0.01), num_cells=3, num_samples=5_000, min_expected=5.0)
    rows += rejections("acceptance", "at alpha*", acceptance_pvalues(0.8, 5_000, 2000, 5), (0.05, 0.01),
                       num_cells=2, num_samples=5_000, min_expected=5.0)
    _, partition, _ = audit_partitions("fast")[2]
    rows += rejections("e-process", "V = 8", eprocess_pvalues(partition, [4096, 8192, 16384], 300, 6), (0.05, 0.01),
                       num_cells=partition.num_cells, num_samples=28_672, min_expected=5.0)
    assert _above(rows) == []


@pytest.mark.slow
def test_the_g_tests_hold_their_level_down_to_a_thousandth_on_every_partition():
    rows = calibration_table("full", draws=4000, alphas=(0.05, 0.01, 0.001), families=("g-test", "depth family"))
    assert _above(rows) == []


@pytest.mark.slow
def test_the_g_test_holds_its_level_at_the_familys_bonferroni_share_on_the_largest_partitions():
    # alpha / m for the default alpha = 1e-3 and a tree audit's family of 4 to 8: 2.5e-4.  40,000 draws:
    # 10 expected rejections, the limit at meta-level 1% / 2 is 20.
    rows = []
    for case, partition, num_samples in audit_partitions("fast")[6:]:
        probs = partition.cell_probs.numpy()
        rows += null_rejections("g-test", probs[probs > 0], num_samples, alphas=(2.5e-4,), draws=40_000, seed=9,
                                case=case)
    assert _above(rows) == []


@pytest.mark.slow
def test_the_stratified_and_sampler_families_hold_their_level_on_many_strata():
    rng = np.random.default_rng(3)
    rows = []
    for name, vocab_size, num_drafts, num_samples in (("speculative", 8, 1, 20_000), ("kseq", 8, 2, 200_000),
                                                     ("rrs", 6, 3, 50_000), ("kseq", 4, 4, 50_000)):
        null = stratified_null(load_verifier(name), rng.dirichlet(np.ones(vocab_size)),
                               rng.dirichlet(np.ones(vocab_size)), num_drafts)
        for family in ("stratified-pearson", "conditional-g", "conditional-pearson", "aggregated-pearson"):
            rows += rejections(family, null.case, stratified_pvalues(family, null, num_samples, 600, seed=7),
                               (0.05, 0.01), num_cells=null.laws.shape[1], num_samples=num_samples,
                               min_expected=5.0)
    assert _above(rows) == []
