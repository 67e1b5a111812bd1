"""The auditor's own calibration, by construction: every test family run on counts drawn from its null.

A test's stated false-alarm rate is only as good as the approximation behind its p-value, and
the audit's partitions are large and sparse (thousands of cells of about 5 expected samples),
where textbook approximations fail.  Here the counts are drawn straight from the null law of a
partition the audit builds (no verifier involved, so the null holds by construction), every
family's p-value is computed as the audit computes it, and the rejections at each level are
counted.  A family whose rejections exceed the upper 99% quantile of Binomial(draws, alpha)
(:attr:`NullRejection.exceeds`) is miscalibrated at that size.

The families:

``g-test``
    the audit's G-test (:func:`~spectr_audit.statistical.gof.g_test`, its null from
    :mod:`spectr_audit.statistical.nulls`);
``g-test (chi-square)``, ``pearson (chi-square)``
    the G statistic and Pearson's X^2 against the plain chi-square with ``cells - 1`` df: what
    the audit used before, kept as the reference that shows what the calibration catches;
``depth family``
    the G-tests of every prefix depth of a :class:`~spectr_audit.statistical.partition.PrefixPartition`
    and of the partition itself, Holm-adjusted, as the audit runs them on one sample;
``e-process``
    :class:`~spectr_audit.statistical.depths.MixtureEProcess` over the audit's chunk schedule;
``stratified-pearson``
    :func:`~spectr_audit.statistical.gof.stratified_pearson_test` on a post-stratified sample:
    tuples drawn i.i.d., each row from its tuple's own law (:func:`stratified_null`);
``conditional-g``, ``conditional-pearson``, ``aggregated-pearson``
    the sampler-versus-law tests (:mod:`spectr_audit.statistical.agreement`), rows from their
    tuples' laws;
``block-efficiency``
    the z-test of the mean emitted length against its bound, lengths drawn at the bound;
``acceptance``
    the exact binomial test of the acceptance against alpha*, drawn at alpha*.

Examples
--------
>>> import numpy as np
>>> rows = null_rejections("g-test", np.full(50, 0.02), 250, alphas=(0.05,), draws=2000, seed=0)
>>> rows[0].num_cells, rows[0].exceeds()
(50, False)
"""

from __future__ import annotations

import dataclasses
import math
from typing import Sequence

import numpy as np
import torch
from scipy import stats

from spectr_audit.contract.convert import as_tree_verifier, as_verifier
from spectr_audit.contract.sampling import SamplingParams, process_logits
from spectr_audit.contract.tree_verifier import TreeVerifier
from spectr_audit.contract.verifier import SHAPE_ATTRS, FunctionVerifier
from spectr_audit.drafting.models import ContextFreeModel, random_markov
from spectr_audit.errors import InvalidArgument
from spectr_audit.exact.iteration import enumerate_drafts
from spectr_audit.statistical.depths import MixtureEProcess, depth_truncations
from spectr_audit.statistical.gof import (
    MIN_EXPECTED,
    binomial_above,
    conditional_g_test,
    conditional_pearson_test,
    holm,
    independent_sum_test,
    mean_above,
    stratified_pearson_test,
)
from spectr_audit.statistical.nulls import g_null
from spectr_audit.statistical.partition import PrefixPartition, build_partition
from spectr_audit.statistical.poststrata import group_strata

__all__ = [
    "CELL_FAMILIES",
    "NullRejection",
    "StratifiedNull",
    "acceptance_pvalues",
    "as_black_box",
    "audit_partitions",
    "block_efficiency_pvalues",
    "calibration_table",
    "cell_pvalues",
    "depth_family_pvalues",
    "eprocess_pvalues",
    "null_rejections",
    "rejections",
    "sparse_partitions",
    "stratified_null",
    "stratified_pvalues",
]

#: The families :func:`cell_pvalues` computes from i.i.d. counts over one set of cells.
CELL_FAMILIES = ("g-test", "g-test (chi-square)", "pearson (chi-square)")

