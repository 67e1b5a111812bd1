"""Draft trees: the topology a tree verifier is given, its builders, and the draft schemes.

Glossary
--------
A *draft tree* has ``num_nodes = N + 1`` nodes.  Node 0 is the *root*: the context, with no token
of its own.  Nodes ``1 .. N`` are *draft nodes*, each carrying one drafted token; the tokens on the
path from the root to node ``n`` (root excluded, ``n`` included) are the draft continuation that node
stands for.  ``parents[n]`` is the parent of node ``n`` (``parents[0] = -1``).

Node order is *breadth-first canonical*: nodes sorted by depth, then by their parent's index, then
by their *rank* among their siblings.  Equivalently ``parents`` is non-decreasing.  Nodes of one
depth are therefore contiguous (``level_starts``), and the children of a node are contiguous and in
rank order.  This is the order EAGLE and Medusa give their tree nodes: their path lists sorted by
``(len(path), path)``.  :meth:`DraftTree.from_parents` accepts any order with ``parents[n] < n``
(depth-first included) and reorders it; :meth:`DraftTree.canonical_order` says how.

A node's *rank* is its position among its siblings as the drafter meant it: child ``r`` of a node is
its ``r``-th draw (schemes ``"iid"`` and ``"without_replacement"``) or its ``r``-th most likely draft
token (scheme ``"topk"``, ranks from 0).  Ranks increase with node index among siblings and may have
gaps (a path list that holds ``(0,)`` and ``(2,)`` but not ``(1,)``).

Draft schemes
-------------
``"iid"``
    every child of node ``n`` is drawn independently from the draft distribution at ``n``
    (siblings may repeat a token);
``"without_replacement"``
    the children of every node are drawn one after another from the draft distribution at that
    node with the tokens already drawn removed (siblings are distinct);
``"topk"``
    deterministic: the child of rank ``r`` is the ``r``-th most likely token of the draft
    distribution at its parent, ties broken by the smallest token id (EAGLE-2/3, Medusa, SGLang);
``"none"``
    target-only: the tokens are given, no draft probabilities come with them.
"""

from __future__ import annotations

import itertools
import operator
from typing import Literal, Optional, Sequence

import torch

from spectr_audit.errors import InvalidArgument

__all__ = [
    "TREE_DRAFT_SCHEMES",
    "TreeDraftScheme",
    "DraftTree",
    "draft_scheme_violation",
    "topk_order",
]

TreeDraftScheme = Literal["iid", "without_replacement", "topk", "none"]
TREE_DRAFT_SCHEMES: tuple[str, ...] = ("iid", "without_replacement", "topk", "none")


def _as_int(value: object, argument: str) -> int:
    if isinstance(value, bool):
        raise InvalidArgument(f"{argument}: expected an integer, got {value!r}")
    try:
        return operator.index(value)
    except TypeError:
        raise InvalidArgument(f"{argument}: expected an integer, got {value!r} ({type(value).__name__})") from None


def _int_list(values: object, argument: str) -> list[int]:
    if isinstance(values, torch.Tensor):
        values = values.tolist()
    if isinstance(values, (str, bytes)) or not hasattr(values, "__iter__"):
        raise InvalidArgument(f"{argument}: expected a sequence of integers, got {type(values).__name__}")
    return [_as_int(v, f"{argument}[{i}]") for i, v in enumerate(values)]


def _check_topology(parents: list[int], argument: str = "parents") -> None:
    """Root first, then every node's parent an earlier node."""
    if len(parents) < 2:
        raise InvalidArgument(
            f"{argument}: a draft tree needs the root and at least one draft node, got {len(parents)} entries"
        )
    if parents[0] != -1:
        raise InvalidArgument(f"{argument}: node 0 is the root and must have parent -1, got {parents[0]}")
    for n in range(1, len(parents)):
        if not 0 <= parents[n] < n:
            raise InvalidArgument(
                f"{argument}: node {n} has parent {parents[n]}; every draft node's parent must be an earlier "
                f"node (0 <= parents[n] < n)"
            )


