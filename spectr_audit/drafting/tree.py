"""The tree drafting harness: draft a :class:`~spectr_audit.contract.tree.DraftTree` and score every node.

:func:`draft_tree` draws the node tokens level by level under a draft scheme, keeping the draft
distribution each node's children were drawn from, and scores every node with the target in one
batched call.  :func:`verify_tree_step` adds the tree verifier call.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch

from spectr_audit.contract.randomness import RandomSource, sample_categorical, uniform
from spectr_audit.contract.tree import TREE_DRAFT_SCHEMES, DraftTree, topk_order
from spectr_audit.contract.tree_verifier import TreeVerifier, TreeVerifyOutput
from spectr_audit.drafting.harness import left_pad
from spectr_audit.drafting.models import Model
from spectr_audit.errors import InvalidArgument

__all__ = ["TreeDraftBatch", "draft_tree", "verify_tree_step"]


@dataclasses.dataclass(frozen=True)
class TreeDraftBatch:
    """A drafted tree: node tokens and the model distributions at every node."""

    tree: DraftTree
    draft_scheme: str
    # [batch_size, num_nodes] int64; entry 0 (the root) is 0
    node_tokens: torch.Tensor
    # [batch_size, num_nodes, vocab_size] float64; rows of leaves are zero; None under scheme "none"
    draft_probs: Optional[torch.Tensor]
    # [batch_size, num_nodes, vocab_size] float64
    target_probs: torch.Tensor


def _path_contexts(
    contexts: torch.Tensor,  # [batch_size, context_len]
    node_tokens: torch.Tensor,  # [batch_size, num_nodes]
    path_index: torch.Tensor,  # [num_nodes, max_depth]
    nodes: list[int],  # nodes of one depth
    depth: int,
) -> torch.Tensor:  # [batch_size * len(nodes), context_len + depth]
    """Each context followed by the tokens on the path to each node, rows ordered (batch row, node)."""
    batch_size = contexts.shape[0]
    paths = node_tokens[:, path_index[nodes, :depth]]  # [batch_size, len(nodes), depth]
    heads = contexts.unsqueeze(1).expand(batch_size, len(nodes), contexts.shape[1])
    return torch.cat([heads, paths], dim=2).reshape(batch_size * len(nodes), -1)


def draft_tree(
    draft_model: Model,
    target_model: Model,
    contexts: torch.Tensor,  # [batch_size, context_len], right-aligned, PAD on the left
    tree: DraftTree,
    generator: RandomSource = None,
    draft_scheme: str = "iid",
) -> TreeDraftBatch:
    """Draft ``tree`` after each context under ``draft_scheme`` and score every node with the target.

    Parameters
    ----------
    draft_model, target_model : Model
    contexts : torch.Tensor
        ``[batch_size, context_len]`` int64, right-aligned.
    tree : DraftTree
    generator : torch.Generator, optional
    draft_scheme : {"iid", "without_replacement", "topk", "none"}
        ``iid``: every child drawn independently from the draft law at its parent.
        ``without_replacement``: the children of each node drawn one after another, in rank
        order, with the tokens already drawn removed.  ``topk``: the child of rank ``r`` is the
        ``r``-th most likely draft token (ties to the smallest id).  ``none``: as ``topk``, and the
        draft probabilities are withheld (``draft_probs = None``), for target-only verifiers.

    Returns
    -------
    TreeDraftBatch

    Notes
    -----
    The draft model is called once per depth on the nodes of that depth that have children
    (``batch_size * num_internal`` rows); the target once on all ``batch_size * (N + 1)`` nodes.
    The draws use one uniform per child (``iid``, ``without_replacement``) from ``generator``.

    Examples
    --------
    >>> from spectr_audit.drafting.models import ContextFreeModel
    >>> tree = DraftTree.from_paths([(0,), (1,), (0, 0)])
    >>> batch = draft_tree(ContextFreeModel([0.5, 0.3, 0.2]), ContextFreeModel([0.2, 0.3, 0.5]),
    ...                    torch.zeros(1, 1, dtype=torch.int64), tree, draft_scheme="topk")
    >>> batch.node_tokens.tolist()
    [[0, 0, 1, 0]]
    """
    if not isinstance(tree, DraftTree):
        raise InvalidArgument(f"tree: expected a DraftTree, got {type(tree).__name__}")
    if not isinstance(contexts, torch.Tensor) or contexts.dim() != 2 or contexts.dtype != torch.int64:
        shape = tuple(contexts.shape) if isinstance(contexts, torch.Tensor) else type(contexts).__name__
        raise InvalidArgument(f"contexts: expected int64 [batch_size, context_len], got {shape}")
    if draft_scheme not in TREE_DRAFT_SCHEMES:
        raise InvalidArgument(f"draft_scheme: expected one of {TREE_DRAFT_SCHEMES}, got {draft_scheme!r}")
    vocab_size = draft_model.vocab_size
    if target_model.vocab_size != vocab_size:
        raise InvalidArgument(f"target_model: vocab_size {target_model.vocab_size} differs from draft_model's {vocab_size}")
    if draft_scheme in ("without_replacement", "topk", "none") and tree.max_children > vocab_size:
        raise InvalidArgument(
            f"tree: a node has {tree.max_children} children, more distinct tokens than the vocabulary of {vocab_size}"
        )
    if draft_scheme in ("topk", "none") and max(tree.ranks) >= vocab_size:
        raise InvalidArgument(f"tree: a node has rank {max(tree.ranks)}, beyond the vocabulary of {vocab_size} tokens")
    batch_size, device = contexts.shape[0], contexts.device
    num_nodes = tree.num_nodes
    path_index = tree.path_index(device)
    node_tokens = torch.zeros(batch_size, num_nodes, dtype=torch.int64, device=device)
    draft_probs = torch.zeros(batch_size, num_nodes, vocab_size, dtype=torch.float64, device=device)
    for depth in range(tree.max_depth):
        parents = [n for n in tree.level(depth) if tree.children[n]]
        rows = draft_model(_path_contexts(contexts, node_tokens, path_index, parents, depth)).double()
        rows = rows.reshape(batch_size, len(parents), vocab_size)
        draft_probs[:, parents] = rows
        slot = {n: i for i, n in enumerate(parents)}
        if draft_scheme == "iid":
            children = list(tree.level(depth + 1))
            picks = sample_categorical(
                rows[:, [slot[tree.parents[c]] for c in children]], uniform(generator, (batch_size, len(children)), device)
            )
            node_tokens[:, children] = picks
        elif draft_scheme == "without_replacement":
            fanout = torch.tensor([len(tree.children[n]) for n in parents], device=device)
            support = (rows > 0).sum(-1)  # [batch_size, len(parents)]
            short = support < fanout
            if bool(short.any()):
                b, i = short.nonzero()[0].tolist()
                raise InvalidArgument(
                    f"tree: node {parents[i]} has {int(fanout[i])} children to draw without replacement, but its draft "
                    f"distribution in batch row {b} has only {int(support[b, i])} tokens of positive probability"
                )
            remaining = rows.clone()
            for position in range(max(len(tree.children[n]) for n in parents)):
                owners = [i for i, n in enumerate(parents) if len(tree.children[n]) > position]
                children = [tree.children[parents[i]][position] for i in owners]
                picks = sample_categorical(remaining[:, owners], uniform(generator, (batch_size, len(owners)), device))
                node_tokens[:, children] = picks
                remaining[:, owners] = remaining[:, owners].scatter(2, picks.unsqueeze(2), 0.0)
        else:  # topk, none: the child of rank r is the r-th most likely token
            order = topk_order(rows)  # [batch_size, len(parents), vocab_size]
            children = list(tree.level(depth + 1))
            owner = torch.tensor([slot[tree.parents[c]] for c in children], device=device)
            rank = torch.tensor([tree.ranks[c] for c in children], device=device)
            node_tokens[:, children] = order[:, owner, rank]
    # every node: the context and the path to it, right-aligned to one width, in node order
    width = contexts.shape[1] + tree.max_depth
    levels = []
    for depth in range(tree.max_depth + 1):
        nodes = list(tree.level(depth))
        rows = left_pad(_path_contexts(contexts, node_tokens, path_index, nodes, depth), width)
        levels.append(rows.reshape(batch_size, len(nodes), width))
    node_contexts = torch.cat(levels, dim=1).reshape(batch_size * num_nodes, width)
    target_probs = target_model(node_contexts).double().reshape(batch_size, num_nodes, vocab_size)
    return TreeDraftBatch(tree, draft_scheme, node_tokens, None if draft_scheme == "none" else draft_probs, target_probs)


def verify_tree_step(
    verifier: TreeVerifier,
    draft_model: Model,
    target_model: Model,
    contexts: torch.Tensor,  # [batch_size, context_len]
    tree: DraftTree,
    generator: RandomSource = None,
    draft_scheme: Optional[str] = None,
) -> tuple[TreeDraftBatch, TreeVerifyOutput]:
    """Draft ``tree`` (with ``draft_scheme``, by default the verifier's first scheme), then verify; returns both."""
    scheme = draft_scheme or verifier.draft_schemes[0]
    batch = draft_tree(draft_model, target_model, contexts, tree, generator, scheme)
    output = verifier.verify_tree(tree, batch.node_tokens, batch.draft_probs, batch.target_probs, generator)
    return batch, output
