"""The HTML report: one self-contained file (inline CSS, figures embedded as base64 PNG).

Sections: the overall verdict and the gate; a summary table per verifier and case; the
findings (failed checks, worst strings, errors, gate violations); the draft trees (each tree
case's tree, drawn and as indented text, beside its verifiers' acceptance and accepted length
against the best achievable); figures of acceptance against K, block efficiency against L and
each case's output law against the target.
A report of the real-LM suite (``meta["real_lm"]``, :meth:`RealLMTables.to_dict`) gets a
section of its own after the findings: block efficiency in the shape of SpecTr's tables
(method, K, one column per L, 95% CIs), acceptance against alpha* for each K, first-token
fidelity, and two figures drawn from those tables.  Nothing is loaded from the network,
so the file can be attached to a CI run or mailed.

The stylesheet, value formatting and embedded figures the HTML reports share are in
``html_common``, the real-LM section in ``html_real_lm``.
"""

from __future__ import annotations

import html
from pathlib import Path
from typing import Any, Optional

from spectr_audit import __version__
from spectr_audit._files import write_text_atomic
from spectr_audit.reports.figures import acceptance_interval, report_figures, tree_cases, tree_figure, tree_text
from spectr_audit.reports.html_common import _CSS, _figure_html, _fmt, _num, _text_cells
from spectr_audit.reports.html_real_lm import _REAL_LM_CSS, _real_lm_section
from spectr_audit.reports.markdown import _sampling_text, sampling_cases
from spectr_audit.results import AuditReport, AuditResult

__all__ = ["render_html", "write_html"]


def _verdict(result: AuditResult) -> tuple[str, str]:
    """(text, css class of the row)."""
    if result.error is not None:
        return "ERROR", "unexpected"
    measured = result.verdict_label  # exact, PASS (sampled), CERTIFIED, INCONCLUSIVE or FINDING
    if result.expected is None:
        return measured, ("inconclusive" if result.inconclusive else "") if result.passed else "unexpected"
    declared = "exact" if result.expected else "inexact"
    if result.as_expected:
        return f"{measured} (declared {declared})", "declared" if not result.passed else ""
    return f"{measured} (declared {declared}, UNEXPECTED)", "unexpected"


_COLUMNS = (
    ("tv_distance", "TV"),
    ("tv_estimate", "TV >= lower (estimate, <= upper)"),
    ("min_detectable_tv", "min detectable TV"),
    ("max_abs_error", "max abs err"),
    ("prefix_cap_excess", "prefix-cap excess"),
    ("acceptance", "acceptance"),
    ("optimal_acceptance", "alpha*"),
    ("acceptance_ratio", "acc / alpha*"),
    ("block_efficiency", "block eff."),
    ("block_lp_optimum", "block LP opt."),
    ("pvalue", "p-value"),
    ("num_samples", "samples"),
)


def _interval_of(metrics: dict, key: str) -> Optional[tuple]:
    """The interval of a sampled metric: the TV estimate's, the acceptance's, and the acceptance ratio's
    (the acceptance's interval over alpha*); None for a value computed exactly."""
    if key == "tv_estimate":
        low, high = metrics.get("tv_lower"), metrics.get("tv_upper")
        return None if low is None or high is None else (low, high)
    acceptance = acceptance_interval(metrics) if key in ("acceptance", "acceptance_ratio") else None
    if key == "acceptance" or acceptance is None:
        return acceptance
    optimum = _num(metrics.get("optimal_acceptance"))
    return None if not optimum else (acceptance[0] / optimum, acceptance[1] / optimum)


def _metric_cell(metrics: dict, key: str) -> str:
    """A metric, with its interval where the result has one (the sampled TV estimate, acceptance, acc / alpha*)."""
    value = metrics.get(key)
    interval = _interval_of(metrics, key)
    if value is None or interval is None:
        return _fmt(value)
    if key == "tv_estimate":  # the lower confidence bound is the headline; the estimate sits within the interval
        return f"&ge; {_fmt(interval[0])} ({_fmt(value)}, &le; {_fmt(interval[1])})"
    return f"{_fmt(value)} [{_fmt(interval[0])}, {_fmt(interval[1])}]"


