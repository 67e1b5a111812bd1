"""Multi-draft block verification's fast paths against the written formulas, bit for bit.

The node rules of ``spectr_audit.verifiers.multi_block`` compute the coins, accepted laws and hits of
docs/rules/multi-block.md with fewer passes over the vocabulary: the single-survivor hits take the
transcendental functions only where they can differ from the accepted mass, the priority sweeps fold
their case split and signs into one expression, the priority order comes from an integer sort, and
only what the trie reads is returned.  The references below are the formulas as written (one dense
tensor expression each); the fast paths must give the same float64 bits, including at tokens the
draft never proposes, at zero targets, at ties of ``q/p`` and where ``free^n`` underflows.
"""

from __future__ import annotations

import pytest
import torch

from spectr_audit.verifiers import multi_block
from spectr_audit.verifiers.multi_block import PRIORITY_MARGIN, PRIORITY_SWEEPS, _node_rule
from spectr_audit.verifiers.rho_star import kseq_rho_star

pytestmark = pytest.mark.usefixtures("single_thread")


def _pow(base, exponent):
    return torch.exp(exponent * torch.log(base))


def _drop_pow(free, mass, exponent):
    safe = torch.where(free > 0, free, torch.ones_like(free))
    ratio = (mass / safe).clamp(max=1.0)
    return torch.where(free > 0, -_pow(free, exponent) * torch.expm1(exponent * torch.log1p(-ratio)),
                       torch.zeros_like(free))


def _hits(target, draft, coins, accepted, exponent):
    refused = draft * (1 - coins)
    free = refused.sum(-1, keepdim=True)
    safe = torch.where(free > 0, free, torch.ones_like(free))
    absent = torch.exp(exponent * torch.log1p(-(refused / safe).clamp(max=1.0)))
    missing = (target - accepted).clamp(min=0)
    return torch.where(free > 0, accepted + missing * (1 - absent), accepted), free


def _priority_coins(draft, target, raw_target, exponent, max_sweeps):
    vocab_size = draft.shape[-1]
    ratio = torch.where(draft > 0, raw_target / torch.where(draft > 0, draft, torch.ones_like(draft)),
                        torch.full_like(draft, float("inf")))
    order = torch.argsort(-ratio, dim=-1, stable=True)
    ranks = torch.empty_like(order).scatter_(-1, order, torch.arange(vocab_size).expand_as(order))
    order = order.flip(-1)
    p_sorted, t_sorted = draft.gather(-1, order), target.gather(-1, order)
    drafted = p_sorted > 0
    safe_p = torch.where(drafted, p_sorted, torch.ones_like(p_sorted))
    coins = torch.zeros_like(p_sorted)

    def free_before(coins):
        return (p_sorted * coins).cumsum(-1) + (p_sorted * (1 - coins)).sum(-1, keepdim=True)

    for _ in range(min(vocab_size, max_sweeps)):
        free = free_before(coins)
        room = _pow(free, exponent)
        safe_room = torch.where(room > 0, room, torch.ones_like(room))
        cap = torch.where(room > t_sorted,
                          -free * torch.expm1(torch.log1p(-(t_sorted / safe_room).clamp(max=1.0)) / exponent), free)
        new = torch.where(drafted, (cap / safe_p).clamp(max=1.0), torch.zeros_like(cap))
        new = torch.maximum(new, coins)
        if torch.equal(new, coins):
            break
        coins = new
    accepted = _drop_pow(free_before(coins), p_sorted * coins, exponent)
    back = vocab_size - 1 - ranks
    return coins.gather(-1, back), accepted.gather(-1, back), ranks


def _kseq_coins(draft, target, beta, exponent):
    stop = (1 - beta).clamp(min=0).unsqueeze(-1)
    rho = kseq_rho_star(torch.cat([draft, torch.zeros_like(stop)], -1), torch.cat([target, stop], -1),
                        exponent.squeeze(-1)).unsqueeze(-1)
    drafted = draft > 0
    coins = torch.where(drafted, (target / (rho * torch.where(drafted, draft, torch.ones_like(draft)))).clamp(max=1.0),
                        torch.zeros_like(draft))
    mass = (draft * coins).sum(-1, keepdim=True)
    free = (draft * (1 - coins)).sum(-1, keepdim=True)
    accept_any = 1 - _pow(free, exponent)
    scale = torch.where(mass > 0, accept_any / torch.where(mass > 0, mass, torch.ones_like(mass)), torch.zeros_like(mass))
    return coins, scale * draft * coins


