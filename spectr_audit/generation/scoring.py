"""One job of the generation audit, run and scored: the engine's (and the reference's) continuations as a
:class:`~spectr_audit.generation.records.JobRecord`, what the store keeps and the analysis reads.
"""

from __future__ import annotations

import time
from typing import Optional

import numpy as np
import torch

from spectr_audit._deadline import call_limit
from spectr_audit.contract.sampling import SamplingParams, process_logits
from spectr_audit.generation.contract import GenerationContractError
from spectr_audit.generation.designs import Job
from spectr_audit.generation.options import _Options
from spectr_audit.generation.pit import token_stats
from spectr_audit.generation.records import Divergences, JobRecord, SourceRecord, TokenColumns
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


def _score_tokens(job: Job, prompts: list, continuations: list, scorer, draft_scorer, options: _Options,
                  is_reference: bool) -> tuple:
    """Score one set of continuations: ``(record, logits)``, the per-token statistics and per-continuation facts,
    and the scorer's logits (None from a law scorer; kept in memory for the greedy margins, never stored)."""
    with call_limit(options.timeout, f"{scorer.component} did not return within {options.timeout} s on {job.case}",
                    GenerationContractError):
        laws, logits, row_params, order = scorer(prompts, continuations, case=job.case)
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
        after_eos=np.array([c.index(eos) if eos is not None and eos in c[:-1] else -1 for c in continuations],
                           dtype=np.int64),
        first_token=np.array([c[0] if c else -1 for c in continuations], dtype=np.int64),
        first_collision=np.array([float((law[0] ** 2).sum()) if len(law) else np.nan for law in laws]),
        emitted=np.array([t for c in continuations for t in c] or [], dtype=np.int64))
    if not rows.size:
        return SourceRecord(tokens=TokenColumns.empty(options.orderings), **facts), logits
    all_laws = torch.cat([law for law in laws if len(law)])
    tokens = torch.tensor([t for c in continuations for t in c], dtype=torch.int64)
    generator = chunk_generator(options.seed, _PIT_STREAM, 2 * job.index + is_reference)
    uniforms = torch.rand(tokens.shape[0], generator=generator, dtype=torch.float64)
    draft_laws = None if draft is None else torch.cat([d for d in draft if len(d)])
    stat = token_stats(all_laws, tokens, uniforms, draft_laws, options.orderings)
    zero = (stat.mass <= options.zero_mass_tol).nonzero().squeeze(1)
    margin = (_margins(torch.cat([x for x in logits if len(x)]).double(), all_laws, tokens, zero,
                       row_params, order, rows)
              if logits is not None and zero.numel() else np.full(tokens.shape[0], np.nan))
    # a single-draft speculative sampler accepts a drafted token here with probability 1 - TV(p, q)
    accept = None if draft_laws is None else (1.0 - 0.5 * (draft_laws - all_laws).abs().sum(1)).numpy()
    columns = TokenColumns(row=rows, position=positions, token=tokens.numpy(), mass=stat.mass.numpy(),
                           surprisal=stat.surprisal.numpy(), entropy=stat.entropy.numpy(),
                           variance=stat.surprisal_var.numpy(), margin=margin,
                           pit={order: stat.pit[order].numpy() for order in options.orderings}, accept=accept)
    return SourceRecord(tokens=columns, **facts), logits


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


def _run_job(job: Job, request: GenerationRequest) -> JobRecord:
    """Run one job: the generator (and the reference) on its prompts, the scorers on what they emitted; its record."""
    options, generator, scorer, reference = request.options, request.generator, request.scorer, request.reference
    draft_scorer = request.draft_scorer
    limit = list(job.limits) if isinstance(job.max_new_tokens, tuple) else job.max_new_tokens
    prompts = [list(p) for p in job.prompts]
    timings = {}
    start = time.perf_counter()
    with call_limit(options.timeout, f"generator did not return within {options.timeout} s on {job.case}",
                    GenerationContractError):
        output = generator(prompts, limit, job.seed, vocab_size=options.vocab_size, case=job.case)
    timings["generation"] = time.perf_counter() - start
    accepted = np.array(output.accepted if output.accepted is not None else [-1] * len(prompts), dtype=np.int64)
    calls = np.array(output.target_calls if output.target_calls is not None else [-1] * len(prompts), dtype=np.int64)
    start = time.perf_counter()
    engine, logits = _score_tokens(job, prompts, output.continuations, scorer, draft_scorer, options, False)
    timings["scoring"] = time.perf_counter() - start
    scored_reference, divergences = None, None
    if reference is not None:
        start = time.perf_counter()
        with call_limit(options.timeout, f"reference did not return within {options.timeout} s on {job.case}",
                        GenerationContractError):
            ref = reference(prompts, limit, job.seed, vocab_size=options.vocab_size, case=job.case)
        timings["reference"] = time.perf_counter() - start
        start = time.perf_counter()
        # with the draft scorer too: the ratio order needs the draft's law at the reference's positions
        scored_reference, _ = _score_tokens(job, prompts, ref.continuations, scorer, draft_scorer, options, True)
        divergences = _divergences(output.continuations, ref.continuations, logits)
        timings["scoring"] += time.perf_counter() - start
    seconds = np.array([timings.get(k, 0.0) for k in ("generation", "reference", "scoring")])
    return JobRecord(engine, accepted, calls, seconds, scored_reference, divergences)
