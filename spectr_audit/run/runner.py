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
from spectr_audit.run.suite import Case, Suite

__all__ = ["AuditOptions", "audit_case", "declared_verdict", "error_result", "plan_jobs", "run_suite", "scheme_fits", "select_verifiers", "EXACT_TOL", "BOUND_TOL"]

# The tolerances of the checks (documented in spectr_audit.defaults).
EXACT_TOL = defaults.EXACT_TOL
MULTI_TOL = defaults.MULTI_TOL
BOUND_TOL = defaults.BOUND_TOL
LP_TOL = defaults.LP_TOL
#: Run the alpha* LP next to the closed form when it has at most this many variables.
LP_MAX_VARIABLES = defaults.LP_CROSS_CHECK_MAX_VARIABLES


@dataclasses.dataclass(frozen=True)
class AuditOptions:
    """Knobs of a run that are not part of a case."""

    seed: int = defaults.SEED
    #: Statistical audits: false-alarm rate, and caps on samples / seconds.
    alpha: float = defaults.ALPHA
    max_samples: Optional[int] = None
    max_seconds: Optional[float] = None
    min_detectable_tv: float = defaults.MIN_DETECTABLE_TV
    power: float = defaults.POWER
    #: Sample cap of the sampler-versus-exact-law check of verifiers with ``output_probs``.
    sampler_max_samples: Optional[int] = defaults.SAMPLER_MAX_SAMPLES
    device: str = "cpu"


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
    ctx = contexts_from(case.prefix, torch.zeros(1, 0, dtype=torch.int64))
    return case.draft_model(ctx)[0].double(), case.target_model(ctx)[0].double()


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
        verifier, case.draft_model, case.target_model, case.num_drafts, case.draft_len, prefix=case.prefix
    )
    metrics.update(
        tv_distance=audit.tv_distance,
        max_abs_error=audit.max_abs_error,
        token_tv_distance=audit.token_tv_distance,
        prefix_cap_excess=audit.prefix_cap_excess,
        acceptance=audit.acceptance,
        block_efficiency=audit.block_efficiency,
        num_draft_tuples=audit.num_draft_tuples,
    )
    details["worst_strings"] = audit.worst_strings()
    details["first_token_law"] = audit.first_token_law.tolist()
    details["target_first_token_law"] = audit.target_law[0].tolist()
    if audit.prefix_cap_excess > 0:
        details["worst_prefix"] = list(audit.worst_prefix)
    if carries:
        # With a carried repair one iteration alone is not meant to be exact: the multi-iteration
        # law is the judge; its single-iteration TV is reported for information only.
        metrics["single_iteration_tv_distance"] = metrics.pop("tv_distance")
        metrics["single_iteration_max_abs_error"] = metrics.pop("max_abs_error")
    else:
        checks.append(Check("exact", audit.max_abs_error <= EXACT_TOL, audit.max_abs_error, EXACT_TOL,
                            "max |F(w) - q(w)| over strings of length L + 1 (single iteration, unmodified continuation)"))
    checks.append(Check("prefix-cap", audit.prefix_cap_excess <= EXACT_TOL, audit.prefix_cap_excess, EXACT_TOL,
                        "max over prefixes u of B(u) - q(u); above 0 no later correction can repair the step"))
    if alpha_star is not None:
        acceptance = audit.acceptance
        # An LP optimum is only as accurate as the solver (about 1e-9 relative); the closed form is exact.
        tol = LP_TOL if details.get("optimal_acceptance_source") == "lp" else BOUND_TOL
        metrics["acceptance_ratio"] = acceptance / alpha_star if alpha_star > 0 else None
        checks.append(Check("acceptance<=optimal", acceptance <= alpha_star + tol, acceptance, alpha_star,
                            "P(first emitted token in the drafts' first tokens) <= alpha*"))
        if "optimal" in verifier.guarantees:
            checks.append(Check("acceptance>=optimal", acceptance >= alpha_star - tol, acceptance, alpha_star,
                                "the verifier claims the optimal acceptance alpha*"))
        if "spectr" in verifier.guarantees and "spectr_bound" in metrics:
            floor = metrics["spectr_bound"]
            checks.append(Check("spectr-guarantee", acceptance >= floor - BOUND_TOL, acceptance, floor,
                                "acceptance >= (1 - (1 - 1/K)^K) alpha*"))


