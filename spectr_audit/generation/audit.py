"""The generation audit: what an engine's ``generate()`` emits, every token, against the target model's own law.

:func:`audit_generation` runs the generator under the audit's batch designs
(:mod:`spectr_audit.generation.designs`), scores every emitted token with the scorer, and tests
the tokens' randomized PITs and surprisals (:mod:`spectr_audit.generation.pit`,
:mod:`spectr_audit.generation.tests`), one Holm family with a stated false-alarm rate.  Jobs are
streamed into a store (:mod:`spectr_audit.generation.store`), so an interrupted audit resumes to
the same verdict; they can be spread over ``torch.distributed`` processes with the same verdict
as one.  docs/generation.md describes the method and what each number rests on.
"""

from __future__ import annotations

import dataclasses
import math
import os
import sys
import time
from typing import Any, Optional, Sequence

import numpy as np
import torch
from scipy import stats

from spectr_audit import defaults
from spectr_audit._deadline import call_limit
from spectr_audit._validation import check_prob
from spectr_audit.errors import InvalidArgument
from spectr_audit.generation.contract import (
    GenerationContractError,
    as_generator,
    as_scorer,
    check_prompts,
)
from spectr_audit.generation.designs import ARMS, Job, plan_jobs
from spectr_audit.generation.pit import ORDERINGS, token_stats
from spectr_audit.generation.results import Divergence, GenerationAuditResult, StratumRow, ZeroMassToken
from spectr_audit.generation.store import SampleStore
from spectr_audit.generation.tests import (
    NUM_BINS,
    PITEProcess,
    agreement_test,
    held_out_tv,
    pit_test,
    surprisal_test,
    two_sample_test,
)
from spectr_audit.statistical.gof import TestResult, holm
from spectr_audit.statistical.sharding import WorkerFailed, chunk_generator, current_shards

__all__ = ["GenerationInterrupted", "audit_generation"]

#: Continuation positions are bucketed at these boundaries (a slip past position 64 must not drown
#: in the first 64).
POSITION_BUCKETS = (16, 64, 256)
#: A stratum is tested when it holds at least this many tokens (the bins' expected count is then >= 5).
MIN_STRATUM_TOKENS = 5 * NUM_BINS
#: The stream of the PIT's uniforms.
_PIT_STREAM = 12


class GenerationInterrupted(KeyboardInterrupt):
    """Ctrl-C during a generation audit; ``result`` holds the analysis of the jobs that finished."""

    def __init__(self, result: Optional[GenerationAuditResult]):
        super().__init__("generation audit interrupted")
        self.result = result


@dataclasses.dataclass(frozen=True)
class _Options:
    vocab_size: int
    max_new_tokens: int
    batch_size: int
    rounds: int
    arms: tuple
    seed: int
    alpha: float
    power: float
    min_detectable_tv: float
    orderings: tuple
    position_buckets: tuple
    zero_mass_tol: float
    logit_tol: float
    max_tokens: Optional[int]
    max_seconds: Optional[float]
    timeout: Optional[float]
    eos_token_id: Optional[int]

    def config(self, prompts: list, reference: bool, draft: bool, per_row_max_new_tokens: bool) -> dict:
        """What must match for a stored audit to be resumed (the jobs, their seeds and what is scored)."""
        fields = dataclasses.asdict(self)
        fields.pop("max_seconds")
        fields.pop("timeout")
        return {**{k: list(v) if isinstance(v, tuple) else v for k, v in fields.items()}, "prompts": prompts,
                "reference": reference, "draft_scorer": draft, "per_row_max_new_tokens": per_row_max_new_tokens}


def _bucket_names(buckets: tuple) -> list:
    edges = (0,) + buckets
    names = [f"positions {a}-{b - 1}" for a, b in zip(edges, edges[1:])]
    return names + [f"positions {edges[-1]}+"]


#: A zero-mass token is numerics when a top-p / min-p this much looser keeps it (probability units).
PROBABILITY_TOLERANCE = 1e-3


