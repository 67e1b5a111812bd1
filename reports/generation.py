"""The generation audit's reports: JSON (a versioned machine contract), Markdown, HTML and JUnit XML.

They read a ``GenerationAuditResult`` through its :meth:`to_dict` (or that dict itself, or a
``report.json`` read back), never the audit: plain values only (docs/report-schema.md,
"Generation audits").  Every number says what it rests on:

* the verdict line names the deciding test, its Holm-adjusted p-value, alpha, the tokens scored,
  and how the audit decided: one-sample (the engine's tokens against the scorer's law),
  two-sample (against the reference generator, because the reference itself differs from the
  scorer: the numerics floor) or greedy (token for token against the reference); an INCONCLUSIVE
  gives the minimum detectable TV reached against the one requested;
* the tests: the whole Holm family, each test with its role (deciding, decisive check, reported)
  and its outcome in words that follow it (``rejected``, ``not rejected``, ``FINDING``, ``held``);
* the strata: per stratum and PIT order, tokens, p, adjusted p, minimum detectable TV and the bins
  outside the 99% acceptance band (the HTML draws the histograms with their bands);
* the held-out lower bounds on the mean per-token TV, the engine's beside the reference's (the
  numerics floor, with the zero-mass logit tolerance used); the greedy divergences, each with its position,
  both tokens, the logit margin and the two continuations side by side from the divergence on,
  labelled "numerics (near-tie)" where the margin is within the tolerance; the zero-mass tokens,
  the continuations that went on after the end-of-sequence token, repeated requests' agreement,
  acceptance counters, wall times and failed jobs.

:func:`write_generation_report` renders every format first, then writes each file atomically
(a temporary file, then a rename): a failure leaves the previous files whole.
"""

from __future__ import annotations

import html
import json
import math
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any, Callable, Mapping, Optional, Sequence

from spectr_audit._files import write_text_atomic
from spectr_audit.errors import InvalidArgument
from spectr_audit.reports.markdown import _cell, _detectable, _finite, _fixed, _pvalue

__all__ = [
    "FORMATS",
    "KIND",
    "SCHEMA_VERSION",
    "generation_dict",
    "generation_json",
    "render_generation_html",
    "render_generation_json",
    "render_generation_junit",
    "render_generation_markdown",
    "write_generation_report",
]

#: ``kind`` of the JSON report.
KIND = "generation-audit"
#: Version of the JSON report's shape; a reader refuses another.
SCHEMA_VERSION = 1
#: The formats :func:`write_generation_report` writes, and their file names.
FORMATS = {"json": "report.json", "md": "report.md", "html": "report.html", "junit": "junit.xml"}

#: The decisive checks: any one violation is a finding (p = 0 by construction), no power involved.
_CHECKS = ("support", "end-of-sequence", "greedy")

_DECIDED_BY = {
    "one-sample": "one-sample: the engine's tokens against the scorer's law",
    "two-sample": ("two-sample: the engine's tokens against the reference generator's, scored alike, because the "
                   "reference itself differs from the scorer beyond its noise (the numerics floor)"),
    "greedy": "greedy: token for token against the reference generator",
}

_STOP = {
    "e-process": "the anytime-valid e-process crossed its threshold before the planned jobs ran out",
    "support": "a decisive violation (a zero-mass token or a continuation past end-of-sequence) was seen",
    "max_tokens": "the token budget (max_tokens) was reached",
    "max_seconds": "the time budget (max_seconds) was reached",
    "interrupted": "the audit was interrupted",
}


# ---------------------------------------------------------------------------------------------
# Reading the result
# ---------------------------------------------------------------------------------------------


