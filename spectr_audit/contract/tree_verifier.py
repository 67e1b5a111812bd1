"""The tree-verifier contract: one verification step over a :class:`~spectr_audit.contract.tree.DraftTree`.

Glossary
--------
A tree verification step sees, per batch row, the drafted token of every draft node, the draft
distribution each node's children were drafted from, and the target's next-token distribution at
every node.  It returns:

* ``accepted_node``: the node whose path from the root is kept (the *accepted* tokens; 0 when no
  draft token is kept);
* ``next_token``: one more token, sampled by the verifier: a *correction* token when the walk
  stopped at a node that has children, or the *bonus* token drawn from the target at a leaf.

The emitted string is the tokens on the path root -> ``accepted_node`` followed by ``next_token``:
1 to ``max_depth + 1`` tokens.

Inputs (``N + 1 = tree.num_nodes``)::

    node_tokens   # [batch_size, N + 1] int64; entry 0 (the root) is unused
    draft_probs   # [batch_size, N + 1, vocab_size]: row n is the law n's children were drafted from;
                  #   rows of leaves are ignored (may be zeros); None under scheme "none"
    target_probs  # [batch_size, N + 1, vocab_size]: row n is the target's next-token law after the
                  #   path to n; the rows of leaves are the bonus rows

Canonical node: when nodes carry the same token path (siblings repeating a token under ``"iid"``),
built-in verifiers report the smallest such node and their exact laws use the same convention, so
that a sampler and its law can be compared cell by cell.  Audits compare emitted strings only.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Optional, Sequence

import torch

from spectr_audit.contract._checks import (
    adopt_function,
    call_third_party,
    check_dims,
    check_law,
    check_output_field,
    check_probs,
    check_same_device,
    check_shape,
    check_token_tensor,
    check_verify_function,
)
from spectr_audit.contract.randomness import RandomSource
from spectr_audit.contract.tree import TREE_DRAFT_SCHEMES, DraftTree, draft_scheme_violation
from spectr_audit.contract.verifier import Expected
from spectr_audit.errors import InvalidArgument, VerifierError

__all__ = [
    "TreeVerifier",
    "TreeVerifyOutput",
    "FunctionTreeVerifier",
    "check_tree_inputs",
    "check_tree_output",
    "check_tree_output_probs",
]


@dataclasses.dataclass(frozen=True)
class TreeVerifyOutput:
    """What one tree verification step decided, per batch row.

    Attributes
    ----------
    accepted_node : torch.Tensor
        ``[batch_size]`` int64 in ``[0, N]``: 0 when no draft token is accepted.
    next_token : torch.Tensor
        ``[batch_size]`` int64 in ``[0, vocab_size)``: the correction or bonus token.
    """

    # [batch_size]
    accepted_node: torch.Tensor
    # [batch_size]
    next_token: torch.Tensor

    def num_accepted(self, tree: DraftTree) -> torch.Tensor:  # [batch_size]
        """Accepted draft tokens per row: the depth of ``accepted_node``."""
        return torch.tensor(tree.depths, dtype=torch.int64, device=self.accepted_node.device)[self.accepted_node]

    def emitted(self, tree: DraftTree, node_tokens: torch.Tensor) -> list[list[int]]:
        """The emitted strings, as Python lists (for reports and small tests)."""
        out = []
        for b in range(node_tokens.shape[0]):
            path = tree.path_nodes(int(self.accepted_node[b]))
            out.append([int(node_tokens[b, n]) for n in path] + [int(self.next_token[b])])
        return out


def _normalised_rows(probs: torch.Tensor) -> torch.Tensor:
    """float64 rows renormalised to sum to 1; rows of zeros (unused leaf rows) stay zero."""
    probs = probs.double()
    total = probs.sum(-1, keepdim=True)
    return probs / torch.where(total > 0, total, torch.ones_like(total))


def check_tree_inputs(
    tree: DraftTree,
    node_tokens: torch.Tensor,  # [batch_size, num_nodes]
    draft_probs: Optional[torch.Tensor],  # [batch_size, num_nodes, vocab_size] or None
    target_probs: torch.Tensor,  # [batch_size, num_nodes, vocab_size]
    draft_schemes: Sequence[str] = TREE_DRAFT_SCHEMES,
    who: str = "verifier",
) -> tuple[int, int]:
    """Validate one tree verification step's inputs; return ``(batch_size, vocab_size)``.

    Checks shapes, dtypes and devices; that every target row and every draft row of a node with
    children is a distribution; that token ids lie in the vocabulary; and that the tokens could have
    been drafted under at least one of ``draft_schemes`` (:func:`draft_scheme_violation`).

    Raises
    ------
    InvalidArgument
        naming the argument and the problem.
    """
    if not isinstance(tree, DraftTree):
        raise InvalidArgument(f"tree: expected a DraftTree, got {type(tree).__name__}")
    num_nodes = tree.num_nodes
    check_token_tensor("node_tokens", node_tokens)
    if node_tokens.dim() != 2 or node_tokens.shape[1] != num_nodes:
        raise InvalidArgument(
            f"node_tokens: expected shape [batch_size, {num_nodes}] (num_nodes = N + 1 of the tree), "
            f"got {tuple(node_tokens.shape)}"
        )
    batch_size = node_tokens.shape[0]
    check_dims("target_probs", target_probs, 3, f"batch_size, {num_nodes}, vocab_size")
    vocab_size = target_probs.shape[-1]
    if vocab_size < 1:
        raise InvalidArgument("target_probs: vocab_size must be >= 1")
    check_probs("target_probs", target_probs, (batch_size, num_nodes, vocab_size))
    check_same_device(node_tokens=node_tokens, target_probs=target_probs)
    schemes = tuple(draft_schemes)
    if draft_probs is None:
        if "none" not in schemes:
            raise InvalidArgument(
                f"draft_probs: {who} needs draft probabilities (its draft schemes are {schemes}); got None"
            )
    else:
        if not isinstance(draft_probs, torch.Tensor):
            raise InvalidArgument(f"draft_probs: expected a torch.Tensor or None, got {type(draft_probs).__name__}")
        check_shape("draft_probs", draft_probs, (batch_size, num_nodes, vocab_size))
        check_same_device(node_tokens=node_tokens, draft_probs=draft_probs)
        internal = list(tree.internal_nodes)
        # only the rows children are drafted from must be distributions; leaf rows are never read
        rows = draft_probs if len(internal) == num_nodes else draft_probs[:, internal]
        try:
            check_probs("draft_probs", rows, (batch_size, len(internal), vocab_size))
        except InvalidArgument as exc:
            raise InvalidArgument(f"{exc} (index over the nodes with children {tuple(internal)})") from None
    if batch_size == 0:
        return batch_size, vocab_size
    drafted = node_tokens[:, 1:]
    out_of_range = (drafted < 0) | (drafted >= vocab_size)
    if bool(out_of_range.any()):
        b, i = out_of_range.nonzero()[0].tolist()
        raise InvalidArgument(
            f"node_tokens: token ids must lie in [0, {vocab_size}); found {int(drafted[b, i])} at node {i + 1} of "
            f"batch row {b}"
        )
    reasons = []
    for scheme in schemes:
        reason = draft_scheme_violation(tree, node_tokens, draft_probs, scheme)
        if reason is None:
            return batch_size, vocab_size
        reasons.append(f"{scheme}: {reason}")
    raise InvalidArgument(
        f"node_tokens: the drafts cannot come from any draft scheme {who} supports ({'; '.join(reasons)})"
    )


def check_tree_output(
    output: Any, tree: DraftTree, batch_size: int, vocab_size: int, who: str = "verifier"
) -> TreeVerifyOutput:
    """Validate what a (possibly third-party) tree verifier returned; normalise it to :class:`TreeVerifyOutput`.

    Accepts a :class:`TreeVerifyOutput` or a pair ``(accepted_node, next_token)``.
    Raises :class:`VerifierError` naming the field and the problem.
    """
    if isinstance(output, TreeVerifyOutput):
        fields = (output.accepted_node, output.next_token)
    elif isinstance(output, (tuple, list)) and len(output) == 2:
        fields = tuple(output)
    else:
        raise VerifierError(
            f"{who}: verify_tree must return TreeVerifyOutput or (accepted_node, next_token); got {type(output).__name__}"
        )
    names = ("accepted_node", "next_token")
    checked = [
        check_output_field(who, name, value, batch_size, 0, hi)
        for name, value, hi in zip(names, fields, (tree.num_nodes - 1, vocab_size - 1))
    ]
    return TreeVerifyOutput(*checked)


def check_tree_output_probs(
    law: Any, tree: DraftTree, batch_size: int, vocab_size: int, who: str = "verifier"
) -> torch.Tensor:
    """Validate an exact law returned by ``tree_output_probs``: shape, finiteness, sign, total mass 1."""
    return check_law(who, "tree_output_probs", law, (batch_size, tree.num_nodes, vocab_size))


class TreeVerifier:
    """Base class of tree verifiers: one required method, ``_verify_tree``.

    Subclasses set the class attributes below and implement ``_verify_tree`` (and
    ``_tree_output_probs`` when they know their exact law).  The public ``verify_tree`` and
    ``tree_output_probs`` validate inputs once, at this boundary.

    Class attributes
    ----------------
    name : str
        Short name used by the CLI and reports.
    draft_schemes : tuple of str
        The draft schemes (:data:`~spectr_audit.contract.tree.TREE_DRAFT_SCHEMES`) under which the
        verifier is meant to be exact; the first is the one the drafting harness uses by default.
        Inputs impossible under every one of them are refused.
    expected : {"exact", "inexact"} or None
        A declared verdict, as for :class:`~spectr_audit.contract.verifier.Verifier`.
    guarantees : frozenset of str
        Optimality claims the audit should check.
    """

    name: str = ""
    description: str = ""
    draft_schemes: tuple = ("iid",)
    expected: Expected = None
    guarantees: frozenset = frozenset()

    # -- public, validated -------------------------------------------------
    def verify_tree(
        self,
        tree: DraftTree,
        node_tokens: torch.Tensor,  # [batch_size, num_nodes]
        draft_probs: Optional[torch.Tensor],  # [batch_size, num_nodes, vocab_size] or None
        target_probs: torch.Tensor,  # [batch_size, num_nodes, vocab_size]
        generator: RandomSource = None,
        *,
        validate: bool = True,
    ) -> TreeVerifyOutput:
        """Verify one step on ``tree``; see the module docstring for the inputs and outputs.

        ``validate=False`` skips the input checks; use it only where the inputs are known valid.
        """
        if validate:
            check_tree_inputs(tree, node_tokens, draft_probs, target_probs, self.draft_schemes, who=repr(self.name))
            self.check_supports_tree(tree)
        return self._verify_tree(tree, node_tokens, draft_probs, target_probs, generator)

    def tree_output_probs(
        self,
        tree: DraftTree,
        node_tokens: torch.Tensor,  # [batch_size, num_nodes]
        draft_probs: Optional[torch.Tensor],  # [batch_size, num_nodes, vocab_size] or None
        target_probs: torch.Tensor,  # [batch_size, num_nodes, vocab_size]
        *,
        validate: bool = True,
    ) -> torch.Tensor:  # [batch_size, num_nodes, vocab_size] float64
        """Exact law ``P(accepted_node = n, next_token = y | drafts)``, float64 ``[batch_size, N + 1, vocab_size]``."""
        if not self.has_tree_law:
            raise NotImplementedError(f"tree verifier {self.name!r} has no exact output law")
        if validate:
            check_tree_inputs(tree, node_tokens, draft_probs, target_probs, self.draft_schemes, who=repr(self.name))
        self.check_supports_tree(tree)
        # exact laws are computed in float64 on rows renormalised to sum to 1
        draft64 = None if draft_probs is None else _normalised_rows(draft_probs)
        return self._tree_output_probs(tree, node_tokens, draft64, _normalised_rows(target_probs))

    @property
    def has_tree_law(self) -> bool:
        """Whether ``tree_output_probs`` is available."""
        return type(self)._tree_output_probs is not TreeVerifier._tree_output_probs

    def standard_entry(self, method: str) -> bool:
        """Whether the public ``method`` (``"verify_tree"``, ``"tree_output_probs"``) is the contract's own entry point:
        it checks the inputs unless called with ``validate=False`` (see
        :meth:`~spectr_audit.contract.verifier.Verifier.standard_entry`)."""
        return (method in ("verify_tree", "tree_output_probs")
                and getattr(type(self), method) is getattr(TreeVerifier, method))

    @property
    def needs_draft_probs(self) -> bool:
        """False when the verifier runs without draft probabilities (scheme ``"none"``)."""
        return "none" not in self.draft_schemes

    def supports_tree(self, tree: DraftTree) -> bool:
        """Whether the verifier accepts ``tree`` (every tree, unless a subclass says otherwise)."""
        return True

    def check_supports_tree(self, tree: DraftTree) -> None:
        """Raise :class:`InvalidArgument` when ``tree`` is outside what the verifier supports."""
        if not self.supports_tree(tree):
            raise InvalidArgument(f"tree: verifier {self.name!r} does not support {tree.describe()}")

    # -- to implement ------------------------------------------------------
    def _verify_tree(self, tree, node_tokens, draft_probs, target_probs, generator) -> TreeVerifyOutput:  # pragma: no cover
        raise NotImplementedError

    def _tree_output_probs(self, tree, node_tokens, draft_probs, target_probs) -> torch.Tensor:  # pragma: no cover
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name!r}>"


def _check_schemes(draft_schemes: Sequence[str]) -> tuple:
    schemes = tuple(draft_schemes)
    if not schemes or any(s not in TREE_DRAFT_SCHEMES for s in schemes):
        raise InvalidArgument(f"draft_schemes: expected a non-empty tuple drawn from {TREE_DRAFT_SCHEMES}, got {schemes}")
    return schemes


class FunctionTreeVerifier(TreeVerifier):
    """Adapter: audit a third party's plain tree-verification function.

    The wrapped callable receives ``(tree, node_tokens, draft_probs, target_probs, generator)`` and
    returns :class:`TreeVerifyOutput` or ``(accepted_node, next_token)``; its output is validated,
    raising :class:`VerifierError` on a contract breach.

    Examples
    --------
    >>> import torch
    >>> def stop_at_root(tree, node_tokens, draft_probs, target_probs, generator):
    ...     return torch.zeros(node_tokens.shape[0], dtype=torch.int64), target_probs[:, 0].argmax(-1)
    >>> v = FunctionTreeVerifier(stop_at_root, draft_schemes=("topk",))
    >>> v.name, v.has_tree_law
    ('stop_at_root', False)
    """

    def __init__(
        self,
        fn: Callable[..., Any],
        *,
        name: Optional[str] = None,
        tree_output_probs: Optional[Callable[..., torch.Tensor]] = None,
        draft_schemes: Sequence[str] = ("iid",),
        supports_tree: Optional[Callable[[DraftTree], bool]] = None,
        expected: Expected = None,
        guarantees: frozenset = frozenset(),
        description: str = "",
    ):
        check_verify_function(fn)
        adopt_function(
            self, fn, tree_output_probs, name=name, default_name="tree-verifier", expected=expected,
            guarantees=guarantees, description=description,
        )
        self._supports = supports_tree
        self.draft_schemes = _check_schemes(draft_schemes)

    @property
    def has_tree_law(self) -> bool:
        return self._law is not None

    def supports_tree(self, tree: DraftTree) -> bool:
        return True if self._supports is None else bool(self._supports(tree))

    def _verify_tree(self, tree, node_tokens, draft_probs, target_probs, generator) -> TreeVerifyOutput:
        raw = call_third_party(self.name, "verify_tree", self._fn, tree, node_tokens, draft_probs, target_probs, generator)
        return check_tree_output(raw, tree, node_tokens.shape[0], target_probs.shape[-1], who=self.name)

    def _tree_output_probs(self, tree, node_tokens, draft_probs, target_probs) -> torch.Tensor:
        law = call_third_party(self.name, "tree_output_probs", self._law, tree, node_tokens, draft_probs, target_probs)
        return check_tree_output_probs(law, tree, node_tokens.shape[0], target_probs.shape[-1], who=self.name)