def _margins(logits: torch.Tensor, laws: torch.Tensor, tokens: torch.Tensor, rows: torch.Tensor,
             params: Optional[list], order, row_of: np.ndarray) -> np.ndarray:
    """For tokens of zero mass: 0 when a slightly looser top-p / min-p keeps them (a boundary decided by
    numerics), else the logit gap below the least likely token the parameters keep."""
    from spectr_audit.contract.sampling import SamplingParams, process_logits

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
                  prefix: str) -> dict:
    """Score one set of continuations: per-token statistics, per-continuation facts, prefixed by ``prefix``."""
    with call_limit(options.timeout, f"{scorer.component} did not return within {options.timeout} s on {job.case}",
                    GenerationContractError):
        laws, logits = scorer(prompts, continuations, case=job.case)
    draft = None
    if draft_scorer is not None:
        with call_limit(options.timeout, f"{draft_scorer.component} did not return within {options.timeout} s on "
                                         f"{job.case}", GenerationContractError):
            draft, _ = draft_scorer(prompts, continuations, case=job.case)
    lengths = [len(c) for c in continuations]
    rows = np.repeat(np.arange(len(continuations)), lengths)
    positions = np.concatenate([np.arange(n) for n in lengths]) if rows.size else np.zeros(0, dtype=np.int64)
    eos = options.eos_token_id
    out = {f"{prefix}cont_len": np.array(lengths, dtype=np.int64),
           # an end-of-sequence token before a continuation's last token: the engine went on past it
           f"{prefix}cont_after_eos": np.array([c.index(eos) if eos is not None and eos in c[:-1] else -1
                                                for c in continuations], dtype=np.int64),
           f"{prefix}cont_first": np.array([c[0] if c else -1 for c in continuations], dtype=np.int64),
           f"{prefix}cont_chance": np.array([float((law[0] ** 2).sum()) if len(law) else np.nan for law in laws])}
    if not rows.size:
        for name in ("row", "pos", "token", "mass", "surprisal", "entropy", "var", "margin"):
            out[f"{prefix}tok_{name}"] = np.zeros(0)
        for order in options.orderings:
            out[f"{prefix}tok_pit_{order}"] = np.zeros(0)
        return out
    all_laws = torch.cat([law for law in laws if len(law)])
    tokens = torch.tensor([t for c in continuations for t in c], dtype=torch.int64)
    generator = chunk_generator(options.seed, _PIT_STREAM, 2 * job.index + (prefix == "ref_"))
    uniforms = torch.rand(tokens.shape[0], generator=generator, dtype=torch.float64)
    draft_laws = None if draft is None else torch.cat([d for d in draft if len(d)])
    stat = token_stats(all_laws, tokens, uniforms, draft_laws, options.orderings)
    zero = (stat.mass <= options.zero_mass_tol).nonzero().squeeze(1)
    margin = (_margins(torch.cat([x for x in logits if len(x)]).double(), all_laws, tokens, zero,
                       getattr(scorer, "last_params", None), getattr(scorer, "last_order", None), rows)
              if logits is not None and zero.numel() else np.full(tokens.shape[0], np.nan))
    out.update({f"{prefix}tok_row": rows, f"{prefix}tok_pos": positions, f"{prefix}tok_token": tokens.numpy(),
                f"{prefix}tok_mass": stat.mass.numpy(), f"{prefix}tok_surprisal": stat.surprisal.numpy(),
                f"{prefix}tok_entropy": stat.entropy.numpy(), f"{prefix}tok_var": stat.surprisal_var.numpy(),
                f"{prefix}tok_margin": margin})
    for order in options.orderings:
        out[f"{prefix}tok_pit_{order}"] = stat.pit[order].numpy()
    if draft_laws is not None:
        # a single-draft speculative sampler accepts a drafted token here with probability 1 - TV(p, q)
        out[f"{prefix}tok_accept"] = (1.0 - 0.5 * (draft_laws - all_laws).abs().sum(1)).numpy()
    if prefix == "" and logits is not None:
        out["_logits"] = logits  # kept in memory for the greedy margins, never stored
    return out


def _divergences(job: Job, engine: list, reference: list, logits: Optional[list], options: _Options) -> dict:
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
    return {"div_row": np.array(rows, dtype=np.int64), "div_pos": np.array(positions, dtype=np.int64),
            "div_margin": np.array(margins, dtype=np.float64),
            "div_engine": np.array(engine_tokens, dtype=np.int64),
            "div_reference": np.array(reference_tokens, dtype=np.int64)}


def _run_job(job: Job, generator, scorer, reference, draft_scorer, options: _Options) -> dict:
    limit = list(job.limits) if isinstance(job.max_new_tokens, tuple) else job.max_new_tokens
    prompts = [list(p) for p in job.prompts]
    timings = {}
    start = time.perf_counter()
    with call_limit(options.timeout, f"generator did not return within {options.timeout} s on {job.case}",
                    GenerationContractError):
        output = generator(prompts, limit, job.seed, vocab_size=options.vocab_size, case=job.case)
    timings["generation"] = time.perf_counter() - start
    records = {"cont_accepted": np.array(output.accepted if output.accepted is not None else
                                         [-1] * len(prompts), dtype=np.int64),
               "cont_calls": np.array(output.target_calls if output.target_calls is not None else
                                      [-1] * len(prompts), dtype=np.int64),
               "cont_tokens": np.array([t for c in output.continuations for t in c] or [], dtype=np.int64)}
    start = time.perf_counter()
    records.update(_score_tokens(job, prompts, output.continuations, scorer, draft_scorer, options, ""))
    timings["scoring"] = time.perf_counter() - start
    if reference is not None:
        start = time.perf_counter()
        with call_limit(options.timeout, f"reference did not return within {options.timeout} s on {job.case}",
                        GenerationContractError):
            ref = reference(prompts, limit, job.seed, vocab_size=options.vocab_size, case=job.case)
        timings["reference"] = time.perf_counter() - start
        start = time.perf_counter()
        # with the draft scorer too: the ratio order needs the draft's law at the reference's positions
        records.update(_score_tokens(job, prompts, ref.continuations, scorer, draft_scorer, options, "ref_"))
        records["ref_cont_tokens"] = np.array([t for c in ref.continuations for t in c] or [], dtype=np.int64)
        records.update(_divergences(job, output.continuations, ref.continuations, records.get("_logits"), options))
        timings["scoring"] += time.perf_counter() - start
    records.pop("_logits", None)
    records["seconds"] = np.array([timings.get(k, 0.0) for k in ("generation", "reference", "scoring")])
    return records


# ---------------------------------------------------------------------------------------------
# Analysis: from the stored jobs to the family and the result
# ---------------------------------------------------------------------------------------------


@dataclasses.dataclass
class _Tokens:
    """Every scored token of one source (engine or reference), columns concatenated over jobs."""

    pit: dict
    arm: np.ndarray
    job: np.ndarray
    row: np.ndarray
    prompt: np.ndarray
    position: np.ndarray
    token: np.ndarray
    mass: np.ndarray
    surprisal: np.ndarray
    entropy: np.ndarray
    var: np.ndarray
    margin: np.ndarray
    accept: Optional[np.ndarray]

    @property
    def size(self) -> int:
        return int(self.token.size)