#: Count matrices are drawn and tested this many rows at a time.
_BLOCK = 256


@dataclasses.dataclass(frozen=True)
class NullRejection:
    """How often one family rejected counts drawn from its own null, at one level.

    Attributes
    ----------
    family : str
    case : str
        The partition or construction, in words.
    num_cells : int
        Cells after pooling.
    num_samples : int
        Samples per draw.
    min_expected : float
        The smallest expected count of a pooled cell.
    alpha : float
        The level.
    draws, rejections : int
    """

    family: str
    case: str
    num_cells: int
    num_samples: int
    min_expected: float
    alpha: float
    draws: int
    rejections: int

    @property
    def rate(self) -> float:
        """Rejections per draw."""
        return self.rejections / self.draws

    def interval(self, confidence: float = 0.99) -> tuple[float, float]:
        """Clopper-Pearson interval of the rejection rate."""
        result = stats.binomtest(self.rejections, self.draws, self.alpha)
        ci = result.proportion_ci(confidence_level=confidence, method="exact")
        return float(ci.low), float(ci.high)

    def limit(self, meta_level: float = 0.01) -> int:
        """The largest rejection count a calibrated family reaches with probability ``1 - meta_level``."""
        return int(stats.binom.ppf(1.0 - meta_level, self.draws, self.alpha))

    def exceeds(self, meta_level: float = 0.01) -> bool:
        """Whether the rejections exceed :meth:`limit`: the family rejects above its level."""
        return self.rejections > self.limit(meta_level)

    def to_dict(self) -> dict:
        """Plain JSON values, with the rate, its 99% interval and whether it exceeds the level."""
        low, high = self.interval()
        return {**dataclasses.asdict(self), "rate": self.rate, "interval": [low, high], "limit": self.limit(),
                "exceeds": self.exceeds()}


def rejections(family: str, case: str, pvalues: np.ndarray, alphas: Sequence[float], *, num_cells: int,
               num_samples: int, min_expected: float) -> list[NullRejection]:
    """:class:`NullRejection` rows of ``pvalues`` (one per draw) at each level of ``alphas``."""
    pvalues = np.asarray(pvalues, dtype=np.float64)
    return [NullRejection(family, case, int(num_cells), int(num_samples), float(min_expected), float(a),
                          int(pvalues.size), int((pvalues <= a).sum())) for a in alphas]


def _check(cell_probs, num_samples: int, draws: int) -> np.ndarray:
    probs = np.asarray(cell_probs, dtype=np.float64).reshape(-1)
    if probs.size < 2 or (probs < 0).any() or not np.isfinite(probs).all() or probs.sum() <= 0:
        raise InvalidArgument("cell_probs: expected at least two finite, non-negative cell probabilities")
    if int(num_samples) < 1 or int(draws) < 1:
        raise InvalidArgument(f"num_samples, draws: expected positive integers, got {num_samples!r}, {draws!r}")
    return probs / probs.sum()


def _pooled(probs: np.ndarray, num_samples: int, min_expected: float):
    """The pooling the tests apply at this sample size (:func:`~spectr_audit.statistical.gof.pool_sparse`'s rule):
    ``(mapping, pooled probabilities)``."""
    positive = probs > 0
    sparse = positive & (num_samples * probs < min_expected)
    kept = np.flatnonzero(positive & ~sparse)
    mapping = np.full(probs.shape, -1, dtype=np.int64)
    mapping[kept] = np.arange(kept.size)
    if sparse.any():
        if num_samples * probs[sparse].sum() >= min_expected or kept.size == 0:
            mapping[sparse] = kept.size
        else:
            mapping[sparse] = int(np.argmin(probs[kept]))
    size = int(mapping.max()) + 1
    keep = mapping >= 0
    pooled = np.bincount(mapping[keep], weights=probs[keep], minlength=size)
    return mapping, pooled / pooled.sum()


