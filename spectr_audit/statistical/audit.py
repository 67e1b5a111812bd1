"""The statistical audit: black-box verifiers judged by their emitted strings.

:func:`statistical_audit` runs a verifier on many drafted batches, completes each emitted
string with target samples to N tokens, and tests the counts against the exact target law
(docs/audit/statistical.md).  One audit is one *family* of sub-tests of
the null hypothesis "the verifier is exact":

``pearson``, ``g-test``
    Chi-square and likelihood-ratio tests of the completed strings over a prefix-tree
    partition of V^N (:mod:`spectr_audit.statistical.sampling`), sparse cells pooled.  The sample size is
    planned for these: power ``power`` against every law at TV >= ``min_detectable_tv``
    (:mod:`spectr_audit.statistical.power`).
``stratified-pearson``
    When the draft space is small, a second sample drawn per draft tuple (strata of known
    probability); the draft-sampling noise drops out of its null distribution.
``acceptance<=optimal``
    P(first emitted token is among the drafts' first tokens) significantly above the
    optimal-transport bound alpha* proves inexactness (exact binomial test).
``block-efficiency<=bound``
    For L >= 2: the mean emitted length significantly above ``1 + sum_i alpha*(p^i, q^i, K)``
    proves inexactness: the first i emitted tokens of an exact verifier are a q-distributed
    string, and they coincide with a draft prefix when more than i tokens are emitted.
``e-process``
    An anytime-valid likelihood-ratio e-process, checked after every chunk, that stops the
    audit early on blatant bugs.
``support``
    Not a statistical test: a completed string of target probability 0 proves inexactness.

The family's p-value is Holm's (the smallest Holm-adjusted p-value), so an exact verifier
gets ``pvalue <= alpha`` with probability at most ``alpha`` (up to the chi-square
approximation).  Stopping early is safe: it happens only when the e-process's anytime-valid
p-value is below ``alpha / m``, where Holm rejects whatever the other sub-tests say.

Optimality is reported apart (it is not about exactness): acceptance below a claimed value
(the SpecTr guarantee for verifiers that declare ``"spectr"``, or ``claimed_acceptance``) and
block efficiency below ``claimed_block_efficiency``, by exact binomial and z tests.

:func:`sampler_law_agreement` (in :mod:`spectr_audit.statistical.agreement`, re-exported here) checks
a verifier that has ``output_probs`` against its own law.

When an audit fails: rerun with another ``seed``.  An exact verifier fails at rate ``alpha``
(1e-3 by default), so a failure that repeats is a finding; ``worst_cells`` names the strings
whose counts are furthest from the target law.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import time
from typing import Optional, Sequence, Union

import torch

from spectr_audit.statistical import power as sizing
from spectr_audit._validation import check_positive_int, check_prob
from spectr_audit.statistical._checks import chunk_schedule, root_laws
from spectr_audit.statistical._stages import (
    CommonArgs,
    budgeted,
    deciding_test,
    holm_family,
    support_test,
    validate_common,
    with_min_detectable_tv,
)
from spectr_audit.statistical.confidence import TVConfidenceSequence, TVInterval, certification_samples
from spectr_audit.statistical.sharding import (
    MAIN_STREAM,
    PERMUTATION_STREAM,
    STRATIFIED_STREAM,
    chunk_generator,
    current_shards,
    run_chunks,
)
from spectr_audit.bounds.acceptance import optimal_acceptance, optimal_acceptance_lp_from_sets, spectr_guarantee
from spectr_audit.errors import InvalidArgument, SpectrAuditError
from spectr_audit.exact.iteration import DraftEnumeration, enumerate_drafts
from spectr_audit.statistical.gof import (
    MIN_EXPECTED,
    PlugInEProcess,
    TestResult,
    binomial_above,
    binomial_below,
    g_test,
    mean_above,
    mean_below,
    pearson_test,
    stratified_pearson_test,
)
from spectr_audit.drafting.models import Model, contexts_from
from spectr_audit.statistical.sampling import (
    PrefixPartition,
    build_partition,
    sample_chunk,
    sample_stratified_chunk,
    sample_tree_chunk,
)
from spectr_audit.statistical.power import DEFAULT_ALPHA, DEFAULT_MIN_DETECTABLE_TV, DEFAULT_POWER
from spectr_audit.statistical.agreement import sampler_law_agreement  # re-exported
from spectr_audit.statistical.results import LawAgreementResult, StatisticalAuditResult, WorstCell, worst_cells

__all__ = [
    "DEFAULT_ALPHA",
    "DEFAULT_MIN_DETECTABLE_TV",
    "DEFAULT_POWER",
    "LawAgreementResult",
    "StatisticalAuditResult",
    "TestResult",
    "WorstCell",
    "plan_sample_size",
    "sampler_law_agreement",
    "statistical_audit",
    "statistical_tree_audit",
]

#: The stratified test runs (with ``stratify="auto"``) only when strata average this many samples...
MIN_PER_STRATUM = 32
#: ...and the partition has at most this many cells (its null needs an eigen-decomposition).
MAX_STRATIFIED_CELLS = 2048


# ---------------------------------------------------------------------------------------------
# Bounds for the exactness sub-tests
# ---------------------------------------------------------------------------------------------


def _optimal_acceptance(
    draft_root: torch.Tensor,  # [vocab_size]
    target_root: torch.Tensor,  # [vocab_size]
    num_drafts: int,
    draft_scheme: str,
) -> Optional[float]:
    """alpha* at the first position for the drafting scheme; None when too large to compute."""
    if draft_scheme == "iid":
        return optimal_acceptance(draft_root, target_root, num_drafts).item()
    # Without replacement: the transport LP over the law of the set of distinct drafts.
    support = [t for t in range(draft_root.numel()) if draft_root[t] > 0]
    if len(support) < num_drafts or math.perm(len(support), num_drafts) > 50_000:
        return None
    sets: dict = {}
    for tup in itertools.permutations(support, num_drafts):
        prob, removed = 1.0, 0.0
        for t in tup:
            prob *= float(draft_root[t]) / (1.0 - removed)
            removed += float(draft_root[t])
        sets[frozenset(tup)] = sets.get(frozenset(tup), 0.0) + prob
    try:
        return optimal_acceptance_lp_from_sets(sets, target_root, max_variables=50_000).value
    except SpectrAuditError:
        return None


def _block_efficiency_bound(draft_model, target_model, prefix, num_drafts, draft_len, device,
                            max_strings: int = 4096) -> Optional[float]:
    """``1 + sum_{i=1..L} alpha*(p^i, q^i, K)`` over joint i-token laws (None when V^L is too large)."""
    vocab_size = target_model.vocab_size
    if vocab_size**draft_len > max_strings:
        return None
    bound = 1.0
    draft_joint = torch.ones(1, dtype=torch.float64)
    target_joint = torch.ones(1, dtype=torch.float64)
    strings = torch.zeros(1, 0, dtype=torch.int64)
    for _ in range(draft_len):
        ctx = contexts_from(prefix, strings.to(device))
        draft_joint = (draft_joint.unsqueeze(1) * draft_model(ctx).double().cpu()).reshape(-1)
        target_joint = (target_joint.unsqueeze(1) * target_model(ctx).double().cpu()).reshape(-1)
        tokens = torch.arange(vocab_size).repeat(strings.shape[0]).unsqueeze(1)
        strings = torch.cat([strings.repeat_interleave(vocab_size, 0), tokens], 1)
        bound += optimal_acceptance(draft_joint, target_joint, num_drafts).item()
    return bound


def _tree_bounds(args) -> tuple[Optional[float], Optional[float]]:
    """alpha* of the root's children under the tree's scheme, and ``1 +`` the closed-form accepted-length bound
    of deterministic drafts (``topk`` / ``none``, depth >= 2); None where either is out of reach."""
    from spectr_audit.bounds.tree_lp import tree_optimal_acceptance, tree_paths_target_mass

    try:
        alpha_star, _ = tree_optimal_acceptance(args.draft_model, args.target_model, args.tree, args.draft_scheme,
                                                args.prefix)
    except InvalidArgument:
        alpha_star = None
    block_bound = None
    if args.draft_scheme in ("topk", "none") and args.tree.max_depth >= 2:
        block_bound = 1.0 + tree_paths_target_mass(args.draft_model, args.target_model, args.tree, args.prefix)
    return alpha_star, block_bound


def _draft_enumeration(draft_model, target_model, num_drafts, draft_len, draft_scheme, prefix, draft_root,
                       stratify, max_strata) -> Optional[DraftEnumeration]:
    """Every draft tuple with its probability, when the stratified design applies."""
    if not stratify:
        return None
    support = int((draft_root > 0).sum())
    if stratify == "auto" and support ** (draft_len * num_drafts) > max_strata:
        return None
    try:
        enumeration = enumerate_drafts(draft_model, target_model, num_drafts, draft_len, draft_scheme, prefix)
    except InvalidArgument:
        if stratify is True:
            raise
        return None
    if stratify == "auto" and enumeration.weights.numel() > max_strata:
        return None
    return enumeration


# ---------------------------------------------------------------------------------------------
# Planning
# ---------------------------------------------------------------------------------------------


def plan_sample_size(
    target_model: Model,
    num_tokens: int,
    *,
    prefix: Sequence[int] = (),
    alpha: float = DEFAULT_ALPHA,
    min_detectable_tv: float = DEFAULT_MIN_DETECTABLE_TV,
    power: float = DEFAULT_POWER,
    num_tests: int = 1,
    min_expected: float = MIN_EXPECTED,
    max_cells: int = 1 << 20,
    device: Union[str, torch.device] = "cpu",
) -> tuple[int, PrefixPartition]:
    """The sample size of the Pearson test, and the partition it is counted on.

    Parameters
    ----------
    target_model : Model
    num_tokens : int
        N, the length of the completed strings.
    prefix : sequence of int
    alpha, min_detectable_tv, power : float
        The Pearson test runs at level ``alpha / num_tests`` (its Bonferroni share of the Holm
        family, which Holm never lowers) and must detect every law at TV >= ``min_detectable_tv``
        with probability ``power``.
    num_tests : int
        Size of the Holm family.
    min_expected : float
        Cells with expected count below it are pooled.
    max_cells : int
        Cap on the partition's cells.
    device : str or torch.device

    Returns
    -------
    num_samples : int
    partition : PrefixPartition

    Notes
    -----
    ``n = lambda / (2 TV)^2`` with ``lambda`` the non-centrality giving the power for ``C - 1``
    degrees of freedom (:func:`spectr_audit.statistical.power.required_samples`).  C, the number of cells
    after pooling, depends on n, so n and the partition are iterated to a fixed point (two or
    three rounds).

    Examples
    --------
    >>> from spectr_audit.drafting.models import ContextFreeModel
    >>> n, part = plan_sample_size(ContextFreeModel([0.5, 0.5]), 2, num_tests=4)
    >>> part.num_cells, n
    (4, 425058)
    """
    num_tests = check_positive_int("num_tests", num_tests, allow_none=False)
    test_alpha = check_prob("alpha", alpha) / num_tests
    vocab_size = target_model.vocab_size
    cells = max(2, min(vocab_size**num_tokens, max_cells))
    num_samples = sizing.required_samples(min_detectable_tv, cells, test_alpha, power)
    partition = None
    for _ in range(6):
        partition = build_partition(target_model, num_tokens, num_samples, prefix=prefix, min_expected=min_expected,
                                    max_cells=max_cells, device=device)
        probs = partition.cell_probs
        kept = int(((probs > 0) & (num_samples * probs >= min_expected)).sum())
        pooled = float(probs[(probs > 0) & (num_samples * probs < min_expected)].sum())
        cells = max(2, kept + (1 if num_samples * pooled >= min_expected else 0))
        updated = sizing.required_samples(min_detectable_tv, cells, test_alpha, power)
        if updated == num_samples:
            break
        num_samples = updated
    return num_samples, partition


# ---------------------------------------------------------------------------------------------
# The stages: validate -> plan -> sample -> test
# ---------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _AuditArgs(CommonArgs):
    """The audit's validated arguments: those shared with the sampler-vs-law check, then its own."""

    num_tokens: int
    stratify: Union[bool, str]
    sequential: bool
    claimed_acceptance: Optional[float]
    claimed_block_efficiency: Optional[float]
    max_cells: int
    max_strata: int
    #: certify TV(F, q) <= certify_tv on the partition (None: no certification)
    certify_tv: Optional[float] = None
    #: the torch.distributed processes the chunks are spread over (None: this process)
    shards: Optional[object] = None

    @property
    def tv_confidence(self) -> float:
        """Level of the TV interval and of the certificate: ``1 - alpha``, the audit's error rate."""
        return 1.0 - self.alpha

    @property
    def one_iteration(self) -> bool:
        """Whether the completed strings are one iteration's (``N = L + 1``): acceptance is measured."""
        return self.num_tokens == self.draft_len + 1


