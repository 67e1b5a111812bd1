"""The Markdown report: a summary table per verifier and case, then the findings.

A report of the real-LM suite (``meta["real_lm"]``) ends with a section of its tables
(:func:`render_real_lm_markdown`, also the CLI's ``real-lm-tables.md``): the power its
first-token tests reached, block efficiency in the shape of SpecTr's tables (method, K, one
column per L, 95% CIs), acceptance against alpha* for each K, and first-token fidelity.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Optional

from spectr_audit._files import write_text_atomic
from spectr_audit.reports.figures import (acceptance_interval, real_lm_block_grid, real_lm_power,
                                          real_lm_power_summary, tree_cases, tree_text)
from spectr_audit.reports.figures.reading import _row
from spectr_audit.results import AuditReport, AuditResult

__all__ = ["real_lm_power_note", "render_markdown", "render_real_lm_markdown", "write_markdown"]


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
    measured = result.verdict_label  # exact, PASS (sampled), CERTIFIED, INCONCLUSIVE or FINDING
    if result.expected is None:
        return measured
    declared = "exact" if result.expected else "inexact"
    return f"{measured} (declared {declared}{'' if result.as_expected else ', UNEXPECTED'})"


def _finite(value) -> Optional[float]:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value) if math.isfinite(value) else None


def _fixed(value, digits: int = 3) -> str:
    """Fixed point; an en dash for a value not measured (NaN in memory, null after JSON)."""
    number = _finite(value)
    return "–" if number is None else f"{number:.{digits}f}"


def _pvalue(value, digits: int = 3) -> str:
    number = _finite(value)
    if number is None:
        return "–"
    return f"{number:.2e}" if 0 < abs(number) < 10.0**-digits else f"{number:.{digits}f}"


def _cell(text) -> str:
    return str(text).replace("|", "\\|")


def _real_lm_block_lines(rows) -> list[str]:
    """Block efficiency in the shape of SpecTr's tables: method, K, one column per L."""
    lengths, series = real_lm_block_grid(rows)
    if not series:
        return ["No block-efficiency rows."]
    lines = ["| method | K | " + " | ".join(f"L = {length}" for length in lengths) + " |",
             "|---|---|" + "---|" * len(lengths)]
    for method, k, cells in series:
        values = []
        for length in lengths:
            row = cells.get(length) or {}
            value = _finite(row.get("block_efficiency"))
            if value is None:
                values.append("–")
                continue
            low, high = row.get("ci_low"), row.get("ci_high")
            ci = "" if _finite(low) is None and _finite(high) is None else f" [{_fixed(low, 2)}, {_fixed(high, 2)}]"
            values.append(f"{value:.2f}{ci}")
        lines.append(f"| {_cell(method)} | {k} | " + " | ".join(values) + " |")
    return lines


def _real_lm_acceptance_lines(rows) -> list[str]:
    lines = ["| K | alpha* | SpecTr bound | (1-1/e) alpha* | single draft | K-SEQ P_A (closed form) "
             "| K-SEQ measured (alpha* there) | RRS measured |",
             "|---|---|---|---|---|---|---|---|"]
    for r in map(_row, rows or ()):
        kseq, rrs = _finite(r.get("kseq_measured")), _finite(r.get("rrs_measured"))
        kseq_text = "–" if kseq is None else (f"{kseq:.3f} ± {_fixed(r.get('kseq_measured_half_width'))} "
                                              f"({_fixed(r.get('kseq_optimal_same_contexts'))})")
        rrs_text = "–" if rrs is None else f"{rrs:.3f} ± {_fixed(r.get('rrs_measured_half_width'))}"
        lines.append(f"| {r.get('num_drafts')} | {_fixed(r.get('optimal'))} | {_fixed(r.get('spectr_bound'))} | "
                     f"{_fixed(r.get('e_bound'))} | {_fixed(r.get('single_draft'))} | "
                     f"{_fixed(r.get('kseq_closed_form'))} | {kseq_text} | {rrs_text} |")
    return lines


def _detectable(value) -> str:
    """A minimum detectable TV: a TV never exceeds 1, so 1 or more (inf: no test) means nothing is detectable."""
    if isinstance(value, float) and math.isinf(value):
        return "none"
    number = _finite(value)
    return "–" if number is None else ("≥ 1 (none)" if number >= 1 else f"{number:.3f}")


