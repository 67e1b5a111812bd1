"""Command line: ``spectr-audit run | audit | bound | generation | list``.

``generation`` audits a whole engine's ``generate()`` (:mod:`spectr_audit.generation`): the toy
loop and its planted slips (``--engine toy`` / ``toy:SLIP``), a user factory
(``--engine package.module:factory``), or the ``[[generation]]`` cases of a suite
(``--suite generation``); its exit codes are below too (0 PASS, 1 FINDING or ERROR, 3
INCONCLUSIVE with ``--fail-on-inconclusive``).

Exit codes: 0 every verdict as expected, 1 findings, 2 usage or input error, 3 only inconclusive
results stood in the way (with ``--fail-on-inconclusive``, or ``--certify-tv`` where a
certificate was not reached; without either, an inconclusive result exits 0 and is listed).

Under ``torchrun --nproc-per-node N -m spectr_audit run ...`` the processes join one
``torch.distributed`` group (gloo; NCCL with ``--device cuda``) and every statistical audit
spreads its chunks over them (:mod:`spectr_audit.statistical.sharding`): the counts and verdicts
are those of one process; the first process prints and writes the reports.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from pathlib import Path
from typing import Optional, Sequence

from spectr_audit import defaults

__all__ = ["main", "build_parser", "parse_model_spec"]


class _UsageError(Exception):
    pass


def parse_model_spec(text: str, argument: str, max_memory=None, inputs: str = "probs"):
    """Parse ``0.6,0.4`` or ``markov:vocab_size=3,seed=1`` / ``dirichlet:vocab_size=8,seed=2`` into a model.

    Integral numbers may be written as floats (``vocab_size=1e6``); a model whose tables exceed
    ``max_memory`` is refused before it is built.  With ``inputs="logits"`` (``--logits``) a
    comma-separated list is a context-free model's raw logits (``-inf`` allowed).
    """
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
                    number = float(value)
                except ValueError:
                    raise _UsageError(f"{argument}: {key}={value!r} is not a number") from None
                # 1e9 means the integer 1000000000 (a size or a seed), not a float to be refused as one
                params[key.strip()] = int(number) if number.is_integer() else number
        return model_from_spec({kind.strip(): params}, argument, max_memory=max_memory, inputs=inputs)
    try:
        values = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        what = "logits (e.g. 1.2,0.3,-inf)" if inputs == "logits" else "probabilities (e.g. 0.6,0.4)"
        raise _UsageError(
            f"{argument}: expected comma-separated {what} or kind:key=value,... "
            f"(markov:vocab_size=3,seed=1 or dirichlet:vocab_size=8,seed=2), got {text!r}"
        ) from None
    return model_from_spec(values, argument, max_memory=max_memory, inputs=inputs)


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


def _number_in(text: str, low: float, high: float, low_open: bool, high_open: bool, what: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}") from None
    above = value > low if low_open else value >= low
    below = value < high if high_open else value <= high
    if not (above and below):
        raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}")
    return value


def _temperature(text: str) -> float:
    return _number_in(text, 0.0, float("inf"), False, True, "a finite temperature >= 0 (0: greedy)")


def _top_k(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0 (0 disables top-k), got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0 (0 disables top-k), got {text!r}")
    return value


def _top_p(text: str) -> float:
    return _number_in(text, 0.0, 1.0, True, False, "a number in (0, 1] (1 disables top-p)")


def _min_p(text: str) -> float:
    return _number_in(text, 0.0, 1.0, False, False, "a number in [0, 1] (0 disables min-p)")


def _add_sampling_params(p: argparse.ArgumentParser, logits: bool) -> None:
    """The sampling parameters the verifier is held to (docs/sampling.md)."""
    from spectr_audit.contract.sampling import order_names

    group = p.add_argument_group(
        "sampling parameters", "hold the verifier to the law the engine's sampler draws from with these parameters "
        "(docs/sampling.md); a verifier that takes logits is handed the raw logits and the parameters"
        + ("" if logits else "; they replace every chain case's own"))
    group.add_argument("--temperature", type=_temperature, default=None, metavar="T",
                       help="temperature (0: greedy; default 1)")
    group.add_argument("--top-k", type=_top_k, default=None, metavar="K", help="top-k (default 0: off)")
    group.add_argument("--top-p", type=_top_p, default=None, metavar="P", help="top-p (default 1: off)")
    group.add_argument("--min-p", type=_min_p, default=None, metavar="M", help="min-p (default 0: off)")
    group.add_argument("--order", choices=order_names(), default=None,
                       help="the engine whose processing order applies (default vllm)")
    if logits:
        group.add_argument("--logits", action="store_true",
                           help="--draft and --target lists are raw logits (write --draft=-1.5,0.2 when one starts "
                           "with a minus sign; -inf allowed), not probabilities")


def _sampling_overrides(args) -> dict:
    """The sampling keys given on the command line (suite.SAMPLING_KEYS), none when none was given."""
    values = {"temperature": args.temperature, "top_k": args.top_k, "top_p": args.top_p, "min_p": args.min_p,
              "order": args.order, "inputs": "logits" if getattr(args, "logits", False) else None}
    return {key: value for key, value in values.items() if value is not None}


def _add_common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--seed", type=int, default=defaults.SEED, help=f"seed of every random draw (default {defaults.SEED})")


def _memory(text: str) -> int:
    from spectr_audit.errors import InvalidArgument
    from spectr_audit.run.budget import parse_memory

    try:
        return parse_memory(text)
    except InvalidArgument as exc:
        raise argparse.ArgumentTypeError(str(exc).partition(": ")[2]) from None


def _timeout(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of seconds >= 0 (0: no limit), got {text!r}") from None
    if not 0 <= value < float("inf"):
        raise argparse.ArgumentTypeError(f"expected a number of seconds >= 0 (0: no limit), got {text!r}")
    return value


def _add_resources(p: argparse.ArgumentParser, timeout: bool = True) -> None:
    """The memory budget and the per-call verifier time limit."""
    p.add_argument("--max-memory", type=_memory, default=None, metavar="SIZE",
                   help="memory budget, e.g. 4GiB, 500M or 1e9 (bytes): an audit, model or sample plan that would "
                   f"need more is refused (exit 2) before anything is allocated (default "
                   # argparse %-formats help: the percent sign is written %%
                   f"{100 * defaults.MAX_MEMORY_FRACTION:.0f}%% of this machine's memory)")
    if timeout:
        p.add_argument("--verifier-timeout", type=_timeout, default=defaults.VERIFIER_TIMEOUT, metavar="SECONDS",
                       help="stop a verifier call that runs longer (the audit becomes an error result, the others "
                       f"are kept; 0: no limit; default {defaults.VERIFIER_TIMEOUT:g})")


def _positive_seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive number of seconds, got {text!r}") from None
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"expected a positive number of seconds, got {text!r}")
    return value


def _add_sampling(p: argparse.ArgumentParser, gate=None) -> None:
    """The statistical audits' budgets, the certification, and failing on inconclusive results."""
    if not any(a.dest == "max_samples" for a in p._actions):
        p.add_argument("--max-samples", type=_positive_int, default=None, metavar="N",
                       help="sample budget of each statistical audit (default: planned by power analysis)")
    p.add_argument("--max-seconds", type=_positive_seconds, default=None, metavar="S",
                   help="wall-time budget of each statistical audit's sampling (default: none); a result cut "
                   "short below its planned power is INCONCLUSIVE")
    p.add_argument("--certify-tv", type=_probability, default=None, metavar="EPS",
                   help="certify TV <= EPS: a black box is CERTIFIED when the anytime-valid upper confidence bound "
                   "(level 1 - alpha) on its TV on the audited partition is at most EPS (the audit stops as soon as "
                   "certified or refuted); a verifier with an exact law by its exact TV; a result not certified "
                   "fails the run")
    p.add_argument("--device", default="cpu", help="device of the drafting, verification and counting (default cpu; "
                   "under torchrun, cuda selects NCCL and the process's LOCAL_RANK GPU)")
    (gate or p).add_argument("--fail-on-inconclusive", action="store_true",
                             help="exit 3 when every result went as expected but some were INCONCLUSIVE (achieved "
                             "minimum detectable TV above the planned one: a budget cut the sample short)")