def _multi_iteration_check(verifier, case, checks, metrics, details) -> None:
    from spectr_audit.exact.multi_iteration import exact_multi_iteration

    num_tokens = case.num_tokens or case.draft_len + 1
    audit = exact_multi_iteration(
        verifier, case.draft_model, case.target_model, case.num_drafts, case.draft_len, num_tokens, prefix=case.prefix
    )
    metrics.update(tv_distance=audit.tv_distance, max_abs_error=audit.max_abs_error,
                   multi_iteration_tokens=num_tokens, multi_iteration_prefix_cap_excess=audit.prefix_cap_excess)
    details["multi_iteration"] = {"num_tokens": num_tokens, "num_histories": audit.num_histories,
                                  "expected_iterations": audit.expected_iterations}
    checks.append(Check("exact-multi-iteration", audit.max_abs_error <= MULTI_TOL, audit.max_abs_error, MULTI_TOL,
                        f"max |P(first {num_tokens} tokens = w) - q(w)| over the whole decoding loop, corrections applied"))


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
        checks.append(Check("block-efficiency<=optimal", efficiency <= bound + LP_TOL, efficiency, bound,
                            "E[len(s)] <= the block LP optimum" + (" with repair" if carries else "")))


def _statistical_check(verifier, case, options, checks, metrics, details) -> None:
    from spectr_audit.statistical.audit import statistical_audit

    result = statistical_audit(
        verifier, case.draft_model, case.target_model, case.num_drafts, case.draft_len,
        prefix=case.prefix, alpha=options.alpha, min_detectable_tv=options.min_detectable_tv, power=options.power,
        max_samples=options.max_samples, max_seconds=options.max_seconds, seed=options.seed, device=options.device,
    )
    summary = result.to_dict()
    metrics.update(pvalue=result.pvalue, test=result.test, num_samples=result.num_samples, seed=result.seed,
                   min_detectable_tv=result.min_detectable_tv, alpha=result.alpha)
    if result.acceptance_samples:
        metrics.update(acceptance=result.acceptance, block_efficiency=result.block_efficiency,
                       acceptance_ci=list(result.acceptance_ci()))
        if metrics.get("optimal_acceptance"):
            metrics["acceptance_ratio"] = result.acceptance / metrics["optimal_acceptance"]
    details["statistical"] = summary
    details["worst_cells"] = summary.get("worst_cells", [])
    checks.append(Check("statistical", not result.rejects(), result.pvalue, result.alpha,
                        f"{result.test}: exactness not rejected at the stated false-alarm rate "
                        f"(minimum detectable TV {result.min_detectable_tv:.3g} at power {result.power:.2f}, "
                        f"{result.num_samples} samples)"))


def _sampler_check(verifier, case, options, checks, metrics, details) -> None:
    from spectr_audit.statistical.agreement import sampler_law_agreement

    result = sampler_law_agreement(
        verifier, case.draft_model, case.target_model, case.num_drafts, case.draft_len, prefix=case.prefix,
        alpha=options.alpha, min_detectable_tv=options.min_detectable_tv, power=options.power,
        max_samples=options.sampler_max_samples, seed=options.seed, device=options.device,
    )
    metrics.update(sampler_pvalue=result.pvalue, sampler_samples=result.num_samples,
                   sampler_min_detectable_tv=result.min_detectable_tv)
    checks.append(Check("sampler-law", result.pvalue > result.alpha, result.pvalue, result.alpha,
                        f"{result.test}: the sampler follows the verifier's own output_probs "
                        f"({result.num_samples} samples, minimum detectable TV {result.min_detectable_tv:.3g})"))


