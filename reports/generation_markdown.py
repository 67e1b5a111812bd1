"""The generation audit's Markdown report: the verdict and what it rests on, then every section with data."""

from __future__ import annotations

from typing import Any, Sequence

from spectr_audit.reports.figures.generation import outside_band
from spectr_audit.reports.generation_reading import (
    _alpha,
    _list,
    _outcome,
    _p_at,
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
    _tail,
    _zero_label,
)
from spectr_audit.reports.markdown import _cell, _detectable, _finite, _fixed, _pvalue

__all__ = ["render_generation_markdown"]


def _md_table(head: Sequence[str], rows: Sequence[Sequence[Any]]) -> list[str]:
    return ["| " + " | ".join(head) + " |", "|" + "---|" * len(head),
            *("| " + " | ".join(_cell(v) for v in row) + " |" for row in rows)]


def render_generation_markdown(result: Any) -> str:
    """The generation audit as Markdown: the verdict and what it rests on, then every section with data."""
    d = generation_dict(result)
    lines = [f"# Generation audit: `{d.get('generator', '?')}` against `{d.get('scorer', '?')}`", "",
             f"**Verdict: {d.get('verdict', '?')}**", ""]
    for line in _verdict_text(d, lambda s: f"`{s}`"):
        lines += [f"**{line}**" if line.startswith("INCOMPLETE") else line, ""]
    lines += ["Verdicts: `PASS` = nothing rejected, at the planned power; `FINDING` = a deciding test rejected at the "
              "familywise level alpha (Holm), or a decisive check found a violation; `INCONCLUSIVE` = nothing "
              "rejected, but the minimum detectable TV reached is above the one requested; `ERROR` = more engine calls "
              "failed than allowed, or no job could be scored.", "", "## Run", ""]
    lines += _md_table(("what", "value"), _facts(d))
    lines += ["", "## Tests", "",
              "The whole Holm family; only the deciding tests and the decisive checks decide. p: the test alone; "
              "adjusted: Holm over the family.", ""]
    lines += _md_table(("test", "role", "statistic", "df", "tokens", "p", "adjusted p", "min detectable TV",
                        "outcome", "what"),
                       [(t.get("name"), _role(d, t), _fixed(t.get("statistic"), 3), _fixed(t.get("df"), 1),
                         t.get("num_samples", "–"), _p_at(t.get("pvalue")), _p_at(t.get("pvalue_adjusted")),
                         _detectable(t.get("min_detectable_tv")), _outcome(d, t),
                         "; ".join(x for x in (t.get("detail"), t.get("null")) if x))
                        for t in _subtests(d)])
    lines += _md_strata(d)
    conditions = _condition_rows(d)
    if conditions:
        lines += ["", "## Serving conditions", "", CONDITIONS_NOTE, ""]
        lines += _md_table(CONDITIONS_HEAD, conditions)
    lines += _md_held_out(d)
    floor = _floor_text(d)
    if floor:
        lines += ["", "## Numerics floor"]
        for line in floor:
            lines += ["", line]
    lines += _md_greedy(d)
    lines += _md_zero_mass(d)
    lines += _md_after_eos(d)
    lines += _md_requests(d)
    agreement = _agreement_rows(d)
    if agreement:
        lines += ["", "## Repeated requests", "",
                  "Pairs of independent requests agreeing on their first token, against the number expected from the "
                  "scorer's law (sum over pairs of sum_v q(v)^2); identical: whole continuations equal.", ""]
        lines += _md_table(("pairs", "count", "agree", "expected", "identical", "p", "adjusted p"), agreement)
    acceptance = _acceptance_lines(d)
    if acceptance:
        lines += ["", "## Acceptance", "", *(f"- {line}" for line in acceptance)]
    failures = d.get("failures") or []
    lines += ["", "## Failed jobs", ""]
    lines += [f"- {f}" for f in failures] if failures else ["None: every generator and scorer call returned."]
    lines.append("")
    return "\n".join(lines) + "\n"


def _md_strata(d: dict) -> list[str]:
    rows = _list(d.get("strata"))
    out = ["", "## Strata", "",
           "Per stratum and PIT order: the binned PIT values against uniform (G-test); min detectable TV: the "
           "smallest TV of the stratum's pooled PIT law detected at the audit's power; outside band: bins whose "
           "count falls outside the 99% range under uniformity (about 1% do by chance).", ""]
    if not rows:
        return out + ["No stratum was tested (no token scored)."]
    alpha = _alpha(d)
    return out + _md_table(
        ("stratum", "order", "tokens", "p", "adjusted p", "min detectable TV", "outside 99% band", "outcome"),
        [(r.get("stratum"), r.get("ordering"), r.get("num_tokens"), _pvalue(r.get("pvalue")),
          _pvalue(r.get("pvalue_adjusted")), _detectable(r.get("min_detectable_tv")),
          "–" if outside_band(r) is None else f"{outside_band(r)} of {len(r.get('histogram') or ())}",
          "rejected" if alpha is not None and _finite(r.get("pvalue_adjusted")) is not None
          and r["pvalue_adjusted"] <= alpha else "not rejected") for r in rows])