_EXIT_CODES = """exit codes:
  0  the verdict is as expected: exact, or a finding of a verifier declared inexact
  1  the verdict is not as expected (a finding of a verifier declared exact or undeclared,
     or no finding of one declared inexact), or the audit could not run (an error result)
  2  usage or input error (a message naming the argument; nothing audited)
  3  only inconclusive results stood in the way (--fail-on-inconclusive, or --certify-tv
     where the certificate was not reached)
  130  interrupted (Ctrl-C)"""

_AUDIT_DESCRIPTION = """Audit one verifier on one case: a draft distribution, a target distribution, K drafts of
L tokens (or a draft tree).  A verifier with an exact law (output_probs) is audited exactly:
its law over every string of L + 1 tokens is enumerated in float64 and compared with the
target's (no sampling, no false alarm), with its acceptance against alpha*, the optimum.  A
black box is audited from samples: tests of its emitted strings against the target law at the
false-alarm rate --alpha, with the sample planned by power analysis (--max-samples and
--max-seconds cap it; a result cut short below its planned power is INCONCLUSIVE).  The first
line is the verdict (exact, FINDING, INCONCLUSIVE, CERTIFIED or ERROR) and how it stands against
the verifier's declaration; then every check with its value, threshold and outcome, then the
metrics."""

_AUDIT_EPILOG = """examples:
  spectr-audit audit --verifier kseq --draft 0.6,0.4 --target 0.3,0.7 --num-drafts 2
  spectr-audit audit --verifier broken:kseq-low-rho --num-drafts 3 \\
      --draft dirichlet:vocab_size=8,seed=1 --target dirichlet:vocab_size=8,seed=2
  spectr-audit audit --verifier my_pkg.verify:my_verify --num-drafts 1 --draft-len 2 \\
      --draft markov:vocab_size=3,seed=1 --target markov:vocab_size=3,seed=2 --json
  spectr-audit audit --verifier tree-rrs --tree 'paths:[[0],[1],[0,0]]' --draft 0.5,0.3,0.2 --target 0.2,0.3,0.5

""" + _EXIT_CODES

_BOUND_DESCRIPTION = """The optimal multi-draft acceptance alpha*: the largest P(the emitted token is among the
K drafts) that any exact verifier can reach when the K drafts are drawn i.i.d. from the draft
distribution p and the emitted token must follow the target q.  Computed in closed form,
alpha* = min over token sets T of q(T) + 1 - p(T)^K (docs/audit/bounds.md), and cross-checked by
the transport LP when it is small enough (lp_value).  Prints alpha*, the set T that
attains the minimum, SpecTr's guarantee factor 1 - (1 - 1/K)^K (K-SEQ reaches at least that
fraction of alpha*) and the single-draft acceptance sum min(p, q) for comparison."""

