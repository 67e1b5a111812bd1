"""The randomized PIT and surprisal of emitted tokens (spectr_audit.generation.pit) against a plain-Python oracle.

* :func:`token_stats` equals :func:`tests.oracles.generation.token_stats` to 1e-12 on
  hypothesis-drawn laws (ties, zeros, one-hot laws, tokens of zero mass, draft laws equal to or
  proportional to the target's) for every order;
* the PIT of tokens drawn from their law is uniform (Kolmogorov-Smirnov at level 1e-3 per order,
  fixed seeds: the test's false-alarm rate is at most 3e-3, and it is deterministic), and the same
  check rejects tokens drawn from a law 0.1 away in TV.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings, strategies as st
from scipy import stats

from spectr_audit.errors import InvalidArgument
from spectr_audit.generation.pit import ORDERINGS, token_stats
from spectr_audit.generation.statistical_tests import pit_test
from tests.oracles import generation as oracle

pytestmark = pytest.mark.usefixtures("single_thread")

TOL = 1e-12


@st.composite
def laws(draw, size: int) -> list:
    """A law over ``size`` tokens: generic, with ties, with zeros, one-hot or uniform."""
    kind = draw(st.sampled_from(["generic", "ties", "zeros", "one-hot", "uniform"]))
    if kind == "one-hot":
        hot = draw(st.integers(0, size - 1))
        return [1.0 if v == hot else 0.0 for v in range(size)]
    if kind == "uniform":
        return [1.0 / size] * size
    if kind == "ties":
        weights = [float(w) for w in draw(st.lists(st.integers(0, 3), min_size=size, max_size=size))]
    elif kind == "zeros":
        weights = draw(st.lists(st.one_of(st.just(0.0), st.floats(1e-6, 1.0)), min_size=size, max_size=size))
    else:
        weights = draw(st.lists(st.floats(1e-9, 1.0), min_size=size, max_size=size))
    if sum(weights) == 0:
        weights[draw(st.integers(0, size - 1))] = 1.0
    total = sum(weights)
    return [w / total for w in weights]


@st.composite
def cases(draw):
    size = draw(st.integers(1, 9))
    num = draw(st.integers(1, 7))
    targets = [draw(laws(size)) for _ in range(num)]
    drafts = []
    for law in targets:
        how = draw(st.sampled_from(["own", "same", "scaled", "tiny"]))
        if how == "tiny":  # draft masses below 1e-300: their ratios q / p are huge (or overflow to inf)
            draft = draw(laws(size))
            tiny = draw(st.lists(st.sampled_from([0.0, 1e-301, 3e-302, 1e-305, 5e-320]), min_size=size,
                                 max_size=size))
            drafts.append([t if t > 0 else d for d, t in zip(draft, tiny)])
        elif how == "same":  # every ratio exactly 1 where q > 0: all tied
            drafts.append(list(law))
        elif how == "scaled":  # proportional on a subset: ties among the ratios, and q > 0 = p
            keep = draw(st.lists(st.booleans(), min_size=size, max_size=size))
            weights = [q if k else 0.0 for q, k in zip(law, keep)]
            drafts.append([w / sum(weights) for w in weights] if sum(weights) > 0 else draw(laws(size)))
        else:
            drafts.append(draw(laws(size)))
    # any token, also one of zero mass (the support check's business, but its PIT is still defined)
    tokens = [draw(st.integers(0, size - 1)) for _ in range(num)]
    uniforms = [draw(st.one_of(st.just(0.0), st.floats(0.0, 1.0, exclude_max=True))) for _ in range(num)]
    return targets, drafts, tokens, uniforms


@settings(max_examples=300, deadline=None)
@given(cases())
def test_token_stats_equal_the_oracle_for_every_order(case):
    targets, drafts, tokens, uniforms = case
    got = token_stats(torch.tensor(targets, dtype=torch.float64), torch.tensor(tokens),
                      torch.tensor(uniforms, dtype=torch.float64), torch.tensor(drafts, dtype=torch.float64),
                      orderings=ORDERINGS)
    want = oracle.token_stats(targets, tokens, uniforms, drafts, orderings=ORDERINGS)
    for order in ORDERINGS:
        assert got.pit[order].tolist() == pytest.approx(want["pit"][order], abs=TOL, rel=0), order
    assert got.mass.tolist() == want["mass"]
    for i, value in enumerate(want["surprisal"]):
        if math.isinf(value):
            assert math.isinf(float(got.surprisal[i])) and float(got.surprisal[i]) > 0
        else:
            assert float(got.surprisal[i]) == pytest.approx(value, abs=TOL, rel=0)
    assert got.entropy.tolist() == pytest.approx(want["entropy"], abs=TOL, rel=0)
    assert got.surprisal_var.tolist() == pytest.approx(want["variance"], abs=TOL, rel=0)


def test_token_stats_chunks_rows_and_agree_with_the_oracle_on_a_large_vocabulary():
    # more rows than one chunk (_ROWS) and a vocabulary wide enough for the variance to cancel badly
    # in the one-pass formula E[log^2 q] - H^2
    rng = np.random.default_rng(0)
    size, num = 300, 1100
    targets = rng.dirichlet(np.full(size, 50.0), size=num)
    targets[::7, :] = 1.0 / size
    drafts = rng.dirichlet(np.ones(size), size=num)
    tokens = rng.integers(0, size, num)
    uniforms = rng.random(num)
    got = token_stats(torch.from_numpy(targets), torch.from_numpy(tokens), torch.from_numpy(uniforms),
                      torch.from_numpy(drafts), ORDERINGS)
    rows = range(0, num, 37)
    want = oracle.token_stats([targets[i].tolist() for i in rows], [int(tokens[i]) for i in rows],
                              [float(uniforms[i]) for i in rows], [drafts[i].tolist() for i in rows], ORDERINGS)
    for order in ORDERINGS:
        assert got.pit[order][list(rows)].tolist() == pytest.approx(want["pit"][order], abs=TOL, rel=0)
    assert got.entropy[list(rows)].tolist() == pytest.approx(want["entropy"], abs=TOL, rel=0)
    assert got.surprisal_var[list(rows)].tolist() == pytest.approx(want["variance"], abs=TOL, rel=0)
    assert float(got.surprisal_var[7]) == pytest.approx(0.0, abs=TOL)  # a uniform law: no variance


def _random_laws(rng, num: int, size: int) -> np.ndarray:
    """Laws of every kind the audit meets: generic, with ties, with zeros, one-hot."""
    out = rng.dirichlet(np.full(size, 0.7), size=num)
    kind = rng.integers(0, 4, num)
    ties = rng.integers(0, 3, (num, size)).astype(np.float64)
    ties[ties.sum(1) == 0, 0] = 1.0
    out[kind == 1] = (ties / ties.sum(1, keepdims=True))[kind == 1]
    zeros = np.where(rng.random((num, size)) < 0.4, 0.0, out)
    zeros[zeros.sum(1) == 0, 0] = 1.0
    out[kind == 2] = (zeros / zeros.sum(1, keepdims=True))[kind == 2]
    out[kind == 3] = np.eye(size)[rng.integers(0, size, num)][kind == 3]
    return out


def _draw(rng, laws: np.ndarray) -> np.ndarray:
    cumulative = laws.cumsum(1)
    cumulative[:, -1] = 1.0
    return (rng.random((laws.shape[0], 1)) < cumulative).argmax(1)


def _pits(seed: int, tv: float) -> dict:
    """PIT values of 20,000 tokens drawn from their target law (tv = 0) or from a law ``tv`` away from it."""
    rng = np.random.default_rng(seed)
    num, size = 20_000, 8
    targets = _random_laws(rng, num, size)
    drafts = _random_laws(rng, num, size)
    sample = targets
    if tv > 0:  # move tv of mass onto the target's most likely token, from the others in proportion
        top = np.eye(size)[targets.argmax(1)]
        rest = targets * (1 - top)
        movable = rest.sum(1, keepdims=True)
        share = np.minimum(tv, movable)
        sample = targets + share * top - np.where(movable > 0, share * rest / np.where(movable > 0, movable, 1), 0)
    tokens = _draw(rng, sample)
    stats_ = token_stats(torch.from_numpy(targets), torch.from_numpy(tokens), torch.from_numpy(rng.random(num)),
                         torch.from_numpy(drafts), ORDERINGS)
    return stats_.pit


LEVEL = 1e-3


def test_the_pit_of_tokens_drawn_from_their_law_is_uniform_under_every_order():
    # Kolmogorov-Smirnov at 1e-3 per order: a false-alarm rate of at most 3e-3 (fixed seed, deterministic)
    pits = _pits(seed=1, tv=0.0)
    for order in ORDERINGS:
        assert stats.kstest(pits[order].numpy(), "uniform").pvalue > LEVEL, order
        assert pit_test(pits[order], order, level=LEVEL, power=0.99).pvalue > LEVEL, order


def test_the_same_check_rejects_tokens_drawn_from_another_law():
    pits = _pits(seed=1, tv=0.1)
    # too sharp: the PIT piles up near 0 in the probability order
    assert stats.kstest(pits["probability"].numpy(), "uniform").pvalue < 1e-6
    assert pit_test(pits["probability"], "p", level=LEVEL, power=0.99).pvalue < 1e-6


def test_token_stats_reject_bad_inputs():
    law = torch.tensor([[0.5, 0.5]], dtype=torch.float64)
    u = torch.zeros(1, dtype=torch.float64)
    with pytest.raises(InvalidArgument, match="orderings"):
        token_stats(law, torch.tensor([0]), u, orderings=("by-magic",))
    with pytest.raises(InvalidArgument, match="ratio"):
        token_stats(law, torch.tensor([0]), u, orderings=("ratio",))
    with pytest.raises(InvalidArgument, match="tokens"):
        token_stats(law, torch.tensor([2]), u)
    with pytest.raises(InvalidArgument, match="draft_laws"):
        token_stats(law, torch.tensor([0]), u, torch.ones(1, 3, dtype=torch.float64) / 3, ("ratio",))
    with pytest.raises(InvalidArgument, match="laws, tokens, uniforms"):
        token_stats(law, torch.tensor([0, 1]), u)
