"""An audit's findings in a result's terms: the checks (each with the words of its outcome), metrics and details.

Every stage of :func:`~spectr_audit.run.runner.audit_case` (:data:`~spectr_audit.run.stages.STAGES`, for
chain and tree cases alike) calls the audit it names (the exact law, the
multi-iteration law, the bounds, the statistical audit, the sampler check) and turns what comes back into
:class:`~spectr_audit.results.Check` records, ``metrics`` (every number) and ``details``; only the checks
decide a verdict.
"""

from __future__ import annotations

import math
from typing import Optional

import torch

from spectr_audit import defaults
from spectr_audit.bounds.acceptance import (
    optimal_acceptance,
    optimal_acceptance_lp,
    optimal_acceptance_lp_from_sets,
    spectr_guarantee,
    without_replacement_set_probs,
)
from spectr_audit.bounds.block_lp import block_lp
from spectr_audit.bounds.tree_lp import tree_bound, tree_optimal_acceptance
from spectr_audit.contract.tree import DraftTree
from spectr_audit.contract.logits import takes_logits
from spectr_audit.drafting.models import contexts_from
from spectr_audit.drafting.processed import BoundLogitsVerifier
from spectr_audit.errors import InvalidArgument
from spectr_audit.exact.iteration import exact_iteration
from spectr_audit.exact.multi_iteration import exact_multi_iteration
from spectr_audit.exact.tree import MAX_TREE_REALISATIONS, MAX_TREE_STRINGS, exact_tree, tree_enumeration_size
from spectr_audit.results import Check
from spectr_audit.run.suite import Case
from spectr_audit.statistical.agreement import sampler_law_agreement
from spectr_audit.statistical.audit import statistical_audit
from spectr_audit.statistical.gof import binomial_above, binomial_below

__all__ = ["BOUND_TOL", "EXACT_TOL", "LP_MAX_VARIABLES", "LP_TOL", "MULTI_TOL", "add_statistical_result",
           "statistical_detail", "tv_text"]

# The tolerances of the checks (documented in spectr_audit.defaults).
EXACT_TOL = defaults.EXACT_TOL
MULTI_TOL = defaults.MULTI_TOL
BOUND_TOL = defaults.BOUND_TOL
LP_TOL = defaults.LP_TOL
#: Run the alpha* LP next to the closed form when it has at most this many variables.
LP_MAX_VARIABLES = defaults.LP_CROSS_CHECK_MAX_VARIABLES


def outcome_detail(passed: bool, held: str, failed: str) -> str:
    """A check's detail in the words of its outcome: ``held`` when it passed, ``failed`` when it did not.

    Reports print the detail beside the verdict, so a fixed text would contradict one of the two.
    """
    return held if passed else failed


def first_position(case: Case) -> tuple[torch.Tensor, torch.Tensor]:
    """The draft and target laws at the case's first position (processed, with sampling parameters)."""
    laws = case.laws() if hasattr(case, "laws") else case
    ctx = contexts_from(laws.prefix, torch.zeros(1, 0, dtype=torch.int64))
    return laws.draft_model(ctx)[0].double(), laws.target_model(ctx)[0].double()


def optimality(case: Case, draft_scheme: str, metrics: dict, details: dict) -> Optional[float]:
    """alpha* for the case's first position under ``draft_scheme``; fills metrics and details.

    i.i.d. drafts: the closed form ``min_T [q(T) + 1 - p(T)^K]``; without replacement: the exact min-cut
    over the law of the set of drafts (:func:`~spectr_audit.bounds.tree_lp.tree_optimal_acceptance` on
    ``DraftTree.chains(K, 1)``, as for a tree's root), None where that is beyond
    ``defaults.MIN_CUT_MAX_SUPPORT``.  The transport LP is solved beside either as a cross-check, up to
    ``LP_MAX_VARIABLES`` variables.
    """
    draft_first, target_first = first_position(case)
    if draft_scheme == "without_replacement":
        try:
            alpha_star, source = tree_optimal_acceptance(case.draft_model, case.target_model,
                                                         DraftTree.chains(case.num_drafts, 1), draft_scheme,
                                                         prefix=case.prefix)
            sets = without_replacement_set_probs(draft_first, case.num_drafts)
        except InvalidArgument as exc:
            details["optimal_acceptance"] = f"skipped: {exc}"
            return None
        metrics["optimal_acceptance"] = alpha_star
        details["optimal_acceptance_source"] = source
        try:
            lp = optimal_acceptance_lp_from_sets(sets, target_first, max_variables=LP_MAX_VARIABLES)
        except InvalidArgument:
            details["optimal_acceptance_lp"] = "skipped: too large"
        else:
            metrics["optimal_acceptance_lp"] = lp.value
            details["optimal_acceptance_lp"] = {"status": lp.status, "solver": lp.solver,
                                                "num_variables": lp.num_variables, "draft_scheme": draft_scheme}
        return alpha_star
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


