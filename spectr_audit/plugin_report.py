"""The pytest plugin's reporting: the terminal summary, the hand-over of a pytest-xdist worker's
audits to the controller, and the session's report files (``--spectr-report``).

:mod:`spectr_audit.plugin` imports this module at pytest start, so it is as light as the plugin:
pytest, the standard library and :mod:`spectr_audit.run.gate`; the result classes and the report
writers are imported when a session has audits to write.
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from typing import Any

import pytest

from spectr_audit.plugin_options import (
    GENERATION_RECORDS,
    RECORDS,
    SETTINGS,
    WORKER_GENERATION_KEY,
    WORKER_KEY,
    GenerationRecord,
    Record,
    Settings,
)
from spectr_audit.run.gate import evaluate_gate


def _numbers(m: dict) -> str:
    """A result's numbers: the exact TV, or the sampled TV estimate with its interval and the power reached."""
    if m.get("tv_estimate") is not None or m.get("tv_upper") is not None:
        tv = (f"tv>={_fmt(m.get('tv_lower'))} (est {_fmt(m.get('tv_estimate'))}, <={_fmt(m.get('tv_upper'))}) "
              f"mdtv={_fmt(m.get('min_detectable_tv'))}/{_fmt(m.get('requested_tv'))}")
    else:
        tv = f"tv={_fmt(m.get('tv_distance'))}"
    acceptance = _fmt(m.get("acceptance"))
    ratio = _fmt(m.get("acceptance_ratio"))
    ci = m.get("acceptance_ci")
    if not (isinstance(ci, (list, tuple)) and len(ci) == 2) and "acceptance_ci_low" in m:
        ci = (m.get("acceptance_ci_low"), m.get("acceptance_ci_high"))
    if isinstance(ci, (list, tuple)) and len(ci) == 2 and all(_fmt(v) != "-" for v in ci):
        # a sampled acceptance: its interval, and the ratio's (a sampled ratio above 1 may be noise)
        acceptance += f" [{_fmt(ci[0])}, {_fmt(ci[1])}]"
        optimum = m.get("optimal_acceptance")
        if ratio != "-" and _fmt(optimum) != "-" and optimum > 0:
            ratio += f" [{_fmt(ci[0] / optimum)}, {_fmt(ci[1] / optimum)}]"
    pvalue = f"p={_fmt(m.get('pvalue'))}"
    if _fmt(m.get("pvalue")) != "-" and _fmt(m.get("alpha")) != "-":
        pvalue += f" (alpha {_fmt(m.get('alpha'))})"
    drawn = f" n={m['num_samples']}" if _fmt(m.get("num_samples")) != "-" else ""
    return (f"{tv} {pvalue}{drawn} acc={acceptance} acc/alpha*={ratio} "
            f"block_eff={_fmt(m.get('block_efficiency'))}")


def _session_header(settings: Settings, results: list) -> list:
    """The summary's first lines: the settings, with the samples the audits drew and the levels they ran at."""
    gate = ", ".join(str(t) for t in settings.thresholds) or "none"
    budget = "" if settings.max_seconds is None else f", max {settings.max_seconds:g} s of sampling per audit"
    certify = "" if settings.certify_tv is None else f", certify TV <= {settings.certify_tv:g}"
    drawn = sorted({int(r.metrics["num_samples"]) for r in results if _fmt(r.metrics.get("num_samples")) != "-"})
    drawn_text = "" if not drawn else (
        f"; drawn: {drawn[0]}" if len(drawn) == 1 else f"; drawn: {drawn[0]} to {drawn[-1]}") + " per audit (n= below)"
    levels = sorted({float(r.metrics["alpha"]) for r in results if _fmt(r.metrics.get("alpha")) != "-"})
    alpha_text = f"alpha {settings.alpha:g} per check"
    if levels and any(not math.isclose(level, settings.alpha) for level in levels):
        alpha_text += (", split over the check's statistical tests (Bonferroni): each audit ran at "
                       + " or ".join(f"{level:g} = {settings.alpha:g} / {round(settings.alpha / level)}"
                                     for level in levels))
    return [f"seed {settings.seed}{certify}, gate: {gate}",
            f"samples: at most {settings.num_samples} per statistical audit's main design, each drawing what its "
            f"power plan needs up to that (a stratified design adds as many){budget}{drawn_text}",
            alpha_text]


