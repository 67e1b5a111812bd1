"""A run's plan, said before it starts: which cases each verifier is audited on, what that draws, how long.

:func:`plan_run` lays out the jobs :func:`~spectr_audit.run.runner.run_suite` will audit (the same
:func:`~spectr_audit.run.runner.plan_jobs`), the samples and draft tuples they take
(:func:`~spectr_audit.run.budget.planned_work`), and a rough time: each verifier is timed on one small
drafted batch of its first case and the work is scaled by it.  ``spectr-audit run`` prints
:meth:`RunPlan.lines` before its first audit.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any, Iterable, Optional

import torch

from spectr_audit.drafting.harness import draft
from spectr_audit.drafting.models import contexts_from
from spectr_audit.run import guard
from spectr_audit.run.budget import MemoryBudgetExceeded, check_audit, planned_work
from spectr_audit.run.options import AuditOptions
from spectr_audit.run.runner import plan_jobs
from spectr_audit.run.suite import Suite, case_selection

__all__ = ["RunPlan", "plan_run", "TIMING_ROWS", "TIMING_MAX_PROBABILITIES", "JOB_OVERHEAD_SECONDS",
           "SAMPLE_OVERHEAD_SECONDS"]

#: Rows of the one batch each verifier is timed on.
TIMING_ROWS = 4096
#: The most draft and target probabilities one timing batch holds (rows x K x (L + 1) x V): fewer rows on a large
#: vocabulary, so that planning a run never costs what the run itself would (a large V at 4,096 rows held
#: gigabytes before the first audit).
TIMING_MAX_PROBABILITIES = 2**22
#: Seconds a job takes besides its samples and tuples (the probe, the bounds, the report), and seconds the
#: statistical audit spends per sample besides drafting and verifying it (counting, partitions, tests): the
#: estimate's constants, measured on a 2-core machine (the default suite's 242 built-in audits took 25 s of CPU;
#: the README's K = 1 function's 6 audits, 4.5 million samples, 33 s).
JOB_OVERHEAD_SECONDS = 0.1
SAMPLE_OVERHEAD_SECONDS = 6e-6


@dataclasses.dataclass(frozen=True)
class RunPlan:
    """What a run will audit.

    Attributes
    ----------
    suite : str
    jobs : tuple of (verifier, case)
    selections : dict
        Per verifier given, by name: ``(K, L, why)`` as text: the values it is audited at, and where they
        come from (the selection, the verifier's declaration, the stated default).
    samples, tuples : int
        Samples the statistical audits and sampler checks draw (upper bound) and draft tuples the exact
        audits enumerate, over every job.
    seconds : float or None
        The estimated time (``None`` when no verifier could be timed, e.g. every one raised).
    untimed : tuple of str
        Verifiers whose timing batch raised (not in the estimate; their audits report why).
    unloadable : int
        Verifiers a case names that cannot be loaded (each becomes an error result).
    """

    suite: str
    jobs: tuple
    selections: dict
    samples: int
    tuples: int
    seconds: Optional[float]
    untimed: tuple = ()
    unloadable: int = 0

    def lines(self) -> list[str]:
        """The plan as the CLI prints it."""
        cases = sorted({c.name for _, c in self.jobs})
        verifiers = sorted({v.name for v, _ in self.jobs})
        out = [f"plan: suite {self.suite!r}: {len(self.jobs)} audits of {len(verifiers)} verifier(s) on "
               f"{len(cases)} case(s)"]
        for name, (ks, ls, why) in self.selections.items():
            out.append(f"  {name}: audited at K = num_drafts in {ks}, L = draft_len in {ls} ({why})")
        if not self.selections:
            out.append("  verifiers: " + ", ".join(verifiers) + " (the suite's own, or every built-in: each on the "
                       "cases it supports)")
        if len(cases) <= 12:
            out.append("  cases: " + ", ".join(cases))
        seconds = "unknown" if self.seconds is None else f"about {_duration(self.seconds)}"
        out.append(f"  samples: up to {self.samples:,}; exact enumeration: {self.tuples:,} draft tuples; "
                   f"estimated time: {seconds} (rough: from one timed batch of each verifier)")
        if self.untimed:
            out.append(f"  not timed (raised on the timing batch; the audits report why): {', '.join(self.untimed)}")
        return out


def _values(values: tuple) -> str:
    return "{" + ", ".join(map(str, values)) + "}"


def _duration(seconds: float) -> str:
    if seconds < 1:
        return "1 s"
    if seconds < 120:
        return f"{seconds:.0f} s"
    return f"{seconds / 60:.0f} min"


def _selection(verifier: Any, num_drafts: Any, draft_len: Any) -> tuple[str, str, str]:
    """The K and L a verifier is audited at, as text, and where they come from."""
    ks, ls = case_selection(verifier, num_drafts, draft_len)
    declared = getattr(verifier, "declares_shape", True)
    k_text = _values(ks) if ks is not None else (verifier.drafts_range() if hasattr(verifier, "drafts_range") else "any")
    l_text = _values(ls) if ls is not None else (verifier.draft_len_range() if hasattr(verifier, "draft_len_range")
                                                 else "any")
    why = []
    for argument, given in (("--num-drafts", num_drafts), ("--draft-len", draft_len)):
        if given is not None:
            why.append(f"{argument} as given")
    if not declared and (num_drafts is None or draft_len is None):
        why.append("it declares no num_drafts / draft_len: the default for a bare function is K = 1, L = 1; declare "
                   "them on it or select with --num-drafts / --draft-len")
    elif num_drafts is None or draft_len is None:
        why.append("as the verifier declares")
    return k_text, l_text, "; ".join(why)


def _seconds_per_row(verifier: Any, case: Any, seed: int) -> tuple[Optional[float], Optional[float]]:
    """Seconds per drafted and verified row, and per row of its exact law (``None`` where it has none), on one
    batch of ``case``; ``(None, None)`` when the verifier raises."""
    probabilities = case.num_drafts * (case.draft_len + 1) * case.draft_model.vocab_size
    rows = max(1, min(TIMING_ROWS, TIMING_MAX_PROBABILITIES // probabilities))
    contexts = contexts_from(case.prefix, torch.zeros(rows, 0, dtype=torch.int64))
    generator = torch.Generator().manual_seed(seed)
    try:
        start = time.process_time()
        batch = draft(case.draft_model, case.target_model, contexts, case.num_drafts, case.draft_len, generator,
                      verifier.draft_scheme)
        verifier.verify(batch.draft_tokens, batch.draft_probs, batch.target_probs, generator)
        per_row = (time.process_time() - start) / rows
        per_law = None
        if getattr(verifier, "has_exact_law", False):
            start = time.process_time()
            verifier.output_probs(batch.draft_tokens, batch.draft_probs, batch.target_probs)
            per_law = (time.process_time() - start) / rows
    except Exception:  # the audit itself reports it, as an error result
        return None, None
    return per_row, per_law


def plan_run(suite: Suite, verifiers: Optional[Iterable[Any]] = None, options: AuditOptions = AuditOptions(), *,
             num_drafts: Any = None, draft_len: Any = None, timing: bool = True) -> RunPlan:
    """The plan of ``run_suite(suite, verifiers, options, num_drafts=..., draft_len=...)``, before it runs.

    ``timing=False`` skips the timing batches (``seconds`` is then ``None``).
    """
    verifiers = list(verifiers) if verifiers is not None else None
    jobs, unloadable = plan_jobs(suite, verifiers, num_drafts=num_drafts, draft_len=draft_len)
    selections = {}
    for verifier in verifiers or ():
        selections[verifier.name] = _selection(verifier, num_drafts, draft_len)
    samples = tuples = 0
    seconds = 0.0
    timed: dict = {}
    untimed: list = []
    for verifier, case in jobs:
        job_samples, job_tuples = planned_work(verifier, case, options)
        samples += job_samples
        tuples += job_tuples
        seconds += JOB_OVERHEAD_SECONDS
        if not timing or getattr(case, "tree", None) is not None:
            continue
        if id(verifier) not in timed:
            try:  # a job the memory budget refuses is never run, so it is not timed either
                check_audit(verifier, case.laws() if hasattr(case, "laws") else case, options)
            except MemoryBudgetExceeded:
                continue
            with guard.time_limited(verifier, guard.check_timeout(options.verifier_timeout)) as limited:
                timed[id(verifier)] = _seconds_per_row(limited, case.laws() if hasattr(case, "laws") else case,
                                                       options.seed)
            if timed[id(verifier)][0] is None:
                untimed.append(verifier.name)
        per_row, per_law = timed[id(verifier)]
        if per_row is not None:
            seconds += job_samples * (per_row + SAMPLE_OVERHEAD_SECONDS) + job_tuples * (per_law or per_row)
    known = timing and (not jobs or len(untimed) < len({id(v) for v, _ in jobs}))
    return RunPlan(suite.name, tuple(jobs), selections, samples, tuples, seconds if known else None, tuple(untimed),
                   len(unloadable))

