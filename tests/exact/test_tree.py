"""The exact tree audit: the enumeration of a tree's draft realisations against the plain-Python oracle,
the emitted-string law against the oracle's, losslessness of the built-in tree verifiers, lossy verifiers
caught, the chain audit reproduced on chain trees (a chain verifier's chunks in the chain contract's form against
the same chunks through the tree form), hand-derived values, and the refusals."""

from __future__ import annotations

import pytest
import torch
from hypothesis import assume, given, settings, strategies as st

from spectr_audit.contract.tree import DraftTree
from spectr_audit.contract.tree_verifier import FunctionTreeVerifier
from spectr_audit.drafting.models import ContextFreeModel, Model, random_markov
from spectr_audit.errors import InvalidArgument
from spectr_audit.contract.chain_trees import ChainVerifierAsTree, tree_inputs_as_chains
from spectr_audit.contract.verifier import FunctionVerifier
from spectr_audit.defaults import EXACT_CHUNK
from spectr_audit.exact.iteration import enumerate_drafts, exact_iteration
from spectr_audit.exact.tree import (
    MAX_TREE_REALISATIONS,
    MAX_TREE_STRINGS,
    branches,
    emitted_laws,
    enumerate_tree_drafts,
    exact_tree,
    tree_enumeration_size,
)
from spectr_audit.registry import load_tree_verifier, load_verifier
from spectr_audit.verifiers.tree import TreeRecursiveRejection, TreeTargetOnly

from tests.oracles.tree_rules import TREE_RULES, implied_law, path_tokens, realisations, string_law, tree_law
from tests.verifiers.test_tree_rules import PAIRS, VERIFIERS, tree_cases

pytestmark = pytest.mark.usefixtures("single_thread")


class PathFnModel(Model):
    """A :class:`Model` reading its law from a function of the token path (the oracles' models)."""

    def __init__(self, path_fn, vocab_size: int):
        self.path_fn, self.vocab_size = path_fn, vocab_size

    def __call__(self, contexts: torch.Tensor) -> torch.Tensor:
        rows = [self.path_fn(tuple(t for t in row if t >= 0)) for row in contexts.tolist()]
        return torch.tensor(rows, dtype=torch.float64).reshape(len(rows), self.vocab_size)


def _oracle_emitted(name, tree, scheme, draft_fn, target_fn, vocab_size) -> dict:
    """{string: probability} of one step, summed over the oracle's realisations with the oracle's walk."""
    rows = realisations(list(tree.parents), list(tree.ranks), scheme, draft_fn, vocab_size)
    emitted: dict = {}
    for tokens, weight in rows:
        draft_rows = [draft_fn(path_tokens(tree.parents, tokens, n)) if tree.children[n] else [0.0] * vocab_size
                      for n in range(tree.num_nodes)]
        target_rows = [target_fn(path_tokens(tree.parents, tokens, n)) for n in range(tree.num_nodes)]
        if scheme == "none":
            draft_rows = target_rows
        for (node, y), mass in tree_law(TREE_RULES[name], list(tree.parents), list(tokens), draft_rows,
                                        target_rows).items():
            s = path_tokens(tree.parents, tokens, node) + (y,)
            emitted[s] = emitted.get(s, 0.0) + weight * mass
    return emitted


def _library_emitted(result) -> dict:
    out = {}
    for m, law in enumerate(result.emitted_law):
        for code in (law > 0).nonzero().flatten().tolist():
            s, c = [], code
            for _ in range(m + 1):
                s.append(c % result.vocab_size)
                c //= result.vocab_size
            out[tuple(reversed(s))] = float(law[code])
    return out


