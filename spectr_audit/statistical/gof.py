"""Goodness-of-fit tests of sampled strings against an exact law.

Every function here takes counts and exact probabilities and returns a :class:`TestResult`
(statistic, p-value, degrees of freedom, what was pooled).  The audit composes them:

* :func:`g_test`: counts of i.i.d. samples over a partition against the exact cell
  probabilities, sparse cells pooled (expected count < ``min_expected``, 5 by default, into one
  cell); the p-value from the G statistic's exact null moments at these cells and this sample
  (:mod:`spectr_audit.statistical.nulls`), calibrated on partitions of any size.
* :func:`pearson_test`: Pearson's X^2 on the same cells against the chi-square with
  ``cells - 1`` df.  Its right tail is heavier than that on partitions that mix small and large
  expected counts, so the audit reports it but does not decide by it.
* :func:`stratified_pearson_test`: samples drawn per draft tuple (strata of known probability);
  the stratified estimate of the law is compared with q by Pearson's distance, and the null
  distribution is the weighted sum of chi-squares given by the estimated within-stratum
  covariance (Rao-Scott), evaluated by Imhof's integral.  The draft-sampling noise drops out.
* :func:`conditional_g_test` (and :func:`conditional_pearson_test`): per-stratum multinomial
  tests against known per-stratum laws (a sampler against its own exact law), summed; :func:`independent_sum_test` for counts
  of samples that each have their own known law.
* :func:`binomial_above`, :func:`binomial_below`: exact one-sided binomial tests of a rate
  against a bound or a claim.
* :class:`PlugInEProcess`: an anytime-valid likelihood-ratio e-process for early stopping.
* :func:`holm`: Holm's step-down adjustment.
"""

from __future__ import annotations

import dataclasses
import math
import warnings
from typing import Optional, Sequence

import numpy as np
import torch
from scipy import integrate, optimize, stats

from spectr_audit import defaults
from spectr_audit.errors import InvalidArgument
from spectr_audit.statistical.nulls import g_null, scaled_chi2_sf

__all__ = [
    "TestResult",
    "PlugInEProcess",
    "binomial_above",
    "binomial_below",
    "conditional_g_test",
    "conditional_pearson_test",
    "g_test",
    "holm",
    "independent_sum_test",
    "pearson_test",
    "pool_sparse",
    "stratified_pearson_test",
    "weighted_chi2_sf",
]

#: Default minimum expected count of a cell (Cochran's rule); sparser cells are pooled.
MIN_EXPECTED = defaults.MIN_EXPECTED


@dataclasses.dataclass(frozen=True)
class TestResult:
    """One sub-test of an audit.

    Attributes
    ----------
    name : str
        ``"pearson"``, ``"g-test"``, ``"stratified-pearson"``, ``"acceptance<=optimal"``, ...
    statistic : float
        The test statistic (chi-square scale for the chi-square tests; a count for binomial tests).
    pvalue : float
        The p-value of this test alone.
    df : float or None
        Degrees of freedom (effective df ``tr(M)^2 / tr(M^2)`` for weighted chi-squares).
    num_samples : int
        Samples the test used.
    num_cells : int or None
        Cells after pooling.
    pooled_mass : float
        Target mass of the cells pooled into one.
    min_detectable_tv : float or None
        Smallest TV detected with the audit's power by this test (when it has a formula).
    pvalue_adjusted : float or None
        Holm-adjusted p-value within the audit's family (set by the audit).
    detail : str
        What was tested, in words.
    null : str
        The reference law the p-value comes from, in words (empty for the tests whose law is
        their name: exact binomial tests, the e-process).
    """

    __test__ = False  # not a pytest test class

    name: str
    statistic: float
    pvalue: float
    df: Optional[float] = None
    num_samples: int = 0
    num_cells: Optional[int] = None
    pooled_mass: float = 0.0
    min_detectable_tv: Optional[float] = None
    pvalue_adjusted: Optional[float] = None
    detail: str = ""
    null: str = ""

    def to_dict(self) -> dict:
        """Plain JSON values."""
        return {k: (None if isinstance(v, float) and not math.isfinite(v) else v)
                for k, v in dataclasses.asdict(self).items()}


