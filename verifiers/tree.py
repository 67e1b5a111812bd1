"""Tree verifiers: one node rule applied at every node of a :class:`~spectr_audit.contract.tree.DraftTree`.

The walk (docs/rules/trees.md) starts at the root.  At the current node the rule is given the
node's children, tried *in order*: child ``i`` is accepted with a probability fixed once the drafts
are known, the first accepted child's token is the output, and if none is accepted the output is
drawn from the rule's residual.  If the output is the token of a child, the walk moves to that
child and repeats; otherwise the step ends with the output as the correction token.  At a node
without children the output is the bonus token, drawn from the target.

Under ``"iid"`` siblings may repeat a token.  The walk then treats the nodes that carry one token
path as one node (their *class*), whose children are all their children in node order: those
children are i.i.d. from the draft law at that path, which is what the rules need.  Reports name the
smallest node of the class (the canonical node); the draft row is read at the class's first node
that has children (rows of leaves are never read).  Under the other schemes siblings are distinct
and every class is a single node.

Both the sampler and the exact law come from the same rule numbers, as in
:mod:`spectr_audit.verifiers._walk` (whose :class:`~spectr_audit.verifiers._walk.NodeRule` classes are
reused here).
"""

from __future__ import annotations

import torch

from spectr_audit.contract.randomness import sample_categorical, uniform
from spectr_audit.contract.tree import DraftTree
from spectr_audit.contract.tree_verifier import TreeVerifier, TreeVerifyOutput
from spectr_audit.verifiers._walk import (
    NodeRule,
    _first_true,
    _rows_of,
    _sample_or_fallback,
    _sampler_dtype,
    normalise,
)
from spectr_audit.verifiers.kseq import KSeqRule
from spectr_audit.verifiers.recursive_rejection import RecursiveRejectionRule

__all__ = [
    "RuleTreeVerifier",
    "TargetOnlyRule",
    "TreeRecursiveRejection",
    "TreeRecursiveRejectionWithoutReplacement",
    "TreeSpecTr",
    "TreeTargetOnly",
]


def _walk_step(stop, output, canon, next_token, accepted_node, alive) -> tuple:
    """``(next token, accepted node, rows still walking)`` after a depth: a row that stops there emits ``output``
    and ends at the class's canonical node ``canon``."""
    return torch.where(stop, output, next_token), torch.where(stop, canon, accepted_node), alive & ~stop


def _walk_start(tree: DraftTree, node_tokens: torch.Tensor) -> tuple:
    """The state a tree walk starts from: ``(batch_size, device, level starts, parents, which nodes have children,
    the current class over its level (the root's), rows still walking, accepted node, next token)``."""
    batch_size, device = node_tokens.shape[0], node_tokens.device
    has_children = torch.tensor([bool(kids) for kids in tree.children], device=device)
    return (batch_size, device, tree.level_starts, tree.parents_tensor(device), has_children,
            torch.ones(batch_size, 1, dtype=torch.bool, device=device),
            torch.ones(batch_size, dtype=torch.bool, device=device),
            torch.zeros(batch_size, dtype=torch.int64, device=device),
            torch.zeros(batch_size, dtype=torch.int64, device=device))


