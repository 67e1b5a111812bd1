"""Chains are trees: K drafts of length L as ``DraftTree.chains(K, L)``, and adapters both ways.

Node ``(d - 1) * K + k + 1`` of the chain tree is token ``d`` (from 1) of draft ``k``; node 0 is the
shared root.  A chain verifier's ``(num_accepted = n, draft_index = k)`` is the node of draft ``k`` at
depth ``n`` (the root when ``n = 0``), and back.  Both conventions report the smallest index among
drafts (nodes) that share the emitted prefix, so laws map cell by cell.

* :class:`ChainVerifierAsTree` runs any chain :class:`~spectr_audit.contract.verifier.Verifier` as a
  tree verifier on chain trees (duplicated siblings allowed under ``"iid"``);
* :class:`TreeVerifierAsChain` runs a tree verifier on the chain contract's K x L drafts, so that the
  chain audits, suites and laws apply to it unchanged.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch

from spectr_audit.contract.randomness import RandomSource
from spectr_audit.contract.tree import DraftTree
from spectr_audit.contract.tree_verifier import TreeVerifier, TreeVerifyOutput, check_tree_inputs
from spectr_audit.contract.verifier import Verifier, VerifyOutput, check_output_probs
from spectr_audit.errors import InvalidArgument

__all__ = [
    "TreeInputs",
    "ChainVerifierAsTree",
    "TreeVerifierAsChain",
    "chain_node_index",
    "chains_as_tree_inputs",
    "tree_inputs_as_chains",
    "chain_output_as_tree",
    "tree_output_as_chain",
    "chain_law_as_tree",
    "tree_law_as_chain",
]


@dataclasses.dataclass(frozen=True)
class TreeInputs:
    """One tree verification step's inputs (see :mod:`spectr_audit.contract.tree_verifier`)."""

    tree: DraftTree
    # [batch_size, num_nodes] int64
    node_tokens: torch.Tensor
    # [batch_size, num_nodes, vocab_size] or None
    draft_probs: Optional[torch.Tensor]
    # [batch_size, num_nodes, vocab_size]
    target_probs: torch.Tensor


def chain_node_index(num_drafts: int, draft_len: int, device=None) -> torch.Tensor:  # [num_drafts, draft_len + 1]
    """``index[k, d]``: the chain-tree node of draft ``k`` at depth ``d`` (0 at depth 0)."""
    depth = torch.arange(draft_len + 1, device=device)
    draft = torch.arange(num_drafts, device=device)
    index = (depth.unsqueeze(0) - 1) * num_drafts + draft.unsqueeze(1) + 1
    return torch.where(depth.unsqueeze(0) == 0, torch.zeros_like(index), index)


def _chain_shape(tree: DraftTree) -> tuple[int, int]:
    shape = tree.as_chains()
    if shape is None:
        raise InvalidArgument(f"tree: expected a chain tree (DraftTree.chains(K, L)), got {tree.describe()}")
    return shape


def chains_as_tree_inputs(
    draft_tokens: torch.Tensor,  # [batch_size, num_drafts, draft_len]
    draft_probs: torch.Tensor,  # [batch_size, num_drafts, draft_len, vocab_size]
    target_probs: torch.Tensor,  # [batch_size, num_drafts, draft_len + 1, vocab_size]
) -> TreeInputs:
    """The chain contract's inputs as inputs on ``DraftTree.chains(K, L)``.

    The root rows come from draft 0 (every draft shares the root); the draft rows of the leaves are zero.
    """
    batch_size, num_drafts, draft_len = draft_tokens.shape
    vocab_size = draft_probs.shape[-1]
    tree = DraftTree.chains(num_drafts, draft_len)
    device = draft_tokens.device
    node_tokens = torch.cat(
        [torch.zeros(batch_size, 1, dtype=torch.int64, device=device), draft_tokens.transpose(1, 2).reshape(batch_size, -1)],
        dim=1,
    )
    # depth-major: node (d - 1) K + k + 1 holds draft k's row at depth d
    draft_rows = draft_probs[:, :, 1:].transpose(1, 2).reshape(batch_size, -1, vocab_size)
    node_draft = torch.cat(
        [draft_probs[:, 0, :1], draft_rows, torch.zeros(batch_size, num_drafts, vocab_size, dtype=draft_probs.dtype, device=device)],
        dim=1,
    )
    node_target = torch.cat(
        [target_probs[:, 0, :1], target_probs[:, :, 1:].transpose(1, 2).reshape(batch_size, -1, vocab_size)], dim=1
    )
    return TreeInputs(tree, node_tokens, node_draft, node_target)


