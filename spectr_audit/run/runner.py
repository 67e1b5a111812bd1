"""Run audits: each verifier on each case it supports, every failure kept as a result.

One bad verifier (a crash, a contract breach) never loses the other results: the
audit of that verifier on that case becomes a result with ``error`` set.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import time
import traceback
from typing import Callable, Iterable, Optional, Sequence

import torch

from spectr_audit.bounds.acceptance import (
    optimal_acceptance,
    optimal_acceptance_lp,
    optimal_acceptance_lp_from_sets,
    spectr_guarantee,
)
from spectr_audit import defaults
from spectr_audit.contract.verifier import Verifier
from spectr_audit.errors import InvalidArgument, SpectrAuditError
from spectr_audit.exact.iteration import exact_iteration
from spectr_audit.drafting.models import contexts_from
from spectr_audit.registry import builtin_verifiers, load_verifier
from spectr_audit.results import AuditReport, AuditResult, Check
from spectr_audit.run import budget, guard
from spectr_audit.run.budget import check_block_lp, check_jobs
from spectr_audit.run.guard import probe_checks as guard_probe
from spectr_audit.run.incomplete import RunAborted, RunInterrupted, incomplete_report
from spectr_audit.run.options import AuditOptions
from spectr_audit.run.suite import Case, Suite, describe_tree_case

__all__ = ["AuditOptions", "audit_case", "audit_tree_case", "tree_fits", "declared_verdict", "error_result", "plan_jobs", "run_suite", "scheme_fits", "select_verifiers", "EXACT_TOL", "BOUND_TOL"]

# The tolerances of the checks (documented in spectr_audit.defaults).
EXACT_TOL = defaults.EXACT_TOL
MULTI_TOL = defaults.MULTI_TOL
BOUND_TOL = defaults.BOUND_TOL
LP_TOL = defaults.LP_TOL
#: Run the alpha* LP next to the closed form when it has at most this many variables.
LP_MAX_VARIABLES = defaults.LP_CROSS_CHECK_MAX_VARIABLES


def _said(passed: bool, held: str, failed: str) -> str:
    """A check's detail in the words of its outcome: ``held`` when it passed, ``failed`` when it did not.

    Reports print the detail beside the verdict, so a fixed text would contradict one of the two.
    """
    return held if passed else failed


def declared_verdict(verifier: Verifier) -> Optional[bool]:
    """The ``expected`` of the verifier's results: True declared exact, False declared inexact, None undeclared."""
    expected = getattr(verifier, "expected", None)
    return None if expected is None else expected == "exact"


def error_result(verifier: Verifier, case: str, exc: BaseException, checks: Sequence[Check] = (),
                 metrics: Optional[dict] = None) -> AuditResult:
    """The result of an audit that raised ``exc`` (call it in the ``except`` block): the error, a short
    traceback, the declaration, and whatever checks and metrics were done before."""
    return AuditResult(
        verifier=verifier.name, case=case, checks=tuple(checks), metrics=dict(metrics or {}),
        expected=declared_verdict(verifier), error=f"{type(exc).__name__}: {exc}",
        details={"traceback": traceback.format_exc(limit=4)},
    )


def _first_position(case: Case) -> tuple[torch.Tensor, torch.Tensor]:
    """The draft and target laws at the case's first position (processed, with sampling parameters)."""
    laws = case.laws() if hasattr(case, "laws") else case
    ctx = contexts_from(laws.prefix, torch.zeros(1, 0, dtype=torch.int64))
    return laws.draft_model(ctx)[0].double(), laws.target_model(ctx)[0].double()


def scheme_fits(verifier: Verifier, case: Case) -> bool:
    """Whether the case allows the verifier's drafting scheme (without replacement: L = 1, K <= support)."""
    if verifier.draft_scheme != "without_replacement":
        return True
    draft_first, _ = _first_position(case)
    return case.draft_len == 1 and int((draft_first > 0).sum()) >= case.num_drafts


def _without_replacement_sets(draft_first: torch.Tensor, num_drafts: int) -> dict:
    """Law of the set of K distinct drafts drawn without replacement (small supports only)."""
    support = [t for t in range(draft_first.numel()) if draft_first[t] > 0]
    if math.perm(len(support), num_drafts) > 200_000:
        raise InvalidArgument("num_drafts: too many ordered tuples for the without-replacement bound")
    sets: dict = {}
    mass = {t: float(draft_first[t]) for t in support}
    for tup in itertools.permutations(support, num_drafts):
        prob = 1.0
        for i, t in enumerate(tup):
            # the mass left, summed over undrawn tokens (1 - drawn mass would cancel)
            prob *= mass[t] / sum(m for s, m in mass.items() if s not in tup[:i])
        key = frozenset(tup)
        sets[key] = sets.get(key, 0.0) + prob
    return sets


def _optimality(case: Case, draft_scheme: str, metrics: dict, details: dict) -> Optional[float]:
    """alpha* for the case's first position under ``draft_scheme``; fills metrics and details."""
    draft_first, target_first = _first_position(case)
    if draft_scheme == "without_replacement":
        # The closed form min_T [q(T) + 1 - p(T)^K] is for i.i.d. drafts; without replacement the
        # set law differs, so the bound comes from the transport LP over that law.
        try:
            lp = optimal_acceptance_lp_from_sets(
                _without_replacement_sets(draft_first, case.num_drafts), target_first, max_variables=LP_MAX_VARIABLES
            )
        except InvalidArgument:
            details["optimal_acceptance_lp"] = "skipped: too large"
            return None
        metrics["optimal_acceptance"] = metrics["optimal_acceptance_lp"] = lp.value
        details["optimal_acceptance_lp"] = {"status": lp.status, "solver": lp.solver, "num_variables": lp.num_variables,
                                            "draft_scheme": draft_scheme}
        details["optimal_acceptance_source"] = "lp"
        return lp.value
    alpha_star = optimal_acceptance(draft_first, target_first, case.num_drafts).item()
    metrics["optimal_acceptance"] = alpha_star
    metrics["spectr_bound"] = spectr_guarantee(case.num_drafts) * alpha_star
    try:
        lp = optimal_acceptance_lp(draft_first, target_first, case.num_drafts, max_variables=LP_MAX_VARIABLES)
    except InvalidArgument:
        details["optimal_acceptance_lp"] = "skipped: too large"
    else:
        metrics["optimal_acceptance_lp"] = lp.value
        details["optimal_acceptance_lp"] = {"status": lp.status, "solver": lp.solver, "num_variables": lp.num_variables}
    return alpha_star