@dataclasses.dataclass(frozen=True)
class _Plan:
    """The family of sub-tests, the bounds they test against, and the sample they are counted on."""

    #: the exactness family, in Holm order
    names: tuple
    #: each sub-test's Bonferroni share of alpha (the level the e-process stops at)
    test_alpha: float
    alpha_star: Optional[float]
    block_efficiency_bound: Optional[float]
    #: the draft tuples of the stratified design (None when it does not run)
    enumeration: Optional[DraftEnumeration]
    partition: PrefixPartition
    #: samples of the main design
    total: int
    stop_reason: str
    #: samples planned before any budget (for exactness: the power analysis; to certify: the certification plan)
    planned: int = 0


@dataclasses.dataclass
class _MainTally:
    """Running counts of the main (i.i.d.-draft) design."""

    counts: torch.Tensor
    num_samples: int = 0
    acceptance_count: int = 0
    length_sum: float = 0.0
    length_sq_sum: float = 0.0
    stop_reason: str = "planned"


@dataclasses.dataclass(frozen=True)
class _Samples:
    """What the sampling stage counted."""

    main: _MainTally
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


def _validate(common: CommonArgs, num_tokens, stratify, sequential, claimed_acceptance, claimed_block_efficiency,
              max_cells, max_strata, certify_tv=None, distributed="auto") -> _AuditArgs:
    """Validate stage: the audit's own arguments, after the shared ones."""
    draft_len = common.draft_len
    num_tokens = draft_len + 1 if num_tokens is None else check_positive_int("num_tokens", num_tokens, False)
    if num_tokens < draft_len + 1:
        raise InvalidArgument(f"num_tokens: must be >= draft_len + 1 = {draft_len + 1}, got {num_tokens}")
    if common.tree is not None and num_tokens != draft_len + 1:
        raise InvalidArgument(f"num_tokens: a tree audit samples one step, max_depth + 1 = {draft_len + 1} tokens; "
                              f"got {num_tokens}")
    if stratify not in (True, False, "auto"):
        raise InvalidArgument(f"stratify: expected True, False or 'auto', got {stratify!r}")
    if claimed_acceptance is not None and not 0 <= claimed_acceptance <= 1:
        raise InvalidArgument(f"claimed_acceptance: expected a number in [0, 1], got {claimed_acceptance!r}")
    if claimed_block_efficiency is not None and not 1 <= claimed_block_efficiency <= draft_len + 1:
        raise InvalidArgument(
            f"claimed_block_efficiency: expected a number in [1, {draft_len + 1}], got {claimed_block_efficiency!r}")
    if certify_tv is not None and (isinstance(certify_tv, bool) or not isinstance(certify_tv, (int, float))
                                   or not 0 < certify_tv < 1):
        raise InvalidArgument(f"certify_tv: expected a number in (0, 1), got {certify_tv!r}")
    if not (isinstance(distributed, bool) or distributed == "auto" or hasattr(distributed, "rank")):
        raise InvalidArgument(f"distributed: expected 'auto', True, False or a process group, got {distributed!r}")
    return _AuditArgs(**vars(common), num_tokens=num_tokens, stratify=stratify, sequential=sequential,
                      claimed_acceptance=claimed_acceptance, claimed_block_efficiency=claimed_block_efficiency,
                      max_cells=max_cells, max_strata=max_strata,
                      certify_tv=None if certify_tv is None else float(certify_tv),
                      shards=current_shards(distributed))