@pytest.mark.parametrize("scheme", ["iid", "without_replacement", "topk", "none"])
@settings(max_examples=40, deadline=None)
@given(data=st.data())
def test_enumeration_matches_the_oracle(scheme, data):
    tree, vocab_size, draft_fn, target_fn = data.draw(tree_cases(scheme, max_nodes=6))
    assume(tree_enumeration_size(tree, scheme, vocab_size) <= 20_000)
    enum = enumerate_tree_drafts(PathFnModel(draft_fn, vocab_size), PathFnModel(target_fn, vocab_size), tree, scheme)
    expected = dict(realisations(list(tree.parents), list(tree.ranks), scheme, draft_fn, vocab_size))
    got = {tuple(t): w for t, w in zip(enum.node_tokens.tolist(), enum.weights.tolist())}
    assert set(got) == set(expected) and len(got) == enum.num_realisations
    # in the documented order: lexicographic in the root's first branch's tokens, then the second's, ...
    order = [node for branch in branches(tree) for node in branch]
    keys = [tuple(row[n] for n in order) for row in enum.node_tokens.tolist()]
    assert keys == sorted(keys)
    for key, weight in expected.items():
        assert got[key] == pytest.approx(weight, abs=1e-12)
    assert float(enum.weights.sum()) == pytest.approx(1.0, abs=1e-12)
    # the conditionals the verifier is given: the models' laws after each node's path
    tokens, draft, target = enum.chunk(slice(0, 3))
    for row in range(tokens.shape[0]):
        for n in range(tree.num_nodes):
            path = path_tokens(tree.parents, tokens[row].tolist(), n)
            assert target[row, n].tolist() == pytest.approx(target_fn(path), abs=1e-15)
            if draft is not None:
                want = draft_fn(path) if tree.children[n] else [0.0] * vocab_size
                assert draft[row, n].tolist() == pytest.approx(want, abs=1e-15)


@pytest.mark.parametrize("name,scheme", PAIRS, ids=lambda x: x)
@settings(max_examples=25, deadline=None)
@given(data=st.data())
def test_emitted_law_matches_the_oracle_and_the_target(name, scheme, data):
    tree, vocab_size, draft_fn, target_fn = data.draw(tree_cases(scheme, max_nodes=6))
    assume(tree_enumeration_size(tree, scheme, vocab_size) <= 4096)
    result = exact_tree(VERIFIERS[name](), PathFnModel(draft_fn, vocab_size), PathFnModel(target_fn, vocab_size), tree,
                        draft_scheme=scheme)
    expected = _oracle_emitted(name, tree, scheme, draft_fn, target_fn, vocab_size)
    got = _library_emitted(result)
    for s in set(expected) | set(got):
        assert got.get(s, 0.0) == pytest.approx(expected.get(s, 0.0), abs=1e-12), s
    # the oracle's implied law is the target's: the built-ins are lossless, and the audit says so
    implied = implied_law(expected, target_fn, tree.max_depth + 1)
    target = string_law(target_fn, tree.max_depth + 1)
    gap = max(abs(implied.get(w, 0.0) - target.get(w, 0.0)) for w in set(implied) | set(target))
    assert gap <= 1e-12 and result.max_abs_error <= 1e-12 and result.prefix_cap_excess <= 1e-12
    lengths = [sum(v for s, v in expected.items() if len(s) == m + 1) for m in range(tree.max_depth + 1)]
    assert result.accepted_length == pytest.approx(sum(m * v for m, v in enumerate(lengths)), abs=1e-12)


@pytest.mark.parametrize("name", ["tree-rrs", "tree-rrs-wor", "tree-target-only", "tree-spectr"])
def test_markov_models_on_an_engine_shaped_tree(name):
    """The first 8 paths of the Medusa repository's 63-path mc_sim_7b_63 (not in the medusa-llm 0.1 wheel; eagle-llm's
    mc_sim_7b_63 is another, 25-path tree) under an order-1 Markov pair."""
    tree = DraftTree.from_paths([[0], [0, 0], [1], [0, 1], [2], [0, 0, 0], [1, 0], [0, 2]])
    verifier = load_tree_verifier(name)
    for scheme in verifier.draft_schemes:
        result = exact_tree(verifier, random_markov(3, seed=1), random_markov(3, seed=2), tree, draft_scheme=scheme)
        assert result.max_abs_error <= 1e-12 and result.prefix_cap_excess <= 1e-12, scheme
        assert sum(result.accepted_length_law) == pytest.approx(1.0, abs=1e-12)
        assert 0 <= result.accepted_length <= tree.max_depth


