"""The drafting harness: draw K drafts of length L and score every node.

:func:`draft` draws drafts from the draft model (i.i.d., or without
replacement for L = 1), keeping the draft conditionals it sampled from, and
scores every node of the draft tree with the target in one batched call.
:func:`verify_step` adds the verifier call.
"""

from __future__ import annotations

import dataclasses

import torch

from spectr_audit.contract.verifier import Verifier, VerifyOutput
from spectr_audit.errors import InvalidArgument
from spectr_audit.drafting.models import PAD, Model
from spectr_audit.contract.randomness import RandomSource, sample_categorical, uniform

__all__ = ["DraftBatch", "draft", "verify_step", "left_pad"]


@dataclasses.dataclass(frozen=True)
class DraftBatch:
    """Drafts and the model conditionals at every node of their tree."""

    # [batch_size, num_drafts, draft_len]
    draft_tokens: torch.Tensor
    # [batch_size, num_drafts, draft_len, vocab_size]
    draft_probs: torch.Tensor
    # [batch_size, num_drafts, draft_len + 1, vocab_size]
    target_probs: torch.Tensor


def left_pad(tokens: torch.Tensor, length: int) -> torch.Tensor:
    """Right-align ``tokens [N, T]`` in ``[N, length]``, padding on the left with ``PAD``."""
    if tokens.shape[1] > length:
        raise InvalidArgument(f"tokens: {tokens.shape[1]} columns do not fit in {length}")
    pad = torch.full((tokens.shape[0], length - tokens.shape[1]), PAD, dtype=torch.int64, device=tokens.device)
    return torch.cat([pad, tokens], dim=1)


def draft(
    draft_model: Model,
    target_model: Model,
    contexts: torch.Tensor,  # [batch_size, context_len], right-aligned, PAD on the left
    num_drafts: int,
    draft_len: int,
    generator: RandomSource = None,
    draft_scheme: str = "iid",
) -> DraftBatch:
    """Draw ``num_drafts`` drafts of ``draft_len`` tokens after each context and score them.

    ``iid``: every draft is an independent autoregressive sample from the draft model.
    ``without_replacement`` (``draft_len`` = 1): K distinct tokens drawn one after another
    from the draft law with the drawn tokens removed (SpecInfer / Sequoia-style).

    The draft model is called once per level on ``[batch_size * num_drafts]`` rows; the
    target once on all ``batch_size * num_drafts * (draft_len + 1)`` nodes.
    """
    if contexts.dim() != 2 or contexts.dtype != torch.int64:
        raise InvalidArgument(f"contexts: expected int64 [batch_size, context_len], got {contexts.dtype} {tuple(contexts.shape)}")
    if num_drafts < 1 or draft_len < 1:
        raise InvalidArgument(f"num_drafts, draft_len: must be >= 1, got {num_drafts}, {draft_len}")
    batch_size = contexts.shape[0]
    device = contexts.device
    vocab_size = draft_model.vocab_size
    if target_model.vocab_size != vocab_size:
        raise InvalidArgument(f"target_model: vocab_size {target_model.vocab_size} differs from draft_model's {vocab_size}")
    if draft_scheme == "iid":
        rows = contexts.repeat_interleave(num_drafts, dim=0)  # [B * K, T]
        tokens = torch.zeros(batch_size * num_drafts, 0, dtype=torch.int64, device=device)
        draft_probs = []
        for _ in range(draft_len):
            dist = draft_model(torch.cat([rows, tokens], dim=1)).double()  # [B * K, V]
            draft_probs.append(dist)
            nxt = sample_categorical(dist, uniform(generator, (batch_size * num_drafts,), device))
            tokens = torch.cat([tokens, nxt.unsqueeze(1)], dim=1)
        draft_tokens = tokens.reshape(batch_size, num_drafts, draft_len)
        draft_probs_t = torch.stack(draft_probs, 1).reshape(batch_size, num_drafts, draft_len, vocab_size)
    elif draft_scheme == "without_replacement":
        if draft_len != 1:
            raise InvalidArgument(f"draft_len: drafting without replacement needs draft_len = 1, got {draft_len}")
        dist = draft_model(contexts).double()  # [B, V]
        support = (dist > 0).sum(-1)
        if bool((support < num_drafts).any()):
            raise InvalidArgument(
                f"num_drafts: {num_drafts} distinct drafts need at least that many tokens of positive draft "
                f"probability; some context has only {int(support.min())}"
            )
        remaining = dist.clone()
        picks = []
        for _ in range(num_drafts):
            nxt = sample_categorical(remaining, uniform(generator, (batch_size,), device))
            picks.append(nxt)
            remaining = remaining.scatter(1, nxt.unsqueeze(1), 0.0)
        draft_tokens = torch.stack(picks, 1).unsqueeze(-1)  # [B, K, 1]
        draft_probs_t = dist.unsqueeze(1).unsqueeze(1).expand(batch_size, num_drafts, 1, vocab_size).clone()
    else:
        raise InvalidArgument(f"draft_scheme: expected 'iid' or 'without_replacement', got {draft_scheme!r}")
    # All nodes: context + draft[:l] for l = 0 .. L, right-aligned to one width.
    width = contexts.shape[1] + draft_len
    nodes = []
    for level in range(draft_len + 1):
        prefix = draft_tokens[:, :, :level].reshape(batch_size * num_drafts, level)
        nodes.append(left_pad(torch.cat([contexts.repeat_interleave(num_drafts, 0), prefix], 1), width))
    node_contexts = torch.stack(nodes, 1).reshape(-1, width)  # [B * K * (L + 1), width]
    target_probs = target_model(node_contexts).double().reshape(batch_size, num_drafts, draft_len + 1, vocab_size)
    return DraftBatch(draft_tokens, draft_probs_t, target_probs)


def verify_step(
    verifier: Verifier,
    draft_model: Model,
    target_model: Model,
    contexts: torch.Tensor,  # [batch_size, context_len]
    num_drafts: int,
    draft_len: int,
    generator: RandomSource = None,
) -> tuple[DraftBatch, VerifyOutput]:
    """Draft with the verifier's declared scheme, then verify; returns both."""
    batch = draft(draft_model, target_model, contexts, num_drafts, draft_len, generator, verifier.draft_scheme)
    return batch, verifier.verify(batch.draft_tokens, batch.draft_probs, batch.target_probs, generator)
