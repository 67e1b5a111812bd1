"""What the commands print: the verdict line, a result, progress; pipe-safe streams; the one rank that prints."""

from __future__ import annotations

import atexit
import os
import sys
from typing import Optional

import torch
import torch.distributed as dist


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


#: This process's rank under ``torchrun`` (0 otherwise): only rank 0 prints and writes reports.
_RANK = 0


def _join_torchrun(args) -> None:
    """Under ``torchrun`` (``WORLD_SIZE`` > 1), join the process group the statistical audits shard over."""
    global _RANK
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        return
    if not dist.is_initialized():
        cuda = str(getattr(args, "device", "cpu")).startswith("cuda") and torch.cuda.is_available()
        if cuda:
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group("nccl" if cuda else "gloo")
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
