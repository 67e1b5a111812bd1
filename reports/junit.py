"""The JUnit XML report: one ``<testcase>`` per verifier and case, metrics as ``<property>`` elements.

CI systems (GitHub Actions test reporters, GitLab, Jenkins) read this format.  A result
fails when its verdict differs from its declaration or when it breaks a gate threshold;
an audit that could not run is an ``<error>``; an INCONCLUSIVE result (nothing rejected, below
its planned power) is ``<skipped>``, with the reason.  Every test case has a ``verdict`` property.
"""

from __future__ import annotations

import math
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any, Optional

from spectr_audit._files import write_text_atomic
from spectr_audit.results import AuditReport, AuditResult

__all__ = ["render_junit", "write_junit"]


def _number(value: Any) -> Optional[str]:
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        return repr(value) if math.isfinite(value) else None
    return None


def _failure_text(result: AuditResult, violations: list) -> tuple[str, str]:
    """(one-line message, body) for a result that did not go as expected."""
    lines = []
    if not result.as_expected:
        if result.expected is not None:
            declared = "exact" if result.expected else "inexact"
            # the measured verdict itself (exact, INCONCLUSIVE, CERTIFIED, FINDING, ERROR)
            lines.append(f"declared {declared}, measured {result.verdict}")
        for check in result.failed_checks:
            lines.append(f"check {check.name} failed: value {check.value!r}, threshold {check.threshold!r}. {check.detail}")
        for worst in (result.details.get("worst_strings") or [])[:5]:
            lines.append(f"  string {worst.get('string')}: implied {worst.get('implied')!r}, target {worst.get('target')!r}")
        if not result.details.get("worst_strings"):
            for cell in (result.details.get("worst_cells") or [])[:5]:
                if isinstance(cell, dict):
                    lines.append(f"  cell {cell.get('cell')}: observed {cell.get('observed')!r}, "
                                 f"expected {cell.get('expected')!r}")
    for violation in violations:
        lines.append(f"gate: {violation}")
    message = lines[0] if lines else "failed"
    return message, "\n".join(lines)


def render_junit(report: AuditReport, gate: Any = None) -> str:
    """Render ``report`` as JUnit XML text.

    Parameters
    ----------
    report : AuditReport
    gate : GateOutcome, optional
        When given, each result's threshold violations are failures too.

    Returns
    -------
    str
        An XML document with one ``<testsuite>``; each ``<testcase>`` is named by the case,
        with ``classname`` ``spectr_audit.<verifier>``, and carries the result's numeric
        metrics as ``<property name="..." value="..."/>``.
    """
    violations_by_result: dict = {}
    for violation in getattr(gate, "violations", ()) or ():
        violations_by_result.setdefault((violation.verifier, violation.case), []).append(violation)
    suite_name = f"spectr-audit.{report.suite or 'audit'}"
    testsuite = ET.Element("testsuite", name=suite_name)
    num_failures = num_errors = num_skipped = 0
    total_time = 0.0
    for result in report.results:
        seconds = result.metrics.get("seconds")
        seconds = float(seconds) if isinstance(seconds, (int, float)) and math.isfinite(seconds) else 0.0
        total_time += seconds
        case = ET.SubElement(
            testsuite, "testcase", classname=f"spectr_audit.{result.verifier}", name=result.case, time=f"{seconds:.6f}"
        )
        properties = ET.SubElement(case, "properties")
        ET.SubElement(properties, "property", name="passed", value=str(result.passed).lower())
        ET.SubElement(properties, "property", name="verdict", value=result.verdict)
        if result.expected is not None:
            ET.SubElement(properties, "property", name="expected", value=str(result.expected).lower())
        for key, value in result.metrics.items():
            text = _number(value)
            if text is not None:
                ET.SubElement(properties, "property", name=key, value=text)
        for key in ("sampling", "sampling_order"):  # the sampling setting the case held the verifier to
            if isinstance(result.metrics.get(key), str):
                ET.SubElement(properties, "property", name=key, value=result.metrics[key])
        violations = violations_by_result.get((result.verifier, result.case), [])
        if result.error is not None:
            num_errors += 1
            error = ET.SubElement(case, "error", message=result.error.splitlines()[0][:500], type="AuditError")
            error.text = result.error + "\n" + str(result.details.get("traceback", ""))
        elif result.inconclusive and not violations and result.as_expected:
            # not a failure unless the run fails on it (--fail-on-inconclusive); its own outcome all the same
            skipped = ET.SubElement(case, "skipped", message="INCONCLUSIVE: " + "; ".join(
                c.detail for c in result.checks if c.inconclusive)[:480])
            skipped.text = "nothing rejected, but below the planned power (or a certificate not reached)"
            num_skipped += 1
        elif not result.as_expected or violations:
            num_failures += 1
            message, body = _failure_text(result, violations)
            failure = ET.SubElement(case, "failure", message=message[:500], type="Finding" if not result.as_expected else "GateViolation")
            failure.text = body
    if gate is not None and getattr(gate, "unmeasured", ()):
        # A threshold that checked nothing fails the gate; give it a testcase so CI shows why.
        for threshold in gate.unmeasured:
            num_failures += 1
            case = ET.SubElement(testsuite, "testcase", classname="spectr_audit.run.gate", name=str(threshold), time="0")
            failure = ET.SubElement(case, "failure", message=f"no gated result measured {threshold.metric}", type="GateViolation")
            failure.text = f"{threshold.source or threshold}: no gated result measured {threshold.metric!r}"
    testsuite.set("tests", str(len(testsuite.findall("testcase"))))
    testsuite.set("failures", str(num_failures))
    testsuite.set("errors", str(num_errors))
    testsuite.set("skipped", str(num_skipped))
    testsuite.set("time", f"{total_time:.6f}")
    testsuites = ET.Element("testsuites", name="spectr-audit")
    testsuites.append(testsuite)
    ET.indent(testsuites)
    return '<?xml version="1.0" encoding="utf-8"?>\n' + ET.tostring(testsuites, encoding="unicode") + "\n"


def write_junit(report: AuditReport, path: Path, gate: Any = None) -> Path:
    """Write the JUnit XML report to ``path`` atomically (parents created); returns the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_text_atomic(path, render_junit(report, gate))
    return path
