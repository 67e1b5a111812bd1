"""Slow, obviously correct oracles of the G statistic's null, the partition's truncation and the strata.

Plain Python loops over every support point, outcome, string and tuple; no vectorisation.
"""

from __future__ import annotations

import itertools
import math


def poisson_deviance_moments(mu: float) -> tuple[float, float]:
    """Mean and variance of ``2 [O log(O / mu) - (O - mu)]`` for O ~ Poisson(mu), summed term by term."""
    top = int(mu + 40 * math.sqrt(mu) + 200)
    m1 = m2 = 0.0
    for o in range(top + 1):
        pmf = math.exp(o * math.log(mu) - mu - math.lgamma(o + 1))
        d = 2.0 * ((o * math.log(o / mu) if o > 0 else 0.0) - (o - mu))
        m1 += pmf * d
        m2 += pmf * d * d
    return m1, m2 - m1 * m1


def multinomial_g_law(probs, n: int) -> list[tuple[float, float]]:
    """Every outcome of Multinomial(n, probs) as ``(G statistic, probability)``."""
    out = []
    k = len(probs)
    for cut in itertools.combinations(range(n + k - 1), k - 1):  # stars and bars
        edges = (-1,) + cut + (n + k - 1,)
        counts = [edges[i + 1] - edges[i] - 1 for i in range(k)]
        log_prob = math.lgamma(n + 1) + sum(c * math.log(p) - math.lgamma(c + 1) for c, p in zip(counts, probs))
        g = 2.0 * sum(c * math.log(c / (n * p)) for c, p in zip(counts, probs) if c > 0)
        out.append((g, math.exp(log_prob)))
    return out


def exact_g_sf(probs, n: int, statistic: float) -> float:
    """``P(G >= statistic)`` under Multinomial(n, probs), by enumeration."""
    return sum(p for g, p in multinomial_g_law(probs, n) if g >= statistic - 1e-9 * max(1.0, abs(statistic)))


def truncated_cell_strings(partition, depth: int) -> dict:
    """For every string of V^N, the description of its cell in the depth-``depth`` truncation, from first principles.

    A string's cell in the full partition is described by a prefix u, or by u and a rare or impossible
    token class; if that definition uses at most ``depth`` tokens the cell stays, else the string's cell
    is "its first ``depth`` tokens, then anything".
    """
    import torch

    vocab_size, num_tokens = partition.vocab_size, partition.num_tokens
    out = {}
    for string in itertools.product(range(vocab_size), repeat=num_tokens):
        cell = int(partition.cells_of(torch.tensor([string]))[0])
        defining = int(partition.cell_depth[cell]) + (int(partition.cell_kind[cell]) != 0)
        out[string] = ("kept", cell) if defining <= depth else ("prefix", string[:depth])
    return out


def group_strata(weights, num_samples: int, min_per_group: float) -> list[int]:
    """The audit's grouping of strata, one stratum at a time in order of decreasing weight."""
    total = sum(weights)
    order = sorted(range(len(weights)), key=lambda i: -weights[i])
    groups, current, mass = [], [], 0.0
    for i in order:
        current.append(i)
        mass += weights[i] / total
        if mass * num_samples >= min_per_group * (1 - 1e-12):
            groups.append(current)
            current, mass = [], 0.0
    if current:
        if groups:
            groups[-1].extend(current)
        else:
            groups.append(current)
    label = [0] * len(weights)
    for g, members in enumerate(groups):
        for i in members:
            label[i] = g
    return label
