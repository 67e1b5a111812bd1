"""The block LPs (docs/audit/bounds.md): hand-derived optima, block verification attains the
unmodified-continuation LP at K = 1, greedy block verification the repair-allowed one, and no exact
verifier beats the LP."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given, settings, strategies as st

from spectr_audit.bounds.block_lp import BlockLPResult, block_lp
from spectr_audit.errors import InvalidArgument
from spectr_audit.exact.iteration import exact_iteration
from spectr_audit.drafting.models import ContextFreeModel
from spectr_audit.registry import load_verifier

from tests._models import PAPER
from tests.exact.test_multi_iteration import markov_pairs

LP_TOL = 1e-8  # CLARABEL with the module's tightened tolerances, on well-scaled cases
LOOSE_TOL = 1e-6  # random models: CLARABEL may fall back to its default tolerances (about 1e-7)


@dataclasses.dataclass(frozen=True)
class LPCase:
    """Hand-derived LP optima (derivations in the comments)."""

    name: str
    draft: tuple
    target: tuple
    num_drafts: int
    draft_len: int
    unmodified: float
    repair: float


LP_CASES = [
    # Paper example, K = 1: block verification's E[tau] = 11/9 is optimal (Sun et al.); with a repair the
    # optimum is sum_{t=0}^{2} sum_{x^t} min(p, q) = 1 + 2/3 + (1/9 + 2/9 + 2/9 + 1/9) = 21/9.
    LPCase("paper-K1", (2 / 3, 1 / 3), (1 / 3, 2 / 3), 1, 2, 20 / 9, 21 / 9),
    # L = 1: exact with unmodified continuation means the first token follows q and a bonus follows a
    # drafted token only, so the optimum is 1 + alpha* (SpecTr seed example, K = 2: alpha* = 0.94).  The cap
    # B(ab) = P(accept a) q(b) <= q(a) q(b) always holds once B(a) = q(a): the repair LP has the same value.
    LPCase("seed-spectr-K2-L1", (0.6, 0.4), (0.3, 0.7), 2, 1, 1.94, 1.94),
    # K = 1, L = 1: 1 + sum_x min(p, q) = 1 + 0.7.
    LPCase("seed-spectr-K1-L1", (0.6, 0.4), (0.3, 0.7), 1, 1, 1.7, 1.7),
    # p = q: everything is accepted, E[len] = L + 1, for any K.
    LPCase("equal-K2", (0.5, 0.5), (0.5, 0.5), 2, 2, 3.0, 3.0),
]


@pytest.mark.parametrize("case", LP_CASES, ids=lambda c: c.name)
def test_hand_derived_optima(case):
    result = block_lp(ContextFreeModel(case.draft), ContextFreeModel(case.target), case.num_drafts, case.draft_len)
    assert result.solved, (result.unmodified_status, result.repair_status)
    assert result.unmodified_value == pytest.approx(case.unmodified, abs=LP_TOL)
    assert result.repair_value == pytest.approx(case.repair, abs=LP_TOL)


def test_result_reports_sizes_and_is_frozen():
    result = block_lp(*PAPER, 1, 2)
    assert isinstance(result, BlockLPResult)
    # 4 draft blocks; each offers 2 + 2 + 2 strings (prefix length 0, 1, 2 plus a token): 24 pi(s|block).
    # Distinct strings: 2 of length 1, 4 of length 2 (0y, 1y), 8 of length 3: 14 ratios E(s)/q(s).
    assert (result.num_draft_tuples, result.num_variables) == (4, 24 + 14)
    # 8 strings w with q(w) > 0, 14 string links, 4 normalisations less the one they imply; caps on
    # 2 + 4 + 8 prefixes with all 4 normalisations.
    assert result.unmodified_num_constraints == 8 + 14 + 3
    assert result.repair_num_constraints == (2 + 4 + 8) + 14 + 4
    assert result.solver == "CLARABEL"
    with pytest.raises(dataclasses.FrozenInstanceError):
        result.repair_value = 0.0


@settings(max_examples=8, deadline=None)
# Temperature >= 1: sharper models put probabilities near 1e-6 and the LP's scaling suffers.
@given(markov_pairs(temperatures=(1.0, 2.0), target_seed_offset=3), st.integers(1, 3))
def test_block_verification_attains_the_lp_at_one_draft(models, draft_len):
    """Sun et al., Theorem 2: block verification is optimal among exact single-draft verifiers; greedy
    block verification (L >= 2) reaches the repair-allowed optimum."""
    result = block_lp(*models, 1, draft_len)
    assert result.solved
    block = exact_iteration(load_verifier("block"), *models, 1, draft_len).block_efficiency
    assert result.unmodified_value == pytest.approx(block, abs=LOOSE_TOL)
    assert result.repair_value >= result.unmodified_value - LOOSE_TOL
    if draft_len >= 2:
        greedy = exact_iteration(load_verifier("greedy-block"), *models, 1, draft_len).block_efficiency
        assert result.repair_value == pytest.approx(greedy, abs=LOOSE_TOL)


@pytest.mark.parametrize("num_drafts", [2, 3])
def test_exact_tree_verifier_stays_below_the_lp(num_drafts):
    """No verifier exact with unmodified continuation can beat the first LP (SpecTr tree, paper example)."""
    result = block_lp(*PAPER, num_drafts, 2)
    assert result.solved
    tree = exact_iteration(load_verifier("spectr-tree"), *PAPER, num_drafts, 2)
    assert tree.max_abs_error <= 1e-12
    assert tree.block_efficiency <= result.unmodified_value + LP_TOL
    assert result.unmodified_value <= result.repair_value + LP_TOL


BAD_INPUTS = [
    ("zero drafts", lambda: block_lp(*PAPER, 0, 2), "num_drafts: expected an integer >= 1, got 0"),
    ("zero length", lambda: block_lp(*PAPER, 1, 0), "draft_len: expected an integer >= 1, got 0"),
    ("unknown solver", lambda: block_lp(*PAPER, 1, 2, solver="NOPE"), "solver: 'NOPE' is not installed"),
    ("vocab mismatch", lambda: block_lp(PAPER[0], ContextFreeModel([0.2, 0.3, 0.5]), 1, 2), "target_model: vocab_size"),
]


@pytest.mark.parametrize("label,call,message", BAD_INPUTS, ids=[b[0] for b in BAD_INPUTS])
def test_bad_inputs(label, call, message):
    with pytest.raises(InvalidArgument, match=message):
        call()