def _aggregate(counts: np.ndarray, mapping: np.ndarray, size: int) -> np.ndarray:
    """Counts ``[draws, cells]`` summed into the pooled cells ``[draws, size]``."""
    keep = np.flatnonzero(mapping >= 0)
    order = keep[np.argsort(mapping[keep], kind="stable")]
    starts = np.searchsorted(mapping[order], np.arange(size))
    return np.add.reduceat(counts[:, order], starts, axis=1) if order.size else np.zeros((counts.shape[0], size))


def _g_statistics(counts: np.ndarray, expected: np.ndarray) -> np.ndarray:
    with np.errstate(divide="ignore", invalid="ignore"):
        terms = np.where(counts > 0, counts * np.log(np.where(counts > 0, counts, 1.0) / expected), 0.0)
    return 2.0 * terms.sum(1)


class _CellTest:
    """One cell family's test at fixed cells and sample size: the pooling and the null, computed once."""

    def __init__(self, family: str, cell_probs, num_samples: int, min_expected: float):
        if family not in CELL_FAMILIES:
            raise InvalidArgument(f"family: expected one of {CELL_FAMILIES}, got {family!r}")
        self.family = family
        self.num_samples = int(num_samples)
        self.mapping, self.pooled = _pooled(_check(cell_probs, 1, 1), self.num_samples, min_expected)
        self.expected = self.num_samples * self.pooled
        self.df = self.pooled.size - 1
        self.null = g_null(self.pooled, self.num_samples) if family == "g-test" and self.df >= 1 else None

    def pvalues(self, counts: np.ndarray) -> np.ndarray:
        if self.df < 1:
            return np.ones(counts.shape[0])
        observed = _aggregate(counts, self.mapping, self.pooled.size)
        if self.family == "pearson (chi-square)":
            return stats.chi2.sf(((observed - self.expected) ** 2 / self.expected).sum(1), self.df)
        statistic = _g_statistics(observed, self.expected)
        if self.family == "g-test (chi-square)":
            return stats.chi2.sf(statistic, self.df)
        return self.null.sf_many(statistic)


def cell_pvalues(family: str, counts: np.ndarray, cell_probs, min_expected: float = MIN_EXPECTED) -> np.ndarray:
    """P-values of ``family`` (one of :data:`CELL_FAMILIES`) for each row of ``counts`` ``[draws, cells]``.

    Every row must have the same total (the multinomial n); the pooling is the tests'
    (:func:`~spectr_audit.statistical.gof.pool_sparse`).  ``"g-test"`` equals
    :func:`~spectr_audit.statistical.gof.g_test`'s p-value row by row.
    """
    counts = np.atleast_2d(np.asarray(counts, dtype=np.float64))
    totals = counts.sum(1)
    if not np.allclose(totals, totals[0]):
        raise InvalidArgument("counts: every row must have the same total")
    return _CellTest(family, cell_probs, int(round(float(totals[0]))), min_expected).pvalues(counts)


def _draw(rng: np.random.Generator, num_samples: int, probs: np.ndarray, draws: int) -> np.ndarray:
    return rng.multinomial(num_samples, probs, size=draws).astype(np.float64)


def null_rejections(family: str, cell_probs, num_samples: int, *, alphas: Sequence[float] = (0.05, 0.01, 0.001),
                    draws: int = 2000, seed: int = 0, min_expected: float = MIN_EXPECTED,
                    case: str = "") -> list[NullRejection]:
    """Rejections of a cell family (:data:`CELL_FAMILIES`) on multinomial counts drawn from ``cell_probs``.

    Parameters
    ----------
    family : str
    cell_probs : array
        ``[num_cells]`` the null's cell probabilities (a partition's ``cell_probs``).
    num_samples : int
        n, the samples of each draw.
    alphas : sequence of float
    draws : int
    seed : int
    min_expected : float
        The tests' pooling threshold.
    case : str
        The partition in words, for the table.
    """
    probs = _check(cell_probs, num_samples, draws)
    rng = np.random.default_rng(seed)
    test = _CellTest(family, probs, num_samples, min_expected)
    pvalues = np.concatenate([test.pvalues(_draw(rng, num_samples, probs, min(_BLOCK, draws - start)))
                              for start in range(0, draws, _BLOCK)])
    return rejections(family, case or f"{probs.size} cells", pvalues, alphas, num_cells=test.pooled.size,
                      num_samples=num_samples, min_expected=float(num_samples * test.pooled.min()))