def _certification_plan(args: _AuditArgs) -> tuple[int, PrefixPartition]:
    """The partition to certify on and the first look at which an exact verifier is certified with ``power``.

    The partition is grown for the planned sample (cells of expected count >= ``min_expected``),
    and the sample planned for that partition; two or three rounds reach a fixed point.  The
    partition is fixed before any sample is drawn.
    """
    num_samples = 1 << 16
    partition = None
    for _ in range(6):
        partition = build_partition(args.target_model, args.num_tokens, num_samples, prefix=args.prefix,
                                    min_expected=args.min_expected, max_cells=args.max_cells, device=args.device)
        needed = certification_samples(args.certify_tv, partition.cell_probs, args.tv_confidence, args.power,
                                       chunk_schedule(1 << 62, args.chunk_size))
        if needed is None:
            raise InvalidArgument(f"certify_tv: {args.certify_tv:g} cannot be certified within 2^40 samples on "
                                  f"{partition.num_cells} cells; ask for a larger tolerance")
        if needed == num_samples:
            break
        num_samples = needed
    return needed, partition


def _plan(args: _AuditArgs) -> _Plan:
    """Plan stage: the bounds, the family of sub-tests, the sample size and its partition."""
    draft_model, target_model = args.draft_model, args.target_model
    num_drafts, draft_len, prefix = args.num_drafts, args.draft_len, args.prefix
    one_iteration = args.one_iteration
    if args.tree is not None:
        # a tree: alpha* for the root's children and, for deterministic drafts, the accepted-length
        # bound in closed form (docs/audit/bounds.md); no stratified design
        alpha_star, block_efficiency_bound = _tree_bounds(args)
        enumeration = None
    else:
        draft_scheme = args.verifier.draft_scheme
        draft_root, target_root = root_laws(draft_model, target_model, prefix, args.device)
        alpha_star = _optimal_acceptance(draft_root, target_root, num_drafts, draft_scheme) if one_iteration else None
        block_efficiency_bound = (
            _block_efficiency_bound(draft_model, target_model, prefix, num_drafts, draft_len, args.device)
            if one_iteration and draft_len >= 2 and draft_scheme == "iid" else None)
        enumeration = (_draft_enumeration(draft_model, target_model, num_drafts, draft_len, draft_scheme, prefix,
                                          draft_root, args.stratify, args.max_strata) if one_iteration else None)
    names = ["pearson", "g-test"]
    names += ["acceptance<=optimal"] if alpha_star is not None else []
    names += ["block-efficiency<=bound"] if block_efficiency_bound is not None else []
    names += ["e-process"] if args.sequential else []
    if args.certify_tv is not None:
        # Certifying: the sample is planned for the certificate, and the stratified design (a test
        # of exactness with no interval) does not run.
        enumeration = None
        planned, partition = _certification_plan(args)
    else:
        planned, partition = plan_sample_size(
            target_model, args.num_tokens, prefix=prefix, alpha=args.alpha, min_detectable_tv=args.min_detectable_tv,
            power=args.power, num_tests=len(names) + (enumeration is not None), min_expected=args.min_expected,
            max_cells=args.max_cells, device=args.device,
        )
    total, stop_reason = budgeted(planned, args.num_samples, args.max_samples)
    if total != planned:
        partition = build_partition(target_model, args.num_tokens, total, prefix=prefix,
                                    min_expected=args.min_expected, max_cells=args.max_cells, device=args.device)
    if args.stratify == "auto" and enumeration is not None and (
        total < MIN_PER_STRATUM * enumeration.weights.numel() or partition.num_cells > MAX_STRATIFIED_CELLS
    ):
        enumeration = None
    names += ["stratified-pearson"] if enumeration is not None else []
    return _Plan(tuple(names), args.alpha / len(names), alpha_star, block_efficiency_bound, enumeration, partition,
                 total, stop_reason, planned)


