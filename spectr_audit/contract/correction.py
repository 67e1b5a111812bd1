"""Carried corrections: a verifier's repair of the *next* iterations' target.

Some block verifiers (greedy block verification, SpecTr-GBV's Algorithm 2) are
not exact in one iteration with the unmodified target; they become exact when
the decoding loop replaces the target distribution at the nodes just below
the emitted string.  This module is the optional contract extension for that.

The protocol
------------
A verifier returns a correction in ``VerifyOutput.correction``: one object for
the whole batch, holding per-row data, *positioned after the string the
iteration emitted*.  It must provide

``adjust(draft_tokens, draft_probs, target_probs) -> target_probs``
    Called by the loop on the next iteration's draft tree, whose root is the
    end of everything committed so far.  ``target_probs`` is the target the
    correction's own iteration was verifying against, evaluated at the new
    tree's nodes (that is, with older corrections already applied); it returns
    the corrected target of the same shape ``[batch_size, num_drafts,
    draft_len + 1, vocab_size]``.  Rows and nodes it does not touch are passed
    through unchanged.  The bonus level ``draft_len`` has no draft conditional
    and is passed through: a correction never needs it there, because its
    horizon (below) is at most the correcting iteration's ``draft_len + 1``
    tokens and it starts after at least one emitted token.
``advance(draft_tokens, draft_probs, target_probs, num_accepted, draft_index, next_token)``
    Called after that iteration committed its own emitted string
    ``draft_tokens[b, draft_index, :num_accepted] + [next_token]``, with the
    same ``target_probs`` that ``adjust`` received.  Returns the correction
    positioned after the new string, or ``None`` once no row has anything left
    to correct (the correction has expired: the committed string is past its
    horizon).
``select(rows) -> correction``
    The same correction restricted to (or repeated along) the given rows, so
    that loops can drop finished rows and exact audits can branch rows.

Optionally ``fingerprint() -> [batch_size, d]`` float64, equal for rows whose
corrections behave identically (zeros for rows with nothing to correct); the
exact multi-iteration audit merges such histories.  Without it the audit
keeps every history apart (correct, slower).

For the exact multi-iteration audit, a verifier that carries corrections also
provides ``carried_correction(draft_tokens, draft_probs, target_probs,
num_accepted, draft_index, next_token)``: the correction its ``verify`` would
return for the given verdicts (it must depend on the verdict and the draft
tree only, not on the verifier's coins beyond the verdict).

Composition
-----------
Corrections stack: iteration t verifies against the target already corrected
by every live older correction, and its own correction repairs *that* target.
:class:`CorrectionChain` applies live corrections oldest first, keeps what
each one saw, advances all of them after the iteration, and drops expired
ones; at most ``draft_len + 1`` are ever live at once, since every iteration
commits at least one token.

Third-party verifiers
---------------------
Any object with the three methods above works; :class:`JointResidualCorrection`
is the built-in one and a worked example.  A third party subclasses
:class:`spectr_audit.contract.verifier.Verifier`, returns its correction in
``VerifyOutput(..., correction=...)`` and, to be audited exactly, defines
``carried_correction`` with the signature above.
"""

from __future__ import annotations

import dataclasses
from typing import Optional, Protocol, Sequence, runtime_checkable

import torch

__all__ = [
    "CarriedCorrection",
    "CorrectionChain",
    "JointResidualCorrection",
    "emitted_path_probs",
    "has_carried_correction",
]


@runtime_checkable
class CarriedCorrection(Protocol):
    """What the decoding loop needs from a carried correction (see the module docstring)."""

    def adjust(
        self,
        draft_tokens: torch.Tensor,  # [batch_size, num_drafts, draft_len]
        draft_probs: torch.Tensor,  # [batch_size, num_drafts, draft_len, vocab_size]
        target_probs: torch.Tensor,  # [batch_size, num_drafts, draft_len + 1, vocab_size]
    ) -> torch.Tensor:  # [batch_size, num_drafts, draft_len + 1, vocab_size]
        ...

    def advance(
        self,
        draft_tokens: torch.Tensor,  # [batch_size, num_drafts, draft_len]
        draft_probs: torch.Tensor,  # [batch_size, num_drafts, draft_len, vocab_size]
        target_probs: torch.Tensor,  # [batch_size, num_drafts, draft_len + 1, vocab_size]
        num_accepted: torch.Tensor,  # [batch_size]
        draft_index: torch.Tensor,  # [batch_size]
        next_token: torch.Tensor,  # [batch_size]
    ) -> Optional["CarriedCorrection"]:
        ...

    def select(self, rows: torch.Tensor) -> "CarriedCorrection":  # rows: [n] int64
        ...


