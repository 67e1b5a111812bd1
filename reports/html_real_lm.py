"""The HTML report's section on the real-LM suite (``meta["real_lm"]``, :meth:`RealLMTables.to_dict`).

Block efficiency in the shape of SpecTr's tables (method, K, one column per L, 95% CIs),
acceptance against alpha* for each K, first-token fidelity, and two figures drawn from those tables.
"""

from __future__ import annotations

import html
import math
from typing import Any, Callable

from spectr_audit.reports.figures import real_lm_block_grid, real_lm_figures
from spectr_audit.reports.figures.reading import _row
from spectr_audit.reports.html_common import _figure_html, _fmt, _num
from spectr_audit.reports.markdown import real_lm_power_note

#: Extra CSS, added only to reports that carry the real-LM tables (others stay byte-identical).
_REAL_LM_CSS = """
table.real-lm td .ci { color: #666; font-size: 0.88em; }
table.real-lm td.missing { color: #999; text-align: center; }
table.real-lm th.group { text-align: center; }
table.real-lm tbody tr.method-start td { border-top: 2px solid #b0b7c0; }
"""

#: Shown for a value the suite did not measure (NaN in memory, null after a JSON round trip).
_MISSING = "&ndash;"


def _fixed(value: Any, digits: int = 3) -> str:
    number = _num(value)
    return _MISSING if number is None else f"{number:.{digits}f}"


def _pvalue(value: Any, digits: int = 3) -> str:
    """A p-value: fixed point, or two significant digits below 10^-digits (so 1e-6 is not 0.000)."""
    number = _num(value)
    if number is None:
        return _MISSING
    return f"{number:.2e}" if 0 < abs(number) < 10.0**-digits else f"{number:.{digits}f}"


def _with_half_width(value: Any, half: Any, digits: int = 3) -> str:
    number = _num(value)
    if number is None:
        return _MISSING
    half_number = _num(half)
    return f"{number:.{digits}f}" + ("" if half_number is None else f" &plusmn; {abs(half_number):.{digits}f}")


def _real_lm_block_table(rows: Any) -> list[str]:
    """Block efficiency in the shape of SpecTr's tables: method, K, then one column per L."""
    lengths, series = real_lm_block_grid(rows)
    if not series:
        return ["<p>No block-efficiency rows.</p>"]
    head = "".join(f"<th>L = {length}</th>" for length in lengths)
    out = ['<table class="real-lm" id="real-lm-block-efficiency-table"><thead>'
           f'<tr><th class="text" rowspan="2">method</th><th rowspan="2">K</th>'
           f'<th class="group" colspan="{len(lengths)}">block efficiency (tokens per target call) '
           f"[95% CI]</th></tr><tr>{head}</tr></thead><tbody>"]
    previous = None
    for method, k, cells in series:
        tds = []
        for length in lengths:
            row = cells.get(length)
            value = _num(row.get("block_efficiency")) if row else None
            if value is None:
                tds.append(f'<td class="missing">{_MISSING}</td>')
                continue
            low, high = _num(row.get("ci_low")), _num(row.get("ci_high"))
            ci = ""
            if low is not None or high is not None:
                ci = f' <span class="ci">[{_fixed(low, 2)}, {_fixed(high, 2)}]</span>'
            runs = f"{row.get('num_iterations')} iterations over {row.get('num_rows')} prompts"
            tds.append(f'<td title="{html.escape(runs)}">{value:.2f}{ci}</td>')
        css = ' class="method-start"' if previous is not None and method != previous else ""
        previous = method
        out.append(f'<tr{css}><td class="text">{html.escape(method)}</td><td>{k}</td>{"".join(tds)}</tr>')
    out.append("</tbody></table>")
    return out


def _real_lm_rows_table(rows: Any, what: str, head: str, row_html: Callable[[dict], str]) -> list[str]:
    """A real-LM table of one HTML row per table row: ``head`` (up to ``<tbody>``), then ``row_html`` of each."""
    rows = [_row(r) for r in rows or ()]
    if not rows:
        return [f"<p>No {what} rows.</p>"]
    return [head, *map(row_html, rows), "</tbody></table>"]


def _real_lm_acceptance_table(rows: Any) -> list[str]:
    def row_html(r: dict) -> str:
        kseq_measured = _num(r.get("kseq_measured")) is not None
        return (
            f"<tr><td>{_fmt(r.get('num_drafts'))}</td><td>{_fixed(r.get('optimal'))}</td>"
            f"<td>{_fixed(r.get('spectr_bound'))}</td><td>{_fixed(r.get('e_bound'))}</td>"
            f"<td>{_fixed(r.get('single_draft'))}</td><td>{_fixed(r.get('kseq_closed_form'))}</td>"
            f"<td>{_with_half_width(r.get('kseq_measured'), r.get('kseq_measured_half_width'))}</td>"
            f"<td>{_fixed(r.get('kseq_optimal_same_contexts')) if kseq_measured else _MISSING}</td>"
            f"<td>{_with_half_width(r.get('rrs_measured'), r.get('rrs_measured_half_width'))}</td>"
            f"<td>{_fmt(r.get('num_contexts'))}</td></tr>"
        )

    return _real_lm_rows_table(
        rows, "acceptance",
        '<table class="real-lm" id="real-lm-acceptance-table"><thead><tr><th>K</th><th>alpha*</th>'
        "<th>SpecTr bound<br>(1-(1-1/K)<sup>K</sup>) alpha*</th><th>(1-1/e) alpha*</th><th>single draft</th>"
        "<th>K-SEQ P<sub>A</sub><br>(closed form)</th><th>K-SEQ measured<br>&plusmn; 95% half-width</th>"
        "<th>alpha* on K-SEQ's<br>contexts</th><th>RRS measured<br>&plusmn; 95% half-width</th>"
        "<th>contexts</th></tr></thead><tbody>", row_html)


