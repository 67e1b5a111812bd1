"""The rows and sentences of the generation audit's sections, shared by its Markdown and HTML reports.

The run's facts, the held-out lower bounds per PIT order (the engine's beside the reference's),
the numerics floor, repeated requests' agreement, the acceptance counters, and the labels of the
greedy divergences and zero-mass tokens (numerics or finding).
"""

from __future__ import annotations

from typing import Any, Mapping, Optional

from spectr_audit.reports.generation_reading import _DECIDED_BY, _list, _subtest
from spectr_audit.results import power_plan_text
from spectr_audit.reports.markdown import _detectable, _finite, _fixed, _pvalue


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


def _condition_rows(d: dict) -> list:
    """One row per serving condition: name, status, tokens, jobs, what it reached, the engine's counters, and the
    smallest Holm-adjusted p-value of its stratum's tests."""
    rows = []
    for c in _list(d.get("conditions")):
        stats = c.get("stats")
        counters = ", ".join(f"{k} {v}" for k, v in stats.items()) if isinstance(stats, Mapping) else "none reported"
        p = c.get("pvalue_adjusted")
        rows.append((c.get("name"), c.get("status"), c.get("tokens"), c.get("jobs"), c.get("how"), counters,
                     _pvalue(p) if p is not None else "– (untested)"))
    return rows


#: What the conditions section says above its table.
CONDITIONS_NOTE = ("Serving conditions, each run on its own design by the engine under that setting: its tokens are "
                   "a stratum of their own (a prefix-cache condition's: the follow-up calls after a cache hit); "
                   "reached: what the engine's counters (or, for long contexts, the audit's own count) show. A "
                   "condition not shown reached keeps the verdict from PASS.")
CONDITIONS_HEAD = ("condition", "status", "tokens", "jobs", "reached", "engine counters", "adjusted p")


def _agreement_rows(d: dict) -> list:
    a = d.get("agreement") if isinstance(d.get("agreement"), Mapping) else {}
    rows = []
    # the result's agreement summary: (pairs, agreeing pairs, expected agreeing pairs, identical pairs) per design
    for label, test, (pairs_key, agree_key, expected_key, identical_key) in (
            ("within a batch (repeated arm)", "independence / within a batch",
             ("pairs_within", "agree_within", "expected_within", "identical_within")),
            ("across calls (same prompt)", "independence / across calls",
             ("pairs_across", "agree_across", "expected_across", None))):
        pairs = a.get(pairs_key)
        if not pairs:
            continue
        t = _subtest(d, test) or {}
        rows.append((label, pairs, a.get(agree_key), _fixed(a.get(expected_key), 2),
                     a.get(identical_key) if identical_key else "–", _pvalue(t.get("pvalue")),
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
        *([("rounds until the power", power_plan_text(d["power_plan"]))] if d.get("power_plan") else []),
        ("wall time", ", ".join(f"{k} {_fixed(v, 2)} s" for k, v in seconds.items()) or "–"),
    ]


def _after_eos_checked(d: dict) -> bool:
    return _subtest(d, "end-of-sequence") is not None or bool(d.get("after_eos"))
