"""``spectr-audit run``: audit verifiers on a suite (or the real-LM suite) and write the reports."""

from __future__ import annotations

import dataclasses
import sys
import time
from pathlib import Path

from spectr_audit._files import write_text_atomic
from spectr_audit.cli import _output
from spectr_audit.cli._args import REAL_LM_SUITE, _check_suite_name, _sampling_overrides, _UsageError
from spectr_audit.cli._output import _Progress
from spectr_audit.lm.real_suite import RealLMOptions, run_real_lm_suite
from spectr_audit.lm.smollm import LMUnavailable
from spectr_audit.reports.figures import real_lm_power_summary
from spectr_audit.reports.html import write_html
from spectr_audit.reports.json_report import render_json, write_json
from spectr_audit.reports.junit import write_junit
from spectr_audit.reports.markdown import render_real_lm_markdown, write_markdown
from spectr_audit.run.gate import evaluate_gate
from spectr_audit.run.incomplete import RunAborted, RunInterrupted, incomplete_text
from spectr_audit.run.output import check_out, clear_earlier_run, write_manifest
from spectr_audit.run.runner import AuditOptions, run_suite, select_verifiers
from spectr_audit.run.suite import load_suite

__all__ = ["command"]


def _run_real_lm(args, out: Path):
    """``run --suite real-lm``: SmolLM2-135M with a layer-skipping self-speculative draft."""
    if args.verifier:
        raise _UsageError("--verifier: the real-lm suite runs its own verifier grid; drop --verifier")
    options = RealLMOptions.quick(seed=args.seed) if args.quick else RealLMOptions(seed=args.seed)
    try:
        report = run_real_lm_suite(options, progress=lambda line: print(f"  {line}", file=sys.stderr))
    except LMUnavailable as exc:
        raise _UsageError(str(exc)) from None
    except RunInterrupted as exc:  # the tables of what finished, then the caller writes the reports
        write_text_atomic(out / "real-lm-tables.md", render_real_lm_markdown(exc.report.meta["real_lm"]))
        raise
    write_text_atomic(out / "real-lm-tables.md", render_real_lm_markdown(report.meta["real_lm"]))
    return report


def _power_text(report) -> str:
    """What a passing real-LM run could have detected (its tests refute exactness, never prove it)."""
    if not isinstance(report.meta.get("real_lm"), dict):
        return ""
    summary = real_lm_power_summary(report.meta["real_lm"])
    return "" if summary is None else f"; {summary}"


def command(args) -> int:
    """Run ``spectr-audit run``; its exit code."""
    out = check_out(args.out) if _output._RANK == 0 else Path(args.out)
    if args.junit:
        check_out(Path(args.junit).parent, "--junit")
        if Path(args.junit).is_dir():
            raise _UsageError(f"--junit: {args.junit!r} is a folder; give the path of the XML file to write")
    start = time.perf_counter()
    report, stopped = _run_audits(args, out)
    thresholds = args.gate or []
    gate = evaluate_gate(report.results, thresholds) if thresholds else None
    if gate is not None:
        report = dataclasses.replace(report, meta={**report.meta, "gate": gate.to_dict()})
    paths = _write_reports(args, out, report, gate, complete=stopped is None)
    if stopped is not None:
        where = f"; the finished results are in {', '.join(str(p) for p in paths)}" if paths else ""
        print(f"spectr-audit run: {stopped[1]}: {incomplete_text(report)}{where}", file=sys.stderr)
        return stopped[0]
    gate_failed = gate is not None and not gate.passed
    fail_on_inconclusive = bool(getattr(args, "fail_on_inconclusive", False) or getattr(args, "certify_tv", None))
    if args.json:
        print(render_json(report))
    else:
        _print_summary(args, report, gate, paths, time.perf_counter() - start, fail_on_inconclusive)
    if gate_failed:
        print(f"spectr-audit run: {gate.message()}", file=sys.stderr)
        return 1
    return report.exit_status(fail_on_inconclusive)


