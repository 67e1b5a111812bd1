"""The randomness seam: injected uniforms and boundary behaviour of categorical draws."""

from __future__ import annotations

import pytest
import torch

from spectr_audit.errors import InvalidArgument
from spectr_audit.randomness import InjectedUniforms, sample_categorical, uniform

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