def _as_numpy(values, name: str) -> np.ndarray:
    if isinstance(values, torch.Tensor):
        values = values.detach().cpu().double().numpy()
    array = np.asarray(values, dtype=np.float64)
    if array.ndim != 1:
        raise InvalidArgument(f"{name}: expected a 1-D array, got shape {array.shape}")
    return array


def pool_sparse(
    observed,  # [num_cells] counts
    cell_probs,  # [num_cells] exact probabilities
    min_expected: float = MIN_EXPECTED,
) -> tuple[np.ndarray, np.ndarray, float, np.ndarray]:
    """Pool cells whose expected count ``n * prob`` is below ``min_expected`` into one cell.

    Cells of probability 0 are dropped (an observation there is a support violation, tested
    separately).  When the pooled cell is itself below ``min_expected`` it is merged into the
    kept cell of smallest expected count.

    Returns
    -------
    observed, probs : numpy arrays over the kept cells (pooled cell last, when there is one)
    pooled_mass : float
        Probability of the pooled cells.
    mapping : numpy int array ``[num_cells]``
        Index of each input cell in the output (-1 for dropped zero-probability cells).
    """
    observed = _as_numpy(observed, "observed")
    probs = _as_numpy(cell_probs, "cell_probs")
    if observed.shape != probs.shape:
        raise InvalidArgument(f"observed, cell_probs: shapes differ, {observed.shape} vs {probs.shape}")
    num_samples = observed.sum()
    positive = probs > 0
    sparse = positive & (num_samples * probs < min_expected)
    kept = np.flatnonzero(positive & ~sparse)
    mapping = np.full(probs.shape, -1, dtype=np.int64)
    mapping[kept] = np.arange(kept.size)
    pooled_mass = float(probs[sparse].sum())
    if sparse.any():
        if num_samples * pooled_mass >= min_expected or kept.size == 0:
            mapping[sparse] = kept.size
        else:
            mapping[sparse] = int(np.argmin(probs[kept]))
    size = int(mapping.max()) + 1 if mapping.max() >= 0 else 0
    keep = mapping >= 0
    out_obs = np.bincount(mapping[keep], weights=observed[keep], minlength=size)
    out_probs = np.bincount(mapping[keep], weights=probs[keep], minlength=size)
    return out_obs, out_probs, pooled_mass, mapping


def _pooled_expected(observed, cell_probs, min_expected: float) -> tuple[np.ndarray, np.ndarray, float]:
    """The pooled counts (:func:`pool_sparse`), their expected counts under the kept cells' renormalised
    probabilities, and the pooled mass."""
    obs, probs, pooled_mass, _ = pool_sparse(observed, cell_probs, min_expected)
    probs = probs / probs.sum() if probs.size else probs
    return obs, obs.sum() * probs, pooled_mass


def _chi2_result(name, statistic, df, num_samples, num_cells, pooled_mass, detail) -> TestResult:
    pvalue = float(stats.chi2.sf(statistic, df)) if df > 0 else 1.0
    return TestResult(name, float(statistic), pvalue, float(df), int(num_samples), int(num_cells), float(pooled_mass),
                      detail=detail)


def pearson_test(
    observed,  # [num_cells] counts of i.i.d. samples
    cell_probs,  # [num_cells] exact probabilities
    min_expected: float = MIN_EXPECTED,
) -> TestResult:
    """Pearson's chi-square of i.i.d. counts against exact cell probabilities, sparse cells pooled.

    Examples
    --------
    >>> r = pearson_test([48, 52], [0.5, 0.5])
    >>> round(r.statistic, 6), r.df
    (0.16, 1.0)
    """
    obs, expected, pooled_mass = _pooled_expected(observed, cell_probs, min_expected)
    statistic = float(((obs - expected) ** 2 / expected).sum()) if obs.size else 0.0
    return _chi2_result("pearson", statistic, max(obs.size - 1, 0), obs.sum(), obs.size, pooled_mass,
                        "Pearson chi-square of completed strings vs the target law")


