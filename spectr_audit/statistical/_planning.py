"""The statistical audit's plan stage (private): what the sub-tests test against, and how many samples.

Before any sample is drawn the plan fixes the bounds of the exactness sub-tests (alpha* and the
block-efficiency bound, :mod:`spectr_audit.bounds`), the draft-tuple strata the main sample is
post-stratified by (:mod:`spectr_audit.statistical.poststrata`), the depths tested beside the
full partition (:mod:`spectr_audit.statistical.depths`), the family of sub-tests in Holm order,
and the sample size with the partition it is counted on: planned for power
(:func:`plan_sample_size`) or for a certificate (docs/audit/statistical.md), then cut to the
budget.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Optional, Sequence, Union

import torch

from spectr_audit import defaults
from spectr_audit._validation import check_positive_int, check_prob
from spectr_audit.bounds.acceptance import optimal_acceptance
from spectr_audit.bounds.tree_lp import tree_optimal_acceptance, tree_paths_target_mass
from spectr_audit.contract.tree import DraftTree
from spectr_audit.drafting.models import Model, contexts_from
from spectr_audit.errors import InvalidArgument
from spectr_audit.exact.iteration import DraftEnumeration, enumerate_drafts
from spectr_audit.statistical import power as sizing
from spectr_audit.statistical._audit_args import AuditArgs
from spectr_audit.statistical._checks import chunk_schedule, root_laws
from spectr_audit.statistical._stages import budgeted
from spectr_audit.statistical.confidence import certification_samples
from spectr_audit.statistical.depths import depth_truncations
from spectr_audit.statistical.gof import MIN_EXPECTED
from spectr_audit.statistical.partition import PrefixPartition, build_partition
from spectr_audit.statistical.poststrata import PostStrata, post_strata
from spectr_audit.statistical.power import DEFAULT_ALPHA, DEFAULT_MIN_DETECTABLE_TV, DEFAULT_POWER

#: The stratified test runs (with ``stratify="auto"``) only when strata average this many samples...
MIN_PER_STRATUM = defaults.MIN_PER_STRATUM
#: ...and the partition has at most this many cells (its null needs an eigen-decomposition)...
MAX_STRATIFIED_CELLS = defaults.MAX_STRATIFIED_CELLS
#: ...and the stratified counts (strata x cells) stay this small (they travel with every chunk).
MAX_STRATIFIED_ENTRIES = defaults.MAX_STRATIFIED_ENTRIES
#: The block-efficiency bound is planned over joint laws of at most this many strings.
PLAN_MAX_BOUND_STRINGS = defaults.PLAN_MAX_BOUND_STRINGS


# ---------------------------------------------------------------------------------------------
# Bounds for the exactness sub-tests
# ---------------------------------------------------------------------------------------------


def _optimal_acceptance(args: AuditArgs, draft_root: torch.Tensor, target_root: torch.Tensor) -> Optional[float]:
    """alpha* at the first position for the verifier's drafting scheme, as a run computes it
    (:func:`spectr_audit.run.checks.optimality`): the closed form for i.i.d. drafts, the exact min-cut on
    ``DraftTree.chains(K, 1)`` without replacement; None beyond the min-cut's ``defaults.MIN_CUT_MAX_SUPPORT``."""
    if args.verifier.draft_scheme == "iid":
        return optimal_acceptance(draft_root, target_root, args.num_drafts).item()
    try:
        return tree_optimal_acceptance(args.draft_model, args.target_model, DraftTree.chains(args.num_drafts, 1),
                                       args.verifier.draft_scheme, args.prefix)[0]
    except InvalidArgument:
        return None


def _block_efficiency_bound(draft_model, target_model, prefix, num_drafts, draft_len, device,
                            max_strings: int = PLAN_MAX_BOUND_STRINGS) -> Optional[float]:
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


def _tree_bounds(args: AuditArgs) -> tuple[Optional[float], Optional[float]]:
    """alpha* of the root's children under the tree's scheme, and ``1 +`` the closed-form accepted-length bound
    of deterministic drafts (``topk`` / ``none``, depth >= 2); None where either is out of reach."""
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
# The sample size and its partition
# ---------------------------------------------------------------------------------------------


def _partition_fixed_point(
    target_model: Model,
    num_tokens: int,
    num_samples: int,
    samples_for: Callable[[PrefixPartition, int], int],
    *,
    prefix,
    min_expected: float,
    max_cells: int,
    device,
) -> tuple[int, PrefixPartition]:
    """Grow the partition for ``num_samples``, plan ``samples_for(partition, num_samples)`` on it, repeat.

    The partition's cells depend on the sample size and the sample size on the cells; two or
    three rounds reach the fixed point (six at most).  Returns the last size planned and the
    partition it was planned on.
    """
    partition = None
    for _ in range(6):
        partition = build_partition(target_model, num_tokens, num_samples, prefix=prefix, min_expected=min_expected,
                                    max_cells=max_cells, device=device)
        needed = samples_for(partition, num_samples)
        if needed == num_samples:
            break
        num_samples = needed
    return num_samples, partition


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
    max_cells: int = defaults.PARTITION_MAX_CELLS,
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

    def samples_for(partition: PrefixPartition, num_samples: int) -> int:
        # C: the kept cells, and the pooled one when its expected count is large enough
        probs = partition.cell_probs
        kept = int(((probs > 0) & (num_samples * probs >= min_expected)).sum())
        pooled = float(probs[(probs > 0) & (num_samples * probs < min_expected)].sum())
        cells = max(2, kept + (1 if num_samples * pooled >= min_expected else 0))
        return sizing.required_samples(min_detectable_tv, cells, test_alpha, power)

    return _partition_fixed_point(target_model, num_tokens,
                                  sizing.required_samples(min_detectable_tv, cells, test_alpha, power), samples_for,
                                  prefix=prefix, min_expected=min_expected, max_cells=max_cells, device=device)