def _first_child_law(tree, node_tokens, draft_probs, target_probs):
    """A lossy rule: the root's first child always accepted, then the target's law at it."""
    law = torch.zeros_like(target_probs, dtype=torch.float64)
    law[:, 1] = target_probs[:, 1].double()
    return law


def _first_child(tree, node_tokens, draft_probs, target_probs, generator):
    return torch.ones(node_tokens.shape[0], dtype=torch.int64), target_probs[:, 1].argmax(-1)


def test_a_lossy_tree_verifier_is_caught():
    lossy = FunctionTreeVerifier(_first_child, tree_output_probs=_first_child_law, draft_schemes=("topk",))
    draft, target = ContextFreeModel([0.5, 0.3, 0.2]), ContextFreeModel([0.2, 0.3, 0.5])
    result = exact_tree(lossy, draft, target, DraftTree.from_paths([(0,), (1,)]))
    # token 0 is emitted first with probability 1 instead of q(0) = 0.2
    assert result.token_tv_distance == pytest.approx(0.8, abs=1e-12)
    assert result.prefix_cap_excess == pytest.approx(0.8, abs=1e-12) and result.worst_prefix == (0,)


@settings(max_examples=60, deadline=None)
@given(num_drafts=st.integers(1, 3), draft_len=st.integers(1, 3), vocab_size=st.integers(2, 4),
       seed=st.integers(0, 2**16), scheme=st.sampled_from(["iid", "without_replacement"]))
def test_chain_trees_enumerate_the_chain_contracts_draft_tuples_bit_for_bit(num_drafts, draft_len, vocab_size, seed,
                                                                            scheme):
    """On DraftTree.chains(K, L) the realisations are the chain contract's draft tuples, in their order, with the
    same floating-point weights (the products of the drafts' sequence probabilities)."""
    if scheme == "without_replacement":
        draft_len, num_drafts = 1, min(num_drafts, vocab_size)
    assume(vocab_size ** (draft_len * num_drafts) <= 5_000)
    draft, target = random_markov(vocab_size, seed=seed), random_markov(vocab_size, seed=seed + 1)
    chains = enumerate_drafts(draft, target, num_drafts, draft_len, scheme)
    tree = DraftTree.chains(num_drafts, draft_len)
    enum = enumerate_tree_drafts(draft, target, tree, scheme)
    tokens, draft_probs, target_probs = tree_inputs_as_chains(tree, *enum.chunk(slice(None)))
    assert torch.equal(tokens, chains.draft_tokens)
    assert torch.equal(enum.weights, chains.weights)
    assert torch.equal(draft_probs, chains.draft_probs) and torch.equal(target_probs, chains.target_probs)
    # the chain form of a chunk, gathered straight from the tables, is the tree form's rows seen as chains
    direct = enum.chain_chunk(slice(None))
    assert all(torch.equal(a, b) for a, b in zip(direct, (tokens, draft_probs, target_probs)))


def _split_root(verifier):
    """``verifier``'s law with part of each row's "nothing accepted" mass moved from draft 0 to the last draft: a
    law off the canonical draft index, where summing the drafts' root mass before or after weighting would differ."""
    def law(draft_tokens, draft_probs, target_probs):
        out = verifier.output_probs(draft_tokens, draft_probs, target_probs).clone()
        moved = out[:, 0, 0] * 0.375
        out[:, 0, 0] -= moved
        out[:, -1, 0] += moved
        return out

    return FunctionVerifier(verifier.verify, name=f"{verifier.name} (root split)", output_probs=law,
                            draft_scheme=verifier.draft_scheme)


@settings(max_examples=40, deadline=None)
@given(name=st.sampled_from(["kseq", "rrs", "rrs-wor", "spectr-tree", "block", "speculative"]),
       num_drafts=st.integers(1, 3), draft_len=st.integers(1, 2), vocab_size=st.integers(2, 4),
       seed=st.integers(0, 2**16), chunk_size=st.sampled_from([1, 7, 64, 8192]), split=st.booleans())
