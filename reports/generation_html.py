"""The generation audit's HTML report: one self-contained document (inline CSS, figures as base64 PNG).

The sections of the Markdown report, with the PIT histograms and their acceptance bands and the
held-out TV chart drawn, and each greedy divergence's two continuations side by side, the tokens
where they differ marked.
"""

from __future__ import annotations

import html
from typing import Any, Sequence

from spectr_audit import __version__
from spectr_audit.reports.figures.generation import generation_figures, outside_band
from spectr_audit.reports.generation_reading import (
    _alpha,
    _list,
    _outcome,
    _p_at,
    _rejected,
    _role,
    _subtests,
    _verdict_text,
    generation_dict,
)
from spectr_audit.reports.generation_sections import (
    CONDITIONS_HEAD,
    CONDITIONS_NOTE,
    _condition_rows,
    _acceptance_lines,
    _after_eos_checked,
    _agreement_rows,
    _confidence,
    _divergence_label,
    _facts,
    _floor_text,
    _held_rows,
    _margin,
    _zero_label,
)
from spectr_audit.reports.html_common import _CSS, _figure_html
from spectr_audit.reports.markdown import _detectable, _finite, _fixed, _pvalue

__all__ = ["render_generation_html"]

_GENERATION_CSS = """
table.tails { margin: 0; font-size: 0.95em; }
table.tails th, table.tails td { padding: 0.05em 0.35em; border-color: #e5e7eb; }
table.tails td.differs { background: #ffd7d5; font-weight: bold; }
tr.numerics td { background: #f3f6fb; }
"""


def _e(value: Any) -> str:
    return html.escape(str(value))


def _html_table(head: Sequence[tuple], rows: Sequence[tuple], css: str = "", row_css: Sequence[str] = ()) -> str:
    """``head``: ``(label, is_text)``; ``rows``: cells already HTML.  Wrapped in a sideways-scrolling container."""
    th = "".join(f'<th class="text">{_e(label)}</th>' if text else f"<th>{_e(label)}</th>" for label, text in head)
    body = []
    for i, row in enumerate(rows):
        cls = row_css[i] if i < len(row_css) and row_css[i] else ""
        tds = "".join(f'<td class="text">{cell}</td>' if text else f"<td>{cell}</td>"
                      for cell, (_, text) in zip(row, head))
        body.append(f'<tr class="{cls}">{tds}</tr>' if cls else f"<tr>{tds}</tr>")
    table_css = f' class="{css}"' if css else ""
    return (f'<div class="scroll"><table{table_css}><thead><tr>{th}</tr></thead><tbody>{"".join(body)}'
            "</tbody></table></div>")


def _tails_html(engine: Any, reference: Any) -> str:
    """The two continuations side by side, aligned token by token, differing positions marked."""
    a, b = list(engine or ()), list(reference or ())
    width = max(len(a), len(b))
    if not width:
        return "–"

    def cell(tokens, other, i):
        if i >= len(tokens):
            return "<td></td>"
        differs = i >= len(other) or tokens[i] != other[i]
        return f'<td class="differs">{_e(tokens[i])}</td>' if differs else f"<td>{_e(tokens[i])}</td>"

    def cells(tokens, other):
        return "".join(cell(tokens, other, i) for i in range(width))

    return (f'<table class="tails"><tr><th class="text">engine</th>{cells(a, b)}</tr>'
            f'<tr><th class="text">reference</th>{cells(b, a)}</tr></table>')


def _figure(figures: list, kind: str) -> list[str]:
    return [_figure_html(f.png, "wide" if kind == "pit" else "", f"{f.kind}: {f.title}", f.title, f.caption)
            for f in figures if f.kind == kind]


