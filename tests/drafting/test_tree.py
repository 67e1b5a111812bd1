"""The tree drafting harness: tokens per draft scheme, conditionals at every node, and its errors."""

from __future__ import annotations

import collections

import pytest
import torch
from scipy import stats

from spectr_audit.contract.tree import DraftTree, topk_order
from spectr_audit.drafting.models import ContextFreeModel, random_markov
from spectr_audit.drafting.tree import draft_tree, verify_tree_step
from spectr_audit.errors import InvalidArgument
from spectr_audit.verifiers.tree import TreeRecursiveRejectionWithoutReplacement, TreeTargetOnly

from tests.oracles.tree_rules import path_tokens, realisations

TREE = DraftTree.from_paths([(0,), (1,), (0, 0), (0, 1), (1, 0), (0, 0, 0)])


def _contexts(*rows):
    """Right-aligned contexts of different lengths (PAD = -1 on the left)."""
    width = max(len(r) for r in rows)
    return torch.tensor([[-1] * (width - len(r)) + list(r) for r in rows], dtype=torch.int64)


@pytest.mark.parametrize("scheme", ["iid", "without_replacement", "topk", "none"])
def test_rows_are_the_models_at_each_nodes_path(scheme):
    draft_model, target_model = random_markov(4, 2, seed=1), random_markov(4, 2, seed=2)
    contexts = _contexts([2], [0, 3, 1], [])
    batch = draft_tree(draft_model, target_model, contexts, TREE, torch.Generator().manual_seed(0), scheme)
    assert batch.node_tokens.shape == (3, TREE.num_nodes) and bool((batch.node_tokens[:, 0] == 0).all())
    for b, context in enumerate(([2], [0, 3, 1], [])):
        for n in range(TREE.num_nodes):
            path = list(path_tokens(TREE.parents, batch.node_tokens[b].tolist(), n))
            full = _contexts(context + path)
            torch.testing.assert_close(batch.target_probs[b, n], target_model(full)[0], atol=0, rtol=0)
            if batch.draft_probs is None:
                continue
            if TREE.children[n]:
                torch.testing.assert_close(batch.draft_probs[b, n], draft_model(full)[0], atol=0, rtol=0)
            else:
                assert bool((batch.draft_probs[b, n] == 0).all())  # leaf rows are not drafted from
        if scheme in ("topk", "none"):
            for n in TREE.internal_nodes:
                row = draft_model(_contexts(context + list(path_tokens(TREE.parents, batch.node_tokens[b].tolist(), n))))[0]
                order = topk_order(row).tolist()
                assert [int(batch.node_tokens[b, c]) for c in TREE.children[n]] == [order[TREE.ranks[c]] for c in TREE.children[n]]
    assert (batch.draft_probs is None) == (scheme == "none")
    assert batch.draft_scheme == scheme and batch.tree == TREE


@pytest.mark.parametrize("scheme", ["iid", "without_replacement"])
def test_drafted_trees_follow_the_scheme_law(scheme):
    """Pearson chi-square of drafted node-token tuples against the oracle's realisation weights.

    One test per scheme at false-alarm rate 1e-4, fixed seed, cells of expected count < 5 pooled.
    """
    tree = DraftTree.from_paths([(0,), (1,), (0, 0)])
    draft_model = random_markov(3, 1, seed=5, concentration=1.5)
    draft_fn = lambda path: draft_model(_contexts([1] + list(path)))[0].tolist()
    reps = 30_000
    batch = draft_tree(draft_model, ContextFreeModel([1 / 3] * 3), torch.ones(reps, 1, dtype=torch.int64), tree,
                       torch.Generator().manual_seed(3), scheme)
    counts = collections.Counter(map(tuple, batch.node_tokens.tolist()))
    law = realisations(list(tree.parents), list(tree.ranks), scheme, draft_fn, 3)
    assert set(counts) <= {r for r, _ in law}, "drafted a realisation of probability 0"
    expected = torch.tensor([w * reps for _, w in law], dtype=torch.float64)
    observed = torch.tensor([counts.get(r, 0) for r, _ in law], dtype=torch.float64)
    big = expected >= 5
    obs = torch.cat([observed[big], observed[~big].sum().unsqueeze(0)])
    exp = torch.cat([expected[big], expected[~big].sum().unsqueeze(0)])
    if exp[-1] == 0:
        obs, exp = obs[:-1], exp[:-1]
    assert stats.chisquare(obs.numpy(), exp.numpy() * obs.sum().item() / exp.sum().item()).pvalue > 1e-4