def g_test(
    observed,  # [num_cells] counts of i.i.d. samples
    cell_probs,  # [num_cells] exact probabilities
    min_expected: float = MIN_EXPECTED,
) -> TestResult:
    """The G-test (likelihood ratio) of i.i.d. counts against exact cell probabilities, sparse cells pooled.

    The p-value comes from the G statistic's null law at these cells and this sample size
    (:func:`spectr_audit.statistical.nulls.g_null`): a scaled chi-square with the exact null mean
    and variance, or every outcome enumerated when there are few.  The plain chi-square with
    ``cells - 1`` df is too liberal on large sparse partitions (it rejected an exact verifier at
    18 times its level on 7,000 cells of 5 expected samples; docs/audit/calibration.md).

    Examples
    --------
    >>> r = g_test([48, 52], [0.5, 0.5])
    >>> round(r.statistic, 6), round(r.pvalue, 4), r.null
    (0.160043, 0.7644, 'exact: 101 multinomial outcomes enumerated')
    """
    obs, expected, pooled_mass = _pooled_expected(observed, cell_probs, min_expected)
    nonzero = obs > 0
    statistic = float(2.0 * (obs[nonzero] * np.log(obs[nonzero] / expected[nonzero])).sum())
    df = max(obs.size - 1, 0)
    if df == 0:
        return TestResult("g-test", statistic, 1.0, 0.0, int(obs.sum()), int(obs.size), float(pooled_mass),
                          detail="G-test (likelihood ratio) of completed strings vs the target law: one cell")
    null = g_null(expected / expected.sum(), int(round(float(obs.sum()))))
    return TestResult("g-test", statistic, null.sf(statistic), float(df), int(obs.sum()), int(obs.size),
                      float(pooled_mass), detail="G-test (likelihood ratio) of completed strings vs the target law",
                      null=null.describe())


def conditional_g_test(
    observed: torch.Tensor,  # [num_strata, num_cells] counts
    expected: torch.Tensor,  # [num_strata, num_cells] expected counts from the exact conditional law
    min_expected: float = MIN_EXPECTED,
    name: str = "conditional-g",
) -> TestResult:
    """Sum over strata of G statistics against known per-stratum expected counts.

    Within a stratum the samples are i.i.d. from a known law (one draft tuple, a sampler
    against its own ``output_probs``), and the strata are independent, so the sum's null mean and
    variance are the sums of the strata's exact ones (:func:`spectr_audit.statistical.nulls.g_null`);
    the p-value is that of the scaled chi-square with those two moments (the stratum's own exact
    law when there is one stratum).  Sparse cells are pooled within each stratum; a stratum with a
    single cell after pooling contributes nothing.
    """
    observed = observed.detach().cpu().double()
    expected = expected.detach().cpu().double()
    statistic, mean, var, df, cells, pooled = 0.0, 0.0, 0.0, 0, 0, 0.0
    totals = observed.sum(1)
    nulls = []
    strata = torch.nonzero(totals > 0).squeeze(1).tolist()
    for t in strata:
        probs = expected[t] / expected[t].sum()
        obs, pooled_probs, pooled_mass, _ = pool_sparse(observed[t], probs, min_expected)
        if obs.size < 2:
            continue
        pooled_probs = pooled_probs / pooled_probs.sum()
        exp = obs.sum() * pooled_probs
        nonzero = obs > 0
        statistic += float(2.0 * (obs[nonzero] * np.log(obs[nonzero] / exp[nonzero])).sum())
        # one stratum: its own exact law where small; several: only their moments add up
        null = g_null(pooled_probs, int(round(float(obs.sum()))), exact=len(strata) == 1)
        nulls.append(null)
        mean, var = mean + null.mean, var + null.var
        df += obs.size - 1
        cells += obs.size
        pooled += pooled_mass * float(totals[t])
    num_samples = float(totals.sum())
    if df == 0:
        pvalue, described = 1.0, "no stratum with two cells: nothing to test"
    elif len(nulls) == 1:
        pvalue, described = nulls[0].sf(statistic), nulls[0].describe()
    else:
        pvalue = scaled_chi2_sf(statistic, mean, var)
        described = (f"scaled chi-square with the exact null mean {mean:.6g} and variance {var:.6g} summed over "
                     f"{len(nulls)} strata (nominal df {df})")
    return TestResult(name, statistic, pvalue, float(df), int(num_samples), cells, pooled / max(num_samples, 1.0),
                      detail="sum over draft tuples of G statistics vs the exact conditional law", null=described)