def _collect(jobs: dict, stored: list, options: _Options, prefix: str) -> _Tokens:
    columns = {k: [] for k in ("arm", "job", "row", "prompt", "position", "token", "mass", "surprisal", "entropy",
                               "var", "margin", "accept")}
    pits = {o: [] for o in options.orderings}
    for index, _, rec in stored:
        job = jobs[index]
        rows = rec[f"{prefix}tok_row"].astype(np.int64)
        if rows.size == 0:
            continue
        columns["arm"].append(np.full(rows.size, ARMS.index(job.arm)))
        columns["job"].append(np.full(rows.size, index))
        columns["row"].append(rows)
        columns["prompt"].append(np.asarray(job.prompt_ids)[rows])
        columns["position"].append(rec[f"{prefix}tok_pos"].astype(np.int64))
        for name, key in (("token", "token"), ("mass", "mass"), ("surprisal", "surprisal"), ("entropy", "entropy"),
                          ("var", "var"), ("margin", "margin")):
            columns[name].append(rec[f"{prefix}tok_{key}"])
        if f"{prefix}tok_accept" in rec:
            columns["accept"].append(rec[f"{prefix}tok_accept"])
        for order in options.orderings:
            pits[order].append(rec[f"{prefix}tok_pit_{order}"])

    def cat(values, dtype=np.float64):
        return np.concatenate(values).astype(dtype) if values else np.zeros(0, dtype=dtype)

    accept = cat(columns["accept"]) if columns["accept"] else None
    return _Tokens({o: cat(v) for o, v in pits.items()}, cat(columns["arm"], np.int64), cat(columns["job"], np.int64),
                   cat(columns["row"], np.int64), cat(columns["prompt"], np.int64),
                   cat(columns["position"], np.int64), cat(columns["token"], np.int64), cat(columns["mass"]),
                   cat(columns["surprisal"]), cat(columns["entropy"]), cat(columns["var"]), cat(columns["margin"]),
                   accept)


def _strata(tokens: _Tokens, options: _Options, prompts: list) -> list:
    """``(name, mask)`` of every stratum worth a test: all, each arm, each position bucket, each prompt."""
    out = [("all", np.ones(tokens.size, dtype=bool))]
    for a, arm in enumerate(ARMS):
        if arm in options.arms:
            out.append((f"arm {arm}", tokens.arm == a))
    edges = (0,) + options.position_buckets + (np.iinfo(np.int64).max,)
    for name, low, high in zip(_bucket_names(options.position_buckets), edges, edges[1:]):
        out.append((name, (tokens.position >= low) & (tokens.position < high)))
    if len(prompts) > 1:
        for p in range(len(prompts)):
            out.append((f"prompt {p}", tokens.prompt == p))
    return [(name, mask) for name, mask in out if int(mask.sum()) >= MIN_STRATUM_TOKENS or name == "all"]


def _family_size(tokens: _Tokens, options: _Options, prompts: list, has_reference: bool) -> int:
    """The size of the Holm family (an upper bound): each test's minimum detectable TV is quoted at alpha / size."""
    strata = _strata(tokens, options, prompts)
    plain = sum(not name.startswith("prompt") for name, _ in strata)
    two = (1 + len(options.arms)) * len(options.orderings) if has_reference else 0
    return len(strata) * len(options.orderings) + plain + two + 4


def _one_sample(tokens: _Tokens, options: _Options, prompts: list, level: float, label: str = "") -> list:
    """The PIT tests per order and stratum, and the surprisal tests per stratum (unadjusted)."""
    tests = []
    strata = _strata(tokens, options, prompts)
    for order in options.orderings:
        pit = torch.from_numpy(tokens.pit[order])
        for name, mask in strata:
            if int(mask.sum()) == 0:
                continue
            tests.append(pit_test(pit[torch.from_numpy(mask)], f"{label}pit {order} / {name}", level=level,
                                  power=options.power))
    surprisal, entropy, var = (torch.from_numpy(x) for x in (tokens.surprisal, tokens.entropy, tokens.var))
    for name, mask in strata:
        if name.startswith("prompt") or int(mask.sum()) == 0:
            continue
        m = torch.from_numpy(mask)
        tests.append(surprisal_test(surprisal[m], entropy[m], var[m], f"{label}surprisal / {name}"))
    return tests


def _agreement(jobs: dict, stored: list) -> tuple[list, dict]:
    """Repeated requests' first tokens: pairs within a batch (repeated arm) and across rounds (same prompt)."""
    agree, chance, identical = [], [], 0
    by_prompt: dict = {}
    for index, _, rec in stored:
        job = jobs[index]
        first, prob, lengths = rec["cont_first"], rec["cont_chance"], rec["cont_len"]
        tokens = rec["cont_tokens"]
        offsets = np.concatenate([[0], np.cumsum(lengths)])
        if job.arm == "repeated":
            for r in range(0, len(job.prompt_ids) - 1, 2):
                if first[r] < 0 or first[r + 1] < 0 or not np.isfinite(prob[r]):
                    continue
                agree.append(bool(first[r] == first[r + 1]))
                chance.append(float(prob[r]))
                identical += bool(np.array_equal(tokens[offsets[r]:offsets[r + 1]],
                                                 tokens[offsets[r + 1]:offsets[r + 2]]))
        if job.arm in ("single", "repeated") and first.size and first[0] >= 0:
            by_prompt.setdefault((job.arm, job.prompt_ids[0]), []).append((first[0], prob[0]))
    across_agree, across_chance = [], []
    for draws in by_prompt.values():
        for (a, pa), (b, _) in zip(draws[::2], draws[1::2]):
            across_agree.append(bool(a == b))
            across_chance.append(float(pa))
    tests = []
    if agree:
        tests.append(agreement_test(agree, chance, "independence / within a batch"))
    if across_agree:
        tests.append(agreement_test(across_agree, across_chance, "independence / across calls"))
    summary = {"pairs_within": len(agree), "agree_within": int(sum(agree)), "expected_within": float(sum(chance)),
               "identical_within": int(identical), "pairs_across": len(across_agree),
               "agree_across": int(sum(across_agree)), "expected_across": float(sum(across_chance))}
    return tests, summary


