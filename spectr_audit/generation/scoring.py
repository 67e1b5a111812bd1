"""One job of the generation audit, run and scored: the engine's (and the reference's) continuations as a
:class:`~spectr_audit.generation.records.JobRecord`, what the store keeps and the analysis reads.
"""

from __future__ import annotations

import math
import time
from typing import Callable, Optional

import numpy as np
import torch

from spectr_audit._deadline import call_limit
from spectr_audit.contract.history import HISTORY_ENGINES, LLAMA_CPP_SAMPLING, process_request
from spectr_audit.contract.sampling import SamplingParams, process_logits
from spectr_audit.errors import InvalidArgument
from spectr_audit.generation.contract import GenerationContractError, GenerationOutput
from spectr_audit.generation.designs import Job
from spectr_audit.generation.options import _Options
from spectr_audit.generation.pit import TokenStats, token_stats
from spectr_audit.generation.records import Divergences, JobRecord, RequestChecks, SourceRecord, TokenColumns
from spectr_audit.generation.request import GenerationRequest
from spectr_audit.statistical.sharding import chunk_generator

#: The stream of the PIT's uniforms.
_PIT_STREAM = 12
#: A zero-mass token is numerics when a top-p / min-p this much looser keeps it (probability units).
PROBABILITY_TOLERANCE = 1e-3


def _margins(logits: torch.Tensor, laws: torch.Tensor, tokens: torch.Tensor, rows: torch.Tensor,
             params: Optional[list], order, row_of: np.ndarray) -> np.ndarray:
    """For tokens of zero mass: 0 when a slightly looser top-p / min-p keeps them (a boundary decided by
    numerics), else the logit gap below the least likely token the parameters keep."""
    out = np.full(tokens.shape[0], np.nan)
    for i in rows.tolist():
        kept = laws[i] > 0
        if not bool(kept.any()):
            continue
        if params is not None:
            p = params[int(row_of[i])]
            relaxed = SamplingParams(temperature=float(p.temperature), top_k=int(p.top_k),
                                     top_p=min(1.0, float(p.top_p) + PROBABILITY_TOLERANCE),
                                     min_p=max(0.0, float(p.min_p) - PROBABILITY_TOLERANCE))
            if float(p.temperature) > 0 and float(process_logits(logits[i].unsqueeze(0), relaxed, order)[0,
                                                                                                       tokens[i]]) > 0:
                out[i] = 0.0
                continue
        out[i] = float(logits[i][kept].min() - logits[i, tokens[i]])
    return out


def _apply_requests(job: Job, prompts: list, continuations: list, requests: list, logits, order, options,
                    component: str, row_params: Optional[list] = None) -> tuple:
    """Each row's laws under its own request and history: ``(laws, processed logits, params, RequestLaws)``."""
    if logits is None:
        raise GenerationContractError(f"{component} on {job.case}: with requests the scorer must return raw logits "
                                      f"(ScoredLogits), so that each row's request is applied over its own history")
    if not isinstance(order, str) or order not in HISTORY_ENGINES:
        raise GenerationContractError(f"{component} on {job.case}: with requests ScoredLogits.order must be one of "
                                      f"{HISTORY_ENGINES}, got {order!r}")
    for i, params in enumerate(row_params or ()):
        if not params.is_neutral():
            raise GenerationContractError(f"{component} on {job.case}, row {i}: with requests the sampling parameters "
                                          f"come from each row's request; ScoredLogits.params must be the neutral "
                                          f"default, got {params.describe()}")
    out = []
    for i, (prompt, row, request) in enumerate(zip(prompts, continuations, requests)):
        try:
            out.append(process_request(logits[i].double(), prompt, row, request, order,
                                       eos_token_id=options.eos_token_id))
        except InvalidArgument as exc:
            raise GenerationContractError(f"{component} on {job.case}, row {i}: {exc}") from exc
    return ([r.probs for r in out], [r.processed_logits for r in out], [r.sampling_params() for r in requests],
            out)


def _logprob_gap(returned: Optional[list], top: Optional[list], row: list, law_logprobs: torch.Tensor) -> tuple:
    """``(largest gap, position)`` between a row's returned log-probabilities (the emitted tokens' ``returned`` and
    the top-n lists ``top``, either None) and the scorer's ``law_logprobs`` ``[len(row), V]``; NaN, -1 when the
    engine returned neither."""
    if returned is None and top is None:
        return np.nan, -1
    worst, where = 0.0, -1
    vocab_size = law_logprobs.shape[1]
    for t, token in enumerate(row):
        pairs = [(token, returned[t])] if returned is not None else []
        if top is not None:
            pairs += [(int(k), float(v)) for k, v in top[t].items()]
        for k, value in pairs:
            expected = float(law_logprobs[t, k]) if 0 <= k < vocab_size else -math.inf
            gap = 0.0 if value == expected else abs(value - expected)
            if not gap <= worst:
                worst, where = (gap if not math.isnan(gap) else math.inf), t
        if top is not None and top[t]:
            # the listed tokens must be the most likely ones: none unlisted may beat the least listed by the tolerance
            listed = torch.zeros(vocab_size, dtype=torch.bool)
            ids = [int(k) for k in top[t] if 0 <= int(k) < vocab_size]
            listed[ids] = True
            least = float(law_logprobs[t][listed].min()) if ids else -math.inf
            others = law_logprobs[t][~listed]
            beaten = (float(others.max()) if others.numel() else -math.inf) - least
            if beaten > worst:
                worst, where = beaten, t
    return worst, where


