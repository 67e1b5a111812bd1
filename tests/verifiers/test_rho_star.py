"""Tests for spectr_audit.verifiers.rho_star: K-SEQ's rho* (exact solve, bisection oracle, sampler solve) and P_A.

rho* is the smallest rho in [1, K] with f(rho) = rho beta(rho) - (1 - (1 - beta(rho))^K) >= 0,
beta(rho) = sum_x min(p(x), q(x) / rho) (docs/rules/kseq.md).  The exact piecewise solve is checked
against plain bisection; the sampler's sort-free solve against the exact one on the very rows it saw:

* valid: f(rho) >= 0 in float64 on those rows renormalised (then K-SEQ's residual is non-negative
  and the sampler's law is exactly the target), whatever the number of passes;
* tight: its acceptance 1 - (1 - beta(rho))^K within 1e-5 of K-SEQ's optimum (the validity margin
  of 16 ulps of float32 costs about 2e-6 on float32 rows).

The hypothesis tests are deterministic in what they assert; a failure is a counterexample to add to
SAMPLER_CASES, which holds every one found so far.
"""

from __future__ import annotations

import dataclasses
import itertools

from unittest import mock

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from spectr_audit.bounds.acceptance import kseq_acceptance
from spectr_audit.errors import InvalidArgument
from spectr_audit.verifiers.rho_star import (
    _InsideTokens,
    _bracket_models,
    _kseq_gap,
    _model_beta,
    kseq_accept_prob,
    kseq_rho_star,
    kseq_rho_star_bisection,
    kseq_rho_star_sampler,
)
from spectr_audit.verifiers._walk import _sampler_dtype

MODES = ["random", "equal", "close", "zeros", "disjoint", "peaked"]