# ---------------------------------------------------------------------------------------------
# Weighted chi-square: Imhof's integral, with a saddlepoint approximation in the far tail
# ---------------------------------------------------------------------------------------------


def _imhof_sf(x: float, weights: np.ndarray) -> Optional[float]:
    """P(sum_j w_j Z_j^2 > x) by Imhof's (1961) inversion integral; None when quad does not converge.

    The integrand ``sin(a(u) - x u / 2) / (u rho(u))``, ``a(u) = sum_j arctan(w_j u) / 2``,
    oscillates and, with few weights, decays slowly.  Past a few periods it is split as
    ``sin(a) cos(x u / 2) - cos(a) sin(x u / 2)`` over smooth, monotone amplitudes, and those
    Fourier integrals go to QUADPACK's QAWF, built for them.  Absolute error ~1e-11.
    """

    def phase(u: float) -> float:
        return 0.5 * float(np.arctan(weights * u).sum())

    def amplitude(u: float) -> float:  # 1 / (u rho(u)), in log space: rho overflows far out
        return math.exp(-math.log(u) - 0.25 * float(np.log1p((weights * u) ** 2).sum()))

    split = 8.0 * math.pi / x
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", integrate.IntegrationWarning)
        # [0, split] in pieces at 1/w_max, 10/w_max, ...: the integrand lives on the scale 1/w_max
        # while a small x makes `split` huge.
        edges = [0.0]
        edge = 1.0 / float(weights.max())
        while edge < split:
            edges.append(edge)
            edge *= 10.0
        edges.append(split)
        head = sum(integrate.quad(lambda u: math.sin(phase(u) - 0.5 * x * u) * amplitude(u), a, b,
                                  limit=200, epsabs=1e-13)[0] for a, b in zip(edges, edges[1:]))
        tail_cos, _ = integrate.quad(lambda u: math.sin(phase(u)) * amplitude(u), split, np.inf,
                                     weight="cos", wvar=0.5 * x, limlst=100)
        tail_sin, _ = integrate.quad(lambda u: math.cos(phase(u)) * amplitude(u), split, np.inf,
                                     weight="sin", wvar=0.5 * x, limlst=100)
    if any(issubclass(w.category, integrate.IntegrationWarning) for w in caught):
        return None
    return 0.5 + (head + tail_cos - tail_sin) / math.pi


def _saddlepoint_sf(x: float, weights: np.ndarray) -> float:
    """Lugannani-Rice saddlepoint approximation of P(sum_j w_j Z_j^2 > x) (Kuonen 1999)."""
    mean = weights.sum()
    k2 = 2.0 * (weights**2).sum()
    k3 = 8.0 * (weights**3).sum()
    if abs(x - mean) <= 1e-6 * math.sqrt(k2):
        return 0.5 - k3 / (6.0 * math.sqrt(2.0 * math.pi) * k2**1.5)

    def cgf_prime(s):
        return (weights / (1.0 - 2.0 * weights * s)).sum() - x

    if x > mean:
        bracket = (0.0, 0.5 / weights.max() * (1 - 1e-15))
    else:  # K'(s) <= k / (-2 s) for s < 0, so K'(-k / 2x) <= x
        bracket = (-weights.size / (2.0 * x), 0.0)
    s_hat = optimize.brentq(cgf_prime, *bracket, xtol=1e-300, rtol=4 * np.finfo(float).eps, maxiter=1000)
    cgf = -0.5 * np.log1p(-2.0 * weights * s_hat).sum()
    cgf_second = (2.0 * weights**2 / (1.0 - 2.0 * weights * s_hat) ** 2).sum()
    w = math.copysign(math.sqrt(max(2.0 * (s_hat * x - cgf), 0.0)), s_hat)
    u = s_hat * math.sqrt(cgf_second)
    if abs(w) < 1e-6 or u == 0:
        return 0.5 - k3 / (6.0 * math.sqrt(2.0 * math.pi) * k2**1.5)
    return float(min(1.0, max(0.0, stats.norm.sf(w) + stats.norm.pdf(w) * (1.0 / u - 1.0 / w))))