def depth_family_pvalues(partition: PrefixPartition, num_samples: int, draws: int, seed: int = 0,
                         min_expected: float = MIN_EXPECTED) -> np.ndarray:
    """Holm's familywise p-value of the audit's G-tests of every depth, on null counts over ``partition``."""
    probs = _check(partition.cell_probs.numpy(), num_samples, draws)
    truncations = depth_truncations(partition)
    tests = [(t.mapping.numpy(), t.num_cells, _CellTest("g-test", t.cell_probs.numpy(), num_samples, min_expected))
             for t in truncations]
    full = _CellTest("g-test", probs, num_samples, min_expected)
    rng = np.random.default_rng(seed)
    out = []
    for start in range(0, draws, _BLOCK):
        counts = _draw(rng, num_samples, probs, min(_BLOCK, draws - start))
        columns = [test.pvalues(_aggregate(counts, mapping, size)) for mapping, size, test in tests]
        columns.append(full.pvalues(counts))
        out.extend(min(holm(row)) for row in np.stack(columns, 1))
    return np.array(out)


def eprocess_pvalues(partition: PrefixPartition, schedule: Sequence[int], draws: int, seed: int = 0) -> np.ndarray:
    """The audit's e-process p-value (:class:`~spectr_audit.statistical.depths.MixtureEProcess`) at the end of
    ``schedule`` (chunk sizes), on null counts over ``partition``: its running maximum, so valid at any look."""
    probs = _check(partition.cell_probs.numpy(), sum(schedule), draws)
    truncations = depth_truncations(partition)
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(draws):
        process = MixtureEProcess(partition, truncations)
        for size in schedule:
            process.update(torch.from_numpy(rng.multinomial(size, probs).astype(np.float64)))
        out.append(process.pvalue)
    return np.array(out)


# ---------------------------------------------------------------------------------------------
# Strata: draft tuples, each with its own law
# ---------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class StratifiedNull:
    """Strata of known probability, each with its own law over the cells, mixing to the target's.

    Attributes
    ----------
    strata_probs : numpy array ``[num_strata]``
    laws : numpy array ``[num_strata, num_cells]``
        Each stratum's law; ``strata_probs @ laws`` is the null's cell law.
    case : str
    """

    strata_probs: np.ndarray
    laws: np.ndarray
    case: str

    @property
    def cell_probs(self) -> np.ndarray:
        """The mixture law ``sum_t P(t) f_t``."""
        return self.strata_probs @ self.laws

    def draw(self, rng: np.random.Generator, num_samples: int) -> np.ndarray:
        """``[num_strata, num_cells]`` counts of ``num_samples`` i.i.d. rows: a stratum, then a cell of its law."""
        per_stratum = rng.multinomial(num_samples, self.strata_probs)
        return np.stack([rng.multinomial(n, law) if n else np.zeros(law.size, dtype=np.int64)
                         for n, law in zip(per_stratum, self.laws)]).astype(np.float64)


