"""The statistical audit's sample stage (private): one sample serves every test.

The main design drafts i.i.d. (or draws the tree), verifies, completes and counts, chunk by
chunk, with the e-process, the support check and the certification looking after every chunk.
Each row is counted in its cell of the partition, in one of two folds (even and odd rows of the
chunk: the held-out TV estimate's halves) and, when the stratified test runs, in its draft
tuple's stratum (tagged before the verifier sees the drafts).  Every chunk draws from its own
generator (:func:`spectr_audit.statistical.sharding.chunk_generator`), so the counts do not
depend on how the chunks are spread over processes.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Optional

import torch

from spectr_audit.statistical._audit_args import AuditArgs
from spectr_audit.statistical._checks import chunk_schedule
from spectr_audit.statistical._planning import Plan
from spectr_audit.statistical.depths import MixtureEProcess, TVBounds
from spectr_audit.statistical.sampling import sample_chunk, sample_tree_chunk
from spectr_audit.statistical.sharding import MAIN_STREAM, chunk_generator, run_chunks


@dataclasses.dataclass
class MainTally:
    """Running counts of the main (i.i.d.-draft) design."""

    #: ``[num_cells]`` the rows in each cell of the partition
    counts: torch.Tensor
    #: ``[2, num_cells]`` the same, by fold (even, odd rows of each chunk)
    fold_counts: torch.Tensor
    #: ``[num_groups, num_cells]`` by draft-tuple stratum (None without the stratified test)
    strat_counts: Optional[torch.Tensor] = None
    num_samples: int = 0
    acceptance_count: int = 0
    length_sum: float = 0.0
    length_sq_sum: float = 0.0
    #: rows whose drafts are not among the enumerated tuples (the stratified test then does not run)
    unstratified: int = 0
    stop_reason: str = "planned"


@dataclasses.dataclass(frozen=True)
class Samples:
    """What the sampling stage counted."""

    main: MainTally
    eprocess: Optional[MixtureEProcess]
    stop_reason: str
    seconds: float
    #: the TV bounds at the last look, and the certification outcome (None when not certifying)
    tv: Optional[TVBounds] = None
    certification: Optional[str] = None

    @property
    def strat_counts(self) -> Optional[torch.Tensor]:
        """``[num_groups, num_cells]`` counts of the main sample by stratum (None without strata)."""
        return self.main.strat_counts


def sample_audit(args: AuditArgs, plan: Plan) -> Samples:
    """Sample stage: the main design, every test's counts from the one sample."""
    eprocess = MixtureEProcess(plan.partition, plan.truncations) if args.sequential else None
    bounds = TVBounds(plan.partition, plan.truncations, args.tv_confidence)
    start = time.perf_counter()
    deadline = None if args.max_seconds is None else start + args.max_seconds
    main = _run_main(args, plan, eprocess, bounds, deadline)
    stop_reason = main.stop_reason if main.stop_reason != "planned" else plan.stop_reason
    # The bounds at the last look (a certification evaluated every look but one that stopped it otherwise).
    if main.num_samples and bounds.looked_at != main.num_samples:
        bounds.look(main.fold_counts)
    certification = None
    if args.certify_tv is not None and main.num_samples:
        # the bounds at the last look decide, whichever rule stopped the sampling there
        certification = ("certified" if bounds.upper <= args.certify_tv
                         else "refuted" if bounds.lower > args.certify_tv else "uncertified")
    return Samples(main, eprocess, stop_reason, time.perf_counter() - start, bounds if main.num_samples else None,
                   certification)


def _run_main(args: AuditArgs, plan: Plan, eprocess, bounds: TVBounds, deadline) -> MainTally:
    """Stream chunks of the i.i.d.-draft design into counts; stop early on certainty or a budget."""
    partition, strata = plan.partition, plan.strata
    num_cells = partition.num_cells
    num_groups = 0 if strata is None else strata.num_groups
    tally = MainTally(torch.zeros(num_cells, dtype=torch.float64), torch.zeros(2, num_cells, dtype=torch.float64),
                      None if strata is None else torch.zeros(num_groups, num_cells, dtype=torch.float64))
    impossible = partition.cell_probs == 0
    certify_tv = args.certify_tv
    buffers: dict = {}  # the drafted conditionals' tensors, rewritten every chunk
    # one chunk's statistics: counts by fold, membership, length sum, squared-length sum, rows not
    # stratified, then counts by stratum
    extra = 2 * num_cells
    width = extra + 4 + num_groups * num_cells

    def compute(index: int, offset: int, size: int) -> torch.Tensor:
        generator = chunk_generator(args.seed, MAIN_STREAM, index, args.device)
        if args.tree is not None:
            chunk = sample_tree_chunk(args.verifier, args.tree, args.draft_scheme, args.draft_model, args.target_model,
                                      args.num_tokens, size, generator, prefix=args.prefix, device=args.device,
                                      validate_inputs=index == 0)
        else:
            chunk = sample_chunk(args.verifier, args.draft_model, args.target_model, args.num_drafts, args.draft_len,
                                 args.num_tokens, size, generator, prefix=args.prefix, device=args.device,
                                 validate_inputs=index == 0, buffers=buffers,
                                 strata_of=None if strata is None else strata.group_of)
        cells = partition.cells_of(chunk.strings).cpu()
        fold = torch.arange(cells.numel()) % 2
        stats = torch.zeros(width, dtype=torch.float64)
        stats[:extra] = torch.bincount(fold * num_cells + cells, minlength=extra).double()
        if chunk.membership is not None:
            lengths = chunk.lengths.double()
            stats[extra] = float(chunk.membership.sum())
            stats[extra + 1] = float(lengths.sum())
            stats[extra + 2] = float((lengths * lengths).sum())
        if strata is not None:
            groups = chunk.strata.cpu()
            tagged = groups >= 0
            stats[extra + 3] = float((~tagged).sum())
            stats[extra + 4:] = torch.bincount(groups[tagged] * num_cells + cells[tagged],
                                               minlength=num_groups * num_cells).double()
        return stats

    def consume(index: int, offset: int, size: int, stats: torch.Tensor) -> Optional[str]:
        fold_counts = stats[:extra].reshape(2, num_cells)
        chunk_counts = fold_counts.sum(0)
        tally.fold_counts += fold_counts
        tally.counts += chunk_counts
        tally.num_samples += size
        tally.acceptance_count += int(stats[extra])
        tally.length_sum += float(stats[extra + 1])
        tally.length_sq_sum += float(stats[extra + 2])
        if strata is not None:
            tally.unstratified += int(stats[extra + 3])
            tally.strat_counts += stats[extra + 4:].reshape(num_groups, num_cells)
        bounds.advance(tally.num_samples)
        if bool((chunk_counts[impossible] > 0).any()):
            return "support"
        if eprocess is not None:
            eprocess.update(chunk_counts)
            if eprocess.pvalue <= plan.test_alpha:
                return "e-process"
        if certify_tv is not None:
            bounds.look(tally.fold_counts)
            if bounds.upper <= certify_tv:
                return "certified"
            if bounds.lower > certify_tv:
                return "refuted"
        return None

    _, tally.stop_reason = run_chunks(chunk_schedule(plan.total, args.chunk_size), compute, consume,
                                      deadline=deadline, shards=args.shards)
    return tally
