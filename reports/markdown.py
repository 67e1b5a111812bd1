"""The Markdown report: a summary table per verifier and case, then the findings."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

from spectr_audit.results import AuditReport, AuditResult

__all__ = ["render_markdown", "write_markdown"]


def _fmt(value: Optional[float], digits: int = 4) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        if value != 0 and (abs(value) < 1e-3 or abs(value) >= 1e5):
            return f"{value:.2e}"
        return f"{value:.{digits}f}"
    return str(value)


def _verdict(result: AuditResult) -> str:
    if result.error is not None:
        return "ERROR"
    measured = "exact" if result.passed else "FINDING"
    if result.expected is None:
        return measured
    declared = "exact" if result.expected else "inexact"
    return f"{measured} (declared {declared}{'' if result.as_expected else ', UNEXPECTED'})"


def render_markdown(report: AuditReport) -> str:
    """Render the report as Markdown text."""
    lines = [
        f"# spectr-audit report: suite `{report.suite}`",
        "",
        f"**Overall: {'PASS' if report.passed else 'FAIL'}** "
        f"({sum(r.as_expected for r in report.results)}/{len(report.results)} results as expected)",
        "",
        "Verdicts: `exact` = every check held; `FINDING` = some check failed (see below). A verifier may declare an "
        "expected verdict (a published rule under audit, a lossy-by-design mode): a run fails only where a "
        "verdict differs from its declaration.",
        "",
        "| verifier | case | verdict | TV | max abs err | prefix-cap excess | acceptance | alpha* | acc/alpha* | block eff. | p-value |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in report.results:
        m = r.metrics
        lines.append(
            f"| {r.verifier} | {r.case} | {_verdict(r)} | {_fmt(m.get('tv_distance'))} | {_fmt(m.get('max_abs_error'))} | "
            f"{_fmt(m.get('prefix_cap_excess'))} | {_fmt(m.get('acceptance'))} | {_fmt(m.get('optimal_acceptance'))} | "
            f"{_fmt(m.get('acceptance_ratio'))} | {_fmt(m.get('block_efficiency'))} | {_fmt(m.get('pvalue'))} |"
        )
    findings = [r for r in report.results if not r.passed]
    lines += ["", "## Findings", ""]
    if not findings:
        lines.append("None: every check of every result held.")
    for r in findings:
        lines.append(f"### {r.verifier} on {r.case}: {_verdict(r)}")
        lines.append("")
        if r.error:
            lines.append(f"Error: `{r.error}`")
        for c in r.failed_checks:
            lines.append(f"- check `{c.name}` failed: value {_fmt(c.value, 6)}, threshold {_fmt(c.threshold, 6)}. {c.detail}")
        worst = r.details.get("worst_strings") or []
        if worst:
            lines.append("")
            lines.append("| string | implied law | target law |")
            lines.append("|---|---|---|")
            for w in worst:
                lines.append(f"| {w['string']} | {_fmt(w['implied'], 6)} | {_fmt(w['target'], 6)} |")
        cells = r.details.get("worst_cells") or []
        if cells:
            lines.append("")
            lines.append("| cell | observed | expected |")
            lines.append("|---|---|---|")
            for c in cells:
                lines.append(f"| {c.get('cell')} | {_fmt(c.get('observed'), 6)} | {_fmt(c.get('expected'), 6)} |")
        lines.append("")
    gate = report.meta.get("gate")
    if gate:
        lines += ["## Gate", "", f"**{'held' if gate.get('passed') else 'FAILED'}**", ""]
        for v in gate.get("violations", []):
            t = v.get("threshold", {})
            lines.append(f"- {v.get('verifier')} on {v.get('case')}: {t.get('metric')} = {_fmt(v.get('value'), 6)} "
                         f"violates {t.get('op')} {t.get('limit')}")
        lines.append("")
    return "\n".join(lines) + "\n"


def write_markdown(report: AuditReport, path: Path) -> Path:
    """Write the Markdown report to ``path``; returns the path."""
    path = Path(path)
    path.write_text(render_markdown(report))
    return path