def _sample(args: _AuditArgs, plan: _Plan) -> _Samples:
    """Sample stage: the main design, then the stratified one unless the main design already decided.

    Every chunk draws from its own generator (:func:`spectr_audit.statistical.sharding.chunk_generator`),
    so the counts do not depend on how the chunks are spread over processes.
    """
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
    return _Samples(main, strat_counts, eprocess, stop_reason, time.perf_counter() - start, tv, certification)


def _run_main(args: _AuditArgs, plan: _Plan, eprocess, sequence: TVConfidenceSequence, deadline) -> _MainTally:
    """Stream chunks of the i.i.d.-draft design into counts; stop early on certainty or a budget."""
    partition = plan.partition
    num_cells = partition.num_cells
    tally = _MainTally(torch.zeros(num_cells, dtype=torch.float64))
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


def _run_stratified(args: _AuditArgs, plan: _Plan, deadline) -> tuple[torch.Tensor, bool]:
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


def _exactness_tests(args: _AuditArgs, plan: _Plan, samples: _Samples) -> list[TestResult]:
    """The exactness family's sub-tests, in the order of ``plan.names``."""
    main, probs = samples.main, plan.partition.cell_probs
    results: dict[str, TestResult] = {}
    for name, test in (("pearson", pearson_test), ("g-test", g_test)):
        results[name] = with_min_detectable_tv(test(main.counts, probs, args.min_expected), main.num_samples,
                                               plan.test_alpha, args.power)
    if plan.alpha_star is not None:
        results["acceptance<=optimal"] = binomial_above(
            main.acceptance_count, main.num_samples, plan.alpha_star, "acceptance<=optimal",
            f"P(first emitted token among the drafts' first tokens) vs alpha* = {plan.alpha_star:.6g}")
    if plan.block_efficiency_bound is not None:
        results["block-efficiency<=bound"] = mean_above(
            main.length_sum, main.length_sq_sum, main.num_samples, plan.block_efficiency_bound,
            "block-efficiency<=bound",
            f"mean emitted length vs 1 + sum_i alpha*(p^i, q^i, K) = {plan.block_efficiency_bound:.6g} (z statistic)")
    if samples.eprocess is not None:
        results["e-process"] = samples.eprocess.result()
    strat_counts = samples.strat_counts
    if plan.enumeration is not None:
        if strat_counts is not None and bool((strat_counts.sum(1) >= 2).all()):
            results["stratified-pearson"] = stratified_pearson_test(
                strat_counts, plan.enumeration.weights, probs, args.min_expected,
                max_cells=max(MAX_STRATIFIED_CELLS, plan.partition.num_cells))
        else:
            results["stratified-pearson"] = TestResult(
                "stratified-pearson", math.nan, 1.0, None, samples.strat_samples,
                detail="not run: stopped before every draft tuple had 2 samples")
    return [results[name] for name in plan.names]


