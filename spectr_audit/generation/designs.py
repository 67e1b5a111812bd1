"""The batch designs the generation audit runs the engine under, as separate arms, and their jobs.

An engine's generation-loop bugs depend on how requests are batched: a rejected tail left in the
KV cache of the rows that accepted less, rows permuted when one finishes, requests sharing one
random stream.  The audit therefore decides the batches itself:

``single``
    every prompt alone (batch 1);
``equal``
    ``batch_size`` prompts at a time, each cut to the shortest of them (equal lengths);
``ragged``
    ``batch_size`` prompts of different lengths at a time, and, where the engine takes one limit
    per row, different ``max_new_tokens`` so that rows finish at different times;
``repeated``
    ``batch_size`` copies of one prompt in one batch (independence across requests).

Serving conditions (:mod:`~spectr_audit.generation.conditions`) add their own jobs to each round, after the
arms: the ``arm`` of such a job is the condition's name.

A job is one generator call (a follow-up job: two): its arm, round, prompts, limits and seed.  Seeds are functions of
the audit's seed and the job's index, so a resumed or sharded audit runs the very same jobs.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence, Union

from spectr_audit._arguments import check_int_at_least
from spectr_audit.errors import InvalidArgument
from spectr_audit.generation.conditions import tiled
from spectr_audit.statistical.sharding import chunk_seed

__all__ = ["ARMS", "Job", "plan_jobs"]

#: Every batch design, in the order the audit runs them.
ARMS = ("single", "equal", "ragged", "repeated")

#: The stream of job seeds (apart from the statistical audit's chunk streams).
_JOB_STREAM = 11


@dataclasses.dataclass(frozen=True)
class Job:
    """One generator call of the audit.

    Attributes
    ----------
    index : int
        Position in the audit's schedule (seeds and resumption key on it).
    arm : str
    round : int
    prompt_ids : tuple of int
        Which of the audit's prompts each row is (a prompt id may repeat).
    prompts : tuple of tuple of int
        The token ids each row gets (a prompt, or its prefix in the ``equal`` arm).
    max_new_tokens : int or tuple of int
    seed : int
    follow_up : bool
        The job runs two calls (a ``prefix-cache`` condition): the first on the first half of ``prompts``, the
        second on each of them followed by what the first call emitted for it (the rows of the second half,
        whose ``prompts`` entries are the first half's again: the follow-ups' are known only once it ran).
    """

    index: int
    arm: str
    round: int
    prompt_ids: tuple
    prompts: tuple
    max_new_tokens: Union[int, tuple]
    seed: int
    follow_up: bool = False
    #: Whether the reference runs on the job too (the further rounds of ``rounds="auto"`` drop it once the
    #: reference holds the tokens its own test needs).
    reference: bool = True

    @property
    def is_condition(self) -> bool:
        """A serving condition's job (its arm is the condition's name)."""
        return self.arm not in ARMS

    @property
    def case(self) -> str:
        """The job in words, for error messages."""
        what = "condition" if self.is_condition else "arm"
        return f"{what} {self.arm}, round {self.round}, job {self.index} ({len(self.prompts)} rows)"

    @property
    def limits(self) -> tuple:
        """``max_new_tokens`` per row."""
        if isinstance(self.max_new_tokens, tuple):
            return self.max_new_tokens
        return (self.max_new_tokens,) * len(self.prompts)


def _groups(count: int, size: int, offset: int) -> list:
    """Consecutive groups of ``size`` prompt ids, cycling, starting at ``offset``."""
    if count <= 0:
        return []
    ids = [(offset + i) % count for i in range(count)]
    return [tuple(ids[i : i + size]) for i in range(0, count, size)]


def plan_jobs(prompts: Sequence[Sequence[int]], *, arms: Sequence[str] = ARMS, batch_size: int = 4,
              rounds: int = 1, max_new_tokens: int = 32, seed: int = 0,
              per_row_max_new_tokens: bool = False, first_round: int = 0, first_index: int = 0,
              conditions: Sequence = (), reference: bool = True) -> list[Job]:
    """Every job of the audit, arm by arm within each round (then each of ``conditions``, the
    :class:`~spectr_audit.generation.conditions.Condition` objects, on its design), rounds in order.

    ``first_round`` and ``first_index`` continue a plan: the rounds ``first_round ... first_round + rounds - 1``,
    their jobs numbered from ``first_index`` (more rounds of an audit that runs until its planned power).

    Examples
    --------
    >>> jobs = plan_jobs([[1, 2, 3], [4, 5], [6]], batch_size=2, max_new_tokens=8)
    >>> [(j.arm, j.prompt_ids) for j in jobs]          # doctest: +NORMALIZE_WHITESPACE
    [('single', (0,)), ('single', (1,)), ('single', (2,)), ('equal', (0, 1)), ('equal', (2,)),
     ('ragged', (2, 0)), ('ragged', (1,)), ('repeated', (0, 0)), ('repeated', (1, 1)), ('repeated', (2, 2))]
    >>> jobs[3].prompts                                 # cut to the shorter prompt
    ((1, 2), (4, 5))
    >>> jobs[5].prompts                                 # the shortest prompt with the longest
    ((6,), (1, 2, 3))
    """
    unknown = [a for a in arms if a not in ARMS]
    if unknown or not arms:
        raise InvalidArgument(f"arms: expected some of {ARMS}, got {list(arms)!r}")
    check_int_at_least("batch_size", batch_size, 2)
    check_int_at_least("rounds", rounds, 1)
    check_int_at_least("max_new_tokens", max_new_tokens, 1)
    prompts = [tuple(p) for p in prompts]
    jobs: list[Job] = []

    def add(arm, round_, ids, rows, limit, follow_up=False):
        index = first_index + len(jobs)
        jobs.append(Job(index, arm, round_, tuple(ids), tuple(rows), limit, chunk_seed(seed, _JOB_STREAM, index),
                        follow_up, reference))

    def ragged(round_):
        # longest and shortest together: sort by length, then interleave the two ends
        order = sorted(range(len(prompts)), key=lambda i: (len(prompts[i]), i))
        mixed = [order[(k // 2) if k % 2 == 0 else len(order) - 1 - k // 2] for k in range(len(order))]
        return mixed[round_ % len(mixed):] + mixed[: round_ % len(mixed)]

    def limits(count):
        return (tuple(max(1, max_new_tokens * (count - r) // count) for r in range(count))
                if per_row_max_new_tokens else max_new_tokens)

    for round_ in range(first_round, first_round + rounds):
        for arm in ARMS:
            if arm not in arms:
                continue
            if arm == "single":
                for i in range(len(prompts)):
                    add(arm, round_, (i,), (prompts[i],), max_new_tokens)
            elif arm == "equal":
                for ids in _groups(len(prompts), batch_size, round_):
                    shortest = min(len(prompts[i]) for i in ids)
                    add(arm, round_, ids, [prompts[i][:shortest] for i in ids], max_new_tokens)
            elif arm == "ragged":
                mixed = ragged(round_)
                for start in range(0, len(mixed), batch_size):
                    ids = mixed[start : start + batch_size]
                    add(arm, round_, ids, [prompts[i] for i in ids], limits(len(ids)))
            else:
                for i in range(len(prompts)):
                    add(arm, round_, (i,) * batch_size, (prompts[i],) * batch_size, max_new_tokens)
        for condition in conditions:
            _condition_jobs(condition, prompts, round_, batch_size, max_new_tokens, per_row_max_new_tokens, add,
                            ragged, limits)
    return jobs


def _condition_jobs(condition, prompts: list, round_: int, batch_size: int, max_new_tokens: int,
                    per_row: bool, add, ragged, limits) -> None:
    """The jobs of one serving condition in one round (``docs/generation.md``, "Serving conditions")."""
    name, kind = condition.name, condition.kind
    if kind == "prefix-cache":
        for ids in _groups(len(prompts), batch_size, round_):
            rows = [prompts[i] for i in ids]
            limit = max_new_tokens if not per_row else (max_new_tokens,) * (2 * len(ids))
            add(name, round_, tuple(ids) * 2, rows * 2, limit, follow_up=True)
    elif kind in ("preemption", "concurrency"):
        count = max(2 * batch_size, len(prompts))
        ids = [(round_ + k) % len(prompts) for k in range(count)]
        add(name, round_, ids, [prompts[i] for i in ids], limits(count) if kind == "concurrency" else max_new_tokens)
    elif kind == "draft-depth":
        mixed = ragged(round_)
        for start in range(0, len(mixed), batch_size):
            ids = mixed[start : start + batch_size]
            add(name, round_, ids, [prompts[i] for i in ids], limits(len(ids)))
    elif kind == "chunked-prefill":
        mixed = ragged(round_)
        for start in range(0, len(mixed), batch_size):
            ids = mixed[start : start + batch_size]
            rows = [tiled(prompts[i], condition.value) if k % 2 == 0 else prompts[i] for k, i in enumerate(ids)]
            add(name, round_, ids, rows, limits(len(ids)))
    else:  # long-context
        for ids in _groups(len(prompts), batch_size, round_):
            add(name, round_, ids, [tiled(prompts[i], condition.value) for i in ids], limits(len(ids)))
