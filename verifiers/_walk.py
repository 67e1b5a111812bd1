"""Tree walks for verifiers that decide one tree level at a time.

Token-level multi-draft rules (single-draft speculative sampling, K-SEQ,
recursive rejection sampling) all have the same shape at a node: the surviving
drafts' next tokens are tried *in order*, draft ``i`` is accepted with a
probability ``accept_probs[i]`` that is fixed once the drafts are known, the
first accepted one is the output, and if none is accepted the output is drawn
from a ``residual`` distribution.  A :class:`NodeRule` returns those two
things; :class:`ChainWalkVerifier` walks the draft tree with it (the SpecTr tree,
docs/rules/spectr-tree.md: a drawn token that matches surviving drafts continues
along them, otherwise the walk stops) and derives both the sampler and the
exact law from the same numbers.
"""

from __future__ import annotations

from typing import Optional

import torch

from spectr_audit.contract.verifier import Verifier, VerifyOutput
from spectr_audit.contract.randomness import sample_categorical, sample_categorical_with_total, uniform
from spectr_audit.verifiers import triton_kernels
from spectr_audit.verifiers.triton_kernels import LazyResidual

__all__ = ["NodeRule", "ChainWalkVerifier", "gather_tokens", "normalise"]


def gather_tokens(
    dist: torch.Tensor,  # [n, vocab_size]
    tokens: torch.Tensor,  # [n, num_drafts]
) -> torch.Tensor:  # [n, num_drafts]
    """``dist[r, tokens[r, i]]``."""
    return dist.gather(-1, tokens)


def normalise(
    mass: torch.Tensor,  # [n, vocab_size], non-negative
    fallback: torch.Tensor,  # [n, vocab_size]
) -> torch.Tensor:  # [n, vocab_size]
    """``mass / mass.sum()``, or ``fallback`` on rows with no mass (such rows are never sampled)."""
    total = mass.sum(-1, keepdim=True)
    safe = torch.where(total > 0, total, torch.ones_like(total))
    return torch.where(total > 0, mass / safe, fallback)