class TargetOnlyRule(NodeRule):
    """Target-only verification at a node: the children's tokens are tried against a shrinking residual.

    ``R = q``; child ``x`` is accepted with ``R(x)``; on a rejection ``R(x) = 0`` and ``R`` is
    renormalised; if no child is accepted the output is drawn from ``R``.  Every token ``y`` then
    comes out with probability ``q(y)`` whatever the tokens were, so no draft probability is read.
    """

    def __call__(self, tokens, survivors, draft_dist, target_dist):
        accept_probs, remaining = self.sampler_parts(tokens, survivors, draft_dist, target_dist)
        return accept_probs, normalise(remaining, target_dist)

    def sampler_parts(self, tokens, survivors, draft_dist, target_dist):
        # Closed form of the sequential rule, two passes over the vocabulary instead of one per child:
        # before child i the residual is q with the distinct earlier candidates' tokens removed, so
        # R(x_i) = q(x_i) / (rest + sum of q over the distinct candidate tokens not yet tried), where
        # rest is q's mass off every candidate token: a sum of non-negative terms (1 - removed mass
        # would cancel when little is left).
        num_children = tokens.shape[1]
        drafted = target_dist.gather(1, tokens)  # [n, num_children]
        earlier = torch.ones(num_children, num_children, dtype=torch.bool, device=tokens.device).tril(-1)  # [i, j]: j < i
        repeat = ((tokens.unsqueeze(2) == tokens.unsqueeze(1)) & survivors.unsqueeze(1) & earlier).any(-1)
        fresh = survivors & ~repeat  # the first candidate carrying each token; a repeat has R(x) = 0
        covered = torch.zeros_like(target_dist).scatter_add_(1, tokens, survivors.to(target_dist.dtype)) > 0
        remaining = torch.where(covered, torch.zeros_like(target_dist), target_dist)  # [n, vocab_size]
        fresh_mass = torch.where(fresh, drafted, torch.zeros_like(drafted))
        untried = fresh_mass.flip(-1).cumsum(-1).flip(-1)  # mass of the fresh tokens at positions >= i
        total = remaining.sum(-1, keepdim=True) + untried
        ratio = fresh_mass / torch.where(total > 0, total, torch.ones_like(total))
        accept_probs = torch.where(fresh & (total > 0), ratio.clamp(max=1.0), torch.zeros_like(ratio))
        return accept_probs, remaining


