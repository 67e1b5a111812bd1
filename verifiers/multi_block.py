"""Multi-draft block verification: K i.i.d. drafts verified as one block (docs/rules/multi-block.md).

The drafts form a trie.  Every trie node u at depth i carries a *budget* ``g(u)`` and a *share*
``s(u) >= g(u)`` (the root: ``g = s = 1``).  At a node with ``n`` surviving drafts the rule runs a
token-level node rule against the sub-probability target ``t = beta q(. | u)``, ``beta = g / s``
(the missing ``1 - beta`` is a *stop* mass the draft never proposes), over the survivors' next
tokens.  The node rule gives

* ``kappa(a)``: the probability that it outputs the drafted child token ``a`` (accepted, or drawn
  from its residual), a function of the survivors' next tokens;
* ``hits(a) = E[kappa(a) 1(a drafted)]`` over those tokens' law (n i.i.d. draws from ``p(. | u)``),
  in closed form.

A child ``ua`` gets budget ``s(u) kappa(a)`` and share ``s(u) kappa(a) / sum_b kappa(b)``.  The node
keeps ``eps(u) = g(u) - s(u) sum_a hits(a)`` for itself, with the correction row
``s(u) (t - hits)``.  With ``E_i = sum_{|u| = i} s(u) sum_a hits_u(a)`` (the expected total budget of
depth i + 1 given the first i tokens of every draft), the accepted node is chosen by a backward
scan: a node of depth L with probability ``g``, else a node of depth ``i`` with probability
``eps(u) / (1 - E_i)``, for i = L - 1 down to 0.  Then ``P(accepted node extends u | first |u|
tokens) = g(u)`` and the emitted token after u is ``q(. | u)``-distributed whatever the other drafts
did, which is exactness.

Node rules (both with one coin per draft, ``theta(x)`` for token x; they differ in the winner):

* *priority*: the accepted draft whose token has the largest ``q/p`` wins; each coin is the largest
  the target allows given the coins before it in that order (a greedy scan, computed as a monotone
  fixed point whose every iterate is valid);
* *K-SEQ* with the stop mass as a token: ``theta = min(1, t / (rho p))``, the first accepted draft
  in draft order wins (SpecTr's rule, docs/rules/kseq.md).

Each node uses K-SEQ unless the priority rule's ``sum_a hits(a)`` is larger by more than
``PRIORITY_MARGIN`` (1%).  For K = 1 both are speculative sampling against ``t`` and the rule is
block verification (docs/rules/block.md).
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch

from spectr_audit.contract.randomness import sample_categorical, uniform
from spectr_audit.contract.verifier import Verifier, VerifyOutput
from spectr_audit.verifiers.rho_star import kseq_rho_star
from spectr_audit.verifiers._walk import _sample_or_fallback, normalise

__all__ = ["MultiDraftBlockVerification", "PRIORITY_MARGIN", "PRIORITY_SWEEPS"]

#: The priority rule replaces K-SEQ at a node only when it allocates more than this fraction more.
PRIORITY_MARGIN = 0.01

#: At most this many sweeps of the priority coins' fixed point (fewer when the vocabulary is smaller:
#: V sweeps reach the greedy scan exactly; any sweep count gives valid coins).
PRIORITY_SWEEPS = 8


def _pow(base: torch.Tensor, exponent: torch.Tensor) -> torch.Tensor:
    """``base ** exponent`` for ``base`` in [0, 1] (``0 ** n = 0`` for n >= 1)."""
    return torch.exp(exponent * torch.log(base))


def _drop_pow(free: torch.Tensor, mass: torch.Tensor, exponent: torch.Tensor) -> torch.Tensor:
    """``free ** n - (free - mass) ** n`` for ``0 <= mass <= free``, without cancellation."""
    if _all_positive(free):  # no case split: the same operations, in place, without the two masks
        drop = (mass / free).clamp_(max=1.0).neg_().log1p_().mul_(exponent).expm1_()
        return drop.mul_(_pow(free, exponent)).neg_()  # -(e free^n) is (-free^n) e
    safe = torch.where(free > 0, free, torch.ones_like(free))
    ratio = (mass / safe).clamp(max=1.0)
    return torch.where(free > 0, -_pow(free, exponent) * torch.expm1(exponent * torch.log1p(-ratio)),
                       torch.zeros_like(free))


def _all_positive(values: torch.Tensor) -> bool:
    """Whether every entry of ``values`` is positive, checked only on the CPU (no device round trip elsewhere).

    Lets the callers skip a pass that only matters at zeros (tokens the draft never proposes, or 0 / 0).
    """
    # a min is cheaper than a mask and its all(); an empty tensor takes the general path
    return values.device.type == "cpu" and values.numel() > 0 and bool(values.amin() > 0)


def _hit_chance(refused, free, exponent):
    """``1 - (1 - refused / free) ** n``: the chance that a residual draw's token is among the n failed drafts.

    ``exponent`` (n) may be None for n = 1: the product with 1 is the identity.
    """
    safe = torch.where(free > 0, free, torch.ones_like(free))
    out = (refused / safe).clamp_(max=1.0).neg_().log1p_()
    if exponent is not None:
        out.mul_(exponent)
    out.exp_()
    return out.neg_().add_(1)  # 1 - absent, as -absent + 1 (the same rounding)


def _hits(target, draft, coins, accepted, exponent):
    """``E[kappa(a) 1(a drafted)]`` ``[n, V]`` and ``1 - sum_x p theta`` ``[n, 1]`` for one-coin-per-draft rules.

    The rule outputs ``a`` with total probability ``t(a)``: ``accepted(a)`` from a coin, the rest
    ``t(a) - accepted(a)`` from its residual after every coin failed.  Given that, the drafted tokens are
    i.i.d. with law ``p (1 - theta) / free``, so the residual draw hits a drafted ``a`` with
    probability ``1 - (1 - p(a) (1 - theta(a)) / free) ** n``.

    On a row with ``free = 0`` every ``refused`` is 0, the hit chance is exactly 0 and the hits are
    ``accepted``: no case split is needed.  The in-place steps round as the written formula does
    (``-x + 1`` is ``1 - x``; products commute).
    """
    refused = torch.rsub(coins, 1).mul_(draft)  # draft (1 - coins)
    free = refused.sum(-1, keepdim=True)  # 1 - sum_x p theta, as a sum of non-negative terms
    hit_chance = _hit_chance(refused, free, exponent)
    hits = torch.sub(target, accepted).clamp_(min=0).mul_(hit_chance).add_(accepted)
    return hits, free


def _single_rule(draft, target, exponent, tokens):
    """Speculative sampling against ``t`` on rows with one survivor: ``(coin, missing)`` at ``tokens``, hits, free.

    ``coins = min(1, t / p)``, ``accepted = p coins``; the hits are ``accepted + (t - accepted)_+ (1 - (1 -
    refused / free))``, which is ``accepted`` itself wherever ``(t - accepted)_+`` or ``refused`` is 0: where
    ``t >= p`` (coin 1, nothing refused) and wherever ``p min(1, t / p)`` rounds to ``t`` or above.  Only the
    other tokens (a few percent) take the transcendental functions, each with the same operations as
    :func:`_hits`, so the values are those of the dense formula bit for bit.  At tokens the draft never
    proposes the coin is 1 or 0 here instead of 0, which changes nothing there (``p = 0``); the coins at the
    drafted ``tokens`` are recomputed by the written formula.
    """
    coins = torch.div(target, draft).clamp_(max=1.0)  # min(1, t / p)
    if not _all_positive(draft):
        coins.nan_to_num_(nan=0.0)  # 0 / 0
    accepted = torch.mul(draft, coins)
    refused = torch.rsub(coins, 1).mul_(draft)  # draft (1 - coins)
    free = refused.sum(-1, keepdim=True)
    missing = torch.sub(target, accepted)  # (t - accepted)_+ where it is positive, all that is read of it
    vocab_size = draft.shape[-1]
    flat = torch.minimum(missing, refused).view(-1).gt(0).nonzero().squeeze(1)
    hits = accepted  # patched in place below
    if flat.numel():
        rows = torch.div(flat, vocab_size, rounding_mode="floor")
        # n = 1 on these rows: the product with it is the identity, so it is left out
        chance = _hit_chance(refused.view(-1).index_select(0, flat), free.view(-1).index_select(0, rows), None)
        patched = missing.view(-1).index_select(0, flat).mul_(chance).add_(accepted.view(-1).index_select(0, flat))
        hits.view(-1).index_copy_(0, flat, patched)
    coin_at, missing_at = _at_tokens_single(draft, target, tokens)
    return coin_at, missing_at, hits, free


def _at_tokens_single(draft, target, tokens):
    """Speculative sampling's coin ``min(1, t / p)`` (0 where ``p = 0``) and ``(t - p coin)_+`` at ``tokens`` ``[m, K]``."""
    p, t = draft.gather(-1, tokens), target.gather(-1, tokens)
    drafted = p > 0
    coin = torch.where(drafted, (t / torch.where(drafted, p, torch.ones_like(p))).clamp(max=1.0), torch.zeros_like(p))
    return coin, (t - p * coin).clamp(min=0)