def _plain(value: Any) -> Any:
    """JSON values: non-finite floats become None, tuples lists, keys strings."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, Mapping):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


def generation_dict(result: Any) -> dict:
    """A generation audit's plain values: ``result.to_dict()``, that dict, or a ``report.json`` read back.

    Raises
    ------
    InvalidArgument
        On anything else, or a ``report.json`` of another kind or schema version.
    """
    if hasattr(result, "to_dict"):
        result = result.to_dict()
    if not isinstance(result, Mapping):
        raise InvalidArgument(f"result: expected a GenerationAuditResult or its to_dict() dict, got "
                              f"{type(result).__name__}")
    data = dict(result)
    if "kind" in data or "schema_version" in data:
        if data.get("kind") != KIND or data.get("schema_version") != SCHEMA_VERSION:
            raise InvalidArgument(f"result: expected a {KIND} report of schema version {SCHEMA_VERSION}, got kind "
                                  f"{data.get('kind')!r}, schema version {data.get('schema_version')!r}")
        for key in ("kind", "schema_version", "spectr_audit_version"):
            data.pop(key, None)
    if "verdict" not in data:
        raise InvalidArgument("result: expected a generation audit's dict (no 'verdict' in it)")
    return _plain(data)


def _list(value: Any) -> list:
    return [v for v in value if isinstance(v, Mapping)] if isinstance(value, (list, tuple)) else []


def _subtests(d: dict) -> list:
    return _list(d.get("subtests"))


def _subtest(d: dict, name: Any) -> Optional[dict]:
    return next((t for t in _subtests(d) if t.get("name") == name), None)


def _alpha(d: dict) -> Optional[float]:
    return _finite(d.get("alpha"))


def _role(d: dict, test: dict) -> str:
    name = test.get("name")
    if name in _CHECKS:
        return "decisive check"
    if name in (d.get("deciding") or ()):
        return "deciding"
    if d.get("decided_by") == "two-sample" and not str(name).startswith("two-sample"):
        return "reported (the verdict is judged against the reference)"
    return "reported"


def _rejected(d: dict, test: dict) -> bool:
    """A test's outcome: a decisive check that found something, or an adjusted p-value at most alpha."""
    if test.get("name") in _CHECKS:
        return (_finite(test.get("statistic")) or 0.0) > 0
    adjusted, alpha = _finite(test.get("pvalue_adjusted")), _alpha(d)
    return adjusted is not None and alpha is not None and adjusted <= alpha


def _check_text(d: dict, test: dict) -> str:
    """What a decisive check found, in the words of its outcome."""
    name, count = test.get("name"), int(_finite(test.get("statistic")) or 0)
    tol = _fixed(d.get("logit_tolerance"), 4) if _finite(d.get("logit_tolerance")) is not None else "–"
    if name == "support":
        numerics = sum(bool(z.get("numerics")) for z in _list(d.get("zero_mass")))
        extra = f"; {numerics} within the {tol}-logit tolerance, reported as numerics" if numerics else ""
        if count:
            return (f"FINDING: {count} emitted token(s) of zero target mass beyond the numerics tolerance "
                    f"among {test.get('num_samples', '?')} scored (any one is a finding){extra}")
        return f"held: no emitted token of zero target mass beyond the numerics tolerance among " \
               f"{test.get('num_samples', '?')} scored{extra}"
    if name == "end-of-sequence":
        if count:
            return (f"FINDING: {count} of {test.get('num_samples', '?')} continuation(s) went on after the "
                    "end-of-sequence token (any one is a finding)")
        return f"held: none of {test.get('num_samples', '?')} continuations went on after the end-of-sequence token"
    # greedy: num_samples counts the divergences, near-ties included
    total = test.get("num_samples") or 0
    if count:
        return (f"FINDING: {count} greedy continuation(s) departed from the reference at a logit margin above "
                f"the audit's logit tolerance (or with no margin measured); {max(total - count, 0)} near-tie(s) "
                "reported as numerics")
    return ("held: no greedy continuation departed from the reference beyond the audit's logit tolerance"
            + (f"; {total} near-tie(s) reported as numerics" if total else ""))


def _outcome(d: dict, test: dict) -> str:
    """A test's outcome in words: ``rejected`` / ``not rejected`` (with its adjusted p), or a check's finding."""
    if test.get("name") in _CHECKS:
        return _check_text(d, test)
    adjusted = _pvalue(test.get("pvalue_adjusted"))
    alpha = _alpha(d)
    if _rejected(d, test):
        return f"rejected (adjusted p {adjusted} <= alpha {alpha:g})"
    return f"not rejected (adjusted p {adjusted} > alpha {alpha:g})" if alpha is not None else "not rejected"


