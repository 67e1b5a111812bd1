"""Run audits: each verifier on each case it supports, every failure kept as a result.

One bad verifier (a crash, a contract breach) never loses the other results: the
audit of that verifier on that case becomes a result with ``error`` set.

:func:`audit_case` binds the audit once (:class:`~spectr_audit.run.request.AuditRequest`: the
verifier under its time limit, the case and its laws, the options, the sampling parameters) and
runs the stages of :data:`~spectr_audit.run.stages.STAGES` that apply, for a chain case and a tree
case alike, the table the memory budget reads too; :mod:`spectr_audit.run.checks` turns what each
stage finds into checks.
"""

from __future__ import annotations

import dataclasses
import time
import traceback
from typing import Callable, Iterable, Optional, Sequence

from spectr_audit import defaults
from spectr_audit.contract.chain_trees import ChainVerifierAsTree
from spectr_audit.contract.convert import as_tree_verifier
from spectr_audit.contract.correction import has_carried_correction
from spectr_audit.contract.verifier import Verifier
from spectr_audit.errors import InvalidArgument, SpectrAuditError
from spectr_audit.registry import builtin_verifiers, load_tree_verifier, load_verifier, tree_verifiers
from spectr_audit.results import AuditReport, AuditResult, Check
from spectr_audit.run import budget, guard
from spectr_audit.run.budget import check_block_lp, check_jobs
from spectr_audit.run.checks import (  # noqa: F401 (the tolerances and the statistical result's checks, re-exported)
    BOUND_TOL,
    EXACT_TOL,
    LP_MAX_VARIABLES,
    LP_TOL,
    MULTI_TOL,
    add_statistical_result,
    block_lp_check,
    bound_checks,
    exact_certificate,
    exact_checks,
    exact_tree_checks,
    exact_tree_reach,
    first_position,
    multi_iteration_check,
    optimality,
    record_sampling,
    sampler_check,
    statistical_check,
    statistical_detail,
    tree_optimality,
    tv_text,
)
from spectr_audit.run.guard import probe_checks as guard_probe
from spectr_audit.run.incomplete import RunAborted, RunInterrupted, incomplete_report
from spectr_audit.run.options import AuditOptions
from spectr_audit.run.request import AuditRequest
from spectr_audit.run.stages import audit_stages
from spectr_audit.run.suite import Case, Suite, case_selection, describe_tree_case, fits_selection, select_cases

__all__ = ["AuditOptions", "audit_case", "audit_tree_case", "tree_fits", "declared_verdict", "error_result", "plan_jobs", "run_suite", "scheme_fits", "select_verifiers", "EXACT_TOL", "BOUND_TOL"]


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
        details={"traceback": traceback.format_exc(limit=-4)},
    )


def scheme_fits(verifier: Verifier, case: Case) -> bool:
    """Whether the case allows the verifier's drafting scheme (without replacement: L = 1, K <= support)."""
    if verifier.draft_scheme != "without_replacement":
        return True
    draft_first, _ = first_position(case)
    return case.draft_len == 1 and int((draft_first > 0).sum()) >= case.num_drafts


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
    laws = case.laws() if hasattr(case, "laws") else case
    timeout = guard.check_timeout(options.verifier_timeout)
    if getattr(case, "tree", None) is not None:
        with guard.time_limited(verifier, timeout) as limited:
            return audit_tree_case(limited, laws, options)
    budget.check_audit(verifier, laws, options)
    with guard.time_limited(verifier, timeout) as limited:
        return _CaseAudit(AuditRequest(limited, case, options)).run()