def render_generation_html(result: Any, figures: bool = True) -> str:
    """The generation audit as one self-contained HTML document (inline CSS; figures as base64 PNG).

    Parameters
    ----------
    result : GenerationAuditResult or its ``to_dict()`` dict
    figures : bool
        Draw the PIT histograms with their acceptance bands and the held-out TV chart (matplotlib);
        ``False`` gives tables only.
    """
    d = generation_dict(result)
    drawn = generation_figures(d) if figures else []
    verdict = str(d.get("verdict", "?"))
    badge_css = {"PASS": "pass", "INCONCLUSIVE": "warn"}.get(verdict, "fail")
    title = f"Generation audit: {d.get('generator', '?')} against {d.get('scorer', '?')}"
    sentences = _verdict_text(d, lambda s: f"“{s}”")
    alpha = _alpha(d)
    parts = [
        "<!DOCTYPE html>",
        '<html lang="en"><head><meta charset="utf-8">',
        '<meta name="viewport" content="width=device-width, initial-scale=1">',
        f"<title>{_e(title)}</title>",
        f"<style>{_CSS}{_GENERATION_CSS}</style></head><body>",
        f"<h1>Generation audit: <code>{_e(d.get('generator', '?'))}</code> against "
        f"<code>{_e(d.get('scorer', '?'))}</code></h1>",
        f'<p class="meta"><span class="badge {badge_css}" id="verdict">{_e(verdict)}</span> '
        f"&middot; spectr-audit {_e(__version__)}</p>",
        f'<p id="verdict-line">{_e(sentences[0])}</p>',
        *(f'<p class="{"incomplete" if s.startswith("INCOMPLETE") else "note"}">{_e(s)}</p>' for s in sentences[1:]),
        '<p class="note">Verdicts: <b>PASS</b> = nothing rejected, at the planned power; <b>FINDING</b> = a deciding '
        "test rejected at the familywise level alpha (Holm), or a decisive check found a violation; "
        "<b>INCONCLUSIVE</b> = nothing rejected, but the minimum detectable TV reached is above the one requested; "
        "<b>ERROR</b> = more engine calls failed than allowed, or no job could be scored.</p>",
        '<nav><a href="#run">Run</a><a href="#tests">Tests</a><a href="#strata">Strata</a>'
        '<a href="#held-out">Held-out TV</a>'
        + ('<a href="#numerics-floor">Numerics floor</a>' if _floor_text(d) else "")
        + ('<a href="#greedy">Greedy</a>' if d.get("greedy") else "")
        + '<a href="#zero-mass">Zero-mass tokens</a><a href="#after-eos">After end-of-sequence</a>'
        '<a href="#failures">Failed jobs</a></nav>',
        '<h2 id="run">Run</h2>',
        _html_table((("what", True), ("value", True)), [(_e(k), _e(v)) for k, v in _facts(d)]),
        '<h2 id="tests">Tests</h2>',
        '<p class="note">The whole Holm family; only the deciding tests and the decisive checks decide. p: the test '
        "alone; adjusted: Holm over the family.</p>",
    ]
    tests = _subtests(d)
    parts.append(_html_table(
        (("test", True), ("role", True), ("statistic", False), ("df", False), ("tokens", False), ("p", False),
         ("adjusted p", False), ("min detectable TV", False), ("outcome", True), ("what", True)),
        [(f"<code>{_e(t.get('name'))}</code>", _e(_role(d, t)), _fixed(t.get("statistic"), 3), _fixed(t.get("df"), 1),
          _e(t.get("num_samples", "–")), _e(_p_at(t.get("pvalue"))), _e(_p_at(t.get("pvalue_adjusted"))),
          _e(_detectable(t.get("min_detectable_tv"))), _e(_outcome(d, t)),
          f'<span class="detail">{_e("; ".join(x for x in (t.get("detail"), t.get("null")) if x))}</span>')
         for t in tests],
        css="findings", row_css=["finding" if _rejected(d, t) else "" for t in tests]))
    strata = _list(d.get("strata"))
    parts += ['<h2 id="strata">Strata</h2>',
              '<p class="note">Per stratum and PIT order: the binned PIT values against uniform (G-test); min '
              "detectable TV: the smallest TV of the stratum's pooled PIT law detected at the audit's power; outside "
              "band: bins whose count falls outside the 99% range under uniformity (about 1% do by chance).</p>"]
    if strata:
        rejected = [alpha is not None and _finite(r.get("pvalue_adjusted")) is not None
                    and r["pvalue_adjusted"] <= alpha for r in strata]
        parts.append(_html_table(
            (("stratum", True), ("order", True), ("tokens", False), ("p", False), ("adjusted p", False),
             ("min detectable TV", False), ("outside 99% band", False), ("outcome", True)),
            [(_e(r.get("stratum")), _e(r.get("ordering")), _e(r.get("num_tokens")), _e(_pvalue(r.get("pvalue"))),
              _e(_pvalue(r.get("pvalue_adjusted"))), _e(_detectable(r.get("min_detectable_tv"))),
              "–" if outside_band(r) is None else f"{outside_band(r)} of {len(r.get('histogram') or ())}",
              "rejected" if bad else "not rejected") for r, bad in zip(strata, rejected)],
            row_css=["finding" if bad else "" for bad in rejected]))
    else:
        parts.append("<p>No stratum was tested (no token scored).</p>")
    parts += _figure(drawn, "pit")
    conditions = _condition_rows(d)
    if conditions:
        parts += ['<h2 id="conditions">Serving conditions</h2>', f'<p class="note">{_e(CONDITIONS_NOTE)}</p>',
                  _html_table(tuple((h, h in ("condition", "status", "reached", "engine counters"))
                                    for h in CONDITIONS_HEAD),
                              [tuple(_e(v) for v in row) for row in conditions],
                              row_css=["finding" if row[1] == "FINDING" else "" for row in conditions])]
    parts += _html_held_out(d, drawn)
    floor = _floor_text(d)
    if floor:
        parts += ['<h2 id="numerics-floor">Numerics floor</h2>', *(f"<p>{_e(s)}</p>" for s in floor)]
    parts += _html_greedy(d)
    parts += _html_zero_mass(d)
    parts += _html_after_eos(d)
    agreement = _agreement_rows(d)
    if agreement:
        parts += ['<h2 id="agreement">Repeated requests</h2>',
                  '<p class="note">Pairs of independent requests agreeing on their first token, against the number '
                  "expected from the scorer's law (sum over pairs of sum_v q(v)^2); identical: whole continuations "
                  "equal.</p>",
                  _html_table((("pairs", True), ("count", False), ("agree", False), ("expected", False),
                               ("identical", False), ("p", False), ("adjusted p", False)),
                              [tuple(_e(v) for v in row) for row in agreement])]
    acceptance = _acceptance_lines(d)
    if acceptance:
        parts += ['<h2 id="acceptance">Acceptance</h2>', "<ul>", *(f"<li>{_e(a)}</li>" for a in acceptance), "</ul>"]
    failures = d.get("failures") or []
    parts.append('<h2 id="failures">Failed jobs</h2>')
    parts += (["<ul>", *(f"<li><code>{_e(f)}</code></li>" for f in failures), "</ul>"] if failures
              else ["<p>None: every generator and scorer call returned.</p>"])
    parts.append("</body></html>")
    return "\n".join(parts) + "\n"


