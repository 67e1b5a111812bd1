"""``spectr-audit generation``: audit an engine's ``generate()``, or the ``[[generation]]`` cases of a suite."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Optional, Sequence

from spectr_audit import defaults
from spectr_audit.cli._args import (
    _check_suite_name,
    _int_at_least,
    _number_in,
    _positive_int,
    _positive_seconds,
    _probability,
    _temperature,
    _top_k,
    _top_p,
    _UsageError,
)

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
    return _int_at_least(text, 2, "an integer >= 2")


def _non_negative_int(text: str) -> int:
    return _int_at_least(text, 0, "an integer >= 0")


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