def weighted_chi2_sf(
    x: float,
    weights,  # [num_weights], non-negative
) -> float:
    """``P(sum_j weights_j Z_j^2 > x)`` for i.i.d. standard normal Z_j and weights >= 0.

    Equal weights: the scaled chi-square, exactly.  Otherwise Imhof's integral (absolute
    error ~1e-11) where it gives more than 1e-7; further out, where only relative accuracy
    matters, the Lugannani-Rice saddlepoint approximation (relative error of a few percent at
    most; Kuonen, Biometrika 1999).

    Examples
    --------
    >>> round(weighted_chi2_sf(3.841458820694124, [1.0]), 6)   # chi-square(1) at its 95% point
    0.05
    >>> round(weighted_chi2_sf(6.0, [1.0, 0.5, 0.25]), 4)   # Monte Carlo (4e6 draws): 0.0265
    0.0265
    """
    weights = _as_numpy(weights, "weights")
    if (weights < 0).any() or not np.isfinite(weights).all():
        raise InvalidArgument(f"weights: expected finite non-negative weights, got {weights.tolist()}")
    weights = weights[weights > 1e-12 * max(weights.max(initial=0.0), 1e-300)]
    if weights.size == 0:
        return 1.0 if x <= 0 else 0.0
    if x <= 0:
        return 1.0
    if np.allclose(weights, weights[0], rtol=1e-12):
        return float(stats.chi2.sf(x / weights[0], weights.size))
    bulk = _imhof_sf(x, weights)
    if bulk is not None and 1e-7 < bulk:
        return float(min(bulk, 1.0))
    return _saddlepoint_sf(x, weights)


def stratified_pearson_test(
    counts: torch.Tensor,  # [num_strata, num_cells] samples of each stratum in each cell
    strata_probs: torch.Tensor,  # [num_strata] exact probability of each stratum (draft tuple)
    cell_probs: torch.Tensor,  # [num_cells] exact target probability of each cell
    min_expected: float = MIN_EXPECTED,
    max_cells: int = 2048,
) -> TestResult:
    """Stratified test that ``sum_t P(t) f_t = q`` from per-stratum samples.

    Parameters
    ----------
    counts : torch.Tensor
        ``[num_strata, num_cells]``: how many samples of stratum t fell in cell c.  Every
        stratum needs at least 2 samples.
    strata_probs : torch.Tensor
        ``[num_strata]``: the exact probability P(t) of each stratum (draft tuple).
    cell_probs : torch.Tensor
        ``[num_cells]``: the exact target probability q of each cell.
    min_expected : float
        Cells with ``n q_c < min_expected`` are pooled.
    max_cells : int
        Cap on the pooled cell count (the null distribution needs an eigen-decomposition).

    Returns
    -------
    TestResult
        ``statistic = n sum_c (F_hat_c - q_c)^2 / q_c`` with ``F_hat = sum_t P(t) counts_t / n_t``;
        ``df`` is the effective df of the weighted chi-square null.

    Notes
    -----
    Under exactness, ``F_hat - q`` is asymptotically normal with covariance
    ``Sigma = sum_t P(t)^2 / n_t Cov_t`` where ``Cov_t = diag(f_t) - f_t f_t^T`` is the
    within-stratum multinomial covariance; the draft-sampling term of an unstratified sample
    (the spread of ``f_t`` between tuples) is absent.  The statistic is then
    ``sum_j lambda_j Z_j^2`` with ``lambda`` the eigenvalues of ``n Q^-1/2 Sigma Q^-1/2``
    (Rao-Scott), estimated with the unbiased ``n_t / (n_t - 1)`` factor, and the p-value is
    computed exactly for those weights (:func:`weighted_chi2_sf`).  Asymptotic in the
    per-stratum counts: the audit runs it only when strata average at least 32 samples.
    """
    counts = counts.detach().cpu().double()
    strata_probs = strata_probs.detach().cpu().double()
    cell_probs = cell_probs.detach().cpu().double()
    per_stratum = counts.sum(1)
    if bool((per_stratum < 2).any()):
        raise InvalidArgument("counts: every stratum needs at least 2 samples")
    num_samples = float(per_stratum.sum())
    _, _, pooled_mass, mapping = pool_sparse(counts.sum(0), cell_probs, min_expected)
    mapping = torch.as_tensor(mapping)
    keep = mapping >= 0
    size = int(mapping.max()) + 1
    if size > max_cells:
        raise InvalidArgument(f"max_cells: the pooled partition has {size} cells, more than {max_cells}")
    pooled = torch.zeros(counts.shape[0], size, dtype=torch.float64).index_add_(1, mapping[keep], counts[:, keep])
    probs = torch.zeros(size, dtype=torch.float64).index_add_(0, mapping[keep], cell_probs[keep])
    probs = probs / probs.sum()
    freq = pooled / per_stratum.unsqueeze(1)  # f_t, [num_strata, size]
    estimate = (strata_probs.unsqueeze(1) * freq).sum(0)
    deviation = estimate - probs
    statistic = float(num_samples * (deviation**2 / probs).sum())
    # n Q^-1/2 Sigma Q^-1/2 = diag(a) - G^T G with unbiased within-stratum covariances.
    stratum_weight = num_samples * strata_probs**2 / (per_stratum - 1)  # [num_strata]
    scaled = freq / probs.sqrt()
    diag = (stratum_weight.unsqueeze(1) * freq).sum(0) / probs
    gram = stratum_weight.sqrt().unsqueeze(1) * scaled
    matrix = torch.diag(diag) - gram.T @ gram
    eigenvalues = torch.linalg.eigvalsh(matrix).clamp(min=0).numpy()
    trace, trace_sq = eigenvalues.sum(), (eigenvalues**2).sum()
    df = float(trace**2 / trace_sq) if trace_sq > 0 else 0.0
    pvalue = weighted_chi2_sf(statistic, eigenvalues)
    return TestResult("stratified-pearson", statistic, pvalue, df, int(num_samples), size, float(pooled_mass),
                      detail="Pearson distance of the per-draft-tuple stratified estimate vs the target law "
                             "(weighted chi-square null from within-tuple covariances)")