def _md_held_out(d: dict) -> list[str]:
    rows = _held_rows(d)
    if not rows:
        return []
    confidence = _confidence(d)
    has_floor = bool(_list(d.get("numerics_floor")))
    head = ["order", "engine estimate", "engine lower bound", "tokens"]
    if has_floor:
        head += ["reference estimate", "reference lower bound (numerics floor)"]
    body = []
    for order, engine, ref in rows:
        engine, ref = engine or {}, ref or {}
        row = [order, _fixed(engine.get("estimate")), f">= {_fixed(engine.get('lower'))}",
               engine.get("num_tokens", "–")]
        if has_floor:
            row += [_fixed(ref.get("estimate")), f">= {_fixed(ref.get('lower'))}"]
        body.append(row)
    return ["", "## Held-out TV", "",
            f"Lower confidence bounds{f' (confidence {confidence:g})' if confidence is not None else ''} on the "
            "engine's mean per-token TV to the scorer, per PIT order: the bins over-represented in one half of the "
            "continuations, scored on the other half, less an Azuma-Hoeffding radius. Best over the orders: >= "
            f"{_fixed(d.get('tv_lower'))}.", "", *_md_table(head, body)]


def _md_greedy(d: dict) -> list[str]:
    if not d.get("greedy"):
        return []
    out = ["", "## Greedy divergences", ""]
    if d.get("decided_by") != "greedy":
        return out + ["A greedy engine audited without a reference: each emitted token is checked against the "
                      "scorer's most likely one (the zero-mass tokens below)."]
    rows = _list(d.get("divergences"))
    out.append("Each continuation against the reference's (speculation off), from the first token where they "
               "differ; margin: the scorer's logit gap between the two tokens there; within the audit's logit "
               "tolerance (logit_tol) it is a near-tie, reported as numerics (the label says which).")
    if not rows:
        return out + ["", "None: every greedy continuation matched the reference token for token."]
    return out + [""] + _md_table(
        ("arm", "job", "row", "prompt", "position", "engine token", "reference token", "margin", "label",
         "engine from the divergence", "reference from the divergence"),
        [(r.get("arm"), r.get("job"), r.get("row"), r.get("prompt"), r.get("position"), r.get("engine_token"),
          r.get("reference_token"), _margin(r.get("margin")), _divergence_label(r),
          f"`{_tail(r.get('engine_tail'))}`", f"`{_tail(r.get('reference_tail'))}`") for r in rows])


def _md_zero_mass(d: dict) -> list[str]:
    rows = _list(d.get("zero_mass"))
    out = ["", "## Zero-mass tokens", ""]
    if not rows:
        return out + ["None: every emitted token has positive mass under the scorer's law."]
    return out + ["Emitted tokens the scorer gives no mass; margin: how far (in logits) the token is below the least "
                  "likely token the sampling parameters keep.", ""] + _md_table(
        ("arm", "job", "row", "prompt", "position", "token", "margin", "label"),
        [(r.get("arm"), r.get("job"), r.get("row"), r.get("prompt"), r.get("position"), r.get("token"),
          _margin(r.get("margin")), _zero_label(r)) for r in rows])


def _md_after_eos(d: dict) -> list[str]:
    rows = _list(d.get("after_eos"))
    out = ["", "## After end-of-sequence", ""]
    if rows:
        return out + ["Continuations that went on after the end-of-sequence token (each a finding):", ""] + _md_table(
            ("job", "row", "end-of-sequence at position"), [(r.get("job"), r.get("row"), r.get("position"))
                                                            for r in rows])
    if _after_eos_checked(d):
        return out + ["None: no continuation went on after the end-of-sequence token."]
    return out + ["Not checked: the audit was given no end-of-sequence token."]


def _md_requests(d: dict) -> list[str]:
    """The whole requests: each one, the findings of their checks, and the determinism line (absent without)."""
    requests = _list(d.get("requests"))
    if not requests:
        return []
    out = ["", "## Whole requests", "", "Each row carried one of these requests, in turn (every batch mixes them):", ""]
    out += _md_table(("request", "kind", "fields"),
                     [(i, r.get("kind"), ", ".join(f"{k}={v}" for k, v in r.items() if k != "kind") or "defaults")
                      for i, r in enumerate(requests)])
    findings = _list(d.get("request_findings"))
    out += [""]
    if findings:
        out += ["Findings of the request checks (each one decisive):", ""] + _md_table(
            ("check", "job", "row", "position", "what"),
            [(f.get("check"), f.get("job"), f.get("row"), f.get("position"), f.get("what")) for f in findings])
    else:
        out += ["No finding of the request checks (logprobs, stopping, constraint)."]
    det = d.get("determinism")
    if isinstance(det, dict):
        if det.get("differing"):
            line = (f"Determinism (not part of the verdict): {det.get('differing')} of {det.get('checked')} seeded rows "
                    f"gave other tokens when rerun in another batch order.")
        elif det.get("checked"):
            line = (f"Determinism (not part of the verdict): all {det.get('checked')} seeded rows gave the same tokens "
                    f"when rerun in another batch order.")
        else:
            line = "Determinism: no seeded row was rerun."
        out += ["", line]
    return out


# Its public home is spectr_audit.reports.generation, which re-exports it: reprs, pickles and help
# name that module.
render_generation_markdown.__module__ = "spectr_audit.reports.generation"