def _acceptance(tokens: _Tokens, stored: list) -> dict:
    accepted = np.concatenate([rec["cont_accepted"] for _, _, rec in stored]) if stored else np.zeros(0)
    calls = np.concatenate([rec["cont_calls"] for _, _, rec in stored]) if stored else np.zeros(0)
    lengths = np.concatenate([rec["cont_len"] for _, _, rec in stored]) if stored else np.zeros(0)
    out: dict = {}
    reported = calls >= 0
    if reported.any() and calls[reported].sum() > 0:
        out["tokens_per_target_call"] = float(lengths[reported].sum() / calls[reported].sum())
    if (accepted >= 0).any():
        out["accepted_draft_tokens"] = int(accepted[accepted >= 0].sum())
    if tokens.accept is not None and tokens.accept.size:
        out["expected_acceptance_per_drafted_token"] = float(tokens.accept.mean())
        out["note"] = ("the expected acceptance is single-draft speculative sampling's, 1 - TV(draft, target), "
                       "averaged over the emitted contexts (drafted contexts after a rejection differ)")
    return out


def _decide(family: list, deciding: set, alpha: float) -> tuple:
    adjusted = holm([t.pvalue for t in family]) if family else []
    family = [dataclasses.replace(t, pvalue_adjusted=a) for t, a in zip(family, adjusted)]
    inside = [t for t in family if t.name in deciding]
    if not inside:
        return family, 1.0, "none"
    # Holm over the whole family, then only the deciding tests decide: their rejections are a subset
    best = min(inside, key=lambda t: t.pvalue_adjusted)
    return family, float(best.pvalue_adjusted), best.name


