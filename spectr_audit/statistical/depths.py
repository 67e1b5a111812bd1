"""The audit's view of its counts by prefix depth: where a slip first shows.

A verifier that is exact on its first two emitted tokens and wrong on the third leaves the law of
the first two tokens alone; a test of the whole N-token string dilutes the third token's
deviation over every cell the deeper tokens split.  The audit therefore tests, beside the full
partition P of V^N, its truncations to the first d tokens
(:meth:`~spectr_audit.statistical.partition.PrefixPartition.truncation`): coarsenings of P with
fewer cells, on which a deviation first visible at depth d is judged with the power of a small
partition.  Everything here is computed from P's counts, so one sample serves every depth.

* :func:`depth_truncations`: the distinct truncations worth a test of their own.
* :class:`MixtureEProcess`: the average of one plug-in e-process per depth, itself an
  e-process: it stops the audit as soon as any depth shows the slip plainly.
* :class:`TVBounds`: anytime-valid bounds on TV_P(F, q): per depth the plug-in interval, and
  the *held-out excess*, an estimate of a lower bound on the TV that sampling noise does not
  inflate (docs/audit/statistical.md, "The TV estimate and its interval").
"""

from __future__ import annotations

import dataclasses
import math
from typing import Optional, Sequence

import torch

from spectr_audit.errors import InvalidArgument
from spectr_audit.statistical.confidence import deviation_radius, look_delta
from spectr_audit.statistical.gof import PlugInEProcess, TestResult
from spectr_audit.statistical.partition import PrefixPartition, Truncation

__all__ = ["DepthBounds", "MixtureEProcess", "TVBounds", "noise_floor", "depth_truncations"]


def depth_truncations(partition: PrefixPartition) -> tuple[Truncation, ...]:
    """The truncations of ``partition`` to depths ``d < N`` that get a test of their own, shallowest first.

    A depth is kept when its truncation has at least two cells and differs from the next
    deeper one (a truncation with as many cells as the one below it is that partition); the full
    partition itself (depth N) is not included.

    Examples
    --------
    >>> from spectr_audit.drafting.models import ContextFreeModel
    >>> from spectr_audit.statistical.partition import build_partition
    >>> part = build_partition(ContextFreeModel([0.5, 0.3, 0.2]), 3, num_samples=100_000)
    >>> [(t.depth, t.num_cells) for t in depth_truncations(part)], part.num_cells
    ([(1, 3), (2, 9)], 27)
    """
    kept = []
    deeper = partition.num_cells
    for depth in range(partition.num_tokens - 1, 0, -1):
        truncation = partition.truncation(depth)
        if 2 <= truncation.num_cells < deeper:
            kept.append(truncation)
            deeper = truncation.num_cells
    return tuple(reversed(kept))


def noise_floor(cell_probs: torch.Tensor, num_samples: int) -> float:
    """About what the plug-in ``TV(F_hat, q)`` of an exact verifier averages: ``sum_c sqrt(q_c (1 - q_c) / (2 pi n))``.

    (The mean absolute deviation of a binomial proportion, by the normal approximation.)

    Examples
    --------
    >>> round(noise_floor(torch.tensor([0.5, 0.5]), 10_000), 5)
    0.00399
    """
    if num_samples <= 0:
        return math.nan
    probs = cell_probs.detach().cpu().double()
    return float(torch.sqrt(probs * (1 - probs) / (2 * math.pi * num_samples)).sum())


class MixtureEProcess:
    """The average of plug-in e-processes (:class:`~spectr_audit.statistical.gof.PlugInEProcess`) at every depth.

    Each depth's e-process is a non-negative martingale of mean 1 under the null, so their
    average is one too, and Ville's inequality makes ``min(1, 1 / max_t E_t)`` an anytime-valid
    p-value.  A slip that shows at one depth grows that depth's e-process like ``n KL``, and the
    average pays only ``log(number of depths)`` for not knowing which.

    Parameters
    ----------
    partition : PrefixPartition
        The full partition; chunk counts are over its cells.
    truncations : sequence of Truncation
        The shallower depths (:func:`depth_truncations`).
    """

    def __init__(self, partition: PrefixPartition, truncations: Sequence[Truncation] = ()):
        self.truncations = tuple(truncations)
        self.processes = [PlugInEProcess(t.cell_probs) for t in self.truncations]
        self.processes.append(PlugInEProcess(partition.cell_probs))
        self.log_e = 0.0
        self.max_log_e = 0.0
        self.num_samples = 0

    def update(self, chunk_counts: torch.Tensor) -> float:
        """Add one chunk of counts over the full partition's cells; return the current ``log E``."""
        chunk_counts = chunk_counts.detach().cpu().double()
        logs = [process.update(t.counts(chunk_counts)) for t, process in zip(self.truncations, self.processes)]
        logs.append(self.processes[-1].update(chunk_counts))
        self.log_e = float(torch.logsumexp(torch.tensor(logs, dtype=torch.float64), 0)) - math.log(len(logs))
        self.max_log_e = max(self.max_log_e, self.log_e)
        self.num_samples = int(self.processes[-1].num_samples)
        return self.log_e

    @property
    def pvalue(self) -> float:
        """Anytime-valid p-value ``min(1, 1 / max_t E_t)``."""
        return float(math.exp(-self.max_log_e)) if self.max_log_e > 0 else 1.0

    def result(self) -> TestResult:
        """The e-process as a sub-test result."""
        depths = f"{len(self.processes)} depths" if len(self.processes) > 1 else "one depth"
        return TestResult("e-process", self.max_log_e, self.pvalue, None, self.num_samples,
                          int(self.processes[-1].positive.sum()),
                          detail=f"anytime-valid plug-in likelihood-ratio e-process, averaged over {depths} "
                                 "(statistic: max log E)")


