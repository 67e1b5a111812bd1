"""A verifier's sampler against its own exact law.

A verifier with ``output_probs`` states the exact law of its verdicts given the drafts; its
``verify`` is usually a separate, faster code path.  :func:`sampler_law_agreement` samples
drafts, runs ``verify`` and compares what it emitted with what ``output_probs`` says it
should emit *for those very drafts*, so the draft-sampling noise drops out and a sampler that
drifted from its formula is caught even when both are exact (DESIGN.md, "What the audit
measures", item 4; issue 4 item 5).
"""

from __future__ import annotations

import dataclasses
import math
import time
from typing import Optional, Sequence, Union

import torch

from spectr_audit.statistical import power as sizing
from spectr_audit.statistical._checks import (
    check_models,
    check_positive_int,
    check_prefix,
    check_prob,
    check_seconds,
    chunk_schedule,
)
from spectr_audit.contract.verifier import as_verifier, check_output_probs
from spectr_audit.errors import InvalidArgument
from spectr_audit.statistical.gof import MIN_EXPECTED, TestResult, conditional_pearson_test, holm, independent_sum_test
from spectr_audit.drafting.models import Model
from spectr_audit.statistical.sampling import default_chunk_size, draw_drafts, verify_batch
from spectr_audit.statistical.power import DEFAULT_ALPHA, DEFAULT_MIN_DETECTABLE_TV, DEFAULT_POWER
from spectr_audit.statistical.results import LawAgreementResult, worst_cells

__all__ = ["sampler_law_agreement"]

#: Up to this many cells (K (L + 1) V), the aggregated test uses the counts' exact covariance.
MAX_COVARIANCE_CELLS = 2048


def _canonical_index(
    draft_tokens: torch.Tensor,  # [batch_size, num_drafts, draft_len]
) -> torch.Tensor:  # [batch_size, num_drafts, draft_len + 1]
    """``canon[b, k, n]``: the smallest draft index whose first n tokens equal draft k's."""
    # same[b, k, j, l]: drafts k and j agree at position l
    same = draft_tokens.unsqueeze(2) == draft_tokens.unsqueeze(1)
    # [batch_size, num_drafts, num_drafts, draft_len + 1]: they agree on the first n positions
    prefix_same = torch.cat([torch.ones_like(same[..., :1]), same.to(torch.int8).cumprod(-1).bool()], -1)
    return prefix_same.to(torch.int8).argmax(2)