def audit_case(verifier: Verifier, case: Case, options: AuditOptions = AuditOptions()) -> AuditResult:
    """Audit ``verifier`` on ``case``; never raises for a verifier's own failure.

    Exact verifiers (with ``output_probs``) get the exact single-iteration audit, the
    multi-iteration audit when they carry a next-iteration repair, the block LP for
    L > 1, and optionally a sampler-versus-law check; black boxes get the statistical
    audit.  Every number lands in ``metrics``; only ``checks`` decide.
    """
    from spectr_audit.contract.correction import has_carried_correction

    checks: list[Check] = []
    details: dict = {}
    metrics: dict = {"num_drafts": case.num_drafts, "draft_len": case.draft_len, "vocab_size": case.vocab_size}
    start = time.perf_counter()
    try:
        alpha_star = _optimality(case, verifier.draft_scheme, metrics, details) if "optimality" in case.checks else None
        carries = has_carried_correction(verifier)
        if verifier.has_exact_law:
            if "exact" in case.checks:
                _exact_checks(verifier, case, alpha_star, carries, checks, metrics, details)
            if carries and ("multi-iteration" in case.checks or "exact" in case.checks):
                _multi_iteration_check(verifier, case, checks, metrics, details)
            if "sampler" in case.checks:
                _sampler_check(verifier, case, options, checks, metrics, details)
        elif "statistical" in case.checks:
            _statistical_check(verifier, case, options, checks, metrics, details)
        if "block-lp" in case.checks and case.draft_len > 1 and verifier.draft_scheme == "iid":
            try:
                _block_lp_check(case, carries, checks, metrics, details)
            except InvalidArgument as exc:
                details["block_lp"] = f"skipped: {exc}"
        if not checks:
            checks.append(Check("ran", True, None, None, "no applicable check"))
    except Exception as exc:  # one bad verifier or case must never lose the other results
        return error_result(verifier, case.name, exc, checks, metrics)
    metrics["seconds"] = time.perf_counter() - start
    return AuditResult(
        verifier=verifier.name, case=case.name, checks=tuple(checks), metrics=metrics,
        expected=declared_verdict(verifier), details=details,
    )


def select_verifiers(specs: Optional[Sequence[str]]) -> Optional[list[Verifier]]:
    """``None`` (each case's own list, else the built-ins) when ``specs`` is empty, else each spec loaded."""
    return None if not specs else [load_verifier(s) for s in specs]


def plan_jobs(suite: Suite, verifiers: Optional[Iterable[Verifier]] = None) -> tuple[list, list]:
    """The (verifier, case) pairs ``run_suite`` audits, and error results for unloadable verifiers.

    With ``verifiers`` given, exactly those run on every case they support.  Without it,
    a case that names its verifiers (``verifiers = [...]`` in the suite file: short names
    or import strings) runs those, and other cases run every built-in verifier.
    """
    explicit = list(verifiers) if verifiers is not None else None
    builtins: Optional[list] = None
    loaded: dict = {}
    jobs: list = []
    errors: list = []
    for case in suite.cases:
        if explicit is not None:
            candidates = explicit
        elif case.verifiers is None:
            builtins = builtins if builtins is not None else builtin_verifiers()
            candidates = builtins
        else:
            candidates = []
            for spec in case.verifiers:
                if spec not in loaded:
                    try:
                        loaded[spec] = load_verifier(spec)
                    except SpectrAuditError as exc:
                        loaded[spec] = exc
                if isinstance(loaded[spec], Exception):
                    errors.append(AuditResult(verifier=spec, case=case.name, error=f"{type(loaded[spec]).__name__}: {loaded[spec]}"))
                else:
                    candidates.append(loaded[spec])
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
    """
    jobs, results = plan_jobs(suite, verifiers)
    if progress is not None and hasattr(progress, "start"):
        progress.start(len(jobs))
    for verifier, case in jobs:
        if progress is not None:
            progress(verifier.name, case.name)
        results.append(audit_case(verifier, case, options))
    return AuditReport(
        results=tuple(results),
        suite=suite.name,
        meta={"num_cases": len(suite.cases), "num_audits": len(results), "seed": options.seed},
    )
