"""The statistical audit: its building blocks against slow oracles, and its public API.

Note on randomized tests: every seed is fixed, so each test is deterministic.  Each
statistical assertion states the false-alarm rate it would have under fresh seeds; a failure
after a code change means the change moved a distribution, and rerunning with other seeds
will not make it go away.
"""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch
from scipy import stats
from statsmodels.stats.multitest import multipletests

from spectr_audit.contract.verifier import FunctionVerifier, VerifyOutput
from spectr_audit.errors import InvalidArgument, VerifierError
from spectr_audit.exact.iteration import exact_iteration
from spectr_audit.statistical.gof import (
    PlugInEProcess,
    binomial_above,
    binomial_below,
    conditional_pearson_test,
    g_test,
    holm,
    independent_sum_test,
    pearson_test,
    pool_sparse,
    stratified_pearson_test,
    weighted_chi2_sf,
)
from spectr_audit.drafting.harness import draft
from spectr_audit.drafting.models import ContextFreeModel
from spectr_audit.statistical.sampling import (
    build_partition,
    complete_with_target,
    default_chunk_size,
    draw_drafts,
    emitted_strings,
)
from spectr_audit.registry import load_verifier
from spectr_audit.statistical.audit import sampler_law_agreement, statistical_audit
from spectr_audit.registry import load_broken

from tests._models import DRAFT8, DRAFT_MARKOV, TARGET8, TARGET_MARKOV

#: Audits of correct verifiers run at this false-alarm rate each.
ALPHA = 1e-3

pytestmark = pytest.mark.usefixtures("single_thread")  # one torch thread (tests/conftest.py)


# ---------------------------------------------------------------------------------------------
# Goodness-of-fit building blocks
# ---------------------------------------------------------------------------------------------

# (observed, probs, min_expected) -> (pooled observed, pooled probs, pooled mass)
POOL_CASES = [
    ([50, 30, 20], [0.5, 0.3, 0.2], 5, [50, 30, 20], [0.5, 0.3, 0.2], 0.0),
    # the two rare cells (expected 2 and 3) pool into one cell of expected 5
    ([90, 4, 6], [0.95, 0.02, 0.03], 5, [90, 10], [0.95, 0.05], 0.05),
    # one rare cell (expected 1) cannot stand alone: it joins the smallest kept cell
    ([60, 38, 2], [0.6, 0.39, 0.01], 5, [60, 40], [0.6, 0.4], 0.01),
    # zero-probability cells are dropped (their observations are the support check's)
    ([50, 50, 0], [0.5, 0.5, 0.0], 5, [50, 50], [0.5, 0.5], 0.0),
]


@pytest.mark.parametrize("observed,probs,min_expected,out_obs,out_probs,pooled_mass", POOL_CASES)
def test_pool_sparse_cases(observed, probs, min_expected, out_obs, out_probs, pooled_mass):
    obs, pooled_probs, mass, _ = pool_sparse(observed, probs, min_expected)
    assert obs.tolist() == out_obs
    assert pooled_probs.tolist() == pytest.approx(out_probs)
    assert mass == pytest.approx(pooled_mass)


def test_pearson_and_g_match_scipy_without_pooling():
    rng = np.random.default_rng(0)
    probs = rng.dirichlet(np.ones(10)) * 0.5 + 0.05
    probs /= probs.sum()
    observed = rng.multinomial(5000, probs)
    chi = stats.power_divergence(observed, 5000 * probs, lambda_="pearson")
    g = stats.power_divergence(observed, 5000 * probs, lambda_="log-likelihood")
    assert pearson_test(observed, probs).statistic == pytest.approx(chi.statistic)
    assert pearson_test(observed, probs).pvalue == pytest.approx(chi.pvalue)
    assert g_test(observed, probs).statistic == pytest.approx(g.statistic)
    # the G-test's null is its exact-moment scaled chi-square: at 5,000 samples over 10 cells, within
    # 1% of the plain chi-square's p-value (it differs by design on sparse partitions)
    assert g_test(observed, probs).pvalue == pytest.approx(g.pvalue, rel=1e-2)