def _tokens_needed(d: dict) -> Optional[int]:
    """Tokens at which the pooled test's minimum detectable TV would reach the requested one (it falls as 1/sqrt(n))."""
    reached, requested, n = _finite(d.get("min_detectable_tv")), _finite(d.get("requested_tv")), d.get("num_tokens")
    if reached is None or not requested or not isinstance(n, int) or n <= 0:
        return None
    return int(math.ceil(n * (reached / requested) ** 2))


def _p_at(value: Any) -> str:
    return "0 (decisive)" if _finite(value) == 0.0 else _pvalue(value)


def _verdict_text(d: dict, quote: Callable[[str], str]) -> list[str]:
    """The verdict's sentences, plain text (names through ``quote``): what decided, on what, at what level."""
    verdict = str(d.get("verdict", "?"))
    alpha = _alpha(d)
    alpha_text = f"{alpha:g}" if alpha is not None else "–"
    tokens = d.get("num_tokens", 0)
    mode = _DECIDED_BY.get(str(d.get("decided_by")), str(d.get("decided_by", "?")))
    test_name = str(d.get("test", "?"))
    test = _subtest(d, test_name) or {}
    on = f"on {test.get('num_samples')} of {tokens} tokens scored" if test.get("num_samples") is not None \
        else f"{tokens} tokens scored"
    power = _finite(d.get("power"))
    reached, requested = _detectable(d.get("min_detectable_tv")), _fixed(d.get("requested_tv"))
    power_text = (f"the minimum detectable TV reached is {reached} (the pooled PIT law of all tokens, probability "
                  f"order, at power {power:g})" if power is not None else f"the minimum detectable TV reached is "
                                                                             f"{reached}")
    lines = []
    if verdict == "ERROR":
        failures = len(d.get("failures") or ())
        lines.append(f"ERROR: no job could be scored ({failures} generator or scorer call(s) failed, listed below); "
                     "nothing was tested.")
    elif verdict == "FINDING" and test_name in _CHECKS:
        found = _check_text(d, test).removeprefix("FINDING: ")
        lines.append(f"FINDING: the decisive check {quote(test_name)} found a violation: {found}; p = 0 "
                     f"(decisive) at alpha {alpha_text}; {tokens} tokens scored; decided {mode}.")
    elif verdict == "FINDING":
        lines.append(f"FINDING: the deciding test {quote(test_name)} rejects: Holm-adjusted p = "
                     f"{_pvalue(d.get('pvalue'))} <= alpha {alpha_text} (familywise over the deciding tests; "
                     f"unadjusted p = {_pvalue(test.get('pvalue'))}), {on}; decided {mode}.")
    else:
        smallest = (f"the smallest Holm-adjusted p over the deciding tests is {_pvalue(d.get('pvalue'))} > alpha "
                    f"{alpha_text} (deciding test {quote(test_name)}, {on})")
        if verdict == "INCONCLUSIVE":
            needed = _tokens_needed(d)
            lines.append(f"INCONCLUSIVE: nothing was rejected, but {power_text}, above the {requested} requested: "
                         f"this is not a PASS. Not rejected: {smallest}; decided {mode}."
                         + (f" At this rate about {needed} tokens would reach the requested TV." if needed else ""))
        elif verdict == "PASS" and d.get("greedy") and d.get("decided_by") == "greedy":
            near = sum(bool(v.get("numerics")) for v in _list(d.get("divergences")))
            lines.append("PASS: every greedy continuation matched the reference token for token"
                         + (f", or departed at a near-tie within the logit tolerance ({near} such)" if near else "")
                         + f"; {smallest}; decided {mode}.")
        elif verdict == "PASS" and d.get("greedy"):
            lines.append(f"PASS: greedy against the scorer alone: every emitted token was the scorer's most likely "
                         f"one (no zero-mass token beyond the numerics tolerance); {smallest}; decided {mode}.")
        elif verdict == "PASS":
            lines.append(f"PASS: nothing was rejected: {smallest}; decided {mode}; {power_text}, within the "
                         f"{requested} requested.")
        else:
            lines.append(f"{verdict}: {smallest}; decided {mode}.")
    if d.get("incomplete"):
        lines.append(f"INCOMPLETE: the audit was interrupted; this result covers the {d.get('num_jobs', '?')} jobs "
                     "that finished.")
    reason = d.get("stop_reason")
    if reason and reason != "planned":
        lines.append(f"Stopped before the planned jobs ran out: {_STOP.get(str(reason), str(reason))}.")
    return lines


