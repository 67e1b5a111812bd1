"""The one-call Python API: :func:`audit` a verifier on a suite, :func:`assert_passed` on the report."""

from __future__ import annotations

import dataclasses
from typing import Any, Iterable, Optional, Sequence

from spectr_audit.errors import InvalidArgument
from spectr_audit.registry import load_verifier
from spectr_audit.results import AuditReport
from spectr_audit.run.conformance import describe_result
from spectr_audit.run.gate import evaluate_gate
from spectr_audit.run.runner import AuditOptions, run_suite
from spectr_audit.run.suite import Suite, load_suite

__all__ = ["assert_passed", "audit", "report_failures"]


def audit(
    verifier: Any,
    suite: Any = "default",
    *,
    seed: int = 0,
    options: Any = None,
    num_drafts: Any = None,
    draft_len: Any = None,
    **option_overrides: Any,
) -> AuditReport:
    """Audit ``verifier`` on every case of ``suite`` that it supports and return the report.

    Parameters
    ----------
    verifier : Verifier, class, callable, str, or a list of them
        A built-in or registered name (``"kseq"``), an import string (``"pkg.mod:attr"`` or
        ``"path/to/file.py:attr"``), a :class:`~spectr_audit.contract.Verifier` (instance or
        class) or a plain ``verify`` function.
    suite : str or Suite
        A built-in suite name, a path to a suite ``.toml``, or a
        :class:`~spectr_audit.run.suite.Suite`.
    seed : int
        Seed of every random stream of the run (the run is deterministic given it).
    num_drafts, draft_len : int, list or str (``"1-3"``), optional
        Only the suite's cases of these K and L (default: every case each verifier supports; a plain
        function that declares none of its K and L runs at K = 1, L = 1 where nothing is selected).
    options : AuditOptions, optional
        The run's knobs; ``option_overrides`` (e.g. ``max_samples=``, ``max_seconds=``,
        ``alpha=``) replace single fields of it.

    Returns
    -------
    AuditReport
        Not asserted on: pass it to :func:`assert_passed`, or read ``report.passed`` and
        ``report.results``.

    Examples
    --------
    >>> import spectr_audit
    >>> report = spectr_audit.audit("speculative", suite="default", max_samples=2000)
    >>> report.passed
    True
    """
    base = options if options is not None else AuditOptions(seed=seed)
    if not isinstance(base, AuditOptions):
        raise InvalidArgument(f"options: expected an AuditOptions, got {type(base).__name__}")
    fields = {f.name for f in dataclasses.fields(AuditOptions)}
    unknown = sorted(set(option_overrides) - fields)
    if unknown:
        raise InvalidArgument(f"{', '.join(unknown)}: unknown option(s); expected some of {', '.join(sorted(fields))}")
    if options is not None and seed != 0:
        option_overrides.setdefault("seed", seed)
    run_options = dataclasses.replace(base, **option_overrides)
    suite_obj = suite if isinstance(suite, Suite) else load_suite(suite)
    verifiers = verifier if isinstance(verifier, (list, tuple)) else [verifier]
    return run_suite(suite_obj, [load_verifier(v) for v in verifiers], run_options, num_drafts=num_drafts,
                     draft_len=draft_len)


def report_failures(report: AuditReport, thresholds: Sequence[Any] = ()) -> list[str]:
    """The lines that explain why ``report`` did not pass (empty when it did)."""
    lines: list[str] = []
    for result in report.results:
        if not result.as_expected:
            lines.append(f"verifier {result.verifier!r}, case {result.case!r}:")
            lines.extend("  " + line for line in describe_result(result).splitlines())
    if thresholds:
        gate = evaluate_gate(report.results, list(thresholds))
        if not gate.passed:
            lines.extend(gate.message().splitlines())
    return lines


def assert_passed(report: AuditReport, thresholds: Optional[Iterable[Any]] = None) -> None:
    """Raise ``AssertionError`` naming every result that did not go as declared.

    Parameters
    ----------
    report : AuditReport
        From :func:`audit` or :func:`~spectr_audit.run.runner.run_suite`.
    thresholds : sequence of gate thresholds, optional
        Parsed with :func:`~spectr_audit.run.gate.parse_threshold`; a violated one fails too.

    Examples
    --------
    >>> import spectr_audit
    >>> spectr_audit.assert_passed(spectr_audit.audit("speculative", max_samples=2000))
    """
    if not isinstance(report, AuditReport):
        raise InvalidArgument(f"report: expected an AuditReport (from spectr_audit.audit), got {type(report).__name__}")
    lines = report_failures(report, tuple(thresholds or ()))
    if lines:
        raise AssertionError(f"spectr-audit: {report.suite}: " + "\n".join(lines))
