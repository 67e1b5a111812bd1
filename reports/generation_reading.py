"""The generation audit's result as every report format reads it.

:func:`generation_dict` takes a ``GenerationAuditResult``, its :meth:`to_dict` dict or a
``report.json`` read back, and gives plain values; the rest reads those values: each test's role
(deciding, decisive check, reported) and outcome in words, and the verdict's sentences (the deciding
test, its Holm-adjusted p-value, alpha, the tokens scored and how the audit decided).
"""

from __future__ import annotations

import math
from typing import Any, Callable, Mapping, Optional

from spectr_audit.errors import InvalidArgument
from spectr_audit.reports.markdown import _detectable, _finite, _fixed, _pvalue

#: ``kind`` of the JSON report.
KIND = "generation-audit"
#: Version of the JSON report's shape; a reader refuses another.
SCHEMA_VERSION = 1

#: The decisive checks: any one violation is a finding (p = 0 by construction), no power involved.
_CHECKS = ("support", "end-of-sequence", "greedy", "logprobs", "stopping", "constraint")

#: The whole-request checks: what a finding says, and what held.
_REQUEST_CHECK_WORDS = {
    "logprobs": ("returned log-probabilities that depart from the scorer's beyond the tolerance",
                 "returned a log-probability departing from the scorer's beyond the tolerance"),
    "stopping": ("broke a stopping rule (tokens after a stop token or string, min_tokens, max_tokens, finish reason "
                 "or usage)",
                 "broke a stopping rule"),
    "constraint": ("emitted a token the request's constraint does not allow",
                   "emitted a token the request's constraint does not allow"),
}

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
    if name in _REQUEST_CHECK_WORDS:
        what, held = _REQUEST_CHECK_WORDS[name]
        if count:
            return (f"FINDING: {count} of {test.get('num_samples', '?')} continuation(s) {what} (any one is a "
                    f"finding)")
        return f"held: none of {test.get('num_samples', '?')} continuations {held}"
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
        calls = failures + int(d.get("num_jobs") or 0)
        first = (d.get("failed_calls") or [{}])[0]
        named = (f"; the first, job {first.get('job')} ({first.get('arm')}): {first.get('error')} (every traceback in "
                 f"report.json, failed_calls[].traceback)" if first.get("error") else "")
        if not d.get("num_jobs"):
            lines.append(f"ERROR: no job could be scored: every engine call failed ({failures} of {calls} jobs, "
                         f"listed below){named}; nothing was tested.")
        else:
            lines.append(f"ERROR: {failures} of {calls} engine calls failed, more than the "
                         f"{d.get('allowed_failed_calls', 0)} allowed{named}; the tests on the other jobs' {tokens} "
                         "tokens do not decide.")
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
        unreached = [c for c in _list(d.get("conditions")) if c.get("reached") is not True]
        short = not (_finite(d.get("min_detectable_tv")) is not None and _finite(d.get("requested_tv")) is not None
                     and d["min_detectable_tv"] <= d["requested_tv"] * (1 + 1e-9))
        if verdict == "INCONCLUSIVE" and (short or not unreached):
            needed = _tokens_needed(d)
            lines.append(f"INCONCLUSIVE: nothing was rejected, but {power_text}, above the {requested} requested: "
                         f"this is not a PASS. Not rejected: {smallest}; decided {mode}."
                         + (f" At this rate about {needed} tokens would reach the requested TV." if needed else ""))
        if verdict == "INCONCLUSIVE" and unreached:
            lines.append("INCONCLUSIVE: nothing was rejected, but the engine did not show these serving conditions "
                         "reached, so their tokens did not test the state they name: "
                         + "; ".join(f"{quote(str(c.get('name')))} ({c.get('how')})" for c in unreached)
                         + f". Not rejected: {smallest}; decided {mode}.")
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


# Its public home is spectr_audit.reports.generation, which re-exports it: reprs, pickles and help
# name that module.
generation_dict.__module__ = "spectr_audit.reports.generation"