def test_a_chain_verifiers_chunks_in_the_chain_form_give_the_tree_forms_bits(name, num_drafts, draft_len, vocab_size,
                                                                             seed, chunk_size, split):
    """The exact audit hands a chain verifier its chunks in the chain contract's form and sums its chain law; the
    same chunks through the tree form (ChainVerifierAsTree, the tree law on the chain tree) give the same emitted
    laws and membership to the last bit, canonical law or not."""
    verifier = load_verifier(name)
    if verifier.draft_scheme == "without_replacement":
        draft_len, num_drafts = 1, min(num_drafts, vocab_size)
    assume(verifier.supports(num_drafts, draft_len))
    assume(vocab_size ** (draft_len * num_drafts) <= 5_000)
    if split:
        verifier = _split_root(verifier)
    draft, target = random_markov(vocab_size, seed=seed), random_markov(vocab_size, seed=seed + 1)
    enum = enumerate_tree_drafts(draft, target, DraftTree.chains(num_drafts, draft_len), verifier.draft_scheme)
    chain_emitted, chain_membership = emitted_laws(verifier, enum, chunk_size)
    tree_emitted, tree_membership = emitted_laws(ChainVerifierAsTree(verifier), enum, chunk_size)
    assert chain_membership == tree_membership
    assert all(torch.equal(a, b) for a, b in zip(chain_emitted, tree_emitted))


@pytest.mark.parametrize("num_drafts, draft_len, chain_name", [(2, 1, "kseq"), (3, 1, "rrs"), (2, 2, "spectr-tree"),
                                                               (2, 2, "rrs"), (2, 1, "rrs-wor")])
def test_the_chain_face_is_the_tree_audit_on_chain_trees(num_drafts, draft_len, chain_name):
    draft, target = random_markov(3, seed=3), random_markov(3, seed=4)
    chain = exact_iteration(load_verifier(chain_name), draft, target, num_drafts, draft_len)
    tree = exact_tree(load_tree_verifier(chain_name), draft, target, DraftTree.chains(num_drafts, draft_len),
                      chunk_size=EXACT_CHUNK)
    assert tree.num_realisations == chain.num_draft_tuples
    for field in ("acceptance", "block_efficiency", "tv_distance", "max_abs_error", "prefix_cap_excess",
                  "token_tv_distance"):
        assert getattr(tree, field) == getattr(chain, field), field
    assert all(torch.equal(a, b) for a, b in zip(tree.emitted_law, chain.emitted_law))


# Hand-derived values.  RRS on two i.i.d. siblings, p = (.6, .4), q = (.3, .7): the first child is
# kept with min(1, q/p) = (.5, 1); after a rejected 0 the residual is (0, 1), so a second child 1
# is kept: 0.4 + 0.6 * 0.5 + 0.6 * 0.5 * 0.4 = 0.82.  Target-only on the top-k tree
# [(0,), (1,), (0, 0)] with p = (.5, .3, .2), q = (.2, .3, .5): tokens 0, 1 and 0 -> 0, so
# acceptance q(0) + q(1) = 0.5 and accepted length 0.2 + 0.3 + 0.2 * 0.2 = 0.54.
HAND = [
    (TreeRecursiveRejection, "iid", DraftTree.chains(2, 1), [0.6, 0.4], [0.3, 0.7], 0.82, 0.82),
    (TreeTargetOnly, "topk", DraftTree.from_paths([(0,), (1,), (0, 0)]), [0.5, 0.3, 0.2], [0.2, 0.3, 0.5], 0.5, 0.54),
    (TreeTargetOnly, "none", DraftTree.from_paths([(0,), (1,), (0, 0)]), [0.5, 0.3, 0.2], [0.2, 0.3, 0.5], 0.5, 0.54),
    # ranks with a gap: the top-1 and top-3 tokens (0 and 2), q(0) + q(2) = 0.7
    (TreeTargetOnly, "topk", DraftTree.from_paths([(0,), (2,)]), [0.5, 0.3, 0.2], [0.2, 0.3, 0.5], 0.7, 0.7),
]


