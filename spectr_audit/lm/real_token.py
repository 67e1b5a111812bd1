"""The ``real-lm`` suite's token level (L = 1): (draft, target) rows at contexts drawn from the
target, and one verifier's acceptance and first-token fidelity at one K on them (Rao-Blackwellised
where the verifier has an exact law, sampled always)."""

from __future__ import annotations

import dataclasses
import math
import time
from typing import Callable, Optional, Sequence

import torch

from spectr_audit.bounds.acceptance import spectr_guarantee
from spectr_audit.contract.randomness import sample_categorical, uniform
from spectr_audit.contract.verifier import Verifier
from spectr_audit.drafting.decoding import emitted_tokens
from spectr_audit.drafting.harness import DraftBatch
from spectr_audit.lm.fidelity import FirstTokenTally, RatioPartition, first_token_law, mean_zero_test, planned_num_cells
from spectr_audit.lm.real_options import RealLMOptions
from spectr_audit.lm.real_verdicts import _Audit, _holm_checks, _mark_underpowered, _mean_ci, _verdict_metrics
from spectr_audit.lm.smollm import DEFAULT_SKIP_LAYERS, SmolLM, TreeSession
from spectr_audit.lm.tables import FidelityRow
from spectr_audit.results import AuditResult
from spectr_audit.run.runner import declared_verdict
from spectr_audit.statistical.gof import TestResult, mean_above, mean_below
from spectr_audit.statistical.sampling import verify_batch

__all__ = ["TokenRows", "sample_token_rows"]


# ---------------------------------------------------------------------------------------------
# Real (draft, target) rows at target-sampled contexts
# ---------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class TokenRows:
    """Draft and target laws at contexts drawn from the target (one row per context)."""

    # [num_contexts, vocab_size] float64
    draft_probs: torch.Tensor
    # [num_contexts, vocab_size] float64
    target_probs: torch.Tensor
    # [num_contexts] index of the prompt each context continues
    prompt_index: torch.Tensor
    # [num_contexts] tokens of the answer before the context's end
    position: torch.Tensor
    #: the token ids of each context (prompt + answer so far)
    contexts: tuple = ()


def sample_token_rows(
    lm: SmolLM,
    prompt_ids: Sequence[Sequence[int]],
    positions_per_prompt: int,
    *,
    temperature: float = 1.0,
    skip_layers: Sequence[int] = DEFAULT_SKIP_LAYERS,
    generator: Optional[torch.Generator] = None,
) -> TokenRows:
    """Sample an answer from the target for each prompt; keep (draft, target) laws at its positions."""
    session = TreeSession(lm, prompt_ids, skip_layers=skip_layers, temperature=temperature)
    draft, target = session.sample_target(positions_per_prompt, generator)  # [B, P, V] each
    num_prompts = len(prompt_ids)
    contexts = tuple(tuple(tokens[:len(prompt) + j]) for prompt, tokens in zip(prompt_ids, session.tokens)
                     for j in range(positions_per_prompt))
    return TokenRows(
        draft_probs=draft.reshape(-1, draft.shape[-1]),
        target_probs=target.reshape(-1, target.shape[-1]),
        prompt_index=torch.arange(num_prompts).repeat_interleave(positions_per_prompt),
        position=torch.arange(positions_per_prompt).repeat(num_prompts),
        contexts=contexts,
    )


# ---------------------------------------------------------------------------------------------
# Token level
# ---------------------------------------------------------------------------------------------


def _draw_first_level(draft_probs, rows, num_drafts, generator):  # -> [n, K, 1]
    probs = draft_probs[rows].unsqueeze(1).expand(-1, num_drafts, -1)
    u = uniform(generator, (rows.shape[0], num_drafts), draft_probs.device)
    return sample_categorical(probs, u).unsqueeze(-1)


@dataclasses.dataclass
class _TokenDraws:
    """What the token-level draws of one verifier at one K leave behind."""

    tally: FirstTokenTally
    sampled_accept: list = dataclasses.field(default_factory=list)
    rb_accept: list = dataclasses.field(default_factory=list)
    rb_cells: list = dataclasses.field(default_factory=list)  # [n, cells] deviations of the RB law on the cells
    rb_full: list = dataclasses.field(default_factory=list)  # [n, V] deviations of the RB law from q


