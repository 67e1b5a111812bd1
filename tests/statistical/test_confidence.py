"""The TV interval, its anytime-valid looks and the certification plan (spectr_audit.statistical.confidence)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from scipy import stats

from spectr_audit.drafting.models import ContextFreeModel
from spectr_audit.errors import InvalidArgument
from spectr_audit.statistical._checks import chunk_schedule
from spectr_audit.statistical.confidence import (
    TVConfidenceSequence,
    certification_samples,
    deviation_radius,
    look_delta,
    partition_tv,
    tv_interval,
)
from spectr_audit.statistical.sampling import build_partition


# (num_samples, num_cells, delta, radius) by hand: min(sqrt((C log 2 + log 1/d) / 2n),
# 1/2 sqrt((C - 1)/n) + sqrt(log(1/d) / 2n))
RADIUS_CASES = [
    (10_000, 2, 0.05, min(math.sqrt((2 * math.log(2) + math.log(20)) / 20_000), 0.005 + math.sqrt(math.log(20) / 20_000))),
    (1_000_000, 64, 1e-3, math.sqrt((64 * math.log(2) + math.log(1000)) / 2e6)),
    # many cells: McDiarmid's bound is the smaller
    (1_000_000, 4096, 1e-3, 0.5 * math.sqrt(4095 / 1e6) + math.sqrt(math.log(1000) / 2e6)),
]


@pytest.mark.parametrize("num_samples, num_cells, delta, radius", RADIUS_CASES)
def test_deviation_radius_by_hand(num_samples, num_cells, delta, radius):
    assert deviation_radius(num_samples, num_cells, delta) == pytest.approx(radius, rel=1e-12)


@pytest.mark.parametrize("probs", [[0.5, 0.5], [0.7, 0.2, 0.1], list(np.full(16, 1 / 16)),
                                   list(np.random.default_rng(3).dirichlet(np.full(32, 0.3)))])
def test_the_radius_bounds_the_empirical_tv_at_its_level(probs):
    # 4000 empirical laws of 500 draws: P(TV(F_hat, F) > r) <= delta = 0.1.  Exceedances above the
    # binomial(4000, 0.1) quantile 1 - 1e-4 would refute the bound (false-alarm rate 1e-4).
    rng = np.random.default_rng(11)
    probs = np.asarray(probs) / np.sum(probs)
    draws = rng.multinomial(500, probs, size=4000) / 500
    tv = 0.5 * np.abs(draws - probs).sum(1)
    radius = deviation_radius(500, probs.size, 0.1)
    assert (tv > radius).sum() <= stats.binom.isf(1e-4, 4000, 0.1)
    # and it is not hopelessly loose: within 3x of the empirical 90% quantile
    assert radius <= 3 * np.quantile(tv, 0.9)


def test_the_looks_spend_at_most_delta_over_any_schedule():
    for chunk_size in (64, 4096, 1 << 14, 1 << 18):
        spent, done, first = 0.0, 0, 0
        for size in chunk_schedule(1 << 34, chunk_size):
            previous, done = done, done + size
            first = first or done
            spent += look_delta(1.0, done, previous, first)
            if done > 1 << 30:
                break
        assert spent <= 1.0
    assert look_delta(1e-3, 4096, 0, 4096) == 5e-4  # the first look spends half
    with pytest.raises(InvalidArgument, match="looks must increase"):
        look_delta(1e-3, 10, 10, 4)


def test_tv_interval_by_hand_and_its_arguments():
    iv = tv_interval(torch.tensor([5200.0, 4800.0]), torch.tensor([0.5, 0.5]), 0.95)
    radius = deviation_radius(10_000, 2, 0.05)
    assert iv.estimate == pytest.approx(0.02) and iv.radius == pytest.approx(radius, rel=1e-12)
    assert (iv.lower, iv.upper) == (pytest.approx(max(0.0, 0.02 - radius)), pytest.approx(0.02 + radius))
    # mass in a cell of target probability 0 counts towards the TV
    iv = tv_interval(torch.tensor([90.0, 0.0, 10.0]), torch.tensor([0.9, 0.1, 0.0]), 0.9)
    assert iv.estimate == pytest.approx(0.1)
    with pytest.raises(InvalidArgument, match="counts, cell_probs"):
        tv_interval(torch.ones(3), torch.ones(2) / 2)
    with pytest.raises(InvalidArgument, match="confidence"):
        tv_interval(torch.ones(2), torch.ones(2) / 2, 1.0)


def test_the_sequence_intersects_its_looks_and_looks_must_increase():
    sequence = TVConfidenceSequence(torch.tensor([0.5, 0.5]), 0.99)
    assert sequence.interval() is None
    sequence.advance(1000)
    first = sequence.look(torch.tensor([580.0, 420.0]))
    sequence.advance(100_000)
    second = sequence.look(torch.tensor([52_000.0, 48_000.0]))
    assert first.lower > second.lower and first.upper > second.upper
    interval = sequence.interval()
    assert interval.lower == first.lower and interval.upper == second.upper  # the running intersection
    assert interval.estimate == second.estimate
    assert second.radius == deviation_radius(100_000, 2, look_delta(0.01, 100_000, 1000, 1000))
    with pytest.raises(InvalidArgument, match="looks must increase"):
        sequence.advance(100_000)


def test_certification_samples_grow_as_the_tolerance_shrinks_and_certify_an_exact_law():
    probs = torch.full((8,), 1 / 8, dtype=torch.float64)
    sizes = [certification_samples(eps, probs, 0.999, 0.99, chunk_schedule(1 << 40, 1 << 14))
             for eps in (0.1, 0.05, 0.02, 0.01)]
    assert sizes == sorted(sizes) and sizes[-1] > 20 * sizes[0]
    # at the planned size, the empirical law of an exact verifier is certified (power 0.99)
    rng = np.random.default_rng(5)
    n = sizes[1]
    counts = rng.multinomial(n, probs.numpy(), size=500)
    schedule, done, first, previous = list(chunk_schedule(n, 1 << 14)), 0, 0, 0
    for size in schedule:
        previous, done = done, done + size
        first = first or done
    radius = deviation_radius(n, 8, look_delta(1e-3, n, previous, first))
    upper = 0.5 * np.abs(counts / n - probs.numpy()).sum(1) + radius
    assert (upper <= 0.05).mean() >= 0.97
    assert certification_samples(1e-9, probs, 0.999, 0.99, chunk_schedule(1 << 40, 1 << 14), max_samples=1 << 20) is None
    with pytest.raises(InvalidArgument, match="certify_tv"):
        certification_samples(1.5, probs, 0.999, 0.99, [1])


def test_partition_tv_coarsens_the_law_to_the_cells():
    target = ContextFreeModel([0.5, 0.3, 0.2])
    law = torch.tensor([0.5, 0.3, 0.2], dtype=torch.float64)
    law = (law.unsqueeze(1) * law).reshape(-1)
    # move mass 0.04 from "1 1" to "1 2": same first token; visible on the full partition only
    law[4] -= 0.04
    law[5] += 0.04
    full = build_partition(target, 2, 10_000)
    coarse = build_partition(target, 2, 30)  # cells '0 (rare)', '0 0', '1 *', '2 *'
    assert partition_tv(law, full) == pytest.approx(0.04)
    assert partition_tv(law, coarse) == pytest.approx(0.0, abs=1e-15)
    with pytest.raises(InvalidArgument, match="law"):
        partition_tv(torch.ones(4), full)
