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
import sys
from typing import Optional, Sequence

from spectr_audit.cli._args import _UsageError, parse_model_spec, suite_names
from spectr_audit.cli._output import _join_torchrun, _PipeSafe, verdict_line
from spectr_audit.cli.audit import _add_audit_parser, _cmd_audit
from spectr_audit.cli.bound import _add_bound_parser, _cmd_bound
from spectr_audit.cli.generation import _add_generation_parser, _cmd_generation
from spectr_audit.cli.listing import _add_list_parser, _cmd_list
from spectr_audit.cli.run import _add_run_parser, _cmd_run

__all__ = ["main", "build_parser", "parse_model_spec", "suite_names", "verdict_line"]


def build_parser() -> argparse.ArgumentParser:
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


_COMMANDS = {"run": _cmd_run, "audit": _cmd_audit, "bound": _cmd_bound, "list": _cmd_list,
             "generation": _cmd_generation}


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