def _certification_plan(args: AuditArgs) -> tuple[int, PrefixPartition]:
    """The partition to certify on and the first look at which an exact verifier is certified with ``power``.

    The partition is grown for the planned sample (cells of expected count >= ``min_expected``),
    and the sample planned for that partition; two or three rounds reach a fixed point.  The
    partition is fixed before any sample is drawn.
    """

    def samples_for(partition: PrefixPartition, num_samples: int) -> int:
        # P's interval gets its share of the error budget (docs/audit/statistical.md: TVBounds)
        share = (1.0 - args.tv_confidence) / (len(depth_truncations(partition)) + 2)
        needed = certification_samples(args.certify_tv, partition.cell_probs, 1.0 - share, args.power,
                                       chunk_schedule(1 << 62, args.chunk_size))
        if needed is None:
            raise InvalidArgument(f"certify_tv: {args.certify_tv:g} cannot be certified within 2^40 samples on "
                                  f"{partition.num_cells} cells; ask for a larger tolerance")
        return needed

    return _partition_fixed_point(args.target_model, args.num_tokens, 1 << 16, samples_for, prefix=args.prefix,
                                  min_expected=args.min_expected, max_cells=args.max_cells, device=args.device)


# ---------------------------------------------------------------------------------------------
# The plan
# ---------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Plan:
    """The family of sub-tests, the bounds they test against, and the sample they are counted on."""

    #: the exactness family, in Holm order
    names: tuple
    #: each sub-test's Bonferroni share of alpha (the level the e-process stops at)
    test_alpha: float
    alpha_star: Optional[float]
    block_efficiency_bound: Optional[float]
    #: the draft-tuple strata of the main sample (None when the stratified test does not run)
    strata: Optional[PostStrata]
    partition: PrefixPartition
    #: samples of the main design
    total: int
    stop_reason: str
    #: samples planned before any budget (for exactness: the power analysis; to certify: the certification plan)
    planned: int = 0
    #: the shallower depths tested beside the full partition (``g-test@d``), shallowest first
    truncations: tuple = ()

    @property
    def depth_names(self) -> tuple:
        """The G-tests' names, shallowest depth first (the full partition's is ``"g-test"``)."""
        return tuple(f"g-test@{t.depth}" for t in self.truncations) + ("g-test",)


def _strata(args: AuditArgs, enumeration: Optional[DraftEnumeration], total: int,
            partition: PrefixPartition) -> Optional[PostStrata]:
    """The main sample's draft-tuple strata, when the stratified test applies to this plan."""
    if enumeration is None:
        return None
    strata = post_strata(enumeration, args.vocab_size, total, MIN_PER_STRATUM)
    if strata is None:
        return None
    if args.stratify == "auto" and (total < MIN_PER_STRATUM * enumeration.weights.numel()
                                    or partition.num_cells > MAX_STRATIFIED_CELLS):
        return None
    if strata.num_groups * partition.num_cells > MAX_STRATIFIED_ENTRIES:
        if args.stratify is True:
            raise InvalidArgument(f"stratify: {strata.num_groups} draft-tuple strata over {partition.num_cells} cells "
                                  f"exceed {MAX_STRATIFIED_ENTRIES} counts")
        return None
    return strata


def plan_audit(args: AuditArgs) -> Plan:
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
        alpha_star = _optimal_acceptance(args, draft_root, target_root) if one_iteration else None
        block_efficiency_bound = (
            _block_efficiency_bound(draft_model, target_model, prefix, num_drafts, draft_len, args.device)
            if one_iteration and draft_len >= 2 and draft_scheme == "iid" else None)
        enumeration = (_draft_enumeration(draft_model, target_model, num_drafts, draft_len, draft_scheme, prefix,
                                          draft_root, args.stratify, args.max_strata) if one_iteration else None)
    others = ["acceptance<=optimal"] if alpha_star is not None else []
    others += ["block-efficiency<=bound"] if block_efficiency_bound is not None else []
    others += ["e-process"] if args.sequential else []
    if args.certify_tv is not None:
        # Certifying: the sample is planned for the certificate, and the stratified test (a test
        # of exactness with no interval) does not run.
        enumeration = None
        planned, partition = _certification_plan(args)
    else:
        # planned for the largest family this case can have: one G-test per depth, the others, the
        # stratified test; the family the partition ends up with is no larger, so the power holds
        most = args.num_tokens + len(others) + (enumeration is not None)
        planned, partition = plan_sample_size(
            target_model, args.num_tokens, prefix=prefix, alpha=args.alpha, min_detectable_tv=args.min_detectable_tv,
            power=args.power, num_tests=most, min_expected=args.min_expected, max_cells=args.max_cells,
            device=args.device,
        )
    total, stop_reason = budgeted(planned, args.num_samples, args.max_samples)
    if total != planned:
        partition = build_partition(target_model, args.num_tokens, total, prefix=prefix,
                                    min_expected=args.min_expected, max_cells=args.max_cells, device=args.device)
    truncations = depth_truncations(partition)
    strata = _strata(args, enumeration, total, partition)
    names = [f"g-test@{t.depth}" for t in truncations] + ["g-test"] + others
    names += ["stratified-pearson"] if strata is not None else []
    return Plan(tuple(names), args.alpha / len(names), alpha_star, block_efficiency_bound, strata, partition,
                total, stop_reason, planned, truncations)