def _support_violations(partition: PrefixPartition, samples: _Samples) -> float:
    """Completed strings, of both designs, in cells of target probability 0."""
    impossible = partition.cell_probs == 0
    violations = float(samples.main.counts[impossible].sum())
    if samples.strat_counts is not None:
        violations += float(samples.strat_counts.sum(0)[impossible].sum())
    return violations


def _optimality_tests(args: _AuditArgs, plan: _Plan, main: _MainTally) -> tuple[tuple, Optional[float]]:
    """The optimality family (Holm within it) and the acceptance claimed (given, or SpecTr's guarantee)."""
    claimed_acceptance = args.claimed_acceptance
    if (claimed_acceptance is None and plan.alpha_star is not None and "spectr" in args.verifier.guarantees
            and args.tree is None and args.verifier.draft_scheme == "iid"):
        claimed_acceptance = spectr_guarantee(args.num_drafts) * plan.alpha_star
    tests = []
    if claimed_acceptance is not None and args.one_iteration:
        tests.append(binomial_below(main.acceptance_count, main.num_samples, claimed_acceptance,
                                    "acceptance>=claimed", f"acceptance vs the claimed {claimed_acceptance:.6g}"))
    claimed_block_efficiency = args.claimed_block_efficiency
    if claimed_block_efficiency is not None and args.one_iteration:
        tests.append(mean_below(main.length_sum, main.length_sq_sum, main.num_samples, claimed_block_efficiency,
                                "block-efficiency>=claimed",
                                f"mean emitted length vs the claimed {claimed_block_efficiency:.6g} (z statistic)"))
    return holm_family(tests), claimed_acceptance


