"""The generation audit's schedule: its jobs run in rounds, one per process, and consumed in job order.

Consuming a job updates the e-processes and applies the stopping rules (a decisive violation, the
e-process's evidence, the budgets), so every process, and a resumed run, stops where one process
alone would.
"""

from __future__ import annotations

import logging
import math
import sys
import time
import traceback
from typing import Any, Optional

import numpy as np
import torch

from spectr_audit.errors import InvalidArgument
from spectr_audit.generation.analysis import largest_family, planned_tokens
from spectr_audit.generation.contract import GenerationContractError
from spectr_audit.generation.designs import Job
from spectr_audit.generation.records import JobRecord
from spectr_audit.generation.request import GenerationRequest
from spectr_audit.generation.scoring import _run_job
from spectr_audit.generation.store import SampleStore
from spectr_audit.generation.statistical_tests import NUM_BINS, PITEProcess
from spectr_audit.statistical.power import required_samples
from spectr_audit.statistical.sharding import WorkerFailed

#: Where the schedule says its plan (``rounds="auto"``).
LOG = logging.getLogger("spectr_audit.generation")


def _exception_line(exc: BaseException) -> str:
    """A failed call in one line: the engine's own exception (the cause the contract wrapped) where there is one,
    its type and the last line of its message; else the contract's complaint.

    >>> try:
    ...     raise GenerationContractError("generator raised on job 2") from ValueError("bad shape\\nrow 3 of 4")
    ... except GenerationContractError as exc:
    ...     _exception_line(exc)
    'ValueError: row 3 of 4'
    """
    root = exc.__cause__ if exc.__cause__ is not None else exc
    lines = [line for line in str(root).strip().splitlines() if line.strip()]
    return f"{type(root).__name__}: {lines[-1].strip()}" if lines else type(root).__name__


class _Collective:
    """This process's exchanges with the others of its ``torch.distributed`` group (none without shards)."""

    def __init__(self, shards):
        self.shards = shards
        self.rank, self.world_size = (0, 1) if shards is None else (shards.rank, shards.world_size)

    def gather(self, payload: Any) -> list:
        """Every process's payload, in rank order."""
        if self.shards is None:
            return [payload]
        import torch.distributed as dist

        gathered = [None] * self.world_size
        dist.all_gather_object(gathered, payload, group=self.shards.group)
        return gathered

    def broadcast(self, payload: Any) -> Any:
        """Rank 0's payload, in every process."""
        if self.shards is None:
            return payload
        import torch.distributed as dist

        box = [payload if self.rank == 0 else None]
        dist.broadcast_object_list(box, src=0, group=self.shards.group)
        return box[0]


def _open_store(path, config: dict, resume: bool, group: _Collective) -> tuple:
    """``(sink, records)``: the store (rank 0's only: the others write nothing) and the records it holds.

    Every process gets rank 0's stored records (or its error: a refused resumption is refused everywhere).
    """
    sink, payload = None, None
    if group.rank == 0:
        try:
            sink = SampleStore(path, config, resume=resume)
            payload = ("ok", {index: rec for index, _, rec in sink.records()})
        except InvalidArgument as exc:
            payload = ("error", str(exc))
    payload = group.broadcast(payload)
    if payload[0] == "error":
        raise InvalidArgument(payload[1])
    return sink, payload[1]


def _progress(enabled: Optional[bool], total: int):
    """A rich progress bar on a terminal (tokens per arm, evidence, time left), else None."""
    if enabled is False or (enabled is None and not sys.stderr.isatty()):
        return None
    try:
        from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn
    except ImportError:  # pragma: no cover - rich is a dependency
        return None
    progress = Progress(TextColumn("{task.description}"), BarColumn(), TextColumn("{task.completed}/{task.total} jobs"),
                        TimeRemainingColumn(), transient=True)
    progress.start()
    progress.add_task("generation audit", total=total)
    return progress


