"""Slow oracle for multi-draft block verification: the law of one draft tuple, in plain Python.

Written straight from the rule's definition (docs/rules/multi-block.md), one draft tuple at a time,
with Python floats and lists: the trie of the drafts is a dict from prefixes to (budget, share), the
priority coins are the sequential greedy scan over the ratio-sorted vocabulary, and K-SEQ's rho is
found by bisection.  The rows are given as functions of the prefix, so context-free and Markov models
are both covered.  The fast verifier computes the same numbers with batched tensors (a fixed-point
form of the greedy scan, the exact piecewise rho solve), which is what the comparison checks.

Also here: the law of the simple construction the rule is measured against (block verification
along the lead draft, the correction drawn by recursive rejection over the other surviving drafts'
next tokens, and a fresh block verification along a survivor whose token was emitted).
"""

from __future__ import annotations

import math

__all__ = ["multi_block_law", "node_decision", "simple_construction_law"]

#: The priority rule replaces K-SEQ at a node only when it allocates more than this fraction more.
PRIORITY_MARGIN = 0.01


def _priority_coins(target, draft, n):
    """Greedy scan, highest q/p first: each token's coin is as large as its target allows."""
    vocab = range(len(draft))
    order = sorted(vocab, key=lambda a: (-(target[a] / draft[a]) if draft[a] > 0 else -math.inf, a))
    coins, accepted = [0.0] * len(draft), [0.0] * len(draft)
    free = 1.0  # 1 - (draft mass of the coins before this token)
    for a in order:
        if draft[a] <= 0:
            continue
        room = free**n
        # the largest mass m = p theta with free^n - (free - m)^n <= target[a]
        mass = free if room <= target[a] else free - (room - target[a]) ** (1.0 / n)
        coins[a] = min(1.0, mass / draft[a])
        accepted[a] = room - (free - draft[a] * coins[a]) ** n
        free -= draft[a] * coins[a]
    return coins, accepted, order


def _kseq_coins(target, draft, n):
    """K-SEQ with the stop mass as a token the draft never proposes; rho by bisection on [1, n]."""
    def beta(rho):
        return sum(min(p, t / rho) for p, t in zip(draft, target))

    def valid(rho):
        b = beta(rho)
        return rho * b - (1 - (1 - b) ** n) >= 0

    low, high = 1.0, float(n)
    if valid(low):
        high = low
    else:
        for _ in range(200):
            mid = 0.5 * (low + high)
            if valid(mid):
                high = mid
            else:
                low = mid
    rho = high
    coins = [min(1.0, t / (rho * p)) if p > 0 else 0.0 for p, t in zip(draft, target)]
    mass = sum(p * c for p, c in zip(draft, coins))
    scale = (1 - (1 - mass) ** n) / mass if mass > 0 else 0.0
    accepted = [scale * p * c for p, c in zip(draft, coins)]
    return coins, accepted


def _hits(target, draft, coins, accepted, n):
    """P(output = a and a is drafted): the accepted mass plus the residual draws that hit a drafted token."""
    free = 1.0 - sum(p * c for p, c in zip(draft, coins))
    out = []
    for a in range(len(draft)):
        missing = target[a] - accepted[a]
        if free <= 0:
            out.append(accepted[a])
            continue
        absent = ((free - draft[a] * (1 - coins[a])) / free) ** n  # P(a not drafted | no coin accepted)
        out.append(accepted[a] + missing * (1 - absent))
    return out


def node_decision(target, draft, tokens):
    """One node's decision with target ``target`` (sub-probability: the rest is the stop mass).

    ``tokens`` are the surviving drafts' next tokens, in draft order.  Returns ``(kappa, hits)``:
    ``kappa[a]`` is the probability that the node rule outputs the drafted token a given these
    tokens, ``hits[a]`` its mean over the tokens' law (n i.i.d. draws from ``draft``).
    """
    n = len(tokens)
    prio_coins, prio_acc, order = _priority_coins(target, draft, n)
    kseq_coins, kseq_acc = _kseq_coins(target, draft, n)
    prio_hits = _hits(target, draft, prio_coins, prio_acc, n)
    kseq_hits = _hits(target, draft, kseq_coins, kseq_acc, n)
    use_kseq = sum(prio_hits) <= (1 + PRIORITY_MARGIN) * sum(kseq_hits)
    coins, accepted, hits = (kseq_coins, kseq_acc, kseq_hits) if use_kseq else (prio_coins, prio_acc, prio_hits)
    kappa = {a: 0.0 for a in tokens}
    if use_kseq:  # the first accepted draft, in draft order
        before = 1.0
        for a in tokens:
            kappa[a] += before * coins[a]
            before *= 1 - coins[a]
    else:  # the accepted draft whose token comes first in the priority order
        rank = {a: i for i, a in enumerate(order)}
        before = 1.0
        for a in sorted(set(tokens), key=lambda a: rank[a]):
            count = tokens.count(a)
            kappa[a] += before * (1 - (1 - coins[a]) ** count)
            before *= (1 - coins[a]) ** count
    none = 1.0
    for a in tokens:
        none *= 1 - coins[a]
    free = (1.0 - sum(p * c for p, c in zip(draft, coins))) ** n
    if free > 0:
        for a in set(tokens):
            kappa[a] += none * (target[a] - accepted[a]) / free
    return kappa, hits