def _digest(counts: torch.Tensor, strat_counts: Optional[torch.Tensor]) -> str:
    """SHA-256 of the counts (main design, then the stratified one): equal digests, equal counts."""
    import hashlib

    digest = hashlib.sha256(counts.double().contiguous().numpy().tobytes())
    if strat_counts is not None:
        digest.update(strat_counts.double().contiguous().numpy().tobytes())
    return digest.hexdigest()


def _test(args: _AuditArgs, plan: _Plan, samples: _Samples) -> StatisticalAuditResult:
    """Test stage: the exactness family (Holm, then the support check), the optimality family, the result."""
    main, partition = samples.main, plan.partition
    family = holm_family(_exactness_tests(args, plan, samples))
    violations = _support_violations(partition, samples)
    stop_reason = samples.stop_reason
    if violations:
        stop_reason = "support" if stop_reason in ("planned", "support") else stop_reason
    support = support_test(violations, main.num_samples + samples.strat_samples,
                           "completed strings of target probability 0 (any one proves inexactness)")
    deciding = deciding_test(family, support)
    optimality, claimed_acceptance = _optimality_tests(args, plan, main)
    pearson = family[plan.names.index("pearson")]
    power_left = (sizing.chi2_power(main.num_samples * sizing.effect_size_for_tv(args.min_detectable_tv) ** 2,
                                    pearson.num_cells, plan.test_alpha) if pearson.num_cells >= 2 else 0.0)
    one_iteration = args.one_iteration
    return StatisticalAuditResult(
        verifier=args.verifier.name,
        test=deciding.name,
        statistic=deciding.statistic,
        pvalue=float(deciding.pvalue_adjusted),
        alpha=args.alpha,
        num_samples=main.num_samples + samples.strat_samples,
        seed=args.seed,
        min_detectable_tv=pearson.min_detectable_tv,
        power=args.power,
        subtests=family + (support,),
        worst_cells=worst_cells(main.counts, main.num_samples * partition.cell_probs, partition.describe),
        seconds=samples.seconds,
        requested_tv=float(args.min_detectable_tv),
        power_at_requested_tv=power_left,
        num_tests=len(plan.names),
        num_tokens=args.num_tokens,
        num_cells=partition.num_cells,
        pooled_mass=pearson.pooled_mass,
        full_partition=partition.is_full,
        optimality=optimality,
        acceptance_count=main.acceptance_count if one_iteration else 0,
        acceptance_samples=main.num_samples if one_iteration else 0,
        optimal_acceptance=plan.alpha_star,
        claimed_acceptance=claimed_acceptance,
        length_sum=main.length_sum if one_iteration else 0.0,
        length_sq_sum=main.length_sq_sum if one_iteration else 0.0,
        block_efficiency_bound=plan.block_efficiency_bound,
        stop_reason=stop_reason,
        tv_estimate=math.nan if samples.tv is None else samples.tv.estimate,
        tv_lower=0.0 if samples.tv is None else samples.tv.lower,
        tv_upper=1.0 if samples.tv is None else samples.tv.upper,
        tv_confidence=args.tv_confidence,
        partition=partition.summary(),
        planned_samples=plan.planned,
        certify_tv=args.certify_tv,
        certification=samples.certification,
        num_processes=1 if args.shards is None else args.shards.world_size,
        counts_digest=_digest(main.counts, samples.strat_counts),
    )


# ---------------------------------------------------------------------------------------------
# The audit
# ---------------------------------------------------------------------------------------------


