"""Confidence intervals for the TV distance on a partition, anytime-valid, and the certification plan.

The statistical audit counts n completed strings over the C cells of a partition of V^N
(:mod:`spectr_audit.statistical.sampling`).  With ``F`` the verifier's law coarsened to the
cells, ``F_hat`` its empirical law and ``q`` the target's cell probabilities,

    TV(F, q) <= TV(F_hat, q) + TV(F_hat, F)   and   TV(F, q) >= TV(F_hat, q) - TV(F_hat, F),

so one bound ``TV(F_hat, F) <= r`` gives both ends of the interval ``TV(F_hat, q) -+ r``
(docs/audit/statistical.md).  :func:`deviation_radius` is such an r, valid for every F:

* *union bound*: ``TV(F_hat, F) = max_A (F_hat(A) - F(A))`` over the ``2^C`` sets of cells, and
  Hoeffding bounds each, so ``P(TV > r) <= 2^C exp(-2 n r^2)``:
  ``r = sqrt((C log 2 + log(1/delta)) / (2n))``;
* *McDiarmid*: one sample moves ``TV(F_hat, F)`` by at most ``1/n``, and
  ``E TV(F_hat, F) <= 1/2 sum_c sqrt(F_c (1 - F_c) / n) <= 1/2 sqrt((C - 1) / n)``, so
  ``r = 1/2 sqrt((C - 1)/n) + sqrt(log(1/delta) / (2n))``.

The smaller of the two is used (a choice made from n, C and delta alone, so it keeps the level).

*Anytime validity.*  The audit looks at its counts after every chunk, at sample counts
``n_1 < n_2 < ...`` fixed by the chunk schedule, and may stop at any of them.  Look i spends
``delta_i = delta (n_i - n_{i-1}) / (2 n_i (1 + log(n_i / n_1))^2)`` (:func:`look_delta`), and
``sum_i delta_i <= delta/2 (1 + int_0^inf du / (1 + u)^2) = delta``: with probability at least
``1 - delta`` every interval of the sequence holds at once, so the interval at a data-chosen
stopping time (the e-process's, a certification's) is valid (:class:`TVConfidenceSequence`).

*Certification* to a tolerance ``eps``: certified when the upper end is at most ``eps``.  An
exact verifier has ``E TV(F_hat, q) <= 1/2 sum_c sqrt(q_c (1 - q_c) / n)``, and McDiarmid bounds
its upper tail, so :func:`certification_samples` finds the first look at which an exact verifier
is certified with probability ``power``.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Iterable, Optional

import torch

from spectr_audit.errors import InvalidArgument

__all__ = [
    "TVConfidenceSequence",
    "TVInterval",
    "certification_samples",
    "deviation_radius",
    "look_delta",
    "partition_tv",
    "tv_interval",
]

#: How the interval is built, in words (reports print it).
METHOD = ("TV(F_hat, q) -+ r, r the smaller of the union-Hoeffding and McDiarmid bounds on TV(F_hat, F); "
          "anytime-valid over the chunk looks")


def deviation_radius(num_samples: int, num_cells: int, delta: float) -> float:
    """An r with ``P(TV(F_hat, F) > r) <= delta`` for the empirical law of ``num_samples`` i.i.d. draws.

    Valid for every law F on ``num_cells`` cells (see the module docstring).

    Examples
    --------
    >>> round(deviation_radius(1_000_000, 64, 1e-3), 5)   # sqrt((64 log 2 + log 1000) / 2e6)
    0.00506
    """
    if num_samples <= 0:
        return math.inf
    if not 0 < delta < 1:
        raise InvalidArgument(f"delta: expected a number in (0, 1), got {delta!r}")
    num_cells = max(int(num_cells), 2)
    log_term = math.log(1.0 / delta)
    union = math.sqrt((num_cells * math.log(2.0) + log_term) / (2.0 * num_samples))
    mcdiarmid = 0.5 * math.sqrt((num_cells - 1) / num_samples) + math.sqrt(log_term / (2.0 * num_samples))
    return min(union, mcdiarmid)


def look_delta(delta: float, num_samples: int, previous: int, first: int) -> float:
    """The error share of the look at ``num_samples`` (the previous look at ``previous``, the first at ``first``).

    ``delta (n_i - n_{i-1}) / (2 n_i (1 + log(n_i / n_1))^2)``; these shares sum to at most
    ``delta`` over any increasing sequence of looks.

    Examples
    --------
    >>> look_delta(1e-3, 4096, 0, 4096)
    0.0005
    """
    if num_samples <= previous or first <= 0:
        raise InvalidArgument(f"num_samples: looks must increase, got {num_samples} after {previous}")
    growth = 1.0 + math.log(max(num_samples / first, 1.0))
    return delta * (num_samples - previous) / (2.0 * num_samples * growth * growth)


@dataclasses.dataclass(frozen=True)
class TVInterval:
    """An estimate of TV(F, q) on a partition, with a confidence interval.

    Attributes
    ----------
    estimate : float
        The plug-in ``TV(F_hat, q) = 1/2 sum_c |counts_c / n - q_c|`` (biased up by the
        sampling noise, about ``sum_c sqrt(q_c / (2 pi n))`` for an exact verifier).
    lower, upper : float
        The interval, clipped to [0, 1].
    confidence : float
        Its level, valid simultaneously over every look of the audit.
    num_samples, num_cells : int
    radius : float
        The bound r on ``TV(F_hat, F)`` at the level spent at this look.
    """

    estimate: float
    lower: float
    upper: float
    confidence: float
    num_samples: int
    num_cells: int
    radius: float

    def to_dict(self) -> dict:
        """Plain JSON values."""
        return {k: (None if isinstance(v, float) and not math.isfinite(v) else v)
                for k, v in dataclasses.asdict(self).items()}


def _plug_in(counts: torch.Tensor, cell_probs: torch.Tensor, num_samples: int) -> float:
    if num_samples <= 0:
        return math.nan
    return 0.5 * float((counts.double() / num_samples - cell_probs.double()).abs().sum())


def tv_interval(
    counts: torch.Tensor,  # [num_cells] counts of i.i.d. samples
    cell_probs: torch.Tensor,  # [num_cells] the target's cell probabilities
    confidence: float = 0.999,
    *,
    delta: Optional[float] = None,
) -> TVInterval:
    """The fixed-sample interval for TV(F, q) at ``confidence`` (or at error ``delta`` when given).

    Examples
    --------
    >>> counts = torch.tensor([5200.0, 4800.0])
    >>> iv = tv_interval(counts, torch.tensor([0.5, 0.5]), 0.95)
    >>> round(iv.estimate, 4), iv.lower < 0.02 < iv.upper
    (0.02, True)
    """
    counts = counts.detach().cpu().double()
    cell_probs = cell_probs.detach().cpu().double()
    if counts.shape != cell_probs.shape or counts.dim() != 1:
        raise InvalidArgument(f"counts, cell_probs: expected two 1-D tensors of one shape, got "
                              f"{tuple(counts.shape)} and {tuple(cell_probs.shape)}")
    if delta is None:
        if not 0 < confidence < 1:
            raise InvalidArgument(f"confidence: expected a number in (0, 1), got {confidence!r}")
        delta = 1.0 - confidence
    num_samples = int(round(float(counts.sum())))
    num_cells = int(counts.numel())
    estimate = _plug_in(counts, cell_probs, num_samples)
    radius = deviation_radius(num_samples, num_cells, delta)
    if num_samples == 0:
        return TVInterval(math.nan, 0.0, 1.0, confidence, 0, num_cells, math.inf)
    return TVInterval(estimate, max(0.0, estimate - radius), min(1.0, estimate + radius), confidence, num_samples,
                      num_cells, radius)


class TVConfidenceSequence:
    """Anytime-valid intervals for TV(F, q) over the looks of an audit (one look per chunk).

    Call :meth:`advance` after every chunk, in order, with the samples counted so far; call
    :meth:`look` (after an ``advance``) to evaluate the interval there.  :attr:`lower` and
    :attr:`upper` are the running intersection of the looks evaluated; looks not evaluated
    still spend their share, so the intervals stay valid whichever looks are evaluated.

    Parameters
    ----------
    cell_probs : torch.Tensor
        ``[num_cells]`` target cell probabilities (cells of probability 0 included: mass
        there counts towards the TV).
    confidence : float
        ``1 - delta``, simultaneous over every look.

    Examples
    --------
    >>> cs = TVConfidenceSequence(torch.tensor([0.5, 0.5]), 0.99)
    >>> cs.advance(4096)
    >>> iv = cs.look(torch.tensor([2048.0, 2048.0]))
    >>> iv.estimate, iv.lower, round(iv.upper, 3)
    (0.0, 0.0, 0.029)
    """

    def __init__(self, cell_probs: torch.Tensor, confidence: float):
        if not 0 < confidence < 1:
            raise InvalidArgument(f"confidence: expected a number in (0, 1), got {confidence!r}")
        self.cell_probs = cell_probs.detach().cpu().double()
        self.confidence = float(confidence)
        self.delta = 1.0 - self.confidence
        self.first = 0
        self.previous = 0
        self.num_samples = 0
        self.lower = 0.0
        self.upper = 1.0
        self.last: Optional[TVInterval] = None

    def advance(self, num_samples: int) -> None:
        """Record a look at ``num_samples`` (more than the last one)."""
        if num_samples <= self.num_samples:
            raise InvalidArgument(f"num_samples: looks must increase, got {num_samples} after {self.num_samples}")
        self.previous, self.num_samples = self.num_samples, int(num_samples)
        if self.first == 0:
            self.first = self.num_samples

    @property
    def delta_here(self) -> float:
        """The error share of the current look."""
        return look_delta(self.delta, self.num_samples, self.previous, self.first)

    def look(self, counts: torch.Tensor) -> TVInterval:
        """The interval at the current look from ``counts`` (``[num_cells]``, summing to its sample count)."""
        interval = tv_interval(counts, self.cell_probs, delta=self.delta_here)
        interval = dataclasses.replace(interval, confidence=self.confidence)
        self.lower = max(self.lower, interval.lower)
        self.upper = min(self.upper, interval.upper)
        self.last = interval
        return interval

    def interval(self) -> Optional[TVInterval]:
        """The last look's estimate with the running intersection of the intervals (None before a look)."""
        if self.last is None:
            return None
        return dataclasses.replace(self.last, lower=min(self.lower, self.upper), upper=self.upper)