def _html_held_out(d: dict, drawn: list) -> list[str]:
    rows = _held_rows(d)
    out = ['<h2 id="held-out">Held-out TV</h2>']
    if not rows:
        return out + ["<p>No bound (no token scored).</p>"]
    confidence = _confidence(d)
    has_floor = bool(_list(d.get("numerics_floor")))
    head = [("order", True), ("engine estimate", False), ("engine lower bound", False), ("tokens", False)]
    if has_floor:
        head += [("reference estimate", False), ("reference lower bound (numerics floor)", False)]
    body = []
    for order, engine, ref in rows:
        engine, ref = engine or {}, ref or {}
        row = [_e(order), _fixed(engine.get("estimate")), f"&ge; {_fixed(engine.get('lower'))}",
               _e(engine.get("num_tokens", "–"))]
        if has_floor:
            row += [_fixed(ref.get("estimate")), f"&ge; {_fixed(ref.get('lower'))}"]
        body.append(tuple(row))
    at = f" (confidence {confidence:g})" if confidence is not None else ""
    return out + [
        f'<p class="note">Lower confidence bounds{_e(at)}'
        " on the engine's mean per-token TV to the scorer, per PIT order: the bins over-represented in one half of "
        "the continuations, scored on the other half, less an Azuma-Hoeffding radius. Best over the orders: "
        f"&ge; {_fixed(d.get('tv_lower'))}.</p>", _html_table(tuple(head), body), *_figure(drawn, "held-out-tv")]


