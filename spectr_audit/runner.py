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

from spectr_audit.bounds import (
    optimal_acceptance,
    optimal_acceptance_lp,
    optimal_acceptance_lp_from_sets,
    spectr_guarantee,
)
from spectr_audit.contract import Verifier
from spectr_audit.errors import InvalidArgument, SpectrAuditError
from spectr_audit.exact import exact_iteration
from spectr_audit.models import contexts_from
from spectr_audit.registry import builtin_verifiers, load_verifier
from spectr_audit.results import AuditReport, AuditResult, Check
from spectr_audit.suite import Case, Suite

__all__ = ["AuditOptions", "audit_case", "run_suite", "select_verifiers", "EXACT_TOL", "BOUND_TOL"]

#: Exact laws must match the target to this absolute error (float64 enumeration).
EXACT_TOL = 1e-12
#: Slack for comparisons with LP / closed-form optima.
BOUND_TOL = 1e-9
#: Run the alpha* LP next to the closed form when it has at most this many variables.
LP_MAX_VARIABLES = 20_000


@dataclasses.dataclass(frozen=True)
class AuditOptions:
    """Knobs of a run that are not part of a case."""

    seed: int = 0
    #: Statistical audits: false-alarm rate, and caps on samples / seconds.
    alpha: float = 1e-3
    max_samples: Optional[int] = None
    max_seconds: Optional[float] = None
    min_detectable_tv: float = 0.005
    power: float = 0.99
    device: str = "cpu"


def _declared(verifier: Verifier) -> Optional[bool]:
    expected = getattr(verifier, "expected", None)
    return None if expected is None else expected == "exact"


def _first_position(case: Case) -> tuple[torch.Tensor, torch.Tensor]:
    ctx = contexts_from(case.prefix, torch.zeros(1, 0, dtype=torch.int64))
    return case.draft_model(ctx)[0].double(), case.target_model(ctx)[0].double()


def _scheme_fits(verifier: Verifier, case: Case) -> bool:
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


def audit_case(verifier: Verifier, case: Case, options: AuditOptions = AuditOptions()) -> AuditResult:
    """Audit ``verifier`` on ``case``; never raises for a verifier's own failure."""
    checks: list[Check] = []
    metrics: dict = {}
    details: dict = {}
    start = time.perf_counter()
    try:
        alpha_star = _optimality(case, verifier.draft_scheme, metrics, details) if "optimality" in case.checks else None
        if verifier.has_exact_law and "exact" in case.checks:
            audit = exact_iteration(
                verifier, case.draft_model, case.target_model, case.num_drafts, case.draft_len, prefix=case.prefix
            )
            metrics.update(
                tv_distance=audit.tv_distance,
                max_abs_error=audit.max_abs_error,
                token_tv_distance=audit.token_tv_distance,
                prefix_cap_excess=audit.prefix_cap_excess,
                acceptance=audit.membership_acceptance,
                block_efficiency=audit.block_efficiency,
                num_draft_tuples=audit.num_draft_tuples,
            )
            details["worst_strings"] = audit.worst_strings()
            details["first_token_law"] = audit.first_token_law.tolist()
            details["target_first_token_law"] = audit.target_law[0].tolist()
            if audit.prefix_cap_excess > 0:
                details["worst_prefix"] = list(audit.worst_prefix)
            checks.append(Check("exact", audit.max_abs_error <= EXACT_TOL, audit.max_abs_error, EXACT_TOL,
                                "max |F(w) - q(w)| over strings of length L + 1"))
            checks.append(Check("prefix-cap", audit.prefix_cap_excess <= EXACT_TOL, audit.prefix_cap_excess, EXACT_TOL,
                                "max over prefixes u of B(u) - q(u)"))
            if alpha_star is not None:
                acceptance = audit.membership_acceptance
                metrics["acceptance_ratio"] = acceptance / alpha_star if alpha_star > 0 else None
                checks.append(Check("acceptance<=optimal", acceptance <= alpha_star + BOUND_TOL, acceptance, alpha_star,
                                    "P(first emitted token in the drafts' first tokens) <= alpha*"))
                if "spectr" in verifier.guarantees and "spectr_bound" in metrics:
                    floor = metrics["spectr_bound"]
                    checks.append(Check("spectr-guarantee", acceptance >= floor - BOUND_TOL, acceptance, floor,
                                        "acceptance >= (1 - (1 - 1/K)^K) alpha*"))
        elif not verifier.has_exact_law:
            details["note"] = "no exact law: statistical audit not run"
        if not checks:
            checks.append(Check("ran", True, None, None, "no applicable check"))
    except Exception as exc:  # one bad verifier or case must never lose the other results
        return AuditResult(
            verifier=verifier.name, case=case.name, checks=tuple(checks), metrics=metrics,
            expected=_declared(verifier), error=f"{type(exc).__name__}: {exc}",
            details={"traceback": traceback.format_exc(limit=4)},
        )
    metrics["seconds"] = time.perf_counter() - start
    return AuditResult(
        verifier=verifier.name, case=case.name, checks=tuple(checks), metrics=metrics,
        expected=_declared(verifier), details=details,
    )


def select_verifiers(specs: Optional[Sequence[str]]) -> list[Verifier]:
    """Built-ins when ``specs`` is empty, else each short name or import string loaded."""
    return builtin_verifiers() if not specs else [load_verifier(s) for s in specs]


def run_suite(
    suite: Suite,
    verifiers: Optional[Iterable[Verifier]] = None,
    options: AuditOptions = AuditOptions(),
    progress: Optional[Callable[[str, str], None]] = None,
) -> AuditReport:
    """Audit every verifier on every case of ``suite`` that it supports.

    With ``verifiers`` given, exactly those run on every case they support.  Without it,
    a case that names its verifiers (``verifiers = [...]`` in the suite file: short names
    or import strings) runs those, and other cases run every built-in verifier.  A
    verifier that cannot be loaded becomes an error result; the other results are kept.
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
        for verifier in candidates:
            if verifier.supports(case.num_drafts, case.draft_len) and _scheme_fits(verifier, case):
                jobs.append((verifier, case))
    results = list(errors)
    for verifier, case in jobs:
        if progress is not None:
            progress(verifier.name, case.name)
        results.append(audit_case(verifier, case, options))
    return AuditReport(
        results=tuple(results),
        suite=suite.name,
        meta={"num_cases": len(suite.cases), "num_audits": len(results), "seed": options.seed},
    )
