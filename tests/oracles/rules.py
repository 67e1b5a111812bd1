"""Slow, obviously-correct oracles: plain-Python versions of the token rules and the tree walk.

No torch, no batching, no vectorised tricks: one draft tuple at a time, written straight
from the rules' definitions (docs/rules/), so that the fast batched verifiers can be compared
against them.
"""

from __future__ import annotations

import math

from scipy.optimize import brentq


def _pos(x: float) -> float:
    return x if x > 0 else 0.0


def _normalise(values: list[float], fallback: list[float]) -> list[float]:
    total = sum(values)
    return [v / total for v in values] if total > 0 else list(fallback)


def maximal_coupling(tokens, draft, target):
    """Single draft: accept min(1, q/p); residual (q - p)_+."""
    accept = [min(1.0, target[x] / draft[x]) for x in tokens]
    return accept, _normalise([_pos(t - d) for t, d in zip(target, draft)], target)


def kseq_rho(draft, target, k) -> float:
    """rho* by Brent's method (a different root finder from the verifier's piecewise solve)."""
    if k == 1:
        return 1.0
    # Rows renormalised with exact sums, and f in the form that keeps its relative accuracy near
    # beta = 1 (a difference of sums of non-negative terms; docs/rules/kseq.md): the direct form
    # rounds to a tiny negative value on equal rows and would put the root at 1 + 1e-8, not 1.
    draft_total, target_total = math.fsum(draft), math.fsum(target)
    draft = [d / draft_total for d in draft]
    target = [t / target_total for t in target]

    def f(rho):
        beta = math.fsum(min(d, t / rho) for d, t in zip(draft, target))
        if beta < 0.5:
            return rho * beta - (1 - (1 - beta) ** k)
        draft_excess = math.fsum(max(d - t / rho, 0.0) for d, t in zip(draft, target))
        target_excess = math.fsum(max(t / rho - d, 0.0) for d, t in zip(draft, target))
        return draft_excess**k - rho * target_excess

    if f(1.0) >= 0:
        return 1.0
    return brentq(f, 1.0, float(k), xtol=1e-15, rtol=1e-15)


def kseq(tokens, draft, target):
    """K-SEQ at a node with k = len(tokens) drafts."""
    k = len(tokens)
    rho = kseq_rho(draft, target, k)
    weighted = [min(d, t / rho) for d, t in zip(draft, target)]
    beta = sum(weighted)
    accept_any = 1 - (1 - beta) ** k
    scale = accept_any / beta if beta > 0 else 0.0
    residual = _normalise([_pos(t - scale * w) for t, w in zip(target, weighted)], target)
    return [min(1.0, target[x] / (rho * draft[x])) for x in tokens], residual


def recursive_rejection(tokens, draft, target, without_replacement=False):
    """Recursive rejection sampling at a node."""
    residual, drafting, accept = list(target), list(draft), []
    for x in tokens:
        accept.append(min(1.0, residual[x] / drafting[x]) if drafting[x] > 0 else 0.0)
        residual = _normalise([_pos(r - d) for r, d in zip(residual, drafting)], residual)
        if without_replacement:
            drafting = _normalise([0.0 if i == x else d for i, d in enumerate(drafting)], drafting)
    return accept, residual


RULES = {
    "speculative": maximal_coupling,
    "kseq": kseq,
    "spectr-tree": kseq,
    "rrs": recursive_rejection,
    "rrs-wor": lambda tokens, draft, target: recursive_rejection(tokens, draft, target, True),
}


def tree_law(rule, draft_tokens, draft_probs, target_probs) -> dict:
    """Exact law {(draft_index, num_accepted, next_token): prob} of a tree walk, one tuple.

    ``draft_tokens[k][l]``, ``draft_probs[k][l][x]``, ``target_probs[k][l][x]`` (plain lists).
    """
    num_drafts, draft_len = len(draft_tokens), len(draft_tokens[0])
    law: dict = {}

    def walk(survivors, level, reach):
        canon = survivors[0]
        if level == draft_len:
            for y, t in enumerate(target_probs[canon][draft_len]):
                law[(canon, draft_len, y)] = law.get((canon, draft_len, y), 0.0) + reach * t
            return
        tokens = [draft_tokens[k][level] for k in survivors]
        accept, residual = rule(tokens, draft_probs[canon][level], target_probs[canon][level])
        out = [0.0] * len(residual)
        none = 1.0
        for x, a in zip(tokens, accept):
            out[x] += none * a
            none *= 1 - a
        out = [o + none * r for o, r in zip(out, residual)]
        for y, mass in enumerate(out):
            if mass == 0:
                continue
            nxt = [k for k in survivors if draft_tokens[k][level] == y]
            if nxt:
                walk(nxt, level + 1, reach * mass)
            else:
                law[(canon, level, y)] = law.get((canon, level, y), 0.0) + reach * mass

    walk(list(range(num_drafts)), 0, 1.0)
    return law
