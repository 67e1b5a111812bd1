"""Slow oracles for the acceptance bounds: brute force over token sets and exact rationals.

alpha* is ``min_T q(T) + 1 - P(S subset of T)`` over all token sets T (the min-cut form of the
optimal multi-draft acceptance, docs/audit/bounds.md); these functions enumerate every T instead of
using the closed form's sort, and evaluate K-SEQ's gap function in exact rational arithmetic.
"""

from __future__ import annotations

import itertools
import math
from fractions import Fraction

import numpy as np

__all__ = ["brute_force_alpha", "brute_force_alpha_from_sets", "without_replacement_set_probs", "exact_kseq_gap"]


def brute_force_alpha(draft: np.ndarray, target: np.ndarray, num_drafts: int) -> float:
    """min over all 2^V token sets T of q(T) + 1 - p(T)^K."""
    vocab_size = len(draft)
    masks = np.array(list(itertools.product([0.0, 1.0], repeat=vocab_size)))  # [2^V, V]
    return float((masks @ target + 1.0 - (masks @ draft) ** num_drafts).min())


def brute_force_alpha_from_sets(set_probs: dict[frozenset[int], float], target: np.ndarray) -> float:
    """min over T of q(T) + 1 - P(S subset of T), for any law of the draft set S."""
    best = math.inf
    for bits in itertools.product([False, True], repeat=len(target)):
        chosen = frozenset(i for i, bit in enumerate(bits) if bit)
        inside = sum(mass for s, mass in set_probs.items() if s <= chosen)
        best = min(best, float(target[list(chosen)].sum()) + 1.0 - inside)
    return best


def without_replacement_set_probs(draft: np.ndarray, num_drafts: int) -> dict[frozenset[int], float]:
    """P(set = S) for num_drafts ordered draws without replacement (stopping if p runs out)."""
    probs: dict[frozenset[int], float] = {}

    def walk(drawn: tuple[int, ...], mass: float) -> None:
        remaining = [i for i in range(len(draft)) if i not in drawn and draft[i] > 0]
        if len(drawn) == num_drafts or not remaining:
            key = frozenset(drawn)
            probs[key] = probs.get(key, 0.0) + mass
            return
        total = sum(draft[i] for i in remaining)
        for i in remaining:
            walk(drawn + (i,), mass * draft[i] / total)

    walk((), 1.0)
    return probs


def exact_kseq_gap(draft: np.ndarray, target: np.ndarray, rho: float, num_drafts: int) -> Fraction:
    """f(rho) = rho beta - (1 - (1 - beta)^K) in exact rational arithmetic.

    The rows are normalised exactly first: a float row sums to 1 only up to rounding, and
    where f is flat (p close to q, K large) a 1e-16 change in the sums moves the root.
    """
    draft_exact = [Fraction(float(x)) for x in draft]
    target_exact = [Fraction(float(x)) for x in target]
    draft_total, target_total = sum(draft_exact), sum(target_exact)
    rho_exact = Fraction(rho)
    beta = sum(
        min(d / draft_total, t / target_total / rho_exact) for d, t in zip(draft_exact, target_exact)
    )
    return rho_exact * beta - (1 - (1 - beta) ** num_drafts)