def _token_draws(verifier, K, token_rows: TokenRows, sampled: RatioPartition, rb: RatioPartition, rows,
                 generator) -> _TokenDraws:
    """Verify K drafts at each of ``rows`` (context indices); tally first tokens (on the ``sampled`` cells)
    and the exact laws (on the ``rb`` cells: a mean test needs no five draws per cell)."""
    V = token_rows.draft_probs.shape[1]
    draws = _TokenDraws(FirstTokenTally(sampled.num_cells))
    chunk = max(1, int(64 // K))
    for lo in range(0, rows.shape[0], chunk):
        r = rows[lo:lo + chunk]
        target_rows = token_rows.target_probs[r]
        draft_tokens = _draw_first_level(token_rows.draft_probs, r, K, generator)
        # The bonus row (level 1) is a stand-in, q at the context: token-level metrics read the first token only.
        batch = DraftBatch(draft_tokens, token_rows.draft_probs[r].view(-1, 1, 1, V).expand(-1, K, 1, V),
                           target_rows.view(-1, 1, 1, V).expand(-1, K, 2, V))
        out = verify_batch(verifier, batch, generator, validate_inputs=lo == 0)
        first = emitted_tokens(draft_tokens, out)[0][:, 0]
        draws.tally.add(sampled.cell_of(first, r), sampled.cells(target_rows, r))
        draws.sampled_accept.append((draft_tokens[:, :, 0] == first.unsqueeze(1)).any(-1).double())
        if verifier.has_exact_law:
            law = verifier.output_probs(draft_tokens, batch.draft_probs, batch.target_probs)
            token_law, accept = first_token_law(draft_tokens, law)
            draws.rb_accept.append(accept)
            draws.rb_cells.append(rb.cells(token_law, r) - rb.cells(target_rows, r))
            draws.rb_full.append(token_law - target_rows)
    return draws


def _rb_tests(draws: _TokenDraws, verifier, K, a_star, num_draws, metrics) -> list[TestResult]:
    """Rao-Blackwellised acceptance and fidelity (verifiers with an exact law); fills ``metrics``."""
    accept = torch.cat(draws.rb_accept)
    n = accept.shape[0]
    mean, low, high = _mean_ci(accept.view(-1, num_draws).mean(1).numpy())
    metrics.update(acceptance=mean, acceptance_ci_low=low, acceptance_ci_high=high)
    metrics["acceptance_ratio"] = mean / metrics["optimal_acceptance"] if metrics["optimal_acceptance"] > 0 else None
    deviations = torch.cat(draws.rb_cells)
    metrics["rb_tv_partition"] = 0.5 * float(deviations.mean(0).abs().sum())
    if num_draws >= 2:
        dev = torch.cat(draws.rb_full).view(-1, num_draws, draws.rb_full[0].shape[-1])
        cross = (dev[:, 0] * dev[:, 1]).sum(-1).numpy()  # E[d_1 . d_2] = ||bias||^2 per context
        metrics["rb_l2sq"] = float(cross.mean())
        metrics["rb_l2sq_se"] = float(cross.std(ddof=1) / math.sqrt(cross.size)) if cross.size > 1 else math.nan
    over = accept - a_star
    tests = [mean_zero_test(deviations),
             mean_above(float(over.sum()), float((over**2).sum()), n, 0.0, "acceptance<=optimal",
                        "Rao-Blackwellised acceptance minus alpha* at each context, mean <= 0")]
    if "spectr" in verifier.guarantees:
        floor = accept - spectr_guarantee(K) * a_star
        tests.append(mean_below(float(floor.sum()), float((floor**2).sum()), n, 0.0, "spectr-guarantee",
                                "Rao-Blackwellised acceptance minus SpecTr's bound at each context, mean >= 0"))
    return tests


def _token_audit(
    verifier: Verifier,
    num_drafts: int,
    token_rows: TokenRows,
    partition_for: Callable[[int], RatioPartition],
    contexts: torch.Tensor,  # [num_used] indices of contexts used
    alpha_star: torch.Tensor,  # [num_contexts]
    options: RealLMOptions,
    generator: torch.Generator,
) -> _Audit:
    """Acceptance and first-token fidelity of one token-level verifier at one K."""
    start = time.perf_counter()
    K, draws = num_drafts, options.rb_draws
    rows = contexts.repeat_interleave(draws)  # [n]
    n = rows.shape[0]
    partition = partition_for(options.num_cells)
    tallied = _token_draws(verifier, K, token_rows, partition_for(planned_num_cells(n, options.num_cells)), partition,
                           rows, generator)
    optimal = float(alpha_star[contexts].mean())
    metrics: dict = {"num_drafts": K, "draft_len": 1, "num_contexts": int(contexts.numel()), "num_samples": n,
                     "optimal_acceptance": optimal, "spectr_bound": spectr_guarantee(K) * optimal,
                     "e_bound": (1 - math.exp(-1)) * optimal,
                     "acceptance_sampled": float(torch.cat(tallied.sampled_accept).mean())}
    details: dict = {"partition": partition.describe(), "vocab_size": token_rows.draft_probs.shape[1],
                     "note": "contexts: positions of target-sampled answers; bonus rows are q at the context "
                             "(token-level metrics use the first emitted token only)"}
    tests: list = []
    if verifier.has_exact_law:
        tests = _rb_tests(tallied, verifier, K, alpha_star[rows], draws, metrics)
    else:
        metrics["acceptance"] = metrics["acceptance_sampled"]
    # The sampled test counts at the Holm level alpha / m at worst: its power is stated there.
    sampled = tallied.tally.test(options.alpha / (len(tests) + 1), options.power)
    tests, checks = _holm_checks([sampled, *tests], options.alpha)
    checks = _mark_underpowered(checks, tests[0], options.min_detectable_tv)
    metrics.update(_verdict_metrics(tests, tests[0], options.alpha), requested_tv=options.min_detectable_tv)
    metrics.update(first_token_pvalue=sampled.pvalue, first_token_min_detectable_tv=sampled.min_detectable_tv)
    if len(tests) > 1:
        metrics["rb_pvalue"] = tests[1].pvalue
    details.update(sampled_test=tests[0].to_dict(), tests=[t.to_dict() for t in tests])
    metrics["seconds"] = time.perf_counter() - start
    judged = declared_verdict(verifier) is not False
    result = AuditResult(verifier=verifier.name, case=f"real-lm/token/K={K}", checks=checks, metrics=metrics,
                         expected=declared_verdict(verifier), details=details) if judged else None
    fidelity = FidelityRow(verifier.name, "token", K, 1, n, sampled.pvalue, sampled.min_detectable_tv,
                           metrics.get("rb_pvalue", math.nan), metrics.get("rb_tv_partition", math.nan),
                           metrics.get("rb_l2sq", math.nan), metrics.get("rb_l2sq_se", math.nan),
                           num_cells=int(sampled.num_cells or 0), test_alpha=metrics["test_alpha"], judged=judged)
    half = (metrics.get("acceptance_ci_high", math.nan) - metrics.get("acceptance_ci_low", math.nan)) / 2
    return _Audit(result, fidelity, (metrics["acceptance"], half, optimal))