def _rows(vocab_size: int, concentration: float, mode: str, seed: int, rows: int = 3) -> tuple[np.ndarray, np.ndarray]:
    """``rows`` float64 (draft, target) pairs, each ``[rows, vocab_size]``, of one of MODES.

    random: Dirichlet rows; equal: p = q; close: q = p up to 1e-3 relative noise (many ratios near 1);
    zeros: p = 0 on a third of the tokens; disjoint: p = 0 where q > 0 and q = 0 elsewhere but one token;
    peaked: softmax of scaled normal logits, the target's a perturbation of the draft's (language-model-like:
    a few tokens hold most mass, many ratios near rho*).
    """
    rng = np.random.default_rng(seed)
    draft = rng.dirichlet(np.full(vocab_size, concentration), size=rows)
    target = rng.dirichlet(np.full(vocab_size, concentration), size=rows)
    if mode == "equal":
        target = draft.copy()
    elif mode == "close":
        target = draft * np.exp(1e-3 * rng.standard_normal(draft.shape))
        target /= target.sum(-1, keepdims=True)
    elif mode == "zeros" and vocab_size > 1:
        draft[:, vocab_size // 3 :] += 1e-3  # keep mass outside the zeroed tokens
        draft[:, : vocab_size // 3] = 0.0
        draft /= draft.sum(-1, keepdims=True)
    elif mode == "disjoint" and vocab_size > 1:
        draft[:, 1:] += 1e-3
        draft[:, 0], target[:, 1:] = 0.0, 0.0
        draft /= draft.sum(-1, keepdims=True)
        target /= target.sum(-1, keepdims=True)
    elif mode == "peaked":
        scale = rng.choice([2.0, 4.0, 8.0])
        logits = scale * rng.standard_normal((rows, vocab_size))
        draft = np.exp(logits - logits.max(-1, keepdims=True))
        draft /= draft.sum(-1, keepdims=True)
        target_logits = logits + rng.choice([0.1, 0.5, 2.0]) * rng.standard_normal((rows, vocab_size))
        target = np.exp(target_logits - target_logits.max(-1, keepdims=True))
        target /= target.sum(-1, keepdims=True)
    return draft, target


def _check_sampler(draft: np.ndarray, target: np.ndarray, num_drafts: int, dtype: torch.dtype, **options) -> None:
    """The sampler's rho on the rows as a sampler sees them (half precision widened and renormalised) is valid and tight."""
    # [rows, vocab_size]
    draft_t = _sampler_dtype(torch.from_numpy(draft).to(dtype))
    target_t = _sampler_dtype(torch.from_numpy(target).to(dtype))
    k = torch.full((draft.shape[0],), float(num_drafts), dtype=torch.float64)
    rho = kseq_rho_star_sampler(draft_t, target_t, k, **options)
    # the exact solve and the gap on the same rows, renormalised in float64
    d64, t64 = draft_t.double(), target_t.double()
    d64, t64 = d64 / d64.sum(-1, keepdim=True), t64 / t64.sum(-1, keepdim=True)
    exact = kseq_rho_star(d64, t64, num_drafts)
    assert rho.dtype == torch.float64 and rho.shape == k.shape
    assert bool((rho >= 1).all() and (rho <= num_drafts).all()), rho
    gap = _kseq_gap(d64, t64, rho, k)
    assert bool((gap >= -1e-15).all()), ("invalid rho", rho, exact, gap)
    assert bool((rho >= exact * (1 - 1e-12)).all()), (rho, exact)
    # What a larger rho costs is acceptance, P_A = 1 - (1 - beta(rho))^K: within 1e-5 of K-SEQ's optimum
    # (rho itself may sit further above rho* where f is flat, e.g. near-equal float32 rows).
    def acceptance(r):
        return kseq_accept_prob(torch.minimum(d64, t64 / r.unsqueeze(-1)).sum(-1), num_drafts)

    loss = acceptance(exact) - acceptance(rho)
    assert bool((loss <= 1e-5).all()), ("loose rho", rho, exact, loss)


# ---------------------------------------------------------------------------------------------
# The exact solve
# ---------------------------------------------------------------------------------------------


@settings(max_examples=150, deadline=None)
@given(
    vocab_size=st.integers(1, 12),
    num_drafts=st.integers(1, 9),
    concentration=st.sampled_from([0.1, 0.5, 2.0]),
    seed=st.integers(0, 2**31 - 1),
    mode=st.sampled_from(["random", "equal", "zeros", "disjoint"]),
)
def test_sorted_rho_star_matches_the_bisection_oracle(vocab_size, num_drafts, concentration, seed, mode):
    """The piecewise solve (sort by q/p, bracket, scalar bisection) against plain 64-step bisection."""
    rng = np.random.default_rng(seed)
    draft = rng.dirichlet(np.full(vocab_size, concentration), size=4)
    target = rng.dirichlet(np.full(vocab_size, concentration), size=4)
    if mode == "equal":
        target = draft.copy()
    elif mode == "zeros" and vocab_size > 1:
        draft[:, 0] = 0.0
        draft /= draft.sum(-1, keepdims=True)
    elif mode == "disjoint" and vocab_size > 1:
        draft[:, 0], target[:, 1:] = 0.0, 0.0
        draft /= draft.sum(-1, keepdims=True)
        target /= target.sum(-1, keepdims=True)
    draft_t, target_t = torch.from_numpy(draft), torch.from_numpy(target)
    fast = kseq_rho_star(draft_t, target_t, num_drafts)
    slow = kseq_rho_star_bisection(draft_t, target_t, num_drafts)
    torch.testing.assert_close(fast, slow, atol=1e-9, rtol=0)


def test_kseq_rho_star_per_row_num_drafts() -> None:
    generator = torch.Generator().manual_seed(0)
    # [4, 3, vocab_size]
    draft = torch.rand(4, 3, 10, generator=generator, dtype=torch.float64) ** 3
    target = torch.rand(4, 3, 10, generator=generator, dtype=torch.float64) ** 3
    draft, target = draft / draft.sum(-1, keepdim=True), target / target.sum(-1, keepdim=True)
    # [4, 3]
    num_drafts = torch.randint(1, 9, (4, 3), generator=generator)
    batched = kseq_rho_star(draft, target, num_drafts.to(torch.float64))
    assert batched.shape == (4, 3) and batched.dtype == torch.float64
    assert torch.equal(batched, kseq_rho_star(draft, target, num_drafts))
    for index in itertools.product(range(4), range(3)):
        row = kseq_rho_star(draft[index], target[index], int(num_drafts[index]))
        assert batched[index].item() == row.item()
    # A tensor K broadcast over the batch equals the int.
    assert torch.equal(kseq_rho_star(draft, target, torch.tensor(5)), kseq_rho_star(draft, target, 5))
    per_row = kseq_acceptance(draft, target, num_drafts)
    assert torch.allclose(per_row.value, kseq_accept_prob(per_row.beta, num_drafts), atol=0, rtol=0)


def test_kseq_accept_prob_small_beta() -> None:
    # 1 - (1 - beta)^K loses all precision here; the expm1 form keeps it.
    beta = torch.tensor([1e-18, 1e-9], dtype=torch.float64)
    accept = kseq_accept_prob(beta, 4)
    assert accept[0].item() == pytest.approx(4e-18, rel=1e-12)
    assert accept[1].item() == pytest.approx(4e-9 - 6e-18, rel=1e-12)


# ---------------------------------------------------------------------------------------------
# The sampler's solve
# ---------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class SamplerCase:
    """Rows from ``_rows(vocab_size, concentration, mode, seed)`` on which an earlier sampler solve failed."""

    name: str
    vocab_size: int
    num_drafts: int
    concentration: float
    dtype: torch.dtype
    seed: int
    mode: str
    failure: str  # what went wrong there before


SAMPLER_CASES = [
    # Sums of p and q over the low tokens accumulated in float32 (a float32 bmm): their rounding, ~1e-6
    # over a few thousand tokens, exceeds the 16-ulp margin, so candidates and the final segment solve
    # were judged valid on the wrong side of rho*.
    SamplerCase("float32_sums_v4099", 4099, 6, 0.05, torch.float32, 4, "zeros", "f(rho) = -2.7e-8"),
    SamplerCase("float32_sums_v32768", 32768, 6, 0.05, torch.float32, 1690859717, "zeros", "f(rho) = -1.3e-5"),
    SamplerCase("float32_sums_v32768_k3", 32768, 3, 0.05, torch.float32, 360857230, "zeros", "f(rho) = -1.1e-6"),
    SamplerCase("float32_sums_peaked", 32768, 3, 2.0, torch.float32, 1703692881, "peaked", "f(rho) = -2.4e-8"),
    SamplerCase("bfloat16_sums_peaked", 4099, 6, 0.5, torch.bfloat16, 1729209896, "peaked", "f(rho) = -2.3e-7"),
    SamplerCase("bfloat16_sums_close", 32768, 2, 2.0, torch.bfloat16, 82767003, "close", "f(rho) = -1.3e-6"),
    # float64 rows: a margin of 16 ulps does not cover the rounding of float64 sums over 32k tokens.
    SamplerCase("float64_sums_v32768", 32768, 8, 0.5, torch.float64, 474527665, "peaked", "f(rho) = -2.0e-15"),
    # Peaked rows, many ratios near rho*: six fixed passes left the bracket holding many tokens and the
    # answer was its upper end.
    SamplerCase("peaked_unconverged_v4099", 4099, 4, 0.5, torch.float64, 1794600742, "peaked", "acceptance 1.4e-4 short"),
    SamplerCase("peaked_unconverged_v32768", 32768, 4, 0.5, torch.float32, 1236317416, "peaked", "acceptance 1.8e-4 short"),
    SamplerCase("peaked_unconverged_k5", 4099, 5, 0.05, torch.float32, 2055773998, "peaked", "acceptance 1.3e-4 short"),
    # Peaked rows on which earlier candidate rules of the bounds-based solve were slow (an interpolated
    # candidate is needed, and a seventh pass).
    SamplerCase("peaked_dense_ratios", 32768, 8, 2.0, torch.float64, 2121397819, "peaked", "acceptance 4.4e-5 short"),
    SamplerCase("peaked_stale_upper_end", 4099, 6, 2.0, torch.float32, 119451985, "peaked", "acceptance 3.5e-6 short"),
    SamplerCase("peaked_kinks_v1000", 1000, 7, 0.5, torch.float64, 739139776, "peaked", "acceptance 1.1e-5 short"),
    SamplerCase("peaked_kinks_k7", 1000, 7, 0.05, torch.float64, 1352216359, "peaked", "acceptance 2.1e-5 short"),
    SamplerCase("peaked_kinks_v300", 300, 6, 0.05, torch.float64, 62222353, "peaked", "acceptance 1.0e-5 short"),
]


@pytest.mark.parametrize("stop_early", [True, False], ids=["stop_early", "fixed_passes"])
@pytest.mark.parametrize("case", SAMPLER_CASES, ids=lambda case: case.name)
def test_sampler_cases(case: SamplerCase, stop_early: bool) -> None:
    """Each counterexample found so far, on the CPU's path (stop once converged) and the accelerators' (fixed passes)."""
    draft, target = _rows(case.vocab_size, case.concentration, case.mode, case.seed)
    _check_sampler(draft, target, case.num_drafts, case.dtype, stop_early=stop_early)


@settings(max_examples=120, deadline=None)
@given(
    vocab_size=st.sampled_from([2, 7, 64, 300, 1000, 4099]),
    num_drafts=st.integers(1, 8),
    concentration=st.sampled_from([0.05, 0.5, 2.0]),
    dtype=st.sampled_from([torch.float64, torch.float32, torch.float32, torch.bfloat16]),
    seed=st.integers(0, 2**31 - 1),
    mode=st.sampled_from(["random", "equal", "close", "zeros", "disjoint", "peaked", "peaked"]),
    stop_early=st.booleans(),
)
def test_sampler_rho_is_valid_and_matches_the_exact_solve(vocab_size, num_drafts, concentration, dtype, seed, mode, stop_early):
    """The sampler's rho (no sort at V > 256) against the exact piecewise solve: valid, and tight in acceptance."""
    draft, target = _rows(vocab_size, concentration, mode, seed)
    _check_sampler(draft, target, num_drafts, dtype, stop_early=stop_early)


@settings(max_examples=60, deadline=None)
@given(
    vocab_size=st.sampled_from([300, 1000, 4099]),
    num_drafts=st.integers(2, 8),
    concentration=st.sampled_from([0.05, 0.5, 2.0]),
    dtype=st.sampled_from([torch.float64, torch.float32]),
    seed=st.integers(0, 2**31 - 1),
    mode=st.sampled_from(MODES),
    passes=st.integers(1, 6),
)
def test_sampler_rho_is_valid_after_any_number_of_passes(vocab_size, num_drafts, concentration, dtype, seed, mode, passes):
    """The answer is the root of a lower bound on f over the final bracket: valid even when the passes stop early."""
    draft, target = _rows(vocab_size, concentration, mode, seed)
    draft_t, target_t = torch.from_numpy(draft).to(dtype), torch.from_numpy(target).to(dtype)
    k = torch.full((3,), float(num_drafts), dtype=torch.float64)
    rho = kseq_rho_star_sampler(draft_t, target_t, k, passes=passes, stop_early=False)
    d64, t64 = draft_t.double(), target_t.double()
    d64, t64 = d64 / d64.sum(-1, keepdim=True), t64 / t64.sum(-1, keepdim=True)
    assert bool((_kseq_gap(d64, t64, rho, k) >= -1e-15).all()), rho
    assert bool((rho >= kseq_rho_star(d64, t64, num_drafts) * (1 - 1e-12)).all() and (rho <= num_drafts).all())


@settings(max_examples=100, deadline=None)
@given(
    vocab_size=st.sampled_from([2, 7, 300, 1000]),
    num_drafts=st.integers(1, 8),
    concentration=st.sampled_from([0.05, 0.5, 2.0]),
    dtype=st.sampled_from([torch.float64, torch.float32]),
    seed=st.integers(0, 2**31 - 1),
    mode=st.sampled_from(MODES),
    fractions=st.lists(st.floats(0.0, 1.0), min_size=2, max_size=2),
)
def test_inside_tokens_give_the_full_pass_sums(vocab_size, num_drafts, concentration, dtype, seed, mode, fractions):
    """The later passes' sums over the tokens with 1 < q/p <= K against a full pass (a matrix product over
    every token) at the same candidates in [1, K]: the same tokens are low, so the float64 sums agree to
    the rounding of a sum of V terms at most 1."""
    draft, target = _rows(vocab_size, concentration, mode, seed)
    draft_t, target_t = torch.from_numpy(draft).to(dtype), torch.from_numpy(target).to(dtype)
    n = draft_t.shape[0]
    stacked = torch.stack([draft_t, target_t], 1).double()
    ratio = torch.div(target_t, draft_t).unsqueeze(1)

    def full_pass(thresholds):  # [n, 2] in the rows' dtype
        mask = (ratio <= thresholds.unsqueeze(-1)).double()
        return torch.bmm(stacked, mask.transpose(1, 2))

    first = torch.tensor([[1.0, float(num_drafts)]] * n, dtype=dtype)
    low_mask = (ratio <= first.unsqueeze(-1)).double()
    with mock.patch("spectr_audit.verifiers.rho_star._INSIDE_FRACTION", 1.0):
        inside = _InsideTokens.of(stacked, ratio, low_mask, full_pass(first))
    candidates = (1 + (num_drafts - 1) * torch.tensor(fractions, dtype=torch.float64)).expand(n, 2).to(dtype)
    torch.testing.assert_close(inside.low_sums(candidates), full_pass(candidates), atol=4 * vocab_size * 2.0**-52, rtol=0)


@settings(max_examples=100, deadline=None)
@given(
    vocab_size=st.integers(2, 40),
    concentration=st.sampled_from([0.1, 0.5, 2.0]),
    seed=st.integers(0, 2**31 - 1),
    ends=st.tuples(st.floats(1.0, 6.0), st.floats(1.0, 6.0)),
)
def test_bracket_models_bound_beta(vocab_size, concentration, seed, ends):
    """The sampler's bracket models: columns 0-1 bound beta from above, 2-3 from below, exact where documented.

    Against beta(x) = sum_x min(p, q/x) summed token by token, on a grid across the bracket.
    """
    low, high = min(ends), max(ends)
    draft, target = _rows(vocab_size, concentration, "random", seed, rows=1)
    ratio = target[0] / draft[0]

    def sums_at(c):
        below = ratio <= c
        return [draft[0][below].sum(), target[0][below].sum()]

    models = _bracket_models(
        torch.tensor([low], dtype=torch.float64), torch.tensor([high], dtype=torch.float64),
        torch.tensor([sums_at(low)], dtype=torch.float64), torch.tensor([sums_at(high)], dtype=torch.float64), 1e-13,
    )
    x = torch.linspace(low, high, 33, dtype=torch.float64).unsqueeze(-1)  # [33, 1]
    # [33, 4]: each model's beta at each x
    model_beta = _model_beta(x, models[0], models[3])
    exact = torch.from_numpy(np.minimum(draft[0], target[0] / x.numpy()).sum(-1)).unsqueeze(-1)  # [33, 1]
    assert bool((model_beta[:, :2] >= exact - 1e-12).all())
    assert bool((model_beta[:, 2:] <= exact + 1e-12).all())
    # exact at the ends they are built from: the split at low (0) and the first bound (2) at low, the rest at high
    torch.testing.assert_close(model_beta[0, [0, 2]], exact[0].expand(2), atol=1e-12, rtol=0)
    torch.testing.assert_close(model_beta[-1, [1, 3]], exact[-1].expand(2), atol=1e-12, rtol=0)


def test_sampler_rho_one_where_it_is_exact() -> None:
    """p = q, disjoint supports and K = 1 give rho* = 1 exactly; the sampler returns exactly 1 too (V > 256)."""
    for mode, num_drafts in [("equal", 4), ("disjoint", 4), ("random", 1)]:
        draft, target = _rows(1000, 0.5, mode, seed=3)
        for dtype in (torch.float32, torch.float64):
            k = torch.full((3,), float(num_drafts), dtype=torch.float64)
            rho = kseq_rho_star_sampler(torch.from_numpy(draft).to(dtype), torch.from_numpy(target).to(dtype), k)
            assert torch.equal(rho, torch.ones(3, dtype=torch.float64)), (mode, dtype, rho)


@dataclasses.dataclass(frozen=True)
class BadCase:
    name: str
    call: object
    fragment: str


GOOD = [0.5, 0.5]

BAD_CASES = [
    BadCase("rho_numpy", lambda: kseq_rho_star(np.array(GOOD), np.array(GOOD), 2), "expected torch tensors"),
    BadCase("rho_int_tensor", lambda: kseq_rho_star(torch.tensor([1, 0]), torch.tensor([1, 0]), 2), "expected floating-point tensors"),
    BadCase("rho_shape", lambda: kseq_rho_star(torch.tensor(GOOD), torch.tensor([GOOD]), 2), "draft_probs: expected shape [..., vocab_size] matching target_probs (1, 2)"),
    BadCase("rho_k_shape", lambda: kseq_rho_star(torch.tensor([GOOD] * 3), torch.tensor([GOOD] * 3), torch.tensor([2, 2])), "num_drafts: expected a tensor broadcastable to the batch shape (3,)"),
    BadCase("rho_k_bool", lambda: kseq_rho_star(torch.tensor(GOOD), torch.tensor(GOOD), torch.tensor(True)), "num_drafts: expected an integer or float tensor"),
    BadCase("rho_k_zero", lambda: kseq_rho_star(torch.tensor(GOOD), torch.tensor(GOOD), 0), "num_drafts: expected an integer >= 1, got 0"),
]


@pytest.mark.parametrize("case", BAD_CASES, ids=lambda case: case.name)
def test_bad_inputs(case: BadCase) -> None:
    with pytest.raises(InvalidArgument) as info:
        case.call()
    assert case.fragment in str(info.value)
    assert isinstance(info.value, ValueError)


def test_sampler_bad_passes() -> None:
    draft, target = (torch.from_numpy(rows).float() for rows in _rows(300, 0.5, "random", seed=0))
    k = torch.full((3,), 2.0, dtype=torch.float64)
    for passes in (0, 1.5, True):
        with pytest.raises(InvalidArgument, match="passes: expected an integer >= 1"):
            kseq_rho_star_sampler(draft, target, k, passes=passes)
