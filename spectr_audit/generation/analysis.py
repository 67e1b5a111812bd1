"""The generation audit's analysis: from the finished jobs' records to the Holm family, the verdict and the result."""

from __future__ import annotations

import dataclasses
import math
from typing import Optional

import numpy as np
import torch
from scipy import stats

from spectr_audit.generation.conditions import condition_reached
from spectr_audit.generation.designs import ARMS
from spectr_audit.generation.family import AGREEMENT_TESTS, FamilyPlan
from spectr_audit.generation.options import _bucket_names, _Options
from spectr_audit.generation.records import STOP_CODES
from spectr_audit.generation.request import GenerationRequest, RunOutcome
from spectr_audit.generation.results import Divergence, GenerationAuditResult, StratumRow, ZeroMassToken
from spectr_audit.generation.statistical_tests import (
    NUM_BINS,
    agreement_test,
    held_out_tv,
    pit_test,
    surprisal_test,
    two_sample_test,
)
from spectr_audit.statistical.gof import TestResult, holm
from spectr_audit.statistical.power import required_samples

#: A stratum is tested when it holds at least this many tokens (the bins' expected count is then >= 5).
MIN_STRATUM_TOKENS = 5 * NUM_BINS


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
    #: With requests of more than one kind: each token's request kind (an index into ``kind_names``).
    kind: Optional[np.ndarray] = None
    kind_names: tuple = ()
    #: What ``arm`` indexes: the arms, then the serving conditions' names.
    arm_names: tuple = ARMS
    #: Whether the token counts in its condition's stratum (False: a follow-up job's first pass; True elsewhere).
    counted: Optional[np.ndarray] = None
    #: Whether the token's job has the reference's records too (the two-sample tests compare those jobs only).
    paired: Optional[np.ndarray] = None

    @property
    def size(self) -> int:
        return int(self.token.size)


