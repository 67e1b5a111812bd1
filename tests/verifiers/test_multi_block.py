"""Multi-draft block verification (docs/rules/multi-block.md).

Hand-derived values on the block-verification paper's example live in a case table (derivations in
comments); the exact single- and multi-iteration audits judge exactness on random context-free and
Markov models; the fast law is compared tuple by tuple with the plain-Python oracle of
``tests/oracles/multi_block.py``; the sampler is checked against its own law by chi-square at a stated
false-alarm rate; the simple construction of ``scripts/multi_block_table.py`` is checked against its
oracle.
"""

from __future__ import annotations

import importlib.util
import pathlib
from fractions import Fraction

import numpy as np
import pytest
import torch
from hypothesis import given, settings, strategies as st

from spectr_audit.bounds.block_lp import block_lp
from spectr_audit.drafting.harness import draft
from spectr_audit.drafting.models import ContextFreeModel, random_markov
from spectr_audit.errors import InvalidArgument
from spectr_audit.exact.iteration import enumerate_drafts, exact_iteration
from spectr_audit.exact.multi_iteration import exact_multi_iteration
from spectr_audit.registry import load_verifier
from spectr_audit.verifiers.multi_block import MultiDraftBlockVerification

from tests._models import PAPER
from tests._stats import pooled_chisquare_pvalue
from tests.oracles.multi_block import multi_block_law, simple_construction_law

pytestmark = pytest.mark.usefixtures("single_thread")

#: Cases with more ordered draft tuples than this are left to the slower audits.
MAX_TUPLES = 1000


def _rows(draft_tokens, draft_probs, target_probs, b):
    """The drafts of row b and the conditionals at their nodes, as the oracle takes them."""
    drafts = draft_tokens[b].tolist()
    draft_len = len(drafts[0])
    rows = {}
    for k, tokens in enumerate(drafts):
        for depth in range(draft_len + 1):
            key = tuple(tokens[:depth])
            if key not in rows:
                rows[key] = (draft_probs[b, k, depth].tolist() if depth < draft_len else None,
                             target_probs[b, k, depth].tolist())
    return drafts, (lambda u: rows[u][0]), (lambda u: rows[u][1])


def _string_law(law, draft_tokens, b) -> dict:
    out: dict = {}
    for k, n, y in (law[b] > 0).nonzero().tolist():
        key = tuple(draft_tokens[b, k, :n].tolist()) + (y,)
        out[key] = out.get(key, 0.0) + float(law[b, k, n, y])
    return out


def _assert_same_law(fast: dict, slow: dict, atol: float):
    for key in set(fast) | set(slow):
        assert abs(fast.get(key, 0.0) - slow.get(key, 0.0)) <= atol, (key, fast.get(key), slow.get(key))


# ---------------------------------------------------------------------------------------------
# Hand-derived values: the paper's example, p = (2/3, 1/3), q = (1/3, 2/3), K = 2, L = 2
# ---------------------------------------------------------------------------------------------

# C(u) = P(the accepted node extends u) = P(the emitted string strictly extends u).
# Root (budget 1, two drafts): priority ranks token 1 (q/p = 2) first.  Accepting every drafted 1 costs
# 1 - (2/3)^2 = 5/9 <= q(1), so theta_1 = 1; the free mass left is 2/3 and token 0 gets the largest
# theta_0 with (2/3)^2 - (2/3 - 2/3 theta_0)^2 <= 1/3: theta_0 = 1/2.  Allocation 5/9 + 1/3 = 8/9 (the
# optimum, alpha*), more than K-SEQ's, so priority is used.  Per depth-1 configuration:
#   {0,0} (4/9): kappa(0) = 1 - (1/2)^2 = 3/4 (the residual, token 1, is not drafted)  -> C(0) = 1/3;
#   {0,1}, {1,1} (4/9 + 1/9): kappa(1) = 1                                              -> C(1) = 5/9.
# Node 1 in {0,1}: one survivor, budget = share = 1: speculative sampling, g(10) = 1/2, g(11) = 1:
#   C(10) += 4/9 * 2/3 * 1/2 = 4/27, C(11) += 4/9 * 1/3 = 4/27.
# Node 1 in {1,1}: two survivors, budget = share = 1: the root's numbers: C(10) += 1/9 * 1/3, C(11) += 1/9 * 5/9.
# Node 0 in {0,0}: budget 3/4, share 1 (its only child): target (1/4, 1/2) plus stop mass 1/4; two survivors
#   cover it fully (1/4 <= P(0 drafted) = 8/9, 1/2 <= 5/9, 3/4 <= 1): C(00) = 4/9 * 1/4, C(01) = 4/9 * 1/2.
PAPER_NODES = {
    (0,): Fraction(1, 3), (1,): Fraction(5, 9),
    (0, 0): Fraction(1, 9), (0, 1): Fraction(2, 9), (1, 0): Fraction(5, 27), (1, 1): Fraction(17, 81),
}
# Block efficiency 1 + sum_u C(u) = 1 + 131/81 = 212/81, the block LP's optimum (its C-values are the
# single-node caps min(1 - (1 - p(u))^K, q(u_last | parent) C(parent)), all reached here).
PAPER_EFFICIENCY = Fraction(212, 81)


