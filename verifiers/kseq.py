"""SpecTr's K-SEQ token-level selection, and the SpecTr draft tree built on it."""

from __future__ import annotations

import torch

from spectr_audit.verifiers import compiled, triton_kernels
from spectr_audit.verifiers.rho_star import kseq_accept_prob, kseq_rho_star, kseq_rho_star_sampler
from spectr_audit.verifiers._walk import NodeRule, ChainWalkVerifier, gather_tokens, normalise

__all__ = ["KSeq", "KSeqRule", "SpecTrTree"]


def _rho_per_distinct_k(solver, draft_dist: torch.Tensor, target_dist: torch.Tensor, num_drafts: torch.Tensor) -> torch.Tensor:
    """``solver(draft_dist, target_dist, num_drafts)`` ``[n]``, solved once per K when every row is the same pair.

    An exact audit's root node, and a Monte-Carlo audit of a context-free model, repeat one (p, q) pair
    over every row (262,144 rows at V = 8, K = 6); each row's rho depends only on that row, so the result
    is the same, bit for bit.  The check is a host sync, so it runs only where that costs nothing (CPU)
    or off the hot path (the exact law).
    """
    n = draft_dist.shape[0]
    # rows of a real batch differ: the last row rejects the full comparison at once
    if n > 1 and torch.equal(draft_dist[-1], draft_dist[0]) and torch.equal(target_dist[-1], target_dist[0]) and (
        torch.equal(draft_dist, draft_dist[:1].expand_as(draft_dist))
        and torch.equal(target_dist, target_dist[:1].expand_as(target_dist))
    ):
        # K is a whole number of surviving drafts: solve for k = 1 .. max K and look each row's up
        largest = int(num_drafts.max())
        key = (solver, largest, draft_dist.dtype, draft_dist.device, draft_dist[0].cpu().numpy().tobytes(),
               target_dist[0].cpu().numpy().tobytes())
        rho = _SOLVED.get(key)
        if rho is None:
            values = torch.arange(1, largest + 1, dtype=torch.float64, device=num_drafts.device)
            rho = solver(draft_dist[:1].expand(largest, -1), target_dist[:1].expand(largest, -1), values)
            # a Monte-Carlo audit calls with the same pair chunk after chunk: the solve (a few hundred small
            # ops) is kept for the last few pairs; rho is a function of the pair and k alone
            _SOLVED[key] = rho
            while len(_SOLVED) > _SOLVED_PAIRS:
                _SOLVED.pop(next(iter(_SOLVED)))
        return rho[num_drafts.long() - 1]
    return solver(draft_dist, target_dist, num_drafts)


#: The last few (solver, max K, pair) solves of :func:`_rho_per_distinct_k`, oldest first.
_SOLVED: dict = {}
_SOLVED_PAIRS = 8