# ---------------------------------------------------------------------------------------------
# JSON
# ---------------------------------------------------------------------------------------------


def generation_json(result: Any) -> dict:
    """The machine contract: ``{"kind": "generation-audit", "schema_version": 1, "spectr_audit_version": ...,
    ...the result's dict}``."""
    from spectr_audit import __version__

    return {"kind": KIND, "schema_version": SCHEMA_VERSION, "spectr_audit_version": __version__,
            **generation_dict(result)}


def render_generation_json(result: Any) -> str:
    """:func:`generation_json` as indented JSON text (strict: no NaN or infinity)."""
    return json.dumps(generation_json(result), indent=2, allow_nan=False) + "\n"


# ---------------------------------------------------------------------------------------------
# Shared pieces of the text formats
# ---------------------------------------------------------------------------------------------


def _tail(tokens: Any) -> str:
    return " ".join(str(t) for t in tokens or ())


def _margin(value: Any) -> str:
    number = _finite(value)
    return "– (no logits)" if number is None else f"{number:.4g}"


def _divergence_label(row: Mapping) -> str:
    if row.get("numerics"):
        return "numerics (near-tie)"
    if _finite(row.get("margin")) is None:
        return "divergence (finding; no logits to measure the margin)"
    return "divergence (finding)"


def _zero_label(row: Mapping) -> str:
    if row.get("numerics"):
        return "numerics (within the logit tolerance)"
    return "violation (finding)" + ("" if _finite(row.get("margin")) is not None else "; no logits to measure it")


def _held_rows(d: dict) -> list:
    """``(order, engine bound or None, reference bound or None)`` per PIT order."""
    engine = {str(h.get("ordering")): h for h in _list(d.get("held_out_tv"))}
    floor = {str(h.get("ordering")): h for h in _list(d.get("numerics_floor"))}
    return [(o, engine.get(o), floor.get(o)) for o in dict.fromkeys([*engine, *floor])]


def _confidence(d: dict) -> Optional[float]:
    for h in [*_list(d.get("held_out_tv")), *_list(d.get("numerics_floor"))]:
        value = _finite(h.get("confidence"))
        if value is not None:
            return value
    return None


def _floor_text(d: dict) -> list[str]:
    """The numerics floor's sentences (empty without a reference)."""
    floor = _list(d.get("numerics_floor"))
    rejected = d.get("reference_rejected")
    if not floor and rejected is None:
        return []
    confidence = _confidence(d)
    at = f" at confidence {confidence:g}" if confidence is not None else ""
    best = max(floor, key=lambda h: _finite(h.get("lower")) or 0.0) if floor else None
    lines = []
    if best is not None:
        lines.append(f"The reference generator (the same engine with speculation off), scored by the same scorer: "
                     f"its held-out lower bound on the mean per-token TV to the scorer is >= "
                     f"{_fixed(best.get('lower'))}{at} (best order: {best.get('ordering')}; estimate "
                     f"{_fixed(best.get('estimate'))}, {best.get('num_tokens', '?')} tokens). That much the scorer's "
                     "numerics alone account for.")
    if rejected:
        lines.append("The reference's own one-sample tests rejected: the reference itself differs from the scorer "
                     "beyond its noise (the scorer's numerics are not the engine's), so the engine is judged "
                     "two-sample, against the reference"
                     + (" (and greedy: token for token)." if d.get("decided_by") == "greedy" else "."))
    elif rejected is False:
        lines.append("The reference's own one-sample tests did not reject: the scorer is an adequate yardstick, and "
                     "the engine is judged against it" + (" (and greedy: token for token against the reference)."
                                                           if d.get("decided_by") == "greedy" else " (one-sample)."))
    tol = _finite(d.get("logit_tolerance"))
    lines.append(f"Logit tolerance: {tol:g} logits: an emitted token of zero target mass within it of the least "
                 "likely kept token is reported as numerics, not a finding (the audit's logit_tol or, with a "
                 "reference, the largest margin at which the reference itself emitted a zero-mass token, when that "
                 "is larger)." if tol is not None else "Logit tolerance: –.")
    return lines


