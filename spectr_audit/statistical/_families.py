"""The statistical audit's test stage (private): the two families of sub-tests, and the result.

The exactness family (a G-test per depth, acceptance against alpha*, block efficiency against
its bound, the e-process, the stratified Pearson test) is Holm-adjusted and joined by the
support check; the sub-test that decides gives the audit's p-value.  The optimality family
(acceptance and block efficiency against what is claimed) is reported apart, Holm within it.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Optional, Sequence

import torch

from spectr_audit.bounds.acceptance import spectr_guarantee
from spectr_audit.statistical import power as sizing
from spectr_audit.statistical._audit_args import AuditArgs
from spectr_audit.statistical._designs import MainTally, Samples
from spectr_audit.statistical._planning import MAX_STRATIFIED_CELLS, Plan
from spectr_audit.statistical._stages import family_result, holm_family, support_test, with_min_detectable_tv
from spectr_audit.statistical.gof import (
    TestResult,
    binomial_above,
    binomial_below,
    g_test,
    mean_above,
    mean_below,
    stratified_pearson_test,
)
from spectr_audit.statistical.partition import PrefixPartition
from spectr_audit.statistical.results import DepthResult, StatisticalAuditResult, worst_cells


def _exactness_tests(args: AuditArgs, plan: Plan, samples: Samples) -> list[TestResult]:
    """The exactness family's sub-tests, in the order of ``plan.names``."""
    main = samples.main
    results: dict[str, TestResult] = {}
    views = [(t.counts(main.counts), t.cell_probs, t.depth) for t in plan.truncations]
    views.append((main.counts, plan.partition.cell_probs, plan.partition.num_tokens))
    for name, (counts, probs, depth) in zip(plan.depth_names, views):
        result = g_test(counts, probs, args.min_expected)
        what = "completed strings" if depth == plan.partition.num_tokens else f"the first {depth} tokens"
        result = dataclasses.replace(result, name=name, detail=f"G-test (likelihood ratio) of {what} vs the target law")
        results[name] = with_min_detectable_tv(result, main.num_samples, plan.test_alpha, args.power)
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
    if plan.strata is not None:
        strat_counts = samples.strat_counts
        if main.unstratified == 0 and bool((strat_counts.sum(1) >= 2).all()):
            results["stratified-pearson"] = stratified_pearson_test(
                strat_counts, plan.strata.group_probs, plan.partition.cell_probs, args.min_expected,
                max_cells=max(MAX_STRATIFIED_CELLS, plan.partition.num_cells))
        else:
            why = ("drafts outside the enumerated tuples" if main.unstratified
                   else "a draft-tuple stratum had fewer than 2 samples")
            results["stratified-pearson"] = TestResult("stratified-pearson", math.nan, 1.0, None, main.num_samples,
                                                       detail=f"not run: {why}")
    return [results[name] for name in plan.names]


def _support_violations(partition: PrefixPartition, samples: Samples) -> float:
    """Completed strings in cells of target probability 0."""
    return float(samples.main.counts[partition.cell_probs == 0].sum())


def _depth_results(plan: Plan, family: Sequence[TestResult], samples: Samples) -> tuple[DepthResult, ...]:
    """Per depth: its G-test and its TV bounds."""
    tests = {t.name: t for t in family}
    bounds = {} if samples.tv is None else {b.depth: b for b in samples.tv.depths()}
    depths = [t.depth for t in plan.truncations] + [plan.partition.num_tokens]
    out = []
    for depth, name in zip(depths, plan.depth_names):
        test, bound = tests[name], bounds.get(depth)
        out.append(DepthResult(
            depth=depth, test=name, num_cells=int(test.num_cells or 0), pvalue=test.pvalue,
            pvalue_adjusted=test.pvalue_adjusted, min_detectable_tv=test.min_detectable_tv,
            tv_plug_in=math.nan if bound is None else bound.plug_in,
            tv_noise_floor=math.nan if bound is None else bound.noise_floor,
            tv_lower=0.0 if bound is None else bound.lower, tv_upper=1.0 if bound is None else bound.upper))
    return tuple(out)


def _optimality_tests(args: AuditArgs, plan: Plan, main: MainTally) -> tuple[tuple, Optional[float]]:
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


def judge_audit(args: AuditArgs, plan: Plan, samples: Samples) -> StatisticalAuditResult:
    """Test stage: the exactness family (Holm, then the support check), the optimality family, the result."""
    main, partition = samples.main, plan.partition
    family = holm_family(_exactness_tests(args, plan, samples))
    violations = _support_violations(partition, samples)
    stop_reason = samples.stop_reason
    if violations:
        stop_reason = "support" if stop_reason in ("planned", "support") else stop_reason
    support = support_test(violations, main.num_samples,
                           "completed strings of target probability 0 (any one proves inexactness)")
    optimality, claimed_acceptance = _optimality_tests(args, plan, main)
    full = family[plan.names.index("g-test")]
    power_left = (sizing.chi2_power(main.num_samples * sizing.effect_size_for_tv(args.min_detectable_tv) ** 2,
                                    full.num_cells, plan.test_alpha) if full.num_cells >= 2 else 0.0)
    one_iteration = args.one_iteration
    tv = samples.tv
    return family_result(
        StatisticalAuditResult, args, family, support,
        num_samples=main.num_samples,
        min_detectable_tv=full.min_detectable_tv,
        worst_cells=worst_cells(main.counts, main.num_samples * partition.cell_probs, partition.describe),
        seconds=samples.seconds,
        requested_tv=float(args.min_detectable_tv),
        power_at_requested_tv=power_left,
        num_tests=len(plan.names),
        num_tokens=args.num_tokens,
        num_cells=partition.num_cells,
        pooled_mass=full.pooled_mass,
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
        tv_estimate=math.nan if tv is None else tv.estimate,
        tv_lower=0.0 if tv is None else tv.lower,
        tv_upper=1.0 if tv is None else tv.upper,
        tv_plug_in=math.nan if tv is None else tv.plug_in,
        tv_noise_floor=math.nan if tv is None else tv.floor,
        tv_confidence=args.tv_confidence,
        partition=partition.summary(),
        planned_samples=plan.planned,
        certify_tv=args.certify_tv,
        certification=samples.certification,
        num_processes=1 if args.shards is None else args.shards.world_size,
        counts_digest=_digest(main.counts, samples.strat_counts),
        depths=_depth_results(plan, family, samples),
        num_strata=0 if plan.strata is None else plan.strata.num_groups,
    )