@dataclasses.dataclass(frozen=True)
class DepthBounds:
    """What the counts say about TV at one depth (the law of the first ``depth`` tokens, on its cells).

    Attributes
    ----------
    depth, num_cells : int
    plug_in : float
        ``TV(F_hat, q)`` on the depth's cells, biased up by sampling noise.
    noise_floor : float
        About what ``plug_in`` averages for an exact verifier (:func:`noise_floor`).
    lower, upper : float
        The depth's anytime-valid interval (running intersection over the looks).
    """

    depth: int
    num_cells: int
    plug_in: float
    noise_floor: float
    lower: float
    upper: float

    def to_dict(self) -> dict:
        """Plain JSON values."""
        return {k: (None if isinstance(v, float) and not math.isfinite(v) else v)
                for k, v in dataclasses.asdict(self).items()}


class TVBounds:
    """Anytime-valid bounds on ``TV_P(F, q)``, the TV of the verifier's law on the audited partition P.

    At every look (one per chunk) and with the counts split in two folds (even and odd rows of
    every chunk):

    * per depth d (the truncations and P itself), the plug-in interval ``TV(F_hat_d, q_d) -+ r``
      of :mod:`spectr_audit.statistical.confidence`.  A truncation is a coarsening of P, so its
      lower end bounds ``TV_P`` from below too;
    * the **held-out excess**: on each fold, at the depth whose plug-in stands furthest above its
      noise floor, the set A of cells that fold over-represents; the *other* fold's excess mass
      there, ``F_hat(A) - q(A)``, is an unbiased estimate of ``F(A) - q(A) <= TV_P(F, q)``
      (zero in expectation for an exact verifier, whatever the number of cells), with a Hoeffding
      radius.  The two folds' estimates are averaged.

    The error budget ``delta = 1 - confidence`` is split equally between the depths' intervals
    and the held-out excess, and within each spent over the looks as
    :func:`~spectr_audit.statistical.confidence.look_delta` does, so every bound holds at every
    look at once with probability at least ``confidence``.  ``lower`` is the best lower bound over
    depths, looks and the held-out excess; ``upper`` is P's own (running minimum).

    Parameters
    ----------
    partition : PrefixPartition
    truncations : sequence of Truncation
        The shallower depths (:func:`depth_truncations`).
    confidence : float
    """

    def __init__(self, partition: PrefixPartition, truncations: Sequence[Truncation], confidence: float):
        if not 0 < confidence < 1:
            raise InvalidArgument(f"confidence: expected a number in (0, 1), got {confidence!r}")
        self.partition = partition
        self.truncations = tuple(truncations)
        self.confidence = float(confidence)
        self.num_parts = len(self.truncations) + 2  # every depth's interval, and the held-out excess
        self.share = (1.0 - self.confidence) / self.num_parts
        self.first = self.previous = self.num_samples = 0
        depths = [t.depth for t in self.truncations] + [partition.num_tokens]
        self._lower = {d: 0.0 for d in depths}
        self._upper = {d: 1.0 for d in depths}
        self._last: dict = {}
        self.witness_lower = 0.0
        self.witness = math.nan
        self.witness_depth: Optional[int] = None
        self.looked_at = 0

    def advance(self, num_samples: int) -> None:
        """Record a look at ``num_samples`` (more than the last one)."""
        if num_samples <= self.num_samples:
            raise InvalidArgument(f"num_samples: looks must increase, got {num_samples} after {self.num_samples}")
        self.previous, self.num_samples = self.num_samples, int(num_samples)
        self.first = self.first or self.num_samples

    def _views(self, counts: torch.Tensor):
        """``(depth, counts over its cells, its cell probabilities)`` for every depth, shallowest first."""
        for truncation in self.truncations:
            yield truncation.depth, truncation.counts(counts), truncation.cell_probs
        yield self.partition.num_tokens, counts.double(), self.partition.cell_probs.double()

    def look(self, fold_counts: torch.Tensor) -> None:
        """Evaluate every bound at the current look from ``fold_counts`` ``[2, num_cells]`` (the two folds)."""
        fold_counts = fold_counts.detach().cpu().double()
        counts = fold_counts.sum(0)
        num_samples = int(round(float(counts.sum())))
        if num_samples != self.num_samples or num_samples == 0:
            raise InvalidArgument(f"fold_counts: expected {self.num_samples} samples at this look, got {num_samples}")
        delta = look_delta(self.share, self.num_samples, self.previous, self.first)
        for depth, depth_counts, probs in self._views(counts):
            plug_in = 0.5 * float((depth_counts / num_samples - probs).abs().sum())
            radius = deviation_radius(num_samples, probs.numel(), delta)
            self._lower[depth] = max(self._lower[depth], plug_in - radius)
            self._upper[depth] = min(self._upper[depth], plug_in + radius)
            self._last[depth] = (plug_in, noise_floor(probs, num_samples), probs.numel())
        self._held_out(fold_counts, delta)
        self.looked_at = self.num_samples

    def _held_out(self, fold_counts: torch.Tensor, delta: float) -> None:
        sizes = fold_counts.sum(1)
        if bool((sizes <= 0).any()):
            return
        estimates, radii, chosen = [], [], []
        for fold in (0, 1):
            best = None
            for depth, depth_counts, probs in self._views(fold_counts[fold]):
                size = float(sizes[fold])
                over = depth_counts / size > probs  # A: the cells this fold over-represents
                excess = float((depth_counts[over] / size - probs[over]).sum()) - noise_floor(probs, int(size))
                if best is None or excess > best[0]:
                    best = (excess, depth, over, probs)
            _, depth, over, probs = best
            other = dict((d, c) for d, c, _ in self._views(fold_counts[1 - fold]))[depth]
            other_size = float(sizes[1 - fold])
            estimates.append(float(other[over].sum()) / other_size - float(probs[over].sum()))
            # one-sided Hoeffding for the other fold's proportion in A, half the look's share per fold
            radii.append(math.sqrt(math.log(2.0 / delta) / (2.0 * other_size)))
            chosen.append(depth)
        self.witness = 0.5 * (estimates[0] + estimates[1])
        self.witness_lower = max(self.witness_lower, self.witness - 0.5 * (radii[0] + radii[1]))
        self.witness_depth = max(chosen)

    @property
    def lower(self) -> float:
        """The best lower bound on ``TV_P(F, q)``: over depths, looks and the held-out excess, clipped to [0, 1]."""
        return float(min(1.0, max(0.0, self.witness_lower, *self._lower.values())))

    @property
    def upper(self) -> float:
        """The upper bound on ``TV_P(F, q)`` from P's own interval (running minimum), at least ``lower``."""
        return float(max(self.lower, min(1.0, self._upper[self.partition.num_tokens])))

    @property
    def estimate(self) -> float:
        """The held-out excess at the last look, within ``[lower, upper]`` (NaN before a look with both folds).

        Unclipped it is unbiased for ``F(A) - q(A)``, and so can fall below 0 (or below a depth's
        lower bound) by sampling noise; a TV is at least ``lower``, so the estimate is too.
        """
        if not math.isfinite(self.witness):
            return math.nan
        return float(min(self.upper, max(self.lower, self.witness)))

    @property
    def plug_in(self) -> float:
        """``TV(F_hat, q)`` on P at the last look (NaN before one)."""
        return self._last.get(self.partition.num_tokens, (math.nan,))[0]

    @property
    def floor(self) -> float:
        """About what :attr:`plug_in` averages for an exact verifier, at the last look."""
        return self._last.get(self.partition.num_tokens, (math.nan, math.nan))[1]

    def depths(self) -> tuple[DepthBounds, ...]:
        """Every depth's bounds at the last look, shallowest first."""
        out = []
        for depth, (plug_in, floor, cells) in sorted(self._last.items()):
            lower = max(0.0, self._lower[depth])
            out.append(DepthBounds(depth, int(cells), plug_in, floor, min(lower, 1.0),
                                   max(lower, min(1.0, self._upper[depth]))))
        return tuple(out)