def _real_lm_fidelity_lines(rows) -> list[str]:
    lines = ["| verifier | level | K | L | samples | cells | sampled p | min detectable TV | RB p "
             "| RB TV on cells (incl. noise) | RB mean ‖bias‖² ± se |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        l2, l2_se = _finite(r.get("rb_l2sq")), _finite(r.get("rb_l2sq_se"))
        l2_text = "–" if l2 is None else f"{l2:.2e}" + ("" if l2_se is None else f" ± {l2_se:.1e}")
        name = _cell(r.get("verifier")) + (" (declared inexact, not judged)" if r.get("judged", True) is False else "")
        cells = r.get("num_cells")
        lines.append(f"| {name} | {r.get('level')} | {r.get('num_drafts')} | "
                     f"{r.get('draft_len')} | {r.get('num_samples')} | {cells if cells else '–'} | "
                     f"{_pvalue(r.get('sampled_pvalue'))} | {_detectable(r.get('sampled_min_detectable_tv'))} | "
                     f"{_pvalue(r.get('rb_pvalue'))} | {_fixed(r.get('rb_tv_partition'), 4)} | {l2_text} |")
    return lines


def real_lm_power_note(tables: dict) -> Optional[str]:
    """What the real-LM suite's first-token tests could detect, and which verifiers were not judged."""
    summary = real_lm_power_summary(tables)
    if summary is None:
        return None
    power = real_lm_power(tables)
    alpha = f" (false-alarm rate {power['alpha']:g} per result)" if power["alpha"] is not None else ""
    text = (f"Power: {summary}{alpha}. A deviation smaller than a test's minimum detectable TV on its cells can pass "
            "it; these tests refute exactness, they do not prove it.")
    if power["not_judged"]:
        text += (f" Declared inexact, measured and not judged: {', '.join(power['not_judged'])} (a test that does not "
                 "reject cannot confirm an inexactness).")
    return text


def render_real_lm_markdown(tables: dict) -> str:
    """The real-LM suite's tables (``meta["real_lm"]``) as a Markdown section: block efficiency in
    SpecTr's shape, acceptance against alpha* for each K, first-token fidelity, and the power reached."""
    lines = ["## Real language model (SmolLM2-135M)", ""]
    if tables.get("setup"):
        lines += [f"Setup: {tables['setup']}", ""]
    note = real_lm_power_note(tables)
    if note:
        lines += [note, ""]
    lines += ["### Block efficiency", "",
              "Tokens emitted per target call, one column per draft length L; brackets: 95% t-interval over prompts.",
              "", *_real_lm_block_lines(tables.get("block_efficiency")),
              "", "### Token-level acceptance against alpha*", "",
              "Mean over contexts; measured values with their 95% half-widths (K-SEQ on a subset of the contexts, "
              "whose alpha* is in parentheses); – : not run at that K.", "",
              *_real_lm_acceptance_lines(tables.get("acceptance"))]
    fidelity = [_row(r) for r in tables.get("fidelity") or ()]
    if fidelity:
        partition = tables.get("partition")
        lines += ["", "### First-token fidelity at V = 49,152", "",
                  (f"Partition: {partition}. " if partition else "") + "p-values unadjusted; cells: after pooling "
                  "sparse ones; min detectable TV: the smallest TV on those cells the sampled test detects with the "
                  "suite's power, at the level the verdict applies to it.", "",
                  *_real_lm_fidelity_lines(fidelity)]
    lines.append("")
    return "\n".join(lines) + "\n"


def sampling_cases(report: AuditReport) -> list:
    """``(case, setting, verifiers handed logits)`` for each case with sampling parameters, in report order
    (from each result's ``details["sampling"]``)."""
    cases: dict = {}
    for r in report.results:
        setting = r.details.get("sampling")
        if not isinstance(setting, dict):
            continue
        entry = cases.setdefault(r.case, (setting, []))
        if setting.get("verifier_takes_logits") and r.verifier not in entry[1]:
            entry[1].append(r.verifier)
    return [(case, setting, names) for case, (setting, names) in cases.items()]


def _sampling_text(params: dict) -> str:
    return ", ".join(f"{key} {value}" for key, value in params.items()) or "neutral (temperature 1, no filter)"


def _sampling_lines(report: AuditReport) -> list[str]:
    """A "Sampling parameters" section: the setting each case held its verifiers to."""
    cases = sampling_cases(report)
    if not cases:
        return []
    lines = ["## Sampling parameters", "",
             "Each case holds its verifiers to the law the engine's non-speculative sampler draws from with these "
             "parameters, in the engine's processing order; a verifier that takes logits is handed the raw logits and "
             "the parameters, the others the processed probabilities (docs/sampling.md).", "",
             "| case | parameters | order | inputs | handed logits |", "|---|---|---|---|---|"]
    for case, setting, names in cases:
        lines.append(f"| {_cell(case)} | {_cell(_sampling_text(setting.get('params') or {}))} | "
                     f"{_cell(setting.get('order', ''))} | {_cell(setting.get('inputs', ''))} | "
                     f"{_cell(', '.join(names) or '-')} |")
    lines.append("")
    return lines


def _tree_lines(report: AuditReport) -> list[str]:
    """A "Draft trees" section: each tree case's tree as indented text and its results against the tree's bound."""
    cases = tree_cases(report.results)
    if not cases:
        return []
    lines = ["## Draft trees", "",
             "Acceptance: P(first emitted token is one of the root's children's tokens), against alpha*; accepted "
             "length: E[accepted draft tokens], against the best any lossless verifier reaches with the tree and its "
             "draft scheme.", ""]
    for case, tree, results in cases:
        lines += [f"### {case}", "", f"{tree.get('description', '')}; spec `{tree.get('spec', '')}`", "", "```",
                  tree_text(tree), "```", "",
                  "| verifier | draft scheme | verdict | TV | p-value | acceptance | alpha* | accepted length | best |",
                  "|---|---|---|---|---|---|---|---|---|"]
        for r in results:
            m = r.metrics
            scheme = (r.details.get("tree") or {}).get("draft_scheme") or "-"
            lines.append(f"| {r.verifier} | {scheme} | {_verdict(r)} | {_fmt(m.get('tv_distance'))} | "
                         f"{_fmt(m.get('pvalue'))} | {_fmt(m.get('acceptance'))} | {_fmt(m.get('optimal_acceptance'))} | "
                         f"{_fmt(m.get('accepted_length'))} | {_fmt(m.get('optimal_accepted_length'))} |")
        lines.append("")
    return lines


def _incomplete_line(report: AuditReport) -> str:
    """The line an interrupted run's report opens with: it holds only the audits that finished."""
    info = report.meta["incomplete"] if isinstance(report.meta.get("incomplete"), dict) else {}
    return (f"**INCOMPLETE: the run was {info.get('reason', 'stopped')}; this report holds the "
            f"{info.get('completed', len(report.results))} of {info.get('planned', '?')} planned audits that "
            f"finished.**")


def _tv_text(m: dict) -> str:
    """The exact TV, or what a sample says of it on the audited partition: its lower confidence bound first,
    then the held-out estimate and the upper bound (the plug-in, inflated by noise, is not shown)."""
    if m.get("tv_distance") is not None or m.get("tv_upper") is None:
        return _fmt(m.get("tv_distance"))
    return f">= {_fmt(m.get('tv_lower'))} (est. {_fmt(m.get('tv_estimate'))}, <= {_fmt(m.get('tv_upper'))})"


def _ratio_text(m: dict) -> str:
    """acc / alpha*, with the interval of a sampled acceptance over alpha* (a sampled ratio above 1 may be noise)."""
    interval, optimum = acceptance_interval(m), _finite(m.get("optimal_acceptance"))
    if m.get("acceptance_ratio") is None or interval is None or not optimum:
        return _fmt(m.get("acceptance_ratio"))
    return f"{_fmt(m.get('acceptance_ratio'))} [{_fmt(interval[0] / optimum)}, {_fmt(interval[1] / optimum)}]"


def _with_interval(m: dict, key: str, interval_key: str) -> str:
    interval = m.get(interval_key)
    if m.get(key) is None or not isinstance(interval, (list, tuple)) or len(interval) != 2:
        return _fmt(m.get(key))
    return f"{_fmt(m.get(key))} [{_fmt(interval[0])}, {_fmt(interval[1])}]"


def _inconclusive_lines(report: AuditReport) -> list[str]:
    results = report.inconclusive
    if not results:
        return []
    lines = ["", "## Inconclusive", "",
             "Nothing was rejected, but without the power planned (a budget cut the sample short, or a certificate "
             "was not reached): these results are not a PASS.", "",
             "| verifier | case | TV >= lower (estimate, <= upper) | min detectable TV | planned | power at planned | why |",
             "|---|---|---|---|---|---|---|"]
    for r in results:
        m = r.metrics
        why = "; ".join(c.detail for c in r.checks if c.inconclusive)
        lines.append(f"| {r.verifier} | {r.case} | {_tv_text(m)} | {_fmt(m.get('min_detectable_tv'))} | "
                     f"{_fmt(m.get('requested_tv'))} | {_fmt(m.get('power_at_requested_tv'))} | {_cell(why)} |")
    return lines


def _worst_table(head: str, rows: list) -> list[str]:
    """A finding's worst strings or cells: ``(name, value, reference)`` per row under ``head`` (nothing without rows)."""
    if not rows:
        return []
    return ["", head, "|---|---|---|", *(f"| {name} | {_fmt(value, 6)} | {_fmt(reference, 6)} |"
                                        for name, value, reference in rows)]


def render_markdown(report: AuditReport) -> str:
    """Render the report as Markdown text."""
    overall = "FAIL" if not report.passed else ("INCONCLUSIVE" if report.inconclusive else "PASS")
    lines = [
        f"# spectr-audit report: suite `{report.suite}`",
        "",
        f"**Overall: {overall}** ({len(report.results)} results: {report.outcome_text()})",
        "",
        *([_incomplete_line(report), ""] if report.meta.get("incomplete") else []),
        "Verdicts: `exact` = every check of the exact audit held; `PASS (sampled)` = the statistical audit of a "
        "verifier without an exact law rejected nothing at its planned power; `FINDING` = some check failed (see "
        "below); `ERROR` = the audit could not run (the verifier raised); `INCONCLUSIVE` = nothing "
        "rejected, but the achieved minimum detectable TV is above the planned one (or a certificate was not "
        "reached); `CERTIFIED` = the upper confidence bound on the TV is within the tolerance asked for. A sampled TV "
        "is an estimate on the audited partition, ~estimate [confidence interval]; acceptance carries its 95% "
        "interval. A verifier may declare an "
        "expected verdict (a published rule under audit, a lossy-by-design mode): a run fails only where a "
        "verdict differs from its declaration.",
        "",
        "| verifier | case | verdict | TV | max abs err | prefix-cap excess | acceptance | alpha* | acc/alpha* | block eff. | p-value |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in report.results:
        m = r.metrics
        lines.append(
            f"| {r.verifier} | {r.case} | {_verdict(r)} | {_tv_text(m)} | {_fmt(m.get('max_abs_error'))} | "
            f"{_fmt(m.get('prefix_cap_excess'))} | {_with_interval(m, 'acceptance', 'acceptance_ci')} | "
            f"{_fmt(m.get('optimal_acceptance'))} | "
            f"{_ratio_text(m)} | {_fmt(m.get('block_efficiency'))} | {_fmt(m.get('pvalue'))} |"
        )
    findings = [r for r in report.results if not r.passed]
    lines += _inconclusive_lines(report)
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
        lines += _worst_table("| string | implied law | target law |",
                              [(w["string"], w["implied"], w["target"]) for w in r.details.get("worst_strings") or []])
        lines += _worst_table("| cell | observed | expected |",
                              [(c.get("cell"), c.get("observed"), c.get("expected"))
                               for c in r.details.get("worst_cells") or []])
        lines.append("")
    lines += _sampling_lines(report)
    lines += _tree_lines(report)
    gate = report.meta.get("gate")
    if gate:
        lines += ["## Gate", "", f"**{'held' if gate.get('passed') else 'FAILED'}**", ""]
        for v in gate.get("violations", []):
            t = v.get("threshold", {})
            lines.append(f"- {v.get('verifier')} on {v.get('case')}: {t.get('metric')} = {_fmt(v.get('value'), 6)} "
                         f"violates {t.get('op')} {t.get('limit')}")
        lines.append("")
    real_lm = report.meta.get("real_lm")
    if isinstance(real_lm, dict):
        lines.append(render_real_lm_markdown(real_lm).rstrip("\n") + "\n")
    return "\n".join(lines) + "\n"


def write_markdown(report: AuditReport, path: Path) -> Path:
    """Write the Markdown report to ``path`` atomically (a temporary file, then a rename); returns the path."""
    path = Path(path)
    write_text_atomic(path, render_markdown(report))
    return path
