"""One generation audit, built once: its checked options, its wrapped components, its prompts and its jobs.

:meth:`GenerationRequest.build` checks every argument of :func:`~spectr_audit.generation.audit_generation`
that shapes the audit (each bad one an ``InvalidArgument`` naming it), wraps the generator, the scorer,
the reference and the draft scorer in the contract, and plans the jobs; the schedule, the scoring of a job
and the analysis are handed the request and read it, never re-assembling it from keywords.
:class:`RunOutcome` is what the schedule hands the analysis: the jobs consumed and failed, and how the
run ended.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, Callable, Optional, Sequence

from spectr_audit.contract.requests import Request
from spectr_audit.errors import InvalidArgument
from spectr_audit.generation.conditions import check_conditions
from spectr_audit.generation.contract import Generator, ScoredLogits, Scorer, as_generator, as_scorer, check_prompts
from spectr_audit.generation.designs import plan_jobs
from spectr_audit.generation.options import _check_options, _Options

__all__ = ["GenerationRequest", "RunOutcome"]


@dataclasses.dataclass(frozen=True)
class GenerationRequest:
    """An audit's checked options, components, prompts and planned jobs.

    Attributes
    ----------
    options : the checked options
    prompts : list of token-id lists, checked
    generator, scorer : the engine under audit and the truth, wrapped in the contract
    reference, draft_scorer : optional, wrapped
    jobs : tuple of :class:`~spectr_audit.generation.designs.Job`
    greedy : bool, optional
        The caller's switch (None: detected from the scored laws).
    """

    options: _Options
    prompts: list
    generator: Generator
    scorer: Scorer
    reference: Optional[Generator]
    draft_scorer: Optional[Scorer]
    jobs: tuple
    greedy: Optional[bool]
    requests: tuple = ()
    logprob_tolerance: float = 0.1
    #: The engine's detokenizer (token ids -> text) for stop strings, and the order whose stop-string rule applies
    #: (the scorer's, read once before any engine call): :meth:`~spectr_audit.contract.requests.Request.stop_position`.
    detokenize: Optional[Callable] = None
    stop_order: str = "vllm"
    #: The serving conditions (:class:`~spectr_audit.generation.conditions.Condition`, each with its wrapped
    #: generator), in the order their jobs run within a round.
    conditions: tuple = ()

    def generator_for(self, job) -> Generator:
        """The engine that runs ``job``: its condition's, or the generator."""
        if job.is_condition:
            return next(c.generator for c in self.conditions if c.name == job.arm)
        return self.generator

    def stop_position(self, row: Sequence[int], request) -> int:
        """Where ``row`` ends under ``request``: its first stop token or completed stop string (-1: none)."""
        return request.stop_position(row, self.options.eos_token_id, self.detokenize, self.stop_order)

    @property
    def has_requests(self) -> bool:
        return bool(self.requests)

    def row_requests(self, job) -> Optional[list]:
        """The request of each row of ``job`` (None without requests): the audit's requests in turn, counted over
        the rows of every job in schedule order, so that each batch mixes them; in the single and repeated arms,
        whose repeated prompts the independence tests pair, by the prompt (a pair shares one request).  A seeded
        request's row gets a seed of its own, derived from the request's seed and the row's place."""
        if not self.requests:
            return None
        start = self._row_starts[job.index]
        out = []
        for i in range(len(job.prompts)):
            if job.arm in ("single", "repeated"):
                # the independence tests pair repeated prompts (within a batch, across calls): a prompt there
                # always carries the same request, so a pair shares one law
                request = self.requests[job.prompt_ids[i] % len(self.requests)]
            else:
                request = self.requests[(start + i) % len(self.requests)]
            if request.seed is not None:
                # a seed of the row's own, from the request's and the row's place in the schedule: repeated
                # requests stay independent draws (the independence tests assume them), reruns reproducible
                request = dataclasses.replace(request, seed=(request.seed * 1_000_003 + start + i) % (1 << 31))
            out.append(request)
        return out

    @functools.cached_property
    def _row_starts(self) -> dict:
        """Job index -> how many rows the jobs before it hold (the requests' turn at its first row), counted once:
        an audit that runs until its power plans thousands of jobs, and every one reads it."""
        starts, count = {}, 0
        for job in sorted(self.jobs, key=lambda j: j.index):
            starts[job.index] = count
            count += len(job.prompts)
        return starts

    def request_kinds(self) -> tuple:
        """The strata of the requests, fixed before any engine call: each distinct ``Request.kind`` in the order
        first given, where the requests are of more than one kind (one kind is the stratum ``all``)."""
        kinds = tuple(dict.fromkeys(r.kind for r in self.requests))
        return kinds if len(kinds) > 1 else ()

    def request_checks(self) -> tuple:
        """The whole-request checks the audit runs, known before any engine call."""
        if not self.requests:
            return ()
        return ((("logprobs",) if any(r.logprobs is not None for r in self.requests) else ()) + ("stopping",)
                + (("constraint",) if any(r.constraint is not None for r in self.requests) else ()))

    @classmethod
    def build(cls, generate: Any, score: Any, prompts: Sequence[Sequence[int]], *, vocab_size: int,
              reference: Any = None, draft_score: Any = None, greedy: Optional[bool] = None,
              per_row_max_new_tokens: Optional[bool] = None, name: Optional[str] = None,
              requests: Any = None, logprob_tolerance: float = 0.1, detokenize: Optional[Callable] = None,
              conditions: Any = None, **options: Any) -> "GenerationRequest":
        """Check and wrap everything; ``options`` are :func:`~spectr_audit.generation.audit_generation`'s
        (``max_new_tokens`` ... ``eos_token_id``), all of them given."""
        checked = _check_options(vocab_size=vocab_size, has_draft_scorer=draft_score is not None, **options)
        prompts = check_prompts(prompts, checked.vocab_size)
        for flag, value in (("greedy", greedy), ("per_row_max_new_tokens", per_row_max_new_tokens)):
            if value is not None and not isinstance(value, bool):
                raise InvalidArgument(f"{flag}: expected None, True or False, got {value!r}")
        if name is not None and not isinstance(name, str):
            raise InvalidArgument(f"name: expected a string, got {name!r}")
        generator = as_generator(generate, name=name, per_row_max_new_tokens=per_row_max_new_tokens,
                                 argument="generate")
        scorer = as_scorer(score, checked.vocab_size, argument="score")
        draft_scorer = (None if draft_score is None else
                        as_scorer(draft_score, checked.vocab_size, component="draft scorer", argument="draft_score"))
        reference_gen = (None if reference is None else
                         as_generator(reference, component="reference", argument="reference"))
        def under(obj, condition):  # the engine under a condition keeps the generator's declarations by default
            return as_generator(obj, name=f"{generator.name} [{condition}]", component=f"generator [{condition}]",
                                argument=f"conditions[{condition!r}]",
                                per_row_max_new_tokens=_declared(obj, "per_row_max_new_tokens", generator),
                                accepts_requests=_declared(obj, "accepts_requests", generator),
                                seeded=_declared(obj, "seeded", generator))

        checked_conditions = check_conditions(conditions, under)
        jobs = plan_jobs(prompts, arms=checked.arms, batch_size=checked.batch_size, rounds=checked.rounds,
                         max_new_tokens=checked.max_new_tokens, seed=checked.seed,
                         per_row_max_new_tokens=generator.per_row_max_new_tokens, conditions=checked_conditions)
        if checked.until_power and reference is not None:
            # sized by its own test: the reference runs on the first round of every arm (every design and
            # condition once, for the two-sample tests by arm), then only while its test is short of its tokens
            jobs = [dataclasses.replace(job, reference=False) if job.round > 0 else job for job in jobs]
        if detokenize is None and requests is not None:  # the engine's own, where it carries one
            detokenize = getattr(generate, "detokenize", None)
        checked_requests = _check_requests(requests, checked.vocab_size, generator, reference_gen, detokenize,
                                           prompts)
        if (isinstance(logprob_tolerance, bool) or not isinstance(logprob_tolerance, (int, float))
                or not math.isfinite(logprob_tolerance) or logprob_tolerance <= 0):
            raise InvalidArgument(f"logprob_tolerance: expected a finite number > 0, got {logprob_tolerance!r}")
        order = _probe_scorer(scorer, prompts, checked_requests) if checked_requests else None
        return cls(checked, prompts, generator, scorer, reference_gen, draft_scorer, tuple(jobs), greedy,
                   checked_requests, float(logprob_tolerance), detokenize, order or "vllm", checked_conditions)

    @property
    def has_reference(self) -> bool:
        return self.reference is not None

    @property
    def names(self) -> tuple:
        """The generator's and the scorer's names, for the result."""
        return self.generator.name, self.scorer.name

    def jobs_by_index(self) -> dict:
        return {job.index: job for job in self.jobs}

    def extended(self, rounds: int, arm: str, reference: bool = True) -> "GenerationRequest":
        """The same request with ``rounds`` more rounds of ``arm`` planned after its jobs (``rounds="auto"``), the
        reference on them or not: the new jobs continue the rounds and the job numbering, so each gets a seed of
        its own and a resumed audit plans the very same ones."""
        last = self.jobs[-1]
        options = self.options
        more = plan_jobs(self.prompts, arms=(arm,), batch_size=options.batch_size, rounds=rounds,
                         max_new_tokens=options.max_new_tokens, seed=options.seed,
                         per_row_max_new_tokens=self.generator.per_row_max_new_tokens, first_round=last.round + 1,
                         first_index=last.index + 1, reference=reference)
        return dataclasses.replace(self, jobs=self.jobs + tuple(more))

    def config(self) -> dict:
        """What a stored audit must match to be resumed."""
        config = self.options.config(self.prompts, self.has_reference, self.draft_scorer is not None,
                                     self.generator.per_row_max_new_tokens)
        if self.requests:
            config["requests"] = [r.describe() for r in self.requests]
            config["logprob_tolerance"] = self.logprob_tolerance
        if self.conditions:
            config["conditions"] = [c.name for c in self.conditions]
        return config