@pytest.mark.parametrize("cls, scheme, tree, draft, target, acceptance, accepted_length", HAND)
def test_hand_derived_values(cls, scheme, tree, draft, target, acceptance, accepted_length):
    result = exact_tree(cls(), ContextFreeModel(draft), ContextFreeModel(target), tree, draft_scheme=scheme)
    assert result.acceptance == pytest.approx(acceptance, abs=1e-12)
    assert result.accepted_length == pytest.approx(accepted_length, abs=1e-12)
    assert result.block_efficiency == pytest.approx(accepted_length + 1, abs=1e-12)


def test_refusals_name_the_size_and_the_limit():
    draft, target = random_markov(4, seed=1), random_markov(4, seed=2)
    big = DraftTree.topk_depth(3, 3)
    assert tree_enumeration_size(big, "iid", 4) > MAX_TREE_REALISATIONS
    with pytest.raises(InvalidArgument, match=rf"realisations at node \d+ .*limit of {MAX_TREE_REALISATIONS}"):
        exact_tree(TreeRecursiveRejection(), draft, target, big)
    deep = DraftTree.chains(1, 11)
    assert 4**12 > MAX_TREE_STRINGS
    with pytest.raises(InvalidArgument, match=rf"number {4 ** 12}, above .*limit of {MAX_TREE_STRINGS}"):
        exact_tree(TreeTargetOnly(), draft, target, deep, draft_scheme="topk")
    # the same tree under top-k drafts is one realisation: in reach
    assert exact_tree(TreeTargetOnly(), draft, target, big, draft_scheme="topk").num_realisations == 1


@pytest.mark.parametrize("call, message", [
    (lambda: exact_tree(TreeRecursiveRejection(), ContextFreeModel([0.5, 0.5]), ContextFreeModel([0.5, 0.5]),
                        DraftTree.chains(2, 1), draft_scheme="topk"), "draft-scheme mismatch"),
    (lambda: exact_tree(FunctionTreeVerifier(_first_child), ContextFreeModel([0.5, 0.5]), ContextFreeModel([0.5, 0.5]),
                        DraftTree.chains(1, 1)), "no exact tree law"),
    (lambda: exact_tree(load_tree_verifier("kseq"), ContextFreeModel([0.5, 0.5]), ContextFreeModel([0.5, 0.5]),
                        DraftTree.from_paths([(0,), (0, 0)])), "does not support"),
    (lambda: enumerate_tree_drafts(ContextFreeModel([0.5, 0.5]), ContextFreeModel([0.5, 0.5]), DraftTree.chains(3, 1),
                                   "without_replacement"), "3 children, more than the 2 tokens"),
    (lambda: enumerate_tree_drafts(ContextFreeModel([0.5, 0.5]), ContextFreeModel([0.5, 0.5]),
                                   DraftTree.from_paths([(0,), (2,)]), "topk"), "rank 2, beyond the vocabulary"),
    (lambda: enumerate_tree_drafts(ContextFreeModel([0.5, 0.5]), ContextFreeModel([0.5, 0.5]), DraftTree.chains(1, 1),
                                   "greedy"), "draft_scheme: expected one of"),
])
def test_bad_input_is_refused(call, message):
    with pytest.raises(InvalidArgument, match=message):
        call()


@pytest.mark.parametrize("scheme", ["iid", "without_replacement"])
def test_the_rows_checked_once_still_name_a_bad_conditional(scheme):
    """The tree audit checks the rows its realisations read once, not every chunk's copies: a target conditional
    reached only below the root (summing to 1.2) must still be named, and so must a bad draft row."""
    from tests.exact.test_iteration import _OffSimplexAfterToken

    tree = DraftTree.from_paths([(0,), (1,), (0, 0)])
    verifier = load_tree_verifier("tree-rrs" if scheme == "iid" else "tree-rrs-wor")
    good, bad = ContextFreeModel([0.2, 0.5, 0.3]), _OffSimplexAfterToken([0.3, 0.3, 0.4])
    with pytest.raises(InvalidArgument, match="target_probs"):
        exact_tree(verifier, good, bad, tree, draft_scheme=scheme, chunk_size=2)
    with pytest.raises(InvalidArgument, match="draft_probs"):
        exact_tree(verifier, bad, good, tree, draft_scheme=scheme, chunk_size=2)