def _markup(verdict: str, settings: Settings) -> dict:
    if verdict in ("ERROR", "FINDING", "GATE"):
        return {"red": True}
    if verdict == "INCONCLUSIVE":
        return {"red": True} if settings.fail_on_inconclusive or settings.certify_tv is not None else {"yellow": True}
    return {"green": True}


def _fmt(value: Any) -> str:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return "-"
    if isinstance(value, int):
        return str(value)
    return f"{value:.3g}"


def _generation_summary(terminalreporter: Any, settings: Settings, records: list) -> None:
    """The generation audits' lines: verdict, engine, deciding test, p-value, tokens, power, TV bound."""
    terminalreporter.write_line(f"generation audits (seed {settings.seed} unless a test set its own):")
    counts: dict = {}
    for record in records:
        r = record.result
        verdict = r["verdict"] + ("/INCOMPLETE" if r.get("incomplete") else "")
        counts[verdict] = counts.get(verdict, 0) + 1
        terminalreporter.write_line(
            f"{verdict:<12} {r['generator']} against {r['scorer']}: test {r['test']!r} p={_fmt(r.get('pvalue'))} "
            f"(alpha {_fmt(r.get('alpha'))}) n={r.get('num_tokens')} tokens mdtv={_fmt(r.get('min_detectable_tv'))}/"
            f"{_fmt(r.get('requested_tv'))} tv>={_fmt(r.get('tv_lower'))}  [{record.nodeid}]",
            **_markup("ERROR" if r.get("incomplete") else r["verdict"], settings))
    terminalreporter.write_line("generation verdicts: " + ", ".join(f"{n} {v}" for v, n in sorted(counts.items())))


def pytest_terminal_summary(terminalreporter: Any, exitstatus: int, config: pytest.Config) -> None:
    records = config.stash.get(RECORDS, [])
    generation = config.stash.get(GENERATION_RECORDS, [])
    if not records and not generation:
        return
    settings = config.stash[SETTINGS]
    terminalreporter.section("spectr-audit")
    if not records:
        _generation_summary(terminalreporter, settings, generation)
        if settings.report is not None:
            terminalreporter.write_line(f"spectr-audit generation report: {_generation_report_path(settings.report)}")
        return
    for line in _session_header(settings, [r.result for r in records]):
        terminalreporter.write_line(line)
    counts: dict = {}
    for record in records:
        result = record.result
        if result.error is not None:
            verdict = "ERROR"
        elif not result.as_expected:
            verdict = "FINDING"
        elif record.gate_violations:
            verdict = "GATE"
        elif result.inconclusive:
            verdict = "INCONCLUSIVE"
        elif result.verdict == "CERTIFIED":
            verdict = "CERTIFIED"
        else:
            verdict = result.verdict_label if result.passed else "inexact (declared)"  # exact, PASS (sampled)
        counts[verdict] = counts.get(verdict, 0) + 1
        terminalreporter.write_line(
            f"{verdict:<12} {result.verifier} on {result.case}: {_numbers(result.metrics)}  [{record.nodeid}]",
            **_markup(verdict, settings))
    terminalreporter.write_line("verdicts: " + ", ".join(f"{n} {v}" for v, n in sorted(counts.items())))
    gate = _session_gate(config)
    if gate is not None and gate.unmeasured:
        for threshold in gate.unmeasured:
            terminalreporter.write_line(
                f"GATE     {threshold.source or threshold}: no audit of this session measured {threshold.metric!r}, "
                "so the threshold checked nothing (the session fails)", red=True)
    if generation:
        _generation_summary(terminalreporter, settings, generation)
    if settings.report is not None:
        terminalreporter.write_line(f"spectr-audit report: {settings.report}")
        if generation:
            terminalreporter.write_line(f"spectr-audit generation report: {_generation_report_path(settings.report)}")


