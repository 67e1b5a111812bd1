"""The tree walk's row helpers against plain indexing, on every stride layout a harness or engine hands over."""

from __future__ import annotations

import torch
from hypothesis import given, settings, strategies as st

from spectr_audit.verifiers._walk import _first_true, _rows_of


def _layouts(batch_size, num_drafts, draft_len, vocab_size, seed):
    """``[B, K, V]`` views with the strides seen in practice: a level of a contiguous ``[B, K, L, V]``,
    a level of an expanded (stride-0) one, a contiguous ``[B, K, V]``, and a transposed copy."""
    gen = torch.Generator().manual_seed(seed)
    full = torch.rand(batch_size, num_drafts, draft_len, vocab_size, generator=gen, dtype=torch.float64)
    row = torch.rand(vocab_size, generator=gen, dtype=torch.float64)
    expanded = row.expand(batch_size, num_drafts, draft_len, vocab_size)
    level = int(torch.randint(draft_len, (1,), generator=gen))
    transposed = torch.rand(num_drafts, batch_size, vocab_size, generator=gen, dtype=torch.float64).transpose(0, 1)
    return [full[:, :, level], expanded[:, :, level], full[:, :, level].contiguous(), transposed]


@settings(max_examples=200, deadline=None)
@given(batch_size=st.integers(1, 9), num_drafts=st.integers(1, 5), draft_len=st.integers(1, 3),
       vocab_size=st.integers(1, 7), seed=st.integers(0, 2**16))
def test_rows_of_is_plain_indexing(batch_size, num_drafts, draft_len, vocab_size, seed):
    index = torch.randint(num_drafts, (batch_size,), generator=torch.Generator().manual_seed(seed))
    for dists in _layouts(batch_size, num_drafts, draft_len, vocab_size, seed):
        expected = torch.stack([dists[b, index[b]] for b in range(batch_size)])
        assert torch.equal(_rows_of(dists, index), expected)


@settings(max_examples=200, deadline=None)
@given(rows=st.integers(1, 6).flatmap(
    lambda width: st.lists(st.lists(st.booleans(), min_size=width, max_size=width), min_size=1, max_size=8)))
def test_first_true_is_the_first_true_or_zero(rows):
    mask = torch.tensor(rows)
    expected = [next((i for i, x in enumerate(r) if x), 0) for r in rows]
    assert _first_true(mask).tolist() == expected