def certification_samples(
    eps: float,
    cell_probs: torch.Tensor,  # [num_cells]
    confidence: float,
    power: float,
    schedule: Iterable[int],
    max_samples: int = 1 << 40,
) -> Optional[int]:
    """The first look of ``schedule`` (chunk sizes) at which an exact verifier is certified with ``power``.

    At a look with n samples an exact verifier's upper end is ``TV(F_hat, q) + r_i``; with
    probability ``power`` the first term is at most ``1/2 sum_c sqrt(q_c (1 - q_c) / n) +
    sqrt(log(1 / (1 - power)) / (2n))``.  Returns None when no look up to ``max_samples``
    reaches ``eps``.

    Examples
    --------
    >>> from spectr_audit.statistical._checks import chunk_schedule
    >>> n = certification_samples(0.05, torch.full((4,), 0.25), 0.999, 0.99, chunk_schedule(1 << 30, 1 << 14))
    >>> 4096 <= n <= 30_000
    True
    """
    if not 0 < eps < 1:
        raise InvalidArgument(f"certify_tv: expected a number in (0, 1), got {eps!r}")
    probs = cell_probs.detach().cpu().double()
    spread = 0.5 * float(torch.sqrt(probs * (1 - probs)).sum()) + math.sqrt(math.log(1.0 / (1.0 - power)) / 2.0)
    num_cells = int(probs.numel())
    delta = 1.0 - confidence
    done, first = 0, 0
    for size in schedule:
        previous, done = done, done + size
        first = first or done
        radius = deviation_radius(done, num_cells, look_delta(delta, done, previous, first))
        if spread / math.sqrt(done) + radius <= eps:
            return done
        if done >= max_samples:
            return None
    return None


