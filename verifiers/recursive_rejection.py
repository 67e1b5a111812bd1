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

    def sampler_parts(self, tokens, survivors, draft_dist, target_dist):
        """:meth:`__call__`'s acceptances and residual with the residual and the drafting law kept unnormalised.

        With ``R = s R_n`` and ``D = d D_n`` (totals s, d), draft s_i is accepted with
        ``min(1, R(s_i) d / (s D(s_i)))`` and the residual after a rejection is ``(R - (s/d) D)_+ =
        s (R_n - D_n)_+``: one fused multiply-add, a clip and a sum per draft instead of a normalisation;
        without replacement the rejected token is zeroed in place and ``d`` summed again.  The same law
        to rounding (the normalisations are only rescalings), on the rows as given.  A rule that
        changes :meth:`_residual_after_rejection` keeps :meth:`__call__`.
        """
        if type(self)._residual_after_rejection is not RecursiveRejectionRule._residual_after_rejection:
            return self(tokens, survivors, draft_dist, target_dist)
        on_cpu = draft_dist.device.type == "cpu"  # a host check of a few flags costs no device round trip there
        residual, drafting = target_dist, draft_dist
        # the rows as given count as normalised (as __call__ takes them)
        res_total = torch.ones_like(target_dist[:, :1])
        draft_total = torch.ones_like(draft_dist[:, :1])
        accept = []
        for i in range(tokens.shape[1]):
            token = tokens[:, i : i + 1]
            active = survivors[:, i : i + 1]
            drafted = gather_tokens(drafting, token)
            scaled = drafted * res_total
            ratio = gather_tokens(residual, token) * draft_total / torch.where(scaled > 0, scaled, torch.ones_like(scaled))
            accept.append(torch.where(active & (drafted > 0), ratio.clamp(max=1.0), torch.zeros_like(ratio)))
            after = torch.addcmul(residual, drafting, -(res_total / draft_total)).clamp_(min=0)  # (R - (s/d) D)_+
            after_total = after.sum(-1, keepdim=True)
            # no mass left (or the draft did not reach this node): the residual stays as it was
            keep = ~active | ~(after_total > 0)
            if on_cpu and not bool(keep.any()):
                residual, res_total = after, after_total
            else:
                residual, res_total = torch.where(keep, residual, after), torch.where(keep, res_total, after_total)
            if self.without_replacement:
                if i == 0:
                    drafting = drafting.clone()  # zeroed in place below: never the caller's rows
                drafting.scatter_(1, token, torch.where(active, torch.zeros_like(drafted), drafted))
                removed_total = drafting.sum(-1, keepdim=True)
                # a drafting law with no mass left stays as it was (as normalise's fallback keeps it)
                empty = active & ~(removed_total > 0)
                if not on_cpu or bool(empty.any()):
                    drafting.scatter_(1, token, torch.where(empty, drafted, gather_tokens(drafting, token)))
                    removed_total = torch.where(empty, draft_total, removed_total)
                draft_total = torch.where(active, removed_total, draft_total)
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
