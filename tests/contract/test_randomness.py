"""The randomness seam: injected uniforms and boundary behaviour of categorical draws."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from spectr_audit.errors import InvalidArgument
from spectr_audit.contract.randomness import (
    CATEGORICAL_BLOCK,
    InjectedUniforms,
    sample_categorical,
    uniform,
)

from tests.oracles.randomness import one_level_draw

JUST_BELOW_ONE = 1 - 2**-53


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "probs,u,expected",
    [
        ([0.0, 1.0, 0.0], 0.0, 1),  # u = 0 never picks a leading zero-mass token
        ([0.0, 1.0, 0.0], JUST_BELOW_ONE, 1),  # u -> 1 never picks a trailing zero-mass token
        ([0.0, 0.25, 0.0, 0.75], 0.25, 3),  # a point on a CDF boundary goes to the next token of mass
        ([0.0, 0.25, 0.0, 0.75], 0.0, 1),
        ([0.5, 0.0, 0.5], 0.5, 2),
        ([0.5, 0.0, 0.5, 0.0], JUST_BELOW_ONE, 2),
        ([2.0, 6.0], 0.25, 1),  # unnormalised mass: the point is u * total
        ([1.0], 0.999, 0),
    ],
)
def test_categorical_boundaries(probs, u, expected, dtype):
    out = sample_categorical(torch.tensor([probs], dtype=dtype), torch.tensor([u], dtype=torch.float64))
    assert out.tolist() == [expected]


def test_categorical_never_returns_zero_mass_tokens_on_a_grid():
    probs = torch.tensor([[0.0, 0.1, 0.0, 0.0, 0.3, 0.0, 0.6, 0.0]], dtype=torch.float32).expand(4097, -1)
    u = torch.linspace(0, JUST_BELOW_ONE, 4097, dtype=torch.float64)
    out = sample_categorical(probs, u)
    assert set(out.tolist()) == {1, 4, 6}


def test_injected_uniforms_are_served_in_order_and_broadcast():
    src = InjectedUniforms([0.0, torch.tensor([0.25, 0.5])])
    assert uniform(src, (3,), torch.device("cpu")).tolist() == [0.0, 0.0, 0.0]
    assert uniform(src, (2,), torch.device("cpu")).tolist() == [0.25, 0.5]
    assert src.calls == [(3,), (2,)]
    with pytest.raises(InvalidArgument, match="ran out of values"):
        uniform(src, (1,), torch.device("cpu"))


def test_injected_uniforms_fall_back_to_a_generator_and_reject_out_of_range():
    src = InjectedUniforms([], fallback=torch.Generator().manual_seed(0))
    assert uniform(src, (5,), torch.device("cpu")).shape == (5,)
    with pytest.raises(InvalidArgument, match=r"must lie in \[0, 1\)"):
        uniform(InjectedUniforms([1.0]), (1,), torch.device("cpu"))


def test_generator_draws_are_reproducible():
    a = uniform(torch.Generator().manual_seed(3), (4,), torch.device("cpu"))
    b = uniform(torch.Generator().manual_seed(3), (4,), torch.device("cpu"))
    assert torch.equal(a, b) and bool(((a >= 0) & (a < 1)).all())


# --- two-level draws at large vocabularies, against the one-level inverse CDF (the oracle) -------------


@settings(max_examples=60, deadline=None)
@given(
    vocab_size=st.integers(2 * CATEGORICAL_BLOCK + 1, 5 * CATEGORICAL_BLOCK + 7),
    zero_fraction=st.sampled_from([0.0, 0.5, 0.97, 1.0]),
    dtype=st.sampled_from([torch.float64, torch.float32, torch.bfloat16]),
    seed=st.integers(0, 2**31 - 1),
)
def test_two_level_draw_matches_the_one_level_inverse_cdf(vocab_size, zero_fraction, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    probs = torch.rand(3, vocab_size, generator=gen, dtype=torch.float64) ** 4
    probs[torch.rand(3, vocab_size, generator=gen, dtype=torch.float64) < zero_fraction] = 0.0
    probs[0, vocab_size - 1] = 0.5  # mass in the (possibly partial) last block
    probs = probs.to(dtype)
    u = torch.rand(3, 200, generator=gen, dtype=torch.float64).T.contiguous()  # [200, 3]
    rows = probs.unsqueeze(0).expand(200, -1, -1)  # [200, 3, V]
    fast = sample_categorical(rows, u)
    slow = one_level_draw(rows.float() if dtype == torch.bfloat16 else rows, u)
    # Never a zero-mass token, and the same token as the one-level map except where the point lies within
    # rounding of a CDF boundary (then a neighbouring token of positive mass).
    has_mass = rows.sum(-1) > 0
    assert bool((rows.gather(-1, fast.unsqueeze(-1)).squeeze(-1) > 0)[has_mass].all())
    assert bool((fast[~has_mass] == vocab_size - 1).all())  # documented value for rows with no mass
    assert (fast == slow)[has_mass].double().mean().item() >= 0.99


def test_two_level_draw_boundaries_and_partial_last_block():
    vocab_size = 3 * CATEGORICAL_BLOCK + 5
    probs = torch.zeros(4, vocab_size, dtype=torch.float32)
    probs[:, 7] = 1.0
    probs[:, CATEGORICAL_BLOCK * 2] = 1.0  # first token of the third block
    probs[:, vocab_size - 1] = 2.0  # the last token, in the partial block
    u = torch.tensor([0.0, 0.25, 0.5, JUST_BELOW_ONE], dtype=torch.float64)
    assert sample_categorical(probs, u).tolist() == [7, 2 * CATEGORICAL_BLOCK, vocab_size - 1, vocab_size - 1]


def test_two_level_draw_is_distributed_as_the_row():
    """Chi-square of 200k draws against a peaked V = 4096 row (seeded; false alarm 1e-6 if correct)."""
    from scipy import stats

    gen = torch.Generator().manual_seed(11)
    probs = torch.softmax(3 * torch.randn(4096, generator=gen, dtype=torch.float64), -1)
    u = torch.rand(200_000, generator=gen, dtype=torch.float64)
    counts = torch.bincount(sample_categorical(probs.float().expand(200_000, -1), u), minlength=4096).double()
    expected = 200_000 * probs
    big = expected >= 5
    observed = torch.cat([counts[big], counts[~big].sum().unsqueeze(0)])
    exp = torch.cat([expected[big], expected[~big].sum().unsqueeze(0)])
    assert stats.chisquare(observed.numpy(), exp.numpy() * observed.sum().item() / exp.sum().item()).pvalue > 1e-6
