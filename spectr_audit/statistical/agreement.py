"""A verifier's sampler against its own exact law.

A verifier with ``output_probs`` states the exact law of its verdicts given the drafts; its
``verify`` is usually a separate, faster code path.  :func:`sampler_law_agreement` samples
drafts, runs ``verify`` and compares what it emitted with what ``output_probs`` says it
should emit *for those very drafts*, so the draft-sampling noise drops out and a sampler that
drifted from its formula is caught even when both are exact (docs/audit/statistical.md).
"""

from __future__ import annotations

import dataclasses
import time
from typing import Optional, Sequence, Union

import torch

from spectr_audit import defaults
from spectr_audit.statistical import power as sizing
from spectr_audit.statistical._stages import (
    CommonArgs,
    budgeted,
    family_result,
    holm_family,
    stream_chunks,
    support_test,
    validate_common,
    with_min_detectable_tv,
)
from spectr_audit.contract.verifier import check_output_probs
from spectr_audit.statistical.gof import MIN_EXPECTED, conditional_pearson_test, independent_sum_test
from spectr_audit.drafting.models import Model
from spectr_audit.statistical.sampling import draw_drafts, verify_batch
from spectr_audit.statistical.power import DEFAULT_ALPHA, DEFAULT_MIN_DETECTABLE_TV, DEFAULT_POWER
from spectr_audit.statistical.results import LawAgreementResult, worst_cells

__all__ = ["sampler_law_agreement"]

#: Up to this many cells (K (L + 1) V), the aggregated test uses the counts' exact covariance.
MAX_COVARIANCE_CELLS = defaults.MAX_COVARIANCE_CELLS


def _canonical_index(
    draft_tokens: torch.Tensor,  # [batch_size, num_drafts, draft_len]
) -> torch.Tensor:  # [batch_size, num_drafts, draft_len + 1]
    """``canon[b, k, n]``: the smallest draft index whose first n tokens equal draft k's."""
    # same[b, k, j, l]: drafts k and j agree at position l
    same = draft_tokens.unsqueeze(2) == draft_tokens.unsqueeze(1)
    # [batch_size, num_drafts, num_drafts, draft_len + 1]: they agree on the first n positions
    prefix_same = torch.cat([torch.ones_like(same[..., :1]), same.to(torch.int8).cumprod(-1).bool()], -1)
    return prefix_same.to(torch.int8).argmax(2)


@dataclasses.dataclass(frozen=True)
class _Plan:
    """The cells, the strata and the sample size of the check."""

    #: cells ``(canonical draft index, num_accepted, next_token)``: K (L + 1) V
    num_cells: int
    #: whether the per-draft-tuple test runs (V^(K L) at most max_strata)
    per_tuple: bool
    #: draft tuples counted apart (1 when the per-tuple test does not run)
    num_strata: int
    #: each test's Bonferroni share of alpha
    test_alpha: float
    total: int


@dataclasses.dataclass(frozen=True)
class _Tally:
    """What the sampling stage counted, per stratum and cell, with the summed per-sample laws."""

    # [num_strata, num_cells]
    observed: torch.Tensor
    # [num_strata, num_cells]
    expected: torch.Tensor
    #: ``[num_cells, num_cells]`` sum of each sample's outer product of its law (None above MAX_COVARIANCE_CELLS)
    second_moment: Optional[torch.Tensor]
    violations: int
    num_samples: int
    seconds: float


def _plan(args: CommonArgs, max_strata: int) -> _Plan:
    """Plan stage: cells, strata, tests, and the sample size of the aggregated test."""
    num_cells = args.num_drafts * (args.draft_len + 1) * args.vocab_size
    num_tuples = args.vocab_size ** (args.num_drafts * args.draft_len)
    per_tuple = num_tuples <= max_strata
    test_alpha = args.alpha / (2 if per_tuple else 1)
    planned = (args.num_samples if args.num_samples is not None
               else sizing.required_samples(args.min_detectable_tv, num_cells, test_alpha, args.power))
    total, _ = budgeted(planned, args.num_samples, args.max_samples)
    return _Plan(num_cells, per_tuple, num_tuples if per_tuple else 1, test_alpha, total)