def _real_lm_fidelity_table(rows: Any, partition: str) -> list[str]:
    def row_html(r: dict) -> str:
        l2, l2_se = _num(r.get("rb_l2sq")), _num(r.get("rb_l2sq_se"))
        l2_text = _MISSING if l2 is None else f"{l2:.2e}" + ("" if l2_se is None else f" &plusmn; {l2_se:.1e}")
        judged = r.get("judged", True) is not False
        row_class = "" if judged else ' class="declared"'
        name = html.escape(str(r.get("verifier", ""))) + ("" if judged else " (declared inexact, not judged)")
        raw, detectable = r.get("sampled_min_detectable_tv"), _num(r.get("sampled_min_detectable_tv"))
        detectable_text = "none" if isinstance(raw, float) and math.isinf(raw) else _MISSING if detectable is None else (
            "&ge; 1 (none)" if detectable >= 1 else f"{detectable:.3f}")
        return (
            f'<tr{row_class}><td class="text">{name}</td>'
            f'<td class="text">{html.escape(str(r.get("level", "")))}</td><td>{_fmt(r.get("num_drafts"))}</td>'
            f'<td>{_fmt(r.get("draft_len"))}</td><td>{_fmt(r.get("num_samples"))}</td>'
            f'<td>{_fmt(r.get("num_cells")) if r.get("num_cells") else _MISSING}</td>'
            f'<td>{_pvalue(r.get("sampled_pvalue"))}</td><td>{detectable_text}</td>'
            f'<td>{_pvalue(r.get("rb_pvalue"))}</td><td>{_fixed(r.get("rb_tv_partition"), 4)}</td>'
            f"<td>{l2_text}</td></tr>"
        )

    return _real_lm_rows_table(
        rows, "fidelity",
        '<table class="real-lm" id="real-lm-fidelity-table"><thead><tr><th class="text">verifier</th>'
        '<th class="text">level</th><th>K</th><th>L</th><th>samples</th><th>cells</th><th>sampled p</th>'
        "<th>min detectable TV</th><th>RB p</th><th>RB TV on cells<br>(incl. noise)</th>"
        "<th>RB mean &#8214;bias&#8214;<sup>2</sup> &plusmn; se</th></tr></thead><tbody>", row_html)


def _real_lm_section(tables: dict, figures: bool) -> list[str]:
    """The real-LM suite's tables (``meta["real_lm"]``) and, with ``figures``, its two figures."""
    out = ['<h2 id="real-lm">Real language model (SmolLM2-135M)</h2>']
    setup = tables.get("setup")
    if setup:
        out.append(f'<p class="note">Setup: {html.escape(str(setup))}.</p>')
    power = real_lm_power_note(tables)
    if power:
        out.append(f'<p id="real-lm-power">{html.escape(power)}</p>')
    out += ['<h3 id="real-lm-block-efficiency">Block efficiency</h3>',
            '<p class="note">Tokens emitted per target call (one verification step), in the shape of SpecTr\'s '
            "tables: one row per method and number of drafts K, one column per draft length L; brackets: 95% "
            "t-interval over prompts (hover a cell for its iterations).</p>",
            *_real_lm_block_table(tables.get("block_efficiency")),
            '<h3 id="real-lm-acceptance">Token-level acceptance against alpha*</h3>',
            '<p class="note">Mean over the token-level contexts of P(first emitted token among the drafts). alpha* is '
            "the optimal acceptance for K i.i.d. drafts; K-SEQ must reach SpecTr's bound. Measured values are "
            "Rao-Blackwellised, with 95% half-widths; K-SEQ is measured on a subset of the contexts, whose mean "
            "alpha* is listed beside it. &ndash;: not run at that K.</p>",
            *_real_lm_acceptance_table(tables.get("acceptance"))]
    partition = str(tables.get("partition") or "")
    out += ['<h3 id="real-lm-fidelity">First-token fidelity at V = 49,152</h3>',
            '<p class="note">Sampled p: the first emitted token\'s cell against the target\'s cell law, with the '
            "smallest TV on the cells (after pooling sparse ones) it detects at the suite's power, at the level the "
            "verdict applies to it. RB: the Rao-Blackwellised law's deviation "
            "from the target, cell by cell, and an unbiased estimate of its mean squared L2 distance over the "
            "vocabulary. p-values are unadjusted; the verdicts above use Holm-adjusted ones."
            + (f" Partition: {html.escape(partition)}." if partition else "") + "</p>",
            *_real_lm_fidelity_table(tables.get("fidelity"), partition)]
    if figures:
        out += [_figure_html(f.png, "real-lm-figure", f"{f.kind}: {f.title}", f.title, f.caption)
                for f in real_lm_figures(tables)]
    return out