def exact_checks(request, carries, checks, metrics, details) -> None:
    """Single-iteration exact law: exactness (the judge unless a repair is carried), prefix cap (acceptance
    against alpha* is the bounds stage's, :func:`bound_checks`)."""
    case = request.case
    # with sampling parameters: the processed laws, and a logits verifier handed the raw logits (bound once)
    verifier, draft_model, target_model = request.bound
    audit = exact_iteration(verifier, draft_model, target_model, case.num_drafts, case.draft_len, prefix=case.prefix)
    # With a carried repair one iteration alone is not meant to be exact: the multi-iteration
    # law is the judge; its single-iteration TV is reported for information only.
    exact_law_checks(audit, "strings of length L + 1", "single iteration, unmodified continuation", checks, metrics,
                      details, judged=not carries, num_draft_tuples=audit.num_draft_tuples)
    if carries:
        metrics["single_iteration_tv_distance"] = metrics.pop("tv_distance")
        metrics["single_iteration_max_abs_error"] = metrics.pop("max_abs_error")


#: The metrics every exact audit (single iteration, tree) records under its own attribute's name.
_EXACT_LAW_METRICS = ("tv_distance", "max_abs_error", "token_tv_distance", "prefix_cap_excess", "acceptance",
                      "block_efficiency")