def _agreement_rows(d: dict) -> list:
    a = d.get("agreement") if isinstance(d.get("agreement"), Mapping) else {}
    rows = []
    for key, label, test in (("within", "within a batch (repeated arm)", "independence / within a batch"),
                             ("across", "across calls (same prompt)", "independence / across calls")):
        pairs = a.get(f"pairs_{key}")
        if not pairs:
            continue
        t = _subtest(d, test) or {}
        rows.append((label, pairs, a.get(f"agree_{key}"), _fixed(a.get(f"expected_{key}"), 2),
                     a.get("identical_within") if key == "within" else "–", _pvalue(t.get("pvalue")),
                     _pvalue(t.get("pvalue_adjusted"))))
    return rows


def _acceptance_lines(d: dict) -> list[str]:
    a = d.get("acceptance") if isinstance(d.get("acceptance"), Mapping) else {}
    out = []
    if _finite(a.get("tokens_per_target_call")) is not None:
        out.append(f"tokens per target call (the engine's counters): {_fixed(a['tokens_per_target_call'])}")
    if a.get("accepted_draft_tokens") is not None:
        out.append(f"accepted draft tokens (the engine's counters): {a['accepted_draft_tokens']}")
    if _finite(a.get("expected_acceptance_per_drafted_token")) is not None:
        out.append(f"expected acceptance per drafted token (single-draft speculative sampling at the visited contexts, "
                   f"from the draft scorer): {_fixed(a['expected_acceptance_per_drafted_token'])}")
    if a.get("note"):
        out.append(f"note: {a['note']}")
    return out


def _facts(d: dict) -> list[tuple[str, str]]:
    """(label, value) of the run: what was audited, with what, how much."""
    arms = d.get("tokens_by_arm") if isinstance(d.get("tokens_by_arm"), Mapping) else {}
    seconds = d.get("seconds") if isinstance(d.get("seconds"), Mapping) else {}
    z = _finite(d.get("surprisal_z"))
    return [
        ("generator", str(d.get("generator", "?"))),
        ("scorer", str(d.get("scorer", "?"))),
        ("tokens scored", f"{d.get('num_tokens', 0)} in {d.get('num_continuations', 0)} continuations, "
                          f"{d.get('num_jobs', 0)} generator calls"),
        ("tokens by arm", ", ".join(f"{k} {v}" for k, v in arms.items()) or "–"),
        ("alpha (familywise) / power", f"{_fixed(d.get('alpha'), 4)} / {_fixed(d.get('power'), 2)}"),
        ("min detectable TV reached / requested", f"{_detectable(d.get('min_detectable_tv'))} / "
                                                  f"{_fixed(d.get('requested_tv'))}"),
        ("greedy", "yes" if d.get("greedy") else "no"),
        ("decided", _DECIDED_BY.get(str(d.get("decided_by")), str(d.get("decided_by", "?")))),
        ("surprisal martingale Z", "–" if z is None else
         f"{z:+.2f} (over all tokens; > 0: less likely tokens than the target's, too flat; < 0: too sharp)"),
        ("PIT bins", str(d.get("num_bins", "?"))),
        ("processes", str(d.get("num_processes", 1))),
        ("stop reason", str(d.get("stop_reason", "?"))),
        ("wall time", ", ".join(f"{k} {_fixed(v, 2)} s" for k, v in seconds.items()) or "–"),
    ]


def _after_eos_checked(d: dict) -> bool:
    return _subtest(d, "end-of-sequence") is not None or bool(d.get("after_eos"))


