"""Slow, obviously-correct oracles for the generation audit: plain Python, one token at a time.

* :func:`vocabulary_order`: the order of the vocabulary the PIT walks, from its definition
  (``sorted`` with an explicit key);
* :func:`token_stats`: per emitted token, its randomized PIT under an order, its target mass,
  surprisal, and the entropy and variance of the surprisal under the target law;
* :func:`step_law`: the exact law of the first token a single-draft speculative step emits, when
  the draft is sampled from ``sample`` while the acceptance reads ``draft`` (both laws given), by
  summing over the drafted token.
"""

from __future__ import annotations

import math


def ratio_key(q: float, p: float) -> float:
    """``q / p``; ``inf`` for a token only the target can emit; 0 for one neither can."""
    if p > 0:
        return q / p
    return math.inf if q > 0 else 0.0


def vocabulary_order(law, ordering: str, draft=None) -> list:
    """The token ids in the PIT's order: by decreasing target probability, decreasing ratio ``q/p``, or id.

    Ties (equal keys) go by increasing token id.
    """
    ids = range(len(law))
    if ordering == "token-id":
        return list(ids)
    if ordering == "probability":
        return sorted(ids, key=lambda v: (-law[v], v))
    if ordering == "ratio":
        return sorted(ids, key=lambda v: (-ratio_key(law[v], draft[v]), v))
    raise ValueError(ordering)


def pit(law, token: int, u: float, ordering: str, draft=None) -> float:
    """``q(tokens before y) + u q(y)``, clipped to [0, 1]."""
    before = 0.0
    for v in vocabulary_order(law, ordering, draft):
        if v == token:
            break
        before += law[v]
    return min(1.0, max(0.0, before + u * law[token]))


def entropy(law) -> float:
    return -sum(q * math.log(q) for q in law if q > 0)


def surprisal_variance(law) -> float:
    """``Var_q(-log q)``: the mean squared distance of ``-log q(v)`` from the entropy."""
    h = entropy(law)
    return sum(q * (-math.log(q) - h) ** 2 for q in law if q > 0)


def token_stats(laws, tokens, uniforms, draft_laws=None, orderings=("probability", "token-id")) -> dict:
    """Per token: ``pit`` (a dict per order), ``mass``, ``surprisal``, ``entropy``, ``variance`` (lists)."""
    out = {"pit": {o: [] for o in orderings}, "mass": [], "surprisal": [], "entropy": [], "variance": []}
    for i, (law, token, u) in enumerate(zip(laws, tokens, uniforms)):
        draft = None if draft_laws is None else draft_laws[i]
        for order in orderings:
            out["pit"][order].append(pit(law, token, u, order, draft))
        q = law[token]
        out["mass"].append(q)
        out["surprisal"].append(-math.log(q) if q > 0 else math.inf)
        out["entropy"].append(entropy(law))
        out["variance"].append(surprisal_variance(law))
    return out


def step_law(target, draft, sample) -> list:
    """The law of the first emitted token of a speculative step that drafts from ``sample``.

    The acceptance reads ``min(1, target / draft)`` and a rejection draws from ``(target - draft)+``
    normalised (the target itself when that is zero); with ``sample == draft`` this is ``target``.
    """
    size = len(target)
    residual = [max(0.0, t - d) for t, d in zip(target, draft)]
    total = sum(residual)
    residual = [r / total for r in residual] if total > 0 else list(target)
    law = [0.0] * size
    for x in range(size):
        if sample[x] == 0:
            continue
        accept = min(1.0, target[x] / draft[x]) if draft[x] > 0 else 0.0
        law[x] += sample[x] * accept
        for y in range(size):
            law[y] += sample[x] * (1.0 - accept) * residual[y]
    return law
