"""Recursive rejection sampling (SpecInfer; EAGLE trees), with or without replacement."""

from __future__ import annotations

import torch

from spectr_audit.contract.randomness import sample_categorical_with_total
from spectr_audit.verifiers._walk import (
    ChainWalkVerifier,
    NodeRule,
    gather_tokens,
    normalise,
)
from spectr_audit.verifiers.triton_kernels import LazyResidual

__all__ = ["RecursiveRejection", "RecursiveRejectionRule", "RecursiveRejectionWithoutReplacement", "RowsResidual"]


class RowsResidual(LazyResidual):
    """A residual materialised on some batch rows only, as the chain walk's residual draw takes it.

    The other rows are never drawn from: a draft is accepted there with probability 1, so the walk
    outputs that draft whatever the draw gives.  Their draw returns token 0 with total 1 (so that no
    fallback draw is made for them); :meth:`materialise` gives the target's row there, as
    :meth:`RecursiveRejectionRule.sampler_parts` does.
    """

    def __init__(
        self,
        values: torch.Tensor,  # [m, vocab_size], the residual of the kept rows
        rows: torch.Tensor,  # [m] int64, their batch rows
        target: torch.Tensor,  # [n, vocab_size], the node's target rows
    ):
        self.values, self.kept_rows, self.target = values, rows, target

    @property
    def vocab_size(self) -> int:
        return self.target.shape[-1]

    def sample_with_total(self, u: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # ([n] int64, [n])
        """The draw of the kept rows (the contract's two-level draw, row by row as on the full tensor)."""
        num_rows = self.target.shape[0]
        drawn = torch.zeros(num_rows, dtype=torch.int64, device=u.device)
        total = torch.ones(num_rows, dtype=self.values.dtype, device=u.device)
        if self.kept_rows.numel() > 0:
            kept_drawn, kept_total = sample_categorical_with_total(self.values, u.index_select(0, self.kept_rows))
            drawn.index_copy_(0, self.kept_rows, kept_drawn)
            total.index_copy_(0, self.kept_rows, kept_total.to(total.dtype))
        return drawn, total

    def materialise(self) -> torch.Tensor:  # [n, vocab_size]
        """Every row: the residual on the kept rows, the target elsewhere (a full copy: for tests)."""
        return self.target.index_copy(0, self.kept_rows, self.values)

    def take(self, outer, inner):  # pragma: no cover - the chain walk never selects rows of a node's residual
        raise NotImplementedError("RowsResidual is read only by the chain walk's residual draw")

    def values_at(self, index):  # pragma: no cover
        raise NotImplementedError("RowsResidual is read only by the chain walk's residual draw")

    def totals(self, dtype=torch.float64):  # pragma: no cover
        raise NotImplementedError("RowsResidual is read only by the chain walk's residual draw")


class RecursiveRejectionRule(NodeRule):
    """Try the surviving drafts in order against a residual that shrinks after each rejection.

    ``R = q, D = p``; draft s_i is accepted with ``min(1, R(s_i) / D(s_i))``; after a
    rejection ``R = normalise((R - D)_+)``, and without replacement also ``D(s_i) = 0``
    renormalised (the ratio must use the law the token was actually drawn from).
    The residual update is :meth:`_residual_after_rejection`, so a variant changes it alone.
    """

    #: Whether the CPU sampler drops rows settled by a certain acceptance (:meth:`_sampler_walk`); the tests turn
    #: it off to compare the verdicts with and without.
    drop_settled_rows = True

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
        ``min(1, R(s_i) d / (s D(s_i)))`` and the residual after a rejection is ``(d R - s D)_+ =
        s d (R_n - D_n)_+``: a product, a fused multiply-add, a clip and a sum per draft instead of a normalisation
        (where ``R_n = D_n`` at a token the two products cancel exactly, as in the exact law);
        without replacement the rejected token is zeroed in place and ``d`` summed again.  The same law
        to rounding (the normalisations are only rescalings), on the rows as given.  A rule that
        changes :meth:`_residual_after_rejection` keeps :meth:`__call__`.

        On the CPU the residuals are computed only on the rows where some later draft or the residual
        can still be reached (:meth:`_sampler_walk`); elsewhere an earlier draft is accepted with
        probability 1, and the target stands in for the residual (never drawn there).
        """
        if type(self)._residual_after_rejection is not RecursiveRejectionRule._residual_after_rejection:
            return self(tokens, survivors, draft_dist, target_dist)
        accept, residual, rows = self._sampler_walk(tokens, survivors, draft_dist, target_dist)
        if rows is None:
            return accept, residual
        return accept, target_dist.index_copy(0, rows, residual)

    def chain_sampler_parts(self, tokens, survivors, draft_dist, target_dist):
        # the walk only draws from the residual: rows settled by a certain acceptance are neither copied nor drawn
        if (type(self).sampler_parts is not RecursiveRejectionRule.sampler_parts
                or type(self)._residual_after_rejection is not RecursiveRejectionRule._residual_after_rejection):
            return self.sampler_parts(tokens, survivors, draft_dist, target_dist)
        accept, residual, rows = self._sampler_walk(tokens, survivors, draft_dist, target_dist)
        if rows is None:
            return accept, residual
        return accept, RowsResidual(residual, rows, target_dist)

    def _sampler_walk(
        self,
        tokens: torch.Tensor,  # [n, num_drafts]
        survivors: torch.Tensor,  # [n, num_drafts] bool
        draft_dist: torch.Tensor,  # [n, vocab_size]
        target_dist: torch.Tensor,  # [n, vocab_size]
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:  # ([n, K], [m, V], [m] int64 or None)
        """The acceptances ``[n, K]``, and the final residual on ``rows`` only (every row when ``rows`` is None).

        A draft accepted with probability 1 (``R(s_i) >= D(s_i)`` in the ratio's own rounding) ends the
        row's node whatever its uniform is (``u < 1``): the later drafts' acceptances and the residual
        are never read there.  On the CPU, where counting costs no device round trip, such rows are
        dropped from the residual passes once dropping them saves more than the copy of the kept rows
        costs; each kept row's numbers are computed by the same operations on that row alone, so they
        are the same bit for bit, and the later acceptances of a dropped row are reported as 0.
        """
        on_cpu = draft_dist.device.type == "cpu"  # a host check of a few flags costs no device round trip there
        num_rows, num_drafts = tokens.shape
        residual, drafting = target_dist, draft_dist
        owned = False  # whether drafting is this call's own copy (zeroed in place without replacement)
        # the rows as given count as normalised (as __call__ takes them)
        res_total = torch.ones_like(target_dist[:, :1])
        draft_total = torch.ones_like(draft_dist[:, :1])
        rows = None  # the batch rows still computed (None: all of them)
        accept = None
        for i in range(num_drafts):
            token = tokens[:, i : i + 1]
            active = survivors[:, i : i + 1]
            drafted = gather_tokens(drafting, token)
            scaled = drafted * res_total
            ratio = gather_tokens(residual, token) * draft_total / torch.where(scaled > 0, scaled, torch.ones_like(scaled))
            accepted = torch.where(active & (drafted > 0), ratio.clamp(max=1.0), torch.zeros_like(ratio))
            if accept is None:
                accept = torch.zeros(num_rows, num_drafts, dtype=accepted.dtype, device=accepted.device)
            if rows is None:
                accept[:, i : i + 1] = accepted
            else:
                accept[:, i].index_copy_(0, rows, accepted.squeeze(1))
            if on_cpu and self.drop_settled_rows:
                # rows that accept draft i for sure: nothing after it is read there
                certain = (accepted >= 1).squeeze(1)
                num_certain = int(certain.sum())
                kept = certain.shape[0] - num_certain
                # dropping saves (K - i) residual steps (about 7 row passes each) on the certain rows and
                # costs a copy of the kept rows of R and D (about 4 row passes)
                if num_certain > 0 and 7 * num_certain * (num_drafts - i) > 4 * kept:
                    keep = (~certain).nonzero().squeeze(1)
                    rows = keep if rows is None else rows.index_select(0, keep)
                    tokens, survivors = tokens.index_select(0, keep), survivors.index_select(0, keep)
                    token, active, drafted = token.index_select(0, keep), active.index_select(0, keep), drafted.index_select(0, keep)
                    residual, drafting = residual.index_select(0, keep), drafting.index_select(0, keep)
                    res_total, draft_total = res_total.index_select(0, keep), draft_total.index_select(0, keep)
                    owned = True
                    if kept == 0:  # every row is settled: no residual is ever drawn
                        break
            # (d R - s D)_+, the residual (R / s - D / d)_+ scaled by s d: where R and D hold the same share of
            # their totals at a token the two products are the same float and cancel exactly, as the exact law's
            # normalised rows do (R - (s/d) D leaves a rounding residue there, which outweighs a residual mass
            # far below the rows' rounding)
            # (with replacement the drafting law keeps its total d = 1, and R * 1 is R: no product pass)
            scaled_residual = residual * draft_total if self.without_replacement else residual
            after = torch.addcmul(scaled_residual, drafting, -res_total).clamp_(min=0)
            after_total = after.sum(-1, keepdim=True)
            # no mass left (or the draft did not reach this node): the residual stays as it was
            keep_old = ~active | ~(after_total > 0)
            if on_cpu and not bool(keep_old.any()):
                residual, res_total = after, after_total
            else:
                residual, res_total = torch.where(keep_old, residual, after), torch.where(keep_old, res_total, after_total)
            if self.without_replacement:
                if not owned:
                    drafting = drafting.clone()  # zeroed in place below: never the caller's rows
                    owned = True
                drafting.scatter_(1, token, torch.where(active, torch.zeros_like(drafted), drafted))
                removed_total = drafting.sum(-1, keepdim=True)
                # a drafting law with no mass left stays as it was (as normalise's fallback keeps it)
                empty = active & ~(removed_total > 0)
                if not on_cpu or bool(empty.any()):
                    drafting.scatter_(1, token, torch.where(empty, drafted, gather_tokens(drafting, token)))
                    removed_total = torch.where(empty, draft_total, removed_total)
                draft_total = torch.where(active, removed_total, draft_total)
        return accept, residual, rows

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