def test_paper_example_node_masses_and_efficiency():
    audit = exact_iteration(load_verifier("multi-block"), *PAPER, 2, 2)
    vocab_size = 2
    for node, value in PAPER_NODES.items():
        # C(u) = sum_a B(ua): the prefix law of strings one token longer than u
        codes = [sum(t * vocab_size ** (len(node) - i) for i, t in enumerate(node)) + a for a in range(vocab_size)]
        mass = float(audit.prefix_law[len(node)][codes].sum())
        assert mass == pytest.approx(float(value), abs=1e-12), node
    assert audit.block_efficiency == pytest.approx(float(PAPER_EFFICIENCY), abs=1e-12)
    assert audit.max_abs_error <= 1e-12 and audit.prefix_cap_excess <= 1e-12


def test_paper_example_reaches_the_block_lp():
    lp = block_lp(*PAPER, 2, 2)
    assert lp.unmodified_value == pytest.approx(float(PAPER_EFFICIENCY), abs=1e-7)


@pytest.mark.parametrize("num_drafts,draft_len", [(2, 2), (3, 2), (2, 3), (3, 3)])
def test_paper_example_beats_spectr_tree_and_the_simple_construction(num_drafts, draft_len):
    """Strictly better than the SpecTr tree and the simple construction, and than one draft."""
    mine = exact_iteration(load_verifier("multi-block"), *PAPER, num_drafts, draft_len)
    tree = exact_iteration(load_verifier("spectr-tree"), *PAPER, num_drafts, draft_len)
    single = exact_iteration(load_verifier("block"), *PAPER, 1, draft_len)
    simple = _simple_efficiency(PAPER[0], PAPER[1], num_drafts, draft_len)
    assert mine.max_abs_error <= 1e-12
    assert mine.block_efficiency > max(tree.block_efficiency, simple, single.block_efficiency) + 1e-3


def test_k1_is_block_verification_on_the_paper_example():
    audit = exact_iteration(load_verifier("multi-block"), *PAPER, 1, 2)
    assert audit.block_efficiency == pytest.approx(20 / 9, abs=1e-12)  # docs/rules/block.md


# ---------------------------------------------------------------------------------------------
# Random models: exact audits, the oracle, block verification at K = 1
# ---------------------------------------------------------------------------------------------


@st.composite
def model_cases(draw):
    """A context-free or order-1 Markov pair with V in 2..4, K <= 3, L <= 3, at most MAX_TUPLES tuples."""
    vocab_size = draw(st.integers(2, 4))
    num_drafts = draw(st.integers(1, 3))
    draft_len = draw(st.integers(1, 3))
    while (vocab_size**draft_len) ** num_drafts > MAX_TUPLES:
        draft_len -= 1
    seed = draw(st.integers(0, 100_000))
    concentration = draw(st.sampled_from([0.3, 1.0, 3.0]))
    if draw(st.booleans()):
        rng = np.random.default_rng(seed)
        models = tuple(ContextFreeModel(rng.dirichlet(np.full(vocab_size, concentration))) for _ in range(2))
    else:
        models = tuple(random_markov(vocab_size, 1, concentration=concentration, seed=seed + i) for i in range(2))
    return models[0], models[1], num_drafts, draft_len