def statistical_audit(
    verifier,
    draft_model: Model,
    target_model: Model,
    num_drafts: int,
    draft_len: int = 1,
    *,
    num_tokens: Optional[int] = None,
    prefix: Sequence[int] = (),
    alpha: float = DEFAULT_ALPHA,
    min_detectable_tv: float = DEFAULT_MIN_DETECTABLE_TV,
    power: float = DEFAULT_POWER,
    num_samples: Optional[int] = None,
    max_samples: Optional[int] = None,
    max_seconds: Optional[float] = None,
    seed: int = 0,
    device: Union[str, torch.device] = "cpu",
    chunk_size: Optional[int] = None,
    stratify: Union[bool, str] = "auto",
    sequential: bool = True,
    claimed_acceptance: Optional[float] = None,
    claimed_block_efficiency: Optional[float] = None,
    min_expected: float = MIN_EXPECTED,
    max_cells: int = 1 << 20,
    max_strata: int = 4096,
    certify_tv: Optional[float] = None,
    distributed: Union[bool, str, object] = "auto",
    tree=None,
    draft_scheme: Optional[str] = None,
    params=None,
    order="vllm",
) -> StatisticalAuditResult:
    """Audit a (black-box) verifier's exactness from its emitted strings.

    With ``tree`` (a :class:`~spectr_audit.contract.tree.DraftTree`) the verifier is a tree
    verifier and each sample drafts the tree under ``draft_scheme``: see :func:`statistical_tree_audit`.

    Parameters
    ----------
    verifier : Verifier, class, object with ``verify``, or function
        Converted with :func:`spectr_audit.contract.verifier.as_verifier`; only ``verify`` is used.
    draft_model, target_model : Model
        Draft and target next-token models (context-free, Markov, or any
        :class:`~spectr_audit.drafting.models.Model`).
    num_drafts : int
        K.
    draft_len : int
        L.
    num_tokens : int, optional
        N, the length the emitted strings are completed to; default ``L + 1`` (one
        iteration).  Larger values run the decoding loop (:func:`spectr_audit.drafting.decoding.decode`)
        for as many iterations as N tokens take.
    prefix : sequence of int
        The context before the audited step.
    alpha : float
        False-alarm rate of the whole audit (Holm over its sub-tests).  Default 1e-3.
    min_detectable_tv : float
        The TV distance the sample size is planned to detect.  Default 0.005.
    power : float
        Probability of flagging a verifier at that TV.  Default 0.99.
    num_samples : int, optional
        Run exactly this many samples in the main design instead of the planned number.
    max_samples : int, optional
        Budget: cap the main design's samples (the result reports the power that remains).
    max_seconds : float, optional
        Budget: stop sampling after this much wall time (half of it for the main design when
        the stratified design runs too).
    seed : int
        Seeds the one ``torch.Generator`` used for drafts, verdicts and completions.
    device : str or torch.device
    chunk_size : int, optional
        Rows per verifier call; default ``target_probs`` of about 8 MB on a CPU (256 MB on an
        accelerator), at most 2^18 rows (:func:`spectr_audit.statistical.sampling.default_chunk_size`).
    stratify : bool or "auto"
        Run the per-draft-tuple stratified test; ``"auto"``: when the draft tuples number at
        most ``max_strata`` and each gets 32 samples on average.  Its sample has the main
        design's size.
    sequential : bool
        Include the e-process and stop early when it alone already rejects.
    claimed_acceptance : float, optional
        Acceptance the verifier claims; defaults to the SpecTr guarantee
        ``(1 - (1 - 1/K)^K) alpha*`` for verifiers that declare ``"spectr"``.
    claimed_block_efficiency : float, optional
        Block efficiency (mean emitted length) the verifier claims.
    min_expected : float
        Cells with a smaller expected count are pooled.
    max_cells : int
        Cap on the partition's cells (a coarser prefix partition beyond it).
    max_strata : int
        Largest number of draft tuples for the stratified test.
    certify_tv : float, optional
        Certify ``TV(F, q) <= certify_tv`` on the partition: the sample is planned so that an
        exact verifier is certified with probability ``power``, and the audit stops at the first
        chunk where the anytime-valid upper bound is at most ``certify_tv`` (``"certified"``)
        or the lower bound above it (``"refuted"``); the stratified design does not run.  The
        certificate's error rate is ``alpha``.
    distributed : "auto", bool or process group
        Spread the chunks over a ``torch.distributed`` group (``"auto"``: the default group when
        one is initialised with several processes).  Counts and verdicts are bit-identical
        for any number of processes (:mod:`spectr_audit.statistical.sharding`); every process
        must call the audit with the same arguments.
    params : SamplingParams, optional
        Sampling parameters (one setting, scalars).  The models are then raw: drafts come from
        the processed draft law, completions and tests from the processed target law
        (:func:`~spectr_audit.contract.sampling.process_logits` with ``order``), the bounds are
        those of the processed laws, and a verifier that takes logits is handed the raw logits
        of every node and ``params`` (:func:`~spectr_audit.contract.logits.verify_with_params`;
        docs/sampling.md).  One iteration only (``num_tokens = L + 1``) for such a verifier.
    order : str, sequence of str or ProcessingOrder
        The engine's processing conventions (default ``"vllm"``).

    Returns
    -------
    StatisticalAuditResult

    Raises
    ------
    InvalidArgument
        On bad arguments, or a verifier that does not support (K, L).
    VerifierError
        When the verifier breaks the output contract.

    Notes
    -----
    Every result carries an estimate of ``TV(F, q)`` on the partition (``tv_estimate``), with
    an interval at level ``1 - alpha`` valid at the audit's stopping time (``tv_lower``,
    ``tv_upper``; :mod:`spectr_audit.statistical.confidence`), computed from the main design.
    A result that rejects nothing while its achieved ``min_detectable_tv`` is above the one
    asked for (a budget, a fixed ``num_samples``) has the verdict ``"INCONCLUSIVE"``.

    Validity: the Pearson and G tests are asymptotic (every pooled cell has an expected count
    of at least ``min_expected``); the binomial tests are exact; the stratified test is
    asymptotic in the per-tuple counts; the e-process is exact at any stopping time.
    ``min_detectable_tv`` refers to TV on the audited partition: when it is not the full V^N
    (``full_partition`` False) deviations inside a cell are not seen.  Acceptance and block
    efficiency are measured for one iteration only (``num_tokens = L + 1``).

    A verifier that returns a carried correction (:mod:`spectr_audit.contract.correction`) is judged
    together with it: completions follow the corrected target, as the decoding loop would.

    Examples
    --------
    >>> from spectr_audit.drafting.models import ContextFreeModel
    >>> from spectr_audit.registry import load_verifier
    >>> result = statistical_audit(load_verifier("speculative"), ContextFreeModel([0.6, 0.4]),
    ...                            ContextFreeModel([0.3, 0.7]), num_drafts=1, num_samples=20_000)
    >>> result.rejects(), result.num_tests
    (False, 5)
    """
    if params is not None:
        verifier, draft_model, target_model = _with_params(verifier, draft_model, target_model, params, order, prefix,
                                                           num_tokens, draft_len, tree)
    # validate -> plan -> sample -> test; validation and the stages' plumbing are shared (_stages)
    common = validate_common(
        verifier, draft_model, target_model, num_drafts, draft_len, prefix=prefix, alpha=alpha,
        min_detectable_tv=min_detectable_tv, power=power, num_samples=num_samples, max_samples=max_samples,
        max_seconds=max_seconds, seed=seed, device=device, chunk_size=chunk_size, min_expected=min_expected,
        tree=tree, draft_scheme=draft_scheme,
    )
    args = _validate(common, num_tokens, stratify, sequential, claimed_acceptance, claimed_block_efficiency,
                     max_cells, max_strata, certify_tv, distributed)
    plan = _plan(args)
    return _test(args, plan, _sample(args, plan))