def _exact_checks(verifier, case, alpha_star, carries, checks, metrics, details) -> None:
    """Single-iteration exact law: exactness (the judge unless a repair is carried), prefix cap, acceptance."""
    audit = exact_iteration(
        verifier, case.draft_model, case.target_model, case.num_drafts, case.draft_len, prefix=case.prefix,
        **_sampling_args(case),
    )
    # With a carried repair one iteration alone is not meant to be exact: the multi-iteration
    # law is the judge; its single-iteration TV is reported for information only.
    _exact_law_checks(audit, "strings of length L + 1", "single iteration, unmodified continuation", checks, metrics,
                      details, judged=not carries, num_draft_tuples=audit.num_draft_tuples)
    if carries:
        metrics["single_iteration_tv_distance"] = metrics.pop("tv_distance")
        metrics["single_iteration_max_abs_error"] = metrics.pop("max_abs_error")
    if alpha_star is not None:
        acceptance = audit.acceptance
        # An LP optimum is only as accurate as the solver (about 1e-9 relative); the closed form is exact.
        tol = LP_TOL if details.get("optimal_acceptance_source") == "lp" else BOUND_TOL
        metrics["acceptance_ratio"] = acceptance / alpha_star if alpha_star > 0 else None
        below = acceptance <= alpha_star + tol
        checks.append(Check("acceptance<=optimal", below, acceptance, alpha_star, _said(
            below, "P(first emitted token in the drafts' first tokens) <= alpha*, as for every exact verifier",
            "P(first emitted token in the drafts' first tokens) above alpha*, which no exact verifier reaches")))
        if "optimal" in verifier.guarantees:
            reached = acceptance >= alpha_star - tol
            checks.append(Check("acceptance>=optimal", reached, acceptance, alpha_star, _said(
                reached, "reaches the optimal acceptance alpha* it claims",
                "below the optimal acceptance alpha* it claims")))
        if "spectr" in verifier.guarantees and "spectr_bound" in metrics:
            floor = metrics["spectr_bound"]
            kept = acceptance >= floor - BOUND_TOL
            checks.append(Check("spectr-guarantee", kept, acceptance, floor, _said(
                kept, "acceptance >= (1 - (1 - 1/K)^K) alpha*: SpecTr's guarantee kept",
                "acceptance below (1 - (1 - 1/K)^K) alpha*: SpecTr's guarantee broken")))


#: The metrics every exact audit (single iteration, tree) records under its own attribute's name.
_EXACT_LAW_METRICS = ("tv_distance", "max_abs_error", "token_tv_distance", "prefix_cap_excess", "acceptance",
                      "block_efficiency")


def _exact_law_checks(audit, strings: str, how: str, checks: list, metrics: dict, details: dict, *, judged: bool = True,
                      extra_details: Optional[dict] = None, **counts) -> None:
    """An exact audit's law, of a chain or of a tree: its metrics and details, and the ``exact`` and ``prefix-cap`` checks.

    ``strings`` and ``how`` say what the law is over in the ``exact`` detail (:func:`_exact_detail`);
    ``judged=False`` leaves the ``exact`` check out.  ``counts`` are the audit's own metrics (recorded
    after the shared ones), ``extra_details`` its own details (before ``worst_prefix``).
    """
    metrics.update({name: getattr(audit, name) for name in _EXACT_LAW_METRICS}, **counts)
    details["worst_strings"] = audit.worst_strings()
    details["first_token_law"] = audit.first_token_law.tolist()
    details["target_first_token_law"] = audit.target_law[0].tolist()
    details.update(extra_details or {})
    if audit.prefix_cap_excess > 0:
        details["worst_prefix"] = list(audit.worst_prefix)
    if judged:
        exact = audit.max_abs_error <= EXACT_TOL
        checks.append(Check("exact", exact, audit.max_abs_error, EXACT_TOL, _exact_detail(exact, strings, how)))
    capped = audit.prefix_cap_excess <= EXACT_TOL
    checks.append(Check("prefix-cap", capped, audit.prefix_cap_excess, EXACT_TOL, _prefix_cap_detail(capped)))


def _exact_detail(passed: bool, strings: str, how: str) -> str:
    """The ``exact`` check's detail: the implied law is the target's, or not, over ``strings``."""
    return _said(passed, f"max |F(w) - q(w)| over {strings} within the tolerance: the implied law is the target's ({how})",
                 f"max |F(w) - q(w)| over {strings} above the tolerance: the implied law is not the target's ({how}; "
                 "the worst strings are listed)")


def _prefix_cap_detail(passed: bool) -> str:
    """The ``prefix-cap`` check's detail."""
    return _said(passed, "max over prefixes u of B(u) - q(u) within the tolerance: no prefix is emitted more often "
                 "than the target allows",
                 "a prefix u has B(u) - q(u) above the tolerance: no later correction can repair the step")


