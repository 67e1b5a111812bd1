"""The tree bounds: closed forms against the LPs, hand-derived values, the built-in tree verifiers never
above the bound, and where they meet it."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from hypothesis import assume, given, settings, strategies as st

from spectr_audit.bounds.acceptance import optimal_acceptance_lp_from_sets
from spectr_audit.bounds.block_lp import block_lp
from spectr_audit.bounds.tree_lp import (
    tree_bound,
    tree_lp,
    tree_optimal_acceptance,
    tree_paths_target_mass,
)
from spectr_audit.contract.tree import DraftTree
from spectr_audit.drafting.models import ContextFreeModel, random_markov
from spectr_audit.exact.tree import exact_tree, tree_enumeration_size
from spectr_audit.registry import tree_verifiers
from spectr_audit.verifiers.tree import TreeRecursiveRejection, TreeRecursiveRejectionWithoutReplacement, TreeTargetOnly

from tests.exact.test_tree import PathFnModel
from tests.verifiers.test_tree_rules import tree_cases

pytestmark = pytest.mark.usefixtures("single_thread")

#: The LP optimum is as accurate as the solver (CLARABEL at tightened tolerances).
LP_TOL = 1e-6


def _distributions(draw, vocab_size: int, min_support: int = 1):
    rng = np.random.default_rng(draw(st.integers(0, 2**31 - 1)))
    rows = []
    for _ in range(2):
        values = rng.dirichlet(np.full(vocab_size, 0.8))
        zeros = rng.permutation(vocab_size)[: rng.integers(0, vocab_size - min_support + 1)]
        values[zeros] = 0.0
        rows.append((values / values.sum()).tolist())
    return rows


def _small_case(data, scheme: str):
    """A drawn tree of up to 5 nodes and its draft and target models, with a tree LP of at most 20,000 variables."""
    tree, vocab_size, draft_fn, target_fn = data.draw(tree_cases(scheme, max_nodes=5))
    assume(tree_enumeration_size(tree, scheme, vocab_size) * tree.num_nodes * vocab_size <= 20_000)
    return tree, PathFnModel(draft_fn, vocab_size), PathFnModel(target_fn, vocab_size)


@settings(max_examples=25, deadline=None)
@given(data=st.data())
def test_without_replacement_min_cut_is_the_transport_lp(data):
    vocab_size = data.draw(st.integers(2, 5))
    num_children = data.draw(st.integers(1, vocab_size))
    draft, target = _distributions(data.draw, vocab_size, min_support=num_children)
    value, _ = tree_optimal_acceptance(ContextFreeModel(draft), ContextFreeModel(target),
                                       DraftTree.chains(num_children, 1), "without_replacement")
    # the slow way: the law of the drawn set by ordered tuples, then the LP over it
    sets: dict = {}
    for tup in itertools.permutations(range(vocab_size), num_children):
        prob, left = 1.0, list(draft)
        for x in tup:
            total = sum(left)
            prob *= left[x] / total if total > 0 else 0.0
            left[x] = 0.0
        if prob > 0:
            sets[frozenset(tup)] = sets.get(frozenset(tup), 0.0) + prob
    assert value == pytest.approx(optimal_acceptance_lp_from_sets(sets, target).value, abs=LP_TOL)


@pytest.mark.parametrize("scheme", ["iid", "without_replacement", "topk"])
@settings(max_examples=12, deadline=None)
@given(data=st.data())
def test_closed_forms_agree_with_the_lp(scheme, data):
    """Depth 1: the best accepted length is alpha*; top-k: sum of q(path); alpha* = the set LP's value."""
    tree, draft, target = _small_case(data, scheme)
    lp = tree_lp(draft, target, tree, scheme)
    assert lp.status == "optimal" and lp.repair_status == "optimal"
    bound = tree_bound(draft, target, tree, scheme, lp=False)
    assert bound.acceptance == pytest.approx(lp.acceptance, abs=LP_TOL)
    if tree.max_depth == 1 or scheme == "topk":
        assert bound.accepted_length == pytest.approx(lp.accepted_length, abs=LP_TOL)
    # the repair-allowed relaxation is never below the lossless optimum
    assert lp.repair_accepted_length >= lp.accepted_length - LP_TOL


# alpha* and the best accepted length, by hand (docs/audit/bounds.md):
# * two i.i.d. siblings, p = (.6, .4), q = (.3, .7): alpha* = 0.3 + 1 - 0.6^2 = 0.94, depth 1;
# * two siblings without replacement from p = (.5, .3, .2), q = (.2, .2, .6): 31/35;
# * top-k tree [(0,), (1,), (0, 0)], p = (.5, .3, .2), q = (.2, .3, .5): q(0) + q(1) = 0.5 and
#   0.2 + 0.3 + 0.2 * 0.2 = 0.54;
# * one chain of two tokens, p = (2/3, 1/3), q = (1/3, 2/3) (the block-verification paper): the
#   best lossless E[accepted] is block verification's E[tau] = 11/9 (token by token: 10/9).
HAND = [
    (DraftTree.chains(2, 1), "iid", [0.6, 0.4], [0.3, 0.7], 0.94, 0.94),
    (DraftTree.chains(2, 1), "without_replacement", [0.5, 0.3, 0.2], [0.2, 0.2, 0.6], 31 / 35, 31 / 35),
    (DraftTree.from_paths([(0,), (1,), (0, 0)]), "topk", [0.5, 0.3, 0.2], [0.2, 0.3, 0.5], 0.5, 0.54),
    (DraftTree.chains(1, 2), "iid", [2 / 3, 1 / 3], [1 / 3, 2 / 3], 2 / 3, 11 / 9),
]


