"""The generation audit: what an engine's ``generate()`` emits, every token, against the target model's own law.

:func:`audit_generation` runs the generator under the audit's batch designs
(:mod:`spectr_audit.generation.designs`), scores every emitted token with the scorer, and tests
the tokens' randomized PITs and surprisals (:mod:`spectr_audit.generation.pit`,
:mod:`spectr_audit.generation.statistical_tests`), one Holm family with a stated false-alarm rate.  Jobs are
streamed into a store (:mod:`spectr_audit.generation.store`), so an interrupted audit resumes to
the same verdict; they can be spread over ``torch.distributed`` processes with the same verdict
as one.  docs/generation.md describes the method and what each number rests on.
"""

from __future__ import annotations

import os
import time
from typing import Any, Callable, Mapping, Optional, Sequence, Union

from spectr_audit import defaults
from spectr_audit.errors import InvalidArgument
from spectr_audit.generation.analysis import _analyse
from spectr_audit.generation.designs import ARMS
from spectr_audit.generation.options import POSITION_BUCKETS, _check_flags
from spectr_audit.generation.request import GenerationRequest, RunOutcome
from spectr_audit.generation.results import GenerationAuditResult
from spectr_audit.generation.schedule import _Collective, _open_store, _Schedule
from spectr_audit.statistical.sharding import current_shards

__all__ = ["GenerationInterrupted", "audit_generation", "run_request"]


class GenerationInterrupted(KeyboardInterrupt):
    """Ctrl-C during a generation audit; ``result`` holds the analysis of the jobs that finished."""

    def __init__(self, result: Optional[GenerationAuditResult]):
        super().__init__("generation audit interrupted")
        self.result = result


def _collective(distributed) -> _Collective:
    """This process's group: the initialised ``torch.distributed`` one ``distributed`` names, or none."""
    return _Collective(current_shards(distributed))


def _check_run_arguments(store: Any, distributed: Any) -> None:
    """The arguments of :func:`audit_generation` the request does not hold: the store and the group."""
    if store is not None and not isinstance(store, (str, os.PathLike)):
        raise InvalidArgument(f"store: expected a file path or None, got {type(store).__name__}")
    if isinstance(distributed, str) and distributed != "auto":
        raise InvalidArgument(f"distributed: expected 'auto', True, False or a process group, got {distributed!r}")


