"""Result objects of the statistical audit and of the sampler-vs-law check.

Frozen dataclasses that report numbers; follow-ups (confidence intervals, a verdict at a
given alpha) are methods.  Only the caller decides pass or fail.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Optional

import torch
from scipy import stats

from spectr_audit.errors import InvalidArgument

__all__ = ["DepthResult", "FamilyResult", "LawAgreementResult", "StatisticalAuditResult", "WorstCell", "worst_cells"]


@dataclasses.dataclass(frozen=True)
class WorstCell:
    """A cell whose count is far from the target law: ``(observed - expected) / sqrt(expected)``."""

    cell: str
    observed: float
    expected: float
    residual: float

    def to_dict(self) -> dict:
        """Plain JSON values."""
        return dataclasses.asdict(self)


@dataclasses.dataclass(frozen=True)
class DepthResult:
    """What a statistical audit measured at one prefix depth: the law of the first ``depth`` tokens.

    Attributes
    ----------
    depth : int
        d; the deepest is N, the audited partition itself.
    test : str
        The depth's G-test in the family (``"g-test@d"``, ``"g-test"`` at depth N).
    num_cells : int
        Cells after pooling.
    pvalue, pvalue_adjusted : float
        The G-test's p-value, and Holm-adjusted within the family.
    min_detectable_tv : float
        Smallest TV of the first ``depth`` tokens' law (on the depth's cells) detected with the
        audit's power at the samples run.
    tv_plug_in, tv_noise_floor : float
        The plug-in TV on the depth's cells, and about what it averages for an exact verifier.
    tv_lower, tv_upper : float
        The depth's anytime-valid interval.
    """

    depth: int
    test: str
    num_cells: int
    pvalue: float
    pvalue_adjusted: Optional[float]
    min_detectable_tv: float
    tv_plug_in: float
    tv_noise_floor: float
    tv_lower: float
    tv_upper: float

    def to_dict(self) -> dict:
        """Plain JSON values."""
        return {k: _finite(v) if isinstance(v, float) else v for k, v in dataclasses.asdict(self).items()}


@dataclasses.dataclass(frozen=True)
class FamilyResult:
    """A null hypothesis tested by a Holm family of sub-tests.  Numbers only: the caller decides.

    The base of :class:`StatisticalAuditResult` (the null: the verifier is exact) and
    :class:`LawAgreementResult` (the null: the sampler follows its own exact law).

    Attributes
    ----------
    verifier : str
    test : str
        The sub-test that decides: the support check when violated, else the one with the
        smallest Holm-adjusted p-value.
    statistic : float
        That sub-test's statistic.
    pvalue : float
        Familywise p-value of the null (Holm over ``subtests``; 0 on a support violation).
    alpha : float
        The false-alarm rate the sample size was planned for.
    num_samples : int
        Samples run in total.
    seed : int
    min_detectable_tv : float
        Smallest TV the planned test detects with probability ``power`` at the samples run.
    power : float
        The planned power.
    subtests : tuple of TestResult
        The family, with Holm-adjusted p-values, then the support check.
    worst_cells : tuple of WorstCell
    seconds : float
        Wall time of the sampling.
    """

    verifier: str
    test: str
    statistic: float
    pvalue: float
    alpha: float
    num_samples: int
    seed: int
    min_detectable_tv: float
    power: float
    subtests: tuple
    worst_cells: tuple
    seconds: float

    def rejects(self, alpha: Optional[float] = None) -> bool:
        """Whether the null is rejected at ``alpha`` (default: the planned ``alpha``)."""
        return self.pvalue <= (self.alpha if alpha is None else alpha)


@dataclasses.dataclass(frozen=True)
class StatisticalAuditResult(FamilyResult):
    """What a statistical audit measured.  Numbers only: the caller decides.

    Attributes
    ----------
    verifier : str
    test : str
        The sub-test with the smallest Holm-adjusted p-value (the one that decides).
    statistic : float
        That sub-test's statistic.
    pvalue : float
        Familywise p-value of "the verifier is exact" (Holm over ``subtests``; 0 on a support
        violation).
    alpha : float
        The false-alarm rate the sample size was planned for.
    num_samples : int
        Verifications run (one sample serves every sub-test).
    seed : int
    min_detectable_tv : float
        Smallest TV (on the audited partition) that its G-test detects with probability
        ``power`` at the samples actually run, at level ``alpha / num_tests`` (``depths`` has
        it for every depth).
    power : float
        The planned power.
    requested_tv : float
        The ``min_detectable_tv`` asked for.
    power_at_requested_tv : float
        Power at ``requested_tv`` with the samples actually run (below ``power`` when a budget
        cut the sample short).
    num_tests : int
        Sub-tests in the Holm family.
    num_tokens : int
        N, the length of the completed strings.
    num_cells : int
        Cells of the partition before pooling; ``pooled_mass`` is the target mass pooled.
    pooled_mass : float
    full_partition : bool
        Whether every string of V^N was its own cell.
    subtests : tuple of TestResult
        The exactness family, with Holm-adjusted p-values.
    optimality : tuple of TestResult
        Acceptance / block efficiency below a claimed value (Holm within this family).
    acceptance_count, acceptance_samples : int
        Samples whose first emitted token is among the drafts' first tokens, out of how many.
    optimal_acceptance : float or None
        alpha* for the drafting scheme at the first position (None when unknown).
    claimed_acceptance : float or None
    length_sum, length_sq_sum : float
        Sum and sum of squares of emitted lengths (block efficiency = mean length).
    block_efficiency_bound : float or None
    worst_cells : tuple of WorstCell
    stop_reason : str
        ``"planned"``, ``"e-process"``, ``"support"``, ``"max_samples"``, ``"max_seconds"``, or,
        when certifying, ``"certified"`` or ``"refuted"``.
    seconds : float
        Wall time of the sampling.
    tv_estimate : float
        The held-out excess: an unbiased estimate of ``F(A) - q(A) <= TV_P(F, q)`` for a set A of
        cells chosen on the other half of the sample (zero in expectation for an exact verifier,
        whatever the number of cells; :class:`~spectr_audit.statistical.depths.TVBounds`), held
        within ``[tv_lower, tv_upper]``.  F is the emitted law completed to N tokens, q the
        target, both on the audited partition P.
    tv_lower, tv_upper : float
        Confidence bounds on ``TV_P(F, q)`` at level ``tv_confidence`` (``1 - alpha``), valid at
        the audit's stopping time.  ``tv_lower`` is the headline: the verifier's law is at least
        this far from the target's.
    tv_plug_in : float
        The plug-in ``TV(F_hat, q)`` on P: biased up by sampling noise, by about ``tv_noise_floor``
        for an exact verifier (large on partitions of many sparse cells).
    tv_noise_floor : float
        About what ``tv_plug_in`` averages for an exact verifier, ``sum_c sqrt(q_c (1 - q_c) / (2 pi n))``.
    tv_confidence : float
    partition : str
        The partition the counts, the tests and the interval are on, in words.
    planned_samples : int
        Samples of the main design planned before any budget.
    certify_tv : float or None
        The tolerance asked to be certified (None: no certification).
    certification : str or None
        ``"certified"`` (``tv_upper <= certify_tv``), ``"refuted"`` (``tv_lower > certify_tv``)
        or ``"uncertified"`` (the budget ran out first); None without ``certify_tv``.
    num_processes : int
        Processes the sampling was spread over (the counts do not depend on it).
    counts_digest : str
        SHA-256 of the cell counts (and the stratified counts): runs with equal digests counted the same.
    depths : tuple of DepthResult
        Every depth tested, shallowest first; the last is the partition itself.
    num_strata : int
        Draft-tuple strata the main sample was post-stratified by (0: no stratified test).
    """

    requested_tv: float
    power_at_requested_tv: float
    num_tests: int
    num_tokens: int
    num_cells: int
    pooled_mass: float
    full_partition: bool
    optimality: tuple
    acceptance_count: int
    acceptance_samples: int
    optimal_acceptance: Optional[float]
    claimed_acceptance: Optional[float]
    length_sum: float
    length_sq_sum: float
    block_efficiency_bound: Optional[float]
    stop_reason: str
    tv_estimate: float = math.nan
    tv_lower: float = 0.0
    tv_upper: float = 1.0
    tv_plug_in: float = math.nan
    tv_noise_floor: float = math.nan
    tv_confidence: float = math.nan
    partition: str = ""
    planned_samples: int = 0
    certify_tv: Optional[float] = None
    certification: Optional[str] = None
    num_processes: int = 1
    counts_digest: str = ""
    depths: tuple = ()
    num_strata: int = 0

    @property
    def underpowered(self) -> bool:
        """Whether the achieved minimum detectable TV is above the one asked for (a budget, a fixed sample)."""
        # relative slack: the plan and the test pool the same cells, up to float rounding
        return not self.min_detectable_tv <= self.requested_tv * (1 + 1e-9)

    @property
    def inconclusive(self) -> bool:
        """Nothing rejected, but the audit lacked the power it was asked for (or, certifying, the certificate).

        Certifying, a result is conclusive when certified or refuted; otherwise when it rejects
        or reached the planned minimum detectable TV.
        """
        if self.rejects() or self.certification == "refuted":
            return False
        if self.certify_tv is not None:
            return self.certification != "certified"
        return self.underpowered

    @property
    def verdict(self) -> str:
        """``"FINDING"`` (exactness rejected, or TV above the tolerance shown), ``"CERTIFIED"``,
        ``"INCONCLUSIVE"`` or ``"exact"`` (not rejected, at the planned power)."""
        if self.rejects() or self.certification == "refuted":
            return "FINDING"
        if self.certification == "certified":
            return "CERTIFIED"
        return "INCONCLUSIVE" if self.inconclusive else "exact"

    @property
    def tv_interval(self) -> tuple[float, float]:
        """``(tv_lower, tv_upper)``."""
        return (self.tv_lower, self.tv_upper)

    @property
    def stopped_early(self) -> bool:
        """Whether the e-process or a support violation ended the audit before the planned size."""
        return self.stop_reason in ("e-process", "support", "certified", "refuted")

    @property
    def acceptance(self) -> float:
        """Membership acceptance measured from emitted strings (NaN when not measured)."""
        return self.acceptance_count / self.acceptance_samples if self.acceptance_samples else math.nan

    @property
    def block_efficiency(self) -> float:
        """Mean emitted length (NaN when not measured)."""
        return self.length_sum / self.acceptance_samples if self.acceptance_samples else math.nan

    @property
    def verifications_per_second(self) -> float:
        """Throughput of the sampling loop."""
        return self.num_samples / self.seconds if self.seconds > 0 else math.inf

    @property
    def optimality_pvalue(self) -> float:
        """Smallest Holm-adjusted p-value of the optimality family (1 when empty)."""
        return min((t.pvalue_adjusted for t in self.optimality), default=1.0)

    def acceptance_ci(self, confidence: float = 0.95, method: str = "clopper-pearson") -> tuple[float, float]:
        """Two-sided interval for the acceptance: ``"clopper-pearson"`` (exact) or ``"wilson"``."""
        return _proportion_ci(self.acceptance_count, self.acceptance_samples, confidence, method)

    def block_efficiency_ci(self, confidence: float = 0.95) -> tuple[float, float]:
        """Two-sided normal interval for the block efficiency (sample variance; n is large)."""
        return _mean_ci(self.length_sum, self.length_sq_sum, self.acceptance_samples, confidence)

    def to_dict(self) -> dict:
        """The JSON contract: ``pvalue``, ``test``, ``num_samples``, ``seed``, ``min_detectable_tv``, ..."""
        out = {
            "verifier": self.verifier,
            "test": self.test,
            "statistic": _finite(self.statistic),
            "pvalue": self.pvalue,
            "alpha": self.alpha,
            "rejects": self.rejects(),
            "num_samples": self.num_samples,
            "seed": self.seed,
            "min_detectable_tv": _finite(self.min_detectable_tv),
            "power": self.power,
            "requested_tv": self.requested_tv,
            "power_at_requested_tv": self.power_at_requested_tv,
            "num_tests": self.num_tests,
            "num_tokens": self.num_tokens,
            "num_cells": self.num_cells,
            "pooled_mass": self.pooled_mass,
            "full_partition": self.full_partition,
            "stop_reason": self.stop_reason,
            "verdict": self.verdict,
            "inconclusive": self.inconclusive,
            "tv_estimate": _finite(self.tv_estimate),
            "tv_interval": [self.tv_lower, self.tv_upper],
            "tv_plug_in": _finite(self.tv_plug_in),
            "tv_noise_floor": _finite(self.tv_noise_floor),
            "tv_confidence": _finite(self.tv_confidence),
            "partition": self.partition,
            "planned_samples": self.planned_samples,
            "certify_tv": self.certify_tv,
            "certification": self.certification,
            "num_processes": self.num_processes,
            "counts_digest": self.counts_digest,
            "seconds": self.seconds,
            "verifications_per_second": _finite(self.verifications_per_second),
            "subtests": [t.to_dict() for t in self.subtests],
            "optimality": [t.to_dict() for t in self.optimality],
            "worst_cells": [c.to_dict() for c in self.worst_cells],
            "depths": [d.to_dict() for d in self.depths],
            "num_strata": self.num_strata,
        }
        if self.acceptance_samples:
            out.update(
                acceptance=self.acceptance,
                acceptance_ci=list(self.acceptance_ci()),
                optimal_acceptance=self.optimal_acceptance,
                claimed_acceptance=self.claimed_acceptance,
                block_efficiency=self.block_efficiency,
                block_efficiency_ci=[_finite(x) for x in self.block_efficiency_ci()],
                block_efficiency_bound=self.block_efficiency_bound,
            )
        return out


@dataclasses.dataclass(frozen=True)
class LawAgreementResult(FamilyResult):
    """A sampler checked against its own exact law (:func:`sampler_law_agreement`).

    Attributes
    ----------
    verifier, test : str
    statistic, pvalue : float
        Of the deciding sub-test; ``pvalue`` is the Holm familywise p-value (0 when the sampler
        emitted a string its own law gives probability 0).
    alpha : float
    num_samples, seed : int
    min_detectable_tv : float
        Smallest TV between the sampler's and the formula's (draft-averaged) output law over
        (draft index, accepted count, next token) detected with ``power``.
    power : float
    num_strata : int
        Draft tuples seen (0 when the per-tuple test did not run).
    subtests : tuple of TestResult
    worst_cells : tuple of WorstCell
    seconds : float
    """

    num_strata: int

    def to_dict(self) -> dict:
        """Plain JSON values."""
        return {
            "verifier": self.verifier, "test": self.test, "statistic": _finite(self.statistic), "pvalue": self.pvalue,
            "alpha": self.alpha, "rejects": self.rejects(), "num_samples": self.num_samples, "seed": self.seed,
            "min_detectable_tv": _finite(self.min_detectable_tv), "power": self.power, "num_strata": self.num_strata,
            "subtests": [t.to_dict() for t in self.subtests], "worst_cells": [c.to_dict() for c in self.worst_cells],
            "seconds": self.seconds,
        }


# ---------------------------------------------------------------------------------------------
# Helpers
# ---------------------------------------------------------------------------------------------


def _finite(value):
    return value if value is None or math.isfinite(value) else None


def _proportion_ci(count: int, nobs: int, confidence: float, method: str) -> tuple[float, float]:
    from statsmodels.stats.proportion import proportion_confint

    methods = {"clopper-pearson": "beta", "wilson": "wilson"}
    if method not in methods:
        raise InvalidArgument(f"method: expected 'clopper-pearson' or 'wilson', got {method!r}")
    if not 0 < confidence < 1:
        raise InvalidArgument(f"confidence: expected a number in (0, 1), got {confidence!r}")
    if nobs == 0:
        return (math.nan, math.nan)
    low, high = proportion_confint(count, nobs, alpha=1 - confidence, method=methods[method])
    return float(low), float(high)


def _mean_ci(total: float, total_sq: float, nobs: int, confidence: float) -> tuple[float, float]:
    if not 0 < confidence < 1:
        raise InvalidArgument(f"confidence: expected a number in (0, 1), got {confidence!r}")
    if nobs < 2:
        return (math.nan, math.nan)
    mean = total / nobs
    var = max(total_sq / nobs - mean * mean, 0.0) * nobs / (nobs - 1)
    half = stats.norm.isf((1 - confidence) / 2) * math.sqrt(var / nobs)
    return float(mean - half), float(mean + half)


def worst_cells(observed: torch.Tensor, expected: torch.Tensor, describe, count: int = 5) -> tuple:
    """Cells with the largest standardised residuals (cells of expected count >= 1, or impossible ones)."""
    observed = observed.double()
    expected = expected.double()
    impossible = (expected == 0) & (observed > 0)
    residual = torch.where(expected >= 1, (observed - expected) / expected.clamp(min=1e-300).sqrt(),
                           torch.zeros_like(expected))
    residual = torch.where(impossible, torch.full_like(residual, math.inf), residual)
    order = torch.argsort(residual.abs(), descending=True)[:count]
    return tuple(
        WorstCell(describe(int(c)), float(observed[c]), float(expected[c]), float(residual[c]))
        for c in order.tolist()
        if residual[c] != 0
    )
