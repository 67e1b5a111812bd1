"""Tests for spectr_audit.bounds.acceptance: alpha* (closed form and LP), K-SEQ's rho* and acceptance.

Every fast path here has a slow oracle: the closed form is checked against the transport LP
and against brute force over all token subsets; batched calls against row-by-row calls.
The hypothesis tests are deterministic in what they assert (no statistical tolerance); a
failure is a counterexample to shrink and add to HAND_CASES.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from typing import Callable, Optional

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from spectr_audit.bounds.acceptance import (
    OptimalAcceptanceResult,
    kseq_acceptance,
    optimal_acceptance,
    optimal_acceptance_lp,
    optimal_acceptance_lp_from_sets,
    spectr_guarantee,
)
from spectr_audit.bounds.acceptance import without_replacement_set_probs as set_probs_without_replacement
from spectr_audit.verifiers.rho_star import kseq_rho_star
from spectr_audit.errors import InvalidArgument

from tests.oracles.acceptance import (
    brute_force_alpha,
    brute_force_alpha_from_sets,
    exact_kseq_gap,
    without_replacement_set_probs,
)

SQRT_034 = math.sqrt(0.34)

# ---------------------------------------------------------------------------------------------
# Hand-derived values
# ---------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class HandCase:
    name: str
    # [vocab_size]
    draft: tuple[float, ...]
    # [vocab_size]
    target: tuple[float, ...]
    num_drafts: int
    alpha: float
    argmin_set: frozenset[int]
    rho_star: Optional[float] = None
    kseq_accept: Optional[float] = None


HAND_CASES = [
    # The SpecTr worked example (docs/rules/kseq.md).  q/p = (0.5, 1.75): prefixes {} -> 1,
    # {A} -> 0.3 + 1 - 0.6^2 = 0.94, {A, B} -> 1.  K-SEQ: for rho <= 1.75, beta = 0.3/rho + 0.4
    # and f = beta (rho - 2 + beta) = 0 gives rho^2 - 1.6 rho + 0.3 = 0, rho* = 0.8 + sqrt(0.34);
    # P_A = rho* beta = 0.4 rho* + 0.3 = 0.62 + 0.4 sqrt(0.34).
    HandCase("seed_k2", (0.6, 0.4), (0.3, 0.7), 2, 0.94, frozenset({0}), 0.8 + SQRT_034, 0.62 + 0.4 * SQRT_034),
    # K = 1: {A} -> 0.3 + 1 - 0.6 = 0.7 = sum min(p, q) = 1 - TV; K-SEQ is plain speculative sampling.
    HandCase("seed_k1", (0.6, 0.4), (0.3, 0.7), 1, 0.7, frozenset({0}), 1.0, 0.7),
    # K = 3: {A} -> 0.3 + 1 - 0.216 = 1.084 > 1, so alpha* = 1 (the empty set).  Coupling:
    # P(set={A}) = 0.216 -> A, P({B}) = 0.064 -> B, P({A,B}) = 0.72 -> A 0.084, B 0.636.
    HandCase("seed_k3", (0.6, 0.4), (0.3, 0.7), 3, 1.0, frozenset()),
    # p = (1, 0), q = (1/2, 1/2), K = 2: both drafts are A, so P(Y in S) = P(Y = A) <= 1/2.
    # Closed form: q/p = (0.5, +inf); {A} -> 1/2 + 1 - 1^2 = 1/2, {} and {A, B} -> 1; alpha* = 1/2.
    # K-SEQ: beta = 0.5/rho, f = 0.5 - 1 + (1 - 0.5/rho)^2 = 0 at rho* = 0.5 / (1 - sqrt(1/2))
    # = 1 + sqrt(1/2); P_A = rho* beta = 1/2 (optimal here).
    HandCase("point_mass_draft", (1.0, 0.0), (0.5, 0.5), 2, 0.5, frozenset({0}), 1 + math.sqrt(0.5), 0.5),
    # Disjoint supports: T = supp(p) has q(T) = 0, p(T) = 1, so alpha* = 0; beta = 0, P_A = 0.
    HandCase("disjoint", (0.5, 0.5, 0.0, 0.0), (0.0, 0.0, 0.3, 0.7), 3, 0.0, frozenset({0, 1}), 1.0, 0.0),
    # p = q: q(T) >= p(T) >= p(T)^K for every T, so alpha* = 1; rho* = 1, beta = 1, P_A = 1.
    HandCase("equal", (0.2, 0.3, 0.5), (0.2, 0.3, 0.5), 4, 1.0, frozenset(), 1.0, 1.0),
]


@pytest.mark.parametrize("case", HAND_CASES, ids=lambda case: case.name)
def test_hand_cases(case: HandCase) -> None:
    bound = optimal_acceptance(case.draft, case.target, case.num_drafts)
    assert bound.item() == pytest.approx(case.alpha, abs=1e-12)
    assert bound.argmin_set() == case.argmin_set
    lp = optimal_acceptance_lp(case.draft, case.target, case.num_drafts)
    assert lp.status == "optimal"
    assert lp.value == pytest.approx(case.alpha, abs=1e-6)
    if case.rho_star is not None:
        result = kseq_acceptance(case.draft, case.target, case.num_drafts)
        assert result.rho_star.item() == pytest.approx(case.rho_star, abs=1e-12)
        assert result.item() == pytest.approx(case.kseq_accept, abs=1e-12)


def test_spectr_guarantee() -> None:
    assert spectr_guarantee(1) == 1.0
    assert spectr_guarantee(2) == pytest.approx(0.75)
    assert spectr_guarantee(8) == pytest.approx(1 - (7 / 8) ** 8)
    assert spectr_guarantee(10_000) == pytest.approx(1 - 1 / math.e, abs=1e-4)


# ---------------------------------------------------------------------------------------------
# Against the slow oracles (tests/oracles/acceptance.py)
# ---------------------------------------------------------------------------------------------


@st.composite
def distributions(draw, vocab_size: int) -> np.ndarray:
    """A random distribution with some exact zeros (Dirichlet-ish: cubed uniforms)."""
    weights = draw(
        st.lists(
            st.one_of(st.just(0.0), st.floats(0.0, 1.0)),
            min_size=vocab_size,
            max_size=vocab_size,
        ).filter(lambda w: sum(x**3 for x in w) > 1e-6)
    )
    cubed = np.array(weights) ** 3
    return cubed / cubed.sum()


@st.composite
def distribution_pairs(draw, min_vocab: int = 2, max_vocab: int = 6) -> tuple[np.ndarray, np.ndarray]:
    vocab_size = draw(st.integers(min_vocab, max_vocab))
    return draw(distributions(vocab_size)), draw(distributions(vocab_size))


@settings(max_examples=100, deadline=None)
@given(pair=distribution_pairs(2, 6), num_drafts=st.integers(1, 4))
def test_lp_matches_closed_form(pair, num_drafts) -> None:
    draft, target = pair
    lp = optimal_acceptance_lp(draft, target, num_drafts)
    assert lp.status == "optimal"
    closed = optimal_acceptance(draft, target, num_drafts).item()
    assert lp.value == pytest.approx(closed, abs=1e-6)


@settings(max_examples=30, deadline=None)
@given(pair=distribution_pairs(2, 5), num_drafts=st.integers(1, 4))
def test_lp_from_sets_without_replacement_matches_min_cut(pair, num_drafts) -> None:
    draft, target = pair
    set_probs = without_replacement_set_probs(draft, num_drafts)
    lp = optimal_acceptance_lp_from_sets(set_probs, target)
    assert lp.status == "optimal"
    assert lp.value == pytest.approx(brute_force_alpha_from_sets(set_probs, target), abs=1e-6)


@settings(max_examples=200, deadline=None)
@given(pair=distribution_pairs(1, 8), num_drafts=st.integers(1, 8))
def test_closed_form_matches_brute_force(pair, num_drafts) -> None:
    draft, target = pair
    bound = optimal_acceptance(draft, target, num_drafts)
    expected = brute_force_alpha(draft, target, num_drafts)
    assert bound.item() == pytest.approx(expected, abs=1e-12)
    # The reported set attains the minimum.
    chosen = sorted(bound.argmin_set())
    attained = target[chosen].sum() + 1.0 - draft[chosen].sum() ** num_drafts
    assert attained == pytest.approx(expected, abs=1e-11)


@settings(max_examples=200, deadline=None)
@given(pair=distribution_pairs(1, 12), num_drafts=st.integers(1, 8))
def test_kseq_within_spectr_guarantee(pair, num_drafts) -> None:
    draft, target = pair
    alpha = optimal_acceptance(draft, target, num_drafts).item()
    result = kseq_acceptance(draft, target, num_drafts)
    accept, rho, beta = result.item(), result.rho_star.item(), result.beta.item()
    assert spectr_guarantee(num_drafts) * alpha - 1e-9 <= accept <= alpha + 1e-9
    assert 1.0 <= rho <= num_drafts
    # docs/rules/kseq.md: at rho*, P_A = rho* beta = sum_x min(rho* p(x), q(x)).
    assert accept == pytest.approx(float(np.minimum(rho * draft, target).sum()), abs=1e-9)
    assert accept >= float(np.minimum(draft, target).sum()) - 1e-12
    # The unvalidated hot path sees exactly these rows (kseq_acceptance renormalised them).
    rho = kseq_rho_star(torch.from_numpy(draft), torch.from_numpy(target), num_drafts).item()
    # rho* is valid: f(rho*) >= 0, i.e. the residual is non-negative.
    assert exact_kseq_gap(draft, target, rho, num_drafts) >= -1e-12
    beta = float(np.minimum(draft, target / rho).sum())
    if beta > 0:
        accept = 1 - (1 - beta) ** num_drafts
        residual = target - (accept / beta) * np.minimum(draft, target / rho)
        assert residual.min() >= -1e-12
    # ... and the smallest valid one.
    if rho > 1 + 1e-6:
        assert exact_kseq_gap(draft, target, rho - 1e-6, num_drafts) < 0


def test_batched_closed_form_equals_rows() -> None:
    generator = torch.Generator().manual_seed(1)
    shape = (2, 3, 7)
    draft = torch.rand(shape, generator=generator, dtype=torch.float64) ** 3
    target = torch.rand(shape, generator=generator, dtype=torch.float64) ** 3
    draft[torch.rand(shape, generator=generator) < 0.3] = 0.0
    target[torch.rand(shape, generator=generator) < 0.3] = 0.0
    draft[..., 0] += 1e-3  # keep every row non-empty
    target[..., 1] += 1e-3
    draft, target = draft / draft.sum(-1, keepdim=True), target / target.sum(-1, keepdim=True)
    for num_drafts in (1, 3, 8):
        batched = optimal_acceptance(draft, target, num_drafts)
        assert batched.value.shape == (2, 3) and batched.value.dtype == torch.float64
        assert batched.argmin_set_size.shape == (2, 3)
        from_numpy = optimal_acceptance(draft.numpy(), target.numpy(), num_drafts)
        assert torch.equal(from_numpy.value, batched.value)
        from_float32 = optimal_acceptance(draft.float(), target.float(), num_drafts)
        assert torch.allclose(from_float32.value, batched.value, atol=1e-6)
        for index in itertools.product(range(2), range(3)):
            row = optimal_acceptance(draft[index], target[index], num_drafts)
            assert row.item() == batched.value[index].item()
            assert row.argmin_set() == batched.argmin_set(index)


def test_lp_refuses_large_problems_and_reports_size() -> None:
    draft = np.full(12, 1 / 12)
    with pytest.raises(InvalidArgument, match="max_variables"):
        optimal_acceptance_lp(draft, draft, 4, max_variables=1000)
    bound = optimal_acceptance_lp([0.5, 0.5, 0.0], [0.2, 0.3, 0.5], 2, solver="HIGHS")
    assert (bound.solver, bound.status, bound.num_sets, bound.num_variables) == ("HIGHS", "optimal", 3, 4)
    assert bound.value == pytest.approx(optimal_acceptance([0.5, 0.5, 0.0], [0.2, 0.3, 0.5], 2).item(), abs=1e-7)


def test_large_vocabulary_runs() -> None:
    rng = np.random.default_rng(2)
    vocab_size = 131072
    draft = torch.from_numpy(rng.dirichlet(np.full(vocab_size, 0.1)))
    target = torch.from_numpy(rng.dirichlet(np.full(vocab_size, 0.1)))
    bound = optimal_acceptance(draft, target, 8)
    assert isinstance(bound, OptimalAcceptanceResult)
    alpha = bound.item()
    assert 0.0 <= alpha <= 1.0
    accept = kseq_acceptance(draft, target, 8).item()
    assert spectr_guarantee(8) * alpha - 1e-9 <= accept <= alpha + 1e-9


# ---------------------------------------------------------------------------------------------
# Bad inputs
# ---------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class BadCase:
    name: str
    call: Callable[[], object]
    fragment: str


GOOD = [0.5, 0.5]

BAD_CASES = [
    BadCase("shape_mismatch", lambda: optimal_acceptance([0.5, 0.5], [0.2, 0.3, 0.5], 2), "draft_probs: expected shape [..., vocab_size] matching target_probs (3,)"),
    BadCase("scalar", lambda: optimal_acceptance(1.0, 1.0, 2), "expected shape [..., vocab_size], got a scalar"),
    BadCase("empty_vocab", lambda: optimal_acceptance([], [], 2), "vocab_size must be >= 1"),
    BadCase("negative", lambda: optimal_acceptance([1.2, -0.2], GOOD, 2), "draft_probs: probabilities must be non-negative; found -0.2"),
    BadCase("nan", lambda: optimal_acceptance(GOOD, [math.nan, 1.0], 2), "target_probs: probabilities must be finite"),
    BadCase("inf", lambda: optimal_acceptance([math.inf, 0.0], GOOD, 2), "draft_probs: probabilities must be finite"),
    BadCase("sum_off", lambda: optimal_acceptance([[0.5, 0.5], [0.5, 0.4]], [[0.5, 0.5]] * 2, 2), "draft_probs: each distribution must sum to 1 within 1.0e-04; the row at batch index (1,)"),
    BadCase("integer_tensor", lambda: optimal_acceptance(torch.tensor([1, 0]), torch.tensor([1.0, 0.0]), 2), "draft_probs: expected a floating-point tensor"),
    BadCase("not_numeric", lambda: optimal_acceptance(["a", "b"], GOOD, 2), "draft_probs: expected a torch tensor, numpy array or nested list"),
    BadCase("zero_drafts", lambda: optimal_acceptance(GOOD, GOOD, 0), "num_drafts: expected an integer >= 1, got 0"),
    BadCase("float_drafts", lambda: optimal_acceptance(GOOD, GOOD, 1.5), "num_drafts: expected an integer >= 1, got 1.5"),
    BadCase("bool_drafts", lambda: optimal_acceptance(GOOD, GOOD, True), "num_drafts: expected an integer >= 1, got True"),
    BadCase("drafts_beyond_64_bits", lambda: optimal_acceptance(GOOD, GOOD, 2**63),
            "num_drafts: at most 2**63 - 1 (torch's 64-bit integers), got 9223372036854775808"),
    BadCase("guarantee_zero", lambda: spectr_guarantee(0), "num_drafts: expected an integer >= 1"),
    BadCase("item_on_batch", lambda: optimal_acceptance([GOOD, GOOD], [GOOD, GOOD], 2).item(), "item(): defined for a single row only"),
    BadCase("argmin_index", lambda: optimal_acceptance([GOOD, GOOD], [GOOD, GOOD], 2).argmin_set(), "index: expected 1 indices"),
    BadCase("lp_batched", lambda: optimal_acceptance_lp([GOOD], [GOOD], 2), "target_probs: expected shape [vocab_size], got (1, 2)"),
    BadCase("lp_too_big", lambda: optimal_acceptance_lp(np.full(30, 1 / 30), np.full(30, 1 / 30), 8), "above max_variables=200000"),
    BadCase("lp_bad_max", lambda: optimal_acceptance_lp(GOOD, GOOD, 2, max_variables=0), "max_variables: expected an integer >= 1"),
    BadCase("lp_unknown_solver", lambda: optimal_acceptance_lp(GOOD, GOOD, 2, solver="NOPE"), "solver: 'NOPE' is not installed"),
    BadCase("sets_empty_key", lambda: optimal_acceptance_lp_from_sets({frozenset(): 1.0}, GOOD), "set_probs: keys must be non-empty frozensets"),
    BadCase("sets_bad_token", lambda: optimal_acceptance_lp_from_sets({frozenset({2}): 1.0}, GOOD), "set_probs: token ids must be integers in [0, 2)"),
    BadCase("sets_negative", lambda: optimal_acceptance_lp_from_sets({frozenset({0}): 1.5, frozenset({1}): -0.5}, GOOD), "set_probs: masses must be finite and non-negative"),
    BadCase("sets_sum_off", lambda: optimal_acceptance_lp_from_sets({frozenset({0}): 0.5}, GOOD), "set_probs: masses must sum to 1"),
    BadCase("sets_not_mapping", lambda: optimal_acceptance_lp_from_sets([(frozenset({0}), 1.0)], GOOD), "set_probs: expected a mapping"),
    BadCase("kseq_k_tensor_zero", lambda: kseq_acceptance([GOOD, GOOD], [GOOD, GOOD], torch.tensor([2, 0])), "num_drafts: expected integral values >= 1, found 0.0 at batch index (1,)"),
    BadCase("kseq_k_tensor_fraction", lambda: kseq_acceptance([GOOD, GOOD], [GOOD, GOOD], torch.tensor([2.5, 2.0])), "num_drafts: expected integral values >= 1, found 2.5"),
    BadCase("kseq_sum_off", lambda: kseq_acceptance(GOOD, [0.5, 0.6], 2), "target_probs: each distribution must sum to 1"),
]


@pytest.mark.parametrize("case", BAD_CASES, ids=lambda case: case.name)
def test_bad_inputs(case: BadCase) -> None:
    with pytest.raises(InvalidArgument) as info:
        case.call()
    assert case.fragment in str(info.value)
    assert isinstance(info.value, ValueError)


@settings(max_examples=100, deadline=None)
@given(pair=distribution_pairs(2, 6), num_drafts=st.integers(1, 4))
def test_the_without_replacement_set_law_matches_the_recursive_oracle(pair, num_drafts) -> None:
    draft, _ = pair
    support = int((draft > 0).sum())
    if support < num_drafts:
        with pytest.raises(InvalidArgument, match="num_drafts: .* need as many of positive draft probability"):
            set_probs_without_replacement(draft, num_drafts)
        return
    fast = set_probs_without_replacement(draft, num_drafts)
    slow = without_replacement_set_probs(draft, num_drafts)
    assert set(fast) == set(slow)
    for key, mass in slow.items():
        assert fast[key] == pytest.approx(mass, rel=1e-12, abs=1e-15)
    assert sum(fast.values()) == pytest.approx(1.0, abs=1e-12)


def test_the_without_replacement_set_law_refuses_beyond_its_limit(monkeypatch) -> None:
    from spectr_audit import defaults

    monkeypatch.setattr(defaults, "MIN_CUT_MAX_SUPPORT", 5)  # five tokens of positive probability: 2**5 sets
    assert len(set_probs_without_replacement([0.2] * 5 + [0.0], 3)) == 10
    monkeypatch.setattr(defaults, "MIN_CUT_MAX_SUPPORT", 4)
    with pytest.raises(InvalidArgument, match=r"tree: .* 2\*\*5 sets of the draft's 5 tokens .* limit of 2\*\*4"):
        set_probs_without_replacement([0.2] * 5 + [0.0], 3, argument="tree")