def _run_audits(args, out: Path):
    """The run's report, and ``(exit code, message)`` when it stopped early (None when it ran through)."""
    sampling = _sampling_overrides(args)
    if args.suite == REAL_LM_SUITE and sampling:
        raise _UsageError(f"--{'/--'.join(k.replace('_', '-') for k in sampling)}: the real-lm suite runs its own "
                          "sampling grid; drop them")
    if args.suite == REAL_LM_SUITE:
        _clear(out)
        try:
            return _run_real_lm(args, out), None
        except RunInterrupted as exc:
            return exc.report, (130, "interrupted (Ctrl-C)")
    _check_suite_name(args.suite)
    suite = load_suite(args.suite, max_memory=args.max_memory, sampling=sampling or None)
    if suite.generation:
        where = f"spectr-audit generation --suite {args.suite}"
        if not suite.cases:
            raise _UsageError(f"--suite: suite {suite.name!r} holds generation audits only ([[generation]] "
                              f"cases); run them with: {where}")
        print(f"spectr-audit run: suite {suite.name!r}: its {len(suite.generation)} [[generation]] cases are not "
              f"run here; run them with: {where}", file=sys.stderr)
    verifiers = select_verifiers(args.verifier)
    # run_suite calls progress.start once every job passed the memory budget, before the first
    # audit: the earlier run's reports go then (a refused run leaves them alone).
    progress = _Progress(args.progress, on_start=lambda: _clear(out))
    options = AuditOptions(seed=args.seed, alpha=args.alpha, max_samples=args.max_samples,
                           max_seconds=args.max_seconds, certify_tv=args.certify_tv, device=args.device,
                           max_memory=args.max_memory, verifier_timeout=args.verifier_timeout or None)
    try:
        return run_suite(suite, verifiers, options, progress=progress), None
    except RunInterrupted as exc:
        return exc.report, (130, "interrupted (Ctrl-C)")
    except RunAborted as exc:
        return exc.report, (2, f"error: {type(exc.cause).__name__}: {exc.cause}")
    finally:
        progress.close()


def _write_reports(args, out: Path, report, gate, complete: bool) -> list:
    """Write report.json, report.md and the asked-for HTML and JUnit reports, then the manifest (the first
    process only, under torchrun: the others hold the same report); their paths."""
    if _output._RANK != 0:
        return []
    paths = [write_json(report, out / "report.json"), write_markdown(report, out / "report.md")]
    if args.html:
        paths.append(write_html(report, out / "report.html", gate))
    if args.junit:
        paths.append(write_junit(report, Path(args.junit), gate))
    write_manifest(out, paths, complete=complete)
    return paths


def _print_summary(args, report, gate, paths: list, seconds: float, fail_on_inconclusive: bool) -> None:
    """The run's verdict line, the results not as expected and the inconclusive ones, and the reports written."""
    unexpected = [r for r in report.results if not r.as_expected]
    findings = [r for r in report.results if not r.passed]
    inconclusive = report.inconclusive
    certified = [r for r in report.results if r.verdict == "CERTIFIED"]
    gate_failed = gate is not None and not gate.passed
    failed = not report.passed or gate_failed or (fail_on_inconclusive and inconclusive)
    verdict = "FAIL" if failed else ("INCONCLUSIVE" if inconclusive else "PASS")
    gate_text = "" if gate is None else f", gate {'held' if gate.passed else 'FAILED'}"
    certified_text = f", {len(certified)} certified" if getattr(args, "certify_tv", None) else ""
    print(
        f"spectr-audit: suite {report.suite!r}: {len(report.results)} audits in {seconds:.1f}s, "
        f"{len(findings)} with findings, {len(inconclusive)} inconclusive{certified_text}, "
        f"{len(unexpected)} not as expected{gate_text} -> {verdict}"
        + _power_text(report)
    )
    for r in unexpected:
        print(f"  unexpected: {r.verifier} on {r.case}: " + (r.error or ", ".join(c.name for c in r.failed_checks)))
    for r in inconclusive:
        print(f"  inconclusive: {r.verifier} on {r.case}: " + "; ".join(c.detail for c in r.checks if c.inconclusive))
    if paths:
        print(f"reports: {', '.join(str(p) for p in paths)}")


def _clear(out: Path) -> None:
    """Remove an earlier run's report files from ``out`` (said on stderr) before this run's first audit."""
    if _output._RANK != 0:
        return
    removed = clear_earlier_run(out)
    if removed:
        print(f"spectr-audit run: removed the report files of an earlier run from {str(out)!r}: "
              f"{', '.join(p.name for p in removed)}", file=sys.stderr)