def _html_greedy(d: dict) -> list[str]:
    if not d.get("greedy"):
        return []
    out = ['<h2 id="greedy">Greedy divergences</h2>']
    if d.get("decided_by") != "greedy":
        return out + ["<p>A greedy engine audited without a reference: each emitted token is checked against the "
                      "scorer's most likely one (the zero-mass tokens below).</p>"]
    out.append('<p class="note">Each continuation against the reference\'s (speculation off), from the first token '
               "where they differ (side by side, differing tokens marked); margin: the scorer's logit gap between "
               "the two tokens there; within the audit's logit tolerance (logit_tol) it is a near-tie, reported as "
               "numerics (the label says which).</p>")
    rows = _list(d.get("divergences"))
    if not rows:
        return out + ["<p>None: every greedy continuation matched the reference token for token.</p>"]
    return out + [_html_table(
        (("arm", True), ("job", False), ("row", False), ("prompt", False), ("position", False),
         ("engine token", False), ("reference token", False), ("margin", False), ("label", True),
         ("the two continuations from the divergence", True)),
        [(_e(r.get("arm")), _e(r.get("job")), _e(r.get("row")), _e(r.get("prompt")), _e(r.get("position")),
          _e(r.get("engine_token")), _e(r.get("reference_token")), _e(_margin(r.get("margin"))),
          _e(_divergence_label(r)), _tails_html(r.get("engine_tail"), r.get("reference_tail"))) for r in rows],
        row_css=["numerics" if r.get("numerics") else "finding" for r in rows])]


def _html_zero_mass(d: dict) -> list[str]:
    rows = _list(d.get("zero_mass"))
    out = ['<h2 id="zero-mass">Zero-mass tokens</h2>']
    if not rows:
        return out + ["<p>None: every emitted token has positive mass under the scorer's law.</p>"]
    return out + ['<p class="note">Emitted tokens the scorer gives no mass; margin: how far (in logits) the token is '
                  "below the least likely token the sampling parameters keep.</p>", _html_table(
        (("arm", True), ("job", False), ("row", False), ("prompt", False), ("position", False), ("token", False),
         ("margin", False), ("label", True)),
        [(_e(r.get("arm")), _e(r.get("job")), _e(r.get("row")), _e(r.get("prompt")), _e(r.get("position")),
          _e(r.get("token")), _e(_margin(r.get("margin"))), _e(_zero_label(r))) for r in rows],
        row_css=["numerics" if r.get("numerics") else "finding" for r in rows])]


def _html_after_eos(d: dict) -> list[str]:
    rows = _list(d.get("after_eos"))
    out = ['<h2 id="after-eos">After end-of-sequence</h2>']
    if rows:
        return out + ["<p>Continuations that went on after the end-of-sequence token (each a finding):</p>",
                      _html_table((("job", False), ("row", False), ("end-of-sequence at position", False)),
                                  [(_e(r.get("job")), _e(r.get("row")), _e(r.get("position"))) for r in rows],
                                  row_css=["finding"] * len(rows))]
    if _after_eos_checked(d):
        return out + ["<p>None: no continuation went on after the end-of-sequence token.</p>"]
    return out + ["<p>Not checked: the audit was given no end-of-sequence token.</p>"]


# Its public home is spectr_audit.reports.generation, which re-exports it: reprs, pickles and help
# name that module.
render_generation_html.__module__ = "spectr_audit.reports.generation"