_BOUND_EPILOG = """examples:
  spectr-audit bound --draft 0.6,0.4 --target 0.3,0.7 --num-drafts 2      # alpha* = 0.94
  spectr-audit bound --draft dirichlet:vocab_size=1000,seed=1 --target dirichlet:vocab_size=1000,seed=2 \\
      --num-drafts 4 --json

exit codes:
  0  the bound was computed
  2  usage or input error (a message naming the argument)
  130  interrupted (Ctrl-C)"""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="spectr-audit",
        description="Audit speculative-decoding verifiers: exactness, acceptance against the optimum.",
    )
    sub = parser.add_subparsers(dest="command", required=True)

    run = sub.add_parser("run", help="audit verifiers on a suite and write reports")
    run.add_argument("--suite", default="default", help="built-in suite name or path to a suite .toml (default: default); "
                     "a suite's [[generation]] cases run with spectr-audit generation --suite")
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
    _add_sampling(run, gate)
    _add_sampling_params(run, logits=False)
    _add_resources(run)
    _add_common(run)

    audit = sub.add_parser("audit", help="audit one verifier on one case", description=_AUDIT_DESCRIPTION,
                           epilog=_AUDIT_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    audit.add_argument("--verifier", required=True, metavar="NAME_OR_IMPORT",
                       help="a built-in short name (spectr-audit list), namespace:name, package.module:attr or "
                       "path/file.py:attr")
    audit.add_argument("--draft", required=True, help="draft distribution: 0.6,0.4 | markov:vocab_size=3,seed=1 | dirichlet:vocab_size=8,seed=1")
    audit.add_argument("--target", required=True, help="target distribution, same forms as --draft")
    audit.add_argument("--num-drafts", type=int, default=None, help="K, the drafts (a chain case; not with --tree)")
    audit.add_argument("--draft-len", type=int, default=None, help="L, each draft's tokens (default 1; not with --tree)")
    audit.add_argument("--tree", default=None, metavar="SPEC",
                       help="audit on a draft tree: a path list 'paths:[[0],[1],[0,0]]' (EAGLE's and Medusa's format) "
                       "or a builder 'cartesian:2,2' | 'topk_depth:2,3' | 'chains:2,3' | 'parents:-1,0,0,1'")
    audit.add_argument("--draft-scheme", default=None, choices=("iid", "without_replacement", "topk", "none"),
                       help="how the tree's children are drafted (with --tree; default: the verifier's first scheme)")
    audit.add_argument("--prefix", default="", help="context tokens before the step, comma-separated")
    audit.add_argument("--json", action="store_true", help="print the result as the JSON report (results.py's contract)")
    audit.add_argument("--alpha", type=_probability, default=defaults.ALPHA, metavar="ALPHA",
                       help=f"false-alarm rate of the statistical audit (default {defaults.ALPHA:g})")
    _add_sampling(audit)
    _add_sampling_params(audit, logits=True)
    _add_resources(audit)
    _add_common(audit)

    bound = sub.add_parser("bound", help="optimal multi-draft acceptance alpha* (closed form, and LP when small)",
                           description=_BOUND_DESCRIPTION, epilog=_BOUND_EPILOG,
                           formatter_class=argparse.RawDescriptionHelpFormatter)
    bound.add_argument("--draft", required=True, metavar="PROBS",
                       help="the draft distribution p, comma-separated probabilities (e.g. 0.6,0.4) or "
                       "dirichlet:vocab_size=8,seed=1 (context-free only)")
    bound.add_argument("--target", required=True, metavar="PROBS", help="the target distribution q, same forms as --draft")
    bound.add_argument("--num-drafts", type=int, required=True, metavar="K", help="K, the i.i.d. drafts from p")
    bound.add_argument("--json", action="store_true", help="print the numbers as one JSON object")
    _add_resources(bound, timeout=False)

    _add_generation_parser(sub)

    lst = sub.add_parser("list", help="list the registered verifiers (every namespace), the generation engines and "
                         "the suites")
    lst.add_argument("--json", action="store_true")
    return parser


def verdict_line(result, exit_code: Optional[int] = None) -> str:
    """``audit``'s first line: the measured verdict, how it stands against the verifier's declaration,
    and the exit status it gives.

    Examples
    --------
    >>> from spectr_audit.results import AuditResult, Check
    >>> broken = AuditResult("kseq-low-rho", "cli", (Check("exact", False, 0.01, 1e-12),), expected=False)
    >>> verdict_line(broken, 0)
    'kseq-low-rho on cli: FINDING, as declared (declared inexact): exit 0'
    """
    head = f"{result.verifier} on {result.case}: {result.verdict}"
    if result.error is None and result.expected is not None:
        declared = "exact" if result.expected else "inexact"
        if result.as_expected:
            head += f", as declared (declared {declared})"
        elif result.expected:
            head += ", NOT as declared (declared exact; a check failed)"
        else:
            head += ", NOT as declared (declared inexact, but every check held: no finding reproduced)"
    return head if exit_code is None else f"{head}: exit {exit_code}"


def _print_result_text(result, exit_code: Optional[int] = None) -> None:
    print(verdict_line(result, exit_code))
    if result.error:
        print(f"  error: {result.error}")
    for c in result.checks:
        mark = "FAIL" if not c.passed else ("INCONCLUSIVE" if c.inconclusive else "ok  ")
        print(f"  [{mark}] {c.name}: value={c.value} threshold={c.threshold}" + (f": {c.detail}" if c.detail else ""))
    worst = result.details.get("worst_strings") or [] if not result.passed else []
    if worst:
        print("  worst strings (string: implied law vs target law): "
              + "; ".join(f"{w['string']}: {w['implied']:.6g} vs {w['target']:.6g}" for w in worst[:5]))
    for key, value in result.metrics.items():
        print(f"  {key} = {value}")


class _Progress:
    """Progress on stderr: a rich bar, one line per audit, or nothing."""

    def __init__(self, mode: str, on_start=None):
        self._on_start = on_start
        if mode == "auto":
            mode = "bar" if sys.stderr.isatty() else "lines"
        self.mode = mode
        self._bar = None
        self._task = None
        self._started = False

    def start(self, total: int) -> None:
        """Called by ``run_suite`` with the number of audits it will make."""
        if self._on_start is not None:
            self._on_start()
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
#: The built-in suite of generation audits (``spectr-audit generation --suite generation``).
GENERATION_SUITE = "generation"


def suite_names() -> list:
    """Every suite ``--suite`` takes by name: the TOML suites shipped, then the real-LM suite.

    The one list that ``spectr-audit list`` prints and a bad ``--suite`` is told.
    """
    from spectr_audit.run.suite import builtin_suites

    return builtin_suites() + [REAL_LM_SUITE]


def _check_suite_name(text: str) -> None:
    """A ``--suite`` that is neither a suite name nor a file: a usage error listing every suite (with a near match)."""
    import difflib

    names = suite_names()
    if text in names or text.endswith(".toml") or Path(text).exists():
        return  # a name, or a file for load_suite to read (and to complain about)
    close = difflib.get_close_matches(text, names, n=1)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    raise _UsageError(f"--suite: {text!r} is neither a suite name{hint} nor a .toml file; suites: {', '.join(names)}")


def _run_real_lm(args, out: Path):
    """``run --suite real-lm``: SmolLM2-135M with a layer-skipping self-speculative draft."""
    from spectr_audit.lm.real_suite import RealLMOptions, run_real_lm_suite
    from spectr_audit.lm.smollm import LMUnavailable

    if args.verifier:
        raise _UsageError("--verifier: the real-lm suite runs its own verifier grid; drop --verifier")
    options = RealLMOptions.quick(seed=args.seed) if args.quick else RealLMOptions(seed=args.seed)
    from spectr_audit.reports.markdown import render_real_lm_markdown

    from spectr_audit._files import write_text_atomic
    from spectr_audit.run.incomplete import RunInterrupted

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
    from spectr_audit.reports.figures import real_lm_power_summary

    summary = real_lm_power_summary(report.meta["real_lm"])
    return "" if summary is None else f"; {summary}"


def _cmd_run(args) -> int:
    from spectr_audit.run.gate import evaluate_gate
    from spectr_audit.reports.json_report import render_json, write_json
    from spectr_audit.reports.markdown import write_markdown
    from spectr_audit.run.runner import AuditOptions, run_suite, select_verifiers
    from spectr_audit.run.suite import load_suite

    from spectr_audit.run.incomplete import RunAborted, RunInterrupted, incomplete_text
    from spectr_audit.run.output import check_out, clear_earlier_run, write_manifest

    out = check_out(args.out) if _RANK == 0 else Path(args.out)
    if args.junit:
        check_out(Path(args.junit).parent, "--junit")
        if Path(args.junit).is_dir():
            raise _UsageError(f"--junit: {args.junit!r} is a folder; give the path of the XML file to write")
    start = time.perf_counter()
    stopped = None  # (exit code, message) of a run that stopped early
    sampling = _sampling_overrides(args)
    if args.suite == REAL_LM_SUITE and sampling:
        raise _UsageError(f"--{'/--'.join(k.replace('_', '-') for k in sampling)}: the real-lm suite runs its own "
                          "sampling grid; drop them")
    if args.suite == REAL_LM_SUITE:
        _clear(out, clear_earlier_run)
        try:
            report = _run_real_lm(args, out)
        except RunInterrupted as exc:
            report, stopped = exc.report, (130, "interrupted (Ctrl-C)")
    else:
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
        progress = _Progress(args.progress, on_start=lambda: _clear(out, clear_earlier_run))
        options = AuditOptions(seed=args.seed, alpha=args.alpha, max_samples=args.max_samples,
                               max_seconds=args.max_seconds, certify_tv=args.certify_tv, device=args.device,
                               max_memory=args.max_memory, verifier_timeout=args.verifier_timeout or None)
        try:
            report = run_suite(suite, verifiers, options, progress=progress)
        except RunInterrupted as exc:
            report, stopped = exc.report, (130, "interrupted (Ctrl-C)")
        except RunAborted as exc:
            report, stopped = exc.report, (2, f"error: {type(exc.cause).__name__}: {exc.cause}")
        finally:
            progress.close()
    thresholds = args.gate or []
    gate = evaluate_gate(report.results, thresholds) if thresholds else None
    if gate is not None:
        report = dataclasses.replace(report, meta={**report.meta, "gate": gate.to_dict()})
    paths = []
    if _RANK == 0:  # under torchrun, the other processes hold the same report
        paths = [write_json(report, out / "report.json"), write_markdown(report, out / "report.md")]
        if args.html:
            from spectr_audit.reports.html import write_html

            paths.append(write_html(report, out / "report.html", gate))
        if args.junit:
            from spectr_audit.reports.junit import write_junit

            paths.append(write_junit(report, Path(args.junit), gate))
        write_manifest(out, paths, complete=stopped is None)
    if stopped is not None:
        where = f"; the finished results are in {', '.join(str(p) for p in paths)}" if paths else ""
        print(f"spectr-audit run: {stopped[1]}: {incomplete_text(report)}{where}", file=sys.stderr)
        return stopped[0]
    gate_failed = gate is not None and not gate.passed
    fail_on_inconclusive = bool(getattr(args, "fail_on_inconclusive", False) or getattr(args, "certify_tv", None))
    if args.json:
        print(render_json(report))
    else:
        unexpected = [r for r in report.results if not r.as_expected]
        findings = [r for r in report.results if not r.passed]
        inconclusive = report.inconclusive
        certified = [r for r in report.results if r.verdict == "CERTIFIED"]
        failed = not report.passed or gate_failed or (fail_on_inconclusive and inconclusive)
        verdict = "FAIL" if failed else ("INCONCLUSIVE" if inconclusive else "PASS")
        gate_text = "" if gate is None else f", gate {'held' if gate.passed else 'FAILED'}"
        certified_text = f", {len(certified)} certified" if getattr(args, "certify_tv", None) else ""
        print(
            f"spectr-audit: suite {report.suite!r}: {len(report.results)} audits in {time.perf_counter() - start:.1f}s, "
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
    if gate_failed:
        print(f"spectr-audit run: {gate.message()}", file=sys.stderr)
        return 1
    return report.exit_status(fail_on_inconclusive)


def _clear(out: Path, clear_earlier_run) -> None:
    """Remove an earlier run's report files from ``out`` (said on stderr) before this run's first audit."""
    if _RANK != 0:
        return
    removed = clear_earlier_run(out)
    if removed:
        print(f"spectr-audit run: removed the report files of an earlier run from {str(out)!r}: "
              f"{', '.join(p.name for p in removed)}", file=sys.stderr)


def _unsupported_drafts(verifier, num_drafts: int, draft_len: int) -> str:
    """The usage error of ``audit`` with a (K, L) the verifier does not take, naming the option at fault.

    Examples
    --------
    >>> from spectr_audit.registry import load_verifier
    >>> _unsupported_drafts(load_verifier("speculative"), 3, 1)
    "--num-drafts: verifier 'speculative' supports K = num_drafts in [1, 1]; got 3"
    """
    faults = []
    if not verifier.min_drafts <= num_drafts <= (num_drafts if verifier.max_drafts is None else verifier.max_drafts):
        faults.append(f"--num-drafts: verifier {verifier.name!r} supports K = num_drafts in {verifier.drafts_range()}; "
                      f"got {num_drafts}")
    if not verifier.min_draft_len <= draft_len <= (draft_len if verifier.max_draft_len is None else verifier.max_draft_len):
        faults.append(f"--draft-len: verifier {verifier.name!r} supports L = draft_len in "
                      f"{verifier.draft_len_range()}; got {draft_len}")
    if not faults:  # each in range, not the pair (a verifier with its own supports rule)
        faults.append(f"--num-drafts, --draft-len: verifier {verifier.name!r} does not support K = {num_drafts} with "
                      f"L = {draft_len} (K in {verifier.drafts_range()}, L in {verifier.draft_len_range()})")
    return "; ".join(faults)


def _tree_case(args, draft_model, target_model, prefix):
    """``audit --tree``: the tree verifier (a chain verifier runs on chain trees) and the tree case."""
    from spectr_audit.registry import load_tree_verifier
    from spectr_audit.run.suite import Case, tree_from_spec

    tree = tree_from_spec(args.tree, "--tree")
    verifier = load_tree_verifier(args.verifier)
    verifier.check_supports_tree(tree)
    scheme = args.draft_scheme or verifier.draft_schemes[0]
    if scheme not in verifier.draft_schemes:
        raise _UsageError(f"--draft-scheme: {verifier.name!r} verifies drafts of the schemes "
                          f"{', '.join(verifier.draft_schemes)}; got {scheme!r}")
    case = Case(name=f"cli-tree/{scheme}", draft_model=draft_model, target_model=target_model,
                num_drafts=len(tree.children[0]), draft_len=tree.max_depth, prefix=prefix, tree=tree,
                draft_scheme=scheme, tree_spec=args.tree)
    return verifier, case


def _cmd_audit(args) -> int:
    from spectr_audit.registry import load_verifier
    from spectr_audit.reports.json_report import render_json
    from spectr_audit.results import AuditReport
    from spectr_audit.run.runner import AuditOptions, audit_case
    from spectr_audit.run.suite import Case

    if args.tree is not None:
        if args.num_drafts is not None or args.draft_len is not None:
            raise _UsageError("--num-drafts, --draft-len: a tree case takes them from --tree (the root's children, "
                              "the depth); drop them")
    else:
        if args.draft_scheme is not None:
            raise _UsageError("--draft-scheme: only with --tree (a chain verifier declares its own draft scheme)")
        if args.num_drafts is None:
            raise _UsageError("--num-drafts: required (or --tree SPEC for a draft-tree case)")
        args.draft_len = 1 if args.draft_len is None else args.draft_len
        if args.num_drafts < 1:
            raise _UsageError(f"--num-drafts: must be >= 1, got {args.num_drafts}")
        if args.draft_len < 1:
            raise _UsageError(f"--draft-len: must be >= 1, got {args.draft_len}")
    sampling = _sampling_overrides(args)
    inputs = sampling.get("inputs", "probs")
    draft_model = parse_model_spec(args.draft, "--draft", args.max_memory, inputs=inputs)
    target_model = parse_model_spec(args.target, "--target", args.max_memory, inputs=inputs)
    if draft_model.vocab_size != target_model.vocab_size:
        raise _UsageError(f"--draft, --target: vocab sizes differ ({draft_model.vocab_size} vs {target_model.vocab_size})")
    try:
        prefix = tuple(int(t) for t in args.prefix.split(",") if t.strip())
    except ValueError:
        raise _UsageError(f"--prefix: expected comma-separated token ids, got {args.prefix!r}") from None
    if any(not 0 <= t < draft_model.vocab_size for t in prefix):
        raise _UsageError(f"--prefix: token ids must lie in [0, {draft_model.vocab_size})")
    if args.tree is not None:
        if sampling:
            raise _UsageError("--temperature, --top-k, --top-p, --min-p, --order, --logits: for chain cases; a tree "
                              "verifier is handed probabilities (give the processed laws as --draft and --target)")
        verifier, case = _tree_case(args, draft_model, target_model, prefix)
    else:
        verifier = load_verifier(args.verifier)
        if not verifier.supports(args.num_drafts, args.draft_len):
            raise _UsageError(_unsupported_drafts(verifier, args.num_drafts, args.draft_len))
        case = Case(name="cli", draft_model=draft_model, target_model=target_model, num_drafts=args.num_drafts,
                    draft_len=args.draft_len, prefix=prefix, **_cli_sampling(sampling))
    options = AuditOptions(seed=args.seed, alpha=args.alpha, max_samples=args.max_samples,
                           max_seconds=args.max_seconds, certify_tv=args.certify_tv, device=args.device,
                           max_memory=args.max_memory, verifier_timeout=args.verifier_timeout or None)
    result = audit_case(verifier, case, options)
    report = AuditReport(results=(result,), suite="cli")
    status = report.exit_status(args.fail_on_inconclusive or args.certify_tv is not None)
    if args.json:
        print(render_json(report))
    else:
        _print_result_text(result, status)
    return status


def _cli_sampling(sampling: dict) -> dict:
    """The ``params``, ``order`` and ``inputs`` of the ``audit`` case (none without sampling flags)."""
    if not sampling:
        return {}
    from spectr_audit.contract.sampling import SamplingParams

    params = SamplingParams(**{key: sampling[key] for key in ("temperature", "top_k", "top_p", "min_p") if key in sampling})
    return {"params": params, "order": sampling.get("order", "vllm"), "inputs": sampling.get("inputs", "probs")}


def _cmd_bound(args) -> int:
    import torch

    from spectr_audit.bounds.acceptance import optimal_acceptance, optimal_acceptance_lp, spectr_guarantee
    from spectr_audit.errors import InvalidArgument
    from spectr_audit.drafting.models import ContextFreeModel

    draft_model = parse_model_spec(args.draft, "--draft", args.max_memory)
    target_model = parse_model_spec(args.target, "--target", args.max_memory)
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


_GENERATION_DESCRIPTION = """Audit a generation engine: what its generate() emits, every token, against the target
model's own law (docs/generation.md).  The audit runs the engine under its batch designs
(--arms: single, equal, ragged, repeated), scores every emitted token with the engine's scorer
(the target without speculation, teacher-forced), and tests the tokens' randomized PITs and
surprisals, one Holm family at the false-alarm rate --alpha.  Verdicts: PASS (nothing rejected,
at the power planned for --min-detectable-tv), FINDING, INCONCLUSIVE (nothing rejected, too few
tokens for the planned power), ERROR (no job could be scored).  The first line printed is the
verdict with the deciding test and its p-value; then how it was decided, the rejected tests and
the decisive tokens.

--engine SPEC is one of
  toy                      the correct speculative loop over a small toy model pair
  toy:SLIP                 the same loop with a planted slip (spectr-audit list shows them)
  package.module:factory   a factory (called with no arguments) returning a dict or object with
  path/file.py:factory     generate, score and vocab_size, and optionally reference (the same
                           engine with speculation off), draft_score, prompts, eos_token_id

--suite runs the [[generation]] cases of a suite instead: the built-in 'generation' (the toy loop
and its slips) or a .toml file of your own, each case with the verdict it expects.  Suites'
generation cases run here, not under `spectr-audit run` (whose report holds verifier audits)."""

_GENERATION_EPILOG = """examples:
  spectr-audit generation --engine toy --max-new-tokens 16 --min-detectable-tv 0.25
  spectr-audit generation --engine toy:shared-stream --json
  spectr-audit generation --engine my_pkg.audit:make_engine --prompts prompts.txt --rounds 4 \\
      --store audit.sqlite --out report/          # Ctrl-C, then the same line with --resume
  spectr-audit generation --suite generation

exit codes:
  0  PASS (and INCONCLUSIVE without --fail-on-inconclusive); a suite: every case as expected
  1  FINDING or ERROR; a suite: a case not as expected
  2  usage or input error (a message naming the argument; nothing audited)
  3  INCONCLUSIVE, with --fail-on-inconclusive
  130  interrupted (Ctrl-C): what finished is written (--out, --store), marked incomplete"""


def _arms(text: str) -> tuple:
    from spectr_audit.generation.designs import ARMS

    arms = tuple(a.strip() for a in text.split(",") if a.strip())
    bad = [a for a in arms if a not in ARMS]
    if not arms or bad:
        raise argparse.ArgumentTypeError(f"expected comma-separated arms from {', '.join(ARMS)}, got {text!r}")
    return arms


def _vocab(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer >= 2, got {text!r}") from None
    if value < 2:
        raise argparse.ArgumentTypeError(f"expected an integer >= 2, got {text!r}")
    return value


def _non_negative_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, got {text!r}")
    return value


def _draft_noise(text: str):
    if text.strip().lower() == "none":
        return "none"
    return _number_in(text, 0.0, float("inf"), False, True, "a number >= 0, or none (an unrelated draft)")


def _add_generation_parser(sub) -> None:
    gen = sub.add_parser("generation", help="audit a generation engine's generate(): every emitted token against the "
                         "target model's law", description=_GENERATION_DESCRIPTION, epilog=_GENERATION_EPILOG,
                         formatter_class=argparse.RawDescriptionHelpFormatter)
    what = gen.add_mutually_exclusive_group(required=True)
    what.add_argument("--engine", metavar="SPEC", help="toy | toy:SLIP | package.module:factory | path/file.py:factory")
    what.add_argument("--suite", metavar="NAME_OR_TOML",
                      help="run the [[generation]] cases of a suite (built-in: generation, engines-e2e) instead of "
                      "one engine")
    gen.add_argument("--case", metavar="PATTERN", action="append", default=None,
                     help="with --suite: run only the cases whose name matches (shell-style, e.g. 'vllm-*'; "
                     "repeatable)")
    gen.add_argument("--prompts", metavar="FILE", default=None,
                     help="the prompts: a JSON list of token-id lists, or one line of space-separated ids per prompt "
                     "(default: the engine's own; the toy has six)")
    audit = gen.add_argument_group("the audit")
    audit.add_argument("--max-new-tokens", type=_positive_int, default=None, metavar="N",
                       help="tokens per continuation (default 32; a toy slip's own where it needs more)")
    audit.add_argument("--batch-size", type=_positive_int, default=None, metavar="N",
                       help="rows per generate() call in the equal, ragged and repeated arms (default 4)")
    audit.add_argument("--rounds", type=_positive_int, default=None, metavar="N",
                       help="times the whole design runs, with new seeds (default 1)")
    audit.add_argument("--arms", type=_arms, default=None, metavar="LIST",
                       help="batch designs, comma-separated: single,equal,ragged,repeated (default all)")
    audit.add_argument("--seed", type=int, default=None, help=f"seed of every job (default {defaults.SEED})")
    audit.add_argument("--alpha", type=_probability, default=None, metavar="ALPHA",
                       help=f"familywise false-alarm rate (default {defaults.ALPHA:g})")
    audit.add_argument("--min-detectable-tv", type=_probability, default=None, metavar="TV",
                       help="the TV the PASS verdict needs the power to detect (default "
                       f"{defaults.GENERATION_MIN_DETECTABLE_TV:g}); below that power nothing rejected is INCONCLUSIVE")
    audit.add_argument("--max-tokens", type=_positive_int, default=None, metavar="N",
                       help="stop after this many engine tokens (the result says how far it got)")
    audit.add_argument("--max-seconds", type=_positive_seconds, default=None, metavar="S",
                       help="stop after this many seconds")
    audit.add_argument("--timeout", type=_positive_seconds, default=None, metavar="S",
                       help="per-call limit of generate(), the reference and the scorers (a call past it fails its job)")
    audit.add_argument("--reference", action=argparse.BooleanOptionalAction, default=None,
                       help="audit with the engine's reference generator (speculation off): two-sample tests and the "
                       "numerics floor (default: a factory's when it gives one; not the toy's, whose scorer is exact)")
    audit.add_argument("--eos-token-id", type=_non_negative_int, default=None, metavar="ID",
                       help="the engine's end-of-sequence id (default: the factory's; the toy's slip eos-inside-block 0)")
    toy = gen.add_argument_group("the toy engine (--engine toy or toy:SLIP)")
    toy.add_argument("--vocab-size", type=_vocab, default=None, metavar="V", help="vocabulary (default 16)")
    toy.add_argument("--toy-seed", type=_non_negative_int, default=None, metavar="N",
                     help="seed of the toy model pair's weights (default 0)")
    toy.add_argument("--draft-noise", type=_draft_noise, default=None, metavar="X",
                     help="the draft is the target perturbed by X (default 0.3); none: an unrelated draft")
    toy.add_argument("--temperature", type=_temperature, default=None, metavar="T",
                     help="temperature (default 1, or the slip's own)")
    toy.add_argument("--top-k", type=_top_k, default=None, metavar="K", help="top-k (default 0: off, or the slip's)")
    toy.add_argument("--top-p", type=_top_p, default=None, metavar="P", help="top-p (default 1: off)")
    out = gen.add_argument_group("store and output")
    out.add_argument("--store", metavar="PATH", default=None,
                     help="an SQLite file each finished job is written to (with --suite: a folder, one file per "
                     "case); Ctrl-C loses at most the job in flight")
    out.add_argument("--resume", action="store_true",
                     help="continue the audit in --store (same configuration) to the same verdict")
    out.add_argument("--out", metavar="DIR", default=None,
                     help="write the reports to DIR (report.json, and .md, .html, JUnit with the generation reports; "
                     "with --suite one folder per case and the suite's report.json)")
    out.add_argument("--repro", metavar="PATH", default=None,
                     help="on a FINDING of an engine that can describe itself (the engines-e2e factories), write a "
                     "standalone reproduction script to PATH (with --suite: a folder, CASE.py per finding)")
    out.add_argument("--json", action="store_true", help="print the result as JSON (the verdict line goes to stderr)")
    out.add_argument("--progress", choices=("auto", "bar", "none"), default="auto",
                     help="a progress bar on stderr: auto (on a terminal), bar, none")
    out.add_argument("--fail-on-inconclusive", action="store_true",
                     help="exit 3 on INCONCLUSIVE (nothing rejected, too few tokens for the planned power)")


def _progress_flag(mode: str):
    return {"auto": None, "bar": True, "none": False}[mode]


def _toy_spec(spec: str) -> bool:
    spec = spec.strip()
    return spec == "toy" or spec.startswith("toy:")


def _given(args, flags: Sequence[str]) -> list:
    """The options among ``flags`` that the command line set (each defaults to None)."""
    return [flag for flag in flags if getattr(args, flag[2:].replace("-", "_")) is not None]


_TOY_FLAGS = ("--toy-seed", "--draft-noise", "--temperature", "--top-k", "--top-p")
_ENGINE_FLAGS = ("--prompts", "--max-new-tokens", "--batch-size", "--rounds", "--arms", "--min-detectable-tv",
                 "--reference", "--eos-token-id", "--vocab-size") + _TOY_FLAGS


def _check_store(path: str, argument: str = "--store") -> Path:
    store = Path(path)
    if store.is_dir():
        raise _UsageError(f"{argument}: {path!r} is a folder; give the path of the SQLite file to write")
    for parent in store.parents:
        if parent.exists():
            if not parent.is_dir():
                raise _UsageError(f"{argument}: {path!r} lies under {str(parent)!r}, which is a file, not a folder")
            break
    try:
        store.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise _UsageError(f"{argument}: cannot create the folder of {path!r}: {exc.strerror or exc}") from None
    return store


def _prepare_out(args) -> Optional[Path]:
    if args.out is None:
        return None
    from spectr_audit.run.output import check_out, clear_earlier_run

    out = check_out(args.out)
    removed = clear_earlier_run(out)
    if removed:
        print(f"spectr-audit generation: removed the report files of an earlier run from {str(out)!r}: "
              f"{', '.join(p.name for p in removed)}", file=sys.stderr)
    return out


def _write_repro(path: Path, result, spec, prompts, max_new_tokens: int, quiet_unless_finding: bool = False) -> None:
    """``--repro``: the standalone reproduction of a FINDING, or a line saying why none was written."""
    if result.verdict != "FINDING":
        if not quiet_unless_finding:
            print(f"spectr-audit generation: --repro: no reproduction written: the verdict is {result.verdict}, "
                  "not FINDING", file=sys.stderr)
        return
    if spec is None:
        print(f"spectr-audit generation: --repro: no reproduction written for {result.generator!r}: its generator "
              "gives no repro_spec (the engines of spectr_audit.engines.e2e.factories do)", file=sys.stderr)
        return
    from spectr_audit.engines.e2e.repro import write_repro

    written = write_repro(path, result, spec, prompts, max_new_tokens=max_new_tokens, alpha=result.alpha)
    print(f"reproduction: {written} (python {written}; exit 1 when the finding reproduces)")


def _cmd_generation(args) -> int:
    if args.resume and args.store is None:
        raise _UsageError("--resume: needs --store PATH (the store of the audit to continue)")
    if args.suite is not None:
        return _generation_suite(args)
    if args.case:
        raise _UsageError("--case: selects cases of a suite; only with --suite")
    if args.repro is not None and Path(args.repro).is_dir():
        raise _UsageError(f"--repro: {args.repro!r} is a folder; give the script's path (with --suite, a folder)")
    from spectr_audit.generation import GenerationInterrupted
    from spectr_audit.run import generation as gen

    if not _toy_spec(args.engine):
        toy_only = _given(args, _TOY_FLAGS)
        if toy_only:
            raise _UsageError(f"{', '.join(toy_only)}: only with --engine toy or toy:SLIP (a factory's engine has its "
                              "own model and sampling setting)")
    store = None if args.store is None else _check_store(args.store)
    if store is not None and args.resume and not store.exists():
        raise _UsageError(f"--resume: there is no store at {args.store!r} to resume; run without --resume first")
    engine = gen.load_generation_engine(args.engine, vocab_size=args.vocab_size, toy_seed=args.toy_seed,
                                        draft_noise={None: "default", "none": None}.get(args.draft_noise,
                                                                                        args.draft_noise),
                                        temperature=args.temperature, top_k=args.top_k,
                                        top_p=args.top_p, eos_token_id=args.eos_token_id, argument="--engine")
    prompts = None
    if args.prompts is not None:
        from spectr_audit.generation.contract import check_prompts

        prompts = check_prompts(gen.read_prompts(args.prompts, "--prompts"), engine.vocab_size,
                                argument=f"--prompts ({args.prompts})")
    elif engine.prompts is None:
        raise _UsageError(f"--prompts: required: the engine {args.engine!r} gives no prompts of its own")
    out = _prepare_out(args)
    options = dict(max_new_tokens=args.max_new_tokens, batch_size=args.batch_size, rounds=args.rounds, arms=args.arms,
                   seed=args.seed, alpha=args.alpha, min_detectable_tv=args.min_detectable_tv,
                   max_tokens=args.max_tokens, max_seconds=args.max_seconds, timeout=args.timeout,
                   store=None if store is None else str(store), resume=args.resume,
                   progress=_progress_flag(args.progress))
    interrupted = False
    try:
        result = gen.audit_engine(engine, prompts, reference=args.reference, **options)
    except GenerationInterrupted as exc:
        if exc.result is None:
            raise KeyboardInterrupt from None
        result, interrupted = exc.result, True
    status = 130 if interrupted else gen.status_of(result, args.fail_on_inconclusive)
    paths = []
    if out is not None:
        from spectr_audit.run.output import write_manifest

        paths = gen.write_reports(result, out)
        write_manifest(out, paths, complete=not interrupted)
    if args.json:
        print(gen.result_json(result))
        print(gen.verdict_line(result, status), file=sys.stderr)
    else:
        print(gen.verdict_line(result, status))
        for line in gen.detail_lines(result):
            print(f"  {line}")
        arms = ", ".join(f"{arm} {n}" for arm, n in result.tokens_by_arm.items() if n)
        if arms:
            print(f"  tokens by arm: {arms}")
        if result.acceptance:
            print("  acceptance: " + ", ".join(f"{k} {_short(v)}" for k, v in result.acceptance.items() if k != "note"))
        if paths:
            print(f"reports: {', '.join(str(p) for p in paths)}")
    if args.repro is not None:
        _write_repro(Path(args.repro), result, getattr(engine.generate, "repro_spec", None),
                     prompts if prompts is not None else engine.prompts, args.max_new_tokens or 32)
    if interrupted:
        where = f"; reports: {', '.join(str(p) for p in paths)}" if paths else ""
        again = (f"; continue with the same command and --resume (store {args.store!r})" if args.store is not None
                 else "; give --store PATH to keep the finished jobs next time")
        print(f"spectr-audit generation: interrupted (Ctrl-C): INCOMPLETE: the result covers the {result.num_jobs} jobs "
              f"that finished{where}{again}", file=sys.stderr)
    return status


def _short(value) -> str:
    return f"{value:.3g}" if isinstance(value, float) else str(value)


def _generation_suite(args) -> int:
    from spectr_audit.run import generation as gen
    from spectr_audit.run.suite import load_suite

    per_engine = [flag for flag in _given(args, _ENGINE_FLAGS)]
    if per_engine:
        raise _UsageError(f"{', '.join(per_engine)}: not with --suite (each [[generation]] case sets its own); with "
                          "--suite only --seed, --alpha, --max-tokens, --max-seconds and --timeout apply to every case")
    _check_suite_name(args.suite)
    suite = load_suite(args.suite)
    if not suite.generation:
        raise _UsageError(f"--suite: suite {suite.name!r} has no [[generation]] cases (its [[case]] tables audit "
                          f"verifiers: spectr-audit run --suite {args.suite})")
    store_dir = None
    if args.store is not None:
        store_dir = Path(args.store)
        if store_dir.exists() and not store_dir.is_dir():
            raise _UsageError(f"--store: with --suite, a folder (one SQLite store per case); {args.store!r} is a file")
        try:
            store_dir.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise _UsageError(f"--store: cannot create the folder {args.store!r}: {exc.strerror or exc}") from None
    out = _prepare_out(args)
    start = time.perf_counter()
    quiet = args.progress == "none"

    def on_start(case) -> None:
        if not quiet:
            print(f"  auditing {case.name} ({case.engine})", file=sys.stderr)

    try:
        report = gen.run_generation_suite(suite, store_dir=store_dir, resume=args.resume, on_start=on_start,
                                          select=args.case, seed=args.seed, alpha=args.alpha, max_tokens=args.max_tokens,
                                          max_seconds=args.max_seconds, timeout=args.timeout,
                                          progress=_progress_flag(args.progress) if args.progress == "bar" else False)
    except gen.GenerationSuiteInterrupted as exc:
        report = exc.report
    status = report.exit_status(args.fail_on_inconclusive)
    paths = []
    if out is not None:
        from spectr_audit._files import write_text_atomic
        from spectr_audit.run.output import write_manifest

        for entry in report.results:
            gen.write_reports(entry.result, out / entry.case)
        paths.append(write_text_atomic(out / "report.json", json.dumps(report.to_dict(), indent=2) + "\n"))
        write_manifest(out, paths, complete=report.incomplete is None)
    findings = sum(r.result.verdict == "FINDING" for r in report.results)
    verdict = "FAIL" if status in (1, 3) else ("INCOMPLETE" if status == 130 else
                                               ("INCONCLUSIVE" if report.inconclusive else "PASS"))
    skipped = f", {len(report.skipped)} skipped" if report.skipped else ""
    head = (f"spectr-audit generation: suite {report.suite!r}: {len(report.results)} of {report.planned} cases in "
            f"{time.perf_counter() - start:.1f}s, {findings} findings, {len(report.inconclusive)} inconclusive, "
            f"{len(report.unexpected)} not as expected{skipped} -> {verdict}: exit {status}")
    if args.json:
        print(json.dumps(report.to_dict(), indent=2))
        print(head, file=sys.stderr)
    else:
        print(head)
        for entry in report.results:
            print(f"  {entry.line()}")
        for case, reason in report.skipped:
            print(f"  {case}: SKIPPED ({reason})")
    if args.repro is not None:
        for entry in report.results:
            case = next(c for c in suite.generation if c.name == entry.case)
            _write_repro(Path(args.repro) / f"{entry.case}.py", entry.result, entry.repro_spec,
                         [list(p) for p in entry.prompts or ()], case.audit_options.get("max_new_tokens", 32),
                         quiet_unless_finding=True)
        if out is not None:
            print(f"reports: {out / 'report.json'} and one folder per case in {str(out)!r}")
    if report.incomplete is not None:
        print(f"spectr-audit generation: interrupted (Ctrl-C): INCOMPLETE: {len(report.results)} of {report.planned} "
              "cases finished" + (f"; continue with --store {args.store!r} --resume" if args.store else ""),
              file=sys.stderr)
    return status


def _cmd_list(args) -> int:
    from spectr_audit.registry import describe, entries, namespaces

    from spectr_audit.run.generation import generation_engine_names

    rows = [describe(entry) for entry in entries()]
    engines = generation_engine_names()
    if args.json:
        print(json.dumps({"namespaces": namespaces(), "verifiers": rows, "generation_engines": engines,
                          "suites": suite_names()}, indent=2))
        return 0
    # Columns aligned on the longest entry of each, across every namespace.
    for r in rows:
        if "trees" in r:  # which draft trees each verifier takes, under which draft schemes
            r["tree_cell"] = f"{r['trees']} ({r['tree_draft_schemes'].replace(',', ', ')})"
    fields = {"name": "name", "num_drafts": "K", "draft_len": "L", "draft_scheme": "drafts", "tree_cell": "trees"}
    width = {key: max([len(title)] + [len(str(r.get(key, ""))) for r in rows]) for key, title in fields.items()}
    print("verifiers (by short name, or namespace:name; trees: 'any' draft tree or only 'chains' of K x L, "
          "and the tree draft schemes):")
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
            if r.get("takes_logits"):
                notes.append("takes logits and sampling parameters")
            notes.append(r["description"])
            print(f"  {cells}  {'yes' if r['exact_law'] else 'no ':<9}  {'; '.join(n for n in notes if n)}")
    print("generation engines (spectr-audit generation --engine SPEC; also package.module:factory or "
          "path/file.py:factory):")
    spec_width = max(len(e["spec"]) for e in engines)
    for e in engines:
        mark = "planted slip: " if e["expected"] == "finding" else ""
        print(f"  {e['spec']:<{spec_width}}  {mark}{e['needs']}")
    print("suites:")
    suites = suite_names()
    suite_width = max(len(s) for s in suites)
    for s in suites:
        note = "  (SmolLM2-135M in the loop; needs the lm extra, see README)" if s == REAL_LM_SUITE else ""
        if s == GENERATION_SUITE:
            note = "  (generation audits: spectr-audit generation --suite generation)"
        print(f"  {s:<{suite_width}}{note}".rstrip())
    return 0


_COMMANDS = {"run": _cmd_run, "audit": _cmd_audit, "bound": _cmd_bound, "list": _cmd_list,
             "generation": _cmd_generation}


#: This process's rank under ``torchrun`` (0 otherwise): only rank 0 prints and writes reports.
_RANK = 0


def _join_torchrun(args) -> None:
    """Under ``torchrun`` (``WORLD_SIZE`` > 1), join the process group the statistical audits shard over."""
    import os

    global _RANK
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        return
    import torch
    import torch.distributed as dist

    if not dist.is_initialized():
        cuda = str(getattr(args, "device", "cpu")).startswith("cuda") and torch.cuda.is_available()
        if cuda:
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group("nccl" if cuda else "gloo")
        import atexit

        atexit.register(dist.destroy_process_group)
    _RANK = dist.get_rank()
    if _RANK != 0:
        sys.stdout = open(os.devnull, "w")  # noqa: SIM115 (for the life of the process)


class _PipeSafe:
    """A text stream whose reader may go away: on EPIPE (``spectr-audit ... | head``) the stream's file
    descriptor is pointed at ``os.devnull`` and output is dropped, the standard way (Python's
    ``signal`` documentation, "Note on SIGPIPE"), so that neither a write nor the flush at exit
    raises ``BrokenPipeError``; the command's exit code stands."""

    def __init__(self, stream):
        self._stream = stream
        self.broken = False

    def _silence(self) -> None:
        self.broken = True
        try:
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, self._stream.fileno())
            os.close(devnull)
        except (OSError, ValueError, AttributeError):  # not a real file (captured output): just drop
            pass

    def write(self, text: str) -> int:
        if self.broken:
            return len(text)
        try:
            return self._stream.write(text)
        except BrokenPipeError:
            self._silence()
            return len(text)

    def flush(self) -> None:
        if self.broken:
            return
        try:
            self._stream.flush()
        except BrokenPipeError:
            self._silence()

    def __getattr__(self, name):
        return getattr(self._stream, name)


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Entry point of the ``spectr-audit`` console script; returns the exit code.

    Exit codes: 0, 1, 3 as in the module docstring; 2 for usage and input errors (a message
    naming the argument, never a traceback; an unexpected error is reported as an internal
    error); 130 after Ctrl-C (SIGINT), with the results finished so far written by ``run``.
    """
    streams = sys.stdout, sys.stderr
    sys.stdout, sys.stderr = _PipeSafe(sys.stdout), _PipeSafe(sys.stderr)
    command = "?"
    try:
        parser = build_parser()
        args = parser.parse_args(argv)
        command = args.command
        return _main(args)
    except KeyboardInterrupt:
        print(f"spectr-audit {command}: interrupted (Ctrl-C)", file=sys.stderr)
        return 130
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        sys.stdout, sys.stderr = streams


def _main(args) -> int:
    if args.command in ("run", "audit"):
        _join_torchrun(args)
    from spectr_audit.errors import InvalidArgument, SpectrAuditError

    try:
        return _COMMANDS[args.command](args)
    except (_UsageError, InvalidArgument) as exc:
        print(f"spectr-audit {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except SpectrAuditError as exc:  # e.g. a verifier that breaks the contract outside an audit
        print(f"spectr-audit {args.command}: error: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 2
    except MemoryError:
        print(f"spectr-audit {args.command}: error: out of memory; lower --max-memory below what this machine "
              "can give (the budget then refuses what does not fit)", file=sys.stderr)
        return 2
    except OSError as exc:
        print(f"spectr-audit {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except Exception as exc:  # a bug of spectr-audit: a message, not a traceback
        print(f"spectr-audit {args.command}: internal error: {type(exc).__name__}: {exc} "
              "(please report it, with the command line)", file=sys.stderr)
        return 2


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