def _multi_iteration_check(verifier, case, checks, metrics, details) -> None:
    from spectr_audit.exact.multi_iteration import exact_multi_iteration

    num_tokens = case.num_tokens or case.draft_len + 1
    audit = exact_multi_iteration(
        verifier, case.draft_model, case.target_model, case.num_drafts, case.draft_len, num_tokens, prefix=case.prefix,
        **_sampling_args(case),
    )
    metrics.update(tv_distance=audit.tv_distance, max_abs_error=audit.max_abs_error,
                   multi_iteration_tokens=num_tokens, multi_iteration_prefix_cap_excess=audit.prefix_cap_excess)
    details["multi_iteration"] = {"num_tokens": num_tokens, "num_histories": audit.num_histories,
                                  "expected_iterations": audit.expected_iterations}
    exact = audit.max_abs_error <= MULTI_TOL
    checks.append(Check("exact-multi-iteration", exact, audit.max_abs_error, MULTI_TOL, _said(
        exact, f"max |P(first {num_tokens} tokens = w) - q(w)| within the tolerance over the whole decoding loop, "
        "corrections applied: the loop's law is the target's",
        f"max |P(first {num_tokens} tokens = w) - q(w)| above the tolerance over the whole decoding loop, "
        "corrections applied: the loop's law is not the target's")))


def _block_lp_check(case, carries, checks, metrics, details) -> None:
    from spectr_audit.bounds.block_lp import block_lp

    lp = block_lp(case.draft_model, case.target_model, case.num_drafts, case.draft_len, prefix=case.prefix)
    metrics.update(block_lp_optimum=lp.unmodified_value, block_lp_repair_optimum=lp.repair_value)
    details["block_lp"] = {"unmodified_status": lp.unmodified_status, "repair_status": lp.repair_status,
                           "solver": lp.solver, "num_variables": lp.num_variables,
                           "num_draft_tuples": lp.num_draft_tuples}
    efficiency = metrics.get("block_efficiency")
    if efficiency is None or not lp.solved:
        return
    bound = lp.repair_value if carries else lp.unmodified_value
    metrics["block_efficiency_ratio"] = efficiency / bound if bound > 0 else None
    if metrics.get("max_abs_error", 1.0) <= EXACT_TOL or carries:
        # Only an exact verifier is bound by the LP; an inexact one can "beat" it by losing fidelity.
        below = efficiency <= bound + LP_TOL
        optimum = "the block LP optimum" + (" with repair" if carries else "")
        checks.append(Check("block-efficiency<=optimal", below, efficiency, bound, _said(
            below, f"E[len(s)] <= {optimum}", f"E[len(s)] above {optimum}, which no exact verifier reaches")))


def _statistical_check(verifier, case, options, checks, metrics, details, draft_scheme=None) -> None:
    from spectr_audit.statistical.audit import statistical_audit

    # a tree case samples the case's tree under draft_scheme (the tree path of the sampling stage)
    tree = getattr(case, "tree", None)
    tree_args = {} if tree is None else {"tree": tree, "draft_scheme": draft_scheme}
    result = statistical_audit(
        verifier, case.draft_model, case.target_model, case.num_drafts, case.draft_len,
        prefix=case.prefix, alpha=options.alpha, min_detectable_tv=options.min_detectable_tv, power=options.power,
        max_samples=options.max_samples, max_seconds=options.max_seconds, seed=options.seed, device=options.device,
        certify_tv=options.certify_tv, **tree_args, **_sampling_args(case),
    )
    add_statistical_result(result, checks, metrics, details)


def add_statistical_result(result, checks: list, metrics: dict, details: dict) -> None:
    """A :class:`~spectr_audit.statistical.results.StatisticalAuditResult` as a result's checks, metrics and details.

    Metrics: the p-value, the bounds on the TV on the partition (``tv_lower``, ``tv_upper`` at
    ``tv_confidence``), the held-out estimate within them (``tv_estimate``), the plug-in with the
    noise floor of an exact verifier (``tv_plug_in``, ``tv_noise_floor``), the depths tested and
    each one's minimum detectable TV (``depths``, ``min_detectable_tv_by_depth``), the achieved and requested minimum detectable
    TV and the power left at the requested one, the samples run and planned, acceptance and
    block efficiency with their intervals.  Checks: ``statistical`` (fails when exactness is
    rejected, inconclusive when not rejected but under-powered; :func:`statistical_detail`) and, when certifying, ``certified-tv`` (fails when TV
    above the tolerance is shown, inconclusive when the budget ran out first).
    """
    summary = result.to_dict()
    metrics.update(pvalue=result.pvalue, test=result.test, num_samples=result.num_samples, seed=result.seed,
                   min_detectable_tv=result.min_detectable_tv, alpha=result.alpha,
                   requested_tv=result.requested_tv, power_at_requested_tv=result.power_at_requested_tv,
                   planned_samples=result.planned_samples, tv_estimate=result.tv_estimate, tv_lower=result.tv_lower,
                   tv_upper=result.tv_upper, tv_plug_in=result.tv_plug_in, tv_noise_floor=result.tv_noise_floor,
                   tv_confidence=result.tv_confidence, stop_reason=result.stop_reason,
                   depths=[d.depth for d in result.depths],
                   min_detectable_tv_by_depth=[d.min_detectable_tv for d in result.depths])
    if result.acceptance_samples:
        metrics.update(acceptance=result.acceptance, acceptance_samples=result.acceptance_samples,
                       block_efficiency=result.block_efficiency, acceptance_ci=list(result.acceptance_ci()),
                       block_efficiency_ci=list(result.block_efficiency_ci()))
        if metrics.get("optimal_acceptance"):
            metrics["acceptance_ratio"] = result.acceptance / metrics["optimal_acceptance"]
    details["statistical"] = summary
    details["worst_cells"] = summary.get("worst_cells", [])
    if result.acceptance_samples:
        # the worst cells' counts are of the main design: its size turns them into frequencies (figures)
        details["worst_cells_num_samples"] = result.acceptance_samples
    certifying = result.certify_tv is not None
    rejected = result.rejects()
    underpowered = not certifying and not rejected and result.inconclusive
    checks.append(Check("statistical", not rejected, result.pvalue, result.alpha, statistical_detail(result),
                        inconclusive=underpowered))
    if certifying:
        checks.append(Check("certified-tv", result.certification != "refuted", result.tv_upper, result.certify_tv,
                            f"{result.certification}: upper confidence bound {result.tv_upper:.4g} on TV(F, q) on the "
                            f"partition ({100 * result.tv_confidence:g}%, anytime-valid) vs the tolerance "
                            f"{result.certify_tv:g}; lower bound {result.tv_lower:.4g}; {result.num_samples} of "
                            f"{result.planned_samples} planned samples",
                            inconclusive=result.certification == "uncertified"))