class RuleTreeVerifier(TreeVerifier):
    """A tree verifier defined by a :class:`~spectr_audit.verifiers._walk.NodeRule`, walked down the tree.

    Subclasses set ``rule`` and ``draft_schemes``.  Randomness per depth ``d`` (one call each, from
    :func:`spectr_audit.contract.randomness.uniform`): ``w + 1`` uniforms per row, where ``w`` is the
    number of nodes at depth ``d + 1`` (acceptance tries, then the residual draw); at the deepest
    level one uniform per row for the bonus.

    Rules must return the target as the residual on rows without candidates (the walk enforces it).
    When ``draft_probs`` is None (scheme ``"none"``) the rule is given the target in its place.
    """

    rule: NodeRule

    def _verify_tree(self, tree: DraftTree, node_tokens, draft_probs, target_probs, generator) -> TreeVerifyOutput:
        if node_tokens.device.type != "cpu":
            return self._verify_tree_batched(tree, node_tokens, draft_probs, target_probs, generator)
        batch_size, device, starts, parents, has_children, members, alive, accepted_node, next_token = \
            _walk_start(tree, node_tokens)
        for depth in range(tree.max_depth + 1):
            lo = starts[depth]
            canon = lo + _first_true(members)  # [batch_size]
            # On the CPU (where counting costs no device round trip) a node's rows are read only for the rows
            # whose walk goes on, and the rule runs only where the class has children: each row's numbers
            # depend on that row alone, a stopped row's output is never read, and a class without children
            # draws from the target (the residual every rule gives there).  The uniforms are drawn for every
            # row, as the batched walk draws them, so the verdicts are the same.
            if depth < tree.max_depth:
                child_lo, child_hi = starts[depth + 1], starts[depth + 2]
                candidates = members[:, parents[child_lo:child_hi] - lo]  # [batch_size, width]: children of the class
                tokens = node_tokens[:, child_lo:child_hi]
                width = tokens.shape[1]
                u = uniform(generator, (batch_size, width + 1), device)
                with_children = candidates.any(-1)
                evaluated, leaf_rows = _split_rows(alive & with_children, alive & ~with_children)
                output = torch.zeros(batch_size, dtype=torch.int64, device=device)
                if evaluated is None or evaluated.numel() > 0:
                    node_tokens_ = tokens if evaluated is None else tokens.index_select(0, evaluated)
                    at_node = candidates if evaluated is None else candidates.index_select(0, evaluated)
                    u_node = u if evaluated is None else u.index_select(0, evaluated)
                    target_dist = _node_rows(target_probs, depth, canon, evaluated)
                    if draft_probs is None:
                        draft_dist = target_dist
                    else:
                        # the class's children were drafted from the row of a member that has children
                        source = lo + _first_true(members & has_children[lo : starts[depth + 1]])
                        draft_dist = _node_rows(draft_probs, depth, source, evaluated)
                    accept_probs, residual = self.rule.chain_sampler_parts(node_tokens_, at_node, draft_dist, target_dist)
                    passed = at_node & (u_node[:, :width] < accept_probs)
                    accepted_token = node_tokens_.gather(1, _first_true(passed).unsqueeze(1)).squeeze(1)
                    drawn = _sample_or_fallback(residual, target_dist, u_node[:, width])
                    chosen = torch.where(passed.any(-1), accepted_token, drawn)
                    output = chosen if evaluated is None else output.index_copy_(0, evaluated, chosen)
                if leaf_rows is not None:
                    leaf_target = _node_rows(target_probs, depth, canon, leaf_rows)
                    output.index_copy_(0, leaf_rows, sample_categorical(leaf_target, u[:, width].index_select(0, leaf_rows)))
                matching = candidates & (tokens == output.unsqueeze(1))
                stop = alive & ~matching.any(-1)
            else:
                u = uniform(generator, (batch_size,), device)
                evaluated, _ = _split_rows(alive, None)
                output = torch.zeros(batch_size, dtype=torch.int64, device=device)
                if evaluated is None or evaluated.numel() > 0:
                    bonus = sample_categorical(_node_rows(target_probs, depth, canon, evaluated),
                                               u if evaluated is None else u.index_select(0, evaluated))
                    output = bonus if evaluated is None else output.index_copy_(0, evaluated, bonus)
                matching = None
                stop = alive
            next_token, accepted_node, alive = _walk_step(stop, output, canon, next_token, accepted_node, alive)
            members = matching
        return TreeVerifyOutput(accepted_node, next_token)

    def _verify_tree_batched(self, tree: DraftTree, node_tokens, draft_probs, target_probs, generator) -> TreeVerifyOutput:
        """:meth:`_verify_tree` off the CPU: every row at every depth, with no host synchronisation."""
        batch_size, device, starts, parents, has_children, members, alive, accepted_node, next_token = \
            _walk_start(tree, node_tokens)
        rows = torch.arange(batch_size, device=device)
        for depth in range(tree.max_depth + 1):
            lo = starts[depth]
            canon = lo + _first_true(members)  # [batch_size]
            target_dist = _sampler_dtype(target_probs[:, 0] if depth == 0 else target_probs[rows, canon])
            if depth < tree.max_depth:
                child_lo, child_hi = starts[depth + 1], starts[depth + 2]
                candidates = members[:, parents[child_lo:child_hi] - lo]  # [batch_size, width]: children of the class
                tokens = node_tokens[:, child_lo:child_hi]
                if draft_probs is None:
                    draft_dist = target_dist
                elif depth == 0:
                    draft_dist = _sampler_dtype(draft_probs[:, 0])
                else:
                    # the class's children were drafted from the row of a member that has children
                    source = lo + _first_true(members & has_children[lo : starts[depth + 1]])
                    draft_dist = _sampler_dtype(draft_probs[rows, source])
                accept_probs, residual = self.rule.sampler_parts(tokens, candidates, draft_dist, target_dist)
                residual = torch.where(candidates.any(-1, keepdim=True), residual, target_dist)
                width = tokens.shape[1]
                u = uniform(generator, (batch_size, width + 1), device)
                passed = candidates & (u[:, :width] < accept_probs)
                accepted_token = tokens.gather(1, _first_true(passed).unsqueeze(1)).squeeze(1)
                drawn = _sample_or_fallback(residual, target_dist, u[:, width])
                output = torch.where(passed.any(-1), accepted_token, drawn)
                matching = candidates & (tokens == output.unsqueeze(1))
                stop = alive & ~matching.any(-1)
            else:
                output = sample_categorical(target_dist, uniform(generator, (batch_size,), device))
                matching = None
                stop = alive
            next_token, accepted_node, alive = _walk_step(stop, output, canon, next_token, accepted_node, alive)
            members = matching
        return TreeVerifyOutput(accepted_node, next_token)

    def _tree_output_probs(self, tree: DraftTree, node_tokens, draft_probs, target_probs) -> torch.Tensor:
        batch_size, num_nodes = node_tokens.shape
        vocab_size = target_probs.shape[-1]
        device = node_tokens.device
        starts = tree.level_starts
        parents = tree.parents_tensor(device)
        has_children = torch.tensor([bool(kids) for kids in tree.children], device=device)
        out = torch.zeros(batch_size, num_nodes, vocab_size, dtype=torch.float64, device=device)
        # reach[b, n]: probability that the walk reaches the class of canonical node n (zero elsewhere)
        reach = torch.zeros(batch_size, num_nodes, dtype=torch.float64, device=device)
        reach[:, 0] = 1.0
        canonical = torch.zeros(batch_size, 1, dtype=torch.int64, device=device)  # canonical node of each level node
        for depth in range(tree.max_depth + 1):
            lo, hi = starts[depth], starts[depth + 1]
            if depth == tree.max_depth:
                out[:, lo:hi] = reach[:, lo:hi].unsqueeze(-1) * target_probs[:, lo:hi]
                break
            child_lo, child_hi = starts[depth + 1], starts[depth + 2]
            tokens_all = node_tokens[:, child_lo:child_hi]  # [batch_size, width]
            parent_class = canonical[:, parents[child_lo:child_hi] - lo]  # [batch_size, width]
            # two children are one class when their parents are and they carry one token
            same = (parent_class.unsqueeze(2) == parent_class.unsqueeze(1)) & (
                tokens_all.unsqueeze(2) == tokens_all.unsqueeze(1)
            )
            child_canonical = child_lo + _first_true(same)  # [batch_size, width]
            # only reachable classes are evaluated (a data-dependent shape: fine for an exact law)
            active = (reach[:, lo:hi] > 0).nonzero()
            b, node = active[:, 0], lo + active[:, 1]
            candidates = parent_class[b] == node.unsqueeze(1)  # [n, width]
            tokens = tokens_all[b]
            target_dist = target_probs[b, node]
            if draft_probs is None:
                draft_dist = target_dist
            else:
                # the class's children were drafted from the row of a member that has children
                members = (canonical[b] == node.unsqueeze(1)) & has_children[lo:hi]
                draft_dist = draft_probs[b, lo + _first_true(members)]
            accept_probs, residual = self.rule(tokens, candidates, draft_dist, target_dist)
            residual = torch.where(candidates.any(-1, keepdim=True), residual, target_dist)
            accept_probs = torch.where(candidates, accept_probs, torch.zeros_like(accept_probs))
            # P(child i is the first accepted) = a_i * prod_{j < i} (1 - a_j)
            reject_all_before = torch.cumprod(1 - accept_probs, dim=-1)
            none_accepted = reject_all_before[:, -1:]
            before = torch.cat([torch.ones_like(none_accepted), reject_all_before[:, :-1]], dim=-1)
            token_law = (none_accepted * residual).scatter_add(1, tokens, accept_probs * before)
            mass = reach[b, node].unsqueeze(1) * token_law  # [n, vocab_size]
            continues = torch.zeros_like(mass).scatter_add(1, tokens, candidates.double()) > 0
            out[b, node] = torch.where(continues, torch.zeros_like(mass), mass)
            # an output carried by a candidate moves the walk to that token's class (its first candidate)
            first = candidates & (child_canonical[b] == torch.arange(child_lo, child_hi, device=device))
            child_mass = mass.gather(1, tokens) * first
            reach[:, child_lo:child_hi].index_put_((b,), child_mass, accumulate=True)
            canonical = child_canonical
        return out