def conditional_pearson_test(
    observed: torch.Tensor,  # [num_strata, num_cells] counts
    expected: torch.Tensor,  # [num_strata, num_cells] expected counts from the exact conditional law
    min_expected: float = MIN_EXPECTED,
    name: str = "conditional-pearson",
) -> TestResult:
    """Sum over strata of Pearson statistics against known per-stratum expected counts.

    Within a stratum the samples are i.i.d. from a known law (one draft tuple, a sampler
    against its own ``output_probs``), so each stratum's Pearson statistic is chi-square with
    ``cells - 1`` df after pooling its sparse cells, and the strata are independent: the sum is
    chi-square with the summed df.  A stratum with a single cell after pooling contributes
    nothing.  With a single stratum that is the plain Pearson test.
    """
    observed = observed.detach().cpu().double()
    expected = expected.detach().cpu().double()
    statistic, df, cells, pooled = 0.0, 0, 0, 0.0
    totals = observed.sum(1)
    for t in torch.nonzero(totals > 0).squeeze(1).tolist():
        probs = expected[t] / expected[t].sum()
        obs, pooled_probs, pooled_mass, _ = pool_sparse(observed[t], probs, min_expected)
        if obs.size < 2:
            continue
        exp = obs.sum() * pooled_probs / pooled_probs.sum()
        statistic += float(((obs - exp) ** 2 / exp).sum())
        df += obs.size - 1
        cells += obs.size
        pooled += pooled_mass * float(totals[t])
    num_samples = float(totals.sum())
    return _chi2_result(name, statistic, df, num_samples, cells, pooled / max(num_samples, 1.0),
                        "sum over draft tuples of Pearson statistics vs the exact conditional law")