# ---------------------------------------------------------------------------------------------
# Markdown
# ---------------------------------------------------------------------------------------------


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
              "rejected, but the minimum detectable TV reached is above the one requested; `ERROR` = no job could be "
              "scored.", "", "## Run", ""]
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
    lines += _md_held_out(d)
    floor = _floor_text(d)
    if floor:
        lines += ["", "## Numerics floor"]
        for line in floor:
            lines += ["", line]
    lines += _md_greedy(d)
    lines += _md_zero_mass(d)
    lines += _md_after_eos(d)
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
    from spectr_audit.reports.figures.generation import outside_band

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


# ---------------------------------------------------------------------------------------------
# HTML
# ---------------------------------------------------------------------------------------------

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
    from spectr_audit.reports.html import _figure_html

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
    from spectr_audit import __version__
    from spectr_audit.reports.figures.generation import generation_figures, outside_band
    from spectr_audit.reports.html import _CSS

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
        "<b>ERROR</b> = no job could be scored.</p>",
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


# ---------------------------------------------------------------------------------------------
# JUnit XML
# ---------------------------------------------------------------------------------------------


def _property(parent: ET.Element, name: str, value: Any) -> None:
    if value is None:
        return
    if isinstance(value, bool):
        text = str(value).lower()
    elif isinstance(value, float):
        if not math.isfinite(value):
            return
        text = repr(value)
    else:
        text = str(value)
    ET.SubElement(parent, "property", name=name, value=text)


def render_generation_junit(result: Any) -> str:
    """The generation audit as JUnit XML: one ``<testcase>`` per deciding test and decisive check.

    A deciding test that rejects (adjusted p at most alpha) or a check that found a violation is a
    ``<failure>``; when the verdict is INCONCLUSIVE, the tests that did not reject are ``<skipped>``
    (nothing rejected, below the planned power), with a ``minimum detectable TV`` test case saying
    how far the power fell short; an ERROR is one ``<error>``.  Tests the verdict does not rest on
    (reported only) are left out.  Every test case carries its numbers as ``<property>`` elements.
    """
    d = generation_dict(result)
    verdict = str(d.get("verdict", "?"))
    alpha = _alpha(d)
    seconds = d.get("seconds") if isinstance(d.get("seconds"), Mapping) else {}
    total = sum(v for v in (_finite(x) for x in seconds.values()) if v is not None)
    classname = f"spectr_audit.generation.{d.get('generator', 'generator')}"
    suite = ET.Element("testsuite", name=f"spectr-audit.generation.{d.get('generator', 'generator')}")
    properties = ET.SubElement(suite, "properties")
    for key in ("verdict", "test", "pvalue", "alpha", "power", "decided_by", "num_tokens", "num_continuations",
                "num_jobs", "min_detectable_tv", "requested_tv", "tv_lower", "greedy", "stop_reason", "incomplete",
                "logit_tolerance", "scorer"):
        _property(properties, key, d.get(key))
    counts = {"failures": 0, "errors": 0, "skipped": 0}
    verdict_text = " ".join(_verdict_text(d, lambda s: f"'{s}'"))

    def case(name: str, test: Optional[dict] = None):
        element = ET.SubElement(suite, "testcase", classname=classname, name=name, time="0")
        props = ET.SubElement(element, "properties")
        _property(props, "verdict", verdict)
        for key in ("statistic", "pvalue", "pvalue_adjusted", "df", "num_samples", "min_detectable_tv"):
            _property(props, key, (test or {}).get(key))
        _property(props, "alpha", alpha)
        if test is not None:
            _property(props, "role", _role(d, test))
        return element

    if verdict == "ERROR":
        element = case("generation audit")
        error = ET.SubElement(element, "error", message=verdict_text[:500], type="AuditError")
        error.text = "\n".join(str(f) for f in d.get("failures") or ()) or verdict_text
        counts["errors"] += 1
    else:
        deciding = set(d.get("deciding") or ())
        for test in _subtests(d):
            name = test.get("name")
            if name not in deciding and name not in _CHECKS:
                continue  # reported only: the verdict does not rest on it
            element = case(str(name), test)
            outcome = _outcome(d, test)
            what = "; ".join(x for x in (test.get("detail"), test.get("null")) if x)
            if _rejected(d, test):
                failure = ET.SubElement(element, "failure", message=f"FINDING: {name}: {outcome}"[:500],
                                        type="Finding")
                failure.text = f"{outcome}\n{what}\n{verdict_text}"
                counts["failures"] += 1
            elif verdict == "INCONCLUSIVE" and name not in _CHECKS:
                skipped = ET.SubElement(element, "skipped", message=(
                    f"INCONCLUSIVE: {outcome}, but the audit's minimum detectable TV "
                    f"{_detectable(d.get('min_detectable_tv'))} is above the {_fixed(d.get('requested_tv'))} "
                    "requested")[:500])
                skipped.text = "nothing rejected, but below the planned power"
                counts["skipped"] += 1
            else:
                ET.SubElement(element, "system-out").text = f"{outcome}. {what}".strip()
        if verdict in ("PASS", "INCONCLUSIVE") and not d.get("greedy"):
            element = case("minimum detectable TV")
            _property(element.find("properties"), "min_detectable_tv", d.get("min_detectable_tv"))
            _property(element.find("properties"), "requested_tv", d.get("requested_tv"))
            reached, requested = _detectable(d.get("min_detectable_tv")), _fixed(d.get("requested_tv"))
            if verdict == "INCONCLUSIVE":
                skipped = ET.SubElement(element, "skipped", message=(
                    f"INCONCLUSIVE: the minimum detectable TV reached, {reached}, is above the {requested} "
                    f"requested ({d.get('num_tokens', 0)} tokens scored)")[:500])
                needed = _tokens_needed(d)
                skipped.text = ("nothing rejected, but below the planned power"
                                + (f"; about {needed} tokens would reach it" if needed else ""))
                counts["skipped"] += 1
            else:
                ET.SubElement(element, "system-out").text = (f"the minimum detectable TV reached, {reached}, is "
                                                            f"within the {requested} requested")
    failures = d.get("failures") or []
    if failures and verdict != "ERROR":
        ET.SubElement(suite, "system-err").text = "failed jobs (their arm's other jobs were kept):\n" + "\n".join(
            str(f) for f in failures)
    ET.SubElement(suite, "system-out").text = verdict_text
    suite.set("tests", str(len(suite.findall("testcase"))))
    suite.set("failures", str(counts["failures"]))
    suite.set("errors", str(counts["errors"]))
    suite.set("skipped", str(counts["skipped"]))
    suite.set("time", f"{total:.6f}")
    suites = ET.Element("testsuites", name="spectr-audit")
    suites.append(suite)
    ET.indent(suites)
    return '<?xml version="1.0" encoding="utf-8"?>\n' + ET.tostring(suites, encoding="unicode") + "\n"


