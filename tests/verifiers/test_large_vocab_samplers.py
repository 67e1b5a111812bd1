"""Samplers at vocabulary sizes that take the fast paths, against their own exact laws.

Above 256 tokens K-SEQ's sampler finds rho without sorting (``kseq_rho_star_sampler``), above 512
categorical draws go in two levels (``sample_categorical``), and float32 rows stay float32 in block
verification's sampler.  The small-vocabulary tests never reach those paths; these do, with float32
inputs as an engine would pass them.

Each case is one Pearson chi-square (cells with expected count < 5 pooled) at false-alarm rate 1e-3
with a fixed seed, so a correct sampler fails a given case with probability about 1e-3.
"""

from __future__ import annotations

import pytest
import torch

from spectr_audit.registry import load_verifier
from spectr_audit.contract.randomness import sample_categorical

from tests._stats import pooled_chisquare_pvalue

VOCAB_SIZE = 700
REPS = 20_000


def _pooled_pvalue(counts: torch.Tensor, expected: torch.Tensor) -> float:
    # K-SEQ's float32 sampler uses a rho a few float32 ulps above rho* (a valid rho: the output law is
    # still exactly q), which leaves residual mass ~1e-6 on tokens whose exact residual is 0 (q/p <= rho*);
    # so verdict cells of exact probability 0 may hold a handful of the 20,000 draws, no more.
    return pooled_chisquare_pvalue(counts, expected, max_zero_fraction=1e-4)


def _case(num_drafts: int, draft_len: int, seed: int):
    """One draft tuple (i.i.d. drafts share their conditionals), float32 rows."""
    gen = torch.Generator().manual_seed(seed)
    shape = (1, 1, draft_len + 1, VOCAB_SIZE)
    target = torch.softmax(2.5 * torch.randn(shape, generator=gen, dtype=torch.float64), -1)
    draft = torch.softmax(0.8 * target.log() + 0.8 * torch.randn(shape, generator=gen, dtype=torch.float64), -1)
    draft = draft[:, :, :draft_len]
    u = torch.rand(1, num_drafts, draft_len, generator=gen, dtype=torch.float64)
    tokens = sample_categorical(draft.expand(1, num_drafts, draft_len, VOCAB_SIZE), u)
    # shared prefixes share conditionals here (a context-free toy: the same rows at every node)
    return tokens, draft.expand(1, num_drafts, -1, -1).float(), target.expand(1, num_drafts, -1, -1).float()


@pytest.mark.parametrize("name,num_drafts,draft_len", [
    ("speculative", 1, 2), ("kseq", 4, 1), ("kseq", 2, 1), ("spectr-tree", 3, 2), ("rrs", 4, 1),
    ("block", 1, 3), ("greedy-block", 1, 2),
])
def test_fast_paths_follow_the_exact_law(name, num_drafts, draft_len):
    verifier = load_verifier(name)
    tokens, draft_probs, target_probs = _case(num_drafts, draft_len, seed=17 + num_drafts + draft_len)
    law = verifier.output_probs(tokens, draft_probs, target_probs)[0]  # [K, L + 1, V] float64
    rep = lambda t: t.expand(REPS, *t.shape[1:]).contiguous()
    out = verifier.verify(rep(tokens), rep(draft_probs), rep(target_probs), torch.Generator().manual_seed(5))
    cells = (out.draft_index * (draft_len + 1) + out.num_accepted) * VOCAB_SIZE + out.next_token
    counts = torch.bincount(cells, minlength=law.numel()).double()
    assert _pooled_pvalue(counts, law.reshape(-1) * REPS) > 1e-3, name


@pytest.mark.parametrize("name,num_drafts,draft_len", [("speculative", 1, 2), ("kseq", 4, 1), ("block", 1, 3)])
def test_half_precision_rows_follow_the_exact_law(name, num_drafts, draft_len):
    """bfloat16 rows: the sampler against the exact law (false-alarm rate 1e-3 per case, fixed seed).

    This catches gross half-precision errors (a bf16 running sum stalls after a few hundred terms); the
    rows' ~1e-3 miss of 1 is below its power, so the renormalisation is checked exactly below.
    """
    verifier = load_verifier(name)
    tokens, draft_probs, target_probs = _case(num_drafts, draft_len, seed=29 + num_drafts + draft_len)
    draft_probs, target_probs = draft_probs.bfloat16(), target_probs.bfloat16()
    drafted = draft_probs[0].gather(-1, tokens[0].unsqueeze(-1))
    assert bool((drafted > 0).all())  # the drafted tokens keep mass after rounding
    law = verifier.output_probs(tokens, draft_probs, target_probs)[0]
    rep = lambda t: t.expand(REPS, *t.shape[1:]).contiguous()
    out = verifier.verify(rep(tokens), rep(draft_probs), rep(target_probs), torch.Generator().manual_seed(6))
    cells = (out.draft_index * (draft_len + 1) + out.num_accepted) * VOCAB_SIZE + out.next_token
    counts = torch.bincount(cells, minlength=law.numel()).double()
    assert _pooled_pvalue(counts, law.reshape(-1) * REPS) > 1e-3, name


def test_half_rows_are_widened_and_renormalised():
    from spectr_audit.verifiers._walk import _sampler_dtype

    rows = torch.softmax(3 * torch.randn(4, VOCAB_SIZE, generator=torch.Generator().manual_seed(0)), -1)
    for dtype in (torch.bfloat16, torch.float16):
        half = rows.to(dtype)
        assert (half.float().sum(-1) - 1).abs().max() > 1e-5  # rounding leaves them off the simplex
        widened = _sampler_dtype(half)
        assert widened.dtype == torch.float32
        torch.testing.assert_close(widened.sum(-1), torch.ones(4), atol=1e-6, rtol=0)
        # proportional to the half-precision values (the exact law renormalises the same way)
        torch.testing.assert_close(widened, half.double().div(half.double().sum(-1, keepdim=True)).float())
    float32_rows = rows.clone()
    assert _sampler_dtype(float32_rows) is float32_rows  # float32 is used as given, without a copy