def _with_params(verifier, draft_model, target_model, params, order, prefix, num_tokens, draft_len, tree):
    """The verifier and models to audit with sampling parameters (:func:`spectr_audit.drafting.processed.bind_params`)."""
    from spectr_audit.contract.logits import as_logits_verifier, takes_logits
    from spectr_audit.drafting.processed import bind_params

    if takes_logits(verifier) or callable(getattr(verifier, "verify_logits", None)):
        if tree is not None:
            raise InvalidArgument("params: a verifier that takes logits verifies chains; a tree audit hands "
                                  "processed probabilities to tree verifiers")
        if num_tokens is not None and num_tokens != draft_len + 1:
            raise InvalidArgument(f"num_tokens: a verifier that takes logits is audited for one iteration "
                                  f"(num_tokens = draft_len + 1 = {draft_len + 1}) by the statistical audit; the exact "
                                  f"multi-iteration audit takes it over more, got {num_tokens}")
        verifier = as_logits_verifier(verifier)
    return bind_params(verifier, draft_model, target_model, params, order, prefix)


def statistical_tree_audit(
    verifier,
    draft_model: Model,
    target_model: Model,
    tree,
    *,
    draft_scheme: Optional[str] = None,
    **kwargs,
) -> StatisticalAuditResult:
    """Audit a (black-box) tree verifier's exactness from its emitted strings on ``tree``.

    The pipeline of :func:`statistical_audit` (validate -> plan -> sample -> test, same arguments
    as keywords), each sample a fresh draft of ``tree`` under ``draft_scheme``
    (:func:`spectr_audit.drafting.tree.draft_tree`; default the verifier's first scheme), the
    emitted string (1 to ``max_depth + 1`` tokens) completed with target samples to
    ``max_depth + 1`` tokens.  ``acceptance<=optimal`` tests the root's membership acceptance
    against the tree's alpha* (docs/audit/bounds.md); under ``topk`` and ``none``
    ``block-efficiency<=bound`` tests the mean emitted length against ``1 + sum_n q(path(n))``.
    The stratified design and the multi-iteration run are for chains only.

    Parameters
    ----------
    verifier : TreeVerifier, or anything :func:`~spectr_audit.contract.tree_verifier.as_tree_verifier` takes
    draft_model, target_model : Model
    tree : DraftTree
    draft_scheme : str, optional
        One of the verifier's ``draft_schemes``.
    **kwargs
        Any keyword of :func:`statistical_audit` (``alpha``, ``num_samples``, ``max_samples``,
        ``seed``, ...).

    Examples
    --------
    >>> from spectr_audit.contract.tree import DraftTree
    >>> from spectr_audit.drafting.models import ContextFreeModel
    >>> from spectr_audit.registry import load_tree_verifier
    >>> tree = DraftTree.from_paths([(0,), (1,), (0, 0)])
    >>> result = statistical_tree_audit(load_tree_verifier("tree-target-only"), ContextFreeModel([0.5, 0.3, 0.2]),
    ...                                 ContextFreeModel([0.2, 0.3, 0.5]), tree, draft_scheme="topk",
    ...                                 num_samples=20_000)
    >>> result.rejects()
    False
    """
    from spectr_audit.contract.tree import DraftTree

    if not isinstance(tree, DraftTree):
        raise InvalidArgument(f"tree: expected a DraftTree, got {type(tree).__name__}")
    return statistical_audit(verifier, draft_model, target_model, len(tree.children[0]), tree.max_depth,
                             tree=tree, draft_scheme=draft_scheme, **kwargs)
