"""First-token fidelity where the vocabulary cannot be enumerated (V = 49,152, a law per context).

The tests of the statistical audit count samples over one partition of one target law; on a
real model every context has its own law.  The pieces here reduce the real-LM samples to
what :mod:`spectr_audit.statistical.gof` tests:

* :class:`RatioPartition` (:func:`ratio_partition`): per context, the tokens sorted by the
  target/draft ratio ``q(x) / p(x)`` and cut into cells of equal mixture mass
  ``(p + q) / 2``, as many as the sample size supports (:func:`planned_num_cells`, Cochran's
  rule, as :func:`spectr_audit.statistical.sampling.build_partition` plans its cells).
  Speculative sampling's coupling follows the ratio order, so a residual or acceptance slip
  moves mass between these cells, and every cell carries draft or target mass of order
  ``1 / num_cells``.
* :class:`FirstTokenTally`: the cell of each sample's first emitted token against the target's
  cell law at its context, tested by
  :func:`spectr_audit.statistical.gof.independent_sum_test` (independent samples with known,
  different laws; sparse cells pooled by :func:`spectr_audit.statistical.gof.pool_sparse`),
  with the minimum detectable TV of :func:`spectr_audit.statistical.power.min_detectable_tv`.
* :func:`mean_zero_test`: the Rao-Blackwellised check, for verifiers with an exact law: the
  per-draw deviations ``f - q`` of the verifier's conditional first-token law from the target,
  cell by cell (t-tests, Bonferroni); the deviations are i.i.d. with mean 0 under exactness.
* :func:`first_token_law`: that conditional law, read off the verifier's ``output_probs``.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Optional

import torch
from scipy import stats

from spectr_audit.statistical.gof import MIN_EXPECTED, TestResult, independent_sum_test
from spectr_audit.statistical.power import min_detectable_tv

__all__ = [
    "FirstTokenTally",
    "RatioPartition",
    "describe_ratio_cells",
    "first_token_law",
    "mean_zero_test",
    "planned_num_cells",
    "ratio_partition",
]


def planned_num_cells(num_samples: int, max_cells: int, min_expected: float = MIN_EXPECTED) -> int:
    """Cells of the ratio partition for ``num_samples`` draws: at most ``max_cells``, at least 2,
    and about ``min_expected`` expected draws per cell.

    Examples
    --------
    >>> planned_num_cells(192, 8), planned_num_cells(24, 8), planned_num_cells(3, 8)
    (8, 4, 2)
    """
    return int(max(2, min(max_cells, num_samples // min_expected)))


@dataclasses.dataclass(frozen=True)
class RatioPartition:
    """Per-context partition of the vocabulary along the target/draft ratio.

    Tokens are sorted by ``q(x) / p(x)`` (ascending; tokens the draft never proposes last) and
    cut into ``num_cells`` consecutive groups of equal mixture mass ``(p + q) / 2``.
    """

    # [num_contexts, vocab_size] int64, the cell of every token
    cell: torch.Tensor
    num_cells: int

    def cells(
        self,
        law: torch.Tensor,  # [n, vocab_size]
        rows: Optional[torch.Tensor] = None,  # [n] context of each law (default: 0..n-1)
    ) -> torch.Tensor:  # [n, num_cells]
        """Mass of each cell under ``law``."""
        index = self.cell if rows is None else self.cell[rows]
        return torch.zeros(law.shape[0], self.num_cells, dtype=law.dtype).scatter_add_(1, index, law)

    def cell_of(
        self,
        tokens: torch.Tensor,  # [n]
        rows: Optional[torch.Tensor] = None,  # [n]
    ) -> torch.Tensor:  # [n] int64
        """Cell of each token."""
        index = self.cell if rows is None else self.cell[rows]
        return index.gather(1, tokens.unsqueeze(1)).squeeze(1)

    def describe(self) -> str:
        """The partition in words, for reports."""
        return describe_ratio_cells(self.num_cells)


def describe_ratio_cells(num_cells: int) -> str:
    """The ratio partition with ``num_cells`` cells, in words."""
    return (f"{num_cells} cells per context: tokens sorted by target/draft probability ratio, cut into "
            f"groups of equal mixture mass (draft + target) / 2")


def ratio_partition(
    draft_probs: torch.Tensor,  # [num_contexts, vocab_size]
    target_probs: torch.Tensor,  # [num_contexts, vocab_size]
    num_cells: int,
) -> RatioPartition:
    """The ratio partition of each context (see :class:`RatioPartition`).

    Examples
    --------
    >>> draft = torch.tensor([[0.5, 0.25, 0.25]], dtype=torch.float64)
    >>> target = torch.tensor([[0.25, 0.25, 0.5]], dtype=torch.float64)
    >>> ratio_partition(draft, target, 2).cell.tolist()   # ratios 0.5, 1, 2; mixture 3/8, 1/4, 3/8
    [[0, 0, 1]]
    """
    # float32 keys sort twice as fast; ties and near-ties may fall either way, which only moves
    # a token between neighbouring cells (the partition is fixed before any draw is seen)
    ratio = torch.where(draft_probs > 0, target_probs / draft_probs.clamp(min=1e-300), math.inf).float()
    order = torch.sort(ratio, dim=-1).indices
    mixture = (0.5 * (draft_probs + target_probs)).gather(1, order)
    before = mixture.cumsum(-1) - mixture  # mass strictly before each token in the order
    sorted_cell = (before * num_cells).floor().clamp(0, num_cells - 1).to(torch.int64)
    cell = torch.empty_like(sorted_cell).scatter_(1, order, sorted_cell)
    return RatioPartition(cell=cell, num_cells=num_cells)


class FirstTokenTally:
    """Cells of sampled first tokens against the target's cell law at each sample's context.

    Each sample s falls in cell c with known probability ``e_s(c)`` under exactness (the
    target's mass of cell c at its context), independently of the others: the counts have
    mean ``sum_s e_s`` and covariance ``diag(sum_s e_s) - sum_s e_s e_s^T``, which is what
    :func:`spectr_audit.statistical.gof.independent_sum_test` tests against.  Only those sums
    are kept, so a tally costs ``num_cells^2`` numbers however many samples it holds.
    """

    def __init__(self, num_cells: int):
        self.num_cells = int(num_cells)
        self.observed = torch.zeros(self.num_cells, dtype=torch.float64)
        self.expected = torch.zeros(self.num_cells, dtype=torch.float64)
        self.second_moment = torch.zeros(self.num_cells, self.num_cells, dtype=torch.float64)

    def add(
        self,
        cells: torch.Tensor,  # [n] int64, the cell each sample fell in
        cell_laws: torch.Tensor,  # [n, num_cells], each sample's cell law under exactness
    ) -> None:
        """Add ``n`` samples."""
        laws = cell_laws.detach().cpu().double()
        self.observed += torch.bincount(cells.cpu(), minlength=self.num_cells).double()
        self.expected += laws.sum(0)
        self.second_moment += laws.T @ laws

    @property
    def num_samples(self) -> int:
        return int(self.observed.sum())

    def test(self, alpha: float, power: float, name: str = "first-token-sampled") -> TestResult:
        """The test, with the smallest TV on the (pooled) cells it detects with ``power`` at level ``alpha``.

        ``alpha`` is the level the verdict applies to this test (within a Holm family of m
        tests, ``alpha / m`` is the level at which it is sure to count).  With fewer than two
        cells left after pooling nothing can be detected: the minimum detectable TV is inf.
        """
        result = independent_sum_test(self.observed, self.expected, self.second_moment, name=name)
        cells = int(result.num_cells or 0)
        detectable = (min_detectable_tv(result.num_samples, cells, alpha, power)
                      if cells >= 2 and result.num_samples else math.inf)
        return dataclasses.replace(
            result, min_detectable_tv=detectable,
            detail="cell of the first emitted token vs the target's cell law at its context (counts of independent "
                   "draws with known laws, null from their exact covariance; sparse cells pooled)")


def mean_zero_test(deviations: torch.Tensor, name: str = "first-token-rb") -> TestResult:  # deviations: [n, num_cells]
    """Do i.i.d. cell deviations ``f - q`` have mean 0?  Largest |t| over cells, Bonferroni.

    Each cell's mean deviation gets a two-sided one-sample t-test (the draws are i.i.d.
    bounded vectors, so the CLT applies); the p-value is ``min(1, cells * min_c p_c)``.
    Chosen over Hotelling's T^2, whose covariance estimate is unstable when the number of
    draws is not much larger than the number of cells and the vectors are far from normal
    (a Rao-Blackwellised law is often a point mass plus a residual).  ``statistic`` is the
    largest |t|.

    Examples
    --------
    >>> mean_zero_test(torch.zeros(10, 4, dtype=torch.float64)).pvalue
    1.0
    """
    d = deviations.detach().cpu().double()
    n, cells = d.shape
    if n < 3:
        return TestResult(name, math.nan, 1.0, None, n, cells, detail="too few draws")
    mean = d.mean(0)
    se = d.std(0, unbiased=True) / math.sqrt(n)
    flat = se <= 1e-15
    t = torch.where(flat, torch.where(mean.abs() <= 1e-15, 0.0, math.inf), mean.abs() / torch.where(flat, 1.0, se))
    pvalues = 2 * stats.t.sf(t.numpy(), n - 1)
    return TestResult(name, float(t.max()), float(min(1.0, cells * pvalues.min())), float(n - 1), n, cells,
                      detail="largest |t| over cells of the Rao-Blackwellised first-token law minus q (Bonferroni)")


def first_token_law(
    draft_tokens: torch.Tensor,  # [n, K, L]
    law: torch.Tensor,  # [n, K, L + 1, V], the verifier's output_probs
) -> tuple[torch.Tensor, torch.Tensor]:  # ([n, V], [n])
    """Exact law of the first emitted token given the drafts, and P(it is among the drafts' first tokens)."""
    first = draft_tokens[:, :, 0]  # [n, K]
    accepted = law[:, :, 1:].sum((2, 3))  # [n, K]: mass emitting draft k's first token via the tree
    token_law = law[:, :, 0].sum(1).scatter_add(1, first, accepted)
    in_drafts = torch.zeros_like(token_law, dtype=torch.bool).scatter(1, first, True)
    return token_law, (token_law * in_drafts).sum(-1)