def test_weighted_chi2_equal_weights_is_scaled_chi2():
    for df in (1, 3, 20):
        for x in (0.5, 5.0, 40.0):
            assert weighted_chi2_sf(x, [0.7] * df) == pytest.approx(stats.chi2.sf(x / 0.7, df), rel=1e-12)


@pytest.mark.parametrize("weights", [[1.0, 0.5, 0.25], [1.0, 1e-3, 1e-3], list(np.linspace(0.05, 1.0, 30))])
def test_weighted_chi2_against_monte_carlo(weights):
    # 1e6 Monte-Carlo draws: the sd of an estimated tail probability P is sqrt(P(1-P)/1e6); we
    # allow 5 sd plus 1% relative error (false-alarm rate ~1e-6 per comparison).
    rng = np.random.default_rng(5)
    weights = np.array(weights)
    draws = (rng.standard_normal((1_000_000, weights.size)) ** 2 * weights).sum(1)
    for quantile in (0.5, 0.9, 0.99, 0.999):
        x = float(np.quantile(draws, quantile))
        mc = float((draws > x).mean())
        tolerance = 5 * math.sqrt(mc * (1 - mc) / draws.size) + 0.01 * mc
        assert abs(weighted_chi2_sf(x, weights) - mc) <= tolerance


def test_weighted_chi2_far_tail_is_monotone_and_positive():
    weights = [1.0, 0.6, 0.3, 0.1]
    values = [weighted_chi2_sf(x, weights) for x in (20, 40, 80, 160)]
    assert all(0 < b < a for a, b in zip(values, values[1:]))
    # the tail is dominated by the largest weight: between chi2(1) scaled and chi2(4) scaled
    assert stats.chi2.sf(80, 1) < values[2] < stats.chi2.sf(80, 4)


def _mixture_strata(rng, num_strata: int, num_cells: int):
    """Strata laws f_t and probabilities P(t) whose mixture is a known q."""
    laws = rng.dirichlet(np.full(num_cells, 0.5), size=num_strata)
    weights = rng.dirichlet(np.ones(num_strata))
    return laws, weights, weights @ laws


def test_stratified_pearson_is_calibrated_and_sees_shifts():
    # 300 exact-null replicates: KS uniformity at meta-level 1e-3.
    rng = np.random.default_rng(7)
    laws, weights, mixture = _mixture_strata(rng, 12, 6)
    n = 6000
    alloc = np.maximum(2, np.round(weights * n)).astype(int)

    def counts(stratum_laws):
        return torch.tensor(np.stack([rng.multinomial(a, f) for a, f in zip(alloc, stratum_laws)]), dtype=torch.float64)

    w, q = torch.tensor(weights), torch.tensor(mixture)
    pvalues = [stratified_pearson_test(counts(laws), w, q).pvalue for _ in range(300)]
    assert stats.kstest(pvalues, "uniform").pvalue > 1e-3
    # a shift of one heavy stratum's law, moving the mixture by TV > 0.04, is seen at this n
    heavy = int(np.argmax(weights))
    shifted = laws.copy()
    shifted[heavy] = 0.8 * laws[heavy] + 0.2 * np.eye(6)[0]
    assert 0.5 * np.abs(weights @ shifted - mixture).sum() > 0.04
    assert stratified_pearson_test(counts(shifted), w, q).pvalue < 1e-6


def test_stratification_removes_the_draft_noise():
    # Strata that nearly determine the cell (high acceptance): an unstratified sample's noise is
    # mostly the draw of the stratum.  A shift of the mixture by TV 0.01 at n = 4000 is then
    # clear to the stratified test and invisible to Pearson on an i.i.d. sample of the same size.
    rng = np.random.default_rng(8)
    laws = np.eye(4) * 0.96 + 0.01
    weights = np.array([0.4, 0.3, 0.2, 0.1])
    mixture = weights @ laws
    shifted = laws.copy()
    shifted[0] += np.array([-0.025, 0.0, 0.0, 0.025])
    assert 0.5 * np.abs(weights @ shifted - mixture).sum() == pytest.approx(0.01)
    n = 4000
    alloc = np.round(weights * n).astype(int)
    strat = torch.tensor(np.stack([rng.multinomial(a, f) for a, f in zip(alloc, shifted)]), dtype=torch.float64)
    assert stratified_pearson_test(strat, torch.tensor(weights), torch.tensor(mixture)).pvalue < 1e-3
    plain = rng.multinomial(n, weights @ shifted)
    assert pearson_test(plain, mixture).pvalue > 1e-3