def _stopping(row: list, request, first: int, stops: tuple, limit: int, finish, usage) -> tuple:
    """``(code, position)`` of the first stopping rule row breaks (a key of records.STOP_CODES; 0: none); ``first``:
    where the row ends (its first stop token or completed stop string, -1: none); ``stops``: its stop tokens."""
    cap = limit if request.max_tokens is None else min(limit, request.max_tokens)
    if first >= 0 and first < len(row) - 1:
        return 1, first + 1
    # min_tokens masks the stop tokens; a stop string before it is the engine's own rule (Request.stop_position)
    if first >= 0 and first < request.min_tokens and row[first] in stops:
        return 2, first
    if request.max_tokens is not None and len(row) > request.max_tokens:
        return 3, request.max_tokens
    if finish is not None:
        expected = "stop" if first >= 0 else ("length" if len(row) >= cap else None)
        if finish != expected:
            return 4, len(row)
    if usage is not None and int(usage) != len(row):
        return 5, len(row)
    return 0, -1


def _request_checks(continuations: list, requests: list, laws: list, output, limits, options, cuts: list,
                    determinism) -> RequestChecks:
    """Per row, the whole-request checks of the engine's ``output`` against ``laws`` (the RequestLaws of each row's
    scored, truncated tokens)."""
    n = len(continuations)
    err, err_pos = np.full(n, np.nan), np.full(n, -1, dtype=np.int64)
    code, code_pos = np.zeros(n, dtype=np.int64), np.full(n, -1, dtype=np.int64)
    constraint = np.full(n, -1, dtype=np.int64)
    table_of = {"raw": "raw_logprobs", "raw-masked": "raw_masked_logprobs",
                "processed": "processed_logprobs"}[output.logprobs_mode]
    for i, (row, request, row_laws) in enumerate(zip(continuations, requests, laws)):
        if row_laws.constraint_violation is not None:
            constraint[i] = row_laws.constraint_violation
        scored = len(row_laws.probs)  # the tokens up to the first stop token
        returned = None if output.logprobs is None or output.logprobs[i] is None else output.logprobs[i][:scored]
        top = None if output.top_logprobs is None or output.top_logprobs[i] is None else output.top_logprobs[i][:scored]
        err[i], err_pos[i] = _logprob_gap(returned, top, row[:scored], getattr(row_laws, table_of))
        finish = None if output.finish_reasons is None else output.finish_reasons[i]
        usage = None if output.completion_tokens is None else output.completion_tokens[i]
        limit = limits[i] if isinstance(limits, (list, tuple)) else limits
        code[i], code_pos[i] = _stopping(row, request, cuts[i], request.stop_ids(options.eos_token_id), limit, finish,
                                         usage)
    det = np.full(n, -1, dtype=np.int64) if determinism is None else np.asarray(determinism, dtype=np.int64)
    return RequestChecks(err, err_pos, code, code_pos, constraint, det)