def _declared(obj: Any, flag: str, generator: Generator) -> bool:
    """``obj``'s own declaration of ``flag``, else the generator's (the same engine under another setting)."""
    own = getattr(obj, flag, None)
    return bool(own) if own is not None else getattr(generator, flag)


def _check_requests(requests: Any, vocab_size: int, generator: Generator, reference: Optional[Generator],
                    detokenize: Optional[Callable] = None, prompts: Sequence = ()) -> tuple:
    """The audit's requests, checked before any engine call (each bad one named ``requests[i].field``)."""
    if detokenize is not None:
        if not callable(detokenize):
            raise InvalidArgument(f"detokenize: expected a callable (token ids -> text), got "
                                  f"{type(detokenize).__name__}")
        if requests is None:
            raise InvalidArgument("detokenize: only for requests with stop strings; no requests were given")
        try:
            text = detokenize(list(prompts[0]) if prompts else [])
        except Exception as exc:  # noqa: BLE001 - the caller's function, named with its own error
            raise InvalidArgument(f"detokenize: failed on the first prompt's token ids: {type(exc).__name__}: "
                                  f"{exc}") from exc
        if not isinstance(text, str):
            raise InvalidArgument(f"detokenize: expected it to return a str, got {type(text).__name__}")
    if requests is None:
        return ()
    if isinstance(requests, Request):
        requests = [requests]
    if isinstance(requests, (str, bytes)) or not isinstance(requests, Sequence) or not requests:
        raise InvalidArgument(f"requests: expected a Request or a non-empty list of Requests, got "
                              f"{type(requests).__name__}")
    out = []
    for i, request in enumerate(requests):
        if not isinstance(request, Request):
            raise InvalidArgument(f"requests[{i}]: expected a Request, got {type(request).__name__}")
        request.check_vocab(vocab_size, f"requests[{i}]")
        if request.logprobs is not None and request.logprobs > vocab_size:
            raise InvalidArgument(f"requests[{i}].logprobs: {request.logprobs} top log-probabilities asked of a "
                                  f"vocabulary of {vocab_size}")
        if request.stop and detokenize is None:
            raise InvalidArgument(f"requests[{i}].stop: stop strings need the engine's detokenizer: give "
                                  f"detokenize= (token ids -> text, e.g. the tokenizer's decode), or the stop tokens "
                                  f"as stop_token_ids")
        out.append(request)
    for component, wrapped in (("generator", generator), ("reference", reference)):
        if wrapped is None or wrapped.accepts_requests:
            continue
        if len({repr(r.describe()) for r in out}) > 1:
            raise InvalidArgument(f"requests: the {component} {wrapped.name!r} does not take per-row requests (it "
                                  f"does not declare accepts_requests); give the one request it runs")
        if component == "generator" and any(r.logprobs is not None for r in out):
            raise InvalidArgument(f"requests: logprobs asked of a generator that does not take requests "
                                  f"({wrapped.name!r} does not declare accepts_requests), so it cannot be asked for "
                                  f"them")
    return tuple(out)


