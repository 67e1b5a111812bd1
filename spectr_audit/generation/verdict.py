"""A generation audit's result in words: the verdict line, the failure message, the exit code, its reports.

What the CLI, the pytest plugin and the assertions of :mod:`spectr_audit.generation.checks` print
(:func:`verdict_line`, :func:`detail_lines`, :func:`failure_text`), the exit code of one audit
(:func:`status_of`), and the result's JSON and reports (:func:`result_json`, :func:`write_reports`).
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Optional, Union

from spectr_audit import __version__
from spectr_audit._files import write_text_atomic
from spectr_audit.results import EXIT_ERROR, EXIT_INCONCLUSIVE, power_plan_text

__all__ = ["condition_line", "detail_lines", "reference_sample_line", "failure_text", "result_json", "status_of", "verdict_line", "write_reports"]


def _p(value: Any) -> str:
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value):
        return "-"
    return "0 (decisive)" if value == 0 else f"{value:.3g}"


def _num(value: Any) -> str:
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value):
        return "-"
    return f"{value:.3g}"


def _count(n: int, word: str) -> str:
    return f"{n} {word}" + ("" if n == 1 else "s")


#: Where the failed calls' tracebacks are, for the headline.
TRACEBACKS_AT = "report.json, failed_calls[].traceback"


def _failed_calls(result: Any) -> list:
    return list(getattr(result, "failed_calls", ()) or ())


def _num_failed(result: Any) -> int:
    return len(getattr(result, "failures", ()) or ())


def _first_failure(result: Any) -> str:
    """The first failed call: its job and arm, the exception's type and last line."""
    calls = _failed_calls(result)
    if calls:
        first = calls[0]
        return f"job {first.get('job')} ({first.get('arm')}): {first.get('error')}"
    failures = list(getattr(result, "failures", ()) or ())
    lines = str(failures[0]).strip().splitlines() if failures else []
    return lines[-1] if lines else "-"


def _error_line(result: Any) -> str:
    """The headline of an ERROR: what failed (how many calls of how many, the first one, where the tracebacks are)."""
    failed, allowed = _num_failed(result), getattr(result, "allowed_failed_calls", 0)
    calls = result.num_jobs + failed
    head = f"ERROR: {result.generator} against {result.scorer}: "
    if failed == 0:
        return head + "no job could be scored (no engine call finished)"
    if result.num_jobs == 0:
        head += f"every engine call failed ({failed} of {_count(calls, 'job')}); "
    else:
        head += (f"{failed} of {_count(calls, 'engine call')} failed (allowed {allowed}; the "
                 f"{_count(result.num_tokens, 'token')} of the other jobs not judged); ")
    return head + f"first: {_first_failure(result)}; tracebacks: {TRACEBACKS_AT}"


def _stopped(result: Any) -> str:
    """What ended the audit, where the verdict line must say it: a budget, an interruption, the planned power
    reached (``rounds="auto"``), or a budget before it."""
    plan = getattr(result, "power_plan", None)
    if result.stop_reason == "power":
        return f"; stopped at the planned power ({plan['tokens_needed']} tokens for TV {plan['requested_tv']:g})"
    if result.stop_reason in ("planned", "e-process", "support"):
        return ""
    short = (f" before the planned power ({result.num_tokens} of {plan['tokens_needed']} tokens)"
             if plan is not None and not plan.get("reached") else "")
    return f"; stopped: {result.stop_reason}{short}"