def test_without_replacement_siblings_are_distinct():
    tree = DraftTree.from_paths([(0,), (1,), (2,), (0, 0), (0, 1)])
    batch = draft_tree(random_markov(3, 1, seed=9), random_markov(3, 1, seed=10), torch.zeros(500, 1, dtype=torch.int64),
                       tree, torch.Generator().manual_seed(0), "without_replacement")
    roots = batch.node_tokens[:, 1:4].sort(-1).values
    assert bool((roots == torch.arange(3)).all())  # three distinct siblings of V = 3: every token once
    assert bool((batch.node_tokens[:, 4] != batch.node_tokens[:, 5]).all())


def test_verify_tree_step_drafts_with_the_verifiers_first_scheme():
    models = random_markov(4, 1, seed=3), random_markov(4, 1, seed=4)
    gen = torch.Generator().manual_seed(0)
    batch, out = verify_tree_step(TreeTargetOnly(), *models, torch.zeros(16, 1, dtype=torch.int64), TREE, gen)
    assert batch.draft_scheme == "topk" and out.accepted_node.shape == (16,)
    batch, out = verify_tree_step(TreeRecursiveRejectionWithoutReplacement(), *models,
                                  torch.zeros(16, 1, dtype=torch.int64), TREE, gen)
    assert batch.draft_scheme == "without_replacement"
    batch, _ = verify_tree_step(TreeTargetOnly(), *models, torch.zeros(4, 1, dtype=torch.int64), TREE, gen,
                                draft_scheme="none")
    assert batch.draft_probs is None


BAD_DRAFTS = [
    ("not a tree", dict(tree=[-1, 0]), "tree: expected a DraftTree"),
    ("bad scheme", dict(draft_scheme="greedy"), "draft_scheme: expected one of"),
    ("float contexts", dict(contexts=torch.zeros(2, 1)), "contexts: expected int64 [batch_size, context_len]"),
    ("vocab mismatch", dict(target_model=ContextFreeModel([0.5, 0.5])), "differs from draft_model's 3"),
    ("fan-out beyond V", dict(tree=DraftTree.chains(4, 1), draft_scheme="topk"), "more distinct tokens than the vocabulary"),
    ("rank beyond V", dict(tree=DraftTree.from_paths([(0,), (3,)]), draft_scheme="topk"), "rank 3, beyond the vocabulary"),
    ("support below fan-out", dict(draft_model=ContextFreeModel([0.5, 0.5, 0.0]), tree=DraftTree.chains(3, 1),
                                   draft_scheme="without_replacement"), "has only 2 tokens of positive probability"),
]


@pytest.mark.parametrize("name,overrides,message", BAD_DRAFTS, ids=[c[0] for c in BAD_DRAFTS])
def test_bad_draft_arguments(name, overrides, message):
    kwargs = dict(draft_model=ContextFreeModel([0.5, 0.3, 0.2]), target_model=ContextFreeModel([0.2, 0.3, 0.5]),
                  contexts=torch.zeros(2, 1, dtype=torch.int64), tree=DraftTree.chains(2, 1), draft_scheme="iid")
    kwargs.update(overrides)
    with pytest.raises(InvalidArgument) as info:
        draft_tree(**kwargs)
    assert message in str(info.value)