@dataclasses.dataclass(frozen=True)
class RunOutcome:
    """How the schedule ran: ``consumed`` ``(job, arm, record)`` in job order, ``failed`` ``(job, arm, message)``,
    why it stopped, the e-process's p-value, the seconds spent, whether Ctrl-C ended it, the processes, and
    ``failed_calls``: each failed job's index, arm, exception line and traceback (dicts, in job order)."""

    consumed: list
    failed: list
    stop_reason: str
    eprocess_p: float
    seconds: dict
    interrupted: bool
    num_processes: int
    failed_calls: list = dataclasses.field(default_factory=list)
    #: With ``rounds="auto"``: the plan of the power and how the rounds went (:meth:`_Schedule.power_plan`).
    power_plan: Optional[dict] = None


def _probe_scorer(scorer: Scorer, prompts: list, requests: tuple) -> Optional[str]:
    """With requests the scorer must return raw logits (each row's request is applied over its own history):
    asked once, before any engine call, for the first prompt and a one-token continuation; its order is returned.
    A scorer that fails here is left to fail on the first job, where the audit reports its own error."""
    try:
        raw = scorer._fn([list(prompts[0])], [[0]])
    except Exception:  # noqa: BLE001 - the scorer's own failure is reported on the first job
        return None
    if isinstance(raw, ScoredLogits):
        return raw.order if isinstance(raw.order, str) else None
    dependent = next((i for i, r in enumerate(requests) if r.history_dependent), None)
    why = (f"requests[{dependent}] ({requests[dependent].kind}) depends on each row's history, which a law of the "
           f"next token cannot carry" if dependent is not None else
           "the audit applies each row's request to the raw logits itself")
    raise InvalidArgument(f"score: with requests the scorer must return raw logits (ScoredLogits), got "
                          f"{type(raw).__name__}: {why}")
