"""The ``real-lm`` suite's verdicts: Holm within a result, t-intervals over independent rows, the
underpowered sampled test marked INCONCLUSIVE, and one audit's result with its table rows."""

from __future__ import annotations

import dataclasses
import math
from typing import Optional, Sequence

import numpy as np
from scipy import stats

from spectr_audit.lm.tables import BlockEfficiencyRow, FidelityRow
from spectr_audit.results import AuditResult, Check
from spectr_audit.statistical.gof import TestResult, holm


def _mean_ci(values: np.ndarray, level: float = 0.95) -> tuple[float, float, float]:
    """Mean and a t-interval over independent values (few rows: a normal interval would be too narrow)."""
    values = np.asarray(values, dtype=np.float64)
    mean = float(values.mean()) if values.size else math.nan
    if values.size < 2:
        return mean, math.nan, math.nan
    half = float(stats.t.ppf(0.5 + level / 2, values.size - 1) * values.std(ddof=1) / math.sqrt(values.size))
    return mean, mean - half, mean + half


def _holm_checks(tests: Sequence[TestResult], alpha: float) -> tuple[list[TestResult], tuple]:
    """The tests with their Holm-adjusted p-values, and one check per test at false-alarm rate ``alpha``."""
    adjusted = [dataclasses.replace(t, pvalue_adjusted=p) for t, p in zip(tests, holm([t.pvalue for t in tests]))]
    checks = []
    for t in adjusted:
        held = t.pvalue_adjusted >= alpha
        outcome = "not rejected" if held else "REJECTED"
        checks.append(Check(t.name, held, t.pvalue_adjusted, alpha,
                            f"{t.detail}: Holm-adjusted p-value {t.pvalue_adjusted:.3g} "
                            f"{'>=' if held else '<'} {alpha:g}, exactness {outcome}"))
    return adjusted, tuple(checks)


def _mark_underpowered(checks: tuple, sampled: TestResult, planned: float) -> tuple:
    """The checks, the sampled test's marked INCONCLUSIVE when nothing failed and it detects only TVs above ``planned``."""
    detectable = sampled.min_detectable_tv
    if any(not c.passed for c in checks) or detectable is None or not detectable > planned:
        return checks
    note = (f"; minimum detectable TV {detectable:.3g}, above the {planned:g} planned: INCONCLUSIVE "
            "(nothing rejected, too few samples to show exactness at the planned power)")
    return tuple(dataclasses.replace(c, inconclusive=True, detail=c.detail + note) if c.name == sampled.name else c
                 for c in checks)


def _verdict_metrics(tests: Sequence[TestResult], sampled: TestResult, alpha: float) -> dict:
    """The runner's names for a result's statistical summary (``pvalue``, ``min_detectable_tv``, ...)."""
    return {"pvalue": min(t.pvalue_adjusted for t in tests), "alpha": alpha, "test": sampled.name,
            "min_detectable_tv": sampled.min_detectable_tv, "test_alpha": alpha / len(tests)}


@dataclasses.dataclass(frozen=True)
class _Audit:
    """One (verifier, K, L) of the grid: its result (None when it is measured, not judged) and table rows."""

    result: Optional[AuditResult]
    fidelity: FidelityRow
    acceptance: tuple = (math.nan, math.nan, math.nan)  # (mean, 95% half-width, alpha* on its contexts)
    block: Optional[BlockEfficiencyRow] = None
