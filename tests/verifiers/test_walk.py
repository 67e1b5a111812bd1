"""The tree walk's row helpers against plain indexing, on every stride layout a harness or engine hands over."""

from __future__ import annotations

import torch
from hypothesis import given, settings, strategies as st

from spectr_audit.contract.randomness import uniform
from spectr_audit.registry import load_verifier
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
    gen = torch.Generator().manual_seed(seed + 1)
    subset = torch.randperm(batch_size, generator=gen)[: int(torch.randint(batch_size + 1, (1,), generator=gen))]
    for dists in _layouts(batch_size, num_drafts, draft_len, vocab_size, seed):
        expected = torch.stack([dists[b, index[b]] for b in range(batch_size)])
        assert torch.equal(_rows_of(dists, index), expected)
        # only some batch rows, in any order (the walk's rows still going)
        assert torch.equal(_rows_of(dists, index, subset), expected[subset])


def test_a_level_where_every_walk_has_stopped_draws_its_uniforms_and_reads_nothing():
    """Every drafted root token has target mass 0, so every walk stops at the root; the next level has no row
    to evaluate.  With V > 512 the residual is drawn in two levels, which an empty batch of rows cannot
    reshape: the level must be skipped, yet draw its uniforms (the stream the bonus token is drawn from)."""
    vocab_size, batch_size, draft_len = 600, 5, 3
    draft = torch.full((batch_size, 1, draft_len, vocab_size), 1.0 / vocab_size, dtype=torch.float64)
    target = torch.full((batch_size, 1, draft_len + 1, vocab_size), 1.0 / (vocab_size - 1), dtype=torch.float64)
    target[:, :, :, 0] = 0.0
    tokens = torch.zeros(batch_size, 1, draft_len, dtype=torch.int64)  # token 0 everywhere: rejected at the root
    out = load_verifier("speculative").verify(tokens, draft, target, torch.Generator().manual_seed(0))
    assert out.num_accepted.tolist() == [0] * batch_size
    assert bool((out.next_token > 0).all())  # from the residual (q - p)_+, which has no mass on token 0
    # the uniforms: one [B, 2] draw per level and one [B] for the bonus token, whether or not a level is evaluated
    gen = torch.Generator().manual_seed(0)
    load_verifier("speculative").verify(tokens, draft, target, gen)
    reference = torch.Generator().manual_seed(0)
    for _ in range(draft_len):
        uniform(reference, (batch_size, 2), torch.device("cpu"))
    uniform(reference, (batch_size,), torch.device("cpu"))
    assert torch.equal(torch.rand(4, generator=gen), torch.rand(4, generator=reference))


@settings(max_examples=200, deadline=None)
@given(rows=st.integers(1, 6).flatmap(
    lambda width: st.lists(st.lists(st.booleans(), min_size=width, max_size=width), min_size=1, max_size=8)))
def test_first_true_is_the_first_true_or_zero(rows):
    mask = torch.tensor(rows)
    expected = [next((i for i, x in enumerate(r) if x), 0) for r in rows]
    assert _first_true(mask).tolist() == expected