class _CaseAudit:
    """One audit within its guards, of a chain or a tree case: the stages of
    :data:`~spectr_audit.run.stages.STAGES` that apply run in order, their findings (checks, metrics,
    details) kept, and whatever was found before an error kept in the error result.

    A chain case (K drafts of L tokens: the tree ``DraftTree.chains(K, L)``) is audited with the chain
    contract: exact verifiers (with ``output_probs``) get the exact single-iteration audit, the
    multi-iteration audit when they carry a next-iteration repair, the block LP for L > 1, and
    optionally a sampler-versus-law check; black boxes get the statistical audit.  With sampling
    parameters (``case.params``) the audits take the raw models and the parameters (a verifier that
    takes logits is handed the raw logits), while the bounds, the block LP and the probe use the
    processed laws (``case.laws()``); the setting is recorded in ``metrics`` (``sampling``,
    ``temperature``, ``top_k``, ``top_p``, ``min_p``) and in ``details["sampling"]``.

    A tree case is audited with the tree verifier (a chain verifier converted to run on chain trees,
    which the result names): the exact tree audit where the enumeration is in reach, else the
    statistical audit on sampled trees, then acceptance and accepted length against the tree's bound;
    ``details["tree"]`` describes the tree.  Every number lands in ``metrics``; only ``checks`` decide.
    """

    def __init__(self, request: AuditRequest):
        case = request.case
        self.request = request
        self.subject = request.verifier  # the verifier the result names
        self.checks: list[Check] = []
        self.metrics = {"num_drafts": case.num_drafts, "draft_len": case.draft_len, "vocab_size": case.vocab_size}
        self.details: dict = {}
        self.tree = getattr(case, "tree", None)
        self.alpha_star: Optional[float] = None
        self.bound = None  # a tree case's bound (alpha* and the best accepted length)
        self.exact_done = False
        self.scheme: Optional[str] = None
        if self.tree is None:
            self.carries = has_carried_correction(request.verifier)
            record_sampling(request.verifier, case, self.metrics, self.details)
        else:
            self.carries = False  # a verifier that carries a repair is judged on chain cases
            self.metrics.update(tree_draft_nodes=self.tree.num_draft_nodes, tree_depth=self.tree.max_depth)
            self.details["tree"] = describe_tree_case(case)

    def _prepare(self) -> None:
        """Work before the first stage that may fail like a stage (an error result, not an exception)."""
        if self.tree is not None:
            # a chain verifier runs on chain trees; the result names the tree verifier
            self.subject = as_tree_verifier(self.request.verifier)
            self.scheme = self.request.case.draft_scheme or self.subject.draft_schemes[0]
            self.details["tree"]["draft_scheme"] = self.scheme

    def run(self) -> AuditResult:
        start = time.perf_counter()
        try:
            self._prepare()
            for stage in audit_stages(self.subject, self.request.case):
                getattr(self, "_" + stage.replace("-", "_"))()
        except Exception as exc:  # one bad verifier or case must never lose the other results
            return error_result(self.subject, self.request.case.name, exc, self.checks, self.metrics)
        return _audited(self.subject, self.request.case, self.checks, self.metrics, self.details, start)

    def _probe(self) -> None:
        request = self.request
        rows = probe_rows(request.options.max_samples)
        self.checks.extend(guard_probe(request.probed, request.laws, request.options.seed, rows))
        self.request = request.with_options(_after_probe(request.options, PROBE_CALLS * rows))

    def _optimality(self) -> None:
        if self.tree is None:
            self.alpha_star = optimality(self.request.laws, self.request.verifier.draft_scheme, self.metrics,
                                         self.details)
        else:
            self.bound = tree_optimality(self.request.case, self.scheme, self.metrics, self.details)
            self.alpha_star = None if self.bound is None else self.bound.acceptance

    def _exact(self) -> None:
        if self.tree is None:
            exact_checks(self.request, self.carries, self.checks, self.metrics, self.details)
            return
        case = self.request.case
        reason = exact_tree_reach(case, self.scheme)
        if reason is not None:
            self.details["exact"] = f"skipped: {reason}; the statistical audit runs instead"
            return
        exact_tree_checks(self.subject, case, self.scheme, self.checks, self.metrics, self.details)
        self.exact_done = True

    def _multi_iteration(self) -> None:
        multi_iteration_check(self.request, self.checks, self.metrics, self.details)

    def _sampler(self) -> None:
        sampler_check(self.request, self.checks, self.metrics, self.details)

    def _certificate(self) -> None:
        exact_certificate(self.request.options, self.checks, self.metrics)

    def _statistical(self) -> None:
        request = self.request
        if self.tree is None:
            statistical_check(request, self.checks, self.metrics, self.details)
            return
        if self.exact_done:
            return
        statistical_check(request, self.checks, self.metrics, self.details, subject=self.subject,
                          draft_scheme=self.scheme)
        if self.metrics.get("block_efficiency") is not None:
            self.metrics["accepted_length"] = self.metrics["block_efficiency"] - 1.0

    def _bounds(self) -> None:
        bound_checks(self.subject, self.alpha_star, self.checks, self.metrics, tree=self.tree is not None,
                     tree_bound=self.bound)

    def _block_lp(self) -> None:
        laws = self.request.laws
        try:
            check_block_lp(laws, self.request.options)
            block_lp_check(laws, self.carries, self.checks, self.metrics, self.details)
        except InvalidArgument as exc:
            self.details["block_lp"] = f"skipped: {exc}"


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