def _analyse(jobs: dict, stored: list, failures: list, options: _Options, prompts: list, names: tuple,
             has_reference: bool, greedy: Optional[bool], stop_reason: str, eprocess_p: float, seconds: dict,
             incomplete: bool, num_processes: int) -> GenerationAuditResult:
    tokens = _collect(jobs, stored, options, "")
    if greedy is None:  # detected: every scored law one-hot (on every job, whichever ran first)
        greedy = bool(tokens.size) and bool(np.all((tokens.var <= 1e-12) & (tokens.entropy <= 1e-12)))
    reference = _collect(jobs, stored, options, "ref_") if has_reference else None
    confidence = 1.0 - options.alpha
    # the family's size fixes the level each test's minimum detectable TV is quoted at (its Bonferroni share)
    level = options.alpha / _family_size(tokens, options, prompts, has_reference)
    one = _one_sample(tokens, options, prompts, level)
    family = list(one)
    deciding = {t.name for t in one}
    agreement_tests, agreement = _agreement(jobs, stored)
    family += agreement_tests
    deciding |= {t.name for t in agreement_tests}
    if eprocess_p < 1.0 or tokens.size:
        family.append(TestResult("e-process", -math.log(max(eprocess_p, 1e-300)), eprocess_p, None, tokens.size,
                                 detail="anytime-valid plug-in e-process on binned PIT values, averaged over the "
                                        "orders (statistic: max log E)"))
        deciding.add("e-process")
    decided_by = "one-sample"
    reference_rejected = None
    floor: tuple = ()
    if has_reference and reference is not None and reference.size:
        ref_tests = _one_sample(reference, options, prompts, level, label="reference ")
        ref_family = holm([t.pvalue for t in ref_tests])
        reference_rejected = bool(ref_family and min(ref_family) <= options.alpha)
        floor = tuple(held_out_tv(torch.from_numpy(reference.pit[o]), torch.from_numpy(reference.job % 2), o,
                                  confidence) for o in options.orderings)
        if not greedy:
            two = []
            for order in options.orderings:
                engine_pit, ref_pit = torch.from_numpy(tokens.pit[order]), torch.from_numpy(reference.pit[order])
                two.append(two_sample_test(engine_pit, ref_pit, f"two-sample {order} / all"))
                for a, arm in enumerate(ARMS):
                    e, r = tokens.arm == a, reference.arm == a
                    if arm in options.arms and e.sum() >= MIN_STRATUM_TOKENS and r.sum() >= MIN_STRATUM_TOKENS:
                        two.append(two_sample_test(engine_pit[torch.from_numpy(e)], ref_pit[torch.from_numpy(r)],
                                                   f"two-sample {order} / arm {arm}"))
            family += two
            deciding |= {t.name for t in two}
            if reference_rejected:
                # the scorer's numerics differ from the engine's beyond their noise: judge against the reference
                decided_by = "two-sample"
                deciding -= {t.name for t in one} | {"e-process"}
    # decisive violations: tokens of zero target mass; greedy divergences at a margin
    # the numerics floor in logits: the largest margin at which the reference (no speculation) itself
    # emits tokens the scorer gives no mass; an engine token within it is the engines' numerics too
    tolerance = options.logit_tol
    if reference is not None and reference.size:
        ref_zero = reference.margin[reference.mass <= options.zero_mass_tol]
        ref_zero = ref_zero[np.isfinite(ref_zero)]  # a margin the scorer did not give (no logits) sets no floor
        if ref_zero.size:
            tolerance = max(tolerance, float(ref_zero.max()))
    zero = []
    for i in np.flatnonzero(tokens.mass <= options.zero_mass_tol)[:1000]:
        margin = None if not np.isfinite(tokens.margin[i]) else float(tokens.margin[i])
        zero.append(ZeroMassToken(ARMS[tokens.arm[i]], int(tokens.job[i]), int(tokens.row[i]), int(tokens.prompt[i]),
                                  int(tokens.position[i]), int(tokens.token[i]), margin,
                                  margin is not None and margin <= tolerance))
    violations = [z for z in zero if not z.numerics]
    after_eos = [(index, r, int(pos)) for index, _, rec in stored
                 for r, pos in enumerate(rec.get("cont_after_eos", np.zeros(0))) if pos >= 0]
    divergences = _divergence_rows(jobs, stored, options) if greedy and has_reference else []
    if greedy:
        # every law one-hot: an emitted argmax has PIT = U (noise) and surprisal 0, so the one-sample
        # tests carry nothing the support check does not; and a token within the numerics tolerance
        # (PIT 1: past the whole mass) must not become a finding through them
        decided_by = "greedy"
        deciding -= {t.name for t in one} | {"e-process"}
    real_divergences = [d for d in divergences if not d.numerics]
    family, pvalue, test = _decide(family, deciding, options.alpha)
    support = TestResult("support", float(len(violations)), 0.0 if violations else 1.0, None, tokens.size,
                         pvalue_adjusted=0.0 if violations else 1.0,
                         detail="emitted tokens of zero target mass beyond the numerics tolerance (any one is a "
                                "finding)")
    greedy_test = TestResult("greedy", float(len(real_divergences)), 0.0 if real_divergences else 1.0, None,
                             len(divergences), pvalue_adjusted=0.0 if real_divergences else 1.0,
                             detail="greedy continuations that depart from the reference at a logit margin above "
                                    "the tolerance")
    family.append(support)
    if options.eos_token_id is not None:
        family.append(TestResult("end-of-sequence", float(len(after_eos)), 0.0 if after_eos else 1.0, None,
                                 int(sum(rec["cont_len"].size for _, _, rec in stored)),
                                 pvalue_adjusted=0.0 if after_eos else 1.0,
                                 detail=f"continuations that go on after the end-of-sequence token "
                                        f"{options.eos_token_id} (any one is a finding)"))
    if greedy and has_reference:
        family.append(greedy_test)
    if violations:
        pvalue, test = 0.0, "support"
    elif after_eos:
        pvalue, test = 0.0, "end-of-sequence"
    elif real_divergences:
        pvalue, test = 0.0, "greedy"
    held = tuple(held_out_tv(torch.from_numpy(tokens.pit[o]), torch.from_numpy(tokens.job % 2), o, confidence)
                 for o in options.orderings)
    all_tokens = torch.from_numpy(tokens.pit["probability"]) if tokens.size else torch.zeros(0)
    mdtv = (pit_test(all_tokens, "pit probability / all", level=level, power=options.power).min_detectable_tv
            if tokens.size else math.inf)
    z = surprisal_test(torch.from_numpy(tokens.surprisal), torch.from_numpy(tokens.entropy),
                       torch.from_numpy(tokens.var), "surprisal").statistic if tokens.size else 0.0
    if not stored:
        verdict = "ERROR"
    elif pvalue <= options.alpha:
        verdict = "FINDING"
    elif greedy and not has_reference and not violations:
        verdict = "PASS"  # greedy against the scorer: every token was the scorer's argmax (or a near-tie)
    elif greedy and has_reference:
        verdict = "PASS"
    else:
        verdict = "INCONCLUSIVE" if not mdtv <= options.min_detectable_tv * (1 + 1e-9) else "PASS"
    strata_rows = tuple(_stratum_row(t, tokens, options, prompts) for t in family if t.name.startswith("pit "))
    arm_tokens = {arm: int((tokens.arm == a).sum()) for a, arm in enumerate(ARMS) if arm in options.arms}
    return GenerationAuditResult(
        generator=names[0], scorer=names[1], verdict=verdict, pvalue=pvalue, test=test, alpha=options.alpha,
        power=options.power, min_detectable_tv=mdtv, requested_tv=options.min_detectable_tv, num_tokens=tokens.size,
        num_continuations=int(sum(rec["cont_len"].size for _, _, rec in stored)), num_jobs=len(stored),
        tokens_by_arm=arm_tokens, subtests=tuple(family), deciding=tuple(sorted(deciding)), decided_by=decided_by,
        held_out_tv=held, numerics_floor=floor, reference_rejected=reference_rejected, zero_mass=tuple(zero[:50]),
        divergences=tuple(divergences[:50]), strata=strata_rows, surprisal_z=float(z), agreement=agreement,
        acceptance=_acceptance(tokens, stored), greedy=greedy, stop_reason=stop_reason,
        after_eos=tuple({"job": j, "row": r, "position": p} for j, r, p in after_eos[:50]),
        failures=tuple(f"job {j} ({arm}): {m}" for j, arm, m in failures), seconds=seconds, num_bins=NUM_BINS,
        incomplete=incomplete, num_processes=num_processes, logit_tolerance=tolerance)