def _reference(draft, target, raw_target, beta, exponent, tokens):
    """The node rule as written, on rows that all have one survivor or all several."""
    if bool((exponent == 1).all()):
        drafted = draft > 0
        coins = torch.where(drafted, (target / torch.where(drafted, draft, torch.ones_like(draft))).clamp(max=1.0),
                            torch.zeros_like(draft))
        accepted = draft * coins
        hits, free = _hits(target, draft, coins, accepted, exponent)
        ranks, use_kseq = torch.zeros_like(draft, dtype=torch.int64), torch.ones_like(free, dtype=torch.bool)
    else:
        prio_coins, prio_acc, ranks = _priority_coins(draft, target, raw_target, exponent, PRIORITY_SWEEPS)
        kseq_coins, kseq_acc = _kseq_coins(draft, target, beta.squeeze(-1), exponent)
        prio_hits, prio_free = _hits(target, draft, prio_coins, prio_acc, exponent)
        kseq_hits, kseq_free = _hits(target, draft, kseq_coins, kseq_acc, exponent)
        use_kseq = prio_hits.sum(-1, keepdim=True) <= (1 + PRIORITY_MARGIN) * kseq_hits.sum(-1, keepdim=True)
        coins, accepted, hits, free = (torch.where(use_kseq, b, a) for a, b in (
            (prio_coins, kseq_coins), (prio_acc, kseq_acc), (prio_hits, kseq_hits), (prio_free, kseq_free)))
    coin, rank, accepted = (x.gather(-1, tokens) for x in (coins, ranks, accepted))
    return coin, rank, (target.gather(-1, tokens) - accepted).clamp(min=0), hits, free, use_kseq


def _same_bits(a, b):
    if a.dtype == torch.float64:
        a, b = a.view(torch.int64), b.view(torch.int64)
    return a.shape == b.shape and torch.equal(a, b)


def _rows(seed, rows, vocab_size, zeros):
    gen = torch.Generator().manual_seed(seed)
    draft = torch.rand(rows, vocab_size, generator=gen, dtype=torch.float64) ** 4
    raw_target = torch.rand(rows, vocab_size, generator=gen, dtype=torch.float64) ** 4
    if zeros:  # tokens the draft never proposes, and zero targets (some of them at such tokens)
        draft = draft * (torch.rand(draft.shape, generator=gen) > 0.3)
        raw_target = raw_target * (torch.rand(raw_target.shape, generator=gen) > 0.3)
    draft[:, 0] += 1e-3
    raw_target[:, 0] += 1e-3
    if seed % 3 == 0:  # ties of q/p
        raw_target[:, : vocab_size // 2] = draft[:, : vocab_size // 2] * 0.5
    draft = draft / draft.sum(-1, keepdim=True)
    raw_target = raw_target / raw_target.sum(-1, keepdim=True)
    beta = torch.rand(rows, 1, generator=gen, dtype=torch.float64)
    beta[::2] = 1.0
    tokens = torch.multinomial(draft, 4, replacement=True, generator=gen)
    return draft, beta * raw_target, raw_target, beta, tokens


@pytest.mark.parametrize("vocab_size", [2, 3, 7, 40, 1000])
@pytest.mark.parametrize("zeros", [False, True])
@pytest.mark.parametrize("seed", range(4))
def test_node_rule_matches_the_written_formulas(vocab_size, zeros, seed):
    draft, target, raw_target, beta, tokens = _rows(seed, 6, vocab_size, zeros)
    gen = torch.Generator().manual_seed(100 + seed)
    for exponent in (torch.ones(6, 1, dtype=torch.float64),
                     torch.randint(2, 6, (6, 1), generator=gen).double()):
        got = _node_rule(draft, target, raw_target, beta, exponent, PRIORITY_SWEEPS, tokens)
        want = _reference(draft, target, raw_target, beta, exponent, tokens)
        assert all(_same_bits(a, b) for a, b in zip(got, want))
    # rows of one and of several survivors together: each part as on its own
    exponent = torch.tensor([[1.0], [3.0], [1.0], [2.0], [4.0], [1.0]], dtype=torch.float64)
    got = _node_rule(draft, target, raw_target, beta, exponent, PRIORITY_SWEEPS, tokens)
    for rows in (torch.tensor([0, 2, 5]), torch.tensor([1, 3, 4])):
        want = _reference(*(x.index_select(0, rows) for x in (draft, target, raw_target, beta, exponent, tokens)))
        assert all(_same_bits(a.index_select(0, rows), b) for a, b in zip(got, want))


def test_priority_where_free_to_the_n_underflows():
    """The lowest-priority token's free mass is 1e-200: free^2 underflows to 0 = t, so its cap is its free mass."""
    draft = torch.tensor([[1e-200, 1.0]], dtype=torch.float64)
    raw_target = torch.tensor([[0.0, 1.0]], dtype=torch.float64)
    beta, exponent, tokens = torch.ones(1, 1, dtype=torch.float64), torch.full((1, 1), 2.0, dtype=torch.float64), \
        torch.tensor([[0, 1]])
    got = _node_rule(draft, raw_target, raw_target, beta, exponent, PRIORITY_SWEEPS, tokens)
    want = _reference(draft, raw_target, raw_target, beta, exponent, tokens)
    assert all(_same_bits(a, b) for a, b in zip(got, want))
    want = _priority_coins(draft, raw_target, raw_target, exponent, PRIORITY_SWEEPS)
    assert want[0][0, 0] == 1.0  # the case the expression without a case split must reproduce
    keep = (draft > 0).double()
    got = multi_block._priority_coins(draft, raw_target, raw_target, exponent, PRIORITY_SWEEPS,
                                      torch.where(draft > 0, draft, torch.ones_like(draft)), keep)
    assert all(_same_bits(a, b) for a, b in zip(got, want))
