"""Sample sizes for the statistical audit: how many verifications detect a given TV.

The statistical audit compares the law F of the first N emitted tokens (completed with target
samples) with the target law q over a partition of V^N into C cells.  Pearson's statistic
``X^2 = n sum_c (F_hat_c - q_c)^2 / q_c`` is then, for large n, non-central chi-square with
C - 1 degrees of freedom and non-centrality ``n w^2``, where Cohen's effect size is
``w = sqrt(sum_c (F_c - q_c)^2 / q_c)``.  By Cauchy-Schwarz,

    TV(F, q) = 1/2 sum_c sqrt(q_c) |F_c - q_c| / sqrt(q_c) <= 1/2 sqrt(sum_c q_c) w = w / 2,

so ``w >= 2 TV`` whatever the shape of the deviation: planning for ``w = 2 * min_detectable_tv``
guarantees the stated power against every F at that TV (on the audited partition).  This is the
same calculation as statsmodels' ``GofChisquarePower`` (the tests use it as the oracle), done
here directly with scipy so that it never depends on a root finder's starting point.  The
G-test has the same asymptotic power.

Defaults (:mod:`spectr_audit.defaults`): false-alarm rate 1e-3 per audit (familywise over its
sub-tests, Holm), power 0.99, minimum detectable TV 0.005.
"""

from __future__ import annotations

import math

from scipy import optimize, stats

from spectr_audit import defaults
from spectr_audit.errors import InvalidArgument

__all__ = [
    "DEFAULT_ALPHA",
    "DEFAULT_POWER",
    "DEFAULT_MIN_DETECTABLE_TV",
    "effect_size_for_tv",
    "noncentrality_for_power",
    "required_samples",
    "min_detectable_tv",
    "chi2_power",
]

#: False-alarm rate of one audit (familywise over its sub-tests): :data:`spectr_audit.defaults.ALPHA`.
DEFAULT_ALPHA = defaults.ALPHA
#: Probability of flagging a verifier whose TV distance is at least the minimum detectable TV.
DEFAULT_POWER = defaults.POWER
#: The smallest TV distance (on the audited partition) the default sample size must detect.
DEFAULT_MIN_DETECTABLE_TV = defaults.MIN_DETECTABLE_TV


def _check_unit(name: str, value: float, *, open_right: bool = True) -> float:
    value = float(value)
    if not math.isfinite(value) or value <= 0 or value >= 1 or (not open_right and value > 1):
        raise InvalidArgument(f"{name}: expected a number in (0, 1), got {value!r}")
    return value


def _check_cells(num_cells: int) -> int:
    if isinstance(num_cells, bool) or int(num_cells) != num_cells or num_cells < 2:
        raise InvalidArgument(f"num_cells: expected an integer >= 2 (one degree of freedom at least), got {num_cells!r}")
    return int(num_cells)


def effect_size_for_tv(tv: float) -> float:
    """Cohen's w guaranteed by a TV distance: ``w >= 2 TV`` (Cauchy-Schwarz; see the module docstring)."""
    tv = float(tv)
    if not math.isfinite(tv) or tv <= 0 or tv > 1:
        raise InvalidArgument(f"min_detectable_tv: expected a number in (0, 1], got {tv!r}")
    return 2.0 * tv


def chi2_power(noncentrality: float, num_cells: int, alpha: float) -> float:
    """Power of the level-``alpha`` chi-square test with ``num_cells - 1`` df at a given non-centrality."""
    df = _check_cells(num_cells) - 1
    alpha = _check_unit("alpha", alpha)
    critical = stats.chi2.isf(alpha, df)
    if noncentrality <= 0:
        return alpha
    return float(stats.ncx2.sf(critical, df, noncentrality))


def noncentrality_for_power(num_cells: int, alpha: float, power: float) -> float:
    """The non-centrality ``n w^2`` at which the chi-square test reaches ``power``."""
    num_cells = _check_cells(num_cells)
    alpha = _check_unit("alpha", alpha)
    power = _check_unit("power", power)
    if power <= alpha:
        return 0.0
    df = num_cells - 1
    critical = stats.chi2.isf(alpha, df)
    # power(lam) increases from alpha (lam = 0) to 1; bracket the root by doubling.
    upper = max(1.0, critical)
    while stats.ncx2.sf(critical, df, upper) < power:
        upper *= 2.0
    return float(optimize.brentq(lambda lam: stats.ncx2.sf(critical, df, lam) - power, 0.0, upper, xtol=1e-10, rtol=1e-12))


def required_samples(
    min_detectable_tv: float = DEFAULT_MIN_DETECTABLE_TV,
    num_cells: int = 2,
    alpha: float = DEFAULT_ALPHA,
    power: float = DEFAULT_POWER,
) -> int:
    """Samples for the chi-square test to flag every law at TV >= ``min_detectable_tv``.

    Parameters
    ----------
    min_detectable_tv : float
        TV distance (on the audited partition) to detect, in (0, 1].
    num_cells : int
        Cells of the partition after pooling (degrees of freedom + 1), >= 2.
    alpha : float
        False-alarm rate of this one test (pass ``alpha / m`` for a test in a Holm family of m).
    power : float
        Probability of rejecting at that TV.

    Returns
    -------
    int
        ``ceil(lambda / (2 TV)^2)`` with ``lambda`` the non-centrality of the required power.

    Notes
    -----
    Asymptotic (non-central chi-square), valid when the expected count of every cell is at
    least about 5, which the audit's pooling enforces.  Equivalent to statsmodels'
    ``GofChisquarePower().solve_power(effect_size=2 * tv, alpha=alpha, power=power,
    n_bins=num_cells)``.

    Examples
    --------
    >>> required_samples(0.005, num_cells=64, alpha=2e-4, power=0.99)
    959971
    """
    w = effect_size_for_tv(min_detectable_tv)
    return int(math.ceil(noncentrality_for_power(num_cells, alpha, power) / (w * w)))


def min_detectable_tv(
    num_samples: int,
    num_cells: int,
    alpha: float = DEFAULT_ALPHA,
    power: float = DEFAULT_POWER,
) -> float:
    """The smallest TV distance detected with ``power`` by ``num_samples`` samples.

    The inverse of :func:`required_samples`: ``sqrt(lambda / n) / 2``.  May exceed 1 (meaning:
    no law at all is detected with that power), and is ``inf`` for ``num_samples = 0``.

    Examples
    --------
    >>> round(min_detectable_tv(959971, num_cells=64, alpha=2e-4, power=0.99), 6)
    0.005
    """
    if isinstance(num_samples, bool) or int(num_samples) != num_samples or num_samples < 0:
        raise InvalidArgument(f"num_samples: expected an integer >= 0, got {num_samples!r}")
    if num_samples == 0:
        return math.inf
    return math.sqrt(noncentrality_for_power(num_cells, alpha, power) / num_samples) / 2.0