def _mask(tokens: _Tokens, options: _Options, prompts: list, name: str) -> np.ndarray:
    stratum = name.split(" / ", 1)[1]
    return dict(_strata(tokens, options, prompts))[stratum]


def _stratum_row(test: TestResult, tokens: _Tokens, options: _Options, prompts: list) -> StratumRow:
    order = test.name.split()[1]
    mask = _mask(tokens, options, prompts, test.name)
    pit = tokens.pit[order][mask]
    histogram = np.bincount(np.minimum((pit * NUM_BINS).astype(np.int64), NUM_BINS - 1), minlength=NUM_BINS)
    n = int(mask.sum())
    low, high = stats.binom.ppf([0.005, 0.995], n, 1.0 / NUM_BINS) if n else (0.0, 0.0)
    return StratumRow(test.name.split(" / ", 1)[1], order, n, test.pvalue, test.pvalue_adjusted,
                      test.min_detectable_tv if test.min_detectable_tv is not None else math.inf,
                      tuple(float(x) for x in histogram), (float(low), float(high)))


def _divergence_rows(jobs: dict, stored: list, options: _Options) -> list:
    out = []
    for index, _, rec in stored:
        if "div_row" not in rec:
            continue
        job = jobs[index]
        lengths, ref_lengths = rec["cont_len"], rec["ref_cont_len"]
        offsets = np.concatenate([[0], np.cumsum(lengths)])
        ref_offsets = np.concatenate([[0], np.cumsum(ref_lengths)])
        for r, pos, margin, a, b in zip(rec["div_row"], rec["div_pos"], rec["div_margin"], rec["div_engine"],
                                        rec["div_reference"]):
            engine_tail = rec["cont_tokens"][offsets[r] + pos: min(offsets[r + 1], offsets[r] + pos + 16)]
            ref_tail = rec["ref_cont_tokens"][ref_offsets[r] + pos: min(ref_offsets[r + 1], ref_offsets[r] + pos + 16)]
            finite = bool(np.isfinite(margin))
            out.append(Divergence(job.arm, index, int(r), int(job.prompt_ids[r]), int(pos), int(a), int(b),
                                  float(margin) if finite else None, finite and float(margin) <= options.logit_tol,
                                  tuple(int(t) for t in engine_tail), tuple(int(t) for t in ref_tail)))
    return out


# ---------------------------------------------------------------------------------------------
# The entry point
# ---------------------------------------------------------------------------------------------


def _check_options(vocab_size, max_new_tokens, batch_size, rounds, arms, seed, alpha, power, min_detectable_tv,
                   orderings, position_buckets, zero_mass_tol, logit_tol, max_tokens, max_seconds, timeout,
                   eos_token_id, draft_score) -> _Options:
    def integer(name, value, low):
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise InvalidArgument(f"{name}: expected an integer >= {low}, got {value!r}")
        return int(value)

    def number(name, value, low, high, closed=True):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not (
                low <= value < high if closed else low < value < high):
            where = f"[{low}, {high})" if closed else f"({low}, {high})"
            raise InvalidArgument(f"{name}: expected a number in {where}, got {value!r}")
        return float(value)

    vocab_size = integer("vocab_size", vocab_size, 2)
    max_new_tokens = integer("max_new_tokens", max_new_tokens, 1)
    batch_size = integer("batch_size", batch_size, 2)
    rounds = integer("rounds", rounds, 1)
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise InvalidArgument(f"seed: expected an integer, got {seed!r}")
    alpha, power = check_prob("alpha", alpha), check_prob("power", power)
    min_detectable_tv = number("min_detectable_tv", min_detectable_tv, 0.0, 1.0, closed=False)
    if orderings is None:
        orderings = ("probability", "ratio", "token-id") if draft_score is not None else ("probability", "token-id")
    if isinstance(orderings, str):
        orderings = (orderings,)
    orderings = tuple(orderings)
    if not orderings or any(o not in ORDERINGS for o in orderings) or len(set(orderings)) != len(orderings):
        raise InvalidArgument(f"orderings: expected distinct ones of {ORDERINGS}, got {list(orderings)!r}")
    if "ratio" in orderings and draft_score is None:
        raise InvalidArgument("orderings: 'ratio' needs draft_score (the draft model's law at each position)")
    if isinstance(position_buckets, (str, bytes)) or not isinstance(position_buckets, Sequence):
        raise InvalidArgument(f"position_buckets: expected increasing positive integers, got {position_buckets!r}")
    buckets = tuple(position_buckets)
    if any(isinstance(b, bool) or not isinstance(b, int) or b < 1 for b in buckets) or \
            list(buckets) != sorted(set(buckets)):
        raise InvalidArgument(f"position_buckets: expected increasing positive integers, got {list(buckets)!r}")
    if max_tokens is not None:
        max_tokens = integer("max_tokens", max_tokens, 1)
    for name, value in (("max_seconds", max_seconds), ("timeout", timeout)):
        if value is not None:
            number(name, value, 0.0, math.inf, closed=False)
    zero_mass_tol = number("zero_mass_tol", zero_mass_tol, 0.0, 1.0)
    logit_tol = number("logit_tol", logit_tol, 0.0, math.inf)
    if isinstance(arms, str):
        arms = (arms,)
    if not isinstance(arms, Sequence):
        raise InvalidArgument(f"arms: expected some of {ARMS}, got {arms!r}")
    arms = tuple(arms)
    if not arms or any(a not in ARMS for a in arms) or len(set(arms)) != len(arms):
        raise InvalidArgument(f"arms: expected distinct ones of {ARMS}, got {list(arms)!r}")
    if eos_token_id is not None:
        if isinstance(eos_token_id, bool) or not isinstance(eos_token_id, int) or not 0 <= eos_token_id < vocab_size:
            raise InvalidArgument(f"eos_token_id: expected a token id in [0, {vocab_size}), got {eos_token_id!r}")
    return _Options(vocab_size, max_new_tokens, batch_size, rounds, arms, seed, alpha, power,
                    min_detectable_tv, orderings, buckets, zero_mass_tol, logit_tol, max_tokens,
                    None if max_seconds is None else float(max_seconds), None if timeout is None else float(timeout),
                    eos_token_id)


