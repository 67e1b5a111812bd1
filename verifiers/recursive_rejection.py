"""Recursive rejection sampling (SpecInfer; EAGLE trees), with or without replacement."""

from __future__ import annotations

import torch

from spectr_audit.verifiers._walk import NodeRule, ChainWalkVerifier, gather_tokens, normalise

__all__ = ["RecursiveRejection", "RecursiveRejectionWithoutReplacement", "RecursiveRejectionRule"]


class RecursiveRejectionRule(NodeRule):
    """Try the surviving drafts in order against a residual that shrinks after each rejection.

    ``R = q, D = p``; draft s_i is accepted with ``min(1, R(s_i) / D(s_i))``; after a
    rejection ``R = normalise((R - D)_+)``, and without replacement also ``D(s_i) = 0``
    renormalised (the ratio must use the law the token was actually drawn from).
    The residual update is :meth:`_residual_after_rejection`, so a variant changes it alone.
    """

    def __init__(self, without_replacement: bool = False):
        self.without_replacement = without_replacement

    def __call__(self, tokens, survivors, draft_dist, target_dist):
        residual = target_dist
        drafting = draft_dist
        accept = []
        for i in range(tokens.shape[1]):
            token = tokens[:, i : i + 1]
            active = survivors[:, i : i + 1]
            drafted = gather_tokens(drafting, token)
            ratio = gather_tokens(residual, token) / torch.where(drafted > 0, drafted, torch.ones_like(drafted))
            accept.append(torch.where(active & (drafted > 0), ratio.clamp(max=1.0), torch.zeros_like(ratio)))
            residual = torch.where(active, self._residual_after_rejection(residual, drafting, token), residual)
            if self.without_replacement:
                removed = drafting.scatter(1, token, 0.0)
                drafting = torch.where(active, normalise(removed, drafting), drafting)
        return torch.cat(accept, dim=1), residual

    def _residual_after_rejection(
        self,
        residual: torch.Tensor,  # [n, vocab_size]
        drafting: torch.Tensor,  # [n, vocab_size], the law the rejected token was drawn from
        token: torch.Tensor,  # [n, 1], the rejected token
    ) -> torch.Tensor:  # [n, vocab_size]
        """The residual after a rejection: ``normalise((R - D)_+)``."""
        return normalise((residual - drafting).clamp(min=0), residual)


class RecursiveRejection(ChainWalkVerifier):
    """Recursive rejection sampling over K i.i.d. drafts (any L: applied at every tree node).

    Duplicated drafts are tried again (skipping them breaks exactness with i.i.d. drafts).
    """

    name = "rrs"
    description = "recursive rejection sampling, i.i.d. drafts (SpecInfer-style)"
    rule = RecursiveRejectionRule(without_replacement=False)


class RecursiveRejectionWithoutReplacement(ChainWalkVerifier):
    """Recursive rejection sampling for drafts drawn without replacement (L = 1).

    The drafts must be distinct tokens drawn sequentially from p with the drawn tokens
    removed (SpecInfer / Sequoia token trees); the drafting law is renormalised after each
    rejection accordingly.
    """

    name = "rrs-wor"
    description = "recursive rejection sampling, drafts drawn without replacement"
    draft_scheme = "without_replacement"
    max_draft_len = 1
    rule = RecursiveRejectionRule(without_replacement=True)