def tree_fits(verifier, case: Case) -> bool:
    """Whether ``verifier`` (a tree verifier, or a chain verifier on a chain tree) can be audited on a tree case.

    It must support the tree and take the case's draft scheme (by default its own first), carry no
    next-iteration repair (a chain verifier that does is judged by the multi-iteration audit), and the
    scheme must be able to draft the tree: without replacement, the root's draft law has as many
    tokens as the widest node has children; under ``topk`` / ``none``, every rank is a token.
    """
    try:
        tree_verifier = as_tree_verifier(verifier)
    except InvalidArgument:
        return False

    if isinstance(tree_verifier, ChainVerifierAsTree) and has_carried_correction(tree_verifier.verifier):
        return False  # judged with its repair by the multi-iteration audit, on chain cases
    tree = case.tree
    scheme = case.draft_scheme or tree_verifier.draft_schemes[0]
    if not tree_verifier.supports_tree(tree) or scheme not in tree_verifier.draft_schemes:
        return False
    if scheme == "without_replacement":
        draft_first, _ = first_position(case)
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
    return _CaseAudit(AuditRequest(verifier, case, options)).run()


def select_verifiers(specs: Optional[Sequence[str]]) -> Optional[list[Verifier]]:
    """``None`` (each case's own list, else the built-ins) when ``specs`` is empty, else each spec loaded.

    A tree verifier the chain contract cannot run (one drafting only ``topk`` or ``none``) is
    kept as a tree verifier: it runs on the suite's tree cases only.
    """
    if not specs:
        return None
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


def _plan_tree_case(case: Case, explicit, builtins, tree_builtins, loaded: dict, selections: dict):
    """The jobs of a tree case: the given verifiers as tree verifiers (those whose selection takes the case's K
    and L), the case's own list (loaded as tree verifiers), or the tree built-ins and the chain built-ins (on
    chain trees); returns the caches too."""
    errors: list = []
    if explicit is not None:
        candidates = [as_tree_verifier(v) for v in explicit if fits_selection(case, selections[id(v)])]
    elif case.verifiers is None:
        if tree_builtins is None:
            builtins = builtins if builtins is not None else builtin_verifiers()
            tree_builtins = tree_verifiers() + [as_tree_verifier(v) for v in builtins]
        candidates = tree_builtins
    else:
        candidates = _listed_verifiers(case, "tree", load_tree_verifier, loaded, errors)
    return [(v, case) for v in candidates if tree_fits(v, case)], errors, builtins, tree_builtins


def plan_jobs(suite: Suite, verifiers: Optional[Iterable[Verifier]] = None, *, num_drafts=None,
              draft_len=None) -> tuple[list, list]:
    """The (verifier, case) pairs ``run_suite`` audits, and error results for unloadable verifiers.

    With ``verifiers`` given, exactly those run on every case they support.  Without it,
    a case that names its verifiers (``verifiers = [...]`` in the suite file: short names
    or import strings) runs those, and other cases run every built-in verifier.

    ``num_drafts`` / ``draft_len`` (an int, a list, or text such as ``"1-3"``) keep the suite's cases of
    those K and L (:func:`~spectr_audit.run.suite.select_cases`); a given verifier that declares none of its
    (K, L) runs at the stated default where nothing is selected (:func:`~spectr_audit.run.suite.case_selection`).
    """
    suite = select_cases(suite, num_drafts, draft_len)
    explicit = list(verifiers) if verifiers is not None else None
    selections = {id(v): case_selection(v, num_drafts, draft_len) for v in explicit or ()}
    builtins: Optional[list] = None
    tree_builtins: Optional[list] = None
    loaded: dict = {}
    jobs: list = []
    errors: list = []
    for case in suite.cases:
        if getattr(case, "tree", None) is not None:
            jobs_, errors_, builtins, tree_builtins = _plan_tree_case(case, explicit, builtins, tree_builtins, loaded,
                                                                      selections)
            jobs.extend(jobs_)
            errors.extend(errors_)
            continue
        if explicit is not None:
            # tree verifiers the chain contract cannot run were kept for the tree cases only
            candidates = [v for v in explicit if isinstance(v, Verifier) and fits_selection(case, selections[id(v)])]
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
    *,
    num_drafts=None,
    draft_len=None,
) -> AuditReport:
    """Audit every verifier on every case of ``suite`` that it supports (see :func:`plan_jobs`; ``num_drafts``
    and ``draft_len`` select the cases, as there).

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
                              f"with spectr_audit.run.generation_suite.run_generation_suite or spectr-audit generation "
                              f"--suite")
    jobs, results = plan_jobs(suite, verifiers, num_drafts=num_drafts, draft_len=draft_len)
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