def test_conditional_pearson_sums_independent_strata():
    rng = np.random.default_rng(9)
    laws = rng.dirichlet(np.ones(5), size=7)
    pvalues = []
    for _ in range(200):
        observed = np.stack([rng.multinomial(400, f) for f in laws])
        result = conditional_pearson_test(torch.tensor(observed, dtype=torch.float64),
                                          torch.tensor(400 * laws))
        pvalues.append(result.pvalue)
    assert result.df <= 7 * 4
    assert stats.kstest(pvalues, "uniform").pvalue > 1e-3  # meta false-alarm rate 1e-3


def test_independent_sum_test_is_calibrated_with_heterogeneous_laws():
    # 2000 samples, each with its own (mostly concentrated) law over 6 cells; 300 replicates,
    # KS uniformity at meta-level 1e-3.  The multinomial chi-square would be very conservative here.
    rng = np.random.default_rng(13)
    laws = torch.tensor(rng.dirichlet(np.full(6, 0.2), size=2000))
    expected, moment = laws.sum(0), laws.T @ laws
    cumulative = laws.cumsum(1).numpy()
    pvalues, plain = [], []
    for _ in range(300):
        cells = (rng.uniform(size=(2000, 1)) > cumulative).sum(1).clip(max=5)
        observed = torch.bincount(torch.tensor(cells), minlength=6).double()
        pvalues.append(independent_sum_test(observed, expected, moment).pvalue)
        plain.append(pearson_test(observed, expected / 2000).pvalue)
    assert stats.kstest(pvalues, "uniform").pvalue > 1e-3
    assert np.mean(plain) > 0.6  # the multinomial null is conservative for such counts


def test_eprocess_is_anytime_valid_and_grows_under_alternatives():
    # Ville: P(sup E >= 20) <= 1/20 under the null.  400 null runs of 20 chunks each; failing
    # needs more than binom.isf(1e-4, 400, 0.05) crossings (false-alarm rate 1e-4).
    rng = np.random.default_rng(10)
    probs = rng.dirichlet(np.ones(6))
    crossings = 0
    for _ in range(400):
        process = PlugInEProcess(torch.tensor(probs))
        for _ in range(20):
            process.update(torch.tensor(rng.multinomial(500, probs), dtype=torch.float64))
        crossings += process.max_log_e >= math.log(20)
    assert crossings <= stats.binom.isf(1e-4, 400, 0.05)
    alternative = 0.8 * probs + 0.2 * np.eye(6)[0]
    process = PlugInEProcess(torch.tensor(probs))
    for _ in range(10):
        process.update(torch.tensor(rng.multinomial(2000, alternative), dtype=torch.float64))
    assert process.pvalue < 1e-20


def test_binomial_tests_match_scipy():
    assert binomial_above(70, 100, 0.6, "x").pvalue == pytest.approx(
        stats.binomtest(70, 100, 0.6, alternative="greater").pvalue)
    assert binomial_below(50, 100, 0.6, "x").pvalue == pytest.approx(
        stats.binomtest(50, 100, 0.6, alternative="less").pvalue)
    assert binomial_above(100, 100, 1.0, "x").pvalue == 1.0  # nothing exceeds a bound of 1


def test_holm_matches_statsmodels():
    rng = np.random.default_rng(12)
    for size in (1, 2, 5, 9):
        pvalues = rng.uniform(0, 0.1, size)
        assert holm(pvalues) == pytest.approx(list(multipletests(pvalues, method="holm")[1]))


# ---------------------------------------------------------------------------------------------
# The Monte-Carlo harness
# ---------------------------------------------------------------------------------------------


def test_emitted_strings_match_the_contract_definition():
    generator = torch.Generator().manual_seed(0)
    draft_tokens = torch.randint(0, 5, (200, 3, 2), generator=generator)
    output = VerifyOutput(
        torch.randint(0, 3, (200,), generator=generator),
        torch.randint(0, 3, (200,), generator=generator),
        torch.randint(0, 5, (200,), generator=generator),
    )
    strings, lengths = emitted_strings(draft_tokens, output, num_tokens=4)
    for row, expected in enumerate(output.emitted(draft_tokens)):  # the contract's slow definition
        assert strings[row, : lengths[row]].tolist() == expected
        assert (strings[row, lengths[row] :] == -1).all()