def has_carried_correction(verifier) -> bool:
    """Whether ``verifier`` declares carried corrections (so the multi-iteration audit is its judge)."""
    return callable(getattr(verifier, "carried_correction", None))


def _picked(probs: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:  # [..., vocab_size], [...] -> [...]
    """The probability of each token under its law, in float64 (gathered first: the same values as converting the
    whole rows, without reading them)."""
    return probs.gather(-1, tokens.unsqueeze(-1)).squeeze(-1).double()


def emitted_path_probs(
    draft_tokens: torch.Tensor,  # [batch_size, num_drafts, draft_len]
    draft_probs: torch.Tensor,  # [batch_size, num_drafts, draft_len, vocab_size]
    target_probs: torch.Tensor,  # [batch_size, num_drafts, draft_len + 1, vocab_size]
    num_accepted: torch.Tensor,  # [batch_size]
    draft_index: torch.Tensor,  # [batch_size]
    next_token: torch.Tensor,  # [batch_size]
) -> tuple[torch.Tensor, torch.Tensor]:  # ([batch_size], [batch_size])
    """Joint draft and target probabilities of each row's emitted string, from the tree's root.

    When ``num_accepted == draft_len`` the last token is a bonus drawn at a leaf,
    where the tree has no draft conditional; its draft factor is then reported
    as 1 (callers only use it for strings that stay inside a horizon, which a
    full draft plus bonus never does).
    """
    batch_size, _, draft_len = draft_tokens.shape
    rows = torch.arange(batch_size, device=draft_tokens.device)
    path = draft_tokens[rows, draft_index]  # [batch_size, draft_len]
    # the probabilities read one by one (no copy of the selected draft's rows), in float64
    at = (rows.unsqueeze(-1), draft_index.unsqueeze(-1), torch.arange(draft_len, device=draft_tokens.device), path)
    drafted, targeted = draft_probs[at].double(), target_probs[at].double()
    accepted = torch.arange(draft_len, device=draft_tokens.device) < num_accepted.unsqueeze(-1)
    one = torch.ones_like(drafted)
    draft_joint = torch.where(accepted, drafted, one).prod(-1)
    target_joint = torch.where(accepted, targeted, one).prod(-1)
    level = num_accepted.clamp(max=draft_len - 1)
    last_draft = draft_probs[rows, draft_index, level, next_token].double()
    last_draft = torch.where(num_accepted < draft_len, last_draft, torch.ones_like(last_draft))
    last_target = target_probs[rows, draft_index, num_accepted, next_token].double()
    return draft_joint * last_draft, target_joint * last_target


def _path_ratios(
    draft_tokens: torch.Tensor,  # [batch_size, num_drafts, draft_len]
    draft_probs: torch.Tensor,  # [batch_size, num_drafts, draft_len, vocab_size]
    target_probs: torch.Tensor,  # [batch_size, num_drafts, draft_len + 1, vocab_size]
) -> torch.Tensor:  # [batch_size, num_drafts, draft_len]
    """p(w) / q(w) for every node w = draft_tokens[b, k, :l] of the tree (inf where q(w) = 0 < p(w))."""
    draft_len = draft_tokens.shape[-1]
    drafted = _picked(draft_probs, draft_tokens)
    targeted = _picked(target_probs[:, :, :draft_len], draft_tokens)
    ones = torch.ones_like(drafted[..., :1])
    draft_joint = torch.cat([ones, drafted[..., :-1]], -1).cumprod(-1)
    target_joint = torch.cat([ones, targeted[..., :-1]], -1).cumprod(-1)
    # A drafted path has p(w) > 0; q(w) = 0 makes the node unreachable under the target.
    return draft_joint / target_joint


@dataclasses.dataclass(frozen=True)
class JointResidualCorrection:
    """Draw from the joint residual below the emitted string, within a horizon.

    At every node ``u`` that extends the string emitted by the correcting
    iteration and lies fewer than ``horizon`` tokens below that iteration's
    start, the next token is drawn from

        q~(x | u)  ∝  q(ux) * (1 - min(1, p(ux) / q(ux)) ** exponent)

    where ``p`` and ``q`` are joint draft and target probabilities counted
    from the correcting iteration's start (``q`` is the target that iteration
    verified against).  Where that mass is zero the target is left unchanged.
    With ``exponent = 1`` this is ``(q(ux) - p(ux))_+`` normalised, which is
    exactly the repair of greedy block verification (docs/rules/greedy-block.md):
    its ``q~(x|u) = (q(ux) - B(ux)) / (q(u) - B(u) + E(u))``
    with greedy block verification's prefix and exact emission laws ``B, E``
    simplifies to that residual at depths ``< draft_len`` and to ``q`` at
    depth ``draft_len``.  Only the joint ratio ``p(u) / q(u)`` of the
    committed path is carried, so the data per row is three numbers.

    Attributes
    ----------
    active : torch.Tensor
        ``[batch_size]`` bool, rows that still have nodes to correct.
    depth : torch.Tensor
        ``[batch_size]`` int64, tokens committed since the correcting iteration's start.
    ratio : torch.Tensor
        ``[batch_size]`` float64, ``p(u) / q(u)`` of those committed tokens.
    horizon : int
        Nodes fewer than this many tokens below the start are corrected.
    exponent : int
        1 for greedy block verification; K for the SpecTr-GBV variant.
    """

    # [batch_size]
    active: torch.Tensor
    # [batch_size]
    depth: torch.Tensor
    # [batch_size]
    ratio: torch.Tensor
    horizon: int
    exponent: int = 1

    @classmethod
    def after_emission(
        cls,
        draft_tokens: torch.Tensor,  # [batch_size, num_drafts, draft_len]
        draft_probs: torch.Tensor,  # [batch_size, num_drafts, draft_len, vocab_size]
        target_probs: torch.Tensor,  # [batch_size, num_drafts, draft_len + 1, vocab_size]
        num_accepted: torch.Tensor,  # [batch_size]
        draft_index: torch.Tensor,  # [batch_size]
        next_token: torch.Tensor,  # [batch_size]
        *,
        horizon: int,
        exponent: int = 1,
    ) -> Optional["JointResidualCorrection"]:
        """The correction of an iteration that emitted the given verdicts (None if nothing to correct)."""
        start = cls(
            active=torch.ones_like(num_accepted, dtype=torch.bool),
            depth=torch.zeros_like(num_accepted),
            ratio=torch.ones_like(num_accepted, dtype=torch.float64),
            horizon=horizon,
            exponent=exponent,
        )
        return start.advance(draft_tokens, draft_probs, target_probs, num_accepted, draft_index, next_token)

    def adjust(self, draft_tokens, draft_probs, target_probs):
        draft_len = draft_tokens.shape[-1]
        levels = torch.arange(draft_len, device=draft_tokens.device)
        # [batch_size, 1, draft_len]: node depth counted from the correcting iteration's start
        inside = self.active.view(-1, 1, 1) & (self.depth.view(-1, 1, 1) + levels < self.horizon)
        if not bool(inside.any()):
            return target_probs
        ratio = self.ratio.view(-1, 1, 1) * _path_ratios(draft_tokens, draft_probs, target_probs)
        target = target_probs[:, :, :draft_len].double()
        draft = draft_probs.double()
        # p(ux) / q(ux) = ratio(u) * p(x|u) / q(x|u); tokens with q(x|u) = 0 keep no mass.
        child_ratio = ratio.unsqueeze(-1) * draft / torch.where(target > 0, target, torch.ones_like(target))
        # 1 - m^K as -expm1(K log m): no cancellation when m is near 1
        mass = target * -torch.expm1(self.exponent * torch.log(child_ratio.clamp(max=1.0)))
        mass = torch.where(target > 0, mass, torch.zeros_like(mass))
        total = mass.sum(-1, keepdim=True)
        usable = inside.unsqueeze(-1) & torch.isfinite(ratio).unsqueeze(-1) & (total > 0)
        corrected = torch.where(usable, mass / torch.where(total > 0, total, torch.ones_like(total)), target)
        return torch.cat([corrected.to(target_probs.dtype), target_probs[:, :, draft_len:]], dim=2)

    def advance(self, draft_tokens, draft_probs, target_probs, num_accepted, draft_index, next_token):
        draft_joint, target_joint = emitted_path_probs(
            draft_tokens, draft_probs, target_probs, num_accepted, draft_index, next_token
        )
        depth = self.depth + num_accepted + 1
        active = self.active & (depth < self.horizon)
        ratio = self.ratio * draft_joint / target_joint
        if not bool(active.any()):
            return None
        return dataclasses.replace(
            self,
            active=active,
            depth=torch.where(active, depth, torch.zeros_like(depth)),
            ratio=torch.where(active, ratio, torch.zeros_like(ratio)),
        )

    def select(self, rows):
        return dataclasses.replace(self, active=self.active[rows], depth=self.depth[rows], ratio=self.ratio[rows])

    def fingerprint(self) -> torch.Tensor:  # [batch_size, 3]
        """Rows with equal fingerprints are corrected identically."""
        return torch.stack([self.active.double(), self.depth.double(), self.ratio], dim=-1)


@dataclasses.dataclass(frozen=True)
class CorrectionChain:
    """The live corrections of a batch, oldest first, applied and advanced together.

    Examples
    --------
    >>> chain = CorrectionChain()
    >>> len(chain.corrections)
    0
    """

    corrections: tuple = ()

    def adjust(
        self,
        draft_tokens: torch.Tensor,  # [batch_size, num_drafts, draft_len]
        draft_probs: torch.Tensor,  # [batch_size, num_drafts, draft_len, vocab_size]
        target_probs: torch.Tensor,  # [batch_size, num_drafts, draft_len + 1, vocab_size]
    ) -> tuple[torch.Tensor, tuple]:
        """The effective target, and the target each correction saw (for :meth:`advance`)."""
        seen = []
        for correction in self.corrections:
            seen.append(target_probs)
            target_probs = correction.adjust(draft_tokens, draft_probs, target_probs)
        return target_probs, tuple(seen)

    def advance(
        self,
        draft_tokens: torch.Tensor,  # [batch_size, num_drafts, draft_len]
        draft_probs: torch.Tensor,  # [batch_size, num_drafts, draft_len, vocab_size]
        seen: Sequence[torch.Tensor],  # each [batch_size, num_drafts, draft_len + 1, vocab_size]
        num_accepted: torch.Tensor,  # [batch_size]
        draft_index: torch.Tensor,  # [batch_size]
        next_token: torch.Tensor,  # [batch_size]
        new: Optional[CarriedCorrection] = None,
    ) -> "CorrectionChain":
        """Move every correction past the committed string; append ``new``; drop expired ones."""
        moved = [
            correction.advance(draft_tokens, draft_probs, target, num_accepted, draft_index, next_token)
            for correction, target in zip(self.corrections, seen)
        ]
        if new is not None:
            moved.append(new)
        return CorrectionChain(tuple(c for c in moved if c is not None))

    def select(self, rows: torch.Tensor) -> "CorrectionChain":
        """The chain restricted to (or repeated along) ``rows``."""
        return CorrectionChain(tuple(c.select(rows) for c in self.corrections))

    def fingerprint(self, batch_size: int) -> Optional[torch.Tensor]:  # [batch_size, d] or None
        """Concatenated fingerprints, or None when some correction has none."""
        parts = [torch.zeros(batch_size, 0, dtype=torch.float64)]
        for correction in self.corrections:
            method = getattr(correction, "fingerprint", None)
            if method is None:
                return None
            parts.append(method().double().cpu())
        return torch.cat(parts, dim=1)