def _inconclusive(report: AuditReport) -> list[str]:
    """The results that rejected nothing below their planned power, and why."""
    results = report.inconclusive
    if not results:
        return []
    out = ['<h3 id="inconclusive">Inconclusive</h3>',
           '<p class="note">Nothing was rejected, but without the power planned (a budget cut the sample short, '
           "or a certificate was not reached): these results are not a PASS.</p>",
           '<table><thead><tr><th class="text">verifier</th><th class="text">case</th><th>TV &ge; lower (estimate, &le; upper)</th>'
           '<th>min detectable TV</th><th>planned</th><th>power at planned</th><th class="text">why</th></tr></thead><tbody>']
    for r in results:
        m = r.metrics
        why = "; ".join(c.detail for c in r.checks if c.inconclusive)
        out.append(f'<tr class="inconclusive">{_text_cells(r.verifier, r.case)}'
                   f'<td>{_metric_cell(m, "tv_estimate")}</td>'
                   f'<td>{_fmt(m.get("min_detectable_tv"))}</td><td>{_fmt(m.get("requested_tv"))}</td>'
                   f'<td>{_fmt(m.get("power_at_requested_tv"))}</td><td class="text wrap">{html.escape(why)}</td></tr>')
    out.append("</tbody></table>")
    return out


def _summary_table(report: AuditReport, violated: set) -> list[str]:
    present = [(key, label) for key, label in _COLUMNS if any(key in r.metrics for r in report.results)]
    head = "".join(f"<th>{html.escape(label)}</th>" for _, label in present)
    out = [f'<table class="results"><thead><tr><th class="text">verifier</th><th class="text">case</th>'
           f'<th class="text">verdict</th><th class="text">gate</th>{head}</tr></thead><tbody>']
    for r in report.results:
        verdict, css = _verdict(r)
        gate = "violated" if (r.verifier, r.case) in violated else ""
        if gate and not css:
            css = "finding"
        # a value with its interval wraps at its spaces (a number alone never breaks)
        cells = "".join(f'<td{" class=wrap" if _interval_of(r.metrics, key) else ""}>{_metric_cell(r.metrics, key)}</td>'
                        for key, _ in present)
        out.append(
            f'<tr class="{css}"><td class="text">{html.escape(r.verifier)}</td><td class="text">{html.escape(r.case)}</td>'
            f'<td class="text">{html.escape(verdict)}</td><td class="text">{gate}</td>{cells}</tr>'
        )
    out.append("</tbody></table>")
    return out


def _verifier_table(report: AuditReport, violated: set) -> list[str]:
    """One row per verifier: how many cases, how many as expected, the worst numbers."""
    rows: dict = {}
    for r in report.results:
        rows.setdefault(r.verifier, []).append(r)
    out = ['<h2 id="verifiers">Verifiers</h2>',
           '<table class="verifiers"><thead><tr><th class="text">verifier</th><th>cases</th><th>passed</th><th>inconclusive</th>'
           '<th>findings</th><th>errors</th><th>not as expected</th><th>gate violations</th><th>max TV</th><th>min acc / alpha*</th>'
           '<th>min p-value</th></tr></thead><tbody>']
    for name, results in rows.items():
        def extreme(key, pick):
            values = [r.metrics[key] for r in results if isinstance(r.metrics.get(key), (int, float))
                      and not isinstance(r.metrics.get(key), bool)]
            return pick(values) if values else None

        def smallest_ratio() -> str:
            # a sampled ratio is an estimate: its interval says whether a value above 1 is more than noise
            rated = [r for r in results if _num(r.metrics.get("acceptance_ratio")) is not None]
            if not rated:
                return _fmt(None)
            return _metric_cell(min(rated, key=lambda r: r.metrics["acceptance_ratio"]).metrics, "acceptance_ratio")

        unexpected = sum(not r.as_expected and r.error is None for r in results)  # errors have their own column
        errors = sum(r.error is not None for r in results)
        declared = {r.expected for r in results if r.expected is not None}
        label = name + (f" (declared {'exact' if declared == {True} else 'inexact'})" if len(declared) == 1 else "")
        num_violated = sum((r.verifier, r.case) in violated for r in results)
        css = "unexpected" if unexpected or errors else ("finding" if num_violated else "")
        out.append(
            f'<tr class="{css}"><td class="text">{html.escape(label)}</td><td>{len(results)}</td>'
            # passed: every check held at its planned power (exact, sampled or certified); INCONCLUSIVE is not
            f"<td>{sum(r.verdict in ('exact', 'CERTIFIED') for r in results)}</td>"
            f"<td>{sum(r.verdict == 'INCONCLUSIVE' for r in results)}</td>"
            f"<td>{sum(not r.passed and r.error is None for r in results)}</td>"
            f"<td>{errors}</td><td>{unexpected}</td><td>{num_violated}</td>"
            f'<td>{_fmt(extreme("tv_distance", max))}</td><td class="wrap">{smallest_ratio()}</td>'
            f"<td>{_fmt(extreme('pvalue', min))}</td></tr>"
        )
    out.append("</tbody></table>")
    return out