def verdict_line(result: Any, exit_code: Optional[int] = None) -> str:
    """The first line of every face: verdict, engine, deciding test and p-value, tokens, and power where it fell short.

    Examples
    --------
    >>> from types import SimpleNamespace as R
    >>> verdict_line(R(verdict="FINDING", generator="shared-stream", scorer="toy target", pvalue=2.6e-4, alpha=1e-3,
    ...              test="independence / within a batch", num_tokens=848, num_jobs=16, incomplete=False,
    ...              stop_reason="planned", min_detectable_tv=0.12, requested_tv=0.02), 1)
    "FINDING: shared-stream against toy target: test 'independence / within a batch', p = 0.00026 (alpha 0.001); 848 tokens in 16 jobs: exit 1"

    A seeded row that changed with its batch is said on the same line, apart from the verdict:

    >>> verdict_line(R(verdict="PASS", generator="toy", scorer="toy target", pvalue=0.4, alpha=1e-3, test="none",
    ...              num_tokens=400, num_jobs=8, incomplete=False, stop_reason="planned", min_detectable_tv=0.1,
    ...              requested_tv=0.1, determinism={"checked": 12, "differing": 3, "rows": [], "passed": False}))
    "PASS: toy against toy target: test 'none', p = 0.4 (alpha 0.001); 400 tokens in 8 jobs; min detectable TV 0.1; determinism (not part of the verdict): 3 of 12 seeded rows gave other tokens in another batch"

    An ERROR names what failed instead of a test:

    >>> verdict_line(R(verdict="ERROR", generator="flaky", scorer="toy target", num_jobs=12, num_tokens=384,
    ...                failures=("job 2 (single): generator raised ...",) * 6, allowed_failed_calls=0,
    ...                failed_calls=({"job": 2, "arm": "single", "error": "RuntimeError: engine crashed"},),
    ...                incomplete=False, stop_reason="planned"), 4)
    'ERROR: flaky against toy target: 6 of 18 engine calls failed (allowed 0; the 384 tokens of the other jobs not judged); first: job 2 (single): RuntimeError: engine crashed; tracebacks: report.json, failed_calls[].traceback: exit 4'
    """
    if result.verdict == "ERROR":
        line = _error_line(result)
        if getattr(result, "incomplete", False):
            line = "ERROR (INCOMPLETE)" + line[len("ERROR"):]
        line += _stopped(result)
        return line if exit_code is None else f"{line}: exit {exit_code}"
    verdict = result.verdict + (" (INCOMPLETE)" if getattr(result, "incomplete", False) else "")
    line = (f"{verdict}: {result.generator} against {result.scorer}: test {result.test!r}, p = {_p(result.pvalue)} "
            f"(alpha {result.alpha:g}); {_count(result.num_tokens, 'token')} in {_count(result.num_jobs, 'job')}")
    if result.verdict == "INCONCLUSIVE":
        unreached = _unreached(result)
        if not result.min_detectable_tv <= result.requested_tv * (1 + 1e-9) or not unreached:
            line += (f"; min detectable TV {_num(result.min_detectable_tv)} above the planned "
                     f"{_num(result.requested_tv)}")
        if unreached:
            line += "; conditions not shown reached: " + ", ".join(c["name"] for c in unreached)
    elif result.verdict == "PASS":
        line += f"; min detectable TV {_num(result.min_detectable_tv)}"
    line += _stopped(result)
    determinism = getattr(result, "determinism", None)
    if determinism and determinism.get("differing"):
        line += (f"; determinism (not part of the verdict): {determinism['differing']} of {determinism['checked']} "
                 f"seeded rows gave other tokens in another batch")
    return line if exit_code is None else f"{line}: exit {exit_code}"


def _unreached(result: Any) -> list:
    """The serving conditions the engine did not show reached (each keeps the verdict from PASS)."""
    return [c for c in getattr(result, "conditions", ()) or () if c.get("reached") is not True]


def reference_sample_line(sample: dict) -> str:
    """What the reference's sample of an audit that runs until its power can exclude.

    >>> reference_sample_line({"jobs": 60, "of_jobs": 91, "tokens": 5000, "engine_tokens_paired": 5088,
    ...                        "min_detectable_tv": 0.0712})
    "reference: 5000 tokens on 60 of 91 calls; its own tests detect the scorer's law departing from the reference's by TV >= 0.0712 (less goes unseen); the two-sample tests compare the engine's 5088 tokens of those calls"
    """
    return (f"reference: {sample['tokens']} tokens on {sample['jobs']} of {sample['of_jobs']} calls; its own tests "
            f"detect the scorer's law departing from the reference's by TV >= {_num(sample['min_detectable_tv'])} "
            f"(less goes unseen); the two-sample tests compare the engine's {sample['engine_tokens_paired']} tokens "
            f"of those calls")