def _check_flags(**flags) -> None:
    """The switches of :func:`audit_generation`: each None or a bool (``resume`` a bool)."""
    for name, value in flags.items():
        if (value is None and name != "resume") or isinstance(value, bool):
            continue
        raise InvalidArgument(f"{name}: expected {'True or False' if name == 'resume' else 'None, True or False'}, "
                              f"got {value!r}")


def _max_family_size(options: _Options, num_prompts: int, has_reference: bool) -> int:
    """The largest Holm family the analysis can build (every stratum filled), known before any job runs."""
    plain = 1 + len(options.arms) + len(options.position_buckets) + 1
    strata = plain + (num_prompts if num_prompts > 1 else 0)
    two = (1 + len(options.arms)) * len(options.orderings) if has_reference else 0
    return strata * len(options.orderings) + plain + two + 3  # + agreement within, across, e-process


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


def _collective(distributed) -> _Collective:
    return _Collective(current_shards(distributed))


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
    rounds: int = 1,
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
    store: Optional[str] = None,
    resume: bool = False,
    distributed: Any = "auto",
    progress: Optional[bool] = None,
    eos_token_id: Optional[int] = None,
    per_row_max_new_tokens: Optional[bool] = None,
    name: Optional[str] = None,
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
    max_new_tokens, batch_size, rounds : int
        Per row; rows per batch (``equal``, ``ragged``, ``repeated`` arms); how many times the
        whole design runs (with new seeds).
    arms : sequence of str
        Batch designs (:data:`~spectr_audit.generation.designs.ARMS`).
    seed : int
    alpha, power, min_detectable_tv : float
        The familywise false-alarm rate; the power the PASS verdict requires at ``min_detectable_tv``
        (TV of the pooled PIT law over all tokens, by probability).
    orderings : sequence of str, optional
        PIT orders (default ``probability`` and ``token-id``, and ``ratio`` with a draft scorer).
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
    options = _check_options(vocab_size, max_new_tokens, batch_size, rounds, arms, seed, alpha, power,
                             min_detectable_tv, orderings, position_buckets, zero_mass_tol, logit_tol, max_tokens,
                             max_seconds, timeout, eos_token_id, draft_score)
    prompts = check_prompts(prompts, options.vocab_size)
    _check_flags(greedy=greedy, resume=resume, progress=progress, per_row_max_new_tokens=per_row_max_new_tokens)
    if store is not None and not isinstance(store, (str, os.PathLike)):
        raise InvalidArgument(f"store: expected a file path or None, got {type(store).__name__}")
    if isinstance(distributed, str) and distributed != "auto":
        raise InvalidArgument(f"distributed: expected 'auto', True, False or a process group, got {distributed!r}")
    if name is not None and not isinstance(name, str):
        raise InvalidArgument(f"name: expected a string, got {name!r}")
    generator = as_generator(generate, name=name, per_row_max_new_tokens=per_row_max_new_tokens, argument="generate")
    scorer = as_scorer(score, options.vocab_size, argument="score")
    draft_scorer = (None if draft_score is None else
                    as_scorer(draft_score, options.vocab_size, component="draft scorer", argument="draft_score"))
    reference_gen = None if reference is None else as_generator(reference, component="reference", argument="reference")
    jobs = plan_jobs(prompts, arms=options.arms, batch_size=options.batch_size, rounds=options.rounds,
                     max_new_tokens=options.max_new_tokens, seed=options.seed,
                     per_row_max_new_tokens=generator.per_row_max_new_tokens)
    by_index = {job.index: job for job in jobs}
    group = _collective(distributed)
    rank, world = group.rank, group.world_size
    config = options.config(prompts, reference is not None, draft_score is not None, generator.per_row_max_new_tokens)
    sink, stored = _open_store(store, config, resume, group)
    records: dict = {}  # job index -> records, every job consumed so far (in job order)
    failures: dict = {}  # job index -> (arm, message), every job that failed in this run
    eprocesses = {o: PITEProcess() for o in options.orderings}
    mixture = {"max": 0.0}
    seen = {"spread": False}  # whether a consumed job had a law that is not one-hot (so: not greedy)
    # The e-process may stop the audit once it alone would reject in the largest family the analysis
    # can build; the stopped audit's verdict is then a FINDING that the planned one would reach too,
    # so stopping adds no false alarm.  Not with a reference: there the one-sample tests may be set
    # aside (a numerics floor), and a sample stopped on them would bias the two-sample tests.
    stop_level = None if reference_gen is not None else options.alpha / _max_family_size(options, len(prompts), False)
    stop_reason, start = "planned", time.perf_counter()
    totals = {"generation": 0.0, "reference": 0.0, "scoring": 0.0}
    emitted = 0
    bar = _progress(progress if rank == 0 else False, len(jobs))
    interrupted = False

    def mixture_p() -> float:
        return float(math.exp(-mixture["max"])) if mixture["max"] > 0 else 1.0

    def consume(job: Job, rec: dict) -> Optional[str]:
        """Add one job's records, in job order; return a stop reason (None: go on)."""
        nonlocal emitted
        records[job.index] = rec
        emitted += int(rec["tok_token"].size)
        for key, value in zip(("generation", "reference", "scoring"), rec["seconds"]):
            totals[key] += float(value)
        logs = [eprocesses[o].update(torch.from_numpy(rec[f"tok_pit_{o}"])) for o in options.orderings]
        # the average of the orders' e-processes is one too (each a martingale of mean 1 under the null,
        # all on the same tokens in the same order)
        mixed = float(torch.logsumexp(torch.tensor(logs, dtype=torch.float64), 0)) - math.log(len(logs))
        mixture["max"] = max(mixture["max"], mixed)
        if bar is not None:
            bar.update(bar.task_ids[0], advance=1,
                       description=f"{job.arm}: {emitted} tokens, evidence log E {mixture['max']:.1f}")
        zero = rec["tok_mass"] <= options.zero_mass_tol
        margin = rec["tok_margin"][zero]
        # a zero-mass token beyond the tolerance is decisive; with a reference the tolerance may still
        # grow to the reference's own numerics floor (known at the end), so only a token without a
        # margin stops the audit then
        beyond = ~np.isfinite(margin)
        if reference_gen is None:
            beyond |= margin > options.logit_tol
        if bool(beyond.any()) or bool((rec["cont_after_eos"] >= 0).any()):
            return "support"
        if greedy is None and not seen["spread"]:
            seen["spread"] = bool(np.any((rec["tok_var"] > 1e-12) | (rec["tok_entropy"] > 1e-12)))
        # not on greedy audits: there the e-process does not decide (nor, so, stop)
        if stop_level is not None and mixture_p() <= stop_level and (greedy is False or seen["spread"]):
            return "e-process"
        return None

    def attempt(job: Optional[Job]) -> tuple:
        """Run one job here: ``("ok", records)``, ``("fail", message)``, ``("interrupt",)``, ``("error", text)``."""
        if job is None:
            return ("none",)
        try:
            return ("ok", _run_job(job, generator, scorer, reference_gen, draft_scorer, options))
        except GenerationContractError as exc:
            return ("fail", str(exc))
        except KeyboardInterrupt:
            return ("interrupt",)
        except Exception as exc:  # with shards every process must reach the exchange, or the others hang
            if world == 1:
                raise
            errors[job.index] = exc
            return ("error", f"{type(exc).__name__}: {exc}")

    errors: dict = {}
    try:
        i = 0
        while i < len(jobs):
            if options.max_tokens is not None and emitted >= options.max_tokens:
                stop_reason = "max_tokens"
                break
            job = jobs[i]
            if job.index in stored:  # finished by an earlier run of this audit: replayed, in job order
                i += 1
                reason = consume(job, stored[job.index])
                if reason is not None:
                    stop_reason = reason
                    break
                continue
            # a round: the next `world` jobs not stored yet, one per process (the stored ones between
            # them are replayed in their place)
            batch, end = [], i
            while end < len(jobs) and len(batch) < world:
                if jobs[end].index not in stored:
                    batch.append(jobs[end])
                end += 1
            if options.max_seconds is not None and group.broadcast(time.perf_counter() - start >= options.max_seconds):
                stop_reason = "max_seconds"
                break
            outcomes = group.gather(attempt(batch[rank] if rank < len(batch) else None))
            broken = [w for w, outcome in enumerate(outcomes) if outcome[0] == "error"]
            if broken:
                mine = errors.get(batch[rank].index) if rank < len(batch) else None
                if mine is not None:
                    raise mine
                raise WorkerFailed(f"process {broken[0]} of {world} failed on {batch[broken[0]].case}: "
                                   f"{outcomes[broken[0]][1]}")
            outcome_of = {job.index: outcome for job, outcome in zip(batch, outcomes)}
            reason = None
            for k in range(i, end):
                job = jobs[k]
                if options.max_tokens is not None and emitted >= options.max_tokens:
                    reason = "max_tokens"
                    break
                if job.index in stored:
                    reason = consume(job, stored[job.index])
                else:
                    outcome = outcome_of[job.index]
                    if outcome[0] == "interrupt":
                        interrupted, reason = True, "interrupted"
                        break
                    if outcome[0] == "fail":
                        failures[job.index] = (job.arm, outcome[1])
                        if sink is not None:
                            sink.fail(job.index, job.arm, outcome[1])
                        continue
                    if sink is not None:
                        sink.put(job.index, job.arm, outcome[1])
                    reason = consume(job, outcome[1])
                if reason is not None:
                    break
            i = end
            if reason is not None:
                stop_reason = reason
                break
    except KeyboardInterrupt:
        interrupted = True
        stop_reason = "interrupted"
    except BaseException:
        if sink is not None:
            sink.close()
        raise
    finally:
        if bar is not None:
            bar.stop()
    consumed = [(index, by_index[index].arm, records[index]) for index in sorted(records)]
    failed = [(index, arm, message) for index, (arm, message) in sorted(failures.items())]
    totals["tests"] = 0.0
    test_start = time.perf_counter()
    result = _analyse(by_index, consumed, failed, options, prompts, (generator.name, scorer.name),
                      reference_gen is not None, greedy, stop_reason, mixture_p(), totals, interrupted, world)
    totals["tests"] = time.perf_counter() - test_start
    if sink is not None:
        sink.close()
    if interrupted:
        raise GenerationInterrupted(result)
    return result
