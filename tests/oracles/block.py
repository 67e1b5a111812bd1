"""Slow oracles for the block rules: plain-Python laws of block verification, greedy block
verification and the published SpecTr-GBV pseudo-code, and an independent single-iteration audit.

Context-free models only (the conditionals are the same at every node), one draft tuple at a time,
written straight from the rules' definitions (docs/rules/block.md, docs/rules/greedy-block.md,
docs/rules/spectr-gbv.md) and from the published pseudo-code.  Every function is generic in the
number type: given ``fractions.Fraction`` rows it computes in exact rational arithmetic.
"""

from __future__ import annotations

import itertools

__all__ = ["last_passing_law", "published_gbv_law", "oracle_single_iteration"]


def _pos(x):
    return x if x > 0 else 0 * x


def _normalise(values, fallback):
    total = sum(values)
    return [v / total for v in values] if total > 0 else list(fallback)


def _joint(probs, tokens):
    out = 1 + 0 * probs[0]
    for t in tokens:
        out *= probs[t]
    return out


def last_passing_law(tokens, draft_probs, target_probs, greedy: bool) -> dict:
    """{emitted string: probability} of block (``greedy=False``) or greedy block verification, one draft."""
    draft_len, vocab = len(tokens), range(len(draft_probs))
    one = 1 + 0 * draft_probs[0]
    pass_probs, residuals = [], []
    if greedy:
        for i in range(draft_len + 1):
            y = tokens[:i]
            py, qy = _joint(draft_probs, y), _joint(target_probs, y)
            if i == draft_len:
                pass_probs.append(min(one, qy / py))
                break
            wanted = [_pos(qy * target_probs[x] - py * draft_probs[x]) for x in vocab]  # (q(yx) - p(yx))_+
            residuals.append(_normalise(wanted, target_probs))
            if i > 0:
                big_a, big_d = sum(wanted), qy - py
                pass_probs.append(one if big_a - big_d == 0 else (big_a - _pos(big_d)) / (big_a - big_d))
    else:
        weight = one
        for i in range(draft_len + 1):
            if i > 0:
                x = tokens[i - 1]
                weight = min(one, weight * target_probs[x] / draft_probs[x])
            if i == draft_len:
                pass_probs.append(weight)
                break
            wanted = [_pos(weight * target_probs[x] - draft_probs[x]) for x in vocab]
            residuals.append(_normalise(wanted, target_probs))
            if i > 0:
                r = sum(wanted)
                pass_probs.append(one if r + 1 - weight == 0 else r / (r + 1 - weight))
    law: dict = {}
    for outcome in itertools.product([False, True], repeat=draft_len):
        prob = one
        for passed, h in zip(outcome, pass_probs):
            prob *= h if passed else 1 - h
        tau = max([i + 1 for i, passed in enumerate(outcome) if passed], default=0)
        nxt = target_probs if tau == draft_len else residuals[tau]
        for y in vocab:
            key = tuple(tokens[:tau]) + (y,)
            law[key] = law.get(key, 0) + prob * nxt[y]
    return law


def published_gbv_law(drafts, draft_probs, target_probs) -> dict:
    """{emitted string: probability} of the published SpecTr-GBV pseudo-code, followed literally.

    H is a Python set of tuples; every test branches into pass (probability h clamped to
    [0, 1], as U < h with U uniform) and fail; skipped tests do not branch.
    """
    num_drafts, draft_len, vocab = len(drafts), len(drafts[0]), range(len(draft_probs))
    one = 1 + 0 * draft_probs[0]

    def cover(y):
        py, qy = _joint(draft_probs, y), _joint(target_probs, y)
        return qy * (1 - (1 - min(one, py / qy)) ** num_drafts) if qy > 0 else 0 * one

    def divide(a, b):
        return a / b if b != 0 else 0 * one

    def clamp(h):
        return min(one, max(0 * one, h))

    def inner(j, i, tau, sel, rejected):
        if i > draft_len - 1:
            return final(j, tau, sel, rejected)
        y = tuple(drafts[j][:i])
        children = sum(cover(y + (x,)) for x in vocab)
        h = divide(cover(y) - children, 1 - (1 - _joint(draft_probs, y)) ** num_drafts - children)
        if y in rejected:
            return inner(j, i + 1, tau, sel, rejected)
        h = clamp(h)
        return [(h * p, t, s) for p, t, s in inner(j, i + 1, i, j, rejected)] + [
            ((1 - h) * p, t, s) for p, t, s in inner(j, i + 1, tau, sel, rejected | {y})
        ]

    def final(j, tau, sel, rejected):
        y = tuple(drafts[j])
        h = clamp(divide(cover(y), 1 - (1 - _joint(draft_probs, y)) ** num_drafts))
        rest = scan(j + 1, tau, sel, rejected)
        return [(h, draft_len, j)] + [((1 - h) * p, t, s) for p, t, s in rest]

    def scan(j, tau, sel, rejected):
        if j == num_drafts:
            return [(one, tau, sel)]
        return inner(j, tau + 1, tau, sel, rejected)

    law: dict = {}
    for prob, tau, sel in scan(0, 0, 0, frozenset()):
        y = tuple(drafts[sel][:tau])
        if tau == draft_len:
            nxt = list(target_probs)
        else:
            masses = []
            for x in vocab:
                pyx, qyx = _joint(draft_probs, y + (x,)), _joint(target_probs, y + (x,))
                masses.append(qyx * (1 - min(one, pyx / qyx) ** num_drafts) if qyx > 0 else 0 * one)
            nxt = _normalise(masses, target_probs)
        for x in vocab:
            law[y + (x,)] = law.get(y + (x,), 0) + prob * nxt[x]
    return law


def oracle_single_iteration(law_of, draft_probs, target_probs, num_drafts, draft_len) -> dict:
    """Independent exact single-iteration audit: E(s), implied law F, TV, prefix-cap excess, block efficiency."""
    vocab = range(len(draft_probs))
    emitted: dict = {}
    for drafts in itertools.product(itertools.product(vocab, repeat=draft_len), repeat=num_drafts):
        weight = 1
        for d in drafts:
            weight *= _joint(draft_probs, d)
        if weight == 0:
            continue
        for s, prob in law_of([list(d) for d in drafts]).items():
            emitted[s] = emitted.get(s, 0) + weight * prob
    tv = 0
    for w in itertools.product(vocab, repeat=draft_len + 1):
        qw = _joint(target_probs, w)
        implied = qw * sum(emitted.get(w[:m], 0) / _joint(target_probs, w[:m]) for m in range(1, draft_len + 2)
                           if _joint(target_probs, w[:m]) > 0)
        tv += abs(implied - qw)
    excess = max(
        sum(v for s, v in emitted.items() if s[: len(u)] == u) - _joint(target_probs, u)
        for m in range(1, draft_len + 2) for u in itertools.product(vocab, repeat=m)
    )
    return {
        "tv": tv / 2,
        "cap_excess": excess,
        "block_efficiency": sum(len(s) * v for s, v in emitted.items()),
        "first_token": [sum(v for s, v in emitted.items() if s[0] == x) for x in vocab],
    }