def partition_tv(
    law: torch.Tensor,  # [vocab_size ** num_tokens] a law over V^N, indexed by base-V code
    partition,
) -> float:
    """TV between ``law`` coarsened to ``partition``'s cells and the partition's target probabilities.

    The exact TV on the audited partition of a verifier with an exact law (the law of
    :func:`spectr_audit.exact.iteration.exact_iteration`'s ``implied_law`` for N = L + 1): what the
    statistical audit's interval estimates.

    Examples
    --------
    >>> from spectr_audit.drafting.models import ContextFreeModel
    >>> from spectr_audit.statistical.sampling import build_partition
    >>> part = build_partition(ContextFreeModel([0.5, 0.5]), 1, 1000)
    >>> round(partition_tv(torch.tensor([0.7, 0.3], dtype=torch.float64), part), 12)
    0.2
    """
    vocab_size, num_tokens = partition.vocab_size, partition.num_tokens
    law = law.detach().cpu().double().reshape(-1)
    if law.numel() != vocab_size**num_tokens:
        raise InvalidArgument(f"law: expected {vocab_size ** num_tokens} entries (V^N), got {law.numel()}")
    codes = torch.arange(law.numel(), dtype=torch.int64)
    powers = vocab_size ** torch.arange(num_tokens - 1, -1, -1, dtype=torch.int64)
    strings = (codes.unsqueeze(1) // powers) % vocab_size  # [V^N, N], first token most significant
    cells = partition.cells_of(strings.to(partition.children.device)).cpu()
    coarse = torch.zeros(partition.num_cells, dtype=torch.float64).index_add_(0, cells, law)
    return 0.5 * float((coarse - partition.cell_probs.double().cpu()).abs().sum())