def _split_rows(
    evaluated: torch.Tensor,  # [batch_size] bool: rows whose rule is evaluated
    leaves: torch.Tensor | None,  # [batch_size] bool: rows that draw from the target, or None
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """The rows of ``evaluated`` (None: every row) and of ``leaves`` (None: no row), read on the host (CPU only)."""
    rows = None if bool(evaluated.all()) else evaluated.nonzero().squeeze(1)
    leaf_rows = None if leaves is None or not bool(leaves.any()) else leaves.nonzero().squeeze(1)
    return rows, leaf_rows


def _node_rows(
    probs: torch.Tensor,  # [batch_size, num_nodes, vocab_size]
    depth: int,
    node: torch.Tensor,  # [batch_size] int64
    rows: torch.Tensor | None,  # [n] int64, or None for every row
) -> torch.Tensor:  # [n, vocab_size], the sampler's dtype
    """``probs[b, node[b]]`` for the batch rows ``rows``: a view at the root, else one copy of each row read."""
    if depth == 0:  # the root is node 0 of every row
        return _sampler_dtype(probs[:, 0] if rows is None else probs[:, 0].index_select(0, rows))
    return _sampler_dtype(_rows_of(probs, node, rows))


class TreeRecursiveRejection(RuleTreeVerifier):
    """Recursive rejection sampling over a tree, children drawn i.i.d. (SpecInfer).

    At each node ``R = q, D = p``: the children are tried in order, child ``x`` accepted with
    ``min(1, R(x) / D(x))``, and after a rejection ``R = normalise((R - D)_+)``; the accepted child's
    subtree continues.  Repeated siblings are tried again, each copy a trial.

    Examples
    --------
    >>> import torch
    >>> from spectr_audit.contract.tree import DraftTree
    >>> tree = DraftTree.chains(2, 1)                       # two i.i.d. siblings of the root
    >>> node_tokens = torch.tensor([[0, 0, 0]])             # both drafted token 0
    >>> draft_probs = torch.tensor([[[0.6, 0.4]] * 3], dtype=torch.float64)
    >>> target_probs = torch.tensor([[[0.3, 0.7]] * 3], dtype=torch.float64)
    >>> law = TreeRecursiveRejection().tree_output_probs(tree, node_tokens, draft_probs, target_probs)
    >>> round(float(law[0, 1].sum()), 6)                    # token 0 accepted at the first try: 0.3 / 0.6
    0.5
    """

    name = "tree-rrs"
    description = "recursive rejection sampling over a draft tree, children drawn i.i.d."
    draft_schemes = ("iid",)
    rule = RecursiveRejectionRule(without_replacement=False)


class TreeRecursiveRejectionWithoutReplacement(RuleTreeVerifier):
    """Recursive rejection sampling over a tree whose siblings are drawn without replacement.

    As :class:`TreeRecursiveRejection`, and after each rejection the rejected token is also removed
    from ``D`` and ``D`` renormalised: the ratio uses the law the next sibling was drawn from.
    EAGLE-1 at T > 0 is this rule: eagle-llm 1.2.1 draws siblings without replacement
    (``eagle/model/cnets.py:711``, ``torch.multinomial(probabilities, k, replacement=False)``) and
    zeroes the earlier siblings in the draft law before each residual (``eagle/model/utils.py:397-405``).
    """

    name = "tree-rrs-wor"
    description = "recursive rejection sampling over a draft tree, siblings drawn without replacement"
    draft_schemes = ("without_replacement",)
    rule = RecursiveRejectionRule(without_replacement=True)


class TreeTargetOnly(RuleTreeVerifier):
    """Target-only tree verification (EAGLE-2/3; SGLang's sampling route at T > 0 with top-k drafts).

    At each node the children are tried in order against ``R = q``: child ``x`` is accepted with
    ``R(x)``, and on a rejection ``R(x) = 0`` and ``R`` is renormalised.  Exact for any given tokens,
    so under every draft scheme, and it reads no draft probability.

    Examples
    --------
    >>> import torch
    >>> from spectr_audit.contract.tree import DraftTree
    >>> tree = DraftTree.from_paths([(0,), (1,)])
    >>> target_probs = torch.tensor([[[0.5, 0.3, 0.2]] * 3], dtype=torch.float64)
    >>> law = TreeTargetOnly().tree_output_probs(tree, torch.tensor([[0, 2, 1]]), None, target_probs)
    >>> [round(float(law[0, n].sum()), 6) for n in range(3)]   # node 1 carries token 2, node 2 token 1
    [0.5, 0.2, 0.3]
    """

    name = "tree-target-only"
    description = "target-only tree verification: children accepted with the residual target probability"
    draft_schemes = ("topk", "none", "iid", "without_replacement")
    rule = TargetOnlyRule()


class TreeSpecTr(RuleTreeVerifier):
    """The SpecTr rule on a general tree: K-SEQ over the children of each node, k = their number.

    Defined for children drawn i.i.d. (K-SEQ's requirement); rho* is recomputed at every node for
    the number of its children.  On ``DraftTree.chains(K, L)`` it is the SpecTr draft tree.
    """

    name = "tree-spectr"
    description = "SpecTr on a draft tree: K-SEQ over the children of every node"
    draft_schemes = ("iid",)
    rule = KSeqRule()