def independent_sum_test(
    observed: torch.Tensor,  # [num_cells] counts
    expected: torch.Tensor,  # [num_cells] sum over samples of their cell laws
    second_moment: torch.Tensor,  # [num_cells, num_cells] sum over samples of law law^T
    min_expected: float = MIN_EXPECTED,
    name: str = "aggregated-pearson",
) -> TestResult:
    """Pearson's statistic for counts that are a sum of independent, non-identical categoricals.

    Sample r falls in cell c with known probability ``l_r(c)`` (a sampler against its own law,
    given its drafts).  The counts have mean ``E = sum_r l_r`` and covariance
    ``diag(E) - sum_r l_r l_r^T``, at most the multinomial one; the statistic
    ``sum_c (O_c - E_c)^2 / E_c`` is then asymptotically ``sum_j lambda_j Z_j^2`` with ``lambda``
    the eigenvalues of ``E^-1/2 Cov E^-1/2``, and the p-value comes from
    :func:`weighted_chi2_sf`.  Sparse cells are pooled as in :func:`pool_sparse`.
    """
    observed = observed.detach().cpu().double()
    expected = expected.detach().cpu().double()
    second_moment = second_moment.detach().cpu().double()
    num_samples = float(observed.sum())
    _, _, pooled_mass, mapping = pool_sparse(observed, expected / max(num_samples, 1.0), min_expected)
    mapping = torch.as_tensor(mapping)
    keep = mapping >= 0
    size = int(mapping.max()) + 1 if bool(keep.any()) else 0
    if size < 2:
        return TestResult(name, 0.0, 1.0, 0.0, int(num_samples), size, pooled_mass)
    project = torch.zeros(observed.numel(), size, dtype=torch.float64)
    project[keep.nonzero().squeeze(1), mapping[keep]] = 1.0
    obs, exp = observed @ project, expected @ project
    moment = project.T @ second_moment @ project
    statistic = float(((obs - exp) ** 2 / exp).sum())
    scale = exp.rsqrt()
    matrix = (torch.diag(exp) - moment) * scale.unsqueeze(0) * scale.unsqueeze(1)
    eigenvalues = torch.linalg.eigvalsh(matrix).clamp(min=0).numpy()
    trace, trace_sq = eigenvalues.sum(), (eigenvalues**2).sum()
    df = float(trace**2 / trace_sq) if trace_sq > 0 else 0.0
    return TestResult(name, statistic, weighted_chi2_sf(statistic, eigenvalues), df, int(num_samples), size,
                      float(pooled_mass),
                      detail="Pearson statistic of counts vs the summed exact laws, null from their exact covariance")


# ---------------------------------------------------------------------------------------------
# Rates: exact one-sided binomial tests
# ---------------------------------------------------------------------------------------------


def binomial_above(successes: int, num_samples: int, bound: float, name: str, detail: str = "") -> TestResult:
    """Exact test of H0: rate <= ``bound``; small p-values mean the rate is significantly above it.

    Examples
    --------
    >>> binomial_above(60, 100, 0.5, "demo").pvalue < 0.05
    True
    """
    if num_samples <= 0:
        return TestResult(name, float(successes), 1.0, None, 0, detail=detail)
    pvalue = 0.0 if bound <= 0 and successes > 0 else (
        1.0 if bound >= 1 else float(stats.binomtest(int(successes), int(num_samples), bound, alternative="greater").pvalue))
    return TestResult(name, float(successes), pvalue, None, int(num_samples), detail=detail)


def binomial_below(successes: int, num_samples: int, claim: float, name: str, detail: str = "") -> TestResult:
    """Exact test of H0: rate >= ``claim``; small p-values mean the rate falls short of the claim."""
    if num_samples <= 0:
        return TestResult(name, float(successes), 1.0, None, 0, detail=detail)
    pvalue = 0.0 if claim >= 1 and successes < num_samples else (
        1.0 if claim <= 0 else float(stats.binomtest(int(successes), int(num_samples), claim, alternative="less").pvalue))
    return TestResult(name, float(successes), pvalue, None, int(num_samples), detail=detail)


def mean_above(total: float, total_sq: float, num_samples: int, bound: float, name: str, detail: str = "") -> TestResult:
    """One-sided z-test (CLT, sample variance) of H0: mean <= ``bound`` for a bounded variable."""
    if num_samples < 2:
        return TestResult(name, math.nan, 1.0, None, int(num_samples), detail=detail)
    mean = total / num_samples
    var = max(total_sq / num_samples - mean * mean, 0.0) * num_samples / (num_samples - 1)
    se = math.sqrt(var / num_samples)
    if se == 0:
        pvalue = 0.0 if mean > bound else 1.0
        return TestResult(name, math.inf if mean > bound else 0.0, pvalue, None, int(num_samples), detail=detail)
    z = (mean - bound) / se
    return TestResult(name, z, float(stats.norm.sf(z)), None, int(num_samples), detail=detail)


