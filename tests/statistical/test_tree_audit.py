"""The statistical audit on sampled draft trees (black-box tree verifiers).

Statistical tests here use fixed seeds; each exact verifier passes with probability at least
1 - alpha (alpha = 1e-3, the audit's familywise false-alarm rate), and each lossy one is far
beyond the planned minimum detectable TV.
"""

from __future__ import annotations

import pytest
import torch

from spectr_audit.contract.tree import DraftTree
from spectr_audit.contract.tree_verifier import FunctionTreeVerifier, TreeVerifyOutput
from spectr_audit.drafting.models import ContextFreeModel, random_markov
from spectr_audit.errors import InvalidArgument
from spectr_audit.exact.tree import exact_tree
from spectr_audit.registry import load_tree_verifier
from spectr_audit.statistical.audit import statistical_tree_audit
from spectr_audit.statistical.sampling import sample_tree_chunk, tree_emitted_strings

pytestmark = pytest.mark.usefixtures("single_thread")

MC_SIM_8 = DraftTree.from_paths([[0], [0, 0], [1], [0, 1], [2], [0, 0, 0], [1, 0], [0, 2]])


def _black_box(name: str) -> FunctionTreeVerifier:
    """A built-in tree verifier's sampler alone: what an engine's verifier gives the audit."""
    verifier = load_tree_verifier(name)
    return FunctionTreeVerifier(verifier.verify_tree, name=f"{name}-black-box", draft_schemes=verifier.draft_schemes)


@pytest.mark.parametrize("name, scheme", [("tree-rrs", "iid"), ("tree-rrs-wor", "without_replacement"),
                                          ("tree-target-only", "topk"), ("tree-spectr", "iid")])
def test_exact_black_boxes_pass_and_measure_the_exact_acceptance(name, scheme):
    draft, target = random_markov(3, seed=1), random_markov(3, seed=2)
    result = statistical_tree_audit(_black_box(name), draft, target, MC_SIM_8, draft_scheme=scheme,
                                    num_samples=40_000, seed=7)
    assert not result.rejects(), result.pvalue
    exact = exact_tree(load_tree_verifier(name), draft, target, MC_SIM_8, draft_scheme=scheme)
    low, high = result.acceptance_ci()
    assert low - 1e-9 <= exact.acceptance <= high + 1e-9
    # mean emitted length within 5 standard errors of the exact one
    var = result.length_sq_sum / result.num_samples - result.block_efficiency**2
    assert abs(result.block_efficiency - exact.block_efficiency) <= 5 * (var / result.num_samples) ** 0.5
    assert result.optimal_acceptance is not None


def _first_child(tree, node_tokens, draft_probs, target_probs, generator):
    """Lossy: the root's first child always accepted, the bonus drawn from its target row."""
    rows = target_probs[:, 1].double()
    u = torch.rand(rows.shape[0], 1, generator=generator, dtype=torch.float64)
    token = (rows.cumsum(-1) < u * rows.sum(-1, keepdim=True)).sum(-1).clamp(max=rows.shape[-1] - 1)
    return TreeVerifyOutput(torch.ones(node_tokens.shape[0], dtype=torch.int64), token)


def test_a_lossy_black_box_is_rejected_and_beats_alpha_star():
    lossy = FunctionTreeVerifier(_first_child, draft_schemes=("topk",))
    result = statistical_tree_audit(lossy, ContextFreeModel([0.5, 0.3, 0.2]), ContextFreeModel([0.2, 0.3, 0.5]),
                                    DraftTree.from_paths([(0,), (1,), (0, 0)]), num_samples=20_000, seed=3)
    assert result.rejects()
    assert result.acceptance == 1.0 and result.optimal_acceptance == pytest.approx(0.5)
    names = {t.name: t for t in result.subtests}
    # under top-k drafts the accepted length is bounded in closed form: 1 + 0.54
    assert result.block_efficiency_bound == pytest.approx(1.54)
    assert names["acceptance<=optimal"].pvalue_adjusted <= 1e-3


def test_emitted_strings_follow_the_accepted_path():
    tree = DraftTree.from_paths([(0,), (1,), (0, 0), (0, 1)])
    node_tokens = torch.tensor([[0, 2, 1, 0, 1]] * 3)
    out = TreeVerifyOutput(torch.tensor([0, 2, 4]), torch.tensor([1, 0, 2]))
    strings, lengths = tree_emitted_strings(tree, node_tokens, out, 3)
    assert strings.tolist() == [[1, -1, -1], [1, 0, -1], [2, 1, 2]]
    assert lengths.tolist() == [1, 2, 3]


def test_sampled_chunk_counts_membership_at_the_root():
    tree = DraftTree.chains(2, 1)
    chunk = sample_tree_chunk(load_tree_verifier("tree-rrs"), tree, "iid", ContextFreeModel([0.6, 0.4]),
                              ContextFreeModel([0.3, 0.7]), 2, 50_000, torch.Generator().manual_seed(0))
    assert chunk.strings.shape == (50_000, 2) and bool((chunk.strings >= 0).all())
    # exact: 0.82 (tests/exact/test_tree.py); the binomial standard error is below 0.002
    assert abs(float(chunk.membership.double().mean()) - 0.82) < 0.01


@pytest.mark.parametrize("call, message", [
    (lambda: statistical_tree_audit(load_tree_verifier("tree-rrs"), ContextFreeModel([0.5, 0.5]),
                                    ContextFreeModel([0.5, 0.5]), DraftTree.chains(2, 1), num_tokens=4),
     "a tree audit samples one step"),
    (lambda: statistical_tree_audit(load_tree_verifier("tree-rrs"), ContextFreeModel([0.5, 0.5]),
                                    ContextFreeModel([0.5, 0.5]), DraftTree.chains(2, 1), draft_scheme="topk"),
     "draft-scheme mismatch"),
    (lambda: statistical_tree_audit(load_tree_verifier("tree-rrs"), ContextFreeModel([0.5, 0.5]),
                                    ContextFreeModel([0.5, 0.5]), [(0,)]), "tree: expected a DraftTree"),
])
def test_bad_tree_arguments_are_named(call, message):
    with pytest.raises(InvalidArgument, match=message):
        call()
