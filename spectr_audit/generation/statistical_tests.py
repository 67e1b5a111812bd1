"""The generation audit's statistical tests, on per-token PIT values and surprisals (docs/generation.md).

Every function takes arrays of per-token statistics and returns a
:class:`~spectr_audit.statistical.gof.TestResult` or a number; :mod:`spectr_audit.generation.analysis`
composes them into one Holm family (planned by :mod:`spectr_audit.generation.family`).

* :func:`pit_test`: the PIT values of a stratum binned into equal bins, against the uniform law
  by the calibrated G-test (:func:`~spectr_audit.statistical.gof.g_test`).
* :func:`surprisal_test`: the surprisal martingale ``sum_t (-log q_t(y_t) - H_t)`` over the root of
  its summed conditional variances, two-sided normal.
* :func:`two_sample_test`: the binned PIT values of the engine against those of the reference
  generator (same scorer), Pearson's test of homogeneity on pooled bins.
* :func:`held_out_tv`: a lower confidence bound on the mean per-token TV along one order.
* :func:`agreement_test`: repeated requests that agree on their first token more often than
  independent draws from the scorer's law would.
* :class:`PITEProcess`: an anytime-valid e-process on binned PIT values, for stopping early.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Optional, Sequence

import numpy as np
import torch
from scipy import stats

from spectr_audit.statistical.gof import TestResult, g_test
from spectr_audit.statistical.power import noncentrality_for_power

__all__ = [
    "NUM_BINS",
    "HeldOutTV",
    "PITEProcess",
    "agreement_test",
    "bin_counts",
    "held_out_tv",
    "pit_test",
    "surprisal_test",
    "two_sample_test",
]

#: Equal bins of [0, 1] the PIT values are counted in.
NUM_BINS = 20


@functools.lru_cache(maxsize=1024)
def _noncentrality(num_cells: int, level: float, power: float) -> float:
    return noncentrality_for_power(num_cells, level, power)


def _min_detectable_tv(num_samples: int, num_cells: int, level: float, power: float) -> float:
    """:func:`~spectr_audit.statistical.power.min_detectable_tv`, its root-finding done once per level."""
    if num_samples <= 0:
        return math.inf
    return math.sqrt(_noncentrality(int(num_cells), float(level), float(power)) / num_samples) / 2.0


def bin_counts(pit: torch.Tensor, num_bins: int = NUM_BINS) -> np.ndarray:
    """``[num_bins]`` counts of PIT values in the equal bins of [0, 1]."""
    index = (pit.double().clamp(0.0, 1.0 - 1e-15) * num_bins).long()
    return torch.bincount(index, minlength=num_bins).double().numpy()


def pit_test(pit: torch.Tensor, name: str, *, level: float, power: float, num_bins: int = NUM_BINS) -> TestResult:
    """The binned PIT values of one stratum against uniform: a G-test (exact-moment or exact null).

    ``min_detectable_tv``: the smallest TV of the stratum's pooled PIT law (binned) that the test
    detects with ``power`` at ``level``.  Since the law of one token's PIT is as far from uniform
    as the token's law is from the target's, this bounds the *mean* per-token TV from below when
    the deviations of different positions land in the same bins.
    """
    counts = bin_counts(pit, num_bins)
    result = g_test(counts, np.full(num_bins, 1.0 / num_bins))
    mde = _min_detectable_tv(int(counts.sum()), num_bins, level, power)
    return dataclasses.replace(result, name=name, min_detectable_tv=mde,
                               detail=f"binned PIT ({num_bins} bins) vs uniform, G-test")


def surprisal_test(surprisal: torch.Tensor, entropy: torch.Tensor, variance: torch.Tensor, name: str) -> TestResult:
    """The surprisal martingale: ``Z = sum_t (-log q_t(y_t) - H_t) / sqrt(sum_t Var_t)``, two-sided normal.

    Under an exact engine each increment has conditional mean 0 and conditional variance
    ``Var_t`` whatever the loop did, so Z has a standard normal limit (the martingale CLT).  Z > 0:
    the engine emits less likely tokens than the target (too flat); Z < 0: too sharp.  Tokens of
    zero target mass are the support check's, not this test's (they are left out).
    """
    finite = torch.isfinite(surprisal)
    total_var = float(variance[finite].sum())
    if total_var <= 0:
        return TestResult(name, 0.0, 1.0, None, int(finite.sum()), detail="surprisal martingale: no variance")
    z = float((surprisal[finite] - entropy[finite]).sum()) / math.sqrt(total_var)
    return TestResult(name, z, float(2 * stats.norm.sf(abs(z))), None, int(finite.sum()),
                      detail="surprisal martingale sum(-log q - H) / sqrt(sum Var), two-sided normal",
                      null="standard normal (martingale central limit)")


#: The two-sample test pools adjacent bins until each cell of the smaller sample expects this many values.
TWO_SAMPLE_MIN_EXPECTED = 5.0


def _pool_columns(table: np.ndarray, min_expected: float) -> np.ndarray:
    """Merge adjacent columns of a ``[2, bins]`` table until each expects ``min_expected`` in its smaller row.

    The merging reads the column totals only (the margins, fixed under the conditional null of
    homogeneity), so the test stays a test of homogeneity at its level.
    """
    share = table.sum(1).min() / table.sum()
    columns, current = [], np.zeros(2)
    for j in range(table.shape[1]):
        current = current + table[:, j]
        if current.sum() * share >= min_expected:
            columns.append(current)
            current = np.zeros(2)
    if current.sum() > 0:
        if columns:
            columns[-1] = columns[-1] + current
        else:
            columns.append(current)
    return np.array(columns).T if columns else np.zeros((2, 0))


def two_sample_test(pit: torch.Tensor, reference_pit: torch.Tensor, name: str,
                    num_bins: int = NUM_BINS) -> TestResult:
    """The engine's binned PIT values against the reference generator's: Pearson's test of homogeneity.

    Both sets of PIT values come from the same scorer, so numerics the scorer shares with neither
    engine cancel: the test asks whether speculation changed the law, not whether the engine
    matches the scorer.  Adjacent bins are pooled until each cell of the smaller sample expects at
    least :data:`TWO_SAMPLE_MIN_EXPECTED` values, and the statistic is Pearson's against
    chi2(cells - 1): the G statistic against that law rejected identical laws at 2-4 times its level
    on 20 bins of 100 and 57 values (tests/generation/test_calibration.py), Pearson's on pooled
    cells holds it.
    """
    a, b = bin_counts(pit, num_bins), bin_counts(reference_pit, num_bins)
    table = np.stack([a, b])
    if (table.sum(1) == 0).any():
        return TestResult(name, 0.0, 1.0, 0.0, int(table.sum()), detail="two-sample PIT: too few tokens")
    table = _pool_columns(table, TWO_SAMPLE_MIN_EXPECTED)
    if table.shape[1] < 2:
        return TestResult(name, 0.0, 1.0, 0.0, int(table.sum()), detail="two-sample PIT: too few tokens")
    expected = table.sum(1, keepdims=True) * table.sum(0, keepdims=True) / table.sum()
    statistic = float(((table - expected) ** 2 / expected).sum())
    df = table.shape[1] - 1
    return TestResult(name, statistic, float(stats.chi2.sf(statistic, df)), float(df), int(table.sum()),
                      int(table.shape[1]), detail=f"engine vs reference binned PIT ({num_bins} bins, adjacent bins "
                                                  f"pooled to {TWO_SAMPLE_MIN_EXPECTED:g} expected), Pearson "
                                                  "test of homogeneity", null=f"chi2({df})")


@dataclasses.dataclass(frozen=True)
class HeldOutTV:
    """A lower confidence bound on the mean per-token TV along one order.

    Attributes
    ----------
    ordering : str
    estimate : float
        The held-out excess: on each half of the continuations, the other half's over-represented
        PIT bins A; the mean over all tokens of both halves of ``1{u in A} - |A|`` (A from the other half).
    lower : float
        ``estimate`` less the two halves' Azuma-Hoeffding radii at the given confidence (clipped at 0):
        a lower confidence bound on the mean per-token TV over all tokens.
    confidence : float
    num_tokens : int
    """

    ordering: str
    estimate: float
    lower: float
    confidence: float
    num_tokens: int

    def to_dict(self) -> dict:
        """Plain JSON values."""
        return {k: (None if isinstance(v, float) and not math.isfinite(v) else v)
                for k, v in dataclasses.asdict(self).items()}


def held_out_tv(pit: torch.Tensor, fold: torch.Tensor, ordering: str, confidence: float,
                num_bins: int = NUM_BINS) -> HeldOutTV:
    """The held-out lower bound on the mean per-token TV (docs/generation.md, "The effect size").

    For any set A of [0, 1] fixed independently of a sequence of tokens, each increment
    ``1{u_t in A} - |A|`` has conditional mean ``P_t(u_t in A) - |A| <= TV(p_t, q_t)`` given the past
    (the PIT's law is as far from uniform as the token's law from the target's), and lies in an
    interval of length 1, so by Azuma-Hoeffding the sum over T tokens is at most the sum of their TVs
    plus ``sqrt(T log(1/delta) / 2)`` with probability ``1 - delta``, under any adaptivity.  A is chosen
    on the other half of the continuations (``fold``: 0 or 1 per token, fixed per continuation),
    which are independent of this half's; the two halves' sums (each at ``delta = (1 - confidence) / 2``)
    add up to a bound on the mean TV over all tokens.
    """
    totals, radii, sizes = [], [], []
    delta = (1.0 - confidence) / 2.0
    for half in (0, 1):
        chooser, judged = pit[fold == half], pit[fold == 1 - half]
        if chooser.numel() == 0 or judged.numel() == 0:
            return HeldOutTV(ordering, math.nan, 0.0, confidence, int(pit.numel()))
        over = bin_counts(chooser, num_bins) / chooser.numel() > 1.0 / num_bins
        index = (judged.double().clamp(0.0, 1.0 - 1e-15) * num_bins).long().numpy()
        inside = over[index].astype(np.float64)
        totals.append(float(inside.sum()) - judged.numel() * float(over.sum()) / num_bins)
        radii.append(math.sqrt(math.log(1.0 / delta) * judged.numel() / 2.0))
        sizes.append(judged.numel())
    # weighted by tokens, so the bound is on the mean over all tokens (each half's sum of increments
    # exceeds its sum of TVs by more than its radius with probability at most delta)
    n = float(sum(sizes))
    estimate = (totals[0] + totals[1]) / n
    return HeldOutTV(ordering, estimate, max(0.0, estimate - (radii[0] + radii[1]) / n), confidence, int(n))


def agreement_test(agree: Sequence[bool], chance: Sequence[float], name: str) -> TestResult:
    """Pairs of independent requests that agree on their first token more often than chance.

    ``chance[i] = sum_v q(v)^2``, the probability that two independent draws from the scorer's
    first-token law agree.  The number of agreeing pairs is Poisson-binomial under independence;
    its exact upper tail is the p-value (one-sided: shared randomness makes agreement more likely).
    """
    agree = np.asarray(agree, dtype=bool)
    chance = np.clip(np.asarray(chance, dtype=np.float64), 0.0, 1.0)
    if agree.size == 0:
        return TestResult(name, 0.0, 1.0, None, 0, detail="no repeated requests")
    # exact Poisson-binomial law by dynamic programming over the pairs
    law = np.zeros(agree.size + 1)
    law[0] = 1.0
    for p in chance:
        law[1:] = law[1:] * (1 - p) + law[:-1] * p
        law[0] *= 1 - p
    observed = int(agree.sum())
    pvalue = float(min(1.0, law[observed:].sum()))
    return TestResult(name, float(observed), pvalue, None, int(agree.size),
                      detail=f"{observed} of {agree.size} pairs of repeated requests agree on their first token; "
                             f"{float(chance.sum()):.3g} expected of independent draws from the scorer's law (more: "
                             f"shared randomness, or a first-token law sharper than the scorer's)",
                      null="Poisson-binomial (exact)")


class PITEProcess:
    """An anytime-valid plug-in e-process on binned PIT values (the uniform law is the null).

    As :class:`~spectr_audit.statistical.gof.PlugInEProcess` on the bins: after each batch,
    ``log E += sum_b n_b log(F_prev(b) / (1/B))`` with ``F_prev`` fixed before the batch.  Under
    an exact engine the PIT values are i.i.d. uniform in the order they arrive, so E is a
    non-negative martingale of mean 1 and ``min(1, 1/max_t E_t)`` is valid at any stopping time.
    """

    def __init__(self, num_bins: int = NUM_BINS, prior: Optional[float] = None):
        self.num_bins = num_bins
        self.prior = float(prior if prior is not None else num_bins)
        self.counts = np.zeros(num_bins)
        self.log_e = 0.0
        self.max_log_e = 0.0

    def update(self, pit: torch.Tensor) -> float:
        """Add a batch's PIT values; return the current ``log E``."""
        counts = bin_counts(pit, self.num_bins)
        plug_in = (self.counts + self.prior / self.num_bins) / (self.counts.sum() + self.prior)
        self.log_e += float((counts * np.log(plug_in * self.num_bins)).sum())
        self.max_log_e = max(self.max_log_e, self.log_e)
        self.counts += counts
        return self.log_e

    @property
    def pvalue(self) -> float:
        """``min(1, 1 / max_t E_t)``."""
        return float(math.exp(-self.max_log_e)) if self.max_log_e > 0 else 1.0