def test_full_partition_cells_are_the_strings_themselves():
    partition = build_partition(TARGET_MARKOV, 3, num_samples=10**7)
    assert partition.is_full and partition.num_cells == 4**3
    strings = torch.cartesian_prod(*[torch.arange(4)] * 3)
    cells = partition.cells_of(strings)
    assert torch.equal(partition.cell_strings[cells], strings)
    assert sorted(cells.tolist()) == list(range(64))


def test_coarse_partition_cells_are_prefixes_with_their_probability():
    partition = build_partition(TARGET_MARKOV, 4, num_samples=400)
    assert not partition.is_full
    strings = torch.cartesian_prod(*[torch.arange(4)] * 4)
    cells = partition.cells_of(strings)
    joint = exact_iteration(load_verifier("speculative"), DRAFT_MARKOV, TARGET_MARKOV, 1, 3).target_law[-1]
    for cell in range(partition.num_cells):
        members = cells == cell
        depth = int(partition.cell_depth[cell])
        assert (strings[members, :depth] == partition.cell_strings[cell, :depth]).all()
        assert float(joint[members].sum()) == pytest.approx(float(partition.cell_probs[cell]), abs=1e-12)


def test_completion_follows_the_markov_target():
    # 40000 completions of fixed one-token strings after a prefix; Pearson over 4^3 strings at
    # level 1e-4 (the false-alarm rate of this test).
    generator = torch.Generator().manual_seed(1)
    n = 40000
    strings = torch.full((n, 3), -1, dtype=torch.int64)
    strings[:, 0] = 2
    out = complete_with_target(strings, torch.ones(n, dtype=torch.int64), TARGET_MARKOV, generator, prefix=(1,))
    assert (out[:, 0] == 2).all()
    context = torch.tensor([[1, 2]])
    second = TARGET_MARKOV(context)[0]
    expected = torch.stack([second[a] * TARGET_MARKOV(torch.tensor([[1, 2, a]]))[0] for a in range(4)]).reshape(-1)
    observed = torch.bincount(out[:, 1] * 4 + out[:, 2], minlength=16)
    assert pearson_test(observed, expected).pvalue > 1e-4


def test_fast_drafting_path_has_the_harness_law():
    # Context-free fast path vs the generic harness: both draw tokens from the draft law
    # (two Pearson tests at 1e-4 each).
    generator = torch.Generator().manual_seed(2)
    fast = draw_drafts(DRAFT8, TARGET8, 3, 2, 20000, generator)
    slow = draft(DRAFT8, TARGET8, torch.zeros(20000, 0, dtype=torch.int64), 3, 2, generator)
    for batch in (fast, slow):
        assert torch.equal(batch.draft_probs[0, 0, 0], DRAFT8.probs)
        assert torch.equal(batch.target_probs[5, 2, 2], TARGET8.probs)
        counts = torch.bincount(batch.draft_tokens.reshape(-1), minlength=8)
        assert pearson_test(counts, DRAFT8.probs).pvalue > 1e-4


def test_default_chunk_size_bounds_memory():
    assert default_chunk_size(4, 1, 8) == 1 << 14  # 8 MB of target_probs on a CPU
    assert default_chunk_size(4, 1, 8, "cuda") == 1 << 18
    assert default_chunk_size(4, 4, 32000) == 64  # the floor: one row is already 5 MB
    assert default_chunk_size(2, 2, 1024) * 2 * 3 * 1024 <= 1 << 20


# ---------------------------------------------------------------------------------------------
# statistical_audit: correct verifiers pass, with the numbers they should have
# ---------------------------------------------------------------------------------------------