def _priority_coins(draft, target, raw_target, exponent, max_sweeps, safe_draft, keep):
    """Coins, accepted law and token ranks ``[n, V]`` of the priority rule.

    Tokens are ranked by ``q/p`` descending (ties: smaller id first; tokens the draft never proposes
    first, where they change nothing).  Token a's coin is the largest with
    ``free_a^n - (free_a - p(a) theta(a))^n <= t(a)``, ``free_a = 1 - sum_{b before a} p(b) theta(b)``.
    Iterating ``theta <- cap(free(theta))`` from 0 increases theta monotonically, every iterate is
    valid (the free mass it was computed from only shrinks), and after V sweeps it is the greedy scan.

    ``safe_draft`` is ``p`` with 1 where ``p = 0``, ``keep`` is ``1(p > 0)`` as floats, or None where every
    ``p > 0`` (then ``safe_draft`` is ``p``).
    """
    vocab_size = draft.shape[-1]
    ratio = raw_target / safe_draft
    if keep is not None:
        ratio = torch.where(keep > 0, ratio, torch.full_like(draft, float("inf")))
    # The stable order of -ratio: ratio is >= 0 or +inf, so its float64 bits (-0 made +0 by adding 0) order as
    # its values, and their complements ascending are -ratio ascending.  The permutation of a stable sort is
    # unique, and the integer sort is about a third faster than the float64 one.
    key = torch.bitwise_not((ratio + 0.0).view(torch.int64))
    order = torch.sort(key, dim=-1, stable=True).indices
    ranks = torch.empty_like(order).scatter_(-1, order, torch.arange(vocab_size, device=order.device).expand_as(order))
    # Stored lowest priority first, so that the free mass is a prefix sum (no flips).
    order = order.flip(-1)
    p_sorted, t_sorted = draft.gather(-1, order), target.gather(-1, order)
    # -p (-1 where p = 0) and -t: the signs folded into the divisions below (a quotient's rounding is symmetric)
    if keep is None:
        neg_safe_p = torch.neg(p_sorted)
    else:
        keep_sorted = keep.gather(-1, order)
        neg_safe_p = torch.rsub(keep_sorted, 1).add_(p_sorted).neg_()  # p + 0 is p; 0 + 1 is 1
    neg_t = torch.neg(t_sorted)
    positive_target = _all_positive(t_sorted)  # then t / free^n is never 0 / 0
    coins = torch.zeros_like(p_sorted)
    new, free, work = torch.empty_like(coins), torch.empty_like(coins), torch.empty_like(coins)

    def free_before(coins):
        # 1 - sum_{b before a} p theta = sum_{b from a on} p theta + sum_b p (1 - theta): no cancellation
        torch.cumsum(torch.mul(p_sorted, coins, out=work), -1, out=free)
        return free.add_(torch.rsub(coins, 1).mul_(p_sorted).sum(-1, keepdim=True))

    for _ in range(min(vocab_size, max_sweeps)):
        free_before(coins)
        room = torch.log(free, out=work).mul_(exponent).exp_()  # free ** n
        # The largest m with free^n - (free - m)^n <= t: free (1 - (1 - t / free^n)^(1/n)), or all of free where
        # free^n <= t.  One expression gives both: there t / free^n >= 1 (0 / 0 taken as 1), log1p(-1) = -inf,
        # expm1(-inf) = -1, and the cap is exactly free; no case split, no branch computed in vain.  Computed
        # as -(-t / free^n) and -cap = free expm1(...), the minus signs exact.
        neg_cap = torch.div(neg_t, room, out=new).clamp_(min=-1.0)
        if not positive_target:
            neg_cap.nan_to_num_(nan=-1.0)
        neg_cap.log1p_().div_(exponent).expm1_().mul_(free)
        new = neg_cap.div_(neg_safe_p).clamp_(max=1.0)  # cap / p
        if keep is not None:
            new.mul_(keep_sorted)  # 0 where the draft never proposes the token
        torch.maximum(new, coins, out=new)  # monotone in exact arithmetic; keeps rounding from undoing it
        if torch.equal(new, coins):  # converged bit for bit: more sweeps change nothing, in any row
            break
        coins, new = new, coins
    accepted = _drop_pow(free_before(coins), p_sorted * coins, exponent)
    back = vocab_size - 1 - ranks  # position of each token in the stored order
    return coins.gather(-1, back), accepted.gather(-1, back), ranks


