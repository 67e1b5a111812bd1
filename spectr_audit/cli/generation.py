"""``spectr-audit generation``: audit an engine's ``generate()``, or the ``[[generation]]`` cases of a suite."""

from __future__ import annotations

import json
import logging
import sys
import time
from pathlib import Path
from typing import Optional, Sequence

from spectr_audit._files import write_text_atomic
from spectr_audit.cli._args import _check_suite_name, _UsageError
from spectr_audit.engine_adapters.repro import write_repro
from spectr_audit.generation import GenerationInterrupted
from spectr_audit.generation.contract import check_prompts
from spectr_audit.generation.designs import ARMS
from spectr_audit.generation import checks as gen
from spectr_audit.run.generation_suite import run_generation_suite
from spectr_audit.run.output import check_out, clear_earlier_run, write_manifest
from spectr_audit.run.suite import load_suite

__all__ = ["command"]


def _progress_flag(mode: str):
    return {"auto": None, "bar": True, "none": False}[mode]


def _toy_spec(spec: str) -> bool:
    return gen.spec_kind(spec) != "factory"


def _given(args, flags: Sequence[str]) -> list:
    """The options among ``flags`` that the command line set (each defaults to None)."""
    return [flag for flag in flags if getattr(args, flag[2:].replace("-", "_")) is not None]


_TOY_FLAGS = ("--toy-seed", "--draft-noise", "--temperature", "--top-k", "--top-p")
_SAMPLING_FLAGS = ("--temperature", "--top-k", "--top-p")
_ENGINE_FLAGS = ("--prompts", "--max-new-tokens", "--batch-size", "--rounds", "--arms", "--conditions",
                 "--min-detectable-tv", "--reference-tv",
                 "--reference", "--eos-token-id", "--vocab-size", "--requests", "--logprob-tolerance") + _TOY_FLAGS


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
              "gives no repro_spec (the engines of spectr_audit.engine_adapters.factories do)", file=sys.stderr)
        return
    written = write_repro(path, result, spec, prompts, max_new_tokens=max_new_tokens, alpha=result.alpha)
    print(f"reproduction: {written} (python {written}; exit 1 when the finding reproduces)")


class _CurrentStderr(logging.StreamHandler):
    """A handler writing to ``sys.stderr`` as it is when a record is emitted (a command run again in the same
    process, under another ``sys.stderr``, writes where that run's errors go, not to a stream since closed)."""

    def __init__(self):
        super().__init__(sys.stderr)

    @property
    def stream(self):
        return sys.stderr

    @stream.setter
    def stream(self, value) -> None:
        pass


def _say_plans(args) -> None:
    """The plan of an audit that runs until its power (``--rounds auto``) on stderr, as the audit says it (unless
    ``--progress none``)."""
    if args.progress == "none":
        return
    log = logging.getLogger("spectr_audit.generation")
    if any(getattr(h, "_spectr_cli", False) for h in log.handlers):
        return
    handler = _CurrentStderr()
    handler.setFormatter(logging.Formatter("spectr-audit generation: %(message)s"))
    handler._spectr_cli = True
    log.addHandler(handler)
    log.setLevel(logging.INFO)