def tree_inputs_as_chains(
    tree: DraftTree,
    node_tokens: torch.Tensor,  # [batch_size, num_nodes]
    draft_probs: torch.Tensor,  # [batch_size, num_nodes, vocab_size]
    target_probs: torch.Tensor,  # [batch_size, num_nodes, vocab_size]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Inputs on a chain tree as the chain contract's ``(draft_tokens, draft_probs, target_probs)``."""
    num_drafts, draft_len = _chain_shape(tree)
    index = chain_node_index(num_drafts, draft_len, node_tokens.device)  # [K, L + 1]
    draft_tokens = node_tokens[:, index[:, 1:]]  # [B, K, L]
    chain_draft = draft_probs[:, index[:, :-1]]  # [B, K, L, V]: the row each token was drafted from
    chain_target = target_probs[:, index]  # [B, K, L + 1, V]
    return draft_tokens, chain_draft, chain_target


def chain_output_as_tree(output: VerifyOutput, num_drafts: int, draft_len: int) -> TreeVerifyOutput:
    """A chain verdict ``(num_accepted, draft_index)`` as the accepted node of the chain tree."""
    index = chain_node_index(num_drafts, draft_len, output.num_accepted.device)
    return TreeVerifyOutput(index[output.draft_index, output.num_accepted], output.next_token)


def tree_output_as_chain(output: TreeVerifyOutput, num_drafts: int, draft_len: int) -> VerifyOutput:
    """An accepted node of the chain tree as a chain verdict (draft 0 when nothing is accepted)."""
    node = output.accepted_node
    num_accepted = torch.where(node > 0, (node - 1) // num_drafts + 1, torch.zeros_like(node))
    draft_index = torch.where(node > 0, (node - 1) % num_drafts, torch.zeros_like(node))
    return VerifyOutput(num_accepted, draft_index, output.next_token)


def chain_law_as_tree(law: torch.Tensor, num_drafts: int, draft_len: int) -> torch.Tensor:  # [B, N + 1, V]
    """A chain law ``[B, K, L + 1, V]`` as a tree law ``[B, N + 1, V]`` on the chain tree."""
    batch_size, vocab_size = law.shape[0], law.shape[-1]
    root = law[:, :, 0].sum(1, keepdim=True)  # every draft's "nothing accepted" is the root
    deeper = law[:, :, 1:].transpose(1, 2).reshape(batch_size, -1, vocab_size)
    return torch.cat([root, deeper], dim=1)


def tree_law_as_chain(law: torch.Tensor, num_drafts: int, draft_len: int) -> torch.Tensor:  # [B, K, L + 1, V]
    """A tree law on the chain tree as a chain law, the root's mass under draft 0."""
    batch_size, vocab_size = law.shape[0], law.shape[-1]
    out = torch.zeros(batch_size, num_drafts, draft_len + 1, vocab_size, dtype=law.dtype, device=law.device)
    out[:, 0, 0] = law[:, 0]
    out[:, :, 1:] = law[:, 1:].reshape(batch_size, draft_len, num_drafts, vocab_size).transpose(1, 2)
    return out


class ChainVerifierAsTree(TreeVerifier):
    """A chain :class:`~spectr_audit.contract.verifier.Verifier` as a tree verifier on chain trees.

    Supports ``DraftTree.chains(K, L)`` for the (K, L) the chain verifier supports, under its
    draft scheme.

    Examples
    --------
    >>> import torch
    >>> from spectr_audit.contract.verifier import FunctionVerifier
    >>> def first_token(draft_tokens, draft_probs, target_probs, generator):
    ...     z = torch.zeros(draft_tokens.shape[0], dtype=torch.int64)
    ...     return z, z, target_probs[:, 0, 0].argmax(-1)
    >>> tree_verifier = ChainVerifierAsTree(FunctionVerifier(first_token, max_draft_len=1))
    >>> tree_verifier.supports_tree(DraftTree.chains(3, 1)), tree_verifier.supports_tree(DraftTree.chains(3, 2))
    (True, False)
    """

    def __init__(self, verifier: Verifier, name: Optional[str] = None):
        if not isinstance(verifier, Verifier):
            raise InvalidArgument(f"verifier: expected a chain Verifier, got {type(verifier).__name__}")
        self.verifier = verifier
        self.name = name or verifier.name
        self.description = verifier.description
        self.draft_schemes = (verifier.draft_scheme,)
        self.expected = verifier.expected
        self.guarantees = verifier.guarantees

    @property
    def has_tree_law(self) -> bool:
        return self.verifier.has_exact_law

    def supports_tree(self, tree: DraftTree) -> bool:
        shape = tree.as_chains()
        return shape is not None and self.verifier.supports(*shape)

    def _verify_tree(self, tree, node_tokens, draft_probs, target_probs, generator) -> TreeVerifyOutput:
        num_drafts, draft_len = _chain_shape(tree)
        chain = tree_inputs_as_chains(tree, node_tokens, draft_probs, target_probs)
        out = self.verifier.verify(*chain, generator, validate=False)
        return chain_output_as_tree(out, num_drafts, draft_len)

    def tree_output_probs(self, tree, node_tokens, draft_probs, target_probs, *, validate: bool = True) -> torch.Tensor:
        """The chain verifier's ``output_probs`` on the chains, as a tree law.

        The rows go to the chain verifier as they are: its ``output_probs`` renormalises them once, as it does
        on the chain contract (renormalising twice would move the law's last bits), and a law it returns is
        checked with the chain contract's words.
        """
        if validate:
            check_tree_inputs(tree, node_tokens, draft_probs, target_probs, self.draft_schemes, who=repr(self.name))
        self.check_supports_tree(tree)
        num_drafts, draft_len = _chain_shape(tree)
        chain = tree_inputs_as_chains(tree, node_tokens, draft_probs, target_probs)
        law = check_output_probs(self.verifier.output_probs(*chain, validate=False), node_tokens.shape[0], num_drafts,
                                 draft_len, target_probs.shape[-1], who=self.verifier.name)
        return chain_law_as_tree(law.double(), num_drafts, draft_len)

    def _tree_output_probs(self, tree, node_tokens, draft_probs, target_probs) -> torch.Tensor:
        return self.tree_output_probs(tree, node_tokens, draft_probs, target_probs, validate=False)

    def standard_entry(self, method: str) -> bool:
        """Its ``tree_output_probs`` checks the tree's inputs unless called with ``validate=False``, as the contract's."""
        return method == "tree_output_probs" or super().standard_entry(method)


class TreeVerifierAsChain(Verifier):
    """A :class:`~spectr_audit.contract.tree_verifier.TreeVerifier` run on the chain contract's K x L drafts.

    The chain draft scheme is ``"iid"`` when the tree verifier supports it, else ``"without_replacement"``
    (the chain contract draws without replacement at L = 1 only).

    Examples
    --------
    >>> import torch
    >>> from spectr_audit.contract.tree_verifier import FunctionTreeVerifier
    >>> def stop_at_root(tree, node_tokens, draft_probs, target_probs, generator):
    ...     return torch.zeros(node_tokens.shape[0], dtype=torch.int64), target_probs[:, 0].argmax(-1)
    >>> chain_verifier = TreeVerifierAsChain(FunctionTreeVerifier(stop_at_root))
    >>> out = chain_verifier.verify(torch.zeros(1, 2, 1, dtype=torch.int64), torch.full((1, 2, 1, 2), 0.5),
    ...                             torch.tensor([[[[0.5, 0.5], [0.5, 0.5]]] * 2]))
    >>> out.num_accepted.tolist(), out.draft_index.tolist()
    ([0], [0])
    """

    def __init__(self, tree_verifier: TreeVerifier, name: Optional[str] = None):
        if not isinstance(tree_verifier, TreeVerifier):
            raise InvalidArgument(f"tree_verifier: expected a TreeVerifier, got {type(tree_verifier).__name__}")
        if "iid" in tree_verifier.draft_schemes:
            self.draft_scheme = "iid"
        elif "without_replacement" in tree_verifier.draft_schemes:
            self.draft_scheme = "without_replacement"
            self.max_draft_len = 1
        else:
            raise InvalidArgument(
                f"tree_verifier: {tree_verifier.name!r} supports the draft schemes {tree_verifier.draft_schemes}; "
                f"the chain contract drafts 'iid' or 'without_replacement'"
            )
        self.tree_verifier = tree_verifier
        self.name = name or tree_verifier.name
        self.description = tree_verifier.description
        self.expected = tree_verifier.expected
        self.guarantees = tree_verifier.guarantees

    @property
    def has_exact_law(self) -> bool:
        return self.tree_verifier.has_tree_law

    def supports(self, num_drafts: int, draft_len: int) -> bool:
        return super().supports(num_drafts, draft_len) and self.tree_verifier.supports_tree(
            DraftTree.chains(num_drafts, draft_len)
        )

    def _verify(self, draft_tokens, draft_probs, target_probs, generator: RandomSource) -> VerifyOutput:
        inputs = chains_as_tree_inputs(draft_tokens, draft_probs, target_probs)
        out = self.tree_verifier.verify_tree(
            inputs.tree, inputs.node_tokens, inputs.draft_probs, inputs.target_probs, generator, validate=False
        )
        return tree_output_as_chain(out, draft_tokens.shape[1], draft_tokens.shape[2])

    def _output_probs(self, draft_tokens, draft_probs, target_probs) -> torch.Tensor:
        inputs = chains_as_tree_inputs(draft_tokens, draft_probs, target_probs)
        law = self.tree_verifier.tree_output_probs(
            inputs.tree, inputs.node_tokens, inputs.draft_probs, inputs.target_probs, validate=False
        )
        return tree_law_as_chain(law, draft_tokens.shape[1], draft_tokens.shape[2])