def sampler_law_agreement(
    verifier,
    draft_model: Model,
    target_model: Model,
    num_drafts: int,
    draft_len: int = 1,
    *,
    prefix: Sequence[int] = (),
    alpha: float = DEFAULT_ALPHA,
    min_detectable_tv: float = DEFAULT_MIN_DETECTABLE_TV,
    power: float = DEFAULT_POWER,
    num_samples: Optional[int] = None,
    max_samples: Optional[int] = None,
    max_seconds: Optional[float] = None,
    seed: int = 0,
    device: Union[str, torch.device] = "cpu",
    chunk_size: Optional[int] = None,
    min_expected: float = MIN_EXPECTED,
    max_strata: int = 4096,
) -> LawAgreementResult:
    """Check that a verifier's sampler follows its own ``output_probs``, conditionally on the drafts.

    Parameters
    ----------
    verifier : Verifier or object with ``verify`` and ``output_probs``
    draft_model, target_model : Model
    num_drafts, draft_len : int
    prefix : sequence of int
    alpha, min_detectable_tv, power : float
        As in :func:`statistical_audit`; the sample is planned for the aggregated test.
    num_samples, max_samples, max_seconds : optional
        Exact sample size, or budgets.
    seed : int
    device : str or torch.device
    chunk_size : int, optional
    min_expected : float
    max_strata : int
        The per-draft-tuple test runs when ``V^(K L)`` is at most this.

    Returns
    -------
    LawAgreementResult

    Notes
    -----
    Each sample's drafts are drawn as usual; the emitted string is mapped to its cell
    ``(canonical draft index, num_accepted, next_token)`` (the canonical index is the smallest
    draft carrying the emitted prefix, so cells are functions of the emitted string), and the
    verifier's exact law for those drafts, folded onto canonical indices, gives that sample's
    cell probabilities.  Two tests (Holm):

    * ``aggregated-pearson``: total counts against the summed per-sample laws.  Given the drafts
      the counts are sums of independent categoricals with a known covariance, and the null is
      the weighted chi-square it implies (:func:`spectr_audit.statistical.gof.independent_sum_test`); above
      ``MAX_COVARIANCE_CELLS`` cells, the multinomial chi-square, which bounds it (conservative);
    * ``per-tuple-pearson`` (small draft spaces): counts per draft tuple against that tuple's
      law, one multinomial test per tuple, summed (:func:`spectr_audit.statistical.gof.conditional_pearson_test`);
      it sees a drift confined to a few tuples.

    A sample in a cell its own law gives probability 0 is a certain disagreement (``support``).

    Examples
    --------
    >>> from spectr_audit.drafting.models import ContextFreeModel
    >>> from spectr_audit.registry import load_verifier
    >>> result = sampler_law_agreement(load_verifier("kseq"), ContextFreeModel([0.6, 0.4]),
    ...                                ContextFreeModel([0.3, 0.7]), num_drafts=2, num_samples=20_000)
    >>> result.rejects(), [t.name for t in result.subtests]
    (False, ['aggregated-pearson', 'per-tuple-pearson', 'support'])
    """
    verifier = as_verifier(verifier)
    if not verifier.has_exact_law:
        raise InvalidArgument(f"verifier: {verifier.name!r} has no output_probs; use statistical_audit")
    vocab_size = check_models(draft_model, target_model)
    num_drafts = check_positive_int("num_drafts", num_drafts, allow_none=False)
    draft_len = check_positive_int("draft_len", draft_len, allow_none=False)
    verifier.check_supports(num_drafts, draft_len)
    prefix = check_prefix(prefix, vocab_size)
    alpha = check_prob("alpha", alpha)
    power = check_prob("power", power)
    sizing.effect_size_for_tv(min_detectable_tv)
    num_samples = check_positive_int("num_samples", num_samples)
    max_samples = check_positive_int("max_samples", max_samples)
    check_seconds(max_seconds)
    device = torch.device(device)
    chunk_size = (check_positive_int("chunk_size", chunk_size)
                  or default_chunk_size(num_drafts, draft_len, vocab_size, device))
    num_cells = num_drafts * (draft_len + 1) * vocab_size
    per_tuple = vocab_size ** (num_drafts * draft_len) <= max_strata
    num_tests = 2 if per_tuple else 1
    test_alpha = alpha / num_tests
    total = num_samples or sizing.required_samples(min_detectable_tv, num_cells, test_alpha, power)
    if max_samples is not None:
        total = min(total, max_samples)
    num_strata = vocab_size ** (num_drafts * draft_len) if per_tuple else 1
    tuple_powers = vocab_size ** torch.arange(num_drafts * draft_len - 1, -1, -1, device=device)

    generator = torch.Generator(device=device).manual_seed(seed)
    observed = torch.zeros(num_strata, num_cells, dtype=torch.float64)
    expected = torch.zeros(num_strata, num_cells, dtype=torch.float64)
    exact_covariance = num_cells <= MAX_COVARIANCE_CELLS
    second_moment = torch.zeros(num_cells, num_cells, dtype=torch.float64) if exact_covariance else None
    violations, done = 0, 0
    start = time.perf_counter()
    for size in chunk_schedule(total, chunk_size):
        batch = draw_drafts(draft_model, target_model, num_drafts, draft_len, size, generator, prefix=prefix,
                            draft_scheme=verifier.draft_scheme, device=device)
        law = check_output_probs(verifier.output_probs(batch.draft_tokens, batch.draft_probs, batch.target_probs),
                                 size, num_drafts, draft_len, vocab_size, who=verifier.name).double()
        output = verify_batch(verifier, batch, generator, validate_inputs=done == 0)
        canon = _canonical_index(batch.draft_tokens)  # [B, K, L + 1]
        accepted = torch.arange(draft_len + 1, device=device).view(1, 1, -1, 1)
        tokens = torch.arange(vocab_size, device=device).view(1, 1, 1, -1)
        law_cells = (canon.unsqueeze(-1) * (draft_len + 1) + accepted) * vocab_size + tokens  # [B, K, L + 1, V]
        folded = torch.zeros(size, num_cells, dtype=torch.float64, device=device).scatter_add_(
            1, law_cells.reshape(size, -1), law.reshape(size, -1))
        rows = torch.arange(size, device=device)
        sample_canon = canon[rows, output.draft_index, output.num_accepted]
        sample_cells = (sample_canon * (draft_len + 1) + output.num_accepted) * vocab_size + output.next_token
        violations += int((folded[rows, sample_cells] <= 0).sum())
        strata = ((batch.draft_tokens.reshape(size, -1) * tuple_powers).sum(-1) if per_tuple
                  else torch.zeros(size, dtype=torch.int64, device=device))
        observed += torch.bincount(strata * num_cells + sample_cells, minlength=num_strata * num_cells).double().cpu(
        ).reshape(num_strata, num_cells)
        expected.index_add_(0, strata.cpu(), folded.cpu())
        if exact_covariance:
            second_moment += (folded.T @ folded).cpu()
        done += size
        if violations:
            break
        if max_seconds is not None and time.perf_counter() - start >= max_seconds:
            break
    seconds = time.perf_counter() - start

    if exact_covariance:
        aggregated = independent_sum_test(observed.sum(0), expected.sum(0), second_moment, min_expected)
    else:  # the multinomial null bounds the true covariance: valid, conservative
        aggregated = conditional_pearson_test(observed.sum(0, keepdim=True), expected.sum(0, keepdim=True),
                                              min_expected, name="aggregated-pearson")
    mde = (sizing.min_detectable_tv(done, aggregated.num_cells, test_alpha, power)
           if (aggregated.num_cells or 0) >= 2 else math.inf)
    tests = [dataclasses.replace(aggregated, min_detectable_tv=mde)]
    if per_tuple:
        tests.append(conditional_pearson_test(observed, expected, min_expected, name="per-tuple-pearson"))
    adjusted = holm([t.pvalue for t in tests])
    family = tuple(dataclasses.replace(t, pvalue_adjusted=a) for t, a in zip(tests, adjusted))
    support = TestResult("support", float(violations), 0.0 if violations else 1.0, None, done,
                         pvalue_adjusted=0.0 if violations else 1.0,
                         detail="samples in cells of probability 0 under the verifier's own law")
    family = family + (support,)
    deciding = family[-1] if violations else min(family[:-1], key=lambda t: t.pvalue_adjusted)  # first on ties

    def describe(cell: int) -> str:
        token = cell % vocab_size
        accepted_count = (cell // vocab_size) % (draft_len + 1)
        index = cell // (vocab_size * (draft_len + 1))
        return f"draft {index}, {accepted_count} accepted, next token {token}"

    return LawAgreementResult(
        verifier=verifier.name,
        test=deciding.name,
        statistic=deciding.statistic,
        pvalue=float(deciding.pvalue_adjusted),
        alpha=alpha,
        num_samples=done,
        seed=seed,
        min_detectable_tv=mde,
        power=power,
        num_strata=int((observed.sum(1) > 0).sum()) if per_tuple else 0,
        subtests=family,
        worst_cells=worst_cells(observed.sum(0), expected.sum(0), describe),
        seconds=seconds,
    )
