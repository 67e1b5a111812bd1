"""Single-draft speculative sampling (the maximal coupling), token by token over L positions."""

from __future__ import annotations

import torch

from spectr_audit.verifiers import triton_kernels
from spectr_audit.verifiers._walk import NodeRule, ChainWalkVerifier, gather_tokens, normalise

__all__ = ["SpeculativeSampling", "MaximalCouplingRule"]


class MaximalCouplingRule(NodeRule):
    """Accept draft token x with min(1, q(x)/p(x)); else draw from (q - p)_+ normalised."""

    def __call__(self, tokens, survivors, draft_dist, target_dist):
        accept_probs, excess = self.sampler_parts(tokens, survivors, draft_dist, target_dist)
        return accept_probs, normalise(excess, target_dist)

    def sampler_parts(self, tokens, survivors, draft_dist, target_dist):
        excess = torch.sub(target_dist, draft_dist).clamp_(min=0)  # [n, vocab_size] (q - p)_+, clamped in place
        return self._accept_probs(tokens, draft_dist, target_dist), excess

    def chain_sampler_parts(self, tokens, survivors, draft_dist, target_dist):
        # On CUDA (spectr_audit.verifiers.triton_kernels): (q - p)_+ by its block sums, in one read of p and q
        if type(self).sampler_parts is MaximalCouplingRule.sampler_parts and triton_kernels.fused_rows(draft_dist):
            n = draft_dist.shape[0]
            ones = torch.ones(n, dtype=draft_dist.dtype, device=draft_dist.device)
            excess = triton_kernels.difference_residual(target_dist, draft_dist, ones, -ones)
            return self._accept_probs(tokens, draft_dist, target_dist), excess
        return self.sampler_parts(tokens, survivors, draft_dist, target_dist)

    def sampler_accept_probs(self, tokens, survivors, draft_dist, target_dist):
        # those of sampler_parts, unless a subclass changes how it samples
        if type(self).sampler_parts is not MaximalCouplingRule.sampler_parts or (
                type(self).chain_sampler_parts is not MaximalCouplingRule.chain_sampler_parts):
            return None
        return self._accept_probs(tokens, draft_dist, target_dist)

    @staticmethod
    def _accept_probs(tokens, draft_dist, target_dist):  # [n, num_drafts]: min(1, q(x) / p(x)), 0 where p(x) = 0
        drafted = gather_tokens(draft_dist, tokens)
        ratio = gather_tokens(target_dist, tokens) / torch.where(drafted > 0, drafted, torch.ones_like(drafted))
        return torch.where(drafted > 0, ratio.clamp(max=1.0), torch.zeros_like(ratio))


class SpeculativeSampling(ChainWalkVerifier):
    """Single-draft speculative sampling (Leviathan et al.; Chen et al.), K = 1, any L.

    Each draft token is accepted with probability ``min(1, q(x) / p(x))`` in turn; at the
    first rejection a correction token is drawn from ``(q - p)_+`` normalised at that node
    and the step ends; if all L tokens pass, a bonus token is drawn from the target at the
    end of the draft.  Acceptance at one position is ``sum min(p, q) = 1 - TV(p, q)``.

    Examples
    --------
    >>> import torch
    >>> v = SpeculativeSampling()
    >>> draft_probs = torch.tensor([[[[0.6, 0.4]]]], dtype=torch.float64)
    >>> target_probs = torch.tensor([[[[0.3, 0.7], [0.5, 0.5]]]], dtype=torch.float64)
    >>> law = v.output_probs(torch.tensor([[[0]]]), draft_probs, target_probs)
    >>> round(float(law[0, 0, 1].sum()), 6)   # P(the drafted token 0 is accepted) = 0.3 / 0.6
    0.5
    """

    name = "speculative"
    description = "single-draft speculative sampling (maximal coupling), token by token"
    min_drafts = 1
    max_drafts = 1
    #: With one draft the maximal coupling attains alpha* = sum min(p, q).
    guarantees = frozenset({"optimal"})
    rule = MaximalCouplingRule()
