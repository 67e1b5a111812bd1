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
from spectr_audit.results import error_origin
from spectr_audit.run.output import check_out, clear_earlier_run, write_manifest
from spectr_audit.run.plan import plan_run
from spectr_audit.run.runner import AuditOptions, run_suite, select_verifiers
from spectr_audit.run.suite import load_suite

__all__ = ["command"]


def _run_real_lm(args, out: Path):
    """``run --suite real-lm``: SmolLM2-135M with a layer-skipping self-speculative draft."""
    if args.verifier:
        raise _UsageError("--verifier: the real-lm suite runs its own verifier grid; drop --verifier")
    if args.num_drafts is not None or args.draft_len is not None:
        raise _UsageError("--num-drafts, --draft-len: the real-lm suite runs its own (K, L) grid; drop them")
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
    options = AuditOptions(seed=args.seed, alpha=args.alpha, max_samples=args.max_samples,
                           max_seconds=args.max_seconds, certify_tv=args.certify_tv, device=args.device,
                           max_memory=args.max_memory, verifier_timeout=args.verifier_timeout or None)
    selection = {"num_drafts": args.num_drafts, "draft_len": args.draft_len}
    plan = plan_run(suite, verifiers, options, **selection)
    if not plan.jobs and not plan.unloadable:  # (a verifier that cannot be loaded is an error result)
        names = ", ".join(repr(v.name) for v in verifiers or ())
        raise _UsageError(f"--num-drafts, --draft-len: no case of suite {suite.name!r} fits "
                          f"{'verifier ' + names if names else 'the verifiers'}: "
                          + "; ".join(line.strip() for line in plan.lines()[1:2])
                          + " (select cases the suite has and the verifier supports)")
    if _output._RANK == 0:
        print("\n".join(plan.lines()), file=sys.stderr)
    # run_suite calls progress.start once every job passed the memory budget, before the first
    # audit: the earlier run's reports go then (a refused run leaves them alone).
    progress = _Progress(args.progress, on_start=lambda: _clear(out))
    try:
        return run_suite(suite, verifiers, options, progress=progress, **selection), None
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


#: Error results printed one per line before the rest are counted.
_ERRORS_LISTED = 5


def _print_summary(args, report, gate, paths: list, seconds: float, fail_on_inconclusive: bool) -> None:
    """The run's verdict line (findings, errors and inconclusive results counted apart), the errors with
    their last line and where they were raised, the findings not as expected, the inconclusive results, and
    the reports written."""
    inconclusive = report.inconclusive
    certified = [r for r in report.results if r.verdict == "CERTIFIED"]
    gate_failed = gate is not None and not gate.passed
    failed = not report.passed or gate_failed or (fail_on_inconclusive and inconclusive)
    verdict = ("ERROR" if report.errors and not report.findings and not gate_failed else "FAIL") if failed else (
        "INCONCLUSIVE" if inconclusive else "PASS")
    certified_text = f" ({len(certified)} certified)" if getattr(args, "certify_tv", None) else ""
    gate_text = "" if gate is None else f"; gate {'held' if gate.passed else 'FAILED'}"
    print(f"spectr-audit: suite {report.suite!r}: {len(report.results)} audits in {seconds:.1f}s: "
          f"{report.outcome_text()}{certified_text}{gate_text} -> {verdict}" + _power_text(report))
    errors = report.errors
    for r in errors[:_ERRORS_LISTED]:
        last = (r.error or "").strip().splitlines()[-1] if (r.error or "").strip() else "error"
        where = error_origin(r)
        print(f"  error: {r.verifier} on {r.case}: {last}" + (f" (raised at {where})" if where else ""))
    if len(errors) > _ERRORS_LISTED:
        print(f"  ... and {len(errors) - _ERRORS_LISTED} more errors")
    if errors:
        json_path = next((p for p in paths if str(p).endswith(".json")), None)
        where = f" in {json_path}" if json_path else " in the JSON report"
        print(f"  errors are not findings: the audit could not run; each traceback is under results[].details."
              f"traceback{where}")
    for r in report.findings:
        print(f"  not as expected: {r.verifier} on {r.case}: "
              + (", ".join(c.name for c in r.failed_checks) or "declared inexact, but every check held"))
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