def _reference_tokens(request: GenerationRequest, size: int) -> int:
    """The reference tokens its own all-tokens PIT test needs to detect ``reference_tv`` with ``power`` at
    ``alpha / size`` (the family's share)."""
    options = request.options
    return required_samples(options.reference_tv, NUM_BINS, options.alpha / size, options.power)


def _stop_level(request: GenerationRequest) -> Optional[float]:
    """The e-process's p-value at which the audit may stop early, or None where it must not stop on it."""
    # The e-process may stop the audit once it alone would reject in the largest family the analysis
    # can build; the stopped audit's verdict is then a FINDING that the planned one would reach too,
    # so stopping adds no false alarm.  Not with a reference: there the one-sample tests may be set
    # aside (a numerics floor), and a sample stopped on them would bias the two-sample tests.
    if request.has_reference:
        return None
    return request.options.alpha / largest_family(request).holm_size


class _Schedule:
    """One run of an audit's jobs: what it consumed, what failed, the evidence so far, and why it stopped.

    ``request`` holds the jobs, the components and the options; ``stored`` the records a resumed store holds.
    """

    def __init__(self, request: GenerationRequest, stored: dict, sink: Optional[SampleStore], group: _Collective,
                 progress: Optional[bool]):
        options = request.options
        self.request, self.jobs, self.stored, self.sink, self.group = request, list(request.jobs), stored, sink, group
        self.options, self.greedy, self.stop_level = options, request.greedy, _stop_level(request)
        self.records: dict = {}  # job index -> records, every job consumed so far (in job order)
        self.failures: dict = {}  # job index -> (arm, message), every job that failed in this run
        self.failure_details: dict = {}  # job index -> (exception's type and last line, traceback text)
        self.errors: dict = {}  # job index -> the exception this process raised on it (with shards)
        self.eprocesses = {o: PITEProcess() for o in options.orderings}
        self.max_log_e = 0.0
        self.spread = False  # whether a consumed job had a law that is not one-hot (so: not greedy)
        self.stop_reason, self.start = "planned", time.perf_counter()
        self.totals = {"generation": 0.0, "reference": 0.0, "scoring": 0.0}
        self.emitted = 0
        self.bar = _progress(progress if group.rank == 0 else False, len(self.jobs))
        self.interrupted = False
        # rounds="auto": the planned power, checked once the first rounds (every arm) are consumed
        self.power_from = self.jobs[-1].index if options.until_power and self.jobs else None
        self.power_plan: Optional[dict] = None
        # the plan of an audit that runs until its power, said before the engine runs and again after the first
        # rounds (the command line shows the logger's INFO lines on stderr)
        self.say = LOG.info if group.rank == 0 else (lambda text: None)
        if self.power_from is not None:
            needed, size = planned_tokens(request)
            self.power_plan = {"requested_tv": options.min_detectable_tv, "power": options.power,
                               "tokens_needed": needed, "family_size": size, "first_rounds": options.rounds,
                               "extension_arm": None, "extension_rounds": 0, "tokens_per_second": {},
                               "estimated_seconds": None, "reached": False}
            if request.has_reference:  # the reference sized by its own test (docs/generation.md)
                self.power_plan.update(reference_tv=options.reference_tv,
                                       reference_tokens_needed=_reference_tokens(request, size),
                                       reference_rounds=0)
            budget = "; ".join(f"{name} {value:g}" for name, value in (("max_tokens", options.max_tokens),
                                                                        ("max_seconds", options.max_seconds))
                               if value is not None) or "no budget"
            self.say(f"plan: min detectable TV {options.min_detectable_tv:g} at power {options.power:g} needs "
                     f"{needed} engine tokens (alpha {options.alpha:g} over a family of up to {size} tests); "
                     f"{options.rounds} rounds of every arm ({len(self.jobs)} calls), then rounds of the fastest arm "
                     f"until then ({budget})")

    def mixture_p(self) -> float:
        """The p-value of the orders' averaged e-process (its running maximum)."""
        return float(math.exp(-self.max_log_e)) if self.max_log_e > 0 else 1.0

    def consume(self, job: Job, rec: JobRecord) -> Optional[str]:
        """Add one job's records, in job order; return a stop reason (None: go on)."""
        options = self.options
        self.records[job.index] = rec
        tokens = rec.engine.tokens
        self.emitted += int(tokens.token.size)
        for key, value in zip(("generation", "reference", "scoring"), rec.seconds):
            self.totals[key] += float(value)
        logs = [self.eprocesses[o].update(torch.from_numpy(tokens.pit[o])) for o in options.orderings]
        # the average of the orders' e-processes is one too (each a martingale of mean 1 under the null,
        # all on the same tokens in the same order)
        mixed = float(torch.logsumexp(torch.tensor(logs, dtype=torch.float64), 0)) - math.log(len(logs))
        self.max_log_e = max(self.max_log_e, mixed)
        if self.bar is not None:
            self.bar.update(self.bar.task_ids[0], advance=1,
                            description=f"{job.arm}: {self.emitted} tokens, evidence log E {self.max_log_e:.1f}")
        zero = tokens.mass <= options.zero_mass_tol
        margin = tokens.margin[zero]
        # a zero-mass token beyond the tolerance is decisive; with a reference the tolerance may still
        # grow to the reference's own numerics floor (known at the end), so only a token without a
        # margin stops the audit then
        beyond = ~np.isfinite(margin)
        if not self.request.has_reference:
            beyond |= margin > options.logit_tol
        if bool(beyond.any()) or bool((rec.engine.after_eos >= 0).any()):
            return "support"
        if self.greedy is None and not self.spread:
            self.spread = bool(np.any((tokens.variance > 1e-12) | (tokens.entropy > 1e-12)))
        # not on greedy audits: there the e-process does not decide (nor, so, stop)
        may_stop = self.greedy is False or self.spread
        if self.stop_level is not None and self.mixture_p() <= self.stop_level and may_stop:
            return "e-process"
        if self.power_from is not None and job.index >= self.power_from and self._power_reached():
            return "power"
        return None

    def _power_reached(self) -> bool:
        reached = self.emitted >= self.power_plan["tokens_needed"]
        self.power_plan["reached"] = reached
        return reached

    def _more_rounds(self) -> Optional[tuple]:
        """With ``rounds="auto"`` once every planned job is consumed: ``(rounds, arm, with the reference)`` to plan
        next, or None when
        the planned power is reached, the audit is greedy (its power is not in tokens) or no arm emitted a token.

        The further rounds run the arm that emitted the most engine tokens per second of generation so far (every
        process reads the same records, so they all choose alike); their number is what the tokens still needed
        take at that arm's tokens per round so far, and the plan is made again when they are consumed (the family,
        hence the tokens needed, may grow as more strata fill)."""
        plan = self.power_plan  # its tokens needed are those of the jobs planned so far
        needed, size = plan["tokens_needed"], plan["family_size"]
        if self._power_reached() or not (self.greedy is False or self.spread):
            return None
        arm_of = {job.index: job for job in self.jobs}
        tokens, seconds, generation, rounds_seen = {}, {}, {}, {}
        reference_total, reference_tokens, reference_rounds = 0, {}, {}  # the reference's: all, and by arm
        for index, rec in self.records.items():
            job = arm_of[index]
            if rec.reference is not None:
                made = int(rec.reference.tokens.token.size)
                reference_total += made
                reference_tokens[job.arm] = reference_tokens.get(job.arm, 0) + made
                reference_rounds.setdefault(job.arm, set()).add(job.round)
            if job.is_condition:  # a condition runs on its own design, in the first rounds only
                continue
            tokens[job.arm] = tokens.get(job.arm, 0) + int(rec.engine.tokens.token.size)
            seconds[job.arm] = seconds.get(job.arm, 0.0) + float(sum(rec.seconds))
            generation[job.arm] = generation.get(job.arm, 0.0) + float(rec.seconds[0])
            rounds_seen.setdefault(job.arm, set()).add(job.round)
        rates = {arm: tokens[arm] / max(generation[arm], 1e-9) for arm in tokens if tokens[arm] > 0}
        plan["tokens_per_second"] = {arm: round(rate, 3) for arm, rate in rates.items()}
        if not rates:
            return None
        arm = max(rates, key=lambda a: (rates[a], a == "ragged"))
        per_round = tokens[arm] / len(rounds_seen[arm])
        rounds = max(1, math.ceil((needed - self.emitted) / per_round))
        with_reference = False
        if "reference_tokens_needed" in plan:
            # the reference runs on the further rounds only while its own test is short of its tokens: the
            # rounds planned now stop where it has them (the next plan runs without it)
            plan["reference_tokens_needed"] = _reference_tokens(self.request, size)
            short = plan["reference_tokens_needed"] - reference_total
            if short > 0:
                ref_per_round = reference_tokens.get(arm, 0) / max(1, len(reference_rounds.get(arm, ())))
                rounds = min(rounds, max(1, math.ceil(short / max(ref_per_round, 1.0))))
                with_reference = True
                plan["reference_rounds"] += rounds
        if plan["extension_arm"] is None:  # the estimate made after the first rounds, in the result
            plan["estimated_seconds"] = round(rounds * seconds[arm] / len(rounds_seen[arm]), 3)
            self.say(f"after {plan['first_rounds']} rounds: {self.emitted} tokens; TV {plan['requested_tv']:g} needs "
                     f"{needed} (family of up to {size}): about {rounds} more rounds of {arm} (the fastest arm, "
                     f"{rates[arm]:.0f} tokens/s of generation), about {plan['estimated_seconds']:.0f} s")
        plan["extension_arm"] = arm
        plan["extension_rounds"] += rounds
        return rounds, arm, with_reference

    def attempt(self, job: Optional[Job]) -> tuple:
        """Run one job here: ``("ok", records)``, ``("fail", message)``, ``("interrupt",)``, ``("error", text)``."""
        if job is None:
            return ("none",)
        try:
            return ("ok", _run_job(job, self.request))
        except GenerationContractError as exc:
            return ("fail", str(exc), _exception_line(exc), "".join(traceback.format_exception(exc)))
        except KeyboardInterrupt:
            return ("interrupt",)
        except Exception as exc:  # with shards every process must reach the exchange, or the others hang
            if self.group.world_size == 1:
                raise
            self.errors[job.index] = exc
            return ("error", f"{type(exc).__name__}: {exc}")

    def run(self) -> None:
        """Run and consume the jobs until the plan is done or a stopping rule holds (``stop_reason``)."""
        try:
            self.stop_reason = self._jobs()
        except KeyboardInterrupt:
            self.interrupted = True
            self.stop_reason = "interrupted"
        except BaseException:
            if self.sink is not None:
                self.sink.close()
            raise
        finally:
            if self.bar is not None:
                self.bar.stop()

    def _over_tokens(self) -> bool:
        return self.options.max_tokens is not None and self.emitted >= self.options.max_tokens

    def _jobs(self) -> str:
        """Every job in order, stored ones replayed, the others in rounds; the stop reason.  With
        ``rounds="auto"`` more rounds are planned whenever the planned ones are consumed short of the power."""
        i = 0
        while True:
            reason = self._planned(i)
            if reason is not None:
                return reason
            i = len(self.jobs)
            more = self._more_rounds() if self.power_plan is not None else None
            if more is None:
                return "power" if self.power_plan is not None and self.power_plan["reached"] else "planned"
            self.request = self.request.extended(*more)
            self.jobs = list(self.request.jobs)
            # the tokens needed at the largest family the extended jobs can give (it may have grown)
            needed, size = planned_tokens(self.request)
            self.power_plan.update(tokens_needed=needed, family_size=size)
            self.stop_level = _stop_level(self.request)  # the largest family may grow with the jobs
            if self.bar is not None:
                self.bar.update(self.bar.task_ids[0], total=len(self.jobs))

    def _planned(self, i: int) -> Optional[str]:
        """The planned jobs from the ``i``-th on; a stop reason, or None once they are all consumed."""
        jobs, stored = self.jobs, self.stored
        while i < len(jobs):
            if self._over_tokens():
                return "max_tokens"
            job = jobs[i]
            if job.index in stored:  # finished by an earlier run of this audit: replayed, in job order
                i += 1
                reason = self.consume(job, stored[job.index])
                if reason is not None:
                    return reason
                continue
            # a round: the next `world` jobs not stored yet, one per process (the stored ones between
            # them are replayed in their place)
            batch, end = [], i
            while end < len(jobs) and len(batch) < self.group.world_size:
                if jobs[end].index not in stored:
                    batch.append(jobs[end])
                end += 1
            if self.options.max_seconds is not None and self.group.broadcast(
                    time.perf_counter() - self.start >= self.options.max_seconds):
                return "max_seconds"
            reason = self._consume_round(jobs[i:end], self._exchange(batch))
            i = end
            if reason is not None:
                return reason
        return None

    def _exchange(self, batch: list) -> dict:
        """Run this process's job of the round; every job's outcome by index (a process's error raised)."""
        rank, world = self.group.rank, self.group.world_size
        outcomes = self.group.gather(self.attempt(batch[rank] if rank < len(batch) else None))
        broken = [w for w, outcome in enumerate(outcomes) if outcome[0] == "error"]
        if broken:
            mine = self.errors.get(batch[rank].index) if rank < len(batch) else None
            if mine is not None:
                raise mine
            raise WorkerFailed(f"process {broken[0]} of {world} failed on {batch[broken[0]].case}: "
                               f"{outcomes[broken[0]][1]}")
        return {job.index: outcome for job, outcome in zip(batch, outcomes)}

    def _consume_round(self, jobs: list, outcome_of: dict) -> Optional[str]:
        """Consume a round's jobs in order (stored ones replayed, failed ones recorded); a stop reason or None."""
        for job in jobs:
            if self._over_tokens():
                return "max_tokens"
            if job.index in self.stored:
                reason = self.consume(job, self.stored[job.index])
            else:
                outcome = outcome_of[job.index]
                if outcome[0] == "interrupt":
                    self.interrupted = True
                    return "interrupted"
                if outcome[0] == "fail":
                    self.failures[job.index] = (job.arm, outcome[1])
                    self.failure_details[job.index] = outcome[2:]
                    if self.sink is not None:
                        self.sink.fail(job.index, job.arm, outcome[1])
                    continue
                if self.sink is not None:
                    self.sink.put(job.index, job.arm, outcome[1])
                reason = self.consume(job, outcome[1])
            if reason is not None:
                return reason
        return None

    def consumed(self) -> list:
        """``(index, arm, records)`` of every consumed job, in job order."""
        arm_of = {job.index: job.arm for job in self.jobs}
        return [(index, arm_of[index], self.records[index]) for index in sorted(self.records)]

    def failed_calls(self) -> list:
        """Every job that failed in this run, in job order: a dict of its index, arm, the exception's type and last
        line (the engine's own exception where it raised one), and the full traceback."""
        return [{"job": index, "arm": arm, "error": self.failure_details.get(index, (message, ""))[0],
                 "traceback": self.failure_details.get(index, (message, ""))[1]}
                for index, (arm, message) in sorted(self.failures.items())]

    def failed(self) -> list:
        """``(index, arm, message)`` of every job that failed in this run, in job order."""
        return [(index, arm, message) for index, (arm, message) in sorted(self.failures.items())]