def _kseq_coins(draft, target, beta, exponent, safe_draft, keep):
    """Coins and accepted law ``[n, V]`` of K-SEQ against ``t`` with the stop mass ``1 - beta`` as a token."""
    stop = (1 - beta).clamp(min=0).unsqueeze(-1)
    rho = kseq_rho_star(torch.cat([draft, torch.zeros_like(stop)], -1), torch.cat([target, stop], -1),
                        exponent.squeeze(-1))
    rho = rho.unsqueeze(-1)
    coins = (target / (rho * safe_draft)).clamp_(max=1.0)
    if keep is not None:
        coins.mul_(keep)  # 0 where the draft never proposes the token
    mass = (draft * coins).sum(-1, keepdim=True)
    free = (draft * (1 - coins)).sum(-1, keepdim=True)
    accept_any = 1 - _pow(free, exponent)
    scale = torch.where(mass > 0, accept_any / torch.where(mass > 0, mass, torch.ones_like(mass)), torch.zeros_like(mass))
    return coins, scale * draft * coins


def _node_rule(draft, target, raw_target, beta, exponent, max_sweeps, tokens):
    """One node's rule on rows ``[m, V]``: the priority rule where it allocates over 1% more than K-SEQ, else K-SEQ.

    Returns, at the survivors' ``tokens`` ``[m, K]``, the coins, the priority ranks and ``(t - accepted)_+``
    ``[m, K]``; the hits ``[m, V]``; ``free = 1 - sum_x p theta`` ``[m, 1]``; whether K-SEQ is used ``[m, 1]``.
    Nothing else of the ``[m, V]`` coins and accepted laws is read afterwards, so none of it is returned.
    """
    single = (exponent.squeeze(-1) == 1).nonzero().squeeze(1)
    if single.numel() == draft.shape[0]:
        # One survivor everywhere: both rules are speculative sampling against t (block verification's step).
        coin, missing, hits, free = _single_rule(draft, target, exponent, tokens)
        return coin, torch.zeros_like(tokens), missing, hits, free, torch.ones_like(free, dtype=torch.bool)
    if single.numel() > 0:  # rows with one survivor take the closed form, the others the full rules
        several = (exponent.squeeze(-1) != 1).nonzero().squeeze(1)
        parts = [_node_rule(*(x.index_select(0, rows) for x in (draft, target, raw_target, beta, exponent)), max_sweeps,
                            tokens.index_select(0, rows))
                 for rows in (single, several)]
        order = torch.cat([single, several])
        return tuple(torch.empty_like(joined).index_copy_(0, order, joined)
                     for joined in (torch.cat([a, b]) for a, b in zip(*parts)))
    if _all_positive(draft):
        keep, safe_draft = None, draft
    else:
        keep = (draft > 0).to(draft.dtype)  # 1(p > 0): a product with it is where(p > 0, x, 0) for finite x
        safe_draft = torch.where(draft > 0, draft, torch.ones_like(draft))
    prio_coins, prio_acc, ranks = _priority_coins(draft, target, raw_target, exponent, max_sweeps, safe_draft, keep)
    kseq_coins, kseq_acc = _kseq_coins(draft, target, beta.squeeze(-1), exponent, safe_draft, keep)
    prio_hits, prio_free = _hits(target, draft, prio_coins, prio_acc, exponent)
    kseq_hits, kseq_free = _hits(target, draft, kseq_coins, kseq_acc, exponent)
    use_kseq = prio_hits.sum(-1, keepdim=True) <= (1 + PRIORITY_MARGIN) * kseq_hits.sum(-1, keepdim=True)
    pick = lambda a, b: torch.where(use_kseq, b, a)  # noqa: E731
    at = lambda x: x.gather(-1, tokens)
    missing = (at(target) - pick(at(prio_acc), at(kseq_acc))).clamp(min=0)
    return (pick(at(prio_coins), at(kseq_coins)), at(ranks), missing, pick(prio_hits, kseq_hits),
            pick(prio_free, kseq_free), use_kseq)