@pytest.mark.parametrize("tree, scheme, draft, target, acceptance, accepted_length", HAND)
def test_hand_derived_bounds(tree, scheme, draft, target, acceptance, accepted_length):
    bound = tree_bound(ContextFreeModel(draft), ContextFreeModel(target), tree, scheme)
    assert bound.acceptance == pytest.approx(acceptance, abs=1e-9)
    assert bound.accepted_length == pytest.approx(accepted_length, abs=LP_TOL)


@pytest.mark.parametrize("scheme", ["iid", "without_replacement", "topk", "none"])
@settings(max_examples=12, deadline=None)
@given(data=st.data())
def test_built_in_tree_verifiers_never_exceed_the_bound(scheme, data):
    tree, draft, target = _small_case(data, scheme)
    bound = tree_bound(draft, target, tree, scheme)
    assert bound.accepted_length is not None, bound.accepted_length_source
    for verifier in tree_verifiers():
        if scheme not in verifier.draft_schemes:
            continue
        result = exact_tree(verifier, draft, target, tree, draft_scheme=scheme)
        assert result.acceptance <= bound.acceptance + 1e-9, verifier.name
        assert result.accepted_length <= bound.accepted_length + LP_TOL, verifier.name
        if verifier.name == "tree-target-only" and scheme in ("topk", "none"):
            # deterministic drafts: target-only verification reaches both bounds
            assert result.acceptance == pytest.approx(bound.acceptance, abs=1e-12)
            assert result.accepted_length == pytest.approx(bound.accepted_length, abs=1e-12)


@pytest.mark.parametrize("verifier, scheme, tree", [
    (TreeRecursiveRejection(), "iid", DraftTree.chains(1, 1)),  # speculative sampling: 1 - TV
    (TreeRecursiveRejectionWithoutReplacement(), "without_replacement", DraftTree.chains(4, 1)),  # every token: 1
    (TreeTargetOnly(), "topk", DraftTree.topk_depth(2, 2)),
])
def test_where_the_built_ins_meet_the_bound(verifier, scheme, tree):
    draft, target = random_markov(4, seed=5), random_markov(4, seed=6)
    bound = tree_bound(draft, target, tree, scheme)
    result = exact_tree(verifier, draft, target, tree, draft_scheme=scheme)
    assert result.acceptance == pytest.approx(bound.acceptance, abs=1e-9)
    assert result.accepted_length == pytest.approx(bound.accepted_length, abs=1e-9)


def test_rrs_on_a_deep_chain_is_below_the_lp():
    """Token-by-token RRS on one chain of 2 is short of the lossless optimum (block verification's)."""
    draft, target = ContextFreeModel([2 / 3, 1 / 3]), ContextFreeModel([1 / 3, 2 / 3])
    bound = tree_bound(draft, target, DraftTree.chains(1, 2), "iid")
    result = exact_tree(TreeRecursiveRejection(), draft, target, DraftTree.chains(1, 2))
    assert result.accepted_length == pytest.approx(10 / 9, abs=1e-12)  # E[tau] of the paper, token by token
    assert result.accepted_length < bound.accepted_length - 0.1


def test_tree_paths_target_mass_by_hand_under_a_markov_target():
    # order-1 Markov tables over V = 2 (row V = 2 is "before the start")
    from spectr_audit.drafting.models import MarkovModel

    draft = MarkovModel([[0.9, 0.1], [0.2, 0.8], [0.7, 0.3]], 1)
    target = MarkovModel([[0.6, 0.4], [0.5, 0.5], [0.1, 0.9]], 1)
    tree = DraftTree.from_paths([(0,), (0, 0)])  # top-1 chain: token 0 (start row), then 0 (row 0)
    assert tree_paths_target_mass(draft, target, tree) == pytest.approx(0.1 + 0.1 * 0.6, abs=1e-15)


def test_bounds_beyond_reach_say_why():
    draft, target = random_markov(4, seed=1), random_markov(4, seed=2)
    bound = tree_bound(draft, target, DraftTree.topk_depth(3, 2), "iid")
    assert bound.accepted_length is None and bound.accepted_length_source.startswith("skipped:")
    assert 0 < bound.acceptance <= 1


@pytest.mark.parametrize("num_drafts, draft_len, vocab_size", [(1, 2, 2), (2, 2, 2), (1, 3, 2), (2, 1, 3)])
def test_the_block_lp_is_the_tree_lp_on_chain_trees(num_drafts, draft_len, vocab_size):
    """One LP over the realisations of the drafts: the block LP of K chains of L tokens is the tree LP of
    DraftTree.chains(K, L), to the last bit (the same candidates, weights and constraints)."""
    draft, target = random_markov(vocab_size, seed=11), random_markov(vocab_size, seed=12)
    block = block_lp(draft, target, num_drafts, draft_len)
    tree = tree_lp(draft, target, DraftTree.chains(num_drafts, draft_len))
    assert block.num_draft_tuples == tree.num_realisations
    assert block.unmodified_value - 1.0 == tree.accepted_length
    assert block.repair_value - 1.0 == tree.repair_accepted_length
