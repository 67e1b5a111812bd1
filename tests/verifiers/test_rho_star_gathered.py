"""The sort-free rho* solve's passes over the gathered tokens with q/p > 1 against a full pass over every token."""

from __future__ import annotations

from unittest import mock

import numpy as np
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from spectr_audit.verifiers.rho_star import (
    _AboveOneTokens,
    kseq_rho_star,
    kseq_rho_star_sampler,
)


def _rows(vocab_size, rows, concentration, zeros, seed, sharpen=None):
    """``[rows, 2, V]`` (draft, target) pairs: independent, or (``sharpen``) the target a sharpened draft, as
    a large model's peaked target against a flatter draft (few tokens with q > p, the gathered path)."""
    rng = np.random.default_rng(seed)
    out = rng.dirichlet(np.full(vocab_size, concentration), size=(rows, 2))
    if sharpen is not None:
        out[:, 1] = out[:, 0] ** sharpen * rng.lognormal(0.0, 0.3, size=(rows, vocab_size))
    out[rng.random(out.shape) < zeros] = 0.0
    out[..., 0] += 1e-3  # a token with mass on both sides
    return out / out.sum(-1, keepdims=True)


@settings(max_examples=60, deadline=None)
@given(
    vocab_size=st.sampled_from([2, 7, 300, 1000]),
    num_drafts=st.integers(1, 8),
    concentration=st.sampled_from([0.05, 0.5, 2.0]),
    zeros=st.sampled_from([0.0, 0.3]),
    sharpen=st.sampled_from([None, 1.5, 3.0]),
    dtype=st.sampled_from([torch.float64, torch.float32]),
    seed=st.integers(0, 2**31 - 1),
    fractions=st.lists(st.floats(0.0, 1.0), min_size=2, max_size=2),
)
def test_gathered_tokens_give_the_full_pass_sums(vocab_size, num_drafts, concentration, zeros, sharpen, dtype, seed,
                                                 fractions):
    """Low sums at candidates in [1, K] from the tokens with q/p > 1 (rows read as strided views) against a
    float64 matrix product over every token: the same tokens are low, so they agree to the rounding of V terms."""
    pairs = torch.from_numpy(_rows(vocab_size, 3, concentration, zeros, seed, sharpen)).to(dtype)
    draft, target = pairs[:, 0], pairs[:, 1]  # strided views, as the verifier's rows are
    n = draft.shape[0]
    ratio = torch.div(target, draft)
    totals = torch.stack([draft.sum(-1, dtype=torch.float64), target.sum(-1, dtype=torch.float64)], -1).unsqueeze(-1)
    snap = 4 * vocab_size * 2.0**-52
    assert torch.equal(target > draft, ratio > 1)  # the gathering's comparison is the full pass's
    with mock.patch("spectr_audit.verifiers.rho_star._INSIDE_FRACTION", 1.0):  # every row gathered
        gathered = _AboveOneTokens.of(draft, target, totals, snap)
    candidates = (1 + (num_drafts - 1) * torch.tensor(fractions, dtype=torch.float64)).expand(n, 2).to(dtype)
    mask = (ratio.unsqueeze(1) <= candidates.unsqueeze(-1)).double()  # [n, 2, V]
    full = torch.bmm(torch.stack([draft, target], 1).double(), mask.transpose(1, 2))
    torch.testing.assert_close(gathered.low_sums(candidates), full, atol=8 * vocab_size * 2.0**-52, rtol=0)


def test_disjoint_supports_give_rho_one_on_the_gathered_path():
    """Disjoint supports: no low token has target mass, so the low target sum is exactly 0 and rho = 1."""
    vocab_size = 1000
    draft = torch.zeros(2, vocab_size)
    target = torch.zeros(2, vocab_size)
    draft[:, :900] = 1 / 900
    target[:, 900:] = torch.rand(2, 100, generator=torch.Generator().manual_seed(0)) + 0.1
    target /= target.sum(-1, keepdim=True)
    k = torch.tensor([3.0, 8.0], dtype=torch.float64)
    rho = kseq_rho_star_sampler(draft, target, k)
    assert torch.equal(rho, torch.ones(2, dtype=torch.float64))
    assert torch.equal(kseq_rho_star(draft.double(), target.double(), k), rho)


@settings(max_examples=40, deadline=None)
@given(
    vocab_size=st.sampled_from([300, 1000]),
    num_drafts=st.integers(2, 8),
    sharpen=st.sampled_from([1.5, 3.0]),
    dtype=st.sampled_from([torch.float64, torch.float32]),
    seed=st.integers(0, 2**31 - 1),
)
def test_the_gathered_solve_is_valid_and_tight(vocab_size, num_drafts, sharpen, dtype, seed):
    """The sampler's solve on the gathered path (peaked targets) against the exact rho* and against its own
    full passes: valid (at least rho*), and the full passes' rho to 1e-9 (their sums differ in the order of
    addition only; both sit above rho* by the validity margin's cost, which on these rows with float32 and
    K = 2 reaches 1e-4 of rho*: few tokens lie above 1, so f rises slowly past its root)."""
    pairs = torch.from_numpy(_rows(vocab_size, 4, 0.5, 0.0, seed, sharpen)).to(dtype)
    draft, target = pairs[:, 0], pairs[:, 1]
    k = torch.full((4,), float(num_drafts), dtype=torch.float64)
    exact = kseq_rho_star(draft.double(), target.double(), k)
    with mock.patch("spectr_audit.verifiers.rho_star._INSIDE_FRACTION", 1.0):
        gathered = kseq_rho_star_sampler(draft, target, k)
    with mock.patch("spectr_audit.verifiers.rho_star._INSIDE_FRACTION", -1.0):  # never gathered: full passes
        full = kseq_rho_star_sampler(draft, target, k)
    for rho in (gathered, full):
        assert bool((rho >= exact * (1 - 1e-15)).all()), (rho, exact)
    torch.testing.assert_close(gathered, full, rtol=1e-9, atol=0)