def _sampling_section(report: AuditReport) -> list[str]:
    """The sampling parameters each case held its verifiers to (docs/sampling.md)."""
    cases = sampling_cases(report)
    if not cases:
        return []
    out = ['<h2 id="sampling">Sampling parameters</h2>',
           '<p class="note">Each case holds its verifiers to the law the engine\'s non-speculative sampler draws from '
           "with these parameters, in the engine's processing order; a verifier that takes logits is handed the raw "
           "logits and the parameters, the others the processed probabilities (docs/sampling.md).</p>",
           '<table><thead><tr><th class="text">case</th><th class="text">parameters</th><th class="text">order</th>'
           '<th class="text">inputs</th><th class="text">handed logits</th></tr></thead><tbody>']
    for case, setting, names in cases:
        cells = _text_cells(case, _sampling_text(setting.get("params") or {}), setting.get("order", ""),
                            setting.get("inputs", ""), ", ".join(names) or "-")
        out.append(f"<tr>{cells}</tr>")
    out.append("</tbody></table>")
    return out


def _findings(report: AuditReport, gate: Any) -> list[str]:
    out = ['<h2 id="findings">Findings</h2>']
    findings = [r for r in report.results if not r.passed]
    if not findings:
        out.append("<p>None: every check of every result held.</p>")
    else:
        # wrapped text columns (and, as every table, a scroll container): it fits the page at any window width
        out.append('<table class="findings"><colgroup><col style="width: 11%"><col style="width: 13%">'
                   '<col style="width: 9%"><col style="width: 32%"><col style="width: 7%"><col style="width: 7%">'
                   '<col style="width: 21%"></colgroup><thead><tr><th class="text">verifier</th>'
                   '<th class="text">case</th><th class="text">verdict</th>'
                   '<th class="text">failed check: what it found</th><th>value</th><th>threshold</th><th class="text">'
                   "worst strings (string: implied vs target law) or cells (observed vs expected count)</th></tr>"
                   "</thead><tbody>")
        for r in findings:
            verdict, css = _verdict(r)
            worst = r.details.get("worst_strings") or []
            worst_html = "<br>".join(
                f"<code>{html.escape(str(w.get('string')))}</code>: {_fmt(w.get('implied'), 6)} vs {_fmt(w.get('target'), 6)}"
                for w in worst[:5]
            )
            if not worst_html:  # a statistical audit: observed against expected counts per cell
                worst_html = "<br>".join(
                    f"<code>{html.escape(str(c.get('cell')))}</code>: observed {_fmt(c.get('observed'), 1)} vs "
                    f"expected {_fmt(c.get('expected'), 1)}"
                    for c in (r.details.get("worst_cells") or [])[:5] if isinstance(c, dict)
                ) or "-"
            rows = [(c.name, c.value, c.threshold, c.detail) for c in r.failed_checks]
            if r.error is not None:
                rows.append(("error", None, None, r.error))
            rows = rows or [("-", None, None, "")]
            for i, (name, value, threshold, detail) in enumerate(rows):
                tail = f'<td class="text worst" rowspan="{len(rows)}">{worst_html}</td>' if i == 0 else ""
                if name == "error":
                    name_html = f'error: <code class="error">{html.escape(detail)}</code>'
                else:  # the check's detail says what it found, in the words of its outcome
                    name_html = html.escape(name) + (f'<br><span class="detail">{html.escape(detail)}</span>'
                                                     if detail else "")
                out.append(
                    f'<tr class="{css or "finding"}"><td class="text">{html.escape(r.verifier)}</td>'
                    f'<td class="text">{html.escape(r.case)}</td><td class="text">{html.escape(verdict)}</td>'
                    f'<td class="text wrap">{name_html}</td><td>{_fmt(value, 6)}</td><td>{_fmt(threshold, 6)}</td>{tail}</tr>'
                )
        out.append("</tbody></table>")
        out.append('<p class="note">Worst strings: the strings w of length L + 1 with the largest '
                   "|F(w) - q(w)|, where F is the law implied by one step followed by the unmodified target. "
                   "Rows marked declared belong to verifiers that declared themselves inexact; they fail a run "
                   "only when the measured verdict differs from the declaration.</p>")
    if gate is not None and getattr(gate, "thresholds", ()):
        out.append('<h3 id="gate">Gate</h3>')
        out.append("<p>Thresholds: " + ", ".join(f"<code>{html.escape(t.source or str(t))}</code>" for t in gate.thresholds)
                   + f" applied to {gate.num_gated} results.</p>")
        if gate.violations:
            out.append('<table><thead><tr><th class="text">verifier</th><th class="text">case</th>'
                       '<th class="text">threshold</th><th>value</th></tr></thead><tbody>')
            for v in gate.violations:
                out.append(f'<tr class="finding"><td class="text">{html.escape(v.verifier)}</td><td class="text">'
                           f'{html.escape(v.case)}</td><td class="text">{html.escape(str(v.threshold))}</td>'
                           f"<td>{_fmt(v.value, 6)}</td></tr>")
            out.append("</tbody></table>")
        for t in gate.unmeasured:
            out.append(f"<p>Threshold <code>{html.escape(str(t))}</code>: no gated result measured "
                       f"<code>{html.escape(t.metric)}</code>, so it fails the gate.</p>")
        if gate.passed:
            out.append("<p>Every threshold held.</p>")
    return out