def stratified_null(verifier, draft_probs, target_probs, num_drafts: int) -> StratifiedNull:
    """The strata of a chain verifier with ``output_probs`` at K drafts of one token (L = 1), context-free models.

    Stratum t is an ordered i.i.d. draft tuple; its law is over the V^2 strings of the step
    completed to two tokens (emitted ``(y)`` completed by the target, or ``(draft_k, y)``).  For an
    exact verifier the strata mix to ``q x q``.
    """
    verifier = as_verifier(verifier)
    draft_probs = torch.as_tensor(draft_probs, dtype=torch.float64)
    target_probs = torch.as_tensor(target_probs, dtype=torch.float64)
    vocab_size = draft_probs.numel()
    enumeration = enumerate_drafts(ContextFreeModel(draft_probs), ContextFreeModel(target_probs), num_drafts, 1)
    tokens, drafts, targets = enumeration.draft_tokens, enumeration.draft_probs, enumeration.target_probs
    law = verifier.output_probs(tokens, drafts, targets).double()  # [T, K, 2, V]
    strings = torch.zeros(tokens.shape[0], vocab_size, vocab_size, dtype=torch.float64)
    strings += law[:, :, 0, :].sum(1).unsqueeze(2) * target_probs.view(1, 1, -1)  # (y) then a target token
    first = torch.nn.functional.one_hot(tokens[:, :, 0], vocab_size).double()  # [T, K, V]
    strings += torch.einsum("tka,tkb->tab", first, law[:, :, 1, :])
    laws = strings.reshape(tokens.shape[0], -1).numpy()
    laws = laws / laws.sum(1, keepdims=True)
    weights = enumeration.weights.double().numpy()
    return StratifiedNull(weights / weights.sum(), laws,
                          f"{verifier.name}, K = {num_drafts}, V = {vocab_size}: {tokens.shape[0]} draft tuples")


def stratified_pvalues(family: str, null: StratifiedNull, num_samples: int, draws: int, seed: int = 0,
                       min_expected: float = MIN_EXPECTED) -> np.ndarray:
    """P-values of a stratified family on ``draws`` samples of ``num_samples`` rows from ``null``.

    ``"stratified-pearson"`` (the exactness test on the post-stratified sample, strata with fewer
    than 2 rows merged into their neighbour as the audit fixes its groups in advance),
    ``"conditional-g"`` / ``"conditional-pearson"`` (per stratum against its own law, summed) or
    ``"aggregated-pearson"`` (all rows against the summed laws, with their exact covariance).
    """
    families = ("stratified-pearson", "conditional-g", "conditional-pearson", "aggregated-pearson")
    if family not in families:
        raise InvalidArgument(f"family: expected one of {families}, got {family!r}")
    rng = np.random.default_rng(seed)
    probs = torch.from_numpy(null.strata_probs)
    laws = torch.from_numpy(null.laws)
    target = torch.from_numpy(null.cell_probs)
    out = []
    for _ in range(draws):
        counts = torch.from_numpy(null.draw(rng, num_samples))
        per_stratum = counts.sum(1)
        if family == "stratified-pearson":
            groups = _groups(null.strata_probs, num_samples)
            grouped = torch.zeros(int(groups.max()) + 1, counts.shape[1], dtype=torch.float64).index_add_(
                0, torch.from_numpy(groups), counts)
            group_probs = torch.zeros(grouped.shape[0], dtype=torch.float64).index_add_(
                0, torch.from_numpy(groups), probs)
            if bool((grouped.sum(1) < 2).any()):
                out.append(1.0)
                continue
            out.append(stratified_pearson_test(grouped, group_probs, target, min_expected).pvalue)
        elif family in ("conditional-g", "conditional-pearson"):
            test = conditional_g_test if family == "conditional-g" else conditional_pearson_test
            out.append(test(counts, per_stratum.unsqueeze(1) * laws, min_expected).pvalue)
        else:
            expected = (per_stratum.unsqueeze(1) * laws).sum(0)
            moment = torch.einsum("t,ta,tb->ab", per_stratum, laws, laws)
            out.append(independent_sum_test(counts.sum(0), expected, moment, min_expected).pvalue)
    return np.array(out)


def _groups(strata_probs: np.ndarray, num_samples: int, min_per_group: float = 32.0) -> np.ndarray:
    """The audit's grouping of rare strata (:func:`spectr_audit.statistical.poststrata.post_strata`)."""
    return group_strata(torch.from_numpy(strata_probs), num_samples, min_per_group).numpy()


# ---------------------------------------------------------------------------------------------
# Rates and means
# ---------------------------------------------------------------------------------------------


