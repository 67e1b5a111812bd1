"""Sample sizes of the statistical audit (spectr_audit.statistical.power, plan_sample_size).

Statistical tests here state their false-alarm rate; seeds are fixed, so a failure is
deterministic and means the code changed, not bad luck.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy import stats
from statsmodels.stats.power import GofChisquarePower

from spectr_audit.errors import InvalidArgument
from spectr_audit.statistical.gof import pearson_test
from spectr_audit.drafting.models import random_markov
from spectr_audit.statistical.power import (
    DEFAULT_ALPHA,
    DEFAULT_MIN_DETECTABLE_TV,
    DEFAULT_POWER,
    chi2_power,
    effect_size_for_tv,
    min_detectable_tv,
    required_samples,
)
from spectr_audit.statistical.audit import plan_sample_size

from tests._models import TARGET8


pytestmark = pytest.mark.usefixtures("single_thread")  # one torch thread (tests/conftest.py)


# (tv, num_cells, alpha, power): spans the audit's range, including its defaults.
SIZING_CASES = [
    (0.005, 64, 2e-4, 0.99),
    (0.005, 4, 1e-3, 0.99),
    (0.01, 512, 1e-3 / 6, 0.99),
    (0.05, 10, 0.05, 0.8),
    (0.001, 2, 1e-3, 0.9),
]


def test_defaults_are_the_documented_ones():
    assert (DEFAULT_ALPHA, DEFAULT_POWER, DEFAULT_MIN_DETECTABLE_TV) == (1e-3, 0.99, 0.005)


@pytest.mark.parametrize("tv,num_cells,alpha,power", SIZING_CASES)
def test_required_samples_matches_statsmodels(tv, num_cells, alpha, power):
    # statsmodels' GofChisquarePower is the slow oracle (a root finder over nobs).
    oracle = GofChisquarePower().solve_power(effect_size=2 * tv, nobs=None, alpha=alpha, power=power, n_bins=num_cells)
    assert required_samples(tv, num_cells, alpha, power) == pytest.approx(oracle, rel=1e-6, abs=1.0)


@pytest.mark.parametrize("tv,num_cells,alpha,power", SIZING_CASES)
def test_min_detectable_tv_inverts_required_samples(tv, num_cells, alpha, power):
    n = required_samples(tv, num_cells, alpha, power)
    assert min_detectable_tv(n, num_cells, alpha, power) <= tv
    assert min_detectable_tv(n - 1, num_cells, alpha, power) > tv * (1 - 1e-3)
    # and the power at that n, from statsmodels, is the requested one
    assert GofChisquarePower().power(2 * tv, n, alpha, num_cells) == pytest.approx(power, abs=1e-4)


def test_power_grows_with_samples():
    powers = [chi2_power(n * 0.01**2, 64, 1e-3) for n in (1e4, 1e5, 1e6, 1e7)]
    assert powers == sorted(powers) and powers[0] < 0.1 and powers[-1] > 0.999


@given(
    st.lists(st.floats(0.01, 1.0), min_size=2, max_size=12),
    st.lists(st.floats(0.01, 1.0), min_size=2, max_size=12),
)
@settings(max_examples=200, deadline=None)
def test_cohen_w_is_at_least_twice_tv(target_raw, other_raw):
    size = min(len(target_raw), len(other_raw))
    target = np.array(target_raw[:size]) / sum(target_raw[:size])
    other = np.array(other_raw[:size]) / sum(other_raw[:size])
    tv = 0.5 * np.abs(other - target).sum()
    w = math.sqrt(((other - target) ** 2 / target).sum())
    assert w >= 2 * tv * (1 - 1e-12)


def _worst_case_law(target: np.ndarray, tv: float) -> np.ndarray:
    """A law at TV ``tv`` from ``target`` with Cohen's w exactly 2 TV (the planning worst case)."""
    # Cells split into two halves of target mass 1/2 each: F = q (1 + 2 tv) on one, q (1 - 2 tv) on the other.
    assert len(target) % 2 == 0
    signs = np.array([1.0, -1.0] * (len(target) // 2))
    return target * (1 + 2 * tv * signs)


def test_planned_power_holds_against_the_worst_case_law():
    # 400 simulated audits at the planned n against a law with w = 2 TV exactly; planned power 0.9.
    # The rejection count is Binomial(400, >= 0.9); failing needs fewer than binom.ppf(1e-4, 400, 0.9)
    # rejections: false-alarm rate of this check 1e-4.
    rng = np.random.default_rng(11)
    target = np.full(8, 1 / 8)
    tv, alpha, power = 0.05, 0.01, 0.9
    law = _worst_case_law(target, tv)
    assert 0.5 * np.abs(law - target).sum() == pytest.approx(tv)
    assert math.sqrt(((law - target) ** 2 / target).sum()) == pytest.approx(2 * tv)
    n = required_samples(tv, len(target), alpha, power)
    rejections = sum(pearson_test(rng.multinomial(n, law), target).pvalue <= alpha for _ in range(400))
    assert rejections >= stats.binom.ppf(1e-4, 400, power)
    # and with 40% of that n the power is clearly lower (the sizing is not wildly conservative)
    fewer = int(0.4 * n)
    weak = sum(pearson_test(rng.multinomial(fewer, law), target).pvalue <= alpha for _ in range(400))
    assert weak < rejections - 40


def test_plan_sample_size_full_partition_and_fixed_point():
    target = TARGET8
    n, partition = plan_sample_size(target, 2, num_tests=5)
    assert partition.is_full and partition.num_cells == 64
    kept = int((n * partition.cell_probs >= 5).sum())
    cells = kept + (1 if n * partition.cell_probs[n * partition.cell_probs < 5].sum() >= 5 else 0)
    assert n == required_samples(0.005, cells, 1e-3 / 5, 0.99)


def test_plan_sample_size_coarsens_large_markov_spaces():
    target = random_markov(16, order=1, seed=3)
    n, partition = plan_sample_size(target, 6, max_cells=4096)
    assert not partition.is_full
    assert partition.num_cells <= 4096
    assert float(partition.cell_probs.sum()) == pytest.approx(1.0, abs=1e-12)
    # a prefix cell's probability is the target probability of its prefix (chain rule, slow
    # oracle); a rare-token cell holds part of its prefix's mass
    from spectr_audit.statistical.sampling import PREFIX

    checked = 0
    for cell in range(0, partition.num_cells, 37):
        depth = int(partition.cell_depth[cell])
        tokens = partition.cell_strings[cell, :depth].tolist()
        prob = 1.0
        for i, token in enumerate(tokens):
            context = torch.tensor([tokens[:i]], dtype=torch.int64).reshape(1, i)
            prob *= float(target(context)[0, token])
        if int(partition.cell_kind[cell]) == PREFIX:
            assert float(partition.cell_probs[cell]) == pytest.approx(prob, rel=1e-10)
            checked += 1
        else:
            assert float(partition.cell_probs[cell]) < prob
    assert checked > 10


BAD_SIZING_ARGS = [
    (dict(min_detectable_tv=0.0), "min_detectable_tv"),
    (dict(min_detectable_tv=1.5), "min_detectable_tv"),
    (dict(num_cells=1), "num_cells"),
    (dict(alpha=0.0), "alpha"),
    (dict(alpha=1.0), "alpha"),
    (dict(power=1.0), "power"),
    (dict(power=float("nan")), "power"),
]


@pytest.mark.parametrize("kwargs,argument", BAD_SIZING_ARGS)
def test_bad_sizing_arguments_name_the_argument(kwargs, argument):
    full = dict(min_detectable_tv=0.01, num_cells=8, alpha=0.01, power=0.9)
    full.update(kwargs)
    with pytest.raises(InvalidArgument, match=argument):
        required_samples(**full)


def test_bad_sample_count_for_min_detectable_tv():
    with pytest.raises(InvalidArgument, match="num_samples"):
        min_detectable_tv(-1, 8)
    assert min_detectable_tv(0, 8) == math.inf
    with pytest.raises(InvalidArgument, match="min_detectable_tv"):
        effect_size_for_tv(-0.1)