def _sample(args: CommonArgs, plan: _Plan) -> _Tally:
    """Sample stage: drafts, the verifier's law for them and its verdicts, counted per stratum and cell."""
    verifier, device, num_drafts, draft_len, vocab_size = (args.verifier, args.device, args.num_drafts,
                                                           args.draft_len, args.vocab_size)
    num_cells, num_strata = plan.num_cells, plan.num_strata
    tuple_powers = vocab_size ** torch.arange(num_drafts * draft_len - 1, -1, -1, device=device)
    generator = torch.Generator(device=device).manual_seed(args.seed)
    observed = torch.zeros(num_strata, num_cells, dtype=torch.float64)
    expected = torch.zeros(num_strata, num_cells, dtype=torch.float64)
    second_moment = (torch.zeros(num_cells, num_cells, dtype=torch.float64)
                     if num_cells <= MAX_COVARIANCE_CELLS else None)
    violations = 0

    def step(size: int, done: int) -> Optional[str]:
        nonlocal violations
        batch = draw_drafts(args.draft_model, args.target_model, num_drafts, draft_len, size, generator,
                            prefix=args.prefix, draft_scheme=verifier.draft_scheme, device=device)
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
        strata = ((batch.draft_tokens.reshape(size, -1) * tuple_powers).sum(-1) if plan.per_tuple
                  else torch.zeros(size, dtype=torch.int64, device=device))
        observed.add_(torch.bincount(strata * num_cells + sample_cells, minlength=num_strata * num_cells).double(
        ).cpu().reshape(num_strata, num_cells))
        expected.index_add_(0, strata.cpu(), folded.cpu())
        if second_moment is not None:
            second_moment.add_((folded.T @ folded).cpu())
        return "support" if violations else None

    start = time.perf_counter()
    deadline = None if args.max_seconds is None else start + args.max_seconds
    done, _ = stream_chunks(plan.total, args.chunk_size, deadline, step)
    return _Tally(observed, expected, second_moment, violations, done, time.perf_counter() - start)


def _test(args: CommonArgs, plan: _Plan, tally: _Tally) -> LawAgreementResult:
    """Test stage: the aggregated and per-tuple tests (Holm), then the support check; the result."""
    observed, expected, min_expected = tally.observed, tally.expected, args.min_expected
    if tally.second_moment is not None:
        aggregated = independent_sum_test(observed.sum(0), expected.sum(0), tally.second_moment, min_expected)
    else:  # the multinomial null bounds the true covariance: valid, conservative
        aggregated = conditional_pearson_test(observed.sum(0, keepdim=True), expected.sum(0, keepdim=True),
                                              min_expected, name="aggregated-pearson")
    aggregated = with_min_detectable_tv(aggregated, tally.num_samples, plan.test_alpha, args.power)
    tests = [aggregated]
    if plan.per_tuple:
        tests.append(conditional_pearson_test(observed, expected, min_expected, name="per-tuple-pearson"))
    family = holm_family(tests)
    support = support_test(float(tally.violations), tally.num_samples,
                           "samples in cells of probability 0 under the verifier's own law")
    vocab_size, draft_len = args.vocab_size, args.draft_len

    def describe(cell: int) -> str:
        token = cell % vocab_size
        accepted_count = (cell // vocab_size) % (draft_len + 1)
        index = cell // (vocab_size * (draft_len + 1))
        return f"draft {index}, {accepted_count} accepted, next token {token}"

    return family_result(
        LawAgreementResult, args, family, support,
        num_samples=tally.num_samples,
        min_detectable_tv=aggregated.min_detectable_tv,
        worst_cells=worst_cells(observed.sum(0), expected.sum(0), describe),
        seconds=tally.seconds,
        num_strata=int((observed.sum(1) > 0).sum()) if plan.per_tuple else 0,
    )


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
    max_strata: int = defaults.MAX_STRATA,
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
    # validate -> plan -> sample -> test; validation and the stages' plumbing are shared (_stages)
    args = validate_common(verifier, draft_model, target_model, num_drafts, draft_len, prefix=prefix, alpha=alpha,
                           min_detectable_tv=min_detectable_tv, power=power, num_samples=num_samples,
                           max_samples=max_samples, max_seconds=max_seconds, seed=seed, device=device,
                           chunk_size=chunk_size, min_expected=min_expected, needs_exact_law=True)
    plan = _plan(args, max_strata)
    return _test(args, plan, _sample(args, plan))