def condition_line(condition: dict) -> str:
    """One serving condition in words: its status, tokens and jobs, what it reached, its stratum's p-value.

    >>> condition_line({"name": "preemption", "status": "NOT REACHED", "tokens": 384, "jobs": 2,
    ...                 "how": "no preemption happened (the engine reported 0 preemptions)", "pvalue_adjusted": 1.0})
    'condition preemption: NOT REACHED: 384 tokens in 2 jobs; no preemption happened (the engine reported 0 preemptions); p = 1 (Holm-adjusted)'
    """
    p = condition.get("pvalue_adjusted")
    tested = f"p = {_p(p)} (Holm-adjusted)" if p is not None else "its stratum untested (too few tokens)"
    return (f"condition {condition['name']}: {condition['status']}: {_count(condition['tokens'], 'token')} in "
            f"{_count(condition['jobs'], 'job')}; {condition['how']}; {tested}")


def _fails(result: Any, fail_on_inconclusive: bool) -> bool:
    if getattr(result, "incomplete", False):
        return True
    return result.verdict in ("FINDING", "ERROR") or (fail_on_inconclusive and result.verdict == "INCONCLUSIVE")


def detail_lines(result: Any, limit: int = 5) -> list:
    """The lines under the verdict line: how it was decided, the rejected tests, decisive tokens, failures."""
    lines = [] if result.num_jobs == 0 else [  # with no job scored nothing was decided
        f"decided by: {result.decided_by} ({len(result.subtests)} tests, Holm; stop: {result.stop_reason}); "
        f"TV lower bound {_num(result.tv_lower)}; min detectable TV {_num(result.min_detectable_tv)} "
        f"(planned {_num(result.requested_tv)})"]
    plan = getattr(result, "power_plan", None)
    if plan is not None and result.num_jobs:
        lines.append(f"rounds until the power: {power_plan_text(plan)}")
    sample = getattr(result, "reference_sample", None)
    if sample is not None and result.num_jobs:
        lines.append(reference_sample_line(sample))
    for condition in getattr(result, "conditions", ()) or ():
        lines.append(condition_line(condition))
    rejected = sorted((t for t in result.subtests if t.pvalue_adjusted is not None and t.pvalue_adjusted <= result.alpha),
                      key=lambda t: t.pvalue_adjusted)
    for test in rejected[:limit]:
        lines.append(f"rejected: {test.name}: p = {_p(test.pvalue_adjusted)} (Holm-adjusted): {test.detail}")
    if len(rejected) > limit:
        lines.append(f"rejected: {len(rejected) - limit} more tests")
    zero = [z for z in result.zero_mass if not z.numerics]
    for z in zero[:limit]:
        margin = "" if z.margin is None else f", {z.margin:.3g} logits below the kept tokens"
        lines.append(f"zero-mass token: {z.token} at position {z.position} of prompt {z.prompt} (arm {z.arm}, job "
                     f"{z.job}, row {z.row}){margin}")
    for item in list(result.after_eos)[:limit]:
        lines.append(f"past end-of-sequence: job {item.get('job')}, row {item.get('row')}: the end-of-sequence token "
                     f"at position {item.get('position')} is not the last")
    for d in [d for d in result.divergences if not d.numerics][:limit]:
        lines.append(f"greedy divergence: prompt {d.prompt} at position {d.position} (arm {d.arm}): engine "
                     f"{d.engine_token}, reference {d.reference_token}, margin {_num(d.margin)}")
    failed = _num_failed(result)
    if failed:
        allowed = getattr(result, "allowed_failed_calls", 0)
        stand = ("within the allowance: the verdict is the tests'" if failed <= allowed else
                 "more than allowed: the gate fails" + (" (the finding stands)" if result.verdict == "FINDING" else ""))
        lines.append(f"failed calls: {failed} of {result.num_jobs + failed} (allowed {allowed}): {stand}; "
                     f"tracebacks: {TRACEBACKS_AT}")
    for failure in list(result.failures)[:limit]:
        lines.append(f"failed job: {failure}")
    if result.verdict == "INCONCLUSIVE" and not result.min_detectable_tv <= result.requested_tv * (1 + 1e-9):
        lines.append("nothing rejected, but too few tokens for the planned power: raise max_new_tokens, rounds or "
                     "the prompts, or plan a larger min_detectable_tv")
    if result.verdict == "INCONCLUSIVE" and _unreached(result):
        lines.append("nothing rejected, but a serving condition was not shown reached: its tokens did not test the "
                     "state it names (the engine's counters, GenerationOutput.stats, must show it)")
    if getattr(result, "incomplete", False):
        lines.append("INCOMPLETE: the audit was interrupted; the result covers the jobs that finished")
    return lines