def statistical_detail(result) -> str:
    """The ``statistical`` check's detail, in the words of its outcome.

    REJECTED (p at most alpha: exactness refuted at that false-alarm rate), INCONCLUSIVE (not
    rejected, but the minimum detectable TV reached is above the one planned), or not rejected
    at the planned power; then the samples, the TV estimate and its interval.

    Examples
    --------
    >>> from types import SimpleNamespace as NS
    >>> result = NS(test="pearson", pvalue=1e-9, alpha=0.001, min_detectable_tv=0.03, power=0.99,
    ...             requested_tv=0.05, power_at_requested_tv=1.0, num_samples=4096, stop_reason="e-process",
    ...             tv_estimate=0.2, tv_confidence=0.999, tv_lower=0.15, tv_upper=0.25, partition="16 cells",
    ...             certify_tv=None, inconclusive=False, rejects=lambda: True)
    >>> statistical_detail(result).split(";")[0]
    'pearson: exactness REJECTED: p = 1e-09 <= alpha = 0.001'
    """
    power = f"minimum detectable TV {result.min_detectable_tv:.3g} at power {result.power:.2f}"
    if result.rejects():
        outcome = f"exactness REJECTED: p = {result.pvalue:.3g} <= alpha = {result.alpha:g}; {power}"
    elif result.certify_tv is None and result.inconclusive:
        outcome = (f"INCONCLUSIVE: exactness not rejected (p = {result.pvalue:.3g} > alpha = {result.alpha:g}), but "
                   f"the {power} is above the {result.requested_tv:g} planned (power "
                   f"{result.power_at_requested_tv:.2f} at TV {result.requested_tv:g})")
    else:
        outcome = f"exactness not rejected: p = {result.pvalue:.3g} > alpha = {result.alpha:g}; {power}"
    return (f"{result.test}: {outcome}; {result.num_samples} samples, stopped: {result.stop_reason}; "
            f"{tv_text(result)} ({result.partition})")


def tv_text(result) -> str:
    """What the sample says of the TV on the audited partition, lower bound first: the bound holds at the
    audit's confidence, the held-out estimate is not inflated by noise, and the plug-in is labelled as such.

    Examples
    --------
    >>> from types import SimpleNamespace as NS
    >>> tv_text(NS(tv_lower=0.012, tv_upper=0.31, tv_estimate=0.02, tv_plug_in=0.14, tv_noise_floor=0.13,
    ...            tv_confidence=0.999))
    'TV on the partition >= 0.012 (99.9% lower bound), <= 0.31; held-out estimate 0.02; plug-in 0.14 (0.13 from sampling noise alone for an exact verifier)'
    """
    floor = getattr(result, "tv_noise_floor", math.nan)
    plug_in = getattr(result, "tv_plug_in", math.nan)
    noise = (f"; plug-in {plug_in:.3g} ({floor:.3g} from sampling noise alone for an exact verifier)"
             if math.isfinite(plug_in) and math.isfinite(floor) else "")
    estimate = f"; held-out estimate {result.tv_estimate:.3g}" if math.isfinite(result.tv_estimate) else ""
    return (f"TV on the partition >= {result.tv_lower:.3g} ({100 * result.tv_confidence:g}% lower bound), "
            f"<= {result.tv_upper:.3g}{estimate}{noise}")


def _sampling_args(case) -> dict:
    """``params`` and ``order`` for the audits of a case with sampling parameters (none without)."""
    params = getattr(case, "params", None)
    return {} if params is None else {"params": params, "order": case.order}


def _probed(verifier, case):
    """What the guard probes: with sampling parameters, a verifier that takes logits as the audit calls it
    (the raw logits and the parameters, :class:`~spectr_audit.drafting.processed.BoundLogitsVerifier`) on the
    case's drafts, through its probability entry on the probe's synthetic ones."""
    if getattr(case, "params", None) is None:
        return verifier
    from spectr_audit.drafting.processed import bind_params

    return bind_params(verifier, case.draft_model, case.target_model, case.params, case.order, case.prefix,
                       foreign_inputs="probabilities")[0]


def _record_sampling(verifier, case, metrics: dict, details: dict) -> None:
    """The case's sampling setting in the result: every field as a metric (JUnit properties), the summary,
    and ``details["sampling"]`` (with whether the verifier was handed logits)."""
    sampling = getattr(case, "sampling", None)
    if sampling is None:
        return
    from spectr_audit.contract.logits import takes_logits

    params = case.params
    metrics.update(sampling=sampling["summary"], sampling_order=case.order, temperature=float(params.temperature),
                   top_k=int(params.top_k), top_p=float(params.top_p), min_p=float(params.min_p))
    details["sampling"] = {**sampling, "verifier_takes_logits": takes_logits(verifier)}


