"""The sort-free rho* solve's passes over the gathered tokens with q/p > 1 against a full pass over every token."""

from __future__ import annotations

import numpy as np
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from spectr_audit.verifiers.rho_star import (
    _AboveOneTokens,
    kseq_rho_star,
    kseq_rho_star_sampler,
)


def _rows(vocab_size, rows, concentration, zeros, seed):
    rng = np.random.default_rng(seed)
    out = rng.dirichlet(np.full(vocab_size, concentration), size=(rows, 2))
    out[rng.random(out.shape) < zeros] = 0.0
    out[..., 0] += 1e-3  # a token with mass on both sides
    return out / out.sum(-1, keepdims=True)  # [rows, 2, V]


@settings(max_examples=60, deadline=None)
@given(
    vocab_size=st.sampled_from([2, 7, 300, 1000]),
    num_drafts=st.integers(1, 8),
    concentration=st.sampled_from([0.05, 0.5, 2.0]),
    zeros=st.sampled_from([0.0, 0.3]),
    dtype=st.sampled_from([torch.float64, torch.float32]),
    seed=st.integers(0, 2**31 - 1),
    fractions=st.lists(st.floats(0.0, 1.0), min_size=2, max_size=2),
)
def test_gathered_tokens_give_the_full_pass_sums(vocab_size, num_drafts, concentration, zeros, dtype, seed, fractions):
    """Low sums at candidates in [1, K] from the tokens with q/p > 1 (rows read as strided views) against a
    float64 matrix product over every token: the same tokens are low, so they agree to the rounding of V terms."""
    pairs = torch.from_numpy(_rows(vocab_size, 3, concentration, zeros, seed)).to(dtype)
    draft, target = pairs[:, 0], pairs[:, 1]  # strided views, as the verifier's rows are
    n = draft.shape[0]
    ratio = torch.div(target, draft)
    totals = torch.stack([draft.sum(-1, dtype=torch.float64), target.sum(-1, dtype=torch.float64)], -1).unsqueeze(-1)
    snap = 4 * vocab_size * 2.0**-52
    gathered = _AboveOneTokens.of(draft, target, ratio, totals, snap)
    if gathered is None:  # over a quarter of the tokens above 1: the solve takes full passes
        assert int((ratio > 1).sum(-1).max()) > 0.25 * vocab_size
        return
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
