"""Node rules the broken and historic libraries share (docs/rules/speculative.md for the correct rule).

:class:`CouplingRule` is speculative sampling's node rule with its two parts, the acceptance
and the residual, as methods: a slip overrides one of them and nothing else, so the override is
the whole bug.  The rules here import nothing of ``verifiers/block.py`` (the historic library
imports without it).
"""

from __future__ import annotations

import torch

from spectr_audit.verifiers._walk import NodeRule, gather_tokens, normalise
from spectr_audit.verifiers.speculative import MaximalCouplingRule


def first_occurrence(
    tokens: torch.Tensor,  # [n, num_drafts] int64
    survivors: torch.Tensor,  # [n, num_drafts] bool
) -> torch.Tensor:  # [n, num_drafts] bool
    """Surviving drafts whose token no earlier surviving draft carries."""
    num_drafts = tokens.shape[1]
    earlier = torch.ones(num_drafts, num_drafts, dtype=torch.bool, device=tokens.device).tril(-1)  # [i, j]: j < i
    same = (tokens.unsqueeze(2) == tokens.unsqueeze(1)) & survivors.unsqueeze(1) & earlier
    return survivors & ~same.any(-1)


class CouplingRule(NodeRule):
    """Accept each draft token with ``min(1, q/p)``; the residual is ``(q - p)_+`` normalised.

    The correct rule at K = 1 (the exact law only: its sampler is the plain ``__call__``, not the
    reference rule's fused one); subclasses replace :meth:`accept_probs` or :meth:`residual`.
    """

    def __call__(self, tokens, survivors, draft_dist, target_dist):
        return self.accept_probs(tokens, draft_dist, target_dist), self.residual(tokens, draft_dist, target_dist)

    def accept_probs(self, tokens, draft_dist, target_dist):  # [n, num_drafts]
        """``min(1, q(x) / p(x))`` per draft token, 0 where ``p(x) = 0``."""
        return MaximalCouplingRule._accept_probs(tokens, draft_dist, target_dist)

    def residual(self, tokens, draft_dist, target_dist):  # [n, vocab_size]
        """``(q - p)_+`` normalised (the target where it has no mass)."""
        return normalise((target_dist - draft_dist).clamp(min=0), target_dist)


class ResampleTargetRule(CouplingRule):
    """The slip: on rejection the token is drawn from the target q itself instead of ``(q - p)_+``."""

    def residual(self, tokens, draft_dist, target_dist):
        return target_dist


class AlwaysAcceptRule(NodeRule):
    """The slip: every drafted token passes (an acceptance coin stuck at 0, tested with ``ratio >= u``)."""

    def __call__(self, tokens, survivors, draft_dist, target_dist):
        return (gather_tokens(draft_dist, tokens) > 0).to(draft_dist.dtype), target_dist