def _exact_certificate(options, checks, metrics) -> None:
    """With ``certify_tv``, an exact law is its own certificate: its TV against the tolerance."""
    tv = metrics.get("tv_distance")
    if options.certify_tv is None or not isinstance(tv, float):
        return
    certified = tv <= options.certify_tv
    checks.append(Check("certified-tv", certified, tv, options.certify_tv, _said(
        certified, "certified: the exact TV distance of the law (no sampling) is within the tolerance",
        "refuted: the exact TV distance of the law (no sampling) is above the tolerance")))


def _sampler_check(verifier, case, options, checks, metrics, details) -> None:
    from spectr_audit.drafting.processed import bind_params
    from spectr_audit.statistical.agreement import sampler_law_agreement

    # with sampling parameters: the processed laws, and a logits verifier handed the raw logits
    verifier, draft_model, target_model = bind_params(verifier, case.draft_model, case.target_model,
                                                      getattr(case, "params", None), getattr(case, "order", "vllm"),
                                                      case.prefix)
    result = sampler_law_agreement(
        verifier, draft_model, target_model, case.num_drafts, case.draft_len, prefix=case.prefix,
        alpha=options.alpha, min_detectable_tv=options.min_detectable_tv, power=options.power,
        max_samples=options.sampler_max_samples, seed=options.seed, device=options.device,
    )
    metrics.update(sampler_pvalue=result.pvalue, sampler_samples=result.num_samples,
                   sampler_min_detectable_tv=result.min_detectable_tv)
    follows = result.pvalue > result.alpha
    # not rejected with less power than planned (the sample budget ran out first): inconclusive, not a pass
    underpowered = follows and not result.min_detectable_tv <= options.min_detectable_tv * (1 + 1e-9)
    measured = (f"{result.num_samples} samples, minimum detectable TV {result.min_detectable_tv:.3g}"
                f"{' above the planned ' + format(options.min_detectable_tv, 'g') if underpowered else ''}")
    if underpowered:
        detail = (f"{result.test}: INCONCLUSIVE: not rejected that the sampler follows the verifier's own output_probs, "
                  f"at less power than planned (p = {result.pvalue:.3g} > alpha = {result.alpha:g}; {measured})")
    else:
        detail = _said(
            follows, f"{result.test}: not rejected that the sampler follows the verifier's own output_probs "
            f"(p = {result.pvalue:.3g} > alpha = {result.alpha:g}; {measured})",
            f"{result.test}: REJECTED: the sampler does not follow the verifier's own output_probs "
            f"(p = {result.pvalue:.3g} <= alpha = {result.alpha:g}; {measured})")
    checks.append(Check("sampler-law", follows, result.pvalue, result.alpha, detail, inconclusive=underpowered))


#: The contract probe verifies this many batches (two draft sets, each verified twice)...
PROBE_CALLS = defaults.PROBE_CALLS