def block_efficiency_pvalues(tail_probs: Sequence[float], num_samples: int, draws: int, seed: int = 0) -> np.ndarray:
    """The block-efficiency z-test's p-values when ``P(length > i) = tail_probs[i - 1]`` exactly (the bound)."""
    tails = np.asarray(tail_probs, dtype=np.float64)
    if tails.ndim != 1 or (np.diff(tails) > 1e-15).any() or tails.min(initial=1.0) < 0 or tails.max(initial=0) > 1:
        raise InvalidArgument("tail_probs: expected non-increasing probabilities in [0, 1]")
    survival = np.concatenate([[1.0], tails, [0.0]])
    law = survival[:-1] - survival[1:]  # P(length = 1 .. L + 1)
    lengths = np.arange(1, law.size + 1, dtype=np.float64)
    bound = 1.0 + tails.sum()
    rng = np.random.default_rng(seed)
    counts = rng.multinomial(num_samples, law, size=draws).astype(np.float64)
    total, total_sq = counts @ lengths, counts @ (lengths**2)
    return np.array([mean_above(t, s, num_samples, bound, "block-efficiency<=bound").pvalue
                     for t, s in zip(total, total_sq)])


def acceptance_pvalues(alpha_star: float, num_samples: int, draws: int, seed: int = 0) -> np.ndarray:
    """The acceptance test's p-values when the acceptance is exactly ``alpha_star`` (the bound)."""
    rng = np.random.default_rng(seed)
    hits = rng.binomial(num_samples, alpha_star, size=draws)
    cache: dict = {}
    out = []
    for h in hits.tolist():
        if h not in cache:
            cache[h] = binomial_above(h, num_samples, alpha_star, "acceptance<=optimal").pvalue
        out.append(cache[h])
    return np.array(out)


# ---------------------------------------------------------------------------------------------
# The partitions the audit builds, and the table
# ---------------------------------------------------------------------------------------------


def audit_partitions(scale: str = "fast") -> list[tuple[str, PrefixPartition, int]]:
    """``(case, partition, num_samples)`` for partitions the audit builds, from tens to 10^4 and more cells.

    Chains (N = 2) with context-free targets of V = 2, 8 and 50 tokens, a target under top-k 3
    (cells of probability 0), the prefix trees of a Markov target over six tokens that a depth-5
    draft tree's audit counts on (EAGLE's mc_sim_7b_63 at 20,000 and 200,000 samples: 2,345 and
    7,709 cells), and, with ``scale="full"``, 2 million samples of it (14,000 cells) and a V = 200
    chain (some 10^4 cells).
    """
    if scale not in ("fast", "full"):
        raise InvalidArgument(f"scale: expected 'fast' or 'full', got {scale!r}")
    rng = np.random.default_rng(7)
    v8 = ContextFreeModel(torch.from_numpy(rng.dirichlet(np.ones(8))))
    v50 = ContextFreeModel(torch.from_numpy(rng.dirichlet(np.full(50, 0.5))))
    top_k = ContextFreeModel(process_logits(torch.log(v8.probs).unsqueeze(0), SamplingParams(top_k=3))[0].double())
    markov = random_markov(5, seed=2)
    cases = [
        ("chain V = 2 (0.3, 0.7)", ContextFreeModel([0.3, 0.7]), 2, 20_000),
        ("chain V = 8", v8, 2, 4_096),
        ("chain V = 8", v8, 2, 200_000),
        ("chain V = 8, top-k 3", top_k, 2, 20_000),
        ("chain V = 50", v50, 2, 20_000),
        ("chain V = 50", v50, 2, 200_000),
        ("tree depth 5, Markov V = 5", markov, 6, 20_000),
        ("tree depth 5, Markov V = 5", markov, 6, 200_000),
    ]
    if scale == "full":
        v200 = ContextFreeModel(torch.from_numpy(rng.dirichlet(np.full(200, 0.5))))
        cases += [("tree depth 5, Markov V = 5", markov, 6, 2_000_000), ("chain V = 200", v200, 2, 400_000)]
    out = []
    for label, model, num_tokens, num_samples in cases:
        partition = build_partition(model, num_tokens, num_samples)
        out.append((f"{label}, n = {num_samples:,}: {partition.num_cells} cells", partition, num_samples))
    return out