def mean_below(total: float, total_sq: float, num_samples: int, claim: float, name: str, detail: str = "") -> TestResult:
    """One-sided z-test (CLT, sample variance) of H0: mean >= ``claim``."""
    flipped = mean_above(-total, total_sq, num_samples, -claim, name, detail)
    return flipped


# ---------------------------------------------------------------------------------------------
# Anytime-valid sequential test
# ---------------------------------------------------------------------------------------------


class PlugInEProcess:
    """A likelihood-ratio e-process against the exact cell law, for early stopping.

    After each chunk of counts, ``log E += sum_c counts_c log(F_prev(c) / q(c))`` where
    ``F_prev = (counts before the chunk + a q) / (samples before + a)`` is fixed before the
    chunk is seen (predictable), with ``a`` prior pseudo-samples.  Under the null (samples
    i.i.d. from q) E is a non-negative martingale with mean 1, so by Ville's inequality
    ``P(sup_t E_t >= 1 / alpha) <= alpha``: ``pvalue = min(1, 1 / max_t E_t)`` is valid at any
    stopping time.  Against a fixed alternative F, ``log E`` grows like ``n KL(F || q)``.

    Parameters
    ----------
    cell_probs : torch.Tensor
        ``[num_cells]`` exact cell probabilities; cells of probability 0 are ignored here
        (an observation there is a support violation, tested separately).
    prior_samples : float, optional
        ``a``; defaults to the number of cells.
    """

    def __init__(self, cell_probs: torch.Tensor, prior_samples: Optional[float] = None):
        self.cell_probs = cell_probs.detach().cpu().double()
        self.positive = self.cell_probs > 0
        self.prior = float(prior_samples if prior_samples is not None else max(int(self.positive.sum()), 1))
        self.counts = torch.zeros_like(self.cell_probs)
        self.num_samples = 0.0
        self.log_e = 0.0
        self.max_log_e = 0.0

    def update(self, chunk_counts: torch.Tensor) -> float:
        """Add one chunk of counts ``[num_cells]``; return the current ``log E``."""
        chunk_counts = chunk_counts.detach().cpu().double()
        plug_in = (self.counts + self.prior * self.cell_probs) / (self.num_samples + self.prior)
        positive = self.positive
        ratio = torch.log(plug_in[positive]) - torch.log(self.cell_probs[positive])
        self.log_e += float((chunk_counts[positive] * ratio).sum())
        self.max_log_e = max(self.max_log_e, self.log_e)
        self.counts += chunk_counts
        self.num_samples += float(chunk_counts[positive].sum())
        return self.log_e

    @property
    def pvalue(self) -> float:
        """Anytime-valid p-value ``min(1, 1 / max_t E_t)``."""
        return float(math.exp(-self.max_log_e)) if self.max_log_e > 0 else 1.0

    def result(self) -> TestResult:
        """The e-process as a sub-test result."""
        return TestResult("e-process", self.max_log_e, self.pvalue, None, int(self.num_samples),
                          int(self.positive.sum()),
                          detail="anytime-valid plug-in likelihood-ratio e-process (statistic: max log E)")


def holm(pvalues: Sequence[float]) -> list[float]:
    """Holm's step-down adjusted p-values: ``max_{j <= i} min(1, (m - j + 1) p_(j))`` in sorted order.

    Same values as statsmodels ``multipletests(method="holm")[1]`` (the tests use it as the
    oracle), without its per-call ``gc.collect()``, which costs a quarter second.

    Examples
    --------
    >>> holm([0.01, 0.04, 0.03])
    [0.03, 0.06, 0.06]
    """
    pvalues = [float(p) for p in pvalues]
    m = len(pvalues)
    order = sorted(range(m), key=lambda i: pvalues[i])
    adjusted = [0.0] * m
    running = 0.0
    for rank, index in enumerate(order):
        running = max(running, min(1.0, (m - rank) * pvalues[index]))
        adjusted[index] = running
    return adjusted