def failure_text(result: Any, fail_on_inconclusive: bool = False) -> Optional[str]:
    """Why ``result`` fails an assertion (the verdict line, the deciding test, the evidence), or None when it passes.

    FINDING, ERROR and an incomplete result fail; INCONCLUSIVE fails only with ``fail_on_inconclusive``.
    """
    if not _fails(result, fail_on_inconclusive):
        return None
    return "spectr-audit generation audit: " + verdict_line(result) + "".join(
        "\n  " + line for line in detail_lines(result))


def status_of(result: Any, fail_on_inconclusive: bool = False) -> int:
    """The exit code of one audit: 0 PASS (and INCONCLUSIVE without the flag), 1 FINDING, 3 INCONCLUSIVE
    with the flag, 4 ERROR (:data:`~spectr_audit.results.EXIT_ERROR`: no job could be scored, or more engine
    calls failed than allowed), 130 incomplete (interrupted)."""
    if getattr(result, "incomplete", False):
        return 130
    if result.verdict == "FINDING":
        return 1
    if result.verdict == "ERROR":
        return EXIT_ERROR
    if result.verdict == "INCONCLUSIVE" and fail_on_inconclusive:
        return EXIT_INCONCLUSIVE
    return 0


def result_json(result: Any) -> str:
    """The result as JSON text: the generation report's JSON when :mod:`spectr_audit.reports.generation` has it,
    else ``result.to_dict()`` with the version and kind."""
    module = _generation_reports()
    if module is not None and hasattr(module, "render_generation_json"):
        return module.render_generation_json(result).rstrip("\n")
    if module is not None and hasattr(module, "generation_json"):
        data = module.generation_json(result)
        return data if isinstance(data, str) else json.dumps(data, indent=2)
    return json.dumps({"spectr_audit_version": __version__, "kind": "generation-audit", **result.to_dict()}, indent=2)


def _generation_reports():
    """:mod:`spectr_audit.reports.generation` when it is installed (None otherwise)."""
    import importlib
    import importlib.util

    try:
        if importlib.util.find_spec("spectr_audit.reports.generation") is None:
            return None
    except (ImportError, ValueError):
        return None
    return importlib.import_module("spectr_audit.reports.generation")


def write_reports(result: Any, out: Union[str, Path]) -> list:
    """Write the result's reports into the folder ``out`` (report.json, and .md, .html, JUnit where
    :mod:`spectr_audit.reports.generation` writes them); returns the paths written."""
    out = Path(out)
    module = _generation_reports()
    if module is not None:
        # write_generation_report returns {format: path written}
        return [Path(path) for path in module.write_generation_report(result, out).values()]
    return [write_text_atomic(out / "report.json", result_json(result) + "\n")]
