"""The whole audit's false-alarm rate and its TV bounds, on exact verifiers audited as black boxes.

Every family runs as it does on an engine (a G-test per depth, acceptance, block efficiency, the
e-process, the stratified test, the support check; Holm).  The verifiers are exact, so every
FINDING is a false alarm and every TV is 0; the broken library gives TVs that are not.  Each
meta-test states its own false-alarm rate and uses fixed seeds.
``python scripts/familywise_rate.py --seeds 1000`` runs the 1,000-audit sweep.
"""

from __future__ import annotations

import ast

import numpy as np
import pytest
import torch
from scipy import stats

from spectr_audit.contract.tree import DraftTree
from spectr_audit.drafting.models import ContextFreeModel, random_markov
from spectr_audit.exact.iteration import exact_iteration
from spectr_audit.registry import broken_names, load_broken, load_tree_verifier, load_verifier
from spectr_audit.statistical.audit import statistical_audit
from spectr_audit.statistical.calibration import as_black_box
from spectr_audit.statistical.confidence import partition_tv
from spectr_audit.statistical.partition import build_partition

pytestmark = pytest.mark.usefixtures("single_thread")

#: EAGLE-1's shipped tree mc_sim_7b_63 (25 draft nodes, depth 5).
EAGLE_TREE = DraftTree.from_paths([tuple(p) for p in ast.literal_eval(
    "[[0],[1],[2],[3],[0,0],[0,1],[0,2],[1,0],[1,1],[2,0],[2,1],[3,0],[0,0,0],[0,0,1],[0,0,2],[0,1,0],[0,1,1],"
    "[0,2,0],[0,2,1],[1,0,0],[0,0,0,0],[0,0,0,1],[0,0,0,2],[0,0,0,0,0],[0,0,0,0,1]]")])
MARKOV_DRAFT, MARKOV_TARGET = random_markov(5, seed=1), random_markov(5, seed=2)


def _eagle_case_audit(seed: int, num_samples: int = 200_000):
    verifier = as_black_box(load_tree_verifier("tree-rrs-wor"), tree=True)
    return statistical_audit(verifier, MARKOV_DRAFT, MARKOV_TARGET, 4, 5, tree=EAGLE_TREE,
                             draft_scheme="without_replacement", max_samples=num_samples, seed=seed)


def test_an_exact_tree_verifier_on_a_depth_five_tree_is_not_a_finding_at_seed_33():
    # the case where the plain chi-square G-test false-alarmed (adjusted p 5.7e-5 on 7,709 cells)
    result = _eagle_case_audit(33)
    assert result.verdict != "FINDING" and result.pvalue > 1e-3
    assert result.num_cells == 7709 and [d.depth for d in result.depths] == [1, 2, 3, 4, 5, 6]
    # the plug-in is sampling noise (its floor is most of it); the held-out estimate and the lower bound are not
    assert result.tv_plug_in > 0.05 and abs(result.tv_plug_in - result.tv_noise_floor) < 0.01
    assert result.tv_lower == 0.0 and result.tv_estimate < 0.01 < result.tv_upper
    assert result.depths[0].min_detectable_tv < result.depths[-1].min_detectable_tv


def _chain_cases():
    rng = np.random.default_rng(5)
    v8 = [ContextFreeModel(torch.from_numpy(rng.dirichlet(np.ones(8)))) for _ in range(2)]
    speculative, kseq, block = (as_black_box(load_verifier(n)) for n in ("speculative", "kseq", "block"))
    return [
        lambda seed: statistical_audit(speculative, ContextFreeModel([0.6, 0.4]), ContextFreeModel([0.3, 0.7]), 1,
                                       num_samples=20_000, seed=seed),
        lambda seed: statistical_audit(kseq, v8[0], v8[1], 2, num_samples=50_000, seed=seed),
        lambda seed: statistical_audit(block, MARKOV_DRAFT, MARKOV_TARGET, 1, 2, num_samples=30_000, seed=seed),
    ]


@pytest.mark.slow
def test_the_familywise_rate_of_exact_chain_verifiers_is_at_most_alpha():
    # 3 cases x 150 seeds = 450 audits; the family p-value at 0.05 (a rejection at the default 1e-3,
    # early stops included, is one at 0.05).  Calibrated: at most Binomial(450, 0.05), fail beyond its
    # 99.9% quantile (meta false-alarm rate 1e-3).
    pvalues = [audit(seed).pvalue for audit in _chain_cases() for seed in range(20_000, 20_150)]
    for alpha in (0.05, 0.01):
        assert sum(p <= alpha for p in pvalues) <= stats.binom.isf(1e-3, len(pvalues), alpha), alpha


@pytest.mark.slow
def test_the_familywise_rate_on_the_depth_five_tree_is_at_most_alpha():
    # 20 audits of 7,709 cells at 0.05: at most Binomial(20, 0.05); fail beyond its 99.9% quantile (5)
    pvalues = [_eagle_case_audit(seed).pvalue for seed in range(20)]
    assert sum(p <= 0.05 for p in pvalues) <= stats.binom.isf(1e-3, 20, 0.05)


def test_the_tv_bounds_cover_the_exact_tv_on_large_sparse_partitions():
    # V = 50, K = 1: 760 cells of about 5 expected samples at 20,000 samples.  Every broken verifier
    # that runs at K = 1 (its exact TV on the partition from its exact law) x 6 seeds, at level 1 - 1e-3:
    # 2 or more misses out of 60-odd has probability below 2e-3.
    rng = np.random.default_rng(8)
    draft = ContextFreeModel(torch.from_numpy(rng.dirichlet(np.full(50, 0.5))))
    target = ContextFreeModel(torch.from_numpy(rng.dirichlet(np.full(50, 0.5))))
    partition = build_partition(target, 2, 20_000)
    misses = total = 0
    seen = []
    for name in broken_names():
        verifier = load_broken(name)
        if not verifier.supports(1, 1):
            continue
        tv = partition_tv(exact_iteration(verifier, draft, target, 1, 1).implied_law, partition)
        for seed in range(6):
            result = statistical_audit(as_black_box(verifier), draft, target, 1, num_samples=20_000, seed=seed)
            assert result.partition == partition.summary()
            misses += not (result.tv_lower <= tv + 1e-12 and tv <= result.tv_upper + 1e-12)
            total += 1
            seen.append((tv, result.tv_estimate, result.tv_plug_in))
    assert total >= 30 and misses <= 1
    exact = [(estimate, plug_in) for tv, estimate, plug_in in seen if tv == 0]
    if exact:  # an exact one among them: the plug-in is noise, the held-out estimate is not
        assert max(e for e, _ in exact) < 0.5 * min(p for _, p in exact)