# (verifier, draft model, target model, K, L, prefix, num_samples): each audit is a level-1e-3
# test of a true null, so each case fails with probability <= 1e-3 under fresh seeds.
CORRECT_CASES = [
    ("speculative", DRAFT8, TARGET8, 1, 1, (), 60_000),
    ("kseq", DRAFT8, TARGET8, 2, 1, (), 30_000),
    ("rrs", DRAFT8, TARGET8, 3, 1, (), 60_000),
    ("rrs-wor", DRAFT8, TARGET8, 3, 1, (), 60_000),
    ("speculative", DRAFT_MARKOV, TARGET_MARKOV, 1, 2, (3,), 60_000),
    ("kseq", DRAFT_MARKOV, TARGET_MARKOV, 3, 1, (0, 2), 30_000),
    ("block", DRAFT_MARKOV, TARGET_MARKOV, 1, 2, (1,), 60_000),
    ("spectr-tree", DRAFT_MARKOV, TARGET_MARKOV, 2, 2, (), 30_000),
]


@pytest.mark.parametrize("name,draft_model,target_model,num_drafts,draft_len,prefix,num_samples", CORRECT_CASES)
def test_correct_verifiers_pass_and_their_acceptance_is_measured(name, draft_model, target_model, num_drafts,
                                                                 draft_len, prefix, num_samples):
    verifier = load_verifier(name)
    result = statistical_audit(verifier, draft_model, target_model, num_drafts, draft_len, prefix=prefix,
                               num_samples=num_samples, seed=3)
    assert not result.rejects(), result.to_dict()
    # The exact acceptance and block efficiency lie in 99.9% intervals (false-alarm rate 2e-3).
    exact = exact_iteration(verifier, draft_model, target_model, num_drafts, draft_len, prefix=prefix)
    low, high = result.acceptance_ci(0.999)
    assert low <= exact.acceptance <= high
    low, high = result.block_efficiency_ci(0.999)
    assert low <= exact.block_efficiency <= high
    assert result.acceptance <= result.optimal_acceptance + 1e-2


def test_result_json_carries_the_contract_fields():
    result = statistical_audit(load_verifier("kseq"), DRAFT8, TARGET8, 2, num_samples=20_000, seed=4)  # 64 strata
    data = json.loads(json.dumps(result.to_dict(), allow_nan=False))
    for key in ("pvalue", "test", "num_samples", "seed", "min_detectable_tv", "alpha", "power",
                "power_at_requested_tv", "subtests", "acceptance", "acceptance_ci", "worst_cells"):
        assert key in data
    assert data["seed"] == 4 and data["num_samples"] == result.num_samples
    assert {t["name"] for t in data["subtests"]} >= {"g-test@1", "g-test", "acceptance<=optimal", "e-process", "support"}
    stratified = next(t for t in result.subtests if t.name == "stratified-pearson")  # 64 draft tuples, grouped
    # one sample serves every sub-test: the stratified test post-stratifies the main sample
    assert result.num_samples == stratified.num_samples == 20_000
    assert 2 <= data["num_strata"] == result.num_strata <= 64
    assert [d["depth"] for d in data["depths"]] == [1, 2] and data["depths"][-1]["test"] == "g-test"
    assert result.optimality and result.optimality[0].name == "acceptance>=claimed"  # K-SEQ's SpecTr guarantee
    assert result.optimality_pvalue > ALPHA


def test_default_sample_size_meets_the_power_target():
    # No budget: the sample is the planned one, so the min detectable TV is the requested one.
    result = statistical_audit(load_verifier("speculative"), ContextFreeModel([0.6, 0.4]),
                               ContextFreeModel([0.3, 0.7]), 1, seed=0, stratify=False)
    assert result.stop_reason == "planned"
    assert result.min_detectable_tv == pytest.approx(0.005, rel=1e-3)
    assert result.power_at_requested_tv == pytest.approx(0.99, abs=1e-3)
    assert not result.rejects()


def test_budgets_report_the_power_that_remains():
    capped = statistical_audit(load_verifier("speculative"), DRAFT8, TARGET8, 1, max_samples=30_000, seed=1)
    assert capped.stop_reason == "max_samples"
    assert capped.min_detectable_tv > 0.005 and capped.power_at_requested_tv < 0.99
    timed = statistical_audit(load_verifier("speculative"), DRAFT8, TARGET8, 1, max_seconds=0.05, seed=1,
                              stratify=False)
    assert timed.stop_reason == "max_seconds" and timed.num_samples < 900_000
    assert timed.min_detectable_tv > 0.005


