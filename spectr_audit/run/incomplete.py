"""Runs that stop early: the finished results, in a report marked incomplete.

A run stopped by Ctrl-C (:class:`RunInterrupted`, a ``KeyboardInterrupt``) or by an error outside
any one audit (:class:`RunAborted`) carries ``report``: every result finished before the stop,
with ``meta["incomplete"]`` saying why, how many audits were planned and how many finished.  An
incomplete report never passes (:func:`is_incomplete`); the JSON has the field, the Markdown and
HTML reports say so in a line at the top, and the CLI writes it and exits 130 (Ctrl-C) or 2.

Examples
--------
>>> from spectr_audit.run.incomplete import incomplete_report, is_incomplete
>>> report = incomplete_report([], "default", {"seed": 0}, planned=3, reason="interrupted (SIGINT)")
>>> is_incomplete(report), report.meta["incomplete"]["completed"], report.passed
(True, 0, False)
"""

from __future__ import annotations

from typing import Any, Sequence

from spectr_audit.errors import SpectrAuditError
from spectr_audit.results import AuditReport

__all__ = ["RunAborted", "RunInterrupted", "incomplete_report", "incomplete_text", "is_incomplete"]


class RunInterrupted(KeyboardInterrupt):
    """Ctrl-C during a run; ``report`` holds the finished results, marked incomplete."""

    def __init__(self, report: AuditReport):
        super().__init__(incomplete_text(report))
        self.report = report


class RunAborted(SpectrAuditError):
    """An error outside any one audit stopped a run; ``report`` holds the finished results, ``cause`` the error."""

    def __init__(self, report: AuditReport, cause: BaseException):
        super().__init__(incomplete_text(report))
        self.report = report
        self.cause = cause


def incomplete_report(results: Sequence[Any], suite: str, meta: dict, planned: int, reason: str) -> AuditReport:
    """The report of a run that stopped after ``len(results)`` of ``planned`` audits, for ``reason``."""
    info = {"reason": reason, "completed": len(results), "planned": planned}
    return AuditReport(results=tuple(results), suite=suite,
                       meta={**meta, "num_audits": len(results), "incomplete": info})


def is_incomplete(report: Any) -> bool:
    """Whether ``report`` is marked incomplete."""
    return isinstance(getattr(report, "meta", None), dict) and bool(report.meta.get("incomplete"))


def incomplete_text(report: Any) -> str:
    """One line for reports and the terminal: why the run stopped and what it holds ("" when complete)."""
    if not is_incomplete(report):
        return ""
    info = report.meta["incomplete"]
    return (f"INCOMPLETE: the run was {info.get('reason', 'stopped')}; this report holds the "
            f"{info.get('completed', '?')} of {info.get('planned', '?')} planned audits that finished")
