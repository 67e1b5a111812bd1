"""The CPU samplers that evaluate only the rows they need draw the tokens of evaluating every row.

Speculative sampling decides acceptance before it builds a residual (``NodeRule.sampler_accept_probs``),
and block verification copies out the residual row each stopped row draws from: each row's draw
depends on that row and its uniforms alone, so the tokens must be those of the whole-level paths.
"""

from __future__ import annotations

import pytest
import torch

from spectr_audit.contract.randomness import sample_categorical
from spectr_audit.verifiers.block import BlockVerification
from spectr_audit.verifiers.greedy_block import GreedyBlockVerification
from spectr_audit.verifiers.speculative import MaximalCouplingRule, SpeculativeSampling


class _WholeLevelRule(MaximalCouplingRule):
    """The same rule, with no acceptance probabilities apart: the walk evaluates every row of a level."""

    def sampler_accept_probs(self, tokens, survivors, draft_dist, target_dist):
        return None


class _WholeLevelSpeculative(SpeculativeSampling):
    rule = _WholeLevelRule()


def _inputs(batch_size, draft_len, vocab_size, dtype, seed, same_rows=False):
    gen = torch.Generator().manual_seed(seed)
    shape = (batch_size, 1, draft_len + 1, vocab_size)
    target = torch.softmax(3 * torch.randn(shape, generator=gen, dtype=torch.float64), dim=-1)
    draft = torch.softmax(0.7 * target.log() + torch.randn(shape, generator=gen, dtype=torch.float64), dim=-1)
    if same_rows:  # rows where p = q: every draft is accepted and the residual has no mass
        draft[::3] = target[::3]
    draft = draft[:, :, :draft_len].contiguous()
    tokens = sample_categorical(draft, torch.rand(draft.shape[:-1], generator=gen, dtype=torch.float64))
    return tokens, draft.to(dtype), target.to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("vocab_size", [5, 700])
@pytest.mark.parametrize("draft_len", [1, 3])
def test_speculative_accept_first_draws_the_whole_level_tokens(dtype, vocab_size, draft_len):
    for seed in range(3):
        tokens, draft, target = _inputs(96, draft_len, vocab_size, dtype, seed, same_rows=seed == 2)
        split = SpeculativeSampling().verify(tokens, draft, target, torch.Generator().manual_seed(seed))
        whole = _WholeLevelSpeculative().verify(tokens, draft, target, torch.Generator().manual_seed(seed))
        for field in ("num_accepted", "draft_index", "next_token"):
            assert torch.equal(getattr(split, field), getattr(whole, field)), field


@pytest.mark.parametrize("verifier", [BlockVerification(), GreedyBlockVerification()], ids=lambda v: v.name)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
@pytest.mark.parametrize("vocab_size", [5, 700])
def test_block_rows_draw_the_all_rows_tokens(verifier, dtype, vocab_size):
    """The CPU path (residual rows copied out at tau, level 0 built on its rows) against the all-rows path."""
    for seed in range(3):
        tokens, draft, target = _inputs(96, 3, vocab_size, dtype, seed, same_rows=seed == 2)
        gen = torch.Generator().manual_seed(seed)
        by_rows = verifier.verify(tokens, draft, target, gen)
        # the all-rows path: every level's residual, the correction and the bonus drawn for every row
        pass_probs, residual = verifier._sampler_levels(tokens, draft, target)
        u = torch.rand((96, 4), generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
        tau = ((u[:, :3] < pass_probs) * torch.arange(1, 4)).amax(-1)
        rows = torch.arange(96)
        level = tau.clamp(max=2)
        rows_target = target[:, 0].float() if dtype == torch.bfloat16 else target[:, 0]
        if dtype == torch.bfloat16:  # widened and renormalised, as the sampler does
            rows_target = rows_target / rows_target.sum(-1, keepdim=True)
        at_tau = residual[rows, level]
        total = at_tau.sum(-1)
        correction = torch.where(total > 0, sample_categorical(at_tau, u[:, 3]),
                                 sample_categorical(rows_target[rows, level], u[:, 3]))
        bonus = sample_categorical(rows_target[:, 3], u[:, 3])
        assert torch.equal(by_rows.num_accepted, tau)
        assert torch.equal(by_rows.next_token, torch.where(tau < 3, correction, bonus))