def _as_law(rows: torch.Tensor) -> torch.Tensor:
    """float64 rows renormalised to sum to 1, as the exact law receives them (a new contiguous tensor)."""
    rows = rows.to(torch.float64, copy=True, memory_format=torch.contiguous_format)
    return rows.div_(rows.sum(-1, keepdim=True))  # in place: one pass less than a new quotient


@dataclasses.dataclass(frozen=True)
class _Nodes:
    """One depth's canonical nodes: what their corrections ``share (t - hits)_+`` are built from."""

    # [m] int64: the nodes' slots, row * K + draft
    index: torch.Tensor
    # [m, 1]
    share: torch.Tensor
    # [m, V]: the sub-probability target t = beta q
    target: torch.Tensor
    # [m, V]
    hits: torch.Tensor

    def correction(self, rows: Optional[torch.Tensor] = None) -> torch.Tensor:
        """``share (t - hits)_+`` of every node ``[m, V]``, or of the nodes at positions ``rows``."""
        if rows is None:
            return self.share * (self.target - self.hits).clamp(min=0)
        pick = lambda x: x.index_select(0, rows)  # noqa: E731
        return pick(self.share) * (pick(self.target) - pick(self.hits)).clamp(min=0)


class MultiDraftBlockVerification(Verifier):
    """Multi-draft block verification: K i.i.d. drafts of length L, exact with the plain target.

    Budgets and shares on the drafts' trie, a token-level node rule (priority by ``q/p`` where it
    allocates over 1% more than K-SEQ, else K-SEQ) against ``beta q`` plus a stop mass, and a
    backward scan for the last chosen node (module docstring; derivation and proof in
    docs/rules/multi-block.md).  For K = 1 it is block verification.  On the block-verification paper's example at K = 2 it reaches the block
    LP's optimum, 212/81.

    Randomness: one :func:`~spectr_audit.contract.randomness.uniform` call of shape
    ``[batch_size, draft_len + 1]``: the choice uniforms of depths 1 .. L, then the next token's.

    Examples
    --------
    >>> from spectr_audit.drafting.models import ContextFreeModel
    >>> from spectr_audit.exact.iteration import exact_iteration
    >>> draft, target = ContextFreeModel([2/3, 1/3]), ContextFreeModel([1/3, 2/3])
    >>> audit = exact_iteration(MultiDraftBlockVerification(), draft, target, num_drafts=2, draft_len=2)
    >>> round(audit.block_efficiency * 81, 6), audit.max_abs_error < 1e-12
    (212.0, True)
    """

    name = "multi-block"
    description = "multi-draft block verification: node budgets and shares, priority or K-SEQ node rule, backward scan"
    expected = "exact"
    #: upper bound on the priority coins' fixed-point sweeps (see PRIORITY_SWEEPS)
    priority_sweeps = PRIORITY_SWEEPS

    # -- the shared numbers ------------------------------------------------------------------------
    def _levels(self, draft_tokens, draft_probs, target_probs):
        """Everything the sampler and the law need, in float64.

        Returns ``slack [B, K, L]`` (eps at canonical nodes, 0 elsewhere), ``expected [B, L]`` (E_i), the
        depth-L budgets ``[B, K]`` and, per depth 0 .. L-1, the :class:`_Nodes` the corrections are built
        from (:meth:`_corrections` for every node, :meth:`_correction_rows` for one node per row).

        The node rules read only the canonical nodes' rows (one per distinct prefix), renormalised in
        float64 as the exact law receives them; the drafts' tokens are looked up in those rows, and no
        ``[B, K, V]`` tensor is built for the other slots.
        """
        batch_size, num_drafts, draft_len = draft_tokens.shape
        device = draft_tokens.device
        draft_ids = torch.arange(num_drafts, device=device)
        earlier = draft_ids.unsqueeze(1) < draft_ids.unsqueeze(0)  # [j, k]: j < k
        before = earlier.T.reshape(1, 1, num_drafts, num_drafts)  # [.., j, j']: j' < j
        budget = torch.zeros(batch_size, num_drafts, dtype=torch.float64, device=device)
        budget[:, 0] = 1.0
        share = budget.clone()
        slack, expected, nodes_per_depth = [], [], []
        for depth in range(draft_len + 1):
            prefix = draft_tokens[:, :, :depth]
            same = (prefix.unsqueeze(2) == prefix.unsqueeze(1)).all(-1)  # [B, j, k]: drafts j, k share the prefix
            canonical = ~(same & earlier).any(1)  # [B, k]: k is the first draft with its prefix
            if depth == draft_len:
                break
            survivors = same.transpose(1, 2)  # [B, k, j]: draft j passes through node k
            count = survivors.sum(-1, keepdim=True).double()  # [B, K, 1]
            beta = torch.where(share > 0, budget / torch.where(share > 0, share, torch.ones_like(share)),
                               torch.zeros_like(share)).clamp(0.0, 1.0)
            # The node rules run on the canonical nodes only (one row per distinct prefix).
            nodes = canonical.reshape(-1).nonzero().squeeze(1)
            flat = lambda x: x.reshape(batch_size * num_drafts, -1).index_select(0, nodes)  # noqa: E731
            # The nodes' rows [m, V], read in place where they are a regular slice (no float32 copy first).
            draft_rows, target_rows = draft_probs[:, :, depth], target_probs[:, :, depth]
            if depth == 0:  # the root: draft 0 of every row
                draft_rows, target_rows = draft_rows[:, 0], target_rows[:, 0]
            elif nodes.shape[0] == batch_size * num_drafts:  # every slot is a node (all prefixes distinct)
                draft_rows, target_rows = (x.reshape(batch_size * num_drafts, -1) for x in (draft_rows, target_rows))
            else:
                draft_rows, target_rows = flat(draft_rows), flat(target_rows)
            draft = _as_law(draft_rows)  # [m, V]
            raw_target = _as_law(target_rows)
            node_beta = flat(beta.unsqueeze(-1))
            target = node_beta * raw_target

            def spread(x):  # back to every (row, draft) slot, zeros at non-canonical ones
                full = torch.zeros(batch_size * num_drafts, x.shape[-1], dtype=x.dtype, device=device)
                return full.index_copy_(0, nodes, x).reshape(batch_size, num_drafts, -1)

            # The node rule on the drafts' actual next tokens: kappa per draft j of node k ([B, k, j]).
            tokens = draft_tokens[:, :, depth]  # [B, j]
            node_tokens = tokens.index_select(0, nodes // num_drafts)  # [m, j]: the tokens below each node
            coin, rank, missing, hits, free, use_kseq = _node_rule(draft, target, raw_target, node_beta, flat(count),
                                                                   self.priority_sweeps, node_tokens)
            coin = torch.where(survivors, spread(coin), torch.zeros_like(survivors, dtype=torch.float64))
            fail = 1 - coin
            rank = spread(rank)
            free, use_kseq = spread(free), spread(use_kseq)
            same_token = tokens.unsqueeze(2) == tokens.unsqueeze(1)  # [B, j, j']
            pair = survivors.unsqueeze(2) & survivors.unsqueeze(3)  # [B, k, j, j']: both survive at k
            ones = torch.ones_like(fail).unsqueeze(2).expand(-1, -1, num_drafts, -1)
            failing = fail.unsqueeze(2).expand(-1, -1, num_drafts, -1)  # [..., j, j'] = 1 - coin_j'
            # priority: every draft of a higher-ranked token fails, some draft of this token succeeds
            higher = pair & (rank.unsqueeze(3) > rank.unsqueeze(2))  # [k, j, j']: j' ranked above j
            mine = pair & same_token.unsqueeze(1)
            prio_win = (torch.where(higher, failing, ones).prod(-1)
                        * (1 - torch.where(mine, failing, ones).prod(-1)))
            # K-SEQ: the first succeeding draft in draft order; a token's drafts add up
            first = coin * torch.where(pair & before, failing, ones).prod(-1)
            kseq_win = torch.where(mine, first.unsqueeze(2).expand(-1, -1, num_drafts, -1),
                                   torch.zeros_like(ones)).sum(-1)
            win = torch.where(use_kseq, kseq_win, prio_win)
            none = torch.where(survivors, fail, torch.ones_like(fail)).prod(-1, keepdim=True)  # [B, K, 1]
            room = _pow(free, count)
            residual_share = torch.where(room > 0, none / torch.where(room > 0, room, torch.ones_like(room)),
                                         torch.zeros_like(room))
            # (q - accepted)_+ at the tokens (0 at non-canonical slots, where residual_share is 0)
            missing = spread(missing)
            kappa = torch.where(survivors, win + residual_share * missing, torch.zeros_like(win))  # [B, k, j]
            # children: draft j is the canonical child of its token under its parent node
            first_of_token = survivors & ~(mine & before).any(-1)
            child = first_of_token & canonical.unsqueeze(-1)
            total = torch.where(child, kappa, torch.zeros_like(kappa)).sum(-1, keepdim=True)
            child_budget = torch.where(child, share.unsqueeze(-1) * kappa, torch.zeros_like(kappa)).sum(1)
            child_share = torch.where(child & (total > 0), share.unsqueeze(-1) * kappa
                                      / torch.where(total > 0, total, torch.ones_like(total)),
                                      torch.zeros_like(kappa)).sum(1)
            kept = share * spread(hits.sum(-1, keepdim=True)).squeeze(-1)
            slack.append(torch.where(canonical, (budget - kept).clamp(min=0), torch.zeros_like(budget)))
            nodes_per_depth.append(_Nodes(nodes, flat(share.unsqueeze(-1)), target, hits))
            expected.append(torch.where(canonical, kept, torch.zeros_like(kept)).sum(-1))
            budget, share = child_budget, child_share
        final = torch.where(canonical, budget, torch.zeros_like(budget))
        return torch.stack(slack, -1), torch.stack(expected, -1), final, nodes_per_depth

    @staticmethod
    def _corrections(nodes_per_depth, batch_size, num_drafts, vocab_size):
        """Unnormalised corrections ``share (t - hits)_+`` of every node ``[B, K, L, V]`` (zeros at non-canonical slots)."""
        out = []
        for node in nodes_per_depth:
            full = torch.zeros(batch_size * num_drafts, vocab_size, dtype=torch.float64, device=node.target.device)
            out.append(full.index_copy_(0, node.index, node.correction()).reshape(batch_size, num_drafts, vocab_size))
        return torch.stack(out, 2)

    @staticmethod
    def _correction_rows(nodes_per_depth, draft_index, level, num_drafts):
        """The correction of node ``draft_index[b]`` at depth ``level[b]`` for every row ``[B, V]`` (zeros at a
        non-canonical slot, as in :meth:`_corrections`), built for those nodes only."""
        batch_size = draft_index.shape[0]
        vocab_size = nodes_per_depth[0].target.shape[-1]
        device = draft_index.device
        out = torch.zeros(batch_size, vocab_size, dtype=torch.float64, device=device)
        slot = torch.arange(batch_size, device=device) * num_drafts + draft_index
        for depth, node in enumerate(nodes_per_depth):
            # position of each slot among this depth's canonical nodes (-1: not one)
            position = torch.full((batch_size * num_drafts,), -1, dtype=torch.int64, device=device)
            position[node.index] = torch.arange(node.index.shape[0], device=device)
            found = position[slot]
            rows = ((level == depth) & (found >= 0)).nonzero().squeeze(1)
            if rows.numel():
                out.index_copy_(0, rows, node.correction(found.index_select(0, rows)))
        return out

    @staticmethod
    def _choice_probs(slack, expected, final):
        """Per depth, the probability of choosing each node given that nothing deeper was chosen: ``[B, K, L + 1]``."""
        room = (1 - expected).unsqueeze(1)  # [B, 1, L]
        inner = torch.where(room > 0, slack / torch.where(room > 0, room, torch.ones_like(room)), torch.zeros_like(slack))
        # The root is chosen whenever nothing deeper was: its eps(root) / (1 - E_0) is 1 in exact arithmetic,
        # and stays 1 where E_0 rounds to 1 (drafts that almost surely reach depth 1), so every row is a law.
        inner[:, :, 0] = 0.0
        inner[:, 0, 0] = 1.0
        choice = torch.cat([inner, final.unsqueeze(-1)], -1)
        # A depth's choices are probabilities of disjoint events: rounding must not make them exceed 1.
        total = choice.sum(1, keepdim=True)
        return torch.where(total > 1, choice / torch.where(total > 1, total, torch.ones_like(total)), choice)

    # -- the verifier ------------------------------------------------------------------------------
    def _verify(self, draft_tokens, draft_probs, target_probs, generator) -> VerifyOutput:
        batch_size, num_drafts, draft_len = draft_tokens.shape
        device = draft_tokens.device
        slack, expected, final, nodes = self._levels(draft_tokens, draft_probs, target_probs)
        choice = self._choice_probs(slack, expected, final)  # [B, K, L + 1]
        u = uniform(generator, (batch_size, draft_len + 1), device)
        # Depth i (1 .. L) chooses node k when u_i falls in its slice of the cumulative choice probabilities.
        cumulative = choice[:, :, 1:].cumsum(1)  # [B, K, L]
        point = u[:, :draft_len].unsqueeze(1)  # [B, 1, L]
        chosen = point < cumulative[:, -1:, :]  # [B, 1, L]: some node of depth i is chosen
        node = (point >= cumulative).sum(1)  # [B, L]: the first k whose cumulative sum exceeds u_i
        depths = torch.arange(1, draft_len + 1, device=device)
        tau = (chosen.squeeze(1) * depths).amax(-1)  # the deepest depth with a choice, 0 (the root) if none
        rows = torch.arange(batch_size, device=device)
        draft_index = torch.where(tau > 0, node.gather(1, (tau - 1).clamp(min=0).unsqueeze(1)).squeeze(1),
                                  torch.zeros_like(tau)).clamp(max=num_drafts - 1)
        level = tau.clamp(max=draft_len - 1)
        fallback = target_probs[rows, draft_index, level]
        corrections = self._correction_rows(nodes, draft_index, level, num_drafts)  # the chosen nodes' only
        correction = _sample_or_fallback(corrections, lambda: fallback.double(), u[:, draft_len])
        bonus = sample_categorical(target_probs[rows, draft_index, draft_len].double(), u[:, draft_len])
        next_token = torch.where(tau < draft_len, correction, bonus)
        return VerifyOutput(tau, draft_index, next_token)

    def _output_probs(self, draft_tokens, draft_probs, target_probs) -> torch.Tensor:
        draft_len = draft_tokens.shape[-1]
        slack, expected, final, nodes = self._levels(draft_tokens, draft_probs, target_probs)
        corrections = self._corrections(nodes, *draft_tokens.shape[:2], draft_probs.shape[-1])
        choice = self._choice_probs(slack, expected, final)  # [B, K, L + 1]
        # P(nothing deeper than depth i is chosen) = prod_{j > i} (1 - sum_k choice[k, j])
        # the choices at a depth can sum to 1 and a rounding above it: a probability, not a negative one
        refuse = (1 - choice.sum(1)).clamp(min=0)  # [B, L + 1]
        after = torch.cat([refuse[:, 1:].flip(-1).cumprod(-1).flip(-1), torch.ones_like(refuse[:, :1])], -1)
        stop = choice * after.unsqueeze(1)  # [B, K, L + 1]
        vocab_size = corrections.shape[-1]
        laws = normalise(corrections.reshape(-1, vocab_size), target_probs[:, :, :draft_len].double().reshape(-1, vocab_size))
        laws = torch.cat([laws.reshape(corrections.shape), target_probs[:, :, draft_len:].double()], 2)
        return stop.unsqueeze(-1) * laws