class NodeRule:
    """One tree node's decision: per-draft acceptance probabilities and a residual."""

    def __call__(
        self,
        tokens: torch.Tensor,  # [n, num_drafts] int64, the drafts' tokens at this node
        survivors: torch.Tensor,  # [n, num_drafts] bool, drafts that reached this node
        draft_dist: torch.Tensor,  # [n, vocab_size] float64, draft conditional at the node
        target_dist: torch.Tensor,  # [n, vocab_size] float64, target conditional at the node
    ) -> tuple[torch.Tensor, torch.Tensor]:  # ([n, num_drafts], [n, vocab_size])
        raise NotImplementedError

    def sampler_parts(
        self,
        tokens: torch.Tensor,  # [n, num_drafts] int64
        survivors: torch.Tensor,  # [n, num_drafts] bool
        draft_dist: torch.Tensor,  # [n, vocab_size] float32 or float64, on the simplex within the input tolerance
        target_dist: torch.Tensor,  # [n, vocab_size] same dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:  # ([n, num_drafts], [n, vocab_size] non-negative, unnormalised)
        """The sampler's view of ``__call__``: the residual may be unnormalised, or all zero on rows never sampled.

        :meth:`ChainWalkVerifier._verify` only draws from the residual (``sample_categorical`` takes
        unnormalised mass) and falls back to the target on rows with no residual mass, so rules
        override this to skip ``__call__``'s normalisation pass.  The exact law keeps ``__call__``.
        """
        return self(tokens, survivors, draft_dist, target_dist)

    def sampler_accept_probs(
        self,
        tokens: torch.Tensor,  # [n, num_drafts] int64
        survivors: torch.Tensor,  # [n, num_drafts] bool
        draft_dist: torch.Tensor,  # [n, vocab_size] float32 or float64, as for sampler_parts
        target_dist: torch.Tensor,  # [n, vocab_size] same dtype
    ) -> torch.Tensor | None:  # [n, num_drafts], or None
        """:meth:`sampler_parts`'s acceptance probabilities alone, bit for bit, where they need no residual; ``None``
        (this default) where the rule has none cheaper than :meth:`sampler_parts` itself.

        A rule that returns them lets :class:`ChainWalkVerifier` decide acceptance first and build the residual
        (a full pass over the row) only for the rows that reject every draft.  Optional: rules that do not
        override it are walked as before.
        """
        return None

    def chain_sampler_parts(
        self,
        tokens: torch.Tensor,  # [n, num_drafts] int64
        survivors: torch.Tensor,  # [n, num_drafts] bool
        draft_dist: torch.Tensor,  # [n, vocab_size]
        target_dist: torch.Tensor,  # [n, vocab_size]
    ):  # ([n, num_drafts], [n, vocab_size] tensor or LazyResidual)
        """:meth:`sampler_parts` for :class:`ChainWalkVerifier`, whose residual may also be a
        :class:`~spectr_audit.verifiers.triton_kernels.LazyResidual` (read only by the residual draw).

        Rules with a Triton kernel for their residual (docs/architecture.md) override this; the
        default is :meth:`sampler_parts`.
        """
        return self.sampler_parts(tokens, survivors, draft_dist, target_dist)


def _as_law(probs: torch.Tensor) -> torch.Tensor:
    """float64 rows renormalised to sum to 1 (inputs are on the simplex only within a tolerance)."""
    probs = probs.double()
    return probs / probs.sum(-1, keepdim=True)


def _sampler_dtype(probs: torch.Tensor) -> torch.Tensor:
    """float64 stays float64; float32 stays as is (no copy); half precision is widened to float32 and renormalised.

    Half-precision rows miss 1 by up to ~1e-3 (the validation tolerance grows with V), enough for a
    sampler on the raw rows to drift from the exact law, which renormalises; the widening copy is
    made anyway, so renormalising it costs one sum.
    """
    if probs.dtype in (torch.float32, torch.float64):
        return probs
    widened = probs.float()
    total = widened.sum(-1, keepdim=True)
    return widened.div_(torch.where(total > 0, total, torch.ones_like(total)))


def _sample_or_fallback(
    residual: torch.Tensor,  # [n, vocab_size] non-negative, possibly unnormalised or all zero
    fallback,  # [n, vocab_size], or a function returning it (built only when some row needs it)
    u: torch.Tensor,  # [n]
    needed: torch.Tensor | None = None,  # [n] bool: the rows whose draw is used (default: all)
) -> torch.Tensor:  # [n] int64
    """A draw from ``residual``, or from ``fallback`` on rows where the residual has no mass.

    On the CPU a check of the residuals' totals costs no device round trip, and skips the fallback
    draw (a full pass over its rows) in the usual case where every residual has mass (every row in
    ``needed``: a row whose draw the caller discards may have none); on an accelerator both draws
    run and a ``where`` picks, with no host sync.
    """
    if isinstance(residual, LazyResidual):  # block sums from a kernel, values recomputed in the drawn block
        drawn, total = residual.sample_with_total(u)
    else:
        drawn, total = sample_categorical_with_total(residual, u)
    if u.device.type == "cpu" and bool(((total > 0) if needed is None else (total > 0) | ~needed).all()):
        return drawn
    rows = fallback() if callable(fallback) else fallback
    return torch.where(total > 0, drawn, sample_categorical(rows, u))


def _rows_of(
    dists: torch.Tensor,  # [B, K, V]
    index: torch.Tensor,  # [B] int64 in [0, K)
    batch_rows: Optional[torch.Tensor] = None,  # [n] int64: only these batch rows (default: all)
) -> torch.Tensor:  # [B, V], or [n, V]
    """``dists[b, index[b]]``: one row per batch row, by ``index_select`` on a flat view where the strides allow one
    (a contiguous copy of B rows, several times faster on the CPU than advanced indexing)."""
    batch_size, num_drafts, vocab_size = dists.shape
    if batch_rows is None:
        batch_rows = torch.arange(batch_size, device=index.device)
    else:
        index = index.index_select(0, batch_rows)
    if dists.stride(0) == num_drafts * dists.stride(1) and dists.stride(2) == 1:
        flat = dists.as_strided((batch_size * num_drafts, vocab_size), (dists.stride(1), 1))
        return flat.index_select(0, batch_rows * num_drafts + index)
    return dists[batch_rows, index]


def _first_true(mask: torch.Tensor) -> torch.Tensor:
    """Index of the first True along the last dim (0 where there is none).

    ``max`` returns the first maximal index (documented), and is about twice as fast as ``argmax`` on
    the CPU for short rows.
    """
    return mask.to(torch.uint8).max(-1).indices


class ChainWalkVerifier(Verifier):
    """A verifier defined by a :class:`NodeRule`, walked down the draft tree.

    Subclasses set ``rule``.  Randomness per level: ``num_drafts`` acceptance
    uniforms and one residual uniform per row, then one bonus uniform per row,
    all from :func:`spectr_audit.contract.randomness.uniform`.
    """

    rule: NodeRule

    def _node_inputs(self, draft_tokens, draft_probs, target_probs, level, canon, rows=None):
        """Sampler inputs at ``level``: tokens ``[B, K]`` and the canonical draft's conditionals ``[B, V]``.

        float32 and float64 rows are used as given (no copy, no renormalisation): the sampler only
        compares ratios and draws by inverse CDF, and each copy is a full pass; half precision is
        widened and renormalised (:func:`_sampler_dtype`).  ``rows``: only these batch rows (``[n]``).
        """
        if rows is not None:
            tokens = draft_tokens[:, :, level].index_select(0, rows)
            draft_dist, target_dist = _rows_of(draft_probs[:, :, level], canon, rows), _rows_of(target_probs[:, :, level], canon, rows)
            return tokens, _sampler_dtype(draft_dist), _sampler_dtype(target_dist)
        if draft_probs.shape[1] == 1 or level == 0:
            # one draft, or the root (every draft survives there): canon is 0, so a view avoids a gather
            # copy of every row
            draft_dist, target_dist = draft_probs[:, 0, level], target_probs[:, 0, level]
        else:
            draft_dist, target_dist = _rows_of(draft_probs[:, :, level], canon), _rows_of(target_probs[:, :, level], canon)
        return draft_tokens[:, :, level], _sampler_dtype(draft_dist), _sampler_dtype(target_dist)

    def _split_node(self, draft_tokens, draft_probs, target_probs, level, survivors, alive, generator):
        """One level decided acceptance first, with the residual built only on the rows that need it, or ``None``.

        On the CPU (where counting rows costs no device round trip), for float32/float64 rows read in place
        (one draft, or the root, where the canonical draft is the first), and for a rule that has its
        acceptance probabilities apart (:meth:`NodeRule.sampler_accept_probs`): the acceptance probabilities of
        every row (a gather of the drafted tokens), then the level's uniforms, then the residual of the rows
        that are still walking and reject every draft only.  Each row's numbers depend on that row alone, so
        the tokens are those of evaluating every row; the uniforms are drawn as in :meth:`_verify`.
        Returns the level's output token ``[B]`` (meaningful on the walking rows), or ``None`` where the level is
        evaluated as a whole (:meth:`_verify`).
        """
        batch_size, num_drafts, _ = draft_tokens.shape
        device = draft_tokens.device
        if device.type != "cpu" or (num_drafts > 1 and level > 0) or draft_probs.dtype not in (
                torch.float32, torch.float64):
            return None
        draft_dist, target_dist = draft_probs[:, 0, level], target_probs[:, 0, level]
        if triton_kernels.fused_rows(draft_dist):
            return None
        tokens = draft_tokens[:, :, level]
        accept_probs = self.rule.sampler_accept_probs(tokens, survivors, draft_dist, target_dist)
        if accept_probs is None:
            return None
        u = uniform(generator, (batch_size, num_drafts + 1), device)
        passed = survivors & (u[:, :num_drafts] < accept_probs)
        output = tokens.gather(1, _first_true(passed).unsqueeze(1)).squeeze(1)
        rejected = (alive & ~passed.any(-1)).nonzero().squeeze(1)
        if rejected.numel() > 0:
            node_draft, node_target = draft_dist.index_select(0, rejected), target_dist.index_select(0, rejected)
            _, residual = self.rule.chain_sampler_parts(
                tokens.index_select(0, rejected), survivors.index_select(0, rejected), node_draft, node_target
            )
            drawn = _sample_or_fallback(residual, node_target, u[:, num_drafts].index_select(0, rejected))
            output = output.index_copy(0, rejected, drawn)
        return output

    def _verify(self, draft_tokens, draft_probs, target_probs, generator) -> VerifyOutput:
        batch_size, num_drafts, draft_len = draft_tokens.shape
        device = draft_tokens.device
        survivors = torch.ones(batch_size, num_drafts, dtype=torch.bool, device=device)
        alive = torch.ones(batch_size, dtype=torch.bool, device=device)
        num_accepted = torch.zeros(batch_size, dtype=torch.int64, device=device)
        draft_index = torch.zeros(batch_size, dtype=torch.int64, device=device)
        next_token = torch.zeros(batch_size, dtype=torch.int64, device=device)
        for level in range(draft_len):
            # every draft survives at the root, where the canonical draft is the first
            canon = torch.zeros(batch_size, dtype=torch.int64, device=device) if level == 0 else _first_true(survivors)
            # Below the root, on the CPU (where counting costs no device round trip), the node is evaluated on the
            # rows whose walk goes on only: each row's numbers depend on that row alone, and a stopped row's
            # output is never read.  The uniforms are drawn for every row, as before.
            rows = None
            if level > 0 and device.type == "cpu" and int(alive.sum()) < batch_size:
                rows = alive.nonzero().squeeze(1)
                if rows.numel() == 0:  # every walk has stopped: the level's uniforms are drawn all the same
                    uniform(generator, (batch_size, num_drafts + 1), device)
                    continue
            output = self._split_node(draft_tokens, draft_probs, target_probs, level, survivors, alive, generator)
            if output is not None:
                tokens = draft_tokens[:, :, level]
            else:
                node = self._node_inputs(draft_tokens, draft_probs, target_probs, level, canon, rows)
                tokens, draft_dist, target_dist = node
                at_node = survivors if rows is None else survivors.index_select(0, rows)
                accept_probs, residual = self.rule.chain_sampler_parts(tokens, at_node, draft_dist, target_dist)
                u = uniform(generator, (batch_size, num_drafts + 1), device)
                u_node = u if rows is None else u.index_select(0, rows)
                passed = at_node & (u_node[:, :num_drafts] < accept_probs)
                accepted_token = tokens.gather(1, _first_true(passed).unsqueeze(1)).squeeze(1)
                rejected = ~passed.any(-1)
                output = torch.where(rejected.logical_not(), accepted_token,
                                     _sample_or_fallback(residual, target_dist, u_node[:, num_drafts], rejected))
                if rows is not None:
                    output = torch.zeros(batch_size, dtype=torch.int64, device=device).index_copy_(0, rows, output)
                    tokens = draft_tokens[:, :, level]
            matching = survivors & (tokens == output.unsqueeze(1))
            stop = alive & ~matching.any(-1)
            next_token = torch.where(stop, output, next_token)
            num_accepted = torch.where(stop, level, num_accepted)
            draft_index = torch.where(stop, canon, draft_index)
            alive = alive & ~stop
            survivors = torch.where(alive.unsqueeze(1), matching, survivors)
        canon = _first_true(survivors)
        u = uniform(generator, (batch_size,), device)
        bonus_rows = target_probs[:, :, draft_len]
        walking = alive.nonzero().squeeze(1) if device.type == "cpu" else None
        if walking is not None and 3 * walking.numel() <= batch_size:
            # On the CPU, few rows pass every level: draw the bonus of those rows only, from a copy of their rows
            # (each row's draw depends on that row and its uniform alone)
            if walking.numel() > 0:
                bonus = sample_categorical(_sampler_dtype(_rows_of(bonus_rows, canon, walking)), u.index_select(0, walking))
                next_token = next_token.index_copy(0, walking, bonus)
        else:
            bonus_dist = bonus_rows[:, 0] if num_drafts == 1 else _rows_of(bonus_rows, canon)
            bonus = sample_categorical(_sampler_dtype(bonus_dist), u)
            next_token = torch.where(alive, bonus, next_token)
        num_accepted = torch.where(alive, draft_len, num_accepted)
        draft_index = torch.where(alive, canon, draft_index)
        return VerifyOutput(num_accepted, draft_index, next_token)

    def _output_probs(self, draft_tokens, draft_probs, target_probs) -> torch.Tensor:
        batch_size, num_drafts, draft_len = draft_tokens.shape
        vocab_size = draft_probs.shape[-1]
        device = draft_tokens.device
        out = torch.zeros(batch_size * num_drafts, draft_len + 1, vocab_size, dtype=torch.float64, device=device)
        # reach[b * K + k]: probability that the walk reaches the node draft_tokens[b, k, :level]; non-zero
        # only for the canonical (smallest) index of each distinct prefix.
        reach = torch.zeros(batch_size * num_drafts, dtype=torch.float64, device=device)
        reach[::num_drafts] = 1.0
        draft_ids = torch.arange(num_drafts, device=device)
        earlier = torch.ones(num_drafts, num_drafts, dtype=torch.bool, device=device).tril(-1)  # [j, i]: i < j
        for level in range(draft_len):
            # Only reachable nodes are evaluated (a data-dependent shape: fine for an exact law, not a hot path).
            active = (reach > 0).nonzero().squeeze(1)
            rows, canon = active // num_drafts, active % num_drafts
            prefix = draft_tokens[rows, :, :level]  # [n, K, level]
            survivors = (prefix == draft_tokens[rows, canon, :level].unsqueeze(1)).all(-1)  # [n, K]
            tokens = draft_tokens[rows, :, level]
            draft_dist = _as_law(draft_probs[rows, canon, level])
            target_dist = _as_law(target_probs[rows, canon, level])
            accept_probs, residual = self.rule(tokens, survivors, draft_dist, target_dist)
            accept_probs = torch.where(survivors, accept_probs, torch.zeros_like(accept_probs))
            # P(draft i is the first accepted) = a_i * prod_{j < i} (1 - a_j)
            reject_all_before = torch.cumprod(1 - accept_probs, dim=-1)
            none_accepted = reject_all_before[:, -1:]
            before = torch.cat([torch.ones_like(none_accepted), reject_all_before[:, :-1]], dim=-1)
            token_law = (none_accepted * residual).scatter_add(1, tokens, accept_probs * before)
            mass = reach[active].unsqueeze(1) * token_law  # [n, vocab_size]
            continues = torch.zeros_like(mass).scatter_add(1, tokens, survivors.double()) > 0
            out[active, level] = torch.where(continues, torch.zeros_like(mass), mass)
            # A drawn token that some survivor carries continues along the first survivor carrying it.
            dup_before = (tokens.unsqueeze(2) == tokens.unsqueeze(1)) & survivors.unsqueeze(1) & earlier
            first_of_token = survivors & ~dup_before.any(-1)  # [n, K]
            child_mass = mass.gather(1, tokens) * first_of_token
            reach = torch.zeros_like(reach).index_add_(
                0, (rows.unsqueeze(1) * num_drafts + draft_ids).reshape(-1), child_mass.reshape(-1)
            )
        out[:, draft_len] = reach.unsqueeze(1) * _as_law(target_probs[:, :, draft_len, :]).reshape(-1, vocab_size)
        return out.reshape(batch_size, num_drafts, draft_len + 1, vocab_size)