def test_same_seed_same_result_other_seed_other_sample():
    runs = [statistical_audit(load_verifier("rrs"), DRAFT8, TARGET8, 2, num_samples=8192, seed=s) for s in (5, 5, 6)]
    assert runs[0].subtests == runs[1].subtests
    assert runs[0].subtests[0].statistic != runs[2].subtests[0].statistic


def _speculative_function(bug: bool):
    """A third party's black box (a plain function, no output_probs): single-draft speculative sampling."""

    def verify(draft_tokens, draft_probs, target_probs, generator):
        token = draft_tokens[:, 0, 0]
        draft_dist, target_dist = draft_probs[:, 0, 0].double(), target_probs[:, 0, 0].double()
        ratio = target_dist.gather(1, token[:, None])[:, 0] / draft_dist.gather(1, token[:, None])[:, 0]
        u = torch.rand(token.shape, generator=generator, dtype=torch.float64)
        accept = u < ratio
        residual = target_dist if bug else (target_dist - draft_dist).clamp(min=0) + 1e-300
        fallback = torch.multinomial(residual, 1, generator=generator)[:, 0]
        bonus = torch.multinomial(target_probs[:, 0, 1].double(), 1, generator=generator)[:, 0]
        next_token = torch.where(accept, bonus, fallback)
        return accept.long(), torch.zeros_like(token), next_token

    return FunctionVerifier(verify, name="third-party" + ("-buggy" if bug else ""), max_drafts=1, max_draft_len=1)


def test_black_box_functions_are_audited():
    good = statistical_audit(_speculative_function(False), DRAFT8, TARGET8, 1, num_samples=50_000, seed=2)
    assert not good.rejects()
    bad = statistical_audit(_speculative_function(True), DRAFT8, TARGET8, 1, num_samples=50_000, seed=2)
    assert bad.rejects() and bad.pvalue < 1e-12
    assert bad.worst_cells and abs(bad.worst_cells[0].residual) > 5


def test_contract_breaches_of_black_boxes_are_verifier_errors():
    def broken(draft_tokens, draft_probs, target_probs, generator):
        n = draft_tokens.shape[0]
        return torch.zeros(n, dtype=torch.int64), torch.zeros(n, dtype=torch.int64), torch.full((n,), 99)

    with pytest.raises(VerifierError, match="next_token"):
        statistical_audit(FunctionVerifier(broken, name="out-of-range"), DRAFT8, TARGET8, 1, num_samples=1000)


def test_support_violation_is_certain():
    # The target never emits token 3; a verifier that always emits the draft's token does.
    target = ContextFreeModel([0.5, 0.3, 0.2, 0.0])
    draft_model = ContextFreeModel([0.25, 0.25, 0.25, 0.25])
    result = statistical_audit(load_broken("always-accept"), draft_model, target, 1, num_samples=50_000, seed=0)
    assert result.pvalue == 0.0 and result.test == "support" and result.stop_reason == "support"
    assert result.num_samples < 50_000  # stopped at the first chunk


def test_always_accept_exceeds_the_transport_bound():
    result = statistical_audit(load_broken("always-accept"), DRAFT8, TARGET8, 4, num_samples=20_000, seed=0,
                               sequential=False, stratify=False)
    assert result.acceptance == 1.0 > result.optimal_acceptance
    accept_test = next(t for t in result.subtests if t.name == "acceptance<=optimal")
    assert accept_test.pvalue < 1e-100


def test_optimality_gap_is_reported_apart_from_exactness():
    from spectr_audit.bounds.acceptance import optimal_acceptance

    alpha_star = optimal_acceptance(DRAFT8.probs, TARGET8.probs, 4).item()
    result = statistical_audit(load_verifier("rrs"), DRAFT8, TARGET8, 4, num_samples=50_000, seed=1,
                               claimed_acceptance=alpha_star)
    assert not result.rejects()  # exact...
    assert result.optimality_pvalue < 1e-6  # ...but below the optimum it was claimed to reach