def probe_rows(max_samples: Optional[int]) -> int:
    """...of this many rows (``defaults.PROBE_ROWS``), or fewer when a sample budget is so small that the probe
    would be more than an eighth of it."""
    rows = defaults.PROBE_ROWS
    return rows if max_samples is None else max(1, min(rows, max_samples // (8 * PROBE_CALLS)))


def _after_probe(options: AuditOptions, probe_verifications: int) -> AuditOptions:
    """The options of the audits after the probe: a sample budget counts every verification, the probe's too."""
    if options.max_samples is None:
        return options
    left = max(1, options.max_samples - probe_verifications)
    sampler = left if options.sampler_max_samples is None else min(left, options.sampler_max_samples)
    return dataclasses.replace(options, max_samples=left, sampler_max_samples=sampler)


def audit_case(verifier: Verifier, case: Case, options: AuditOptions = AuditOptions()) -> AuditResult:
    """Audit ``verifier`` on ``case``; never raises for a verifier's own failure.

    Refused (:class:`~spectr_audit.run.budget.MemoryBudgetExceeded`, before anything is allocated)
    when a stage would exceed ``options.max_memory``; every verifier call is limited to
    ``options.verifier_timeout`` seconds, and a probe checks that the verifier leaves its inputs
    unchanged and is deterministic under a fixed generator (:mod:`spectr_audit.run.guard`).
    """
    if getattr(case, "tree", None) is not None:
        return audit_tree_case(verifier, case.laws() if hasattr(case, "laws") else case, options)
    budget.check_audit(verifier, case.laws() if hasattr(case, "laws") else case, options)
    with guard.time_limited(verifier, guard.check_timeout(options.verifier_timeout)) as limited:
        return _audit_case(limited, case, options)


def _audit_case(verifier: Verifier, case: Case, options: AuditOptions) -> AuditResult:
    """:func:`audit_case` within its guards.

    Exact verifiers (with ``output_probs``) get the exact single-iteration audit, the
    multi-iteration audit when they carry a next-iteration repair, the block LP for
    L > 1, and optionally a sampler-versus-law check; black boxes get the statistical
    audit.  Every number lands in ``metrics``; only ``checks`` decide.

    With sampling parameters (``case.params``) the audits take the raw models and the
    parameters (a verifier that takes logits is handed the raw logits), while the bounds, the
    block LP and the probe use the processed laws (``case.laws()``); the setting is recorded in
    ``metrics`` (``sampling``, ``temperature``, ``top_k``, ``top_p``, ``min_p``) and in
    ``details["sampling"]``.
    """
    from spectr_audit.contract.correction import has_carried_correction

    checks: list[Check] = []
    details: dict = {}
    metrics: dict = {"num_drafts": case.num_drafts, "draft_len": case.draft_len, "vocab_size": case.vocab_size}
    laws = case.laws() if hasattr(case, "laws") else case
    _record_sampling(verifier, case, metrics, details)
    start = time.perf_counter()
    try:
        rows = probe_rows(options.max_samples)
        checks.extend(guard_probe(_probed(verifier, case), laws, options.seed, rows))
        options = _after_probe(options, PROBE_CALLS * rows)
        alpha_star = _optimality(laws, verifier.draft_scheme, metrics, details) if "optimality" in case.checks else None
        carries = has_carried_correction(verifier)
        if verifier.has_exact_law:
            if "exact" in case.checks:
                _exact_checks(verifier, case, alpha_star, carries, checks, metrics, details)
            if carries and ("multi-iteration" in case.checks or "exact" in case.checks):
                _multi_iteration_check(verifier, case, checks, metrics, details)
            if "sampler" in case.checks:
                _sampler_check(verifier, case, options, checks, metrics, details)
            _exact_certificate(options, checks, metrics)
        elif "statistical" in case.checks:
            _statistical_check(verifier, case, options, checks, metrics, details)
        if "block-lp" in case.checks and case.draft_len > 1 and verifier.draft_scheme == "iid":
            try:
                check_block_lp(laws, options)
                _block_lp_check(laws, carries, checks, metrics, details)
            except InvalidArgument as exc:
                details["block_lp"] = f"skipped: {exc}"
    except Exception as exc:  # one bad verifier or case must never lose the other results
        return error_result(verifier, case.name, exc, checks, metrics)
    return _audited(verifier, case, checks, metrics, details, start)


def _audited(verifier, case: Case, checks: list, metrics: dict, details: dict, start: float) -> AuditResult:
    """The result of an audit (of a chain or a tree case) that ran through: its checks ("ran" when none
    applied), its metrics with the seconds since ``start``, its details, and the verifier's declaration."""
    if not checks:
        checks.append(Check("ran", True, None, None, "no applicable check"))
    metrics["seconds"] = time.perf_counter() - start
    return AuditResult(
        verifier=verifier.name, case=case.name, checks=tuple(checks), metrics=metrics,
        expected=declared_verdict(verifier), details=details,
    )


# ---------------------------------------------------------------------------------------------
# Draft-tree cases
# ---------------------------------------------------------------------------------------------


def _tree_optimality(case: Case, draft_scheme: str, metrics: dict, details: dict):
    """The tree bound (docs/audit/bounds.md): alpha* in closed form, the best accepted length where reachable."""
    from spectr_audit.bounds.tree_lp import tree_bound

    try:
        bound = tree_bound(case.draft_model, case.target_model, case.tree, draft_scheme, prefix=case.prefix,
                           max_variables=LP_MAX_VARIABLES)
    except InvalidArgument as exc:
        details["tree_bound"] = f"skipped: {exc}"
        return None
    metrics["optimal_acceptance"] = bound.acceptance
    if bound.accepted_length is not None:
        metrics["optimal_accepted_length"] = bound.accepted_length
    if bound.repair_accepted_length is not None:
        metrics["optimal_accepted_length_repair"] = bound.repair_accepted_length
    details["tree_bound"] = bound.to_dict()
    return bound


def _tree_bound_checks(tree_verifier, bound, checks: list, metrics: dict) -> None:
    """Acceptance and accepted length against the tree bound (the length only for a verifier found exact)."""
    if bound is None or "acceptance" not in metrics:
        return
    acceptance = metrics["acceptance"]
    alpha_star = bound.acceptance
    metrics["acceptance_ratio"] = acceptance / alpha_star if alpha_star > 0 else None
    what = "P(first emitted token among the root's children's tokens)"
    sampled = "acceptance_samples" in metrics
    if sampled:
        # A sampled acceptance is judged by a one-sided exact binomial test at the audit's alpha: a verifier
        # that reaches alpha* exactly lands above it in half the samples' runs.
        from spectr_audit.statistical.gof import binomial_above, binomial_below

        num, alpha = metrics["acceptance_samples"], metrics["alpha"]
        hits = round(acceptance * num)

    def judged(test, exact_holds):
        """Whether the bound holds, and the words for it (the test's counts and p-value when sampled)."""
        if not sampled:
            return exact_holds, ""
        pvalue = test(hits, num, alpha_star, "acceptance-bound").pvalue
        return pvalue > alpha, f" ({hits} of {num} samples, one-sided binomial p = {pvalue:.3g} at alpha = {alpha:g})"

    shown = "shown " if sampled else ""
    below, on = judged(binomial_above if sampled else None, acceptance <= alpha_star + BOUND_TOL)
    checks.append(Check("acceptance<=optimal", below, acceptance, alpha_star, _said(
        below, f"{what} {'not shown above' if sampled else '<='} alpha* of the tree's draft scheme{on}",
        f"{what} {shown}above alpha* of the tree's draft scheme{on}, which no exact verifier reaches")))
    if "optimal" in tree_verifier.guarantees:
        reached, on = judged(binomial_below if sampled else None, acceptance >= alpha_star - BOUND_TOL)
        checks.append(Check("acceptance>=optimal", reached, acceptance, alpha_star, _said(
            reached, f"{'not shown below' if sampled else 'reaches'} the optimal acceptance alpha* it claims{on}",
            f"{shown}below the optimal acceptance alpha* it claims{on}")))
    best = bound.accepted_length
    length = metrics.get("accepted_length")
    if best is None or length is None:
        return
    metrics["accepted_length_ratio"] = length / best if best > 0 else None
    if metrics.get("max_abs_error", 1.0) <= EXACT_TOL:
        # only a lossless verifier is bound; an inexact one can "beat" the optimum by losing fidelity
        tol = LP_TOL if bound.accepted_length_source == "lp" else BOUND_TOL
        within = length <= best + tol
        source = bound.accepted_length_source
        checks.append(Check("accepted-length<=optimal", within, length, best, _said(
            within, f"E[accepted draft tokens] <= the best of a lossless verifier ({source})",
            f"E[accepted draft tokens] above the best of a lossless verifier ({source}), which no exact verifier "
            "reaches")))


def _exact_tree_reach(case: Case, draft_scheme: str) -> Optional[str]:
    """Why the exact tree audit cannot enumerate the case (None when it can)."""
    from spectr_audit.exact.tree import MAX_TREE_REALISATIONS, MAX_TREE_STRINGS, tree_enumeration_size

    tree, vocab_size = case.tree, case.vocab_size
    if vocab_size ** (tree.max_depth + 1) > MAX_TREE_STRINGS:
        return f"V^(max_depth + 1) = {vocab_size ** (tree.max_depth + 1)} strings, above {MAX_TREE_STRINGS}"
    size = tree_enumeration_size(tree, draft_scheme, vocab_size)
    if size > MAX_TREE_REALISATIONS:
        return f"up to {size} realisations of the drafts, above {MAX_TREE_REALISATIONS}"
    return None


def _exact_tree_checks(tree_verifier, case: Case, draft_scheme: str, checks: list, metrics: dict, details: dict) -> None:
    from spectr_audit.exact.tree import exact_tree

    audit = exact_tree(tree_verifier, case.draft_model, case.target_model, case.tree, draft_scheme=draft_scheme,
                       prefix=case.prefix)
    _exact_law_checks(audit, "strings of max_depth + 1 tokens", "one tree step, unmodified continuation", checks,
                      metrics, details, extra_details={"accepted_length_law": list(audit.accepted_length_law)},
                      accepted_length=audit.accepted_length, num_draft_tuples=audit.num_realisations,
                      num_realisations=audit.num_realisations)


def tree_fits(verifier, case: Case) -> bool:
    """Whether ``verifier`` (a tree verifier, or a chain verifier on a chain tree) can be audited on a tree case.

    It must support the tree and take the case's draft scheme (by default its own first), carry no
    next-iteration repair (a chain verifier that does is judged by the multi-iteration audit), and the
    scheme must be able to draft the tree: without replacement, the root's draft law has as many
    tokens as the widest node has children; under ``topk`` / ``none``, every rank is a token.
    """
    from spectr_audit.contract.convert import as_tree_verifier

    try:
        tree_verifier = as_tree_verifier(verifier)
    except InvalidArgument:
        return False
    from spectr_audit.contract.chain_trees import ChainVerifierAsTree
    from spectr_audit.contract.correction import has_carried_correction

    if isinstance(tree_verifier, ChainVerifierAsTree) and has_carried_correction(tree_verifier.verifier):
        return False  # judged with its repair by the multi-iteration audit, on chain cases
    tree = case.tree
    scheme = case.draft_scheme or tree_verifier.draft_schemes[0]
    if not tree_verifier.supports_tree(tree) or scheme not in tree_verifier.draft_schemes:
        return False
    if scheme == "without_replacement":
        draft_first, _ = _first_position(case)
        return int((draft_first > 0).sum()) >= tree.max_children
    if scheme in ("topk", "none"):
        return max(tree.ranks) < case.vocab_size
    return True


def audit_tree_case(verifier, case: Case, options: AuditOptions = AuditOptions()) -> AuditResult:
    """Audit a tree verifier (or a chain verifier, on a chain tree) on a draft-tree case; never raises for its failure.

    The exact tree audit (:func:`spectr_audit.exact.tree.exact_tree`) where the verifier has a tree
    law and the enumeration is within reach; otherwise the statistical audit on sampled trees
    (when the case asks for ``statistical``, or for ``exact`` beyond the enumeration's reach).
    Acceptance and accepted length are checked against the tree's bound
    (:func:`spectr_audit.bounds.tree_lp.tree_bound`).  ``details["tree"]`` describes the tree.
    """
    from spectr_audit.contract.convert import as_tree_verifier
    checks: list[Check] = []
    tree = case.tree
    details: dict = {"tree": describe_tree_case(case)}
    metrics: dict = {"num_drafts": case.num_drafts, "draft_len": case.draft_len, "vocab_size": case.vocab_size,
                     "tree_draft_nodes": tree.num_draft_nodes, "tree_depth": tree.max_depth}
    start = time.perf_counter()
    tree_verifier = verifier
    try:
        tree_verifier = as_tree_verifier(verifier)
        scheme = case.draft_scheme or tree_verifier.draft_schemes[0]
        details["tree"]["draft_scheme"] = scheme
        bound = _tree_optimality(case, scheme, metrics, details) if "optimality" in case.checks else None
        exact_done = False
        if tree_verifier.has_tree_law and "exact" in case.checks:
            reason = _exact_tree_reach(case, scheme)
            if reason is None:
                _exact_tree_checks(tree_verifier, case, scheme, checks, metrics, details)
                exact_done = True
            else:
                details["exact"] = f"skipped: {reason}; the statistical audit runs instead"
        sampled = "statistical" in case.checks or ("exact" in case.checks and not exact_done)
        if not exact_done and sampled:
            _statistical_check(tree_verifier, case, options, checks, metrics, details, draft_scheme=scheme)
            if metrics.get("block_efficiency") is not None:
                metrics["accepted_length"] = metrics["block_efficiency"] - 1.0
        _tree_bound_checks(tree_verifier, bound, checks, metrics)
    except Exception as exc:  # one bad verifier or case must never lose the other results
        return error_result(tree_verifier, case.name, exc, checks, metrics)
    return _audited(tree_verifier, case, checks, metrics, details, start)


def select_verifiers(specs: Optional[Sequence[str]]) -> Optional[list[Verifier]]:
    """``None`` (each case's own list, else the built-ins) when ``specs`` is empty, else each spec loaded.

    A tree verifier the chain contract cannot run (one drafting only ``topk`` or ``none``) is
    kept as a tree verifier: it runs on the suite's tree cases only.
    """
    if not specs:
        return None
    from spectr_audit.registry import load_tree_verifier

    loaded = []
    for spec in specs:
        try:
            loaded.append(load_verifier(spec))
        except InvalidArgument:
            try:
                loaded.append(load_tree_verifier(spec))
            except InvalidArgument:
                pass
            else:
                continue
            raise
    return loaded


def _listed_verifiers(case: Case, kind: str, load: Callable, loaded: dict, errors: list) -> list:
    """The verifiers ``case.verifiers`` names, each spec loaded by ``load`` once per ``kind`` (``loaded`` caches
    the verifier or its error under ``(kind, spec)``); one that cannot be loaded becomes an error result in
    ``errors``."""
    candidates = []
    for spec in case.verifiers:
        key = (kind, spec)
        if key not in loaded:
            try:
                loaded[key] = load(spec)
            except SpectrAuditError as exc:
                loaded[key] = exc
        if isinstance(loaded[key], Exception):
            errors.append(AuditResult(verifier=spec, case=case.name, error=f"{type(loaded[key]).__name__}: {loaded[key]}"))
        else:
            candidates.append(loaded[key])
    return candidates


def _plan_tree_case(case: Case, explicit, builtins, tree_builtins, loaded: dict):
    """The jobs of a tree case: the given verifiers as tree verifiers, the case's own list (loaded as tree
    verifiers), or the tree built-ins and the chain built-ins (on chain trees); returns the caches too."""
    from spectr_audit.contract.convert import as_tree_verifier
    from spectr_audit.registry import load_tree_verifier, tree_verifiers

    errors: list = []
    if explicit is not None:
        candidates = [as_tree_verifier(v) for v in explicit]
    elif case.verifiers is None:
        if tree_builtins is None:
            builtins = builtins if builtins is not None else builtin_verifiers()
            tree_builtins = tree_verifiers() + [as_tree_verifier(v) for v in builtins]
        candidates = tree_builtins
    else:
        candidates = _listed_verifiers(case, "tree", load_tree_verifier, loaded, errors)
    return [(v, case) for v in candidates if tree_fits(v, case)], errors, builtins, tree_builtins


def plan_jobs(suite: Suite, verifiers: Optional[Iterable[Verifier]] = None) -> tuple[list, list]:
    """The (verifier, case) pairs ``run_suite`` audits, and error results for unloadable verifiers.

    With ``verifiers`` given, exactly those run on every case they support.  Without it,
    a case that names its verifiers (``verifiers = [...]`` in the suite file: short names
    or import strings) runs those, and other cases run every built-in verifier.
    """
    explicit = list(verifiers) if verifiers is not None else None
    builtins: Optional[list] = None
    tree_builtins: Optional[list] = None
    loaded: dict = {}
    jobs: list = []
    errors: list = []
    for case in suite.cases:
        if getattr(case, "tree", None) is not None:
            jobs_, errors_, builtins, tree_builtins = _plan_tree_case(case, explicit, builtins, tree_builtins, loaded)
            jobs.extend(jobs_)
            errors.extend(errors_)
            continue
        if explicit is not None:
            # tree verifiers the chain contract cannot run were kept for the tree cases only
            candidates = [v for v in explicit if isinstance(v, Verifier)]
        elif case.verifiers is None:
            builtins = builtins if builtins is not None else builtin_verifiers()
            candidates = builtins
        else:
            candidates = _listed_verifiers(case, "chain", load_verifier, loaded, errors)
        jobs.extend((v, case) for v in candidates if v.supports(case.num_drafts, case.draft_len) and scheme_fits(v, case))
    return jobs, errors


def run_suite(
    suite: Suite,
    verifiers: Optional[Iterable[Verifier]] = None,
    options: AuditOptions = AuditOptions(),
    progress: Optional[Callable[[str, str], None]] = None,
) -> AuditReport:
    """Audit every verifier on every case of ``suite`` that it supports (see :func:`plan_jobs`).

    A verifier that cannot be loaded becomes an error result; the other results are kept.
    ``progress(verifier_name, case_name)`` is called before each audit, after
    ``progress.start(total)`` when the callback has a ``start`` method.

    Every job is checked against the memory budget before the first audit
    (:class:`~spectr_audit.run.budget.MemoryBudgetExceeded` naming the case).  Ctrl-C raises
    :class:`~spectr_audit.run.incomplete.RunInterrupted` (a ``KeyboardInterrupt``) and an
    error outside any one audit :class:`~spectr_audit.run.incomplete.RunAborted`; both carry
    ``report``, the finished results marked incomplete.
    """
    if not suite.cases and getattr(suite, "generation", ()):
        raise InvalidArgument(f"suite: {suite.name!r} holds generation audits only ([[generation]] cases); run them "
                              f"with spectr_audit.run.generation.run_generation_suite or spectr-audit generation "
                              f"--suite")
    jobs, results = plan_jobs(suite, verifiers)
    # tree jobs: the exact tree audit refuses enumerations beyond its own limits (spectr_audit.exact.tree)
    check_jobs([(v, c) for v, c in jobs if getattr(c, "tree", None) is None], options,
               source=suite.source or f"suite {suite.name!r}")
    meta = {"num_cases": len(suite.cases), "seed": options.seed}
    if progress is not None and hasattr(progress, "start"):
        progress.start(len(jobs))
    try:
        for verifier, case in jobs:
            if progress is not None:
                progress(verifier.name, case.name)
            results.append(audit_case(verifier, case, options))
    except KeyboardInterrupt:
        # Ctrl-C: the finished results are kept, in a report marked incomplete.
        raise RunInterrupted(incomplete_report(results, suite.name, meta, len(jobs), "interrupted (SIGINT)")) from None
    except Exception as exc:
        raise RunAborted(incomplete_report(results, suite.name, meta, len(jobs),
                                           f"stopped by {type(exc).__name__}: {exc}"), exc) from exc
    return AuditReport(results=tuple(results), suite=suite.name, meta={**meta, "num_audits": len(results)})
