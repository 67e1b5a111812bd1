"""Recursive rejection's CPU sampler drops rows settled by a certain acceptance: the verdicts must not move.

The chain walk (``rrs``, ``rrs-wor``) and the tree walk (``tree-rrs``, ``tree-rrs-wor``) are run with the
rule as shipped and with ``drop_settled_rows`` off, on the same uniforms; every verdict must be equal.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from spectr_audit.contract.randomness import sample_categorical
from spectr_audit.contract.tree import DraftTree
from spectr_audit.verifiers.recursive_rejection import (
    RecursiveRejection,
    RecursiveRejectionRule,
    RecursiveRejectionWithoutReplacement,
    RowsResidual,
)
from spectr_audit.verifiers.tree import (
    TreeRecursiveRejection,
    TreeRecursiveRejectionWithoutReplacement,
)


class _KeepEveryRow(RecursiveRejectionRule):
    drop_settled_rows = False


def _pair(cls):
    """The verifier as shipped and the same verifier whose rule keeps every row."""
    plain = cls()
    plain.rule = _KeepEveryRow(without_replacement=cls.rule.without_replacement)
    return cls(), plain


def _rows(batch_size, vocab_size, gen, dtype, sharpness):
    target = torch.softmax(sharpness * torch.randn(batch_size, vocab_size, generator=gen, dtype=torch.float64), -1)
    draft = torch.softmax(0.7 * target.log() + torch.randn(batch_size, vocab_size, generator=gen, dtype=torch.float64), -1)
    return draft.to(dtype), target.to(dtype)


def _distinct(draft_row, k, gen):
    return torch.multinomial(draft_row.double(), k, replacement=False, generator=gen)


@pytest.mark.parametrize("cls", [RecursiveRejection, RecursiveRejectionWithoutReplacement])
@settings(max_examples=40, deadline=None)
@given(num_drafts=st.integers(1, 5), draft_len=st.integers(1, 3), vocab_size=st.integers(5, 700),
       seed=st.integers(0, 2**16), dtype=st.sampled_from([torch.float32, torch.float64]),
       sharpness=st.sampled_from([0.5, 3.0]))
def test_chain_verdicts_do_not_depend_on_dropping_settled_rows(cls, num_drafts, draft_len, vocab_size, seed, dtype,
                                                              sharpness):
    shipped, plain = _pair(cls)
    draft_len = min(draft_len, cls.max_draft_len or draft_len)
    batch_size = 40
    gen = torch.Generator().manual_seed(seed)
    draft, target = _rows(batch_size * num_drafts * (draft_len + 1), vocab_size, gen, dtype, sharpness)
    draft = draft.reshape(batch_size, num_drafts, draft_len + 1, vocab_size)[:, :, :draft_len].contiguous()
    target = target.reshape(batch_size, num_drafts, draft_len + 1, vocab_size)
    if shipped.rule.without_replacement:
        draft = draft[:, :1].expand_as(draft).contiguous()
        target = target[:, :1].expand_as(target).contiguous()
        tokens = torch.stack([_distinct(draft[b, 0, 0], num_drafts, gen) for b in range(batch_size)]).unsqueeze(-1)
    else:
        u = torch.rand(draft.shape[:-1], generator=gen, dtype=torch.float64)
        tokens = sample_categorical(draft, u)
    for trial in range(3):
        ours = shipped.verify(tokens, draft, target, torch.Generator().manual_seed(trial), validate=False)
        theirs = plain.verify(tokens, draft, target, torch.Generator().manual_seed(trial), validate=False)
        assert torch.equal(ours.num_accepted, theirs.num_accepted)
        assert torch.equal(ours.draft_index, theirs.draft_index)
        assert torch.equal(ours.next_token, theirs.next_token)


@pytest.mark.parametrize("cls", [TreeRecursiveRejection, TreeRecursiveRejectionWithoutReplacement])
@pytest.mark.parametrize("tree", [DraftTree.chains(3, 2), DraftTree.cartesian([3, 2]), DraftTree.topk_depth(2, 3)],
                         ids=["chains", "cartesian", "topk_depth"])
@pytest.mark.parametrize("seed", range(4))
def test_tree_verdicts_do_not_depend_on_dropping_settled_rows(cls, tree, seed):
    shipped, plain = _pair(cls)
    batch_size, vocab_size, num_nodes = 60, 300, len(tree.parents)
    gen = torch.Generator().manual_seed(seed)
    draft, target = (rows.reshape(batch_size, num_nodes, vocab_size)
                     for rows in _rows(batch_size * num_nodes, vocab_size, gen, torch.float32, 3.0))
    tokens = torch.zeros(batch_size, num_nodes, dtype=torch.int64)
    for parent, kids in enumerate(tree.children):
        if kids:
            tokens[:, list(kids)] = torch.stack([_distinct(draft[b, parent], len(kids), gen) for b in range(batch_size)])
    for trial in range(3):
        ours = shipped.verify_tree(tree, tokens, draft, target, torch.Generator().manual_seed(trial), validate=False)
        theirs = plain.verify_tree(tree, tokens, draft, target, torch.Generator().manual_seed(trial), validate=False)
        assert torch.equal(ours.accepted_node, theirs.accepted_node)
        assert torch.equal(ours.next_token, theirs.next_token)


def test_settled_rows_are_not_drawn_and_the_rest_are():
    """A row whose first draft is accepted for sure is dropped; the other row's residual is drawn as a full one."""
    draft = torch.tensor([[0.5, 0.3, 0.2], [0.5, 0.3, 0.2]])
    target = torch.tensor([[0.6, 0.2, 0.2], [0.1, 0.2, 0.7]])
    tokens = torch.tensor([[0, 1], [0, 1]])  # row 0: q(0) >= p(0), accepted for sure
    survivors = torch.ones(2, 2, dtype=torch.bool)
    rule = RecursiveRejectionRule()
    accept, residual = rule.chain_sampler_parts(tokens, survivors, draft, target)
    assert isinstance(residual, RowsResidual) and residual.kept_rows.tolist() == [1]
    assert accept[0].tolist() == [1.0, 0.0]
    full_accept, full_residual = _KeepEveryRow().sampler_parts(tokens, survivors, draft, target)
    assert torch.equal(accept[1], full_accept[1])
    assert torch.equal(residual.materialise()[1], full_residual[1])
    assert torch.equal(residual.materialise()[0], target[0])
    u = torch.tensor([0.3, 0.99], dtype=torch.float64)
    drawn, total = residual.sample_with_total(u)
    assert drawn[1] == sample_categorical(full_residual[1:], u[1:])[0] and total[0] == 1
    # sampler_parts gives a tensor, with the target's row where the row is settled
    accept_t, residual_t = rule.sampler_parts(tokens, survivors, draft, target)
    assert torch.equal(accept_t, accept) and torch.equal(residual_t, residual.materialise())
