"""The statistical audit's sample stage (private): the main design, then the stratified one.

The main design drafts i.i.d. (or draws the tree), verifies, completes and counts, chunk by
chunk, with the e-process, the support check and the certification looking after every chunk;
the stratified design verifies given draft tuples in proportion to their probability.  Every
chunk draws from its own generator (:func:`spectr_audit.statistical.sharding.chunk_generator`),
so the counts do not depend on how the chunks are spread over processes.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Optional

import torch

from spectr_audit.statistical._audit_args import AuditArgs
from spectr_audit.statistical._checks import chunk_schedule
from spectr_audit.statistical._planning import Plan
from spectr_audit.statistical.confidence import TVConfidenceSequence, TVInterval
from spectr_audit.statistical.gof import PlugInEProcess
from spectr_audit.statistical.sampling import sample_chunk, sample_stratified_chunk, sample_tree_chunk
from spectr_audit.statistical.sharding import (
    MAIN_STREAM,
    PERMUTATION_STREAM,
    STRATIFIED_STREAM,
    chunk_generator,
    run_chunks,
)


@dataclasses.dataclass
class MainTally:
    """Running counts of the main (i.i.d.-draft) design."""

    counts: torch.Tensor
    num_samples: int = 0
    acceptance_count: int = 0
    length_sum: float = 0.0
    length_sq_sum: float = 0.0
    stop_reason: str = "planned"


@dataclasses.dataclass(frozen=True)
class Samples:
    """What the sampling stage counted."""

    main: MainTally
    #: ``[num_strata, num_cells]`` counts of the stratified design (None when it did not run)
    strat_counts: Optional[torch.Tensor]
    eprocess: Optional[PlugInEProcess]
    stop_reason: str
    seconds: float
    #: the TV interval at the last look, and the certification outcome (None when not certifying)
    tv: Optional[TVInterval] = None
    certification: Optional[str] = None

    @property
    def strat_samples(self) -> int:
        """Samples of the stratified design."""
        return int(self.strat_counts.sum()) if self.strat_counts is not None else 0


def sample_audit(args: AuditArgs, plan: Plan) -> Samples:
    """Sample stage: the main design, then the stratified one unless the main design already decided."""
    eprocess = PlugInEProcess(plan.partition.cell_probs) if args.sequential else None
    sequence = TVConfidenceSequence(plan.partition.cell_probs, args.tv_confidence)
    start = time.perf_counter()
    max_seconds = args.max_seconds
    deadline = (None if max_seconds is None
                else start + (max_seconds / 2 if plan.enumeration is not None else max_seconds))
    main = _run_main(args, plan, eprocess, sequence, deadline)
    stop_reason = main.stop_reason if main.stop_reason != "planned" else plan.stop_reason
    # The interval at the last look (a certification evaluated every look but one that stopped it otherwise).
    if main.num_samples and (sequence.last is None or sequence.last.num_samples != main.num_samples):
        sequence.look(main.counts)
    tv = sequence.interval()
    certification = None
    if args.certify_tv is not None and tv is not None:
        # the interval at the last look decides, whichever rule stopped the sampling there
        certification = ("certified" if tv.upper <= args.certify_tv
                         else "refuted" if tv.lower > args.certify_tv else "uncertified")
    strat_counts = None
    if plan.enumeration is not None and stop_reason not in ("support", "e-process"):
        strat_counts, complete = _run_stratified(args, plan, None if max_seconds is None else start + max_seconds)
        if not complete:
            stop_reason = "max_seconds"
    return Samples(main, strat_counts, eprocess, stop_reason, time.perf_counter() - start, tv, certification)


def _run_main(args: AuditArgs, plan: Plan, eprocess, sequence: TVConfidenceSequence, deadline) -> MainTally:
    """Stream chunks of the i.i.d.-draft design into counts; stop early on certainty or a budget."""
    partition = plan.partition
    num_cells = partition.num_cells
    tally = MainTally(torch.zeros(num_cells, dtype=torch.float64))
    impossible = partition.cell_probs == 0
    certify_tv = args.certify_tv
    buffers: dict = {}  # the drafted conditionals' tensors, rewritten every chunk

    def compute(index: int, offset: int, size: int) -> torch.Tensor:
        # [num_cells + 3]: the chunk's cell counts, then its membership count, length sum and squared-length sum
        generator = chunk_generator(args.seed, MAIN_STREAM, index, args.device)
        if args.tree is not None:
            chunk = sample_tree_chunk(args.verifier, args.tree, args.draft_scheme, args.draft_model, args.target_model,
                                      args.num_tokens, size, generator, prefix=args.prefix, device=args.device,
                                      validate_inputs=index == 0)
        else:
            chunk = sample_chunk(args.verifier, args.draft_model, args.target_model, args.num_drafts, args.draft_len,
                                 args.num_tokens, size, generator, prefix=args.prefix, device=args.device,
                                 validate_inputs=index == 0, buffers=buffers)
        stats = torch.zeros(num_cells + 3, dtype=torch.float64)
        stats[:num_cells] = torch.bincount(partition.cells_of(chunk.strings), minlength=num_cells).double().cpu()
        if chunk.membership is not None:
            lengths = chunk.lengths.double()
            stats[num_cells] = float(chunk.membership.sum())
            stats[num_cells + 1] = float(lengths.sum())
            stats[num_cells + 2] = float((lengths * lengths).sum())
        return stats

    def consume(index: int, offset: int, size: int, stats: torch.Tensor) -> Optional[str]:
        chunk_counts = stats[:num_cells]
        tally.counts += chunk_counts
        tally.num_samples += size
        tally.acceptance_count += int(stats[num_cells])
        tally.length_sum += float(stats[num_cells + 1])
        tally.length_sq_sum += float(stats[num_cells + 2])
        sequence.advance(tally.num_samples)
        if bool((chunk_counts[impossible] > 0).any()):
            return "support"
        if eprocess is not None:
            eprocess.update(chunk_counts)
            if eprocess.pvalue <= plan.test_alpha:
                return "e-process"
        if certify_tv is not None:
            interval = sequence.look(tally.counts)
            if sequence.upper <= certify_tv:
                return "certified"
            if interval.lower > certify_tv or sequence.lower > certify_tv:
                return "refuted"
        return None

    _, tally.stop_reason = run_chunks(chunk_schedule(plan.total, args.chunk_size), compute, consume,
                                      deadline=deadline, shards=args.shards)
    return tally


def _run_stratified(args: AuditArgs, plan: Plan, deadline) -> tuple[torch.Tensor, bool]:
    """Counts ``[num_strata, num_cells]`` of a sample allocated to draft tuples in proportion to P(t) (>= 2 each).

    Returns the counts and whether the whole allocation ran (a deadline can cut it short).
    """
    enumeration, partition = plan.enumeration, plan.partition
    weights = enumeration.weights
    allocation = torch.clamp(torch.round(weights / weights.sum() * plan.total), min=2).to(torch.int64)
    rows = torch.repeat_interleave(torch.arange(weights.numel()), allocation)
    # A random order, so that every chunk mixes tuples as an engine's batch would.
    order = chunk_generator(args.seed, PERMUTATION_STREAM, 0)
    rows = rows[torch.randperm(rows.numel(), generator=order)]
    num_strata, num_cells = weights.numel(), partition.num_cells
    flat = torch.zeros(num_strata * num_cells, dtype=torch.float64)

    def compute(index: int, offset: int, size: int) -> torch.Tensor:
        strata = rows[offset : offset + size]
        generator = chunk_generator(args.seed, STRATIFIED_STREAM, index, args.device)
        chunk = sample_stratified_chunk(args.verifier, enumeration, strata, args.draft_model, args.target_model,
                                        args.num_tokens, generator, prefix=args.prefix, device=args.device,
                                        validate_inputs=index == 0)
        cells = partition.cells_of(chunk.strings).cpu()
        return torch.bincount(strata * num_cells + cells, minlength=num_strata * num_cells).double()

    def consume(index: int, offset: int, size: int, stats: torch.Tensor) -> None:
        flat.add_(stats)

    _, stop_reason = run_chunks(chunk_schedule(rows.numel(), args.chunk_size), compute, consume, deadline=deadline,
                                shards=args.shards, ordered=False)
    return flat.reshape(num_strata, num_cells), stop_reason == "planned"