def sparse_partitions(scale: str = "fast") -> list[tuple[str, np.ndarray, int]]:
    """``(case, cell probabilities, num_samples)``: every cell at 5 expected samples (uniform) or the smallest
    at 5 (Dirichlet(0.5) shapes), 30 to 20,000 cells: the sparsest partitions the pooling allows."""
    rng = np.random.default_rng(11)
    sizes = (30, 300, 3000) if scale == "fast" else (30, 300, 3000, 20_000)
    out = []
    for size in sizes:
        out.append((f"uniform, {size} cells of 5 expected", np.full(size, 1.0 / size), 5 * size + 1))
        probs = rng.dirichlet(np.full(size, 0.5))
        probs = probs[probs > 5e-8]
        probs /= probs.sum()
        out.append((f"Dirichlet(0.5), {probs.size} cells, smallest 5 expected", probs,
                    int(math.ceil(5.0 / probs.min())) + 1))
    return out


def calibration_table(scale: str = "fast", *, draws: int = 2000, alphas: Sequence[float] = (0.05, 0.01, 0.001),
                      seed: int = 0, families: Sequence[str] = CELL_FAMILIES + ("depth family",)) -> list[NullRejection]:
    """Null rejections of the cell families on :func:`audit_partitions` and :func:`sparse_partitions`.

    ``"depth family"`` runs on the audit's prefix partitions (it needs their depths).
    """
    rows: list[NullRejection] = []
    for index, (case, partition, num_samples) in enumerate(audit_partitions(scale)):
        probs = partition.cell_probs.numpy()
        positive = probs[probs > 0]
        for family in families:
            if family == "depth family":
                pvalues = depth_family_pvalues(partition, num_samples, draws, seed + index)
                _, pooled = _pooled(positive / positive.sum(), num_samples, MIN_EXPECTED)
                rows += rejections(family, case, pvalues, alphas, num_cells=pooled.size, num_samples=num_samples,
                                   min_expected=float(num_samples * pooled.min()))
            else:
                rows += null_rejections(family, positive, num_samples, alphas=alphas, draws=draws, seed=seed + index,
                                        case=case)
    for index, (case, probs, num_samples) in enumerate(sparse_partitions(scale)):
        for family in families:
            if family != "depth family":
                rows += null_rejections(family, probs, num_samples, alphas=alphas, draws=draws,
                                        seed=seed + 100 + index, case=case)
    return rows


# ---------------------------------------------------------------------------------------------
# Exact verifiers as black boxes: the whole audit's false-alarm rate
# ---------------------------------------------------------------------------------------------


def as_black_box(verifier, tree: bool = False):
    """``verifier`` with its exact law hidden: the audit can only sample it, as it samples an engine.

    A chain verifier keeps ``verify`` and its declared draft scheme and limits; with ``tree``,
    a tree verifier (or a chain verifier, converted) keeps ``verify_tree``, its schemes and the
    trees it supports.  Running the statistical audit on an exact verifier wrapped so measures
    the audit's familywise false-alarm rate.
    """
    if tree:
        inner = as_tree_verifier(verifier)

        class _TreeBlackBox(TreeVerifier):
            name = f"{inner.name} (black box)"
            draft_schemes = tuple(inner.draft_schemes)

            def supports_tree(self, candidate) -> bool:
                return inner.supports_tree(candidate)

            def _verify_tree(self, tree_, node_tokens, draft_probs, target_probs, generator):
                return inner._verify_tree(tree_, node_tokens, draft_probs, target_probs, generator)

        return _TreeBlackBox()
    inner = as_verifier(verifier)
    limits = {attr: getattr(inner, attr) for attr in ("draft_scheme", *SHAPE_ATTRS)}
    return FunctionVerifier(inner.verify, name=f"{inner.name} (black box)", **limits)
