"""Null distributions of the G statistic that hold on large, sparse partitions.

The asymptotic chi-square law of the G statistic (the likelihood ratio of multinomial counts
against known cell probabilities) is accurate when every expected count is large.  The audit's
partitions are built the other way round: a prefix tree grown until its cells hold about
``min_expected`` (5) samples, thousands of them at once.  There the G statistic's mean is
``(C - 1) (1 + (sum_c 1/q_c - 1) / (6 n (C - 1)) + ...)``, a few percent above the chi-square's
``C - 1``, which at ``C`` = 7,000 cells moves the 99.9% quantile by more than a standard
deviation: the plain chi-square p-value rejected an exact verifier 18 times its stated rate
(docs/audit/calibration.md).

This module gives the G statistic a null that is right at every size:

* **moment-matched** (the default for all but tiny samples): the counts are independent
  Poisson(e_c) conditioned on their total, and the Poisson G statistic is exactly the multinomial
  one plus the deviance of the total (``G_Poisson = G_multinomial(S) + D(S, n)``).  The exact mean
  and variance of each cell's Poisson deviance are summed over the cell's support (an asymptotic
  expansion above an expected count of 1,000, where it is exact to 1e-12), the total's are
  subtracted, and the p-value is that of the scaled chi-square ``a chi2_b`` with the same two
  moments (Satterthwaite);
* **exact** when the multinomial has at most :data:`MAX_EXACT_OUTCOMES` outcomes (two cells and
  any sample up to a million, three cells up to about 1,400 samples, ...): every outcome is
  enumerated and the p-value is the null probability of a G statistic at least the one observed.
  There the counts are too few for any continuous law (two cells of 5 expected samples each:
  the chi-square p-value rejects at twice its level).

Measured (docs/audit/calibration.md): over partitions of 2 to 20,000 cells with expected counts
down to 5, the null rejection rate is within its sampling noise of the level at 0.05, 0.01,
0.001 and 2.5e-4.

Pearson's X^2 is not given a corrected null here: its right tail is heavier than any two- or
three-moment fit on partitions that mix small and large expected counts (1.3 to 2.7 times the
level at 1e-3 to 1e-4, measured), and the audit does not use it to decide.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Optional

import numpy as np
from scipy import special, stats

from spectr_audit import defaults

__all__ = [
    "MAX_EXACT_OUTCOMES",
    "GNull",
    "g_null",
    "g_statistic",
    "poisson_deviance_moments",
    "scaled_chi2_sf",
]

#: Up to this many multinomial outcomes the G-test's p-value is computed by enumerating them.
MAX_EXACT_OUTCOMES = defaults.NULL_MAX_EXACT_OUTCOMES

#: Above this expected count a cell's deviance moments come from their asymptotic expansion (its
#: first omitted terms, about 0.32 / e^3 and 3.9 / e^3, are below 4e-15 there).
_ASYMPTOTIC_FROM = 1e5

#: Support points held at once while summing over the Poisson laws.
_BLOCK_POINTS = 1 << 22


def _deviance(observed: np.ndarray, expected: np.ndarray) -> np.ndarray:
    """``2 [o log(o / e) - (o - e)]`` elementwise (0 log 0 = 0)."""
    with np.errstate(divide="ignore", invalid="ignore"):
        log_term = np.where(observed > 0, observed * np.log(np.where(observed > 0, observed, 1.0) / expected), 0.0)
    return 2.0 * (log_term - (observed - expected))


def poisson_deviance_moments(expected) -> tuple[np.ndarray, np.ndarray]:
    """Mean and variance of the Poisson deviance ``D = 2 [O log(O / e) - (O - e)]``, O ~ Poisson(e).

    Exact sums over ``[e - 14 sqrt(e) - 30, e + 14 sqrt(e) + 40]`` (the mass outside is below
    1e-40) for ``e <= 100,000``; above, the expansion ``E D = 1 + 1/(6e) + 1/(6e^2)`` and
    ``Var D = 2 + 2/(3e) + 4/(3e^2)`` (the next terms, about 0.32/e^3 and 3.9/e^3, are below
    4e-15 there).

    Examples
    --------
    >>> mean, var = poisson_deviance_moments([5.0, 1e6])
    >>> [round(float(m), 6) for m in mean], [round(float(v), 6) for v in var]
    ([1.046677, 1.0], [2.266783, 2.000001])
    """
    expected = np.asarray(expected, dtype=np.float64).reshape(-1)
    if expected.size and not (np.isfinite(expected).all() and (expected > 0).all()):
        raise ValueError("expected: every expected count must be finite and positive")
    mean = np.empty_like(expected)
    var = np.empty_like(expected)
    large = expected > _ASYMPTOTIC_FROM
    e = expected[large]
    mean[large] = 1.0 + 1.0 / (6.0 * e) + 1.0 / (6.0 * e * e)
    var[large] = 2.0 + 2.0 / (3.0 * e) + 4.0 / (3.0 * e * e)
    small = np.flatnonzero(~large)
    if small.size:
        order = small[np.argsort(expected[small])]
        ordered = expected[order]
        lows = np.floor(np.maximum(ordered - 14.0 * np.sqrt(ordered) - 30.0, 0.0))
        widths = np.ceil(ordered + 14.0 * np.sqrt(ordered) + 40.0 - lows).astype(np.int64) + 1
        start = 0
        while start < order.size:
            # a block of cells of similar expected count (ascending), each on its own support window
            # of the block's widest width, at most _BLOCK_POINTS points in all
            sizes = np.arange(1, order.size - start + 1) * widths[start:]
            count = max(1, int(np.searchsorted(sizes, _BLOCK_POINTS, side="right")))
            block = slice(start, start + count)
            e = ordered[block][:, None]
            support = lows[block][:, None] + np.arange(int(widths[start + count - 1]))[None, :]
            pmf = np.exp(support * np.log(e) - e - special.gammaln(support + 1.0))
            dev = _deviance(support, e)
            block_mean = (pmf * dev).sum(1)
            mean[order[block]] = block_mean
            var[order[block]] = (pmf * (dev - block_mean[:, None]) ** 2).sum(1)
            start += count
    return mean, var


@dataclasses.dataclass(frozen=True)
class GNull:
    """The null law of a G statistic: its exact mean and variance, or every outcome.

    Attributes
    ----------
    mean, var : float
        Mean and variance of the G statistic under the null.
    df : int
        Nominal degrees of freedom, ``cells - 1``.
    method : str
        ``"moment-matched"`` (a scaled chi-square with the exact two moments) or ``"exact"``
        (enumerated outcomes).
    exact_statistics, exact_probs : numpy arrays or None
        Every outcome's statistic and probability (``"exact"`` only).
    """

    mean: float
    var: float
    df: int
    method: str
    exact_statistics: Optional[np.ndarray] = None
    exact_probs: Optional[np.ndarray] = None

    def sf(self, statistic: float) -> float:
        """``P(G >= statistic)`` under the null."""
        if self.df <= 0:
            return 1.0
        if self.method == "exact":
            # outcomes within rounding of the observed statistic count as at least as extreme
            tol = 1e-9 * max(1.0, abs(statistic))
            return float(min(1.0, self.exact_probs[self.exact_statistics >= statistic - tol].sum()))
        return scaled_chi2_sf(statistic, self.mean, self.var)

    def sf_many(self, statistics) -> np.ndarray:
        """:meth:`sf` of every entry of ``statistics`` (an array)."""
        statistics = np.asarray(statistics, dtype=np.float64)
        if self.df <= 0:
            return np.ones_like(statistics)
        if self.method == "exact":
            order = np.argsort(self.exact_statistics)
            ordered = self.exact_statistics[order]
            tail = np.cumsum(self.exact_probs[order][::-1])[::-1]  # tail[i] = P(G >= ordered[i])
            tol = 1e-9 * np.maximum(1.0, np.abs(statistics))
            index = np.searchsorted(ordered, statistics - tol, side="left")
            return np.where(index < ordered.size, np.minimum(1.0, tail[np.minimum(index, ordered.size - 1)]), 0.0)
        scale = self.var / (2.0 * self.mean)
        return stats.chi2.sf(statistics / scale, 2.0 * self.mean * self.mean / self.var)

    def describe(self) -> str:
        """The reference law in words (reports print it)."""
        if self.df <= 0:
            return "one cell: nothing to test"
        if self.method == "exact":
            return f"exact: {self.exact_probs.size} multinomial outcomes enumerated"
        scale = self.var / (2.0 * self.mean)
        return (f"{scale:.4g} x chi2({2.0 * self.mean * self.mean / self.var:.6g}), the exact null mean "
                f"{self.mean:.6g} and variance {self.var:.6g} (nominal df {self.df})")


def scaled_chi2_sf(statistic: float, mean: float, var: float) -> float:
    """``P(a chi2_b >= statistic)`` for the scaled chi-square of the given mean and variance.

    Examples
    --------
    >>> round(scaled_chi2_sf(3.841458820694124, 1.0, 2.0), 6)   # chi2(1) itself
    0.05
    """
    if mean <= 0 or var <= 0:
        return 1.0 if statistic <= mean else 0.0
    scale = var / (2.0 * mean)
    return float(stats.chi2.sf(statistic / scale, 2.0 * mean * mean / var))


def g_statistic(observed, expected) -> float:
    """``2 sum_c o_c log(o_c / e_c)`` over cells with ``sum o = sum e``."""
    observed = np.asarray(observed, dtype=np.float64)
    expected = np.asarray(expected, dtype=np.float64)
    return float(_deviance(observed, expected).sum())


def _log_num_outcomes(num_cells: int, num_samples: int) -> float:
    """``log C(n + k - 1, k - 1)``, the log of the number of multinomial outcomes."""
    return float(special.gammaln(num_samples + num_cells) - special.gammaln(num_cells)
                 - special.gammaln(num_samples + 1))


def _compositions(num_cells: int, num_samples: int) -> np.ndarray:
    """Every vector of ``num_cells`` non-negative integers summing to ``num_samples`` (``[outcomes, cells]``)."""
    if num_cells == 1:
        return np.array([[num_samples]], dtype=np.int64)
    first = np.arange(num_samples + 1, dtype=np.int64)
    if num_cells == 2:
        return np.stack([first, num_samples - first], 1)
    rows = []
    for head in range(num_samples + 1):
        tail = _compositions(num_cells - 1, num_samples - head)
        rows.append(np.concatenate([np.full((tail.shape[0], 1), head, dtype=np.int64), tail], 1))
    return np.concatenate(rows, 0)


def _exact_null(probs: np.ndarray, num_samples: int) -> GNull:
    outcomes = _compositions(probs.size, num_samples).astype(np.float64)
    log_prob = (special.gammaln(num_samples + 1.0) - special.gammaln(outcomes + 1.0).sum(1)
                + (outcomes * np.log(probs)[None, :]).sum(1))
    prob = np.exp(log_prob)
    statistic = _deviance(outcomes, num_samples * probs[None, :]).sum(1)
    mean = float((prob * statistic).sum())
    var = float((prob * (statistic - mean) ** 2).sum())
    return GNull(mean, var, probs.size - 1, "exact", statistic, prob)


def g_null(probs, num_samples: int, exact: bool = True) -> GNull:
    """The null law of the G statistic of ``num_samples`` multinomial counts over cells of ``probs``.

    Parameters
    ----------
    probs : array
        ``[num_cells]`` positive cell probabilities (renormalised to sum 1).
    num_samples : int
        n, the multinomial total.
    exact : bool
        Enumerate the outcomes where there are few (False: the moments alone, as a sum of
        independent G statistics needs).

    Returns
    -------
    GNull
        Exact (every outcome) when there are at most :data:`MAX_EXACT_OUTCOMES` outcomes, else
        moment-matched: ``E G = sum_c E D(e_c) - E D(n)`` and ``Var G = sum_c Var D(e_c) - Var D(n)``
        with ``e_c = n q_c`` and D the Poisson deviance (:func:`poisson_deviance_moments`).

    Notes
    -----
    With O_c independent Poisson(e_c) and S their total, ``sum_c D(O_c; e_c) = G(O | S) + D(S; n)``
    exactly, where ``G(O | S)`` is the multinomial G statistic given the total; given S = n the
    counts are the multinomial.  The two terms are asymptotically independent, so the
    multinomial's moments are the Poisson sum's less the total's, up to ``O(1/n)``.

    Examples
    --------
    >>> null = g_null([0.5, 0.5], 10)            # 11 outcomes: exact
    >>> null.method, round(null.sf(13.862943611198906), 6)   # all 10 samples in one cell
    ('exact', 0.001953)
    >>> g_null([0.25] * 4, 10_000).method
    'moment-matched'
    """
    probs = np.asarray(probs, dtype=np.float64).reshape(-1)
    if probs.size == 0 or not (probs > 0).all() or not np.isfinite(probs).all():
        raise ValueError("probs: expected positive, finite cell probabilities")
    probs = probs / probs.sum()
    num_samples = int(num_samples)
    df = probs.size - 1
    if df <= 0 or num_samples <= 0:
        return GNull(0.0, 0.0, max(df, 0), "exact" if df <= 0 else "moment-matched")
    if exact and _log_num_outcomes(probs.size, num_samples) <= math.log(MAX_EXACT_OUTCOMES) + 1e-9:
        return _exact_null(probs, num_samples)
    cell_mean, cell_var = poisson_deviance_moments(num_samples * probs)
    total_mean, total_var = poisson_deviance_moments([float(num_samples)])
    mean = float(cell_mean.sum() - total_mean[0])
    var = float(cell_var.sum() - total_var[0])
    return GNull(mean, var, df, "moment-matched")