def test_carried_corrections_are_judged_with_their_repair():
    # greedy block verification: inexact alone, exact with its carried correction.
    alone = statistical_audit(load_verifier("greedy-block"), ContextFreeModel([2 / 3, 1 / 3]),
                              ContextFreeModel([1 / 3, 2 / 3]), 1, 2, num_samples=100_000, seed=0)
    assert alone.rejects()
    repaired = statistical_audit(load_verifier("greedy-block-repaired"), ContextFreeModel([2 / 3, 1 / 3]),
                                 ContextFreeModel([1 / 3, 2 / 3]), 1, 2, num_samples=100_000, seed=0)
    assert not repaired.rejects(), repaired.to_dict()


def test_multi_iteration_runs_through_the_decoding_loop():
    good = statistical_audit(load_verifier("speculative"), DRAFT_MARKOV, TARGET_MARKOV, 1, 1, num_tokens=4,
                             prefix=(2,), num_samples=30_000, seed=0)
    assert not good.rejects() and good.num_tokens == 4 and good.acceptance_samples == 0
    bad = statistical_audit(load_broken("bonus-from-draft"), DRAFT_MARKOV, TARGET_MARKOV, 1, 1, num_tokens=4,
                            prefix=(2,), num_samples=30_000, seed=0)
    assert bad.rejects()


BAD_AUDIT_ARGS = [
    (dict(num_drafts=0), "num_drafts"),
    (dict(num_drafts=2), "num_drafts"),  # speculative supports K = 1 only
    (dict(draft_len=0), "draft_len"),
    (dict(num_tokens=1), "num_tokens"),
    (dict(prefix=(9,)), "prefix"),
    (dict(alpha=0.0), "alpha"),
    (dict(power=1.5), "power"),
    (dict(min_detectable_tv=0.0), "min_detectable_tv"),
    (dict(max_samples=0), "max_samples"),
    (dict(max_seconds=-1.0), "max_seconds"),
    (dict(stratify="yes"), "stratify"),
    (dict(seed=1.5), "seed"),
    (dict(claimed_acceptance=1.5), "claimed_acceptance"),
    (dict(target_model=ContextFreeModel([0.5, 0.5])), "target_model"),
]


@pytest.mark.parametrize("kwargs,argument", BAD_AUDIT_ARGS)
def test_bad_audit_arguments_name_the_argument(kwargs, argument):
    full = dict(verifier=load_verifier("speculative"), draft_model=DRAFT8, target_model=TARGET8, num_drafts=1)
    full.update(kwargs)
    with pytest.raises(InvalidArgument, match=argument):
        statistical_audit(**full)


# ---------------------------------------------------------------------------------------------
# A sampler against its own exact law
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "name,draft_model,target_model,num_drafts,draft_len",
    [("kseq", DRAFT8, TARGET8, 2, 1), ("rrs", DRAFT8, TARGET8, 3, 1), ("block", DRAFT_MARKOV, TARGET_MARKOV, 1, 2),
     ("spectr-tree", DRAFT_MARKOV, TARGET_MARKOV, 2, 2)],
)
def test_samplers_agree_with_their_own_law(name, draft_model, target_model, num_drafts, draft_len):
    # level 1e-3 each
    result = sampler_law_agreement(load_verifier(name), draft_model, target_model, num_drafts, draft_len,
                                   num_samples=20_000, seed=2)
    assert not result.rejects(), result.to_dict()
    assert result.num_strata > 0


def test_a_sampler_that_drifted_from_its_formula_is_caught():
    result = sampler_law_agreement(load_broken("kseq-sampler-drift"), DRAFT8, TARGET8, 2, num_samples=20_000, seed=2)
    assert result.rejects()
    # ...while the black-box audit cannot see it: the drifted sampler is itself exact
    blind = statistical_audit(load_broken("kseq-sampler-drift"), DRAFT8, TARGET8, 2, num_samples=20_000, seed=2,
                              stratify=False)
    assert not blind.rejects()


def test_a_formula_that_drifted_from_its_sampler_is_caught_statistically():
    # The sampler is speculative sampling; the stated law resamples rejections from q instead of
    # (q - p)_+.  Every string the sampler emits has positive stated probability, so only the
    # counts can tell.
    sampler, formula = load_verifier("speculative"), load_broken("resample-target")
    verifier = FunctionVerifier(sampler.verify, name="drifted-formula", output_probs=formula.output_probs,
                                max_drafts=1)
    result = sampler_law_agreement(verifier, DRAFT8, TARGET8, 1, num_samples=20_000, seed=0)
    assert result.rejects() and result.test in ("aggregated-pearson", "per-tuple-pearson")
    assert next(t for t in result.subtests if t.name == "support").statistic == 0