@settings(max_examples=40, deadline=None)
@given(model_cases())
def test_exact_in_one_iteration_on_random_models(case):
    draft_model, target_model, num_drafts, draft_len = case
    audit = exact_iteration(load_verifier("multi-block"), draft_model, target_model, num_drafts, draft_len)
    assert audit.max_abs_error <= 1e-12
    assert audit.tv_distance <= 1e-12
    assert audit.prefix_cap_excess <= 1e-12


@settings(max_examples=25, deadline=None)
@given(model_cases(), st.integers(0, 2**31))
def test_law_matches_the_oracle_tuple_by_tuple(case, pick):
    """Up to 24 draft tuples of each case, against the plain-Python oracle."""
    draft_model, target_model, num_drafts, draft_len = case
    enum = enumerate_drafts(draft_model, target_model, num_drafts, draft_len)
    rows = torch.randperm(enum.weights.shape[0], generator=torch.Generator().manual_seed(pick))[:24]
    tokens, draft_probs, target_probs = enum.draft_tokens[rows], enum.draft_probs[rows], enum.target_probs[rows]
    law = load_verifier("multi-block").output_probs(tokens, draft_probs, target_probs)
    for b in range(tokens.shape[0]):
        slow = multi_block_law(*_rows(tokens, draft_probs, target_probs, b))
        # float64 both, the priority sweeps summed in another order: the largest gap found so far is 1.33e-12
        # (an entry of 0.86 on a concentration-0.3 case), so 1e-11 leaves room for rounding and none for a slip
        _assert_same_law(_string_law(law, tokens, b), slow, atol=1e-11)


@settings(max_examples=15, deadline=None)
@given(model_cases())
def test_one_draft_is_block_verification(case):
    draft_model, target_model, _, draft_len = case
    enum = enumerate_drafts(draft_model, target_model, 1, draft_len)
    args = (enum.draft_tokens, enum.draft_probs, enum.target_probs)
    torch.testing.assert_close(load_verifier("multi-block").output_probs(*args),
                               load_verifier("block").output_probs(*args), atol=1e-13, rtol=0)


@pytest.mark.parametrize("num_drafts,draft_len,num_tokens", [(2, 2, 4), (3, 2, 3), (2, 3, 4)])
def test_exact_over_several_iterations(num_drafts, draft_len, num_tokens):
    """The whole decoding loop (plain target every iteration) on a Markov pair."""
    draft_model, target_model = random_markov(2, 1, seed=3), random_markov(2, 1, seed=4, concentration=0.5)
    audit = exact_multi_iteration(load_verifier("multi-block"), draft_model, target_model, num_drafts, draft_len,
                                  num_tokens)
    assert audit.tv_distance <= 1e-12
    assert audit.prefix_cap_excess <= 1e-12


def test_any_number_of_priority_sweeps_is_exact():
    """Every iterate of the priority coins' fixed point is valid: one sweep gives another, still exact, rule."""
    draft_model, target_model = random_markov(4, 1, seed=11), random_markov(4, 1, seed=12)
    full, one = MultiDraftBlockVerification(), MultiDraftBlockVerification()
    one.priority_sweeps = 1
    enum = enumerate_drafts(draft_model, target_model, 2, 2)
    args = (enum.draft_tokens, enum.draft_probs, enum.target_probs)
    assert (full.output_probs(*args) - one.output_probs(*args)).abs().max() > 1e-3  # a different rule
    audit = exact_iteration(one, draft_model, target_model, 2, 2)
    assert audit.max_abs_error <= 1e-12 and audit.prefix_cap_excess <= 1e-12


# ---------------------------------------------------------------------------------------------
# At least the SpecTr tree's efficiency
# ---------------------------------------------------------------------------------------------

DOMINANCE_CASES = [
    # (kind, vocab_size, draft seed, target seed, concentration, num_drafts, draft_len)
    ("markov", 2, 370621597, 590011580, 0.3, 2, 3),  # taking the larger node allocation at every node lost here
    ("markov", 3, 5, 6, 1.0, 2, 2),
    ("markov", 2, 17, 18, 0.3, 3, 3),
    ("context-free", 3, 23, 24, 0.3, 3, 2),
    ("context-free", 2, 29, 30, 3.0, 3, 3),
    ("context-free", 4, 31, 32, 1.0, 2, 2),
]


