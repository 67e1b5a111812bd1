"""Slow, obviously-correct oracles for the tree verifiers and the tree draft schemes.

Plain Python: parent lists, lists of floats, dicts.  One realisation of the node tokens at a time,
written from docs/rules/trees.md, so that the batched tree verifiers and the drafting harness can
be compared against them.
"""

from __future__ import annotations

import itertools

from tests.oracles.rules import _normalise, kseq, recursive_rejection


def target_only(tokens, draft, target):
    """Target-only at a node: accept x with R(x), else R(x) = 0 and renormalise; draft is not read."""
    remaining, accept = list(target), []
    for x in tokens:
        total = sum(remaining)
        accept.append(remaining[x] / total if total > 0 else 0.0)
        remaining[x] = 0.0
    return accept, _normalise(remaining, target)


TREE_RULES = {
    "tree-rrs": recursive_rejection,
    "tree-rrs-wor": lambda tokens, draft, target: recursive_rejection(tokens, draft, target, True),
    "tree-target-only": target_only,
    "tree-spectr": kseq,
}


def children_of(parents):
    """Children lists, in node order."""
    kids = [[] for _ in parents]
    for n in range(1, len(parents)):
        kids[parents[n]].append(n)
    return kids


def path_tokens(parents, node_tokens, node):
    """The tokens on the path root -> node (root excluded)."""
    out = []
    while node > 0:
        out.append(node_tokens[node])
        node = parents[node]
    return tuple(reversed(out))


def tree_law(rule, parents, node_tokens, draft_rows, target_rows) -> dict:
    """Exact law {(accepted_node, next_token): prob} of the tree walk, one realisation.

    ``draft_rows[n]`` / ``target_rows[n]``: lists over the vocabulary (draft rows of leaves unused).
    Nodes with one token path form a class, named by its smallest node; its children are all its
    nodes' children, in node order, drafted from the draft row of its first node with children.
    """
    kids = children_of(parents)
    law: dict = {}

    def walk(members, reach):
        canon = members[0]
        candidates = sorted(c for m in members for c in kids[m])
        if not candidates:
            for y, t in enumerate(target_rows[canon]):
                law[(canon, y)] = law.get((canon, y), 0.0) + reach * t
            return
        tokens = [node_tokens[c] for c in candidates]
        # the class's draft row: that of a member with children (rows of leaves are not read)
        source = next(m for m in members if kids[m])
        accept, residual = rule(tokens, draft_rows[source], target_rows[canon])
        out = [0.0] * len(residual)
        none = 1.0
        for x, a in zip(tokens, accept):
            out[x] += none * a
            none *= 1 - a
        out = [o + none * r for o, r in zip(out, residual)]
        for y, mass in enumerate(out):
            if mass == 0:
                continue
            nxt = [c for c in candidates if node_tokens[c] == y]
            if nxt:
                walk(nxt, reach * mass)
            else:
                law[(canon, y)] = law.get((canon, y), 0.0) + reach * mass

    walk([0], 1.0)
    return law


def topk_tokens(dist, ranks):
    """The tokens of the given ranks: by decreasing probability, ties to the smallest id."""
    order = sorted(range(len(dist)), key=lambda x: (-dist[x], x))
    return [order[r] for r in ranks]


def realisations(parents, ranks, scheme, draft_fn, vocab_size):
    """Every realisation of the node tokens under ``scheme`` with its probability.

    ``draft_fn(path) -> list`` is the draft law after a token path.  Returns a list of
    ``(node_tokens, weight)`` with ``node_tokens[0] = 0``; realisations of probability 0 are left out.
    ``"topk"`` and ``"none"`` give the one top-k realisation.
    """
    kids = children_of(parents)
    num_nodes = len(parents)
    out = []

    def extend(tokens, node, weight):
        # draw the children of nodes in node order; `node` is the next parent to expand
        if node == num_nodes:
            out.append((tuple(tokens), weight))
            return
        children = kids[node]
        if not children:
            extend(tokens, node + 1, weight)
            return
        dist = draft_fn(path_tokens(parents, tokens, node))
        if scheme == "iid":
            choices = itertools.product(range(vocab_size), repeat=len(children))
        elif scheme == "without_replacement":
            choices = itertools.permutations(range(vocab_size), len(children))
        else:
            choices = [tuple(topk_tokens(dist, [ranks[c] for c in children]))]
        for choice in choices:
            w = weight
            if scheme == "iid":
                for x in choice:
                    w *= dist[x]
            elif scheme == "without_replacement":
                left = list(dist)
                for x in choice:
                    total = sum(left)
                    w *= left[x] / total if total > 0 else 0.0
                    left[x] = 0.0
            if w == 0:
                continue
            new = list(tokens)
            for c, x in zip(children, choice):
                new[c] = x
            extend(new, node + 1, w)

    extend([0] * num_nodes, 0, 1.0)
    return out


def implied_law(emitted: dict, target_fn, length: int) -> dict:
    """F(w) over strings of ``length``: the emitted law, continued with the target to that length.

    ``emitted`` maps token tuples to probabilities; ``target_fn(path) -> list`` is the target law.
    """
    implied: dict = {}
    for m in range(1, length + 1):
        nxt: dict = {}
        for u, mass in implied.items():
            for x, t in enumerate(target_fn(u)):
                if t > 0:
                    nxt[u + (x,)] = nxt.get(u + (x,), 0.0) + mass * t
        for s, mass in emitted.items():
            if len(s) == m:
                nxt[s] = nxt.get(s, 0.0) + mass
        implied = nxt
    return implied


def string_law(target_fn, length: int) -> dict:
    """q(w) over strings of ``length`` with positive probability."""
    law = {(): 1.0}
    for _ in range(length):
        law = {u + (x,): mass * t for u, mass in law.items() for x, t in enumerate(target_fn(u)) if t > 0}
    return law
