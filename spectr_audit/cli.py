"""Command line: ``spectr-audit run | audit | bound | list``.

Exit codes: 0 every verdict as expected, 1 findings, 2 usage or input error.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path
from typing import Optional, Sequence

from spectr_audit import defaults

__all__ = ["main", "build_parser", "parse_model_spec"]


class _UsageError(Exception):
    pass


def parse_model_spec(text: str, argument: str):
    """Parse ``0.6,0.4`` or ``markov:vocab_size=3,seed=1`` / ``dirichlet:vocab_size=8,seed=2`` into a model."""
    from spectr_audit.run.suite import model_from_spec

    text = text.strip()
    if ":" in text:
        kind, _, rest = text.partition(":")
        params: dict = {}
        for item in filter(None, (s.strip() for s in rest.split(","))):
            key, sep, value = item.partition("=")
            if not sep:
                raise _UsageError(f"{argument}: expected key=value in {item!r} (from {text!r})")
            try:
                params[key.strip()] = int(value)
            except ValueError:
                try:
                    params[key.strip()] = float(value)
                except ValueError:
                    raise _UsageError(f"{argument}: {key}={value!r} is not a number") from None
        return model_from_spec({kind.strip(): params}, argument)
    try:
        values = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise _UsageError(
            f"{argument}: expected comma-separated probabilities (e.g. 0.6,0.4) or kind:key=value,... "
            f"(markov:vocab_size=3,seed=1 or dirichlet:vocab_size=8,seed=2), got {text!r}"
        ) from None
    return model_from_spec(values, argument)


def _probability(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number in (0, 1), got {text!r}") from None
    if not 0 < value < 1:
        raise argparse.ArgumentTypeError(f"expected a number in (0, 1), got {text!r}")
    return value


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


def _add_common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--seed", type=int, default=defaults.SEED, help=f"seed of every random draw (default {defaults.SEED})")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="spectr-audit",
        description="Audit speculative-decoding verifiers: exactness, acceptance against the optimum.",
    )
    sub = parser.add_subparsers(dest="command", required=True)

    run = sub.add_parser("run", help="audit verifiers on a suite and write reports")
    run.add_argument("--suite", default="default", help="built-in suite name or path to a suite .toml (default: default)")
    run.add_argument("--verifier", action="append", default=[], metavar="NAME_OR_IMPORT",
                     help="a built-in short name, package.module:attr or path/file.py:attr (repeatable; default: all built-ins)")
    run.add_argument("--out", default="spectr-audit-report", help="output directory (default ./spectr-audit-report)")
    run.add_argument("--json", action="store_true", help="print the JSON report to stdout")
    run.add_argument("--quick", action="store_true", help="real-lm suite only: a small preset (a minute or so)")
    run.add_argument("--html", action="store_true",
                     help="also write report.html (self-contained, with figures) to the output directory")
    run.add_argument("--junit", metavar="PATH", default=None, help="also write a JUnit XML report to PATH")
    run.add_argument("--alpha", type=_probability, default=defaults.ALPHA, metavar="ALPHA",
                     help=f"false-alarm rate of each statistical audit (default {defaults.ALPHA:g})")
    run.add_argument("--max-samples", type=_positive_int, default=None, metavar="N",
                     help="sample budget of each statistical audit (default: planned by power analysis)")
    run.add_argument("--progress", choices=("auto", "bar", "lines", "none"), default="auto",
                     help="progress on stderr: a bar (rich), one line per audit, or nothing; auto: a bar on a "
                     "terminal, lines otherwise")
    gate = run.add_argument_group(
        "gate", "fail the run (exit 1) when a result breaks a threshold, in the style of coverage.py's --fail-under; "
        "each threshold applies to every result that measured its metric, and one that no result measured fails")
    from spectr_audit.run.gate import add_gate_arguments

    add_gate_arguments(gate.add_argument)
    _add_common(run)

    audit = sub.add_parser("audit", help="audit one verifier on one case")
    audit.add_argument("--verifier", required=True, metavar="NAME_OR_IMPORT")
    audit.add_argument("--draft", required=True, help="draft distribution: 0.6,0.4 | markov:vocab_size=3,seed=1 | dirichlet:vocab_size=8,seed=1")
    audit.add_argument("--target", required=True, help="target distribution, same forms as --draft")
    audit.add_argument("--num-drafts", type=int, required=True)
    audit.add_argument("--draft-len", type=int, default=1)
    audit.add_argument("--prefix", default="", help="context tokens before the step, comma-separated")
    audit.add_argument("--json", action="store_true")
    _add_common(audit)

    bound = sub.add_parser("bound", help="optimal multi-draft acceptance alpha* (closed form, and LP when small)")
    bound.add_argument("--draft", required=True)
    bound.add_argument("--target", required=True)
    bound.add_argument("--num-drafts", type=int, required=True)
    bound.add_argument("--json", action="store_true")

    lst = sub.add_parser("list", help="list the registered verifiers (every namespace) and the suites")
    lst.add_argument("--json", action="store_true")
    return parser


def _print_result_text(result) -> None:
    status = "ERROR" if result.error else ("exact" if result.passed else "FINDING")
    print(f"{result.verifier} on {result.case}: {status}")
    if result.error:
        print(f"  error: {result.error}")
    for c in result.checks:
        mark = "ok  " if c.passed else "FAIL"
        print(f"  [{mark}] {c.name}: value={c.value} threshold={c.threshold}")
    for key, value in result.metrics.items():
        print(f"  {key} = {value}")


class _Progress:
    """Progress on stderr: a rich bar, one line per audit, or nothing."""

    def __init__(self, mode: str):
        if mode == "auto":
            mode = "bar" if sys.stderr.isatty() else "lines"
        self.mode = mode
        self._bar = None
        self._task = None
        self._started = False

    def start(self, total: int) -> None:
        """Called by ``run_suite`` with the number of audits it will make."""
        if self.mode == "bar":
            from rich.console import Console
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

            self._bar = Progress(TextColumn("[bold]auditing"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                                 TextColumn("{task.description}"), console=Console(stderr=True), transient=True)
            self._task = self._bar.add_task("", total=total)
            self._bar.start()

    def __call__(self, verifier: str, case: str) -> None:
        if self.mode == "lines":
            print(f"  auditing {verifier} on {case}", file=sys.stderr)
        elif self._bar is not None:
            # Called before each audit: the previous one is done.
            self._bar.update(self._task, advance=1 if self._started else 0, description=f"{verifier} on {case}")
            self._started = True

    def close(self) -> None:
        if self._bar is not None:
            self._bar.stop()


#: The real-language-model suite: not a TOML file but SmolLM2-135M in the loop (an optional extra).
REAL_LM_SUITE = "real-lm"


def _run_real_lm(args, out: Path):
    """``run --suite real-lm``: SmolLM2-135M with a layer-skipping self-speculative draft."""
    from spectr_audit.lm.real_suite import RealLMOptions, run_real_lm_suite
    from spectr_audit.lm.smollm import LMUnavailable

    if args.verifier:
        raise _UsageError("--verifier: the real-lm suite runs its own verifier grid; drop --verifier")
    options = RealLMOptions.quick(seed=args.seed) if args.quick else RealLMOptions(seed=args.seed)
    from spectr_audit.reports.markdown import render_real_lm_markdown

    try:
        report = run_real_lm_suite(options, progress=lambda line: print(f"  {line}", file=sys.stderr))
    except LMUnavailable as exc:
        raise _UsageError(str(exc)) from None
    out.mkdir(parents=True, exist_ok=True)
    (out / "real-lm-tables.md").write_text(render_real_lm_markdown(report.meta["real_lm"]))
    return report


def _power_text(report) -> str:
    """What a passing real-LM run could have detected (its tests refute exactness, never prove it)."""
    if not isinstance(report.meta.get("real_lm"), dict):
        return ""
    from spectr_audit.reports.figures import real_lm_power_summary

    summary = real_lm_power_summary(report.meta["real_lm"])
    return "" if summary is None else f"; {summary}"


def _cmd_run(args) -> int:
    from spectr_audit.run.gate import evaluate_gate
    from spectr_audit.reports.json_report import render_json, write_json
    from spectr_audit.reports.markdown import write_markdown
    from spectr_audit.run.runner import AuditOptions, run_suite, select_verifiers
    from spectr_audit.run.suite import load_suite

    out = Path(args.out)
    start = time.perf_counter()
    if args.suite == REAL_LM_SUITE:
        report = _run_real_lm(args, out)
    else:
        suite = load_suite(args.suite)
        verifiers = select_verifiers(args.verifier)
        out.mkdir(parents=True, exist_ok=True)
        progress = _Progress(args.progress)
        options = AuditOptions(seed=args.seed, alpha=args.alpha, max_samples=args.max_samples)
        try:
            report = run_suite(suite, verifiers, options, progress=progress)
        finally:
            progress.close()
    thresholds = args.gate or []
    gate = evaluate_gate(report.results, thresholds) if thresholds else None
    if gate is not None:
        report = dataclasses.replace(report, meta={**report.meta, "gate": gate.to_dict()})
    paths = [write_json(report, out / "report.json"), write_markdown(report, out / "report.md")]
    if args.html:
        from spectr_audit.reports.html import write_html

        paths.append(write_html(report, out / "report.html", gate))
    if args.junit:
        from spectr_audit.reports.junit import write_junit

        paths.append(write_junit(report, Path(args.junit), gate))
    gate_failed = gate is not None and not gate.passed
    if args.json:
        print(render_json(report))
    else:
        unexpected = [r for r in report.results if not r.as_expected]
        findings = [r for r in report.results if not r.passed]
        verdict = "PASS" if report.passed and not gate_failed else "FAIL"
        gate_text = "" if gate is None else f", gate {'held' if gate.passed else 'FAILED'}"
        print(
            f"spectr-audit: suite {report.suite!r}: {len(report.results)} audits in {time.perf_counter() - start:.1f}s, "
            f"{len(findings)} with findings, {len(unexpected)} not as expected{gate_text} -> {verdict}"
            + _power_text(report)
        )
        for r in unexpected:
            print(f"  unexpected: {r.verifier} on {r.case}: " + (r.error or ", ".join(c.name for c in r.failed_checks)))
        print(f"reports: {', '.join(str(p) for p in paths)}")
    if gate_failed:
        print(f"spectr-audit run: {gate.message()}", file=sys.stderr)
        return 1
    return report.exit_code


def _cmd_audit(args) -> int:
    from spectr_audit.registry import load_verifier
    from spectr_audit.reports.json_report import render_json
    from spectr_audit.results import AuditReport
    from spectr_audit.run.runner import AuditOptions, audit_case
    from spectr_audit.run.suite import Case

    if args.num_drafts < 1:
        raise _UsageError(f"--num-drafts: must be >= 1, got {args.num_drafts}")
    if args.draft_len < 1:
        raise _UsageError(f"--draft-len: must be >= 1, got {args.draft_len}")
    draft_model = parse_model_spec(args.draft, "--draft")
    target_model = parse_model_spec(args.target, "--target")
    if draft_model.vocab_size != target_model.vocab_size:
        raise _UsageError(f"--draft, --target: vocab sizes differ ({draft_model.vocab_size} vs {target_model.vocab_size})")
    try:
        prefix = tuple(int(t) for t in args.prefix.split(",") if t.strip())
    except ValueError:
        raise _UsageError(f"--prefix: expected comma-separated token ids, got {args.prefix!r}") from None
    if any(not 0 <= t < draft_model.vocab_size for t in prefix):
        raise _UsageError(f"--prefix: token ids must lie in [0, {draft_model.vocab_size})")
    verifier = load_verifier(args.verifier)
    verifier.check_supports(args.num_drafts, args.draft_len)
    case = Case(name="cli", draft_model=draft_model, target_model=target_model, num_drafts=args.num_drafts,
                draft_len=args.draft_len, prefix=prefix)
    result = audit_case(verifier, case, AuditOptions(seed=args.seed))
    report = AuditReport(results=(result,), suite="cli")
    if args.json:
        print(render_json(report))
    else:
        _print_result_text(result)
    return report.exit_code


def _cmd_bound(args) -> int:
    import torch

    from spectr_audit.bounds.acceptance import optimal_acceptance, optimal_acceptance_lp, spectr_guarantee
    from spectr_audit.errors import InvalidArgument
    from spectr_audit.drafting.models import ContextFreeModel

    draft_model = parse_model_spec(args.draft, "--draft")
    target_model = parse_model_spec(args.target, "--target")
    if not isinstance(draft_model, ContextFreeModel) or not isinstance(target_model, ContextFreeModel):
        raise _UsageError("--draft, --target: bound needs context-free distributions")
    if draft_model.vocab_size != target_model.vocab_size:
        raise _UsageError(f"--draft, --target: vocab sizes differ ({draft_model.vocab_size} vs {target_model.vocab_size})")
    if args.num_drafts < 1:
        raise _UsageError(f"--num-drafts: must be >= 1, got {args.num_drafts}")
    start = time.perf_counter()
    closed = optimal_acceptance(draft_model.probs, target_model.probs, args.num_drafts)
    closed_seconds = time.perf_counter() - start
    out = {
        "num_drafts": args.num_drafts,
        "vocab_size": draft_model.vocab_size,
        "optimal_acceptance": closed.item(),
        "closed_form_seconds": closed_seconds,
        "spectr_guarantee_factor": spectr_guarantee(args.num_drafts),
        "single_draft_acceptance": float(torch.minimum(draft_model.probs, target_model.probs).sum()),
        "minimising_set": sorted(closed.argmin_set()),
    }
    try:
        lp = optimal_acceptance_lp(draft_model.probs, target_model.probs, args.num_drafts,
                                   max_variables=defaults.LP_MAX_VARIABLES)
        out.update(lp_value=lp.value, lp_status=lp.status, lp_solver=lp.solver, lp_variables=lp.num_variables)
    except InvalidArgument as exc:
        out.update(lp_value=None, lp_status=f"skipped: {exc}")
    if args.json:
        print(json.dumps(out, indent=2))
    else:
        for key, value in out.items():
            print(f"{key}: {value}")
    return 0


def _cmd_list(args) -> int:
    from spectr_audit.registry import describe, entries, namespaces
    from spectr_audit.run.suite import builtin_suites

    rows = [describe(entry) for entry in entries()]
    if args.json:
        print(json.dumps({"namespaces": namespaces(), "verifiers": rows, "suites": builtin_suites() + [REAL_LM_SUITE]},
                         indent=2))
        return 0
    # Columns aligned on the longest entry of each, across every namespace.
    fields = {"name": "name", "num_drafts": "K", "draft_len": "L", "draft_scheme": "drafts"}
    width = {key: max([len(title)] + [len(str(r.get(key, ""))) for r in rows]) for key, title in fields.items()}
    print("verifiers (by short name, or namespace:name):")
    for namespace in namespaces():
        print(f"{namespace}:")
        print("  " + "  ".join(f"{title:<{width[key]}}" for key, title in fields.items()) + "  exact law  notes")
        for r in (r for r in rows if r["namespace"] == namespace):
            if "error" in r:
                print(f"  {r['name']:<{width['name']}}  unavailable: {r['error']}")
                continue
            cells = "  ".join(f"{str(r[key]):<{width[key]}}" for key in fields)
            notes = [f"declared {r['expected']}"] if r["expected"] else []
            if r["extra"]:
                notes.append(f"extra: spectr-audit[{r['extra']}]")
            notes.append(r["description"])
            print(f"  {cells}  {'yes' if r['exact_law'] else 'no ':<9}  {'; '.join(n for n in notes if n)}")
    print("suites:")
    suites = builtin_suites()
    suite_width = max(len(s) for s in suites + [REAL_LM_SUITE])
    for s in suites:
        print(f"  {s}")
    print(f"  {REAL_LM_SUITE:<{suite_width}}  (SmolLM2-135M in the loop; needs the lm extra, see README)")
    return 0


_COMMANDS = {"run": _cmd_run, "audit": _cmd_audit, "bound": _cmd_bound, "list": _cmd_list}


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Entry point of the ``spectr-audit`` console script; returns the exit code."""
    parser = build_parser()
    args = parser.parse_args(argv)
    from spectr_audit.errors import InvalidArgument

    try:
        return _COMMANDS[args.command](args)
    except (_UsageError, InvalidArgument) as exc:
        print(f"spectr-audit {args.command}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