@pytest.mark.parametrize("kind,vocab_size,draft_seed,target_seed,concentration,num_drafts,draft_len", DOMINANCE_CASES)
def test_at_least_the_spectr_tree(kind, vocab_size, draft_seed, target_seed, concentration, num_drafts, draft_len):
    if kind == "markov":
        draft_model, target_model = (random_markov(vocab_size, 1, concentration=concentration, seed=s)
                                     for s in (draft_seed, target_seed))
    else:
        draft_model, target_model = (
            ContextFreeModel(np.random.default_rng(s).dirichlet(np.full(vocab_size, concentration)))
            for s in (draft_seed, target_seed))
    mine = exact_iteration(load_verifier("multi-block"), draft_model, target_model, num_drafts, draft_len)
    tree = exact_iteration(load_verifier("spectr-tree"), draft_model, target_model, num_drafts, draft_len)
    assert mine.block_efficiency >= tree.block_efficiency - 1e-12


# ---------------------------------------------------------------------------------------------
# The sampler against its own law
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("num_drafts,draft_len", [(2, 2), (3, 2), (2, 3)])
def test_sampled_verdicts_follow_output_probs(num_drafts, draft_len):
    """Pearson chi-square of sampled verdict cells (draft_index, num_accepted, next_token) for fixed tuples.

    Two draft tuples per shape, each a test at false-alarm rate 1e-3 with a fixed seed (cells with
    expected count < 5 pooled): a correct sampler fails with probability about 2e-3 per shape.
    """
    verifier = load_verifier("multi-block")
    vocab_size, reps = 3, 20_000
    draft_model = random_markov(vocab_size, 1, seed=5, concentration=0.8)
    target_model = random_markov(vocab_size, 1, seed=6, concentration=0.8)
    gen = torch.Generator().manual_seed(2024)
    batch = draft(draft_model, target_model, torch.full((2, 1), -1, dtype=torch.int64), num_drafts, draft_len, gen)
    law = verifier.output_probs(batch.draft_tokens, batch.draft_probs, batch.target_probs)
    for b in range(2):
        rep = lambda t: t[b : b + 1].expand(reps, *t.shape[1:]).contiguous()  # noqa: E731
        out = verifier.verify(rep(batch.draft_tokens), rep(batch.draft_probs), rep(batch.target_probs), gen)
        cells = (out.draft_index * (draft_len + 1) + out.num_accepted) * vocab_size + out.next_token
        counts = torch.bincount(cells, minlength=law[b].numel()).double()
        assert pooled_chisquare_pvalue(counts, law[b].reshape(-1) * reps) > 1e-3, b


# Sharp models whose drafts reach depth 1 with probability 1 up to rounding (E_0 rounds to 1): every
# tuple's law, however improbable the tuple, must still be a law (found by the exact-audit fuzz).
SHARP_CASES = [
    # (vocab size, K, L, temperature, concentration, seed)
    (3, 4, 1, 0.05, 0.05, 1),
    (3, 3, 2, 0.05, 0.05, 1),
    (4, 2, 2, 0.05, 0.05, 3),
]


@pytest.mark.parametrize("vocab_size,num_drafts,draft_len,temperature,concentration,seed", SHARP_CASES)
def test_every_row_is_a_law_on_sharp_models(vocab_size, num_drafts, draft_len, temperature, concentration, seed):
    verifier = load_verifier("multi-block")
    model_d = random_markov(vocab_size, 1, seed=seed, concentration=concentration, temperature=temperature)
    model_t = random_markov(vocab_size, 1, seed=seed + 1, concentration=concentration, temperature=temperature)
    audit = exact_iteration(verifier, model_d, model_t, num_drafts, draft_len)
    assert audit.max_abs_error <= 1e-12, audit.worst_strings()
    tuples = enumerate_drafts(model_d, model_t, num_drafts, draft_len)
    law = verifier.output_probs(tuples.draft_tokens, tuples.draft_probs, tuples.target_probs)
    assert bool((law >= 0).all())
    torch.testing.assert_close(law.sum((1, 2, 3)), torch.ones(law.shape[0], dtype=law.dtype), atol=1e-12, rtol=0)


