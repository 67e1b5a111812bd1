"""Command line: ``spectr-audit run | audit | bound | generation | list``.

``generation`` audits a whole engine's ``generate()`` (:mod:`spectr_audit.generation`): the toy
loop and its planted slips (``--engine toy`` / ``toy:SLIP``), a user factory
(``--engine package.module:factory``), or the ``[[generation]]`` cases of a suite
(``--suite generation``); its exit codes are below too (0 PASS, 1 FINDING or ERROR, 3
INCONCLUSIVE with ``--fail-on-inconclusive``).

Exit codes: 0 every verdict as expected, 1 findings, 2 usage or input error, 3 only inconclusive
results stood in the way (with ``--fail-on-inconclusive``, or ``--certify-tv`` where a
certificate was not reached; without either, an inconclusive result exits 0 and is listed), 4 (``run``
and ``audit``) no finding but an audit could not run: an ERROR (the verifier raised, broke the call's
contract or timed out), counted and printed apart from findings.

Under ``torchrun --nproc-per-node N -m spectr_audit run ...`` the processes join one
``torch.distributed`` group (gloo; NCCL with ``--device cuda``) and every statistical audit
spreads its chunks over them (:mod:`spectr_audit.statistical.sharding`): the counts and verdicts
are those of one process; the first process prints and writes the reports.
"""

from __future__ import annotations

import importlib
import sys
from typing import Optional, Sequence

from spectr_audit.cli._args import _UsageError, parse_model_spec, suite_names
from spectr_audit.cli._output import _join_torchrun, _PipeSafe, verdict_line
from spectr_audit.cli.parsers import COMMAND_MODULES, build_parser
from spectr_audit.errors import InvalidArgument, SpectrAuditError

__all__ = ["main", "build_parser", "parse_model_spec", "suite_names", "verdict_line"]


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Entry point of the ``spectr-audit`` console script; returns the exit code.

    Exit codes: 0, 1, 3, 4 as in the module docstring; 2 for usage and input errors (a message
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
    try:
        # the one place the command line loads an audit: the module of the command that runs
        return importlib.import_module(f"spectr_audit.cli.{COMMAND_MODULES[args.command]}").command(args)
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
