"""The G statistic's null law, the partition's truncations, the strata and the depths' bounds against oracles."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from spectr_audit.drafting.models import ContextFreeModel, random_markov
from spectr_audit.exact.iteration import enumerate_drafts
from spectr_audit.statistical.calibration import cell_pvalues
from spectr_audit.statistical.depths import MixtureEProcess, depth_truncations
from spectr_audit.statistical.gof import PlugInEProcess, conditional_g_test, g_test
from spectr_audit.statistical.nulls import MAX_EXACT_OUTCOMES, g_null, poisson_deviance_moments, scaled_chi2_sf
from spectr_audit.statistical.partition import build_partition
from spectr_audit.statistical.poststrata import group_strata, post_strata
from tests.oracles import nulls as oracle

pytestmark = pytest.mark.usefixtures("single_thread")


@settings(max_examples=60, deadline=None)
@given(st.floats(min_value=0.05, max_value=1500.0))
def test_poisson_deviance_moments_match_the_term_by_term_sums(mu):
    mean, var = poisson_deviance_moments([mu])
    want_mean, want_var = oracle.poisson_deviance_moments(mu)
    assert mean[0] == pytest.approx(want_mean, rel=1e-9, abs=1e-12)
    assert var[0] == pytest.approx(want_var, rel=1e-9, abs=1e-12)


@pytest.mark.parametrize("mu", [99_999.0, 100_000.0, 100_000.5, 250_000.0])
def test_the_asymptotic_expansion_agrees_with_the_sums_where_it_takes_over(mu):
    mean, var = poisson_deviance_moments([mu])
    want_mean, want_var = oracle.poisson_deviance_moments(mu)
    assert mean[0] == pytest.approx(want_mean, abs=1e-9) and var[0] == pytest.approx(want_var, abs=1e-9)


@pytest.mark.parametrize("probs,n", [([0.5, 0.5], 10), ([0.2, 0.3, 0.5], 12), ([0.1, 0.2, 0.3, 0.4], 9),
                                     ([0.7, 0.3], 40)])
def test_the_exact_null_is_the_enumerated_multinomial(probs, n):
    null = g_null(probs, n)
    assert null.method == "exact"
    law = oracle.multinomial_g_law(probs, n)
    assert null.mean == pytest.approx(sum(g * p for g, p in law), rel=1e-10)
    for statistic in sorted({round(g, 9) for g, _ in law})[::3]:
        assert null.sf(statistic) == pytest.approx(oracle.exact_g_sf(probs, n, statistic), rel=1e-9, abs=1e-15)


def test_sf_many_is_sf_entry_by_entry():
    for null in (g_null([0.2, 0.3, 0.5], 30), g_null(np.full(40, 1 / 40), 400)):
        statistics = np.linspace(0.0, 3 * null.mean + 10, 37)
        assert null.sf_many(statistics) == pytest.approx([null.sf(x) for x in statistics], rel=1e-12, abs=1e-300)


def test_enumeration_stops_at_the_outcome_limit():
    # C(n + 1, 1) = n + 1 outcomes for two cells: exact up to the limit, moments beyond it
    assert g_null([0.5, 0.5], MAX_EXACT_OUTCOMES - 1).method == "exact"
    assert g_null([0.5, 0.5], MAX_EXACT_OUTCOMES).method == "moment-matched"
    assert g_null([0.5, 0.5], 10, exact=False).method == "moment-matched"


def test_the_moment_matched_null_has_the_simulated_mean_and_variance():
    # 7,000 cells of about 5 expected samples: where the plain chi-square's mean is 2% too small
    rng = np.random.default_rng(0)
    probs = rng.dirichlet(np.full(7000, 50.0))
    n = int(5 / probs.min()) + 1
    null = g_null(probs, n)
    counts = rng.multinomial(n, probs, size=3000).astype(float)
    expected = n * probs
    g = 2 * np.where(counts > 0, counts * np.log(np.where(counts > 0, counts, 1) / expected), 0).sum(1)
    # 3,000 draws: the mean within 4 standard errors, the variance within 4 of its standard errors
    assert abs(g.mean() - null.mean) < 4 * math.sqrt(null.var / 3000)
    assert abs(g.var() - null.var) < 4 * null.var * math.sqrt(2 / 3000)
    assert null.mean > (probs.size - 1) * 1.01  # the chi-square's own mean is off by more than 1%


def test_g_test_and_the_calibration_batches_agree_row_by_row():
    rng = np.random.default_rng(1)
    for probs, n in ((rng.dirichlet(np.ones(6)), 30), (rng.dirichlet(np.full(300, 0.5)), 20_000)):
        counts = rng.multinomial(n, probs, size=20).astype(float)
        batch = cell_pvalues("g-test", counts, probs)
        assert batch == pytest.approx([g_test(c, probs).pvalue for c in counts], rel=1e-10, abs=1e-300)


def test_scaled_chi2_is_the_chi2_at_its_own_moments():
    assert scaled_chi2_sf(9.0, 4.0, 8.0) == pytest.approx(0.061099, abs=1e-6)  # chi2(4) sf at 9
    assert scaled_chi2_sf(18.0, 8.0, 32.0) == pytest.approx(0.061099, abs=1e-6)  # 2 x chi2(4)


def test_conditional_g_with_one_stratum_is_the_g_test():
    observed = torch.tensor([[30.0, 12.0, 8.0]])
    probs = torch.tensor([0.5, 0.3, 0.2], dtype=torch.float64)
    one = conditional_g_test(observed, 50 * probs.unsqueeze(0))
    plain = g_test(observed[0], probs)
    assert one.statistic == pytest.approx(plain.statistic) and one.pvalue == pytest.approx(plain.pvalue)


# ---------------------------------------------------------------------------------------------
# Truncations
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("vocab_size,num_tokens,num_samples,seed", [(3, 3, 400, 0), (3, 3, 20_000, 1),
                                                                     (4, 3, 2_000, 2), (2, 4, 300, 3)])
def test_a_truncation_merges_exactly_the_cells_defined_deeper(vocab_size, num_tokens, num_samples, seed):
    target = random_markov(vocab_size, seed=seed, concentration=0.5)
    partition = build_partition(target, num_tokens, num_samples)
    q = {}  # target probability of every string, by the chain rule
    import itertools
    for string in itertools.product(range(vocab_size), repeat=num_tokens):
        prob, context = 1.0, []
        for token in string:
            prob *= float(target(torch.tensor([context]) if context else torch.zeros(1, 0, dtype=torch.int64))[0, token])
            context.append(token)
        q[string] = prob
    for depth in range(1, num_tokens + 1):
        truncation = partition.truncation(depth)
        want = oracle.truncated_cell_strings(partition, depth)
        # strings the oracle puts together are together in the truncation, and no others
        label = {s: int(truncation.mapping[int(partition.cells_of(torch.tensor([s]))[0])]) for s in want}
        keys = {}
        for s, key in want.items():
            keys.setdefault(key, set()).add(label[s])
        assert all(len(cells) == 1 for cells in keys.values())
        assert len({next(iter(c)) for c in keys.values()}) == len(keys) == truncation.num_cells
        mass = torch.zeros(truncation.num_cells, dtype=torch.float64)
        for s, cell in label.items():
            mass[cell] += q[s]
        assert torch.allclose(truncation.cell_probs, mass, atol=1e-12)
    assert torch.equal(partition.truncation(num_tokens).mapping, torch.arange(partition.num_cells))


def test_depths_are_the_distinct_coarsenings():
    partition = build_partition(random_markov(5, seed=2), 6, 200_000)
    depths = depth_truncations(partition)
    sizes = [t.num_cells for t in depths]
    assert [t.depth for t in depths] == [1, 2, 3, 4, 5] and sizes == sorted(set(sizes)) and sizes[-1] < partition.num_cells
    counts = torch.from_numpy(np.random.default_rng(0).multinomial(1000, partition.cell_probs.numpy()).astype(float))
    for t in depths:
        assert float(t.counts(counts).sum()) == 1000.0


# ---------------------------------------------------------------------------------------------
# Strata and the depths' e-process
# ---------------------------------------------------------------------------------------------


@settings(max_examples=80, deadline=None)
@given(st.lists(st.floats(min_value=1e-4, max_value=1.0), min_size=1, max_size=30),
       st.integers(min_value=1, max_value=5000), st.sampled_from([1.0, 10.0, 32.0]))
def test_group_strata_matches_the_one_at_a_time_oracle(weights, num_samples, min_per_group):
    got = group_strata(torch.tensor(weights, dtype=torch.float64), num_samples, min_per_group).tolist()
    assert got == oracle.group_strata(weights, num_samples, min_per_group)


def test_group_of_finds_every_enumerated_tuple():
    draft = ContextFreeModel([0.4, 0.3, 0.2, 0.1])
    enumeration = enumerate_drafts(draft, draft, 3, 1)
    strata = post_strata(enumeration, 4, 100_000)
    groups = strata.group_of(enumeration.draft_tokens)
    want = group_strata(enumeration.weights, 100_000, 32.0)
    assert torch.equal(groups, want)
    assert float(strata.group_probs.sum()) == pytest.approx(1.0)
    assert strata.group_of(torch.tensor([[[5], [0], [0]]])).tolist() == [-1]  # not a tuple of the enumeration


def test_the_mixture_e_process_is_the_average_of_the_depths():
    partition = build_partition(random_markov(3, seed=4), 3, 5000)
    depths = depth_truncations(partition)
    mixture = MixtureEProcess(partition, depths)
    singles = [PlugInEProcess(t.cell_probs) for t in depths] + [PlugInEProcess(partition.cell_probs)]
    rng = np.random.default_rng(2)
    skewed = partition.cell_probs.numpy() ** 1.3
    for size in (500, 1000, 2000):
        chunk = torch.from_numpy(rng.multinomial(size, skewed / skewed.sum()).astype(float))
        logs = [p.update(t.counts(chunk)) for p, t in zip(singles, depths)] + [singles[-1].update(chunk)]
        assert mixture.update(chunk) == pytest.approx(math.log(sum(math.exp(x) for x in logs) / len(logs)))