def audit_generation(
    generate: Any,
    score: Any,
    prompts: Sequence[Sequence[int]],
    *,
    vocab_size: int,
    reference: Any = None,
    draft_score: Any = None,
    max_new_tokens: int = 32,
    batch_size: int = 4,
    rounds: Union[int, str] = 1,
    arms: Sequence[str] = ARMS,
    seed: int = defaults.SEED,
    alpha: float = defaults.ALPHA,
    power: float = defaults.POWER,
    min_detectable_tv: float = defaults.GENERATION_MIN_DETECTABLE_TV,
    orderings: Optional[Sequence[str]] = None,
    position_buckets: Sequence[int] = POSITION_BUCKETS,
    greedy: Optional[bool] = None,
    zero_mass_tol: float = 0.0,
    logit_tol: float = defaults.GENERATION_LOGIT_TOLERANCE,
    max_tokens: Optional[int] = None,
    max_seconds: Optional[float] = None,
    timeout: Optional[float] = None,
    allow_failed_calls: int = 0,
    store: Optional[str] = None,
    resume: bool = False,
    distributed: Any = "auto",
    progress: Optional[bool] = None,
    eos_token_id: Optional[int] = None,
    per_row_max_new_tokens: Optional[bool] = None,
    name: Optional[str] = None,
    requests: Any = None,
    logprob_tolerance: float = 0.1,
    detokenize: Optional[Callable] = None,
    conditions: Optional[Mapping[str, Any]] = None,
    reference_tv: Optional[float] = None,
) -> GenerationAuditResult:
    """Audit a generation engine's emitted tokens against the target model's law, every token.

    Parameters
    ----------
    generate : callable or object with ``generate``
        ``generate(prompts, max_new_tokens, seed) -> continuations`` (docs/generation.md).
    score : callable or object with ``score``
        ``score(prompts, continuations) -> laws`` (``[len_i, vocab_size]`` per continuation, the
        processed target law at each position) or :class:`~spectr_audit.generation.contract.ScoredLogits`.
    prompts : list of token-id lists
    vocab_size : int
    reference : callable, optional
        The same engine with speculation off: a two-sample test and the numerics floor.
    draft_score : callable, optional
        The draft model's law at the same positions: the ``ratio`` order, and the expected
        acceptance.
    max_new_tokens, batch_size : int
        Per row; rows per batch (``equal``, ``ragged``, ``repeated`` arms).
    rounds : int or "auto"
        How many times the whole design runs (with new seeds); ``"auto"``: two rounds of every arm, then rounds
        of the fastest arm until the all-tokens test reaches ``min_detectable_tv`` at ``power`` or a budget
        stops the audit (``result.power_plan``; docs/generation.md, "Rounds until the planned power").
    arms : sequence of str
        Batch designs (:data:`~spectr_audit.generation.designs.ARMS`).
    seed : int
    alpha, power, min_detectable_tv : float
        The familywise false-alarm rate; the power the PASS verdict requires at ``min_detectable_tv``
        (TV of the pooled PIT law over all tokens, by probability, or by the first of ``orderings``
        when it leaves probability out: the result's ``power_ordering``).
    orderings : sequence of str, optional
        PIT orders, distinct ones of :data:`~spectr_audit.generation.pit.ORDERINGS` (default
        ``probability`` and ``token-id``, and ``ratio`` with a draft scorer; ``ratio`` needs one).
    position_buckets : sequence of int
        Boundaries of the position strata.
    greedy : bool, optional
        Greedy engine (default: detected, every scored law one-hot, over all jobs).  The one-sample
        tests and the e-process then do not decide (an argmax token's PIT is pure noise): the support
        check does, and, with a reference, token-for-token equality (a divergence above ``logit_tol``
        is a finding, one within it numerics).
    zero_mass_tol, logit_tol : float
        A token of mass at most ``zero_mass_tol`` is a violation unless a logits scorer shows it
        within ``logit_tol`` logits of the kept tokens (numerics); the same tolerance separates a
        greedy divergence from a near-tie.
    max_tokens, max_seconds : optional
        Budgets: stop after this many engine tokens or seconds (the result says how far it got).
    timeout : float, optional
        Per-call limit of the generator, the reference and the scorers.
    allow_failed_calls : int
        How many jobs may fail (their generator, reference or scorer call raised, broke the contract or
        ran past ``timeout``) before the verdict is ERROR whatever the tests say (a FINDING stands);
        default 0: a failed engine call fails the audit.  Within the allowance the verdict is the
        tests' and the failed calls are counted apart.
    store, resume : optional
        An SQLite file the finished jobs are written to; ``resume=True`` continues an interrupted
        audit (same configuration) to the same verdict.
    distributed : "auto", bool or a process group
        Spread the jobs over an initialised ``torch.distributed`` group: the schedule runs in rounds
        of one job per process, the records are exchanged, and every process consumes them in job
        order through the same stopping rules (jobs past a stop in the same round are dropped), so
        every process gets the same result as one process alone, bit for bit.  Rank 0 alone writes
        the store (and reads it on resumption, for all).
    progress : bool, optional
        A progress bar (default: when stderr is a terminal).
    eos_token_id : int, optional
        For the record: the engine's end-of-sequence id (continuations may stop there).
    per_row_max_new_tokens : bool, optional
        Whether ``generate`` takes one limit per row (default: the generator's attribute).
    name : str, optional

    requests : Request or list of Request, optional
        The whole request of each row (:class:`~spectr_audit.contract.requests.Request`: sampling parameters,
        penalties, logit bias, bad words, min_tokens, stop tokens, max_tokens, seed, logprobs, a constraint),
        given to the rows in turn so that every batch mixes them.  The generator takes them as ``requests=``
        when it declares ``accepts_requests`` (otherwise only one request may be given, the one it runs); the
        scorer must return :class:`~spectr_audit.generation.contract.ScoredLogits`, and each row's laws are its
        logits under its own request and history.  Adds the decisive checks ``logprobs`` (where asked),
        ``stopping`` and ``constraint`` (where a request has one), and a determinism line where the generator
        declares ``seeded`` (docs/generation.md, "Whole requests").
    logprob_tolerance : float
        The largest gap between a returned log-probability and the scorer's that is not a finding.
    detokenize : callable, optional
        The engine's detokenizer, token ids -> text (e.g. its tokenizer's ``decode``): needed when a request
        has stop strings, which end a row at the token that completes one
        (:meth:`~spectr_audit.contract.requests.Request.stop_position`, under the scorer's order).
    conditions : mapping, optional
        Serving conditions run as arms of their own: condition name (``prefix-cache``, ``chunked-prefill``,
        ``preemption``, ``concurrency``, ``draft-depth=N``, ``long-context``;
        :mod:`~spectr_audit.generation.conditions`) -> the engine under that setting (a generator of the same
        contract, reporting its serving counters in ``GenerationOutput.stats``).  Each runs on its own design in
        every planned round, its tokens a stratum of their own; the result's ``conditions`` say what each reached,
        and a condition not shown reached keeps the verdict from PASS (docs/generation.md, "Serving conditions").

    reference_tv : float, optional
        With ``rounds="auto"`` and a reference: the TV the reference's own all-tokens test is sized for (default
        twice ``min_detectable_tv``, at most 0.5).  The reference runs on the first round of every arm (and condition), and on
        the further rounds only until it holds the tokens that test needs at its share of ``alpha``; the
        two-sample tests compare the engine's tokens of the calls the reference ran on, and the result's
        ``reference_sample`` says what its sample can exclude (docs/generation.md, "The reference where it pays").

    Returns
    -------
    GenerationAuditResult

    Raises
    ------
    InvalidArgument
        On bad arguments.
    GenerationInterrupted
        On Ctrl-C, carrying the result of the finished jobs (``.result``).

    Examples
    --------
    >>> from spectr_audit.generation.library import ToyPair, correct_engine
    >>> pair = ToyPair(vocab_size=12, seed=0)
    >>> result = audit_generation(correct_engine(pair), pair.scorer(), [[1, 2, 3], [4, 5]], vocab_size=12,
    ...                           max_new_tokens=16, progress=False)
    >>> result.verdict in ("PASS", "INCONCLUSIVE"), result.num_tokens > 0
    (True, True)
    """
    request = GenerationRequest.build(
        generate, score, prompts, vocab_size=vocab_size, reference=reference, draft_score=draft_score, greedy=greedy,
        per_row_max_new_tokens=per_row_max_new_tokens, name=name, requests=requests,
        logprob_tolerance=logprob_tolerance, detokenize=detokenize, conditions=conditions,
        max_new_tokens=max_new_tokens,
        batch_size=batch_size, rounds=rounds, arms=arms, seed=seed, alpha=alpha, power=power,
        min_detectable_tv=min_detectable_tv, orderings=orderings, position_buckets=position_buckets,
        zero_mass_tol=zero_mass_tol, logit_tol=logit_tol, max_tokens=max_tokens, max_seconds=max_seconds,
        timeout=timeout, eos_token_id=eos_token_id, allow_failed_calls=allow_failed_calls, reference_tv=reference_tv)
    _check_flags(resume=resume, progress=progress)
    _check_run_arguments(store, distributed)
    return run_request(request, store=store, resume=resume, distributed=distributed, progress=progress)


def run_request(request: GenerationRequest, *, store: Optional[str] = None, resume: bool = False,
                distributed: Any = "auto", progress: Optional[bool] = None) -> GenerationAuditResult:
    """Run a built request: its jobs scheduled (into ``store``, resumed from it), then analysed.

    Raises
    ------
    GenerationInterrupted
        On Ctrl-C, carrying the result of the finished jobs.
    """
    group = _collective(distributed)
    sink, stored = _open_store(store, request.config(), resume, group)
    schedule = _Schedule(request, stored, sink, group, progress)
    schedule.run()
    seconds = schedule.totals
    seconds["tests"] = 0.0
    test_start = time.perf_counter()
    outcome = RunOutcome(schedule.consumed(), schedule.failed(), schedule.stop_reason, schedule.mixture_p(),
                         seconds, schedule.interrupted, group.world_size, schedule.failed_calls(),
                         schedule.power_plan)
    result = _analyse(schedule.request, outcome)  # with rounds="auto", the jobs planned as the audit ran
    seconds["tests"] = time.perf_counter() - test_start
    if sink is not None:
        sink.close()
    if schedule.interrupted:
        raise GenerationInterrupted(result)
    return result