def _generation_report_path(report: Path) -> Path:
    """Where the session's generation audits go: ``<report stem>.generation.json`` beside ``--spectr-report``."""
    return report.with_name(f"{report.stem}.generation.json")


def _session_gate(config: pytest.Config) -> Any:
    settings = config.stash.get(SETTINGS, None)
    records = config.stash.get(RECORDS, [])
    if settings is None or not settings.thresholds or not records:
        return None
    return evaluate_gate([r.result for r in records], settings.thresholds)


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node: Any, error: Any) -> None:
    """pytest-xdist, on the controller: collect a finished worker's audits."""
    config = node.config
    settings = config.stash.get(SETTINGS, None)
    output = getattr(node, "workeroutput", None) or {}
    sent = output.get(WORKER_KEY)
    if settings is not None:
        config.stash.setdefault(GENERATION_RECORDS, []).extend(
            GenerationRecord(item["nodeid"], item["result"], item["line"]) for item in output.get(WORKER_GENERATION_KEY)
            or [])
    if settings is None or not sent:
        return
    from spectr_audit.results import AuditResult

    records = config.stash.setdefault(RECORDS, [])
    for item in sent:
        result = AuditResult.from_dict(item["result"])
        violations = tuple(evaluate_gate([result], settings.thresholds).violations) if settings.thresholds else ()
        records.append(Record(item["nodeid"], result, violations))


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    config = session.config
    settings = config.stash.get(SETTINGS, None)
    records = config.stash.get(RECORDS, [])
    workeroutput = getattr(config, "workeroutput", None)
    if workeroutput is not None:
        # An xdist worker: the controller prints the summary, runs the session gate and writes the report.
        workeroutput[WORKER_KEY] = [{"nodeid": r.nodeid, "result": r.result.to_dict()} for r in records]
        workeroutput[WORKER_GENERATION_KEY] = [dataclasses.asdict(r) for r in config.stash.get(GENERATION_RECORDS, [])]
        return
    generation = config.stash.get(GENERATION_RECORDS, [])
    if settings is not None and settings.report is not None and generation:
        import json

        from spectr_audit import __version__
        from spectr_audit._files import write_text_atomic

        data = {"spectr_audit_version": __version__, "kind": "generation-audits", "seed": settings.seed,
                "results": [{"nodeid": r.nodeid, "line": r.line, **r.result} for r in generation]}
        write_text_atomic(_generation_report_path(settings.report), json.dumps(data, indent=2) + "\n")
    gate = _session_gate(config)
    if gate is not None and gate.unmeasured and session.exitstatus == pytest.ExitCode.OK:
        # Like coverage's --fail-under: a gate that checked nothing must not pass silently.
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
    if settings is None or settings.report is None or not records:
        return
    from spectr_audit.results import AuditReport

    report = AuditReport(results=tuple(r.result for r in records), suite="pytest",
                         meta={"seed": settings.seed, "num_audits": len(records),
                               **({"gate": gate.to_dict()} if gate is not None else {})})
    path = settings.report
    path.parent.mkdir(parents=True, exist_ok=True)
    suffix = path.suffix.lower()
    if suffix in (".html", ".htm"):
        from spectr_audit.reports.html import write_html

        write_html(report, path, gate)
    elif suffix == ".md":
        from spectr_audit.reports.markdown import write_markdown

        write_markdown(report, path)
    elif suffix == ".xml":
        from spectr_audit.reports.junit import write_junit

        write_junit(report, path, gate)
    else:
        from spectr_audit.reports.json_report import write_json

        write_json(report, path)