def _tree_section(report: AuditReport, figures: bool) -> list[str]:
    """Each draft-tree case: its tree (drawn, and as indented text) beside its results against the tree's bound."""
    cases = tree_cases(report.results)
    if not cases:
        return []
    out = ['<h2 id="trees">Draft trees</h2>',
           '<p class="note">Each tree case: the tree (node numbers in the engines\' order: paths sorted by length, '
           "then lexicographically; ranks are sibling draw orders or top-k ranks), and each verifier's membership "
           "acceptance against alpha* and expected accepted draft tokens against the best any lossless verifier "
           "reaches with that tree and draft scheme (docs/audit/bounds.md).</p>"]
    for case, tree, results in cases:
        out.append(f'<h3 id="tree-{html.escape(case)}">{html.escape(case)}</h3>')
        out.append(f'<p class="note">{html.escape(str(tree.get("description", "")))}; spec '
                   f'<code>{html.escape(str(tree.get("spec", "")))}</code></p>')
        if figures:
            png = tree_figure(tree, results, case)
            if png is not None:
                out.append(_figure_html(png, "wide", f"tree: {case}", case,
                                        "the tree, and each verifier against the best achievable"))
        out.append(f"<pre>{html.escape(tree_text(tree))}</pre>")
        out.append('<table><thead><tr><th class="text">verifier</th><th class="text">draft scheme</th>'
                   '<th class="text">verdict</th><th>TV</th><th>p-value</th><th>acceptance</th><th>alpha*</th>'
                   '<th>accepted length</th><th>best accepted length</th></tr></thead><tbody>')
        for r in results:
            verdict, css = _verdict(r)
            m = r.metrics
            scheme = (r.details.get("tree") or {}).get("draft_scheme")
            out.append(f'<tr class="{css}"><td class="text">{html.escape(r.verifier)}</td>'
                       f'<td class="text">{html.escape(str(scheme or "-"))}</td><td class="text">{html.escape(verdict)}</td>'
                       f"<td>{_fmt(m.get('tv_distance'))}</td><td>{_fmt(m.get('pvalue'))}</td>"
                       f"<td>{_fmt(m.get('acceptance'))}</td><td>{_fmt(m.get('optimal_acceptance'))}</td>"
                       f"<td>{_fmt(m.get('accepted_length'))}</td><td>{_fmt(m.get('optimal_accepted_length'))}</td></tr>")
        out.append("</tbody></table>")
    return out