def _collect(jobs: dict, stored: list, options: _Options, reference: bool,
             row_kinds: Optional[tuple] = None, arm_names: tuple = ARMS) -> _Tokens:
    """The engine's tokens over every job (the reference's with ``reference=True``); with ``row_kinds``
    (``(kind names, {job index: kind index per row})``) each token's request kind; ``arm_names``: the arms and
    the serving conditions' names."""
    columns = {k: [] for k in ("arm", "job", "row", "prompt", "position", "token", "mass", "surprisal", "entropy",
                               "var", "margin", "accept", "kind", "counted", "paired")}
    pits = {o: [] for o in options.orderings}
    for index, _, rec in stored:
        job = jobs[index]
        if reference and rec.reference is None:
            continue  # a further round of rounds="auto" run without the reference
        tokens = (rec.reference if reference else rec.engine).tokens
        rows = tokens.row.astype(np.int64)
        if rows.size == 0:
            continue
        columns["arm"].append(np.full(rows.size, arm_names.index(job.arm)))
        # a follow-up job's first pass comes before any cache hit: all tokens, not its condition's stratum
        columns["counted"].append(rows >= len(job.prompts) // 2 if job.follow_up else np.ones(rows.size, dtype=bool))
        columns["paired"].append(np.full(rows.size, rec.reference is not None))
        columns["job"].append(np.full(rows.size, index))
        columns["row"].append(rows)
        columns["prompt"].append(np.asarray(job.prompt_ids)[rows])
        if row_kinds is not None:
            columns["kind"].append(np.asarray(row_kinds[1][index], dtype=np.int64)[rows])
        columns["position"].append(tokens.position.astype(np.int64))
        for name, values in (("token", tokens.token), ("mass", tokens.mass), ("surprisal", tokens.surprisal),
                             ("entropy", tokens.entropy), ("var", tokens.variance), ("margin", tokens.margin)):
            columns[name].append(values)
        if tokens.accept is not None:
            columns["accept"].append(tokens.accept)
        for order in options.orderings:
            pits[order].append(tokens.pit[order])

    def cat(values, dtype=np.float64):
        return np.concatenate(values).astype(dtype) if values else np.zeros(0, dtype=dtype)

    accept = cat(columns["accept"]) if columns["accept"] else None
    integers = ("arm", "job", "row", "prompt", "position", "token")
    return _Tokens(pit={o: cat(v) for o, v in pits.items()},
                   **{name: cat(columns[name], np.int64 if name in integers else np.float64)
                      for name in (*integers, "mass", "surprisal", "entropy", "var", "margin")},
                   accept=accept, kind=cat(columns["kind"], np.int64) if row_kinds is not None else None,
                   kind_names=tuple(row_kinds[0]) if row_kinds is not None else (), arm_names=tuple(arm_names),
                   counted=cat(columns["counted"], bool), paired=cat(columns["paired"], bool))


def _strata(tokens: _Tokens, options: _Options, prompts: list) -> list:
    """``(name, mask)`` of every stratum worth a test: all, each arm, each serving condition, each position bucket,
    each prompt."""
    out = [("all", np.ones(tokens.size, dtype=bool))]
    for a, arm in enumerate(ARMS):
        if arm in options.arms:
            out.append((f"arm {arm}", tokens.arm == a))
    for c in range(len(ARMS), len(tokens.arm_names)):
        out.append((f"condition {tokens.arm_names[c]}", (tokens.arm == c) & tokens.counted))
    edges = (0,) + options.position_buckets + (np.iinfo(np.int64).max,)
    for name, low, high in zip(_bucket_names(options.position_buckets), edges, edges[1:]):
        out.append((name, (tokens.position >= low) & (tokens.position < high)))
    if len(prompts) > 1:
        for p in range(len(prompts)):
            out.append((f"prompt {p}", tokens.prompt == p))
    if tokens.kind is not None:
        for k, kind in enumerate(tokens.kind_names):
            out.append((f"request {kind}", tokens.kind == k))
    return [(name, mask) for name, mask in out if int(mask.sum()) >= MIN_STRATUM_TOKENS or name == "all"]


def _two_sample_strata(tokens: _Tokens, reference: _Tokens, options: _Options) -> tuple:
    """The strata of the two-sample tests: all tokens, and each arm where both sources hold enough tokens."""
    return ("all",) + tuple(f"arm {arm}" for a, arm in enumerate(ARMS)
                            if arm in options.arms and ((tokens.arm == a) & tokens.paired).sum() >= MIN_STRATUM_TOKENS
                            and (reference.arm == a).sum() >= MIN_STRATUM_TOKENS)


def family_plan(tokens: _Tokens, reference: Optional[_Tokens], agreement_tests: list, eprocess: list,
                options: _Options, prompts: list, greedy: bool, has_reference: bool,
                request_checks: tuple = ()) -> FamilyPlan:
    """The tests of these tokens: the strata they fill, the agreement tests and e-process that have data, (with
    a reference's tokens, not greedy) the two-sample strata both sources fill, and the decisive checks."""
    return FamilyPlan(options.orderings, tuple(name for name, mask in _strata(tokens, options, prompts) if mask.any()),
                      tuple(t.name for t in agreement_tests), bool(eprocess),
                      _two_sample_strata(tokens, reference, options) if reference is not None and not greedy else (),
                      FamilyPlan.decisive_checks(options.eos_token_id, greedy and has_reference, request_checks))


def largest_family(request: GenerationRequest, has_reference: bool = False) -> FamilyPlan:
    """The largest Holm family the analysis can build from ``request``'s planned jobs, known before any job runs.

    Each planned row is counted as emitting every token its job allows (``Job.limits``; the contract refuses a
    longer row), so a stratum's capacity bounds the tokens any run can put in it: a stratum that cannot reach
    :data:`MIN_STRATUM_TOKENS` is left out (the analysis leaves it out too), and so is an agreement test the design
    cannot pair (within a batch: a repeated-arm call of two rows or more; across calls: a prompt that leads two
    single or repeated calls).  The family built is never larger; it is this one when every row runs to its limit.
    """
    options = request.options
    kinds = request.request_kinds()
    edges = (0,) + tuple(options.position_buckets) + (np.iinfo(np.int64).max,)
    buckets = list(zip(_bucket_names(options.position_buckets), edges, edges[1:]))
    capacity: dict = {}
    leads: dict = {}
    within = False
    for job in request.jobs:
        row_kinds = [r.kind for r in request.row_requests(job)] if kinds else None
        for i, limit in enumerate(job.limits):
            counted = not job.follow_up or i >= len(job.prompts) // 2
            names = [f"{'condition' if job.is_condition else 'arm'} {job.arm}"] if counted else []
            names += [f"prompt {job.prompt_ids[i]}"]
            names += [f"request {row_kinds[i]}"] if row_kinds else []
            for name in names:
                capacity[name] = capacity.get(name, 0) + limit
            for name, low, high in buckets:
                capacity[name] = capacity.get(name, 0) + max(0, min(high, limit) - low)
        within |= job.arm == "repeated" and len(job.prompts) >= 2
        if job.arm in ("single", "repeated") and job.prompts:
            key = (job.arm, job.prompt_ids[0])
            leads[key] = leads.get(key, 0) + 1
    agreement = ((AGREEMENT_TESTS[0],) if within else ()) + \
        ((AGREEMENT_TESTS[1],) if any(n >= 2 for n in leads.values()) else ())
    return FamilyPlan.largest(options.orderings, options.arms, options.position_buckets, len(request.prompts),
                              has_reference, kinds, capacity=capacity, min_stratum_tokens=MIN_STRATUM_TOKENS,
                              agreement=agreement, conditions=tuple(c.name for c in request.conditions))


def planned_tokens(request: GenerationRequest) -> tuple:
    """``(tokens, family size)``: the engine tokens the all-tokens PIT test needs to detect ``min_detectable_tv`` with
    ``power`` at its share ``alpha / size`` of the largest family ``request``'s planned jobs can give (its decisive
    checks counted, as the analysis counts them), so that the analysis's own minimum detectable TV, quoted at the
    family it builds (never larger), is at most the requested one once that many tokens are scored."""
    options = request.options
    plan = largest_family(request, request.has_reference)
    size = plan.holm_size + len(FamilyPlan.decisive_checks(options.eos_token_id, request.has_reference,
                                                           request.request_checks()))
    return required_samples(options.min_detectable_tv, NUM_BINS, options.alpha / size, options.power), size


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
        first, prob, lengths = rec.engine.first_token, rec.engine.first_collision, rec.engine.lengths
        tokens = rec.engine.emitted
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
    accepted = np.concatenate([rec.accepted for _, _, rec in stored]) if stored else np.zeros(0)
    calls = np.concatenate([rec.target_calls for _, _, rec in stored]) if stored else np.zeros(0)
    lengths = np.concatenate([rec.engine.lengths for _, _, rec in stored]) if stored else np.zeros(0)
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


def _eprocess_tests(eprocess_p: float, tokens: _Tokens) -> list:
    """The e-process's entry of the family: none when it saw no token and gathered no evidence."""
    if eprocess_p < 1.0 or tokens.size:
        return [TestResult("e-process", -math.log(max(eprocess_p, 1e-300)), eprocess_p, None, tokens.size,
                           detail="anytime-valid plug-in e-process on binned PIT values, averaged over the "
                                  "orders (statistic: max log E)")]
    return []


def _against_reference(tokens: _Tokens, reference: _Tokens, options: _Options, prompts: list, level: float,
                       confidence: float, plan: FamilyPlan) -> tuple:
    """``(reference_rejected, numerics_floor, two_sample_tests)``: whether the one-sample tests reject the
    reference itself, its held-out TV bounds, and the engine-against-reference tests of ``plan``."""
    ref_tests = _one_sample(reference, options, prompts, level, label="reference ")
    ref_family = holm([t.pvalue for t in ref_tests])
    reference_rejected = bool(ref_family and min(ref_family) <= options.alpha)
    floor = tuple(held_out_tv(torch.from_numpy(reference.pit[o]), torch.from_numpy(reference.job % 2), o,
                              confidence) for o in options.orderings)
    two = []
    # like against like: the engine's tokens of the calls the reference ran on too
    paired = torch.from_numpy(tokens.paired)
    for order in plan.orderings:
        engine_pit, ref_pit = torch.from_numpy(tokens.pit[order]), torch.from_numpy(reference.pit[order])
        for name in plan.two_sample:
            if name == "all":
                two.append(two_sample_test(engine_pit[paired], ref_pit, f"two-sample {order} / all"))
                continue
            a = ARMS.index(name.split(" ", 1)[1])
            e, r = torch.from_numpy(tokens.arm == a) & paired, torch.from_numpy(reference.arm == a)
            two.append(two_sample_test(engine_pit[e], ref_pit[r], f"two-sample {order} / {name}"))
    own = next((t for t in ref_tests if t.name == f"reference pit {options.power_ordering} / all"), None)
    return reference_rejected, floor, two, own


def _numerics_tolerance(reference: Optional[_Tokens], options: _Options) -> float:
    """The logit tolerance a zero-mass token is numerics within: ``logit_tol``, raised to the reference's floor."""
    # the numerics floor in logits: the largest margin at which the reference (no speculation) itself
    # emits tokens the scorer gives no mass; an engine token within it is the engines' numerics too
    tolerance = options.logit_tol
    if reference is not None and reference.size:
        ref_zero = reference.margin[reference.mass <= options.zero_mass_tol]
        ref_zero = ref_zero[np.isfinite(ref_zero)]  # a margin the scorer did not give (no logits) sets no floor
        if ref_zero.size:
            tolerance = max(tolerance, float(ref_zero.max()))
    return tolerance


def _zero_mass_tokens(tokens: _Tokens, options: _Options, tolerance: float) -> list:
    """The first 1000 emitted tokens of zero target mass, each marked numerics or not."""
    zero = []
    for i in np.flatnonzero(tokens.mass <= options.zero_mass_tol)[:1000]:
        margin = None if not np.isfinite(tokens.margin[i]) else float(tokens.margin[i])
        zero.append(ZeroMassToken(tokens.arm_names[tokens.arm[i]], int(tokens.job[i]), int(tokens.row[i]), int(tokens.prompt[i]),
                                  int(tokens.position[i]), int(tokens.token[i]), margin,
                                  margin is not None and margin <= tolerance))
    return zero


def _after_eos(stored: list) -> list:
    """``(job, row, position)`` of every continuation that goes on after an end-of-sequence token."""
    return [(index, r, int(pos)) for index, _, rec in stored
            for r, pos in enumerate(rec.engine.after_eos) if pos >= 0]


def _decisive_checks(tokens: _Tokens, stored: list, options: _Options, violations: list, after_eos: list,
                     divergences: list, with_greedy: bool) -> list:
    """The checks any one violation of decides: support, end-of-sequence (with an eos id), greedy (if asked)."""
    real_divergences = [d for d in divergences if not d.numerics]
    checks = [TestResult("support", float(len(violations)), 0.0 if violations else 1.0, None, tokens.size,
                         pvalue_adjusted=0.0 if violations else 1.0,
                         detail="emitted tokens of zero target mass beyond the numerics tolerance (any one is a "
                                "finding)")]
    if options.eos_token_id is not None:
        checks.append(TestResult("end-of-sequence", float(len(after_eos)), 0.0 if after_eos else 1.0, None,
                                 int(sum(rec.engine.lengths.size for _, _, rec in stored)),
                                 pvalue_adjusted=0.0 if after_eos else 1.0,
                                 detail=f"continuations that go on after the end-of-sequence token "
                                        f"{options.eos_token_id} (any one is a finding)"))
    if with_greedy:
        checks.append(TestResult("greedy", float(len(real_divergences)), 0.0 if real_divergences else 1.0, None,
                                 len(divergences), pvalue_adjusted=0.0 if real_divergences else 1.0,
                                 detail="greedy continuations that depart from the reference at a logit margin "
                                        "above the tolerance"))
    return checks


_REQUEST_CHECK_DETAIL = {
    "logprobs": lambda request: (f"continuations whose returned log-probabilities (the emitted token's and the "
                                 f"top-n) depart from the scorer's by more than {request.logprob_tolerance:g} "
                                 f"(any one is a finding)"),
    "stopping": lambda request: ("continuations that break a stopping rule: tokens after a stop token or a "
                                 "completed stop string, a stop token before min_tokens, more than max_tokens, a "
                                 "finish reason or usage count that disagrees with the tokens (any one is a "
                                 "finding)"),
    "constraint": lambda request: "continuations with a token the request's constraint does not allow (any one "
                                  "is a finding)",
}


def _request_findings(stored: list, request: GenerationRequest) -> tuple:
    """The whole-request checks' findings (dicts: job, row, check, position, what) and the determinism line."""
    findings, checked, differing, rows = [], 0, 0, []
    for index, _, rec in stored:
        checks = rec.engine.checks
        if checks is None:
            continue
        for r in range(checks.stop_code.size):
            error = float(checks.logprob_error[r])
            if not math.isnan(error) and error > request.logprob_tolerance:
                findings.append({"job": index, "row": r, "check": "logprobs",
                                 "position": int(checks.logprob_position[r]),
                                 "what": f"a returned log-probability departs from the scorer's by {error:.4g}"})
            if int(checks.stop_code[r]):
                findings.append({"job": index, "row": r, "check": "stopping", "position": int(checks.stop_position[r]),
                                 "what": STOP_CODES[int(checks.stop_code[r])]})
            if int(checks.constraint_position[r]) >= 0:
                findings.append({"job": index, "row": r, "check": "constraint",
                                 "position": int(checks.constraint_position[r]),
                                 "what": "a token the constraint does not allow"})
            if int(checks.determinism[r]) >= 0:
                checked += 1
                if int(checks.determinism[r]):
                    differing += 1
                    rows.append({"job": index, "row": r})
    determinism = None
    if request.requests and request.generator.seeded and any(r.seed is not None for r in request.requests):
        determinism = {"checked": checked, "differing": differing, "rows": rows[:50],
                       "passed": differing == 0 and checked > 0}
    return findings, determinism


def _decisive(pvalue: float, test: str, violations: list, after_eos: list, divergences: list) -> tuple:
    """``(pvalue, test)``: the family's decision, unless a decisive violation overrules it."""
    if violations:
        return 0.0, "support"
    if after_eos:
        return 0.0, "end-of-sequence"
    if any(not d.numerics for d in divergences):
        return 0.0, "greedy"
    return pvalue, test


def _power(tokens: _Tokens, one: list, options: _Options, confidence: float) -> tuple:
    """``(held_out_tv, min_detectable_tv, surprisal_z)`` over all of the engine's tokens.

    The minimum detectable TV is that of the family's all-tokens PIT test of ``options.power_ordering``
    (one of the orders run; inf when no token was scored).
    """
    held = tuple(held_out_tv(torch.from_numpy(tokens.pit[o]), torch.from_numpy(tokens.job % 2), o, confidence)
                 for o in options.orderings)
    name = f"pit {options.power_ordering} / all"
    test = next((t for t in one if t.name == name), None)
    mdtv = (test.min_detectable_tv if tokens.size and test is not None and test.min_detectable_tv is not None
            else math.inf)
    z = surprisal_test(torch.from_numpy(tokens.surprisal), torch.from_numpy(tokens.entropy),
                       torch.from_numpy(tokens.var), "surprisal").statistic if tokens.size else 0.0
    return held, mdtv, z


def _verdict(stored: list, pvalue: float, options: _Options, greedy: bool, has_reference: bool, violations: list,
             mdtv: float, unreached: bool = False) -> str:
    """ERROR (no job finished), FINDING, PASS, or INCONCLUSIVE (the power falls short of the request, or a serving
    condition was not shown reached: ``unreached``)."""
    if not stored:
        return "ERROR"
    if pvalue <= options.alpha:
        return "FINDING"
    if unreached:
        return "INCONCLUSIVE"
    if greedy and not has_reference and not violations:
        return "PASS"  # greedy against the scorer: every token was the scorer's argmax (or a near-tie)
    if greedy and has_reference:
        return "PASS"
    return "INCONCLUSIVE" if not mdtv <= options.min_detectable_tv * (1 + 1e-9) else "PASS"


def _analyse(request: GenerationRequest, outcome: RunOutcome) -> GenerationAuditResult:
    """The result of a run: the Holm family planned and built from the consumed jobs' records, and decided."""
    jobs, stored, failures = request.jobs_by_index(), outcome.consumed, outcome.failed
    options, prompts, names, has_reference = request.options, request.prompts, request.names, request.has_reference
    greedy, eprocess_p = request.greedy, outcome.eprocess_p
    kinds = request.request_kinds()
    row_kinds = (kinds, {j.index: [kinds.index(r.kind) for r in request.row_requests(j)] for j in request.jobs}) \
        if kinds else None
    arm_names = ARMS + tuple(c.name for c in request.conditions)
    tokens = _collect(jobs, stored, options, reference=False, row_kinds=row_kinds, arm_names=arm_names)
    if greedy is None:  # detected: every scored law one-hot (on every job, whichever ran first)
        greedy = bool(tokens.size) and bool(np.all((tokens.var <= 1e-12) & (tokens.entropy <= 1e-12)))
    reference = (_collect(jobs, stored, options, reference=True, row_kinds=row_kinds, arm_names=arm_names)
                 if has_reference else None)
    confidence = 1.0 - options.alpha
    agreement_tests, agreement = _agreement(jobs, stored)
    eprocess = _eprocess_tests(eprocess_p, tokens)
    with_reference = has_reference and reference is not None and reference.size
    plan = family_plan(tokens, reference if with_reference else None, agreement_tests, eprocess, options, prompts,
                       greedy, has_reference, request.request_checks())
    # the family's size fixes the level each test's minimum detectable TV is quoted at (its Bonferroni share)
    level = options.alpha / plan.size
    one = _one_sample(tokens, options, prompts, level)
    family = one + agreement_tests + eprocess
    deciding = {t.name for t in family}
    decided_by, reference_rejected, floor, reference_sample = "one-sample", None, (), None
    if with_reference:
        reference_rejected, floor, two, own = _against_reference(tokens, reference, options, prompts, level,
                                                                 confidence, plan)
        # with rounds="auto" the reference may skip the further rounds: say what its sample is
        reference_sample = _reference_sample(reference, tokens, stored, own) if options.until_power else None
        family += two
        deciding |= {t.name for t in two}
        if not greedy and reference_rejected:
            # the scorer's numerics differ from the engine's beyond their noise: judge against the reference
            decided_by = "two-sample"
            deciding -= {t.name for t in one} | {"e-process"}
    # decisive violations: tokens of zero target mass; greedy divergences at a margin
    tolerance = _numerics_tolerance(reference, options)
    zero = _zero_mass_tokens(tokens, options, tolerance)
    violations = [z for z in zero if not z.numerics]
    after_eos = _after_eos(stored)
    divergences = _divergence_rows(jobs, stored, options) if greedy and has_reference else []
    if greedy:
        # every law one-hot: an emitted argmax has PIT = U (noise) and surprisal 0, so the one-sample
        # tests carry nothing the support check does not; and a token within the numerics tolerance
        # (PIT 1: past the whole mass) must not become a finding through them
        decided_by = "greedy"
        deciding -= {t.name for t in one} | {"e-process"}
    family, pvalue, test = _decide(family, deciding, options.alpha)
    family += _decisive_checks(tokens, stored, options, violations, after_eos, divergences, greedy and has_reference)
    pvalue, test = _decisive(pvalue, test, violations, after_eos, divergences)
    findings, determinism = _request_findings(stored, request)
    for name in request.request_checks():
        found = [f for f in findings if f["check"] == name]
        family.append(TestResult(name, float(len(found)), 0.0 if found else 1.0, None,
                                 int(sum(rec.engine.lengths.size for _, _, rec in stored)),
                                 pvalue_adjusted=0.0 if found else 1.0, detail=_REQUEST_CHECK_DETAIL[name](request)))
        if found and pvalue > 0.0:
            pvalue, test = 0.0, name
    held, mdtv, z = _power(tokens, one, options, confidence)
    conditions = _conditions(request, jobs, stored, tokens, family, failures)
    verdict = _verdict(stored, pvalue, options, greedy, has_reference, violations, mdtv,
                       any(c["reached"] is not True for c in conditions))
    if len(failures) > options.allow_failed_calls and verdict != "FINDING":
        verdict = "ERROR"  # more engine calls failed than allowed: the gate fails whatever the tests say
    strata_rows = tuple(_stratum_row(t, tokens, options, prompts) for t in family if t.name.startswith("pit "))
    arm_tokens = {arm: int((tokens.arm == a).sum()) for a, arm in enumerate(ARMS) if arm in options.arms}
    return GenerationAuditResult(
        generator=names[0], scorer=names[1], verdict=verdict, pvalue=pvalue, test=test, alpha=options.alpha,
        power=options.power, min_detectable_tv=mdtv, requested_tv=options.min_detectable_tv, num_tokens=tokens.size,
        num_continuations=int(sum(rec.engine.lengths.size for _, _, rec in stored)), num_jobs=len(stored),
        tokens_by_arm=arm_tokens, subtests=tuple(family), deciding=tuple(sorted(deciding)), decided_by=decided_by,
        held_out_tv=held, numerics_floor=floor, reference_rejected=reference_rejected, zero_mass=tuple(zero[:50]),
        divergences=tuple(divergences[:50]), strata=strata_rows, surprisal_z=float(z), agreement=agreement,
        acceptance=_acceptance(tokens, stored), greedy=greedy, stop_reason=outcome.stop_reason,
        after_eos=tuple({"job": j, "row": r, "position": p} for j, r, p in after_eos[:50]),
        failures=tuple(f"job {j} ({arm}): {m}" for j, arm, m in failures), seconds=outcome.seconds,
        num_bins=NUM_BINS, incomplete=outcome.interrupted, num_processes=outcome.num_processes, logit_tolerance=tolerance,
        power_ordering=options.power_ordering, failed_calls=tuple(outcome.failed_calls),
        allowed_failed_calls=options.allow_failed_calls,
        requests=tuple(dict(r.describe(), kind=r.kind) for r in request.requests),
        request_findings=tuple(findings[:50]), determinism=determinism, power_plan=outcome.power_plan,
        conditions=tuple(conditions), reference_sample=reference_sample)


def _reference_sample(reference: _Tokens, tokens: _Tokens, stored: list, own) -> dict:
    """What the reference's sample is: the calls it ran on, its tokens and the engine's on those calls, and the
    smallest TV between the scorer's law and the reference's that its own all-tokens test detects (``own``, at the
    family's share of alpha): below it a scorer that departs from the engine's true law goes unseen by the
    reference's tests, and the one-sample verdict assumes the scorer."""
    mdtv = own.min_detectable_tv if own is not None and own.min_detectable_tv is not None else math.inf
    return {"jobs": int(sum(rec.reference is not None for _, _, rec in stored)), "of_jobs": len(stored),
            "tokens": reference.size, "engine_tokens_paired": int(tokens.paired.sum()),
            "min_detectable_tv": float(mdtv)}


def _conditions(request: GenerationRequest, jobs: dict, stored: list, tokens: _Tokens, family: list,
                failures: list = ()) -> list:
    """One row per serving condition: its jobs and counted tokens, the engine's counters over its counted calls
    (summed; ``draft_depth``: the largest), whether it was reached and how, its stratum's tests (the smallest
    Holm-adjusted p-value) and its status: FINDING (its stratum rejected), ERROR (every call failed), NOT REACHED,
    NOT SHOWN (no counter reported), TOO FEW TOKENS (its stratum untested) or PASS (tested, reached, nothing
    rejected)."""
    rows = []
    alpha = request.options.alpha
    for c, condition in enumerate(request.conditions, start=len(ARMS)):
        mine = [(index, rec) for index, _, rec in stored if jobs[index].arm == condition.name]
        stats: Optional[dict] = None
        for _, rec in mine:
            if rec.stats is None:
                continue
            stats = stats or {}
            for key, value in rec.stats.items():
                stats[key] = max(stats.get(key, 0), value) if key == "draft_depth" else stats.get(key, 0) + value
        long_tokens = 0
        if condition.kind == "long-context":
            for index, rec in mine:
                starts = np.asarray([len(p) for p in jobs[index].prompts])[rec.engine.tokens.row.astype(np.int64)]
                long_tokens += int(((starts + rec.engine.tokens.position) >= condition.value).sum())
        reached, how = condition_reached(condition, stats, long_tokens)
        failed = [message for _, arm, message in failures if arm == condition.name]
        if failed and not mine:
            how = f"every call failed ({len(failed)}); the first: {failed[0].strip().splitlines()[-1]}"
        stratum = f"condition {condition.name}"
        tests = [t for t in family if t.name.endswith(" / " + stratum)]
        p = min((t.pvalue_adjusted for t in tests if t.pvalue_adjusted is not None), default=None)
        counted = int(((tokens.arm == c) & tokens.counted).sum())
        if p is not None and p <= alpha:
            status = "FINDING"
        elif failed and not mine:
            status = "ERROR"
        elif reached is False:
            status = "NOT REACHED"
        elif reached is None:
            status = "NOT SHOWN"
        elif not tests:
            status = "TOO FEW TOKENS"
        else:
            status = "PASS"
        rows.append({"name": condition.name, "kind": condition.kind, "value": condition.value, "jobs": len(mine),
                     "tokens": counted, "stats": stats, "reached": reached, "how": how, "pvalue_adjusted": p,
                     "tests": [t.name for t in tests], "status": status, "failed_calls": len(failed)})
    return rows

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
        found = rec.divergences
        if found is None:
            continue
        job = jobs[index]
        offsets = np.concatenate([[0], np.cumsum(rec.engine.lengths)])
        ref_offsets = np.concatenate([[0], np.cumsum(rec.reference.lengths)])
        for r, pos, margin, a, b in zip(found.row, found.position, found.margin, found.engine_token,
                                        found.reference_token):
            engine_tail = rec.engine.emitted[offsets[r] + pos: min(offsets[r + 1], offsets[r] + pos + 16)]
            ref_tail = rec.reference.emitted[ref_offsets[r] + pos: min(ref_offsets[r + 1], ref_offsets[r] + pos + 16)]
            finite = bool(np.isfinite(margin))
            out.append(Divergence(job.arm, index, int(r), int(job.prompt_ids[r]), int(pos), int(a), int(b),
                                  float(margin) if finite else None, finite and float(margin) <= options.logit_tol,
                                  tuple(int(t) for t in engine_tail), tuple(int(t) for t in ref_tail)))
    return out
