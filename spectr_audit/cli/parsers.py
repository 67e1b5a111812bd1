"""The command line's parsers: every command's options, built without importing the audits.

:func:`build_parser` is what ``spectr-audit --help`` and every command read; the command that
runs is imported by name after parsing (``spectr_audit.cli.run``, ``audit``, ``bound``,
``generation``, ``listing``), so a command loads only what it uses.
"""

from __future__ import annotations

import argparse

from spectr_audit import defaults
from spectr_audit.cli._args import (
    _add_common,
    _add_resources,
    _add_sampling,
    _add_sampling_params,
    _int_at_least,
    _number_in,
    _positive_int,
    _positive_seconds,
    _probability,
    _temperature,
    _top_k,
    _top_p,
)
from spectr_audit.errors import InvalidArgument
from spectr_audit.run.gate import add_gate_arguments
from spectr_audit.run.selection import parse_values

__all__ = ["COMMAND_MODULES", "build_parser"]

#: The module of ``spectr_audit.cli`` that runs each command (its ``command(args) -> int``).
COMMAND_MODULES = {"run": "run", "audit": "audit", "bound": "bound", "generation": "generation", "list": "listing"}


def build_parser() -> argparse.ArgumentParser:
    """The ``spectr-audit`` parser with its five commands."""
    parser = argparse.ArgumentParser(
        prog="spectr-audit",
        description="Audit speculative-decoding verifiers: exactness, acceptance against the optimum.",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    _add_run_parser(sub)
    _add_audit_parser(sub)
    _add_bound_parser(sub)
    _add_generation_parser(sub)
    _add_list_parser(sub)
    return parser

def _values_arg(argument: str):
    """The argparse type of ``--num-drafts`` / ``--draft-len``: ``2``, ``1,2``, ``1-3`` (parse_values)."""
    def parse(text: str) -> tuple:
        try:
            return parse_values(text, argument)
        except InvalidArgument as exc:
            raise argparse.ArgumentTypeError(str(exc).partition(": ")[2]) from None

    return parse


def _add_run_parser(sub) -> None:
    """The parser of ``run``: the suite, the verifiers, the reports, the gate and the budgets."""
    run = sub.add_parser("run", help="audit verifiers on a suite and write reports", description=_RUN_DESCRIPTION,
                         epilog=_RUN_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    run.add_argument("--suite", default="default", help="built-in suite name or path to a suite .toml (default: default); "
                     "a suite's [[generation]] cases run with spectr-audit generation --suite")
    run.add_argument("--verifier", action="append", default=[], metavar="NAME_OR_IMPORT",
                     help="a built-in short name, package.module:attr or path/file.py:attr (repeatable; default: all built-ins)")
    run.add_argument("--num-drafts", type=_values_arg("--num-drafts"), default=None, metavar="K",
                     help="audit only the suite's cases of these K (e.g. 1, 1,2 or 1-3; default: every K each verifier "
                     "supports; a verifier that declares none: K = 1)")
    run.add_argument("--draft-len", type=_values_arg("--draft-len"), default=None, metavar="L",
                     help="audit only the suite's cases of these L (e.g. 3, 1,3 or 2-4; default: every L each verifier "
                     "supports; a verifier that declares none: L = 1)")
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
    add_gate_arguments(gate.add_argument)
    _add_sampling(run, gate)
    _add_sampling_params(run, logits=False)
    _add_resources(run)
    _add_common(run)


_EXIT_CODES = """exit codes:
  0  the verdict is as expected: exact, or a finding of a verifier declared inexact
  1  the verdict is not as expected (a finding of a verifier declared exact or undeclared,
     or no finding of one declared inexact); run: also a gate threshold broken
  2  usage or input error (a message naming the argument; nothing audited)
  3  only inconclusive results stood in the way (--fail-on-inconclusive, or --certify-tv
     where the certificate was not reached)
  4  no finding, but an audit could not run: the verifier raised, broke the call's contract
     or ran past --verifier-timeout (an ERROR result: its exception's last line and where
     it was raised are printed; the traceback is in report.json, details.traceback)
  130  interrupted (Ctrl-C)"""

_RUN_DESCRIPTION = """Audit verifiers on a suite's cases and write the reports.  Each verifier runs on the cases
it supports: the K = num_drafts and L = draft_len it declares (max_drafts, max_draft_len, or exact
values num_drafts = 1, draft_len = 3 on the verifier), narrowed by --num-drafts / --draft-len.  A
plain function that declares none is audited at K = 1, L = 1 unless --num-drafts / --draft-len
say otherwise.  The plan (the cases, the samples, an estimated time) is printed before the first
audit; the summary counts findings, errors and inconclusive results apart."""

_RUN_EPILOG = """examples:
  spectr-audit run                                         # every built-in verifier, suite default
  spectr-audit run --verifier my_verifier.py:my_verify     # a bare function: K = 1, L = 1
  spectr-audit run --verifier my_verifier.py:my_verify --num-drafts 1-2 --draft-len 1,2
  spectr-audit run --verifier my_pkg.mod:MyVerifier --max-tv 1e-9 --html

"""

_RUN_EPILOG += _EXIT_CODES

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


def _add_audit_parser(sub) -> None:
    """The parser of ``audit``: the verifier, the case and the budgets."""
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


def _add_bound_parser(sub) -> None:
    """The parser of ``bound``: the draft, the target and K."""
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


_GENERATION_DESCRIPTION = """Audit a generation engine: what its generate() emits, every token, against the target
model's own law (docs/generation.md).  The audit runs the engine under its batch designs
(--arms: single, equal, ragged, repeated), scores every emitted token with the engine's scorer
(the target without speculation, teacher-forced), and tests the tokens' randomized PITs and
surprisals, one Holm family at the false-alarm rate --alpha.  Verdicts: PASS (nothing rejected,
at the power planned for --min-detectable-tv), FINDING, INCONCLUSIVE (nothing rejected, too few
tokens for the planned power), ERROR (no job could be scored, or more engine calls failed than
--allow-failed-calls allows: the gate fails whatever the tests say).  The first line printed is
the verdict with the deciding test and its p-value (an ERROR's: how many calls failed, the first
one's exception and where the tracebacks are); then how it was decided, the rejected tests, the
decisive tokens and the failed calls.

--engine SPEC is one of
  toy                      the correct speculative loop over a small toy model pair
  toy:SLIP                 the same loop with a planted slip (spectr-audit list shows them)
  toy-requests             the correct loop over whole requests, one per row (without
                           --requests: every feature on, penalties to logprobs)
  toy-requests:SLIP        that loop with a slip in the rest of the request
  package.module:factory   a factory (called with no arguments) returning a dict or object with
  path/file.py:factory     generate, score and vocab_size, and optionally reference (the same
                           engine with speculation off), draft_score, prompts, eos_token_id

--requests FILE audits whole requests (docs/generation.md, "Whole requests"): a JSON list of
objects whose keys are Request's fields (temperature, top_k, top_p, min_p, repetition_penalty,
presence_penalty, frequency_penalty, logit_bias, bad_words, min_tokens, stop_token_ids, stop,
max_tokens, seed, logprobs, constraint), given to the rows in turn; each is checked before any
engine runs, an error naming the file, the request's index and the field.

--suite runs the [[generation]] cases of a suite instead: the built-in 'generation' (the toy loop
and its slips) or a .toml file of your own, each case with the verdict it expects.  Suites'
generation cases run here, not under `spectr-audit run` (whose report holds verifier audits)."""

_GENERATION_EPILOG = """examples:
  spectr-audit generation --engine toy --max-new-tokens 16 --min-detectable-tv 0.25
  spectr-audit generation --engine toy:shared-stream --json
  spectr-audit generation --engine toy-requests --requests requests.json --logprob-tolerance 0.05
  spectr-audit generation --engine my_pkg.audit:make_engine --prompts prompts.txt --rounds 4 \\
      --store audit.sqlite --out report/          # Ctrl-C, then the same line with --resume
  spectr-audit generation --suite generation

exit codes:
  0  PASS (and INCONCLUSIVE without --fail-on-inconclusive); a suite: every case as expected
  1  FINDING (whatever else failed); a suite: a case not as expected
  2  usage or input error (a message naming the argument; nothing audited)
  3  INCONCLUSIVE, with --fail-on-inconclusive
  4  ERROR: no finding, but more engine calls failed than --allow-failed-calls allows (default
     0), or none finished (the first failure's exception is printed; the tracebacks are in
     report.json, failed_calls[].traceback)
  130  interrupted (Ctrl-C): what finished is written (--out, --store), marked incomplete"""


def _rounds(text: str):
    """``--rounds``: a positive integer, or ``auto`` (rounds until the planned power)."""
    if text == "auto":
        return text
    try:
        return _positive_int(text)
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(f"expected a positive integer or auto, got {text!r}") from None


def _arms(text: str) -> tuple:
    """The comma-separated arm names (checked against the generation audit's arms when the command runs)."""
    arms = tuple(a.strip() for a in text.split(",") if a.strip())
    if not arms:
        raise argparse.ArgumentTypeError(f"expected comma-separated arm names, got {text!r}")
    return arms


def _vocab(text: str) -> int:
    return _int_at_least(text, 2, "an integer >= 2")


def _non_negative_int(text: str) -> int:
    return _int_at_least(text, 0, "an integer >= 0")


def _positive_number(text: str) -> float:
    return _number_in(text, 0.0, float("inf"), True, True, "a number > 0")


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
    audit.add_argument("--rounds", type=_rounds, default=None, metavar="N|auto",
                       help="times the whole design runs, with new seeds (default 1, or auto when "
                            "--min-detectable-tv is given); auto: two rounds of every arm, then rounds of the fastest "
                            "arm until the min detectable TV is reached or --max-tokens / --max-seconds stops it (the "
                            "plan is printed first)")
    audit.add_argument("--arms", type=_arms, default=None, metavar="LIST",
                       help="batch designs, comma-separated: single,equal,ragged,repeated (default all)")
    audit.add_argument("--conditions", type=_arms, default=None, metavar="LIST",
                       help="serving conditions run as arms of their own, comma-separated: prefix-cache, "
                            "chunked-prefill[=N], preemption, concurrency, draft-depth=N, long-context[=N], or 'all' "
                            "(every one the engine offers); the engine (its factory's 'conditions') makes the engine "
                            "under each, and a condition it does not show reached keeps the verdict from PASS")
    audit.add_argument("--seed", type=int, default=None, help=f"seed of every job (default {defaults.SEED})")
    audit.add_argument("--alpha", type=_probability, default=None, metavar="ALPHA",
                       help=f"familywise false-alarm rate (default {defaults.ALPHA:g})")
    audit.add_argument("--min-detectable-tv", type=_probability, default=None, metavar="TV",
                       help="the TV the PASS verdict needs the power to detect (default "
                       f"{defaults.GENERATION_MIN_DETECTABLE_TV:g}); below that power nothing rejected is INCONCLUSIVE; "
                       "given without --rounds, the audit runs rounds until that power (--rounds auto)")
    audit.add_argument("--reference-tv", type=_probability, default=None, metavar="TV",
                       help="with --rounds auto and the engine's reference: the TV the reference's own test is sized "
                            "for (default twice --min-detectable-tv): the reference runs on the first round of every arm, then only "
                            "until it has the tokens that test needs")
    audit.add_argument("--max-tokens", type=_positive_int, default=None, metavar="N",
                       help="stop after this many engine tokens (the result says how far it got)")
    audit.add_argument("--max-seconds", type=_positive_seconds, default=None, metavar="S",
                       help="stop after this many seconds")
    audit.add_argument("--timeout", type=_positive_seconds, default=None, metavar="S",
                       help="per-call limit of generate(), the reference and the scorers (a call past it fails its job)")
    audit.add_argument("--allow-failed-calls", type=_non_negative_int, default=None, metavar="N",
                       help="how many jobs' engine calls (generate(), the reference, the scorers) may fail before the "
                       "verdict is ERROR, exit 4 (default 0; a FINDING keeps exit 1)")
    audit.add_argument("--reference", action=argparse.BooleanOptionalAction, default=None,
                       help="audit with the engine's reference generator (speculation off): two-sample tests and the "
                       "numerics floor (default: a factory's when it gives one; not the toy's, whose scorer is exact)")
    audit.add_argument("--eos-token-id", type=_non_negative_int, default=None, metavar="ID",
                       help="the engine's end-of-sequence id (default: the factory's; the toy's slip eos-inside-block 0)")
    audit.add_argument("--requests", metavar="FILE", default=None,
                       help="audit whole requests: a JSON list of objects of Request's fields, e.g. "
                       '[{"temperature": 0, "repetition_penalty": 1.3, "logprobs": 2}, {"temperature": 0.7, '
                       '"seed": 5}], given to the rows in turn (logit_bias: {"7": -1.5}; bad_words: a list of '
                       "token-id lists; constraint: {\"automaton\": {...}} only). The engine must take requests "
                       "(toy-requests does; default: its own, every feature on)")
    audit.add_argument("--logprob-tolerance", type=_positive_number, default=None, metavar="X",
                       help="with requests: the largest gap between a returned log-probability and the scorer's that "
                       "is not a finding (default 0.1)")
    toy = gen.add_argument_group("the toy engines (--engine toy, toy:SLIP; toy-requests takes no --temperature, "
                                 "--top-k, --top-p: its requests carry them)")
    toy.add_argument("--vocab-size", type=_vocab, default=None, metavar="V",
                     help="vocabulary (default 16; toy-requests 12)")
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


def _add_list_parser(sub) -> None:
    """The parser of ``list``."""
    lst = sub.add_parser("list", help="list the registered verifiers (every namespace), the generation engines and "
                         "the suites")
    lst.add_argument("--json", action="store_true")