def test_law_agreement_needs_a_law():
    with pytest.raises(InvalidArgument, match="output_probs"):
        sampler_law_agreement(_speculative_function(False), DRAFT8, TARGET8, 1, num_samples=100)


def test_verdicts_inconclusive_below_the_planned_power_exact_at_it():
    v = load_verifier("speculative")
    draft, target = ContextFreeModel([0.6, 0.4]), ContextFreeModel([0.3, 0.7])
    # planned for TV 0.05 (a few thousand samples): reaching the plan is a conclusive "exact"
    planned = statistical_audit(v, draft, target, 1, min_detectable_tv=0.05, seed=2)
    assert planned.stop_reason == "planned" and planned.min_detectable_tv <= 0.05 * (1 + 1e-9)
    assert planned.verdict == "exact" and not planned.inconclusive
    # the same plan cut by a budget: nothing rejected, below the planned power -> INCONCLUSIVE
    cut = statistical_audit(v, draft, target, 1, min_detectable_tv=0.05, max_samples=500, seed=2)
    assert cut.stop_reason == "max_samples" and cut.min_detectable_tv > 0.05
    assert cut.verdict == "INCONCLUSIVE" and cut.inconclusive and cut.power_at_requested_tv < 0.99
    assert cut.planned_samples == planned.planned_samples > 500
    summary = json.loads(json.dumps(cut.to_dict()))
    assert summary["verdict"] == "INCONCLUSIVE" and summary["inconclusive"] is True
    assert summary["tv_interval"] == [cut.tv_lower, cut.tv_upper] and summary["partition"] == cut.partition
    assert summary["tv_confidence"] == pytest.approx(1 - 1e-3) and len(summary["counts_digest"]) == 64
    # a broken verifier is a FINDING whatever the power, and its TV interval excludes 0
    broken = statistical_audit(load_broken("always-accept"), DRAFT8, TARGET8, 2, num_samples=4096, seed=2)
    assert broken.verdict == "FINDING" and broken.tv_lower > 0.3


@pytest.mark.parametrize("kwargs, message", [
    ({"certify_tv": 0.0}, "certify_tv: expected a number in (0, 1)"),
    ({"certify_tv": True}, "certify_tv: expected a number in (0, 1)"),
    ({"distributed": "sometimes"}, "distributed: expected 'auto', True, False or a process group"),
    ({"distributed": True}, "distributed: True needs torch.distributed.init_process_group()"),
    ({"certify_tv": 1e-7}, "certify_tv: 1e-07 cannot be certified within 2^40 samples"),
])
def test_certification_and_sharding_arguments(kwargs, message):
    with pytest.raises(InvalidArgument) as info:
        statistical_audit(load_verifier("speculative"), ContextFreeModel([0.6, 0.4]), ContextFreeModel([0.3, 0.7]),
                          1, **kwargs)
    assert message in str(info.value)


def test_certification_stops_at_the_first_look_that_decides():
    v = load_verifier("speculative")
    draft, target = ContextFreeModel([0.6, 0.4]), ContextFreeModel([0.3, 0.7])
    certified = statistical_audit(v, draft, target, 1, certify_tv=0.1, seed=0)
    assert certified.certification == "certified" and certified.stop_reason == "certified"
    assert certified.tv_upper <= 0.1 and certified.verdict == "CERTIFIED"
    assert not any(t.name == "stratified-pearson" for t in certified.subtests)  # not run when certifying
    refuted = statistical_audit(load_broken("always-accept"), DRAFT8, TARGET8, 2, certify_tv=0.1, seed=0)
    assert refuted.certification == "refuted" and refuted.tv_lower > 0.1 and refuted.verdict == "FINDING"
    short = statistical_audit(v, draft, target, 1, certify_tv=0.01, max_samples=4096, seed=0)
    assert short.certification == "uncertified" and short.verdict == "INCONCLUSIVE" and short.num_samples == 4096