def _figure_sections(report: AuditReport, max_law_figures: int) -> list[str]:
    figures = report_figures(report, max_law_figures=max_law_figures)
    sections = (
        ("acceptance", "Acceptance against K",
         "Membership acceptance P(first emitted token is among the drafts' first tokens) against the number of "
         "drafts K (a case family with a single K: the verifiers side by side at that K). alpha* is the optimal "
         "acceptance over all couplings of the drafts and the target: the acceptance of an exact verifier, "
         "computed exactly, never exceeds it. A sampled acceptance is an estimate, drawn with its 95% interval, "
         "and can lie above alpha* by sampling error alone. K-SEQ must reach (1-(1-1/K)^K) alpha*, which is at "
         "least (1-1/e) alpha*."),
        ("block-efficiency", "Block efficiency against L",
         "Expected number of tokens emitted per verification step against the draft length L, with the block LP "
         "optimum where the audit computed it."),
        ("law", "Output law against the target",
         "Per case, left: the law of the first emitted token only, for each verifier whose law is computed "
         "exactly (\"its law, computed exactly\": the audit's method, not its verdict, which is in brackets) "
         "against the target law q (black ticks). Right: where the findings are, the strings w of L + 1 tokens "
         "with the largest |F(w) - q(w)| for each verifier with a finding: computed exactly (filled points) or, "
         "for a statistical audit, the cell's observed frequency minus its target probability with a 95% Wilson "
         "interval (open squares). A finding past the first token shows on the right only."),
    )
    out = ['<h2 id="figures">Figures</h2>'] if figures else []
    for kind, heading, note in sections:
        chosen = [f for f in figures if f.kind == kind]
        if not chosen:
            continue
        out.append(f'<h3 id="{kind}">{heading}</h3><p class="note">{html.escape(note)}</p>')
        for f in chosen:
            out.append(_figure_html(f.png, "wide" if kind == "law" else "", f"{kind}: {f.title}", f.title, f.caption))
    return out


def _incomplete_html(report: AuditReport) -> str:
    """The line an interrupted run's report opens with ("" for a complete run)."""
    info = report.meta.get("incomplete")
    if not info:
        return ""
    info = info if isinstance(info, dict) else {}
    return (f'<p class="incomplete"><strong>INCOMPLETE: the run was {html.escape(str(info.get("reason", "stopped")))}; '
            f'this report holds the {html.escape(str(info.get("completed", len(report.results))))} of '
            f'{html.escape(str(info.get("planned", "?")))} planned audits that finished.</strong></p>')