def exact_law_checks(audit, strings: str, how: str, checks: list, metrics: dict, details: dict, *, judged: bool = True,
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
        checks.append(Check("exact", exact, audit.max_abs_error, EXACT_TOL, exact_detail(exact, strings, how)))
    capped = audit.prefix_cap_excess <= EXACT_TOL
    checks.append(Check("prefix-cap", capped, audit.prefix_cap_excess, EXACT_TOL, prefix_cap_detail(capped)))


def exact_detail(passed: bool, strings: str, how: str) -> str:
    """The ``exact`` check's detail: the implied law is the target's, or not, over ``strings``."""
    return outcome_detail(passed, f"max |F(w) - q(w)| over {strings} within the tolerance: the implied law is the target's ({how})",
                 f"max |F(w) - q(w)| over {strings} above the tolerance: the implied law is not the target's ({how}; "
                 "the worst strings are listed)")


def prefix_cap_detail(passed: bool) -> str:
    """The ``prefix-cap`` check's detail."""
    return outcome_detail(passed, "max over prefixes u of B(u) - q(u) within the tolerance: no prefix is emitted more often "
                 "than the target allows",
                 "a prefix u has B(u) - q(u) above the tolerance: no later correction can repair the step")


def multi_iteration_check(request, checks, metrics, details) -> None:
    """The whole decoding loop's exact law, corrections applied: the judge of a verifier that carries a repair."""
    verifier, case = request.verifier, request.case
    num_tokens = case.num_tokens or case.draft_len + 1
    audit = exact_multi_iteration(
        verifier, case.draft_model, case.target_model, case.num_drafts, case.draft_len, num_tokens, prefix=case.prefix,
        **request.sampling,
    )
    metrics.update(tv_distance=audit.tv_distance, max_abs_error=audit.max_abs_error,
                   multi_iteration_tokens=num_tokens, multi_iteration_prefix_cap_excess=audit.prefix_cap_excess)
    details["multi_iteration"] = {"num_tokens": num_tokens, "num_histories": audit.num_histories,
                                  "expected_iterations": audit.expected_iterations}
    exact = audit.max_abs_error <= MULTI_TOL
    checks.append(Check("exact-multi-iteration", exact, audit.max_abs_error, MULTI_TOL, outcome_detail(
        exact, f"max |P(first {num_tokens} tokens = w) - q(w)| within the tolerance over the whole decoding loop, "
        "corrections applied: the loop's law is the target's",
        f"max |P(first {num_tokens} tokens = w) - q(w)| above the tolerance over the whole decoding loop, "
        "corrections applied: the loop's law is not the target's")))


def block_lp_check(case, carries, checks, metrics, details) -> None:
    """Block efficiency against the block LP's optimum (with repair when the verifier carries one)."""
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
        checks.append(Check("block-efficiency<=optimal", below, efficiency, bound, outcome_detail(
            below, f"E[len(s)] <= {optimum}", f"E[len(s)] above {optimum}, which no exact verifier reaches")))


def statistical_check(request, checks, metrics, details, subject=None, draft_scheme=None) -> None:
    """The black-box audit of ``request``'s verifier on its case (``subject``, the tree verifier, on the case's tree
    under ``draft_scheme`` for a tree case), on the verifier and models the request bound once
    (:attr:`~spectr_audit.run.request.AuditRequest.bound`): with sampling parameters, the processed models and a
    verifier that takes logits handed its raw logits."""
    case, options = request.case, request.options
    verifier, draft_model, target_model = request.bound
    tree = getattr(case, "tree", None)
    tree_args = {} if tree is None else {"tree": tree, "draft_scheme": draft_scheme}
    if subject is not None:
        verifier = subject  # a tree case (its suite refuses sampling parameters): the tree verifier
    elif isinstance(verifier, BoundLogitsVerifier):
        verifier = verifier.trusting()  # the audit hands it only the processed laws at the drafted nodes
    result = statistical_audit(
        verifier, draft_model, target_model, case.num_drafts, case.draft_len,
        prefix=case.prefix, alpha=options.alpha, min_detectable_tv=options.min_detectable_tv, power=options.power,
        max_samples=options.max_samples, max_seconds=options.max_seconds, seed=options.seed, device=options.device,
        certify_tv=options.certify_tv, **tree_args,
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


def record_sampling(verifier, case, metrics: dict, details: dict) -> None:
    """The case's sampling setting in the result: every field as a metric (JUnit properties), the summary,
    and ``details["sampling"]`` (with whether the verifier was handed logits)."""
    sampling = getattr(case, "sampling", None)
    if sampling is None:
        return
    params = case.params
    metrics.update(sampling=sampling["summary"], sampling_order=case.order, temperature=float(params.temperature),
                   top_k=int(params.top_k), top_p=float(params.top_p), min_p=float(params.min_p))
    details["sampling"] = {**sampling, "verifier_takes_logits": takes_logits(verifier)}


def exact_certificate(options, checks, metrics) -> None:
    """With ``certify_tv``, an exact law is its own certificate: its TV against the tolerance."""
    tv = metrics.get("tv_distance")
    if options.certify_tv is None or not isinstance(tv, float):
        return
    certified = tv <= options.certify_tv
    checks.append(Check("certified-tv", certified, tv, options.certify_tv, outcome_detail(
        certified, "certified: the exact TV distance of the law (no sampling) is within the tolerance",
        "refuted: the exact TV distance of the law (no sampling) is above the tolerance")))


def sampler_check(request, checks, metrics, details) -> None:
    """The sampler against the verifier's own ``output_probs``, on the processed laws with sampling parameters."""
    case, options = request.case, request.options
    # with sampling parameters: the processed laws, and a logits verifier handed the raw logits
    verifier, draft_model, target_model = request.bound
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
        detail = outcome_detail(
            follows, f"{result.test}: not rejected that the sampler follows the verifier's own output_probs "
            f"(p = {result.pvalue:.3g} > alpha = {result.alpha:g}; {measured})",
            f"{result.test}: REJECTED: the sampler does not follow the verifier's own output_probs "
            f"(p = {result.pvalue:.3g} <= alpha = {result.alpha:g}; {measured})")
    checks.append(Check("sampler-law", follows, result.pvalue, result.alpha, detail, inconclusive=underpowered))


def tree_optimality(case: Case, draft_scheme: str, metrics: dict, details: dict):
    """The tree bound (docs/audit/bounds.md): alpha* in closed form, the best accepted length where reachable."""
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


#: The words of the acceptance checks on each shape: what the acceptance is, and whose alpha* bounds it.
_ACCEPTANCE_WORDS = {
    "chain": ("P(first emitted token in the drafts' first tokens)", "alpha*", ", as for every exact verifier"),
    "tree": ("P(first emitted token among the root's children's tokens)", "alpha* of the tree's draft scheme", ""),
}


def bound_checks(verifier, alpha_star: Optional[float], checks: list, metrics: dict, *, tree: bool = False,
                 tree_bound=None) -> None:
    """Acceptance against alpha* (``acceptance<=optimal``; ``acceptance>=optimal`` and ``spectr-guarantee``
    where the verifier claims them), of a chain or (``tree``) a tree case; with the tree's bound, the accepted
    length against the best of a lossless verifier too (only for a verifier found exact).

    An exact acceptance is compared within ``BOUND_TOL`` (alpha* is exact: a closed form or the exact
    min-cut); a sampled one (a tree's statistical audit) by a one-sided exact binomial test at the audit's
    alpha: a verifier that reaches alpha* exactly lands above it in half the samples' runs.
    """
    if alpha_star is None or "acceptance" not in metrics:
        return
    acceptance = metrics["acceptance"]
    metrics["acceptance_ratio"] = acceptance / alpha_star if alpha_star > 0 else None
    what, bound, held = _ACCEPTANCE_WORDS["tree" if tree else "chain"]
    sampled = "acceptance_samples" in metrics
    if sampled:
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
    checks.append(Check("acceptance<=optimal", below, acceptance, alpha_star, outcome_detail(
        below, f"{what} {'not shown above' if sampled else '<='} {bound}{on}{held}",
        f"{what} {shown}above {bound}{on}, which no exact verifier reaches")))
    if "optimal" in verifier.guarantees:
        reached, on = judged(binomial_below if sampled else None, acceptance >= alpha_star - BOUND_TOL)
        checks.append(Check("acceptance>=optimal", reached, acceptance, alpha_star, outcome_detail(
            reached, f"{'not shown below' if sampled else 'reaches'} the optimal acceptance alpha* it claims{on}",
            f"{shown}below the optimal acceptance alpha* it claims{on}")))
    if "spectr" in verifier.guarantees and "spectr_bound" in metrics:
        floor = metrics["spectr_bound"]
        kept = acceptance >= floor - BOUND_TOL
        checks.append(Check("spectr-guarantee", kept, acceptance, floor, outcome_detail(
            kept, "acceptance >= (1 - (1 - 1/K)^K) alpha*: SpecTr's guarantee kept",
            "acceptance below (1 - (1 - 1/K)^K) alpha*: SpecTr's guarantee broken")))
    best = None if tree_bound is None else tree_bound.accepted_length
    length = metrics.get("accepted_length")
    if best is None or length is None:
        return
    metrics["accepted_length_ratio"] = length / best if best > 0 else None
    if metrics.get("max_abs_error", 1.0) <= EXACT_TOL:
        # only a lossless verifier is bound; an inexact one can "beat" the optimum by losing fidelity
        tol = LP_TOL if tree_bound.accepted_length_source == "lp" else BOUND_TOL
        within = length <= best + tol
        source = tree_bound.accepted_length_source
        checks.append(Check("accepted-length<=optimal", within, length, best, outcome_detail(
            within, f"E[accepted draft tokens] <= the best of a lossless verifier ({source})",
            f"E[accepted draft tokens] above the best of a lossless verifier ({source}), which no exact verifier "
            "reaches")))


def exact_tree_reach(case: Case, draft_scheme: str) -> Optional[str]:
    """Why the exact tree audit cannot enumerate the case (None when it can)."""
    tree, vocab_size = case.tree, case.vocab_size
    if vocab_size ** (tree.max_depth + 1) > MAX_TREE_STRINGS:
        return f"V^(max_depth + 1) = {vocab_size ** (tree.max_depth + 1)} strings, above {MAX_TREE_STRINGS}"
    size = tree_enumeration_size(tree, draft_scheme, vocab_size)
    if size > MAX_TREE_REALISATIONS:
        return f"up to {size} realisations of the drafts, above {MAX_TREE_REALISATIONS}"
    return None


def exact_tree_checks(tree_verifier, case: Case, draft_scheme: str, checks: list, metrics: dict, details: dict) -> None:
    audit = exact_tree(tree_verifier, case.draft_model, case.target_model, case.tree, draft_scheme=draft_scheme,
                       prefix=case.prefix)
    exact_law_checks(audit, "strings of max_depth + 1 tokens", "one tree step, unmodified continuation", checks,
                      metrics, details, extra_details={"accepted_length_law": list(audit.accepted_length_law)},
                      accepted_length=audit.accepted_length, num_draft_tuples=audit.num_realisations,
                      num_realisations=audit.num_realisations)