def multi_block_law(drafts, draft_row, target_row) -> dict:
    """{emitted string: probability} of multi-draft block verification on one draft tuple.

    ``drafts`` is a list of K token tuples of length L; ``draft_row(prefix)`` and ``target_row(prefix)``
    return the conditionals after ``prefix`` (lists of floats).
    """
    num_drafts, draft_len = len(drafts), len(drafts[0])
    vocab = range(len(target_row(())))
    nodes = [{(): (1.0, 1.0)}]  # per depth: prefix -> (budget g, share s)
    slack, corrections, expected_next = [], [], []
    for depth in range(draft_len):
        children, level_slack, level_corr, total = {}, {}, {}, 0.0
        for prefix, (budget, share) in nodes[depth].items():
            survivors = [k for k in range(num_drafts) if tuple(drafts[k][:depth]) == prefix]
            tokens = [drafts[k][depth] for k in survivors]
            beta = budget / share if share > 0 else 0.0
            draft, target = draft_row(prefix), [beta * x for x in target_row(prefix)]
            kappa, hits = node_decision(target, draft, tokens)
            total += share * sum(hits)
            level_slack[prefix] = budget - share * sum(hits)
            level_corr[prefix] = [max(share * (target[a] - hits[a]), 0.0) for a in vocab]
            mass = sum(kappa.values())
            for a, value in kappa.items():
                children[prefix + (a,)] = (share * value, share * value / mass if mass > 0 else 0.0)
        nodes.append(children)
        slack.append(level_slack)
        corrections.append(level_corr)
        expected_next.append(total)
    law: dict = {}

    def emit(prefix, mass, row):
        norm = sum(row)
        row = [x / norm for x in row] if norm > 0 else target_row(prefix)
        for y in vocab:
            law[prefix + (y,)] = law.get(prefix + (y,), 0.0) + mass * row[y]

    # The backward scan: depth L first, then each shallower depth if nothing deeper was chosen.
    not_chosen = 1.0
    for prefix, (budget, _) in nodes[draft_len].items():
        emit(prefix, budget, target_row(prefix))
        not_chosen -= budget
    for depth in range(draft_len - 1, -1, -1):
        room = 1.0 - expected_next[depth]
        chosen = 0.0
        for prefix, eps in slack[depth].items():
            h = eps / room if room > 0 else 0.0
            chosen += h
            emit(prefix, not_chosen * h, corrections[depth][prefix])
        not_chosen *= 1.0 - chosen
    return law


# ---------------------------------------------------------------------------------------------
# The simple construction
# ---------------------------------------------------------------------------------------------


def _block_stops(draft_tokens, start, draft_row, target_row):
    """Block verification along one draft from depth ``start``: [(tau, P(tau), correction row or None)]."""
    draft_len = len(draft_tokens)
    weights = [1.0]
    for i in range(start, draft_len):
        prefix, x = tuple(draft_tokens[:i]), draft_tokens[i]
        weights.append(min(1.0, weights[-1] * target_row(prefix)[x] / draft_row(prefix)[x]))
    levels = draft_len - start
    pass_probs, rows = [None] * (levels + 1), [None] * (levels + 1)
    for j in range(levels):
        prefix = tuple(draft_tokens[: start + j])
        wanted = [max(weights[j] * q - p, 0.0) for p, q in zip(draft_row(prefix), target_row(prefix))]
        rows[j] = wanted
        if j > 0:
            r = sum(wanted)
            pass_probs[j] = 1.0 if r + 1 - weights[j] == 0 else r / (r + 1 - weights[j])
    pass_probs[levels] = weights[levels]
    out, after = [], 1.0
    for j in range(levels, 0, -1):
        out.append((start + j, pass_probs[j] * after, rows[j] if j < levels else None))
        after *= 1 - pass_probs[j]
    out.append((start, after, rows[0]))
    return out


def _recursive_rejection(residual, draft, tokens):
    """Output law of recursive rejection sampling of ``tokens`` (in order) against ``residual``."""
    out, reach = [0.0] * len(draft), 1.0
    for y in tokens:
        accept = min(1.0, residual[y] / draft[y]) if draft[y] > 0 else 0.0
        out[y] += reach * accept
        reach *= 1 - accept
        rest = [max(r - p, 0.0) for r, p in zip(residual, draft)]
        total = sum(rest)
        residual = [r / total for r in rest] if total > 0 else residual
    return [o + reach * r for o, r in zip(out, residual)]


def simple_construction_law(drafts, draft_row, target_row) -> dict:
    """{emitted string: probability} of the simple construction on one draft tuple."""
    vocab = range(len(target_row(())))
    law: dict = {}

    def walk(members, start, mass):
        lead = min(members)
        tokens = drafts[lead]
        for tau, prob, wanted in _block_stops(tokens, start, draft_row, target_row):
            if prob == 0:
                continue
            prefix = tuple(tokens[:tau])
            if wanted is None:
                row = target_row(prefix)
                for y in vocab:
                    law[prefix + (y,)] = law.get(prefix + (y,), 0.0) + mass * prob * row[y]
                continue
            total = sum(wanted)
            residual = [w / total for w in wanted] if total > 0 else target_row(prefix)
            # the other drafts through x^tau; the lead's own tokens past tau decided tau, so it is left out
            others = [k for k in members if k != lead and tuple(drafts[k][:tau]) == prefix]
            out = _recursive_rejection(residual, draft_row(prefix), [drafts[k][tau] for k in others])
            for y in vocab:
                if out[y] == 0:
                    continue
                followers = [k for k in others if drafts[k][tau] == y]
                if followers:
                    walk(followers, tau + 1, mass * prob * out[y])
                else:
                    law[prefix + (y,)] = law.get(prefix + (y,), 0.0) + mass * prob * out[y]

    walk(list(range(len(drafts))), 0, 1.0)
    return law
