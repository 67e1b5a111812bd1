"""Draft trees and the tree-verifier contract: builders, validation, adapters between chains and trees."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from spectr_audit.contract.chain_trees import (
    ChainVerifierAsTree,
    TreeVerifierAsChain,
    chain_law_as_tree,
    chain_node_index,
    chain_output_as_tree,
    chains_as_tree_inputs,
    tree_inputs_as_chains,
    tree_law_as_chain,
    tree_output_as_chain,
)
from spectr_audit.contract.tree import DraftTree, draft_scheme_violation, topk_order
from spectr_audit.contract.tree_verifier import (
    FunctionTreeVerifier,
    TreeVerifier,
    TreeVerifyOutput,
    check_tree_inputs,
)
from spectr_audit.contract.convert import as_tree_verifier
from spectr_audit.contract.verifier import VerifyOutput
from spectr_audit.errors import InvalidArgument, SpectrAuditError, VerifierError
from spectr_audit.registry import load_verifier
from spectr_audit.verifiers.tree import TreeRecursiveRejection, TreeRecursiveRejectionWithoutReplacement, TreeTargetOnly


@dataclasses.dataclass(frozen=True)
class BuilderCase:
    """A builder call and the parents (and ranks) it must give, worked out by hand."""

    name: str
    build: object  # () -> DraftTree
    parents: tuple
    ranks: tuple = None
    leaves: tuple = None


BUILDER_CASES = [
    # nodes: 1 = (0,), 2 = (1,), 3 = (0, 0), 4 = (0, 1), 5 = (1, 0), 6 = (0, 0, 0)
    BuilderCase("paths", lambda: DraftTree.from_paths([(0,), (1,), (0, 0), (0, 1), (1, 0), (0, 0, 0)]),
                (-1, 0, 0, 1, 1, 2, 3), (-1, 0, 1, 0, 1, 0, 0), (4, 5, 6)),
    # any input order: sorted by (len, path) -> (0,), (1,), (0, 0), (1, 0)
    BuilderCase("unsorted paths", lambda: DraftTree.from_paths([(1, 0), (0,), (0, 0), (1,)]), (-1, 0, 0, 1, 2)),
    # lists as EAGLE writes them: (0,), (1,), (2,), (0, 0), (0, 1), (1, 0), (0, 0, 0)
    BuilderCase("EAGLE-style lists", lambda: DraftTree.from_paths([[0], [1], [2], [0, 0], [0, 1], [1, 0], [0, 0, 0]]),
                (-1, 0, 0, 0, 1, 1, 2, 4), (-1, 0, 1, 2, 0, 1, 0, 0), (3, 5, 6, 7)),
    # Medusa's lists interleave depths; the same tree as above
    BuilderCase("Medusa-style order", lambda: DraftTree.from_paths([(0,), (0, 0), (1,), (0, 1), (2,), (0, 0, 0), (1, 0)]),
                (-1, 0, 0, 0, 1, 1, 2, 4)),
    # a gap in the ranks: the root's children are its top-1 and top-3 tokens
    BuilderCase("rank gaps", lambda: DraftTree.from_paths([(0,), (2,), (2, 1)]), (-1, 0, 0, 2), (-1, 0, 2, 1), (1, 3)),
    # node (d - 1) K + k + 1 is token d of draft k
    BuilderCase("chains 3x2", lambda: DraftTree.chains(3, 2), (-1, 0, 0, 0, 1, 2, 3), (-1, 0, 1, 2, 0, 0, 0), (4, 5, 6)),
    BuilderCase("chains 1x3", lambda: DraftTree.chains(1, 3), (-1, 0, 1, 2), (-1, 0, 0, 0), (3,)),
    # Medusa cartesian, heads' top-k (2, 1): (0,), (1,), (0, 0), (1, 0)
    BuilderCase("cartesian [2, 1]", lambda: DraftTree.cartesian([2, 1]), (-1, 0, 0, 1, 2), (-1, 0, 1, 0, 0)),
    BuilderCase("cartesian [1, 2]", lambda: DraftTree.cartesian([1, 2]), (-1, 0, 1, 1), (-1, 0, 0, 1)),
    BuilderCase("cartesian [3]", lambda: DraftTree.cartesian([3]), (-1, 0, 0, 0)),
    BuilderCase("topk 2 x depth 2", lambda: DraftTree.topk_depth(2, 2), (-1, 0, 0, 1, 1, 2, 2), (-1, 0, 1, 0, 1, 0, 1)),
    # 2 + 4 + 8 nodes; depth 3's eight nodes hang two by two under nodes 3 .. 6
    BuilderCase("topk 2 x depth 3", lambda: DraftTree.topk_depth(2, 3),
                (-1, 0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6)),
    # depth-first: root; a (1); a's children (2, 3); b (4) -> breadth-first root, a, b, a's children
    BuilderCase("depth-first parents", lambda: DraftTree.from_parents([-1, 0, 1, 1, 0]), (-1, 0, 0, 1, 1)),
    BuilderCase("direct", lambda: DraftTree([-1, 0, 0, 1]), (-1, 0, 0, 1), (-1, 0, 1, 0), (2, 3)),
]


@pytest.mark.parametrize("case", BUILDER_CASES, ids=lambda c: c.name)
def test_builders_give_the_documented_parents(case):
    tree = case.build()
    assert tree.parents == case.parents
    if case.ranks is not None:
        assert tree.ranks == case.ranks
    if case.leaves is not None:
        assert tree.leaves == case.leaves
    # the path list round-trips, and every node's path is its parent's plus its rank
    assert DraftTree.from_paths(tree.to_paths()) == tree
    for n in range(1, tree.num_nodes):
        assert tree.paths[n] == tree.paths[tree.parents[n]] + (tree.ranks[n],)
        assert tree.depths[n] == len(tree.paths[n]) == len(tree.path_nodes(n))
        assert n in tree.children[tree.parents[n]]


def test_topology_accessors():
    tree = DraftTree.from_paths([(0,), (1,), (0, 0), (0, 1), (1, 0), (0, 0, 0)])
    assert tree.num_nodes == 7 and tree.num_draft_nodes == 6 and tree.max_depth == 3
    assert tree.level_starts == (0, 1, 3, 6, 7)
    assert list(tree.level(2)) == [3, 4, 5]
    assert tree.children == ((1, 2), (3, 4), (5,), (6,), (), (), ())
    assert tree.internal_nodes == (0, 1, 2, 3) and tree.max_children == 2
    assert tree.path_nodes(6) == (1, 3, 6) and tree.path_nodes(0) == ()
    assert tree.path_index().tolist()[6] == [1, 3, 6] and tree.path_index().tolist()[2] == [2, -1, -1]
    assert tree.as_chains() is None
    assert DraftTree.chains(2, 3).as_chains() == (2, 3)
    assert DraftTree.from_paths([(0,), (1,), (0, 0), (1, 0)]).as_chains() == (2, 2)
    assert "6 draft nodes, depth 3, per level [2, 3, 1]" in tree.describe()
    assert eval(repr(tree), {"DraftTree": DraftTree}) == tree
    assert hash(tree) == hash(DraftTree(tree.parents, tree.ranks))


def test_canonical_order_reorders_per_node_tensors():
    depth_first = [-1, 0, 1, 2, 1, 0, 5]  # root, a, a0, a00, a1, b, b0
    order = DraftTree.canonical_order(depth_first)
    tree = DraftTree.from_parents(depth_first)
    assert order == [0, 1, 5, 2, 4, 6, 3]
    assert tree.parents == (-1, 0, 0, 1, 1, 2, 3)
    # the reordered parents are the old parents renamed
    position = {old: new for new, old in enumerate(order)}
    assert all(tree.parents[position[n]] == position[depth_first[n]] for n in range(1, 7))


def test_topk_order_breaks_ties_by_smallest_id():
    assert topk_order(torch.tensor([0.25, 0.25, 0.5, 0.0])).tolist() == [2, 0, 1, 3]
    assert topk_order(torch.tensor([[0.1, 0.9], [0.5, 0.5]])).tolist() == [[1, 0], [0, 1]]


@dataclasses.dataclass(frozen=True)
class BadTree:
    name: str
    build: object
    message: str


BAD_TREES = [
    BadTree("root parent not -1", lambda: DraftTree([0, 0]), "node 0 is the root and must have parent -1"),
    BadTree("no draft node", lambda: DraftTree([-1]), "at least one draft node"),
    BadTree("parent not earlier", lambda: DraftTree([-1, 1]), "every draft node's parent must be an earlier node"),
    BadTree("not breadth-first", lambda: DraftTree([-1, 0, 1, 0]), "breadth-first canonical order"),
    BadTree("ranks not increasing", lambda: DraftTree([-1, 0, 0], ranks=[-1, 1, 1]), "strictly increasing ranks"),
    BadTree("ranks wrong length", lambda: DraftTree([-1, 0], ranks=[-1]), "ranks: expected 2 entries"),
    BadTree("negative rank", lambda: DraftTree([-1, 0], ranks=[-1, -2]), "ranks must be >= 0"),
    BadTree("float parent", lambda: DraftTree([-1, 0.5]), "parents[1]: expected an integer"),
    BadTree("parents a string", lambda: DraftTree("-1,0"), "parents: expected a sequence of integers"),
    BadTree("no paths", lambda: DraftTree.from_paths([]), "paths: expected at least one path"),
    BadTree("duplicate path", lambda: DraftTree.from_paths([(0,), (0,)]), "path (0,) appears more than once"),
    BadTree("missing prefix", lambda: DraftTree.from_paths([(0,), (1, 0)]), "needs its prefix (1,)"),
    BadTree("empty path", lambda: DraftTree.from_paths([(), (0,)]), "the empty path is the root"),
    BadTree("negative rank in a path", lambda: DraftTree.from_paths([(0,), (0, -1)]), "sibling ranks must be >= 0"),
    BadTree("paths a string", lambda: DraftTree.from_paths("0,1"), "paths: expected a list of index tuples"),
    BadTree("path an int", lambda: DraftTree.from_paths([0, 1]), "paths[0]: expected a tuple of sibling ranks"),
    BadTree("zero chains", lambda: DraftTree.chains(0, 2), "num_drafts, draft_len: must be >= 1"),
    BadTree("empty cartesian", lambda: DraftTree.cartesian([]), "topk_per_head: expected a non-empty list"),
    BadTree("cartesian zero head", lambda: DraftTree.cartesian([2, 0]), "topk_per_head: expected a non-empty list"),
    BadTree("topk depth zero", lambda: DraftTree.topk_depth(2, 0), "topk, depth: must be >= 1"),
    BadTree("shared rank", lambda: DraftTree.from_parents([-1, 0, 0], ranks=[-1, 1, 1]), "share rank 1"),
    BadTree("path_nodes out of range", lambda: DraftTree.chains(1, 1).path_nodes(2), "node: expected a node in [0, 2)"),
]


@pytest.mark.parametrize("case", BAD_TREES, ids=lambda c: c.name)
def test_bad_trees_raise_invalid_argument(case):
    with pytest.raises(InvalidArgument) as info:
        case.build()
    assert case.message in str(info.value)
    assert isinstance(info.value, ValueError) and isinstance(info.value, SpectrAuditError)


TREE = DraftTree.from_paths([(0,), (1,), (0, 0)])  # nodes 1, 2 under the root; node 3 under node 1


def _good(batch_size=2, vocab_size=3):
    node_tokens = torch.tensor([[0, 0, 1, 2], [0, 1, 2, 0]])
    draft_probs = torch.full((batch_size, 4, vocab_size), 1.0 / vocab_size)
    target_probs = torch.full((batch_size, 4, vocab_size), 1.0 / vocab_size)
    return [TREE, node_tokens, draft_probs, target_probs]


def _with(index, value=None, fn=None):
    args = _good()
    args[index] = value if fn is None else fn(args[index])
    return args


def _set(tensor, idx, value):
    tensor = tensor.clone()
    tensor[idx] = value
    return tensor


@dataclasses.dataclass(frozen=True)
class BadInput:
    name: str
    args: list
    message: str
    verifier: object = TreeRecursiveRejection


BAD_INPUTS = [
    BadInput("tree not a DraftTree", _with(0, [-1, 0, 0, 1]), "tree: expected a DraftTree"),
    BadInput("tokens not a tensor", _with(1, [[0, 0, 1, 2]]), "node_tokens: expected a torch.Tensor"),
    BadInput("tokens int32", _with(1, fn=lambda t: t.int()), "node_tokens: expected dtype torch.int64"),
    BadInput("tokens wrong node count", _with(1, fn=lambda t: t[:, :3]), "node_tokens: expected shape [batch_size, 4]"),
    BadInput("target 2-D", _with(3, fn=lambda t: t[:, 0]), "target_probs: expected shape [batch_size, 4, vocab_size]"),
    BadInput("target wrong nodes", _with(3, torch.full((2, 3, 3), 1 / 3)), "target_probs: expected shape (2, 4, 3)"),
    BadInput("draft other V", _with(2, torch.full((2, 4, 4), 1 / 4)), "draft_probs: expected shape (2, 4, 3)"),
    BadInput("draft a list", _with(2, [[0.5, 0.5]]), "draft_probs: expected a torch.Tensor or None"),
    BadInput("draft int", _with(2, fn=lambda t: t.long()), "draft_probs: expected a floating-point tensor"),
    BadInput("draft None for a rule that reads it", _with(2, None), "draft_probs: 'tree-rrs' needs draft probabilities"),
    BadInput("NaN target", _with(3, fn=lambda t: _set(t, (0, 3, 1), float("nan"))), "target_probs: probabilities must be finite"),
    BadInput("target leaf row off the simplex", _with(3, fn=lambda t: _set(t, (1, 2), 0.0)),
             "target_probs: each distribution must sum to 1"),
    BadInput("negative draft at a node with children", _with(2, fn=lambda t: _set(t, (0, 1, 0), -0.1)),
             "draft_probs: probabilities must be non-negative"),
    BadInput("draft row of a node with children sums to 1.5", _with(2, fn=lambda t: _set(t, (1, 0, 0), 1 / 3 + 0.5)),
             "draft_probs: each distribution must sum to 1"),
    BadInput("token id = V", _with(1, fn=lambda t: _set(t, (0, 2), 3)), "node_tokens: token ids must lie in [0, 3)"),
    BadInput("token id negative", _with(1, fn=lambda t: _set(t, (1, 3), -1)), "found -1 at node 3 of batch row 1"),
    BadInput("drafted token with zero draft probability",
             _with(2, fn=lambda t: _set(t, (1, 0, 1), 0.0) / _set(t, (1, 0, 1), 0.0).sum(-1, keepdim=True)),
             "node 1 of batch row 1 carries token 1, which has zero draft probability"),
    BadInput("repeated siblings without replacement", _with(1, fn=lambda t: _set(t, (0, 2), 0)),
             "sibling nodes 1 and 2 of batch row 0 both carry token 0", TreeRecursiveRejectionWithoutReplacement),
]


@pytest.mark.parametrize("case", BAD_INPUTS, ids=lambda c: c.name)
def test_bad_inputs_raise_invalid_argument_naming_the_problem(case):
    verifier = case.verifier()
    with pytest.raises(InvalidArgument) as info:
        verifier.verify_tree(*case.args, torch.Generator().manual_seed(0))
    assert case.message in str(info.value)
    if verifier.has_tree_law:
        with pytest.raises(InvalidArgument):
            verifier.tree_output_probs(*case.args)


def test_inputs_the_contract_accepts():
    tree, node_tokens, draft_probs, target_probs = _good()
    leafless = draft_probs.clone()
    leafless[:, list(tree.leaves)] = 0.0  # rows of leaves are never read
    assert check_tree_inputs(tree, node_tokens, leafless, target_probs, ("iid",)) == (2, 3)
    # target-only takes no draft probabilities and repeated siblings
    repeated = _set(node_tokens, (0, 2), 0)
    out = TreeTargetOnly().verify_tree(tree, repeated, None, target_probs, torch.Generator().manual_seed(0))
    assert out.accepted_node.shape == (2,)
    # an empty batch
    assert check_tree_inputs(tree, node_tokens[:0], draft_probs[:0], target_probs[:0], ("iid",)) == (0, 3)


def test_draft_scheme_violations():
    tree = DraftTree.from_paths([(0,), (1,), (0, 0)])
    draft_probs = torch.tensor([[[0.5, 0.3, 0.2], [0.2, 0.2, 0.6], [0.0] * 3, [0.0] * 3]])
    topk_tokens = torch.tensor([[0, 0, 1, 2]])  # ranks 0, 1 at the root: 0, 1; rank 0 under node 1: 2
    assert draft_scheme_violation(tree, topk_tokens, draft_probs, "topk") is None
    assert draft_scheme_violation(tree, topk_tokens, draft_probs, "iid") is None
    assert "not 1, the token of that rank" in draft_scheme_violation(tree, torch.tensor([[0, 0, 2, 2]]), draft_probs, "topk")
    assert "siblings are distinct" in draft_scheme_violation(tree, torch.tensor([[0, 1, 1, 2]]), None, "topk")
    assert draft_scheme_violation(tree, torch.tensor([[0, 1, 1, 2]]), draft_probs, "iid") is None
    assert "needs draft_probs" in draft_scheme_violation(tree, topk_tokens, None, "iid")
    assert draft_scheme_violation(tree, torch.tensor([[0, 1, 1, 1]]), None, "none") is None
    gaps = DraftTree.from_paths([(0,), (3,)])
    assert "beyond the vocabulary" in draft_scheme_violation(gaps, torch.tensor([[0, 0, 1]]), draft_probs[:, :3], "topk")
    with pytest.raises(InvalidArgument, match="scheme: expected one of"):
        draft_scheme_violation(tree, topk_tokens, draft_probs, "greedy")
    # a verifier whose only scheme is top-k refuses drafts that are not the top-k tokens
    only_topk = FunctionTreeVerifier(lambda *a: (torch.zeros(1, dtype=torch.int64),) * 2, draft_schemes=("topk",))
    with pytest.raises(InvalidArgument, match="cannot come from any draft scheme"):
        only_topk.verify_tree(tree, torch.tensor([[0, 0, 2, 2]]), draft_probs, torch.full((1, 4, 3), 1 / 3))


def _returning(value):
    return FunctionTreeVerifier(lambda tree, tokens, draft, target, gen: value, name="third-party")


BAD_OUTPUTS = [
    ("not a pair", _returning("nope"), "must return TreeVerifyOutput or (accepted_node, next_token)"),
    ("int32 node", _returning((torch.zeros(2, dtype=torch.int32), torch.zeros(2, dtype=torch.int64))),
     "accepted_node must have dtype torch.int64"),
    ("node out of range", _returning((torch.tensor([0, 4]), torch.zeros(2, dtype=torch.int64))),
     "accepted_node[1] = 4 is outside [0, 3]"),
    ("token out of range", _returning(TreeVerifyOutput(torch.zeros(2, dtype=torch.int64), torch.tensor([3, 0]))),
     "next_token[0] = 3 is outside [0, 2]"),
    ("wrong batch", _returning((torch.zeros(3, dtype=torch.int64), torch.zeros(3, dtype=torch.int64))),
     "accepted_node must have shape [2]"),
    ("raises", FunctionTreeVerifier(lambda *a: 1 / 0, name="third-party"), "verify_tree raised ZeroDivisionError"),
]


@pytest.mark.parametrize("name,verifier,message", BAD_OUTPUTS, ids=[c[0] for c in BAD_OUTPUTS])
def test_bad_outputs_raise_verifier_error(name, verifier, message):
    with pytest.raises(VerifierError) as info:
        verifier.verify_tree(*_good(), torch.Generator().manual_seed(0))
    assert message in str(info.value)


def test_bad_laws_raise_verifier_error():
    def law_of(value):
        return FunctionTreeVerifier(lambda *a: None, tree_output_probs=lambda *a: value, name="third-party")

    tree, node_tokens, draft_probs, target_probs = _good()
    cases = [
        (torch.zeros(2, 4, 2, dtype=torch.float64), "must have shape (2, 4, 3)"),
        (torch.full((2, 4, 3), float("nan")), "contains NaN or Inf"),
        (torch.full((2, 4, 3), -0.1), "negative probabilities"),
        (torch.full((2, 4, 3), 0.5), "row 0 sums to 6"),
        (torch.zeros(2, 4, 3, dtype=torch.int64), "must return a floating-point torch.Tensor"),
    ]
    for value, message in cases:
        with pytest.raises(VerifierError, match=None) as info:
            law_of(value).tree_output_probs(tree, node_tokens, draft_probs, target_probs)
        assert message in str(info.value)
    with pytest.raises(NotImplementedError):
        FunctionTreeVerifier(lambda *a: None).tree_output_probs(tree, node_tokens, draft_probs, target_probs)


def test_as_tree_verifier_wraps_each_kind():
    assert isinstance(as_tree_verifier(TreeTargetOnly), TreeTargetOnly)
    named = as_tree_verifier(TreeTargetOnly(), name="renamed")
    assert named.name == "renamed"
    chain = as_tree_verifier(load_verifier("rrs"))
    assert isinstance(chain, ChainVerifierAsTree) and chain.draft_schemes == ("iid",) and chain.has_tree_law

    class ThirdParty:
        name = "engine"
        draft_schemes = ("topk",)

        def verify_tree(self, tree, node_tokens, draft_probs, target_probs, generator):
            return torch.zeros(node_tokens.shape[0], dtype=torch.int64), target_probs[:, 0].argmax(-1)

        def supports_tree(self, tree):
            return tree.max_depth <= 2

    wrapped = as_tree_verifier(ThirdParty())
    assert wrapped.name == "engine" and wrapped.draft_schemes == ("topk",) and not wrapped.has_tree_law
    assert wrapped.supports_tree(TREE) and not wrapped.supports_tree(DraftTree.chains(1, 3))
    assert isinstance(as_tree_verifier(lambda *a: None), FunctionTreeVerifier)
    with pytest.raises(InvalidArgument, match="expected a TreeVerifier, a Verifier"):
        as_tree_verifier(42)
    with pytest.raises(InvalidArgument, match="draft_schemes: expected a non-empty tuple"):
        FunctionTreeVerifier(lambda *a: None, draft_schemes=("greedy",))


def test_chain_verifier_as_tree_supports_only_its_chain_trees():
    kseq = ChainVerifierAsTree(load_verifier("kseq"))  # L = 1 only
    assert kseq.supports_tree(DraftTree.chains(3, 1))
    assert not kseq.supports_tree(DraftTree.chains(3, 2)) and not kseq.supports_tree(TREE)
    with pytest.raises(InvalidArgument, match="tree: verifier 'kseq' does not support"):
        kseq.verify_tree(*_good(), torch.Generator().manual_seed(0))


def test_tree_verifier_as_chain_picks_the_chain_scheme():
    assert TreeVerifierAsChain(TreeRecursiveRejection()).draft_scheme == "iid"
    wor = TreeVerifierAsChain(TreeRecursiveRejectionWithoutReplacement())
    assert wor.draft_scheme == "without_replacement" and wor.supports(3, 1) and not wor.supports(3, 2)
    assert TreeVerifierAsChain(TreeTargetOnly()).has_exact_law
    only_topk = FunctionTreeVerifier(lambda *a: None, draft_schemes=("topk",))
    with pytest.raises(InvalidArgument, match="the chain contract drafts 'iid' or 'without_replacement'"):
        TreeVerifierAsChain(only_topk)


def test_chain_and_tree_inputs_round_trip():
    gen = torch.Generator().manual_seed(0)
    batch_size, num_drafts, draft_len, vocab_size = 3, 2, 3, 5
    draft_tokens = torch.randint(0, vocab_size, (batch_size, num_drafts, draft_len), generator=gen)
    draft_probs = torch.rand(batch_size, num_drafts, draft_len, vocab_size, generator=gen, dtype=torch.float64)
    target_probs = torch.rand(batch_size, num_drafts, draft_len + 1, vocab_size, generator=gen, dtype=torch.float64)
    draft_probs[:, 1, 0] = draft_probs[:, 0, 0]  # drafts share the root
    target_probs[:, 1, 0] = target_probs[:, 0, 0]
    inputs = chains_as_tree_inputs(draft_tokens, draft_probs, target_probs)
    assert inputs.tree == DraftTree.chains(num_drafts, draft_len)
    # node (d - 1) K + k + 1 is token d of draft k; its target row is the chain's row d
    assert int(inputs.node_tokens[1, 2 * num_drafts + 1 + 1]) == int(draft_tokens[1, 1, 2])
    assert torch.equal(inputs.target_probs[2, 1 * num_drafts + 0 + 1], target_probs[2, 0, 2])
    assert torch.equal(inputs.draft_probs[0, 1 * num_drafts + 1 + 1], draft_probs[0, 1, 2])
    assert bool((inputs.draft_probs[:, list(inputs.tree.leaves)] == 0).all())
    back = tree_inputs_as_chains(inputs.tree, inputs.node_tokens, inputs.draft_probs, inputs.target_probs)
    for original, returned in zip((draft_tokens, draft_probs, target_probs), back):
        assert torch.equal(original, returned)
    index = chain_node_index(num_drafts, draft_len)
    assert index.tolist() == [[0, 1, 3, 5], [0, 2, 4, 6]]
    with pytest.raises(InvalidArgument, match="expected a chain tree"):
        tree_inputs_as_chains(TREE, *_good()[1:])


def test_chain_and_tree_laws_and_outputs_round_trip():
    num_drafts, draft_len, vocab_size = 3, 2, 4
    law = torch.rand(2, num_drafts, draft_len + 1, vocab_size, dtype=torch.float64)
    law[:, 1:, 0] = 0.0  # canonical: nothing accepted is reported under draft 0
    law = law / law.sum((1, 2, 3), keepdim=True)
    tree_law = chain_law_as_tree(law, num_drafts, draft_len)
    assert tree_law.shape == (2, 1 + num_drafts * draft_len, vocab_size)
    assert torch.allclose(tree_law.sum((1, 2)), torch.ones(2, dtype=torch.float64))
    assert torch.equal(tree_law_as_chain(tree_law, num_drafts, draft_len), law)
    chain_out = VerifyOutput(torch.tensor([0, 1, 2, 2]), torch.tensor([0, 2, 1, 0]), torch.tensor([3, 2, 1, 0]))
    tree_out = chain_output_as_tree(chain_out, num_drafts, draft_len)
    assert tree_out.accepted_node.tolist() == [0, 3, 5, 4]
    back = tree_output_as_chain(tree_out, num_drafts, draft_len)
    assert back.num_accepted.tolist() == [0, 1, 2, 2] and back.draft_index.tolist() == [0, 2, 1, 0]
    tree = DraftTree.chains(num_drafts, draft_len)
    assert tree_out.num_accepted(tree).tolist() == [0, 1, 2, 2]
    tokens = torch.arange(7).unsqueeze(0).expand(4, 7)
    assert tree_out.emitted(tree, tokens)[2] == [2, 5, 1]


def test_a_tree_verifier_subclass_needs_only_verify_tree():
    class StopAtRoot(TreeVerifier):
        name = "stop-at-root"
        draft_schemes = ("none",)

        def _verify_tree(self, tree, node_tokens, draft_probs, target_probs, generator):
            return TreeVerifyOutput(torch.zeros(node_tokens.shape[0], dtype=torch.int64), target_probs[:, 0].argmax(-1))

    verifier = StopAtRoot()
    assert not verifier.has_tree_law and not verifier.needs_draft_probs
    out = verifier.verify_tree(TREE, _good()[1], None, _good()[3])
    assert out.accepted_node.tolist() == [0, 0]