def render_html(report: AuditReport, gate: Any = None, *, figures: bool = True, max_law_figures: int = 48) -> str:
    """Render ``report`` as one self-contained HTML document.

    Parameters
    ----------
    report : AuditReport
    gate : GateOutcome, optional
        Shown next to the verdict, with its violations.
    figures : bool
        Draw the figures (needs matplotlib); ``False`` gives tables only.
    max_law_figures : int
        At most this many per-case law figures (cases with findings first).

    Returns
    -------
    str
        HTML text with inline CSS and figures as ``data:image/png;base64`` images.
    """
    passed = report.passed and (gate is None or gate.passed)
    violated = {(v.verifier, v.case) for v in getattr(gate, "violations", ()) or ()}
    badge = '<span class="badge pass">PASS</span>' if passed else '<span class="badge fail">FAIL</span>'
    if passed and report.inconclusive:
        badge = (f'<span class="badge warn">INCONCLUSIVE</span> {len(report.inconclusive)} result(s) without their '
                 "planned power &middot;")
    gate_line = ""
    if gate is not None and getattr(gate, "thresholds", ()):
        gate_line = (f' &middot; gate <span class="badge {"pass" if gate.passed else "fail"}">'
                     f'{"held" if gate.passed else "failed"}</span> ({len(gate.violations)} violations)')
    meta = ", ".join(f"{html.escape(str(k))} {_fmt(v, 2)}" for k, v in report.meta.items()
                     if not isinstance(v, (dict, list)))
    real_lm = report.meta.get("real_lm")
    real_lm = real_lm if isinstance(real_lm, dict) else None
    parts = [
        "<!DOCTYPE html>",
        '<html lang="en"><head><meta charset="utf-8">',
        '<meta name="viewport" content="width=device-width, initial-scale=1">',
        f"<title>spectr-audit report: {html.escape(report.suite)}</title>",
        f"<style>{_CSS}{_REAL_LM_CSS if real_lm is not None else ''}</style></head><body>",
        f"<h1>spectr-audit report: suite <code>{html.escape(report.suite)}</code></h1>",
        f'<p class="meta">{badge} {len(report.results)} results: {html.escape(report.outcome_text())}{gate_line}'
        f" &middot; spectr-audit {html.escape(__version__)}{(' &middot; ' + meta) if meta else ''}</p>",
        _incomplete_html(report),
        '<p class="note">Verdicts: <b>exact</b> = every check of the exact audit held; <b>PASS (sampled)</b> = the '
        "statistical audit of a verifier without an exact law rejected nothing at its planned power; <b>FINDING</b> = "
        "some check failed; <b>ERROR</b> = the audit could not run (the verifier raised); "
        "<b>INCONCLUSIVE</b> = nothing rejected, but the achieved minimum detectable TV is above the planned one (or a "
        "certificate was not reached); <b>CERTIFIED</b> = the upper confidence bound on the TV is within the tolerance "
        "asked for. Sampled TV estimates are on the audited partition, with their confidence interval. A verifier may "
        "declare an expected verdict (a published rule under audit, a lossy-by-design mode); a run fails only where a "
        "verdict differs from its declaration, or where a gate threshold breaks.</p>",
        '<nav><a href="#verifiers">Verifiers</a><a href="#findings">Findings</a>'
        + ('<a href="#real-lm">Real language model</a>' if real_lm is not None else "")
        + ('<a href="#trees">Draft trees</a>' if any("tree" in r.details for r in report.results) else "")
        + ('<a href="#sampling">Sampling parameters</a>' if any("sampling" in r.details for r in report.results) else "")
        + ('<a href="#figures">Figures</a>' if figures else "")
        + '<a href="#summary">Every result</a></nav>',
        *_verifier_table(report, violated),
        *_findings(report, gate),
        *_inconclusive(report),
    ]
    if real_lm is not None:
        parts += _real_lm_section(real_lm, figures)
    parts += _tree_section(report, figures)
    parts += _sampling_section(report)
    if figures:
        parts += _figure_sections(report, max_law_figures)
    parts += ['<h2 id="summary">Every result</h2>', *_summary_table(report, violated), "</body></html>"]
    # every table in a container that scrolls sideways: a table wider than the window never cuts a column
    text = "\n".join(parts).replace("<table", '<div class="scroll"><table').replace("</table>", "</table></div>")
    return text + "\n"


def write_html(report: AuditReport, path: Path, gate: Any = None, *, figures: bool = True,
               max_law_figures: int = 48) -> Path:
    """Write the HTML report to ``path`` atomically (parents created); returns the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_text_atomic(path, render_html(report, gate, figures=figures, max_law_figures=max_law_figures))
    return path