def test_float32_rows_give_the_float64_law():
    """The sampler renormalises its rows in float64 as the law does: same verdicts for the same uniforms."""
    verifier = load_verifier("multi-block")
    model_d, model_t = random_markov(3, 1, seed=7), random_markov(3, 1, seed=8)
    batch = draft(model_d, model_t, torch.full((64, 1), -1, dtype=torch.int64), 3, 2, torch.Generator().manual_seed(1))
    outs = [verifier.verify(batch.draft_tokens, probs_d, probs_t, torch.Generator().manual_seed(9))
            for probs_d, probs_t in [(batch.draft_probs, batch.target_probs),
                                     (batch.draft_probs.double(), batch.target_probs.double())]]
    agree = (outs[0].num_accepted == outs[1].num_accepted) & (outs[0].next_token == outs[1].next_token)
    assert agree.double().mean() > 0.95  # float32 rounding moves only verdicts next to a boundary


def test_bad_input_is_refused_with_the_argument_named():
    verifier = load_verifier("multi-block")
    tokens = torch.zeros(1, 2, 2, dtype=torch.int64)
    probs = torch.full((1, 2, 2, 3), 1 / 3, dtype=torch.float64)
    with pytest.raises(InvalidArgument, match="target_probs"):
        verifier.verify(tokens, probs, probs, None)  # the target needs draft_len + 1 rows


# ---------------------------------------------------------------------------------------------
# The simple construction of scripts/multi_block_table.py
# ---------------------------------------------------------------------------------------------


def _table_script():
    path = pathlib.Path(__file__).resolve().parents[2] / "scripts" / "multi_block_table.py"
    spec = importlib.util.spec_from_file_location("multi_block_table", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _simple_efficiency(draft_model, target_model, num_drafts, draft_len) -> float:
    """The simple construction's block efficiency from the oracle, summed over every draft tuple."""
    enum = enumerate_drafts(draft_model, target_model, num_drafts, draft_len)
    total = 0.0
    for b in range(enum.weights.shape[0]):
        law = simple_construction_law(*_rows(enum.draft_tokens, enum.draft_probs, enum.target_probs, b))
        total += float(enum.weights[b]) * sum(len(s) * v for s, v in law.items())
    return total


@pytest.mark.parametrize("models,num_drafts,draft_len", [
    (PAPER, 2, 2), (PAPER, 3, 2), ((random_markov(3, 1, seed=13), random_markov(3, 1, seed=14)), 2, 2),
])
def test_simple_construction_of_the_table_matches_its_oracle(models, num_drafts, draft_len):
    simple = _table_script().SimpleConstruction()
    enum = enumerate_drafts(*models, num_drafts, draft_len)
    law = simple.output_probs(enum.draft_tokens, enum.draft_probs, enum.target_probs)
    for b in range(enum.weights.shape[0]):
        slow = simple_construction_law(*_rows(enum.draft_tokens, enum.draft_probs, enum.target_probs, b))
        _assert_same_law(_string_law(law, enum.draft_tokens, b), slow, atol=1e-12)
    audit = exact_iteration(simple, *models, num_drafts, draft_len)
    assert audit.max_abs_error <= 1e-12


def test_table_rows_on_the_paper_example():
    module = _table_script()
    row = module.table_rows([dict(name="paper", draft=PAPER[0], target=PAPER[1], num_drafts=2, draft_len=2)])[0]
    assert row["multi-block"] == pytest.approx(float(PAPER_EFFICIENCY), abs=1e-12)
    assert row["block"] == pytest.approx(20 / 9, abs=1e-12)
    assert row["ratio"] == pytest.approx(1.0, abs=1e-6)
    assert row["spectr-tree"] < row["simple"] < row["multi-block"]


def test_the_law_has_no_negative_entry_where_the_choices_at_a_depth_sum_to_one():
    # K = 4 near-uniform drafts of L = 2 over two tokens: every depth's choices sum to 1 up to a rounding
    # above it, which once left P(nothing deeper) = -5.6e-19 and a negative entry in the law
    from spectr_audit.drafting.models import random_markov
    from spectr_audit.registry import load_verifier

    verifier = load_verifier("multi-block")
    draft_model = random_markov(2, 1, seed=3, concentration=3.0, temperature=5.0)
    target_model = random_markov(2, 1, seed=4, concentration=3.0, temperature=5.0)
    batch = draft(draft_model, target_model, torch.full((1, 1), -1, dtype=torch.int64), 4, 2,
                  torch.Generator().manual_seed(3), verifier.draft_scheme)
    law = verifier.output_probs(batch.draft_tokens, batch.draft_probs, batch.target_probs)
    assert bool((law >= 0).all()), law.min()
    assert abs(float(law.sum()) - 1.0) < 1e-12
