"""Greedy block verification (docs/rules/greedy-block.md), with and without its next-iteration repair.

Greedy block verification accepts the drafted prefix ``x^i`` with the joint
ratio, ``P(tau >= i | x^i) = min(1, q(x^i) / p(x^i))``: the maximal coupling
of the draft's and the target's laws of ``i``-token strings, at every ``i`` at
once.  That is more than any verifier exact with the unmodified target can
accept (the block LPs, docs/audit/bounds.md), and one iteration alone is not exact: the correction
token ``y ~ (q(x^tau y) - p(x^tau y))_+`` leaves the string ``x^tau y`` with
the right probability but its continuation must be drawn from the joint
residual ``(q(x^tau y z) - p(x^tau y z))_+`` until depth ``L``.

The general repair (docs/rules/greedy-block.md) is ``q~(x|u) = (q(ux) - B(ux)) / (q(u) - B(u) + E(u))``
with this verifier's prefix law ``B`` and exact emission law ``E`` (averaged
over the draft, given the iteration's start).  For this verifier
``B(u) = min(p(u), q(u)) + E(u)`` for ``|u| <= L`` and
``E(ux) = [min(p(u), q(u)) - sum_z min(p(uz), q(uz))] (q(ux) - p(ux))_+ / sum_z (q(uz) - p(uz))_+``,
so the repair is ``q~(x|u) ∝ (q(ux) - p(ux))_+`` at nodes ``u`` below the
emitted string with ``|u| < L``, and ``q`` at depth ``L``: a
:class:`spectr_audit.contract.correction.JointResidualCorrection` with exponent 1 and
horizon ``L``.  Everything it needs is on the next iterations' draft trees.
"""

from __future__ import annotations

import torch

from spectr_audit.contract.correction import JointResidualCorrection
from spectr_audit.verifiers.block import LastPassingVerifier

__all__ = ["GreedyBlockVerification", "RepairedGreedyBlockVerification"]


class GreedyBlockVerification(LastPassingVerifier):
    """Greedy block verification WITHOUT its repair: a lossy mode, declared inexact.

    Level ``i < L`` passes with ``h_i = (A - D_+) / (A - D)``, ``A = sum_x (q(yx) - p(yx))_+``,
    ``D = q(y) - p(y)`` for ``y = x^i`` (joint probabilities); level L with
    ``min(1, q(x^L) / p(x^L))``; ``tau`` = the last passing level; correction from
    ``(q(x^tau y) - p(x^tau y))_+``, bonus from ``q(. | x^L)``.  Decoding on with the plain
    target afterwards does not follow the target (the audit measures by how much);
    ``greedy-block-repaired`` is the exact version.

    Examples
    --------
    >>> import torch
    >>> v = GreedyBlockVerification()
    >>> draft_probs = torch.tensor([[[[2/3, 1/3], [2/3, 1/3]]]], dtype=torch.float64)
    >>> target_probs = torch.tensor([[[[1/3, 2/3]] * 3]], dtype=torch.float64)
    >>> law = v.output_probs(torch.tensor([[[1, 0]]]), draft_probs, target_probs)
    >>> round(float(law[0, 0, 2].sum()), 6)   # q(10) / p(10) = (2/9) / (2/9)
    1.0
    """

    name = "greedy-block"
    description = "greedy block verification (joint-ratio acceptance), no next-iteration repair: lossy"
    expected = "inexact"
    # At L = 1 the rule is speculative sampling (exact): block rules start at L = 2.
    min_draft_len = 2

    def _weights(self, log_token_ratio):
        # The raw joint ratio q(x^i) / p(x^i), not clamped at 1 (inf when it overflows).
        zeros = torch.zeros_like(log_token_ratio[:, :1])
        return torch.cat([zeros, log_token_ratio.cumsum(-1)], dim=1).exp()


class RepairedGreedyBlockVerification(GreedyBlockVerification):
    """Greedy block verification with its next-iteration repair: exact over the decoding loop.

    Same verdicts as ``greedy-block``; ``VerifyOutput.correction`` carries the repair
    ``q~(x | u) ∝ (q(ux) - p(ux))_+`` for nodes ``u`` below the emitted string that lie
    fewer than L tokens below the iteration start (joint probabilities from that start;
    see the module docstring for why this is the general repair).  Judge it with the
    multi-iteration audit (:mod:`spectr_audit.exact.multi_iteration`); the single-iteration
    audit, which continues with the unmodified target, reports it inexact by design.
    """

    name = "greedy-block-repaired"
    description = "greedy block verification with its next-iteration repair (carried correction)"
    expected = "exact"

    def carried_correction(self, draft_tokens, draft_probs, target_probs, num_accepted, draft_index, next_token):
        """The repair carried after these verdicts (None when no row has anything to repair).

        The correction reads the rows only at the drafted tokens and at the emitted token (the joint
        probabilities of the emitted string): it is handed those two columns of every row, ``[..., 2]``
        (the drafted token's probability, then the emitted token's), with token ids 0 and 1 pointing at
        them.  The same numbers, without a float64 copy of every row.
        """
        draft_len = draft_tokens.shape[-1]
        drafted = draft_tokens.unsqueeze(-1)  # [batch_size, num_drafts, draft_len, 1]
        # the emitted token, at every level (the end of the draft included, for the target)
        emitted = next_token.view(-1, 1, 1, 1).expand(-1, draft_tokens.shape[1], draft_len + 1, 1)
        # the target's rows at the end of the draft have no drafted token: any column will do there
        target_drafted = torch.cat([drafted, torch.zeros_like(drafted[:, :, :1])], dim=2)
        draft_columns = torch.cat([draft_probs.gather(-1, drafted), draft_probs.gather(-1, emitted[:, :, :draft_len])], -1)
        target_columns = torch.cat([target_probs.gather(-1, target_drafted), target_probs.gather(-1, emitted)], -1)
        return JointResidualCorrection.after_emission(
            torch.zeros_like(draft_tokens), draft_columns, target_columns, num_accepted, draft_index,
            torch.ones_like(next_token), horizon=draft_len, exponent=1,
        )