# ---------------------------------------------------------------------------------------------
# Writing
# ---------------------------------------------------------------------------------------------


def write_generation_report(result: Any, out_dir: Any, formats: Sequence[str] = ("json", "md", "html", "junit"),
                            *, figures: bool = True) -> dict:
    """Write the generation audit's reports into ``out_dir``: report.json, report.md, report.html, junit.xml.

    Every format is rendered before any file is written, and each file is written atomically
    (a temporary file in ``out_dir``, then a rename), so a failure leaves the previous reports whole.

    Parameters
    ----------
    result : GenerationAuditResult or its ``to_dict()`` dict
    out_dir : str or Path
        Created when missing.
    formats : sequence of str
        Some of :data:`FORMATS` (``"json"``, ``"md"``, ``"html"``, ``"junit"``).
    figures : bool
        Draw the HTML report's figures.

    Returns
    -------
    dict
        ``{format: path written}``.
    """
    if isinstance(formats, str):
        formats = (formats,)
    formats = tuple(formats)
    unknown = [f for f in formats if f not in FORMATS]
    if not formats or unknown:
        raise InvalidArgument(f"formats: expected some of {sorted(FORMATS)}, got {list(formats)!r}")
    data = generation_dict(result)
    renderers = {"json": render_generation_json, "md": render_generation_markdown,
                 "html": lambda r: render_generation_html(r, figures=figures), "junit": render_generation_junit}
    texts = {f: renderers[f](data) for f in dict.fromkeys(formats)}
    out_dir = Path(out_dir)
    return {f: write_text_atomic(out_dir / FORMATS[f], text) for f, text in texts.items()}