def _score_tokens(job: Job, prompts: list, continuations: list, scorer, draft_scorer, options: _Options,
                  is_reference: bool, requests: Optional[list] = None, output=None, limits=None,
                  determinism=None, stop_at: Optional[Callable] = None) -> tuple:
    """Score one set of continuations: ``(record, logits)``, the per-token statistics and per-continuation facts,
    and the scorer's logits (None from a law scorer; kept in memory for the greedy margins, never stored).

    With ``requests`` (one per row), each row is cut after its first stop token (the law tested is that of the
    truncated sequence), its laws are the scorer's logits under its own request and history, and the engine's
    returned log-probabilities, stopping and constraint are checked (``output``: the engine's GenerationOutput).
    ``stop_at(row, request)``: where a row ends (its first stop token or completed stop string; -1: none).
    """
    full = continuations
    if requests is not None:
        cuts = [stop_at(row, r) for row, r in zip(full, requests)]
        continuations = [row if cut < 0 else row[:cut + 1] for row, cut in zip(full, cuts)]
    with call_limit(options.timeout, f"{scorer.component} did not return within {options.timeout} s on {job.case}",
                    GenerationContractError):
        laws, logits, row_params, order = scorer(prompts, continuations, case=job.case)
    checks = None
    if requests is not None:
        laws, logits, row_params, request_laws = _apply_requests(job, prompts, continuations, requests, logits,
                                                                 order, options, scorer.component, row_params)
        if output is not None:
            checks = _request_checks(full, requests, request_laws, output, limits, options, cuts, determinism)
    draft = None
    if draft_scorer is not None:
        with call_limit(options.timeout, f"{draft_scorer.component} did not return within {options.timeout} s on "
                                         f"{job.case}", GenerationContractError):
            draft = draft_scorer(prompts, continuations, case=job.case).laws
    lengths = [len(c) for c in continuations]
    rows = np.repeat(np.arange(len(continuations)), lengths)
    positions = np.concatenate([np.arange(n) for n in lengths]) if rows.size else np.zeros(0, dtype=np.int64)
    eos = options.eos_token_id
    facts = dict(
        lengths=np.array(lengths, dtype=np.int64),
        # an end-of-sequence token before a continuation's last token: the engine went on past it
        after_eos=np.array([c.index(eos) if eos is not None and eos in c[:-1] else -1 for c in full],
                           dtype=np.int64),
        first_token=np.array([c[0] if c else -1 for c in continuations], dtype=np.int64),
        first_collision=np.array([float((law[0] ** 2).sum()) if len(law) else np.nan for law in laws]),
        emitted=np.array([t for c in continuations for t in c] or [], dtype=np.int64))
    if not rows.size:
        return SourceRecord(tokens=TokenColumns.empty(options.orderings), checks=checks, **facts), logits
    tokens = torch.tensor([t for c in continuations for t in c], dtype=torch.int64)
    generator = chunk_generator(options.seed, _PIT_STREAM, 2 * job.index + is_reference)
    uniforms = torch.rand(tokens.shape[0], generator=generator, dtype=torch.float64)
    # each continuation's laws on their own (a whole job's [tokens, V] laws are never built: at a large vocabulary
    # that copy cost as much as the statistics)
    parts, starts = [], np.concatenate([[0], np.cumsum(lengths)])
    for r in range(len(continuations)):
        if lengths[r]:
            span = slice(int(starts[r]), int(starts[r + 1]))
            parts.append(token_stats(laws[r], tokens[span], uniforms[span], None if draft is None else draft[r],
                                     options.orderings))
    stat = TokenStats.concatenate(parts)
    zero = (stat.mass <= options.zero_mass_tol).nonzero().squeeze(1)
    margin = np.full(tokens.shape[0], np.nan)
    if logits is not None and zero.numel():
        margin = _margins(torch.cat([x for x in logits if len(x)]).double(),
                          torch.cat([law for law in laws if len(law)]), tokens, zero, row_params,
                          LLAMA_CPP_SAMPLING if order == "llama.cpp" else order, rows)
    # a single-draft speculative sampler accepts a drafted token here with probability 1 - TV(p, q)
    accept = (None if draft is None else
              np.concatenate([(1.0 - 0.5 * (d - law).abs().sum(1)).numpy() for d, law in zip(draft, laws) if len(law)]))
    columns = TokenColumns(row=rows, position=positions, token=tokens.numpy(), mass=stat.mass.numpy(),
                           surprisal=stat.surprisal.numpy(), entropy=stat.entropy.numpy(),
                           variance=stat.surprisal_var.numpy(), margin=margin,
                           pit={order: stat.pit[order].numpy() for order in options.orderings}, accept=accept)
    return SourceRecord(tokens=columns, checks=checks, **facts), logits


def _divergences(engine: list, reference: list, logits: Optional[list]) -> Divergences:
    """Per row, where a greedy engine first departs from its reference, and the scorer's margin there."""
    rows, positions, margins, engine_tokens, reference_tokens = [], [], [], [], []
    for r, (a, b) in enumerate(zip(engine, reference)):
        first = next((t for t, (x, y) in enumerate(zip(a, b)) if x != y), None)
        if first is None:
            continue
        rows.append(r)
        positions.append(first)
        engine_tokens.append(a[first])
        reference_tokens.append(b[first])
        if logits is not None and len(logits[r]) > first:
            row = logits[r][first].double()
            margins.append(float(abs(row[a[first]] - row[b[first]])))
        else:
            margins.append(np.nan)
    return Divergences(np.array(rows, dtype=np.int64), np.array(positions, dtype=np.int64),
                       np.array(margins, dtype=np.float64), np.array(engine_tokens, dtype=np.int64),
                       np.array(reference_tokens, dtype=np.int64))