class DraftTree:
    """A draft-tree topology in breadth-first canonical order (see the module docstring).

    Parameters
    ----------
    parents : sequence of int, length ``N + 1``
        ``parents[0] = -1`` (the root), ``parents[n]`` for the draft nodes; non-decreasing
        (breadth-first canonical order).  Use :meth:`from_parents` for any other order.
    ranks : sequence of int, optional
        The sibling rank of each node (``ranks[0]`` is ignored); strictly increasing among the
        children of one node.  Defaults to ``0, 1, 2, ...`` among each node's children.

    Examples
    --------
    >>> tree = DraftTree.from_paths([(0,), (1,), (0, 0), (0, 1), (1, 0)])
    >>> tree.parents
    (-1, 0, 0, 1, 1, 2)
    >>> tree.children[1], tree.leaves, tree.depths
    ((3, 4), (3, 4, 5), (0, 1, 1, 2, 2, 2))
    >>> DraftTree.chains(2, 2).parents
    (-1, 0, 0, 1, 2)
    """

    def __init__(self, parents: Sequence[int], ranks: Optional[Sequence[int]] = None):
        parents = _int_list(parents, "parents")
        _check_topology(parents)
        for n in range(2, len(parents)):
            if parents[n] < parents[n - 1]:
                raise InvalidArgument(
                    f"parents: nodes must be in breadth-first canonical order (parents non-decreasing), but node "
                    f"{n} has parent {parents[n]} after node {n - 1}'s parent {parents[n - 1]}; "
                    f"DraftTree.from_parents reorders a depth-first (or any topological) list"
                )
        num_nodes = len(parents)
        children: list[list[int]] = [[] for _ in range(num_nodes)]
        for n in range(1, num_nodes):
            children[parents[n]].append(n)
        if ranks is None:
            rank_list = [-1] + [0] * (num_nodes - 1)
            for kids in children:
                for r, c in enumerate(kids):
                    rank_list[c] = r
        else:
            rank_list = _int_list(ranks, "ranks")
            if len(rank_list) != num_nodes:
                raise InvalidArgument(f"ranks: expected {num_nodes} entries (one per node), got {len(rank_list)}")
            rank_list[0] = -1
            for n in range(1, num_nodes):
                if rank_list[n] < 0:
                    raise InvalidArgument(f"ranks: node {n} has rank {rank_list[n]}; ranks must be >= 0")
            for node, kids in enumerate(children):
                for a, b in zip(kids, kids[1:]):
                    if rank_list[b] <= rank_list[a]:
                        raise InvalidArgument(
                            f"ranks: the children of node {node} must have strictly increasing ranks in node order; "
                            f"node {a} has rank {rank_list[a]} and node {b} has rank {rank_list[b]}"
                        )
        depths = [0] * num_nodes
        for n in range(1, num_nodes):
            depths[n] = depths[parents[n]] + 1
        max_depth = depths[-1]
        starts = [0] * (max_depth + 2)
        for d in range(max_depth + 1):
            starts[d + 1] = starts[d] + depths.count(d)
        paths: list[tuple[int, ...]] = [()] * num_nodes
        for n in range(1, num_nodes):
            paths[n] = paths[parents[n]] + (rank_list[n],)
        self._parents = tuple(parents)
        self._ranks = tuple(rank_list)
        self._children = tuple(tuple(k) for k in children)
        self._depths = tuple(depths)
        self._level_starts = tuple(starts)
        self._paths = tuple(paths)

    # -- builders ------------------------------------------------------------------------------
    @classmethod
    def from_paths(cls, paths: Sequence[Sequence[int]]) -> "DraftTree":
        """A tree from a path list, the format of EAGLE's and Medusa's tree choices.

        Each path is a tuple of sibling ranks from the root: ``(0,)`` is the root's first child,
        ``(1, 0)`` the first child of the root's second child.  Nodes are numbered in the order of
        ``sorted(paths, key=lambda p: (len(p), p))`` (node ``i + 1`` is the ``i``-th sorted path),
        the numbering the engines use.  Every proper prefix of a path must itself be a path.

        Examples
        --------
        >>> DraftTree.from_paths([(0, 0), (0,), (1,), (0, 1)]).parents
        (-1, 0, 0, 1, 1)
        """
        if isinstance(paths, (str, bytes)) or not hasattr(paths, "__iter__"):
            raise InvalidArgument(f"paths: expected a list of index tuples, got {type(paths).__name__}")
        keys = []
        for i, path in enumerate(paths):
            if isinstance(path, (str, bytes)) or not hasattr(path, "__iter__"):
                raise InvalidArgument(f"paths[{i}]: expected a tuple of sibling ranks, got {path!r}")
            key = tuple(_int_list(path, f"paths[{i}]"))
            if not key:
                raise InvalidArgument(f"paths[{i}]: the empty path is the root, which is implicit; remove it")
            if any(r < 0 for r in key):
                raise InvalidArgument(f"paths[{i}]: sibling ranks must be >= 0, got {key}")
            keys.append(key)
        if not keys:
            raise InvalidArgument("paths: expected at least one path")
        if len(set(keys)) != len(keys):
            dup = next(k for k in keys if keys.count(k) > 1)
            raise InvalidArgument(f"paths: path {dup} appears more than once")
        ordered = sorted(keys, key=lambda p: (len(p), p))
        index = {p: i + 1 for i, p in enumerate(ordered)}
        parents, ranks = [-1], [-1]
        for p in ordered:
            if len(p) > 1 and p[:-1] not in index:
                raise InvalidArgument(f"paths: path {p} needs its prefix {p[:-1]}, which is not in the list")
            parents.append(index[p[:-1]] if len(p) > 1 else 0)
            ranks.append(p[-1])
        return cls(parents, ranks)

    @classmethod
    def from_parents(cls, parents: Sequence[int], ranks: Optional[Sequence[int]] = None) -> "DraftTree":
        """The canonical tree of a parent list in any order with ``parents[n] < n`` (depth-first included).

        Siblings keep their order of appearance (or ``ranks``, when given).  The canonical node
        ``m`` is input node ``DraftTree.canonical_order(parents, ranks)[m]``.

        Examples
        --------
        >>> depth_first = [-1, 0, 1, 1, 0]     # root; a; a's two children; b
        >>> DraftTree.from_parents(depth_first).parents
        (-1, 0, 0, 1, 1)
        >>> DraftTree.canonical_order(depth_first)
        [0, 1, 4, 2, 3]
        """
        order = cls.canonical_order(parents, ranks)
        parents = _int_list(parents, "parents")
        position = {old: new for new, old in enumerate(order)}
        new_parents = [-1] + [position[parents[old]] for old in order[1:]]
        new_ranks = None
        if ranks is not None:
            rank_list = _int_list(ranks, "ranks")
            new_ranks = [rank_list[old] for old in order]
        return cls(new_parents, new_ranks)

    @staticmethod
    def canonical_order(parents: Sequence[int], ranks: Optional[Sequence[int]] = None) -> list[int]:
        """``order[m]``: the input node that becomes canonical node ``m`` (see :meth:`from_parents`).

        Reorder per-node tensors with it: ``node_tokens[:, order]``.
        """
        parents = _int_list(parents, "parents")
        _check_topology(parents)
        if ranks is not None:
            rank_list = _int_list(ranks, "ranks")
            if len(rank_list) != len(parents):
                raise InvalidArgument(f"ranks: expected {len(parents)} entries (one per node), got {len(rank_list)}")
        children: list[list[int]] = [[] for _ in parents]
        for n in range(1, len(parents)):
            children[parents[n]].append(n)
        if ranks is not None:
            for node, kids in enumerate(children):
                kids.sort(key=lambda c: rank_list[c])
                for a, b in zip(kids, kids[1:]):
                    if rank_list[a] == rank_list[b]:
                        raise InvalidArgument(f"ranks: nodes {a} and {b}, children of node {node}, share rank {rank_list[a]}")
        order, frontier = [0], [0]
        while frontier:
            frontier = [c for node in frontier for c in children[node]]
            order.extend(frontier)
        return order

    @classmethod
    def chains(cls, num_drafts: int, draft_len: int) -> "DraftTree":
        """``num_drafts`` chains of ``draft_len`` tokens from the root: the chain contract's K x L drafts.

        Node ``(d - 1) * num_drafts + k + 1`` is token ``d`` (from 1) of draft ``k``; ranks are
        ``k`` at depth 1 and 0 below.  Under ``"iid"`` the chains are K i.i.d. drafts.

        Examples
        --------
        >>> DraftTree.chains(3, 2).parents
        (-1, 0, 0, 0, 1, 2, 3)
        """
        num_drafts = _as_int(num_drafts, "num_drafts")
        draft_len = _as_int(draft_len, "draft_len")
        if num_drafts < 1 or draft_len < 1:
            raise InvalidArgument(f"num_drafts, draft_len: must be >= 1, got {num_drafts}, {draft_len}")
        parents = [-1] + [0] * num_drafts
        ranks = [-1] + list(range(num_drafts))
        for d in range(2, draft_len + 1):
            parents += [(d - 2) * num_drafts + k + 1 for k in range(num_drafts)]
            ranks += [0] * num_drafts
        return cls(parents, ranks)

    @classmethod
    def cartesian(cls, topk_per_head: Sequence[int]) -> "DraftTree":
        """Medusa's cartesian candidates: every node at depth ``d`` has ``topk_per_head[d]`` children.

        Head ``d`` (from 0) proposes its top ``topk_per_head[d]`` tokens at depth ``d + 1``; the
        candidates are every combination, so the tree holds ``k_0 + k_0 k_1 + ... + k_0 ... k_{H-1}``
        draft nodes, as the paths ``(i_0, ..., i_{d})`` with ``i_j < topk_per_head[j]``.

        Examples
        --------
        >>> DraftTree.cartesian([2, 1]).to_paths()
        [(0,), (1,), (0, 0), (1, 0)]
        """
        ks = _int_list(topk_per_head, "topk_per_head")
        if not ks or any(k < 1 for k in ks):
            raise InvalidArgument(f"topk_per_head: expected a non-empty list of integers >= 1, got {ks}")
        paths = [p for depth in range(1, len(ks) + 1) for p in itertools.product(*(range(k) for k in ks[:depth]))]
        return cls.from_paths(paths)

    @classmethod
    def topk_depth(cls, topk: int, depth: int) -> "DraftTree":
        """The top-k x depth tree: every node above depth ``depth`` expands its ``topk`` children.

        The full ``topk``-ary tree of that depth, ``topk + topk**2 + ... + topk**depth`` draft nodes
        (``cartesian([topk] * depth)``).  SGLang's EAGLE drafting with ``speculative_eagle_topk = topk``
        and ``speculative_num_steps = depth`` proposes a subtree of it: for ``depth <= 2`` with
        ``speculative_num_draft_tokens = N + 1`` exactly this tree; deeper, a beam of ``topk`` nodes per
        level and a final top-scoring selection, chosen at run time (pass that subtree as a
        :class:`DraftTree` of its own; ranks may have gaps).

        Examples
        --------
        >>> DraftTree.topk_depth(2, 2).parents
        (-1, 0, 0, 1, 1, 2, 2)
        """
        topk = _as_int(topk, "topk")
        depth = _as_int(depth, "depth")
        if topk < 1 or depth < 1:
            raise InvalidArgument(f"topk, depth: must be >= 1, got {topk}, {depth}")
        return cls.cartesian([topk] * depth)

    # -- the topology --------------------------------------------------------------------------
    @property
    def parents(self) -> tuple[int, ...]:
        """``parents[n]``; ``-1`` for the root."""
        return self._parents

    @property
    def ranks(self) -> tuple[int, ...]:
        """Sibling rank of each node (``-1`` for the root)."""
        return self._ranks

    @property
    def num_nodes(self) -> int:
        """``N + 1``: the root and the draft nodes (the rows of ``node_tokens``)."""
        return len(self._parents)

    @property
    def num_draft_nodes(self) -> int:
        """``N``: the drafted tokens."""
        return len(self._parents) - 1

    @property
    def depths(self) -> tuple[int, ...]:
        """Depth of each node (the root is at 0; a draft node at depth d carries the d-th token of its path)."""
        return self._depths

    @property
    def max_depth(self) -> int:
        """The longest path, in draft tokens: at most ``max_depth + 1`` tokens are emitted per step."""
        return self._depths[-1]

    @property
    def children(self) -> tuple[tuple[int, ...], ...]:
        """Children of each node, in rank order."""
        return self._children

    @property
    def leaves(self) -> tuple[int, ...]:
        """Nodes without children (where a fully accepted path draws its bonus token)."""
        return tuple(n for n, kids in enumerate(self._children) if not kids)

    @property
    def internal_nodes(self) -> tuple[int, ...]:
        """Nodes with children (the rows of ``draft_probs`` that are read)."""
        return tuple(n for n, kids in enumerate(self._children) if kids)

    @property
    def max_children(self) -> int:
        """The largest number of children of one node."""
        return max(len(kids) for kids in self._children)

    @property
    def level_starts(self) -> tuple[int, ...]:
        """Nodes at depth ``d`` are ``range(level_starts[d], level_starts[d + 1])``."""
        return self._level_starts

    def level(self, depth: int) -> range:
        """The nodes at ``depth``."""
        return range(self._level_starts[depth], self._level_starts[depth + 1])

    @property
    def paths(self) -> tuple[tuple[int, ...], ...]:
        """Each node's path of sibling ranks from the root (``()`` for the root)."""
        return self._paths

    def to_paths(self) -> list[tuple[int, ...]]:
        """The draft nodes' paths, in node order: ``DraftTree.from_paths(tree.to_paths()) == tree``."""
        return list(self._paths[1:])

    def path_nodes(self, node: int) -> tuple[int, ...]:
        """The draft nodes from depth 1 down to ``node`` (empty for the root)."""
        node = _as_int(node, "node")
        if not 0 <= node < self.num_nodes:
            raise InvalidArgument(f"node: expected a node in [0, {self.num_nodes}), got {node}")
        out = []
        while node > 0:
            out.append(node)
            node = self._parents[node]
        return tuple(reversed(out))

    def path_index(self, device: torch.device | str | None = None) -> torch.Tensor:  # [num_nodes, max_depth]
        """``[N + 1, max_depth]`` int64: row ``n`` lists :meth:`path_nodes` (n), padded with -1 on the right."""
        out = torch.full((self.num_nodes, self.max_depth), -1, dtype=torch.int64)
        for n in range(1, self.num_nodes):
            nodes = self.path_nodes(n)
            out[n, : len(nodes)] = torch.tensor(nodes, dtype=torch.int64)
        return out.to(device) if device is not None else out

    def parents_tensor(self, device: torch.device | str | None = None) -> torch.Tensor:  # [num_nodes]
        """``parents`` as int64 (``-1`` at the root)."""
        return torch.tensor(self._parents, dtype=torch.int64, device=device)

    def as_chains(self) -> Optional[tuple[int, int]]:
        """``(num_drafts, draft_len)`` when this is ``DraftTree.chains(num_drafts, draft_len)``, else None."""
        num_drafts, draft_len = len(self._children[0]), self.max_depth
        if self.num_draft_nodes != num_drafts * draft_len:
            return None
        return (num_drafts, draft_len) if self == DraftTree.chains(num_drafts, draft_len) else None

    def describe(self) -> str:
        """One line for reports: size, depth and the number of nodes per level."""
        widths = [self._level_starts[d + 1] - self._level_starts[d] for d in range(1, self.max_depth + 1)]
        chains = self.as_chains()
        kind = f"{chains[0]} chains of {chains[1]}, " if chains else ""
        return f"draft tree: {kind}{self.num_draft_nodes} draft nodes, depth {self.max_depth}, per level {widths}"

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, DraftTree):
            return NotImplemented
        return self._parents == other._parents and self._ranks == other._ranks

    def __hash__(self) -> int:
        return hash((self._parents, self._ranks))

    def __repr__(self) -> str:
        return f"DraftTree.from_paths({self.to_paths()!r})"