def command(args) -> int:
    """Run ``spectr-audit generation``; its exit code."""
    _say_plans(args)
    if args.resume and args.store is None:
        raise _UsageError("--resume: needs --store PATH (the store of the audit to continue)")
    if args.suite is not None:
        return _generation_suite(args)
    if args.case:
        raise _UsageError("--case: selects cases of a suite; only with --suite")
    unknown = [arm for arm in args.arms or () if arm not in ARMS]
    if unknown:
        raise _UsageError(f"--arms: expected comma-separated arms from {', '.join(ARMS)}, got {','.join(args.arms)!r}")
    if args.repro is not None and Path(args.repro).is_dir():
        raise _UsageError(f"--repro: {args.repro!r} is a folder; give the script's path (with --suite, a folder)")
    if not _toy_spec(args.engine):
        toy_only = _given(args, _TOY_FLAGS)
        if toy_only:
            raise _UsageError(f"{', '.join(toy_only)}: only with --engine toy or toy:SLIP (a factory's engine has its "
                              "own model and sampling setting)")
    if gen.spec_kind(args.engine) == "toy-requests":
        sampling = _given(args, _SAMPLING_FLAGS)
        if sampling:
            raise _UsageError(f"{', '.join(sampling)}: not with --engine {args.engine.strip()}: its requests carry the "
                              "sampling parameters (give them in --requests FILE)")
    if gen.spec_kind(args.engine) == "toy" and args.requests is not None:
        raise _UsageError(f"--requests: the engine {args.engine.strip()!r} does not take requests (its generator does "
                          "not declare accepts_requests and its scorer returns laws, not raw logits); the toy loop "
                          "over whole requests is --engine toy-requests")
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
        prompts = check_prompts(gen.read_prompts(args.prompts, "--prompts"), engine.vocab_size,
                                argument=f"--prompts ({args.prompts})")
    elif engine.prompts is None:
        raise _UsageError(f"--prompts: required: the engine {args.engine!r} gives no prompts of its own")
    requests = None if args.requests is None else gen.read_requests(args.requests, "--requests")
    out = _prepare_out(args)
    # a TV asked for without a number of rounds: rounds until the power for it (or a budget)
    rounds = args.rounds if args.rounds is not None or args.min_detectable_tv is None else "auto"
    options = dict(max_new_tokens=args.max_new_tokens, batch_size=args.batch_size, rounds=rounds, arms=args.arms,
                   seed=args.seed, alpha=args.alpha, min_detectable_tv=args.min_detectable_tv,
                   reference_tv=args.reference_tv,
                   max_tokens=args.max_tokens, max_seconds=args.max_seconds, timeout=args.timeout,
                   allow_failed_calls=args.allow_failed_calls, store=None if store is None else str(store), resume=args.resume,
                   progress=_progress_flag(args.progress), logprob_tolerance=args.logprob_tolerance)
    interrupted = False
    try:
        result = gen.audit_engine(engine, prompts, reference=args.reference, requests=requests,
                                  conditions=args.conditions, **options)
    except GenerationInterrupted as exc:
        if exc.result is None:
            raise KeyboardInterrupt from None
        result, interrupted = exc.result, True
    status = 130 if interrupted else gen.status_of(result, args.fail_on_inconclusive)
    paths = []
    if out is not None:
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
        arms += "".join(f", {c['name']} {c['tokens']}" for c in result.conditions if c["tokens"])
        if arms:
            print(f"  tokens by arm: {arms}")
        if result.acceptance:
            print("  acceptance: " + ", ".join(f"{k} {_short(v)}" for k, v in result.acceptance.items() if k != "note"))
        if paths:
            print(f"reports: {', '.join(str(p) for p in paths)}")
        elif result.failures:
            print("  the failed calls' tracebacks: give --out DIR (report.json) or --json to keep them")
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
    per_engine = [flag for flag in _given(args, _ENGINE_FLAGS)]
    if per_engine:
        raise _UsageError(f"{', '.join(per_engine)}: not with --suite (each [[generation]] case sets its own); with "
                          "--suite only --seed, --alpha, --max-tokens, --max-seconds, --timeout and --allow-failed-calls "
                          "apply to every case")
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
        report = run_generation_suite(suite, store_dir=store_dir, resume=args.resume, on_start=on_start,
                                          select=args.case, seed=args.seed, alpha=args.alpha, max_tokens=args.max_tokens,
                                          max_seconds=args.max_seconds, timeout=args.timeout,
                                          allow_failed_calls=args.allow_failed_calls,
                                          progress=_progress_flag(args.progress) if args.progress == "bar" else False)
    except gen.GenerationSuiteInterrupted as exc:
        report = exc.report
    status = report.exit_status(args.fail_on_inconclusive)
    paths = []
    if out is not None:
        for entry in report.results:
            gen.write_reports(entry.result, out / entry.case)
        paths.append(write_text_atomic(out / "report.json", json.dumps(report.to_dict(), indent=2) + "\n"))
        write_manifest(out, paths, complete=report.incomplete is None)
    findings = sum(r.result.verdict == "FINDING" for r in report.results)
    verdict = "FAIL" if status in (1, 3) else "ERROR" if status == 4 else ("INCOMPLETE" if status == 130 else
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