def _determinism(job: Job, request: GenerationRequest, prompts: list, limit, requests: Optional[list],
                 output) -> Optional[list]:
    """Where the generator honours seeds: the job's rows rerun in reverse order (another batch composition), and
    per row 0 (the seeded row's tokens are the same), 1 (they differ) or -1 (the row carries no seed)."""
    if (requests is None or job.is_condition or not request.generator.seeded
            or not any(r.seed is not None for r in requests)):
        return None
    order = list(range(len(prompts)))[::-1]
    limits = [limit[i] for i in order] if isinstance(limit, list) else limit
    again = request.generator([prompts[i] for i in order], limits, job.seed + 1, vocab_size=request.options.vocab_size,
                              case=job.case + " (rerun in reverse order)", requests=[requests[i] for i in order])
    rerun = {i: again.continuations[k] for k, i in enumerate(order)}
    return [-1 if r.seed is None else int(rerun[i] != output.continuations[i]) for i, r in enumerate(requests)]


def _follow_up(job: Job, generator, prompts: list, limit, requests: Optional[list], vocab_size: int) -> tuple:
    """A follow-up job's two calls: the first half of the rows, then each of them followed by what it emitted
    (``docs/generation.md``, "Serving conditions"); the prompts of every row, the outputs joined, and the second
    call's serving counters (the calls after a cache hit)."""
    half = len(prompts) // 2

    def part(values, first):
        if isinstance(values, list):
            return values[:half] if first else values[half:]
        return values

    first = generator(prompts[:half], part(limit, True), job.seed, vocab_size=vocab_size, case=job.case + " (first pass)",
                      requests=part(requests, True))
    after = [list(p) + list(c) for p, c in zip(prompts[:half], first.continuations)]
    second = generator(after, part(limit, False), (job.seed * 2 + 1) % (1 << 62), vocab_size=vocab_size,
                       case=job.case + " (follow-up)", requests=part(requests, False))
    joined = {}
    for field in ("continuations", "accepted", "target_calls", "logprobs", "top_logprobs", "finish_reasons",
                  "completion_tokens"):
        a, b = getattr(first, field), getattr(second, field)
        joined[field] = None if a is None or b is None else list(a) + list(b)
    return prompts[:half] + after, GenerationOutput(**joined, logprobs_mode=second.logprobs_mode, stats=second.stats)


def _run_job(job: Job, request: GenerationRequest) -> JobRecord:
    """Run one job: the generator (and the reference) on its prompts, the scorers on what they emitted; its record."""
    options, scorer, reference = request.options, request.scorer, request.reference
    generator = request.generator_for(job)
    draft_scorer = request.draft_scorer
    limit = list(job.limits) if isinstance(job.max_new_tokens, tuple) else job.max_new_tokens
    prompts = [list(p) for p in job.prompts]
    requests = request.row_requests(job)
    timings = {}
    start = time.perf_counter()
    with call_limit(options.timeout, f"generator did not return within {options.timeout} s on {job.case}",
                    GenerationContractError):
        if job.follow_up:
            prompts, output = _follow_up(job, generator, prompts, limit, requests, options.vocab_size)
        else:
            output = generator(prompts, limit, job.seed, vocab_size=options.vocab_size, case=job.case,
                               requests=requests)
        determinism = _determinism(job, request, prompts, limit, requests, output)
    timings["generation"] = time.perf_counter() - start
    accepted = np.array(output.accepted if output.accepted is not None else [-1] * len(prompts), dtype=np.int64)
    calls = np.array(output.target_calls if output.target_calls is not None else [-1] * len(prompts), dtype=np.int64)
    start = time.perf_counter()
    engine, logits = _score_tokens(job, prompts, output.continuations, scorer, draft_scorer, options, False,
                                   requests, output, limit, determinism, request.stop_position)
    timings["scoring"] = time.perf_counter() - start
    scored_reference, divergences = None, None
    if reference is not None and job.reference:
        start = time.perf_counter()
        with call_limit(options.timeout, f"reference did not return within {options.timeout} s on {job.case}",
                        GenerationContractError):
            ref = reference(prompts, limit, job.seed, vocab_size=options.vocab_size, case=job.case,
                            requests=requests)
        timings["reference"] = time.perf_counter() - start
        start = time.perf_counter()
        # with the draft scorer too: the ratio order needs the draft's law at the reference's positions
        scored_reference, _ = _score_tokens(job, prompts, ref.continuations, scorer, draft_scorer, options, True,
                                            requests, stop_at=request.stop_position)
        divergences = _divergences(output.continuations, ref.continuations, logits)
        timings["scoring"] += time.perf_counter() - start
    seconds = np.array([timings.get(k, 0.0) for k in ("generation", "reference", "scoring")])
    return JobRecord(engine, accepted, calls, seconds, scored_reference, divergences, stats=output.stats)