def topk_order(draft_probs: torch.Tensor) -> torch.Tensor:  # [..., vocab_size] int64
    """Tokens by decreasing draft probability, ties broken by the smallest token id (the ``"topk"`` order).

    ``draft_probs`` is ``[..., vocab_size]``; entry ``r`` of the result is the token of rank ``r``.

    Examples
    --------
    >>> topk_order(torch.tensor([0.2, 0.4, 0.0, 0.4])).tolist()
    [1, 3, 0, 2]
    """
    # a stable sort keeps equal probabilities in increasing token order
    return torch.sort(draft_probs, dim=-1, descending=True, stable=True).indices


def draft_scheme_violation(
    tree: DraftTree,
    node_tokens: torch.Tensor,  # [batch_size, num_nodes] int64, entry 0 unused
    draft_probs: Optional[torch.Tensor],  # [batch_size, num_nodes, vocab_size] or None
    scheme: str,
) -> Optional[str]:
    """Why ``node_tokens`` could not have been drafted under ``scheme``, or None when they could.

    ``"iid"``: a drafted token with zero draft probability at its parent.  ``"without_replacement"``:
    that, or two siblings with one token.  ``"topk"``: siblings that repeat a token, or (with
    ``draft_probs``) a child that is not the token of its rank in :func:`topk_order` of its parent's
    row.  ``"none"``: never.  Shapes are assumed valid (see ``check_tree_inputs``).
    """
    if scheme not in TREE_DRAFT_SCHEMES:
        raise InvalidArgument(f"scheme: expected one of {TREE_DRAFT_SCHEMES}, got {scheme!r}")
    if scheme == "none" or node_tokens.shape[0] == 0:
        return None
    batch_size = node_tokens.shape[0]
    device = node_tokens.device
    parents = tree.parents_tensor(device)[1:]  # [N]
    tokens = node_tokens[:, 1:]  # [batch_size, N]
    if scheme in ("iid", "without_replacement"):
        if draft_probs is None:
            return f"scheme {scheme!r} needs draft_probs, got None"
        vocab_size = draft_probs.shape[-1]
        flat = draft_probs.reshape(batch_size, -1)
        mass = flat.gather(1, parents * vocab_size + tokens)  # [batch_size, N]: draft_probs[b, parent(n), token(n)]
        zero = mass <= 0
        if bool(zero.any()):
            b, i = zero.nonzero()[0].tolist()
            return (
                f"node {i + 1} of batch row {b} carries token {int(tokens[b, i])}, which has zero draft probability "
                f"at its parent node {int(parents[i])}, so it cannot have been drafted"
            )
    if scheme in ("without_replacement", "topk"):
        pairs = [(a, b) for kids in tree.children for a, b in itertools.combinations(kids, 2)]
        if pairs:
            first = torch.tensor([a for a, _ in pairs], device=device)
            second = torch.tensor([b for _, b in pairs], device=device)
            same = node_tokens[:, first] == node_tokens[:, second]  # [batch_size, num_pairs]
            if bool(same.any()):
                b, j = same.nonzero()[0].tolist()
                return (
                    f"sibling nodes {pairs[j][0]} and {pairs[j][1]} of batch row {b} both carry token "
                    f"{int(node_tokens[b, pairs[j][0]])}; siblings are distinct under {scheme!r}"
                )
    if scheme == "topk" and draft_probs is not None:
        vocab_size = draft_probs.shape[-1]
        ranks = torch.tensor(tree.ranks[1:], device=device)
        if int(ranks.max()) >= vocab_size:
            n = int(ranks.argmax()) + 1
            return f"node {n} has rank {tree.ranks[n]}, beyond the vocabulary of {vocab_size} tokens"
        internal = list(tree.internal_nodes)
        order = topk_order(draft_probs[:, internal])  # [batch_size, num_internal, vocab_size]
        slot = torch.full((tree.num_nodes,), -1, dtype=torch.int64)
        slot[internal] = torch.arange(len(internal))
        expected = order[:, slot[tree.parents_tensor()[1:]].to(device), ranks]  # [batch_size, N]
        wrong = expected != tokens
        if bool(wrong.any()):
            b, i = wrong.nonzero()[0].tolist()
            return (
                f"node {i + 1} of batch row {b} has rank {tree.ranks[i + 1]} but carries token {int(tokens[b, i])}, "
                f"not {int(expected[b, i])}, the token of that rank in its parent's draft distribution"
            )
    return None