class KSeqRule(NodeRule):
    """K-SEQ at one node, with k = the number of surviving drafts (docs/rules/kseq.md).

    The exact law uses rho* from :func:`~spectr_audit.verifiers.rho_star.kseq_rho_star`; the sampler a valid
    rho equal to it to the rows' precision, found without sorting
    (:func:`~spectr_audit.verifiers.rho_star.kseq_rho_star_sampler`).  ``rho_scale``
    multiplies it, which exists only so that the broken-verifier library can build
    "rho a little below rho*" without copying this code.
    """

    def __init__(self, rho_scale: float = 1.0):
        self.rho_scale = rho_scale

    def __call__(self, tokens, survivors, draft_dist, target_dist):
        # the exact law: rho* from the exact piecewise solve, in float64
        num_survivors = survivors.sum(-1).to(torch.float64)  # [n]
        rho = _rho_per_distinct_k(kseq_rho_star, draft_dist, target_dist, num_survivors.clamp(min=1))
        accept_probs, excess = self._parts(tokens, num_survivors, rho, draft_dist, target_dist)
        return accept_probs, normalise(excess, target_dist)

    def sampler_parts(self, tokens, survivors, draft_dist, target_dist):
        return self._sampler_parts(tokens, survivors, draft_dist, target_dist, lazy=False)

    def chain_sampler_parts(self, tokens, survivors, draft_dist, target_dist):
        # On CUDA (spectr_audit.verifiers.triton_kernels): beta and the residual's block sums, one read each
        lazy = type(self).sampler_parts is KSeqRule.sampler_parts and triton_kernels.fused_rows(draft_dist)
        return self._sampler_parts(tokens, survivors, draft_dist, target_dist, lazy=lazy)

    def _sampler_parts(self, tokens, survivors, draft_dist, target_dist, lazy):
        # the sampler: a valid rho equal to rho* to the rows' precision, without sorting the vocabulary
        num_survivors = survivors.sum(-1).to(torch.float64)  # [n]
        if draft_dist.device.type == "cpu":
            rho = _rho_per_distinct_k(kseq_rho_star_sampler, draft_dist, target_dist, num_survivors.clamp(min=1))
        else:
            rho = kseq_rho_star_sampler(draft_dist, target_dist, num_survivors.clamp(min=1))
        return self._parts(tokens, num_survivors, rho, draft_dist, target_dist, fused=compiled.compiled_enabled(),
                           lazy=lazy)

    def _parts(self, tokens, num_survivors, rho, draft_dist, target_dist, fused=False, lazy=False):
        """Acceptance probabilities ``[n, K]`` and the unnormalised residual ``[n, V]`` at a given rho.

        ``lazy``: the Triton kernels, and the residual as a
        :class:`~spectr_audit.verifiers.triton_kernels.LazyResidual`.
        """
        rho = rho * self.rho_scale
        # [n, 1] in the rows' dtype: float32 rows keep the [n, vocab_size] work in float32
        rho = rho.unsqueeze(-1).to(target_dist.dtype)
        if lazy:  # one read for beta (spectr_audit.verifiers.triton_kernels), m_rho never materialised
            beta = triton_kernels.kseq_beta(draft_dist, target_dist, rho)
        elif fused:  # the sampler with spectr_audit.verifiers.compiled on: two fused passes, m_rho never materialised
            beta = compiled.kseq_beta(draft_dist, target_dist, rho)
        else:
            weighted = torch.minimum(draft_dist, target_dist / rho)  # m_rho(x) = min(p(x), q(x) / rho)
            beta = weighted.sum(-1, keepdim=True)
        accept_any = kseq_accept_prob(beta, num_survivors.unsqueeze(-1))  # P_A = 1 - (1 - beta)^k, without cancellation
        # beta = 0 (disjoint supports): P_A = 0 and the residual is the target itself.
        scale = torch.where(beta > 0, accept_any / torch.where(beta > 0, beta, torch.ones_like(beta)), torch.zeros_like(beta))
        if lazy:  # the residual's block sums in one more read; its values are recomputed where drawn
            excess = triton_kernels.kseq_excess_residual(draft_dist, target_dist, rho, scale.to(target_dist.dtype))
        elif fused:
            excess = compiled.kseq_excess(draft_dist, target_dist, rho, scale.to(target_dist.dtype))
        else:
            # [n, vocab_size] (q - scale m_rho)_+, computed in place in the buffer of m_rho
            excess = torch.sub(target_dist, weighted.mul_(scale.to(weighted.dtype)), out=weighted).clamp_(min=0)
        drafted = gather_tokens(draft_dist, tokens)
        ratio = gather_tokens(target_dist, tokens) / (rho * torch.where(drafted > 0, drafted, torch.ones_like(drafted)))
        accept_probs = torch.where(drafted > 0, ratio.clamp(max=1.0), torch.zeros_like(ratio))
        return accept_probs, excess


class KSeq(ChainWalkVerifier):
    """K-SEQ (SpecTr, Sun et al. 2023): token-level selection among K i.i.d. drafts, L = 1.

    Draft i is accepted with ``min(1, q(x_i) / (rho* p(x_i)))`` in order; the first accepted
    is the output; if none is, the output is drawn from ``(q - A)/(1 - P_A)`` with
    ``A = (P_A / beta) min(p, q / rho*)``.  Duplicated drafts are kept (each copy is a trial).
    Acceptance ``P_A >= (1 - (1 - 1/K)^K) alpha*``.
    """

    name = "kseq"
    description = "SpecTr K-SEQ token-level selection"
    max_draft_len = 1
    guarantees = frozenset({"spectr"})
    rule = KSeqRule()


class SpecTrTree(KSeq):
    """The SpecTr draft tree: K i.i.d. drafts of length L, K-SEQ at every node.

    At each node K-SEQ runs over the drafts that survived so far (rho recomputed for
    their number); a drawn token that matches surviving drafts continues along them
    (also when it came from the residual), otherwise the step ends with it.
    """

    name = "spectr-tree"
    description = "SpecTr draft tree: K-SEQ at every node over the surviving drafts"
    min_draft_len = 2
    max_draft_len = None
    guarantees = frozenset()
