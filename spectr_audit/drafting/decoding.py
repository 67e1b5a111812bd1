"""The decoding loop: draft, verify, commit, and carry corrections, until N tokens exist.

:func:`decode` runs whole speculative-decoding iterations on ``batch_size``
independent rows (each row emits 1 to ``draft_len + 1`` tokens per iteration,
so rows advance at different rates; contexts are kept right-aligned with
``PAD`` on the left, as the models expect).  Carried corrections returned by
the verifier (:mod:`spectr_audit.contract.correction`) are applied to the next
iterations' targets.  :func:`complete` extends given strings with samples from
the (possibly corrected) target: the statistical audit completes each emitted
string to a fixed length with it.  :func:`emitted_tokens` turns verdicts into
strings.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch

from spectr_audit.contract.verifier import Verifier, VerifyOutput
from spectr_audit.contract.correction import CarriedCorrection, CorrectionChain
from spectr_audit.errors import InvalidArgument
from spectr_audit.drafting.harness import draft
from spectr_audit.drafting.models import PAD, Model
from spectr_audit.contract.randomness import RandomSource, sample_categorical, uniform

__all__ = ["complete", "decode", "emitted_tokens"]


def emitted_tokens(
    draft_tokens: torch.Tensor,  # [batch_size, num_drafts, draft_len]
    output: VerifyOutput,
) -> tuple[torch.Tensor, torch.Tensor]:  # ([batch_size, draft_len + 1], [batch_size])
    """The emitted strings, left-aligned and ``PAD``-filled, and their lengths.

    Examples
    --------
    >>> import torch
    >>> out = VerifyOutput(torch.tensor([1]), torch.tensor([0]), torch.tensor([7]))
    >>> tokens, lengths = emitted_tokens(torch.tensor([[[3, 4]]]), out)
    >>> tokens.tolist(), lengths.tolist()
    ([[3, 7, -1]], [2])
    """
    batch_size, _, draft_len = draft_tokens.shape
    rows = torch.arange(batch_size, device=draft_tokens.device)
    path = draft_tokens[rows, output.draft_index]  # [batch_size, draft_len]
    positions = torch.arange(draft_len + 1, device=draft_tokens.device)
    padded = torch.cat([path, torch.full_like(path[:, :1], PAD)], dim=1)
    tokens = torch.where(positions < output.num_accepted.unsqueeze(1), padded, torch.full_like(padded, PAD))
    tokens = tokens.scatter(1, output.num_accepted.unsqueeze(1), output.next_token.unsqueeze(1))
    return tokens, output.num_accepted + 1


def _check_prefix(prefix: Sequence[int], vocab_size: int) -> torch.Tensor:
    tokens = torch.as_tensor(list(prefix), dtype=torch.int64)
    if tokens.dim() != 1 or bool(((tokens < 0) | (tokens >= vocab_size)).any()):
        raise InvalidArgument(f"prefix: expected a sequence of token ids in [0, {vocab_size}), got {list(prefix)!r}")
    return tokens


def _contexts(
    prefix: torch.Tensor,  # [prefix_len]
    generated: torch.Tensor,  # [n, capacity], left-aligned
    lengths: torch.Tensor,  # [n]
) -> torch.Tensor:  # [n, prefix_len + max(lengths)], right-aligned, PAD on the left
    """``prefix + generated[:length]`` per row, right-aligned to one width."""
    prefix_len = prefix.shape[0]
    width = prefix_len + int(lengths.max()) if lengths.numel() else prefix_len
    full = torch.cat([prefix.to(generated.device).expand(generated.shape[0], -1), generated], dim=1)
    # Column c of a row holds position c - (width - prefix_len - length) of prefix + generated.
    source = torch.arange(width, device=generated.device) - (width - prefix_len - lengths).unsqueeze(1)
    picked = full.gather(1, source.clamp(min=0, max=full.shape[1] - 1))
    return torch.where(source >= 0, picked, torch.full_like(picked, PAD))


def append_tokens(
    generated: torch.Tensor,  # [n, capacity]
    lengths: torch.Tensor,  # [n]
    tokens: torch.Tensor,  # [n, m], left-aligned
    counts: torch.Tensor,  # [n]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Append ``tokens[:, :count]`` after each row's ``length`` tokens."""
    positions = lengths.unsqueeze(1) + torch.arange(tokens.shape[1], device=tokens.device)
    keep = torch.arange(tokens.shape[1], device=tokens.device) < counts.unsqueeze(1)
    rows = torch.arange(generated.shape[0], device=generated.device).unsqueeze(1).expand_as(positions)
    generated = generated.index_put((rows[keep], positions[keep]), tokens[keep])
    return generated, lengths + counts


def decode(
    verifier: Verifier,
    draft_model: Model,
    target_model: Model,
    num_tokens: int,
    num_drafts: int,
    draft_len: int,
    batch_size: int,
    generator: RandomSource = None,
    prefix: Sequence[int] = (),
) -> torch.Tensor:  # [batch_size, num_tokens]
    """Speculative decoding of ``num_tokens`` tokens after ``prefix``, on ``batch_size`` rows.

    Parameters
    ----------
    verifier : Verifier
        Drafts are drawn with its declared ``draft_scheme``.  A carried correction in its
        ``VerifyOutput.correction`` is applied to the following iterations' targets.
    draft_model, target_model : Model
    num_tokens : int
        Tokens to produce per row (the last iteration's surplus is dropped).
    num_drafts, draft_len : int
        K and L of every iteration.
    batch_size : int
        Independent rows, decoded together.
    generator : torch.Generator or InjectedUniforms, optional
        The one source of drafting and verification randomness.
    prefix : sequence of int
        The context before the first iteration.

    Returns
    -------
    torch.Tensor
        ``[batch_size, num_tokens]`` int64: the first ``num_tokens`` tokens of every row.

    Notes
    -----
    For an exact verifier (or one exact together with its carried correction) each row
    follows the target's law of ``num_tokens``-token strings; the exact law of this loop
    is :func:`spectr_audit.exact.multi_iteration.exact_multi_iteration`.  Rows that have
    finished are dropped from later iterations.

    Examples
    --------
    >>> import torch
    >>> from spectr_audit.drafting.models import ContextFreeModel
    >>> from spectr_audit.registry import load_verifier
    >>> tokens = decode(load_verifier("block"), ContextFreeModel([0.6, 0.4]), ContextFreeModel([0.3, 0.7]),
    ...                 num_tokens=5, num_drafts=1, draft_len=3, batch_size=4,
    ...                 generator=torch.Generator().manual_seed(0))
    >>> tuple(tokens.shape)
    (4, 5)
    """
    for name, value, low in (("num_tokens", num_tokens, 1), ("num_drafts", num_drafts, 1),
                             ("draft_len", draft_len, 1), ("batch_size", batch_size, 0)):
        if not isinstance(value, int) or value < low:
            raise InvalidArgument(f"{name}: expected an integer >= {low}, got {value!r}")
    verifier.check_supports(num_drafts, draft_len)
    prefix_tokens = _check_prefix(prefix, draft_model.vocab_size)
    generated = torch.full((batch_size, num_tokens + draft_len), PAD, dtype=torch.int64)
    lengths = torch.zeros(batch_size, dtype=torch.int64)
    rows = torch.arange(batch_size)  # rows still decoding
    chain = CorrectionChain()
    while rows.numel():
        contexts = _contexts(prefix_tokens, generated[rows], lengths[rows])
        batch = draft(draft_model, target_model, contexts, num_drafts, draft_len, generator, verifier.draft_scheme)
        target_probs, seen = chain.adjust(batch.draft_tokens, batch.draft_probs, batch.target_probs)
        output = verifier.verify(batch.draft_tokens, batch.draft_probs, target_probs, generator)
        tokens, counts = emitted_tokens(batch.draft_tokens, output)
        new_generated, new_lengths = append_tokens(generated[rows], lengths[rows], tokens, counts)
        generated[rows], lengths[rows] = new_generated, new_lengths
        chain = chain.advance(
            batch.draft_tokens, batch.draft_probs, seen,
            output.num_accepted, output.draft_index, output.next_token, new=output.correction,
        )
        unfinished = (new_lengths < num_tokens).nonzero().squeeze(1)
        rows, chain = rows[unfinished], chain.select(unfinished)
    return generated[:, :num_tokens]


def complete(
    target_model: Model,
    tokens: torch.Tensor,  # [batch_size, length], left-aligned, PAD after each row's string
    lengths: torch.Tensor,  # [batch_size]
    num_tokens: int,
    generator: RandomSource = None,
    *,
    prefix: Sequence[int] = (),
    correction: Optional[CarriedCorrection] = None,
    draft_model: Optional[Model] = None,
) -> torch.Tensor:  # [batch_size, num_tokens]
    """Extend each row's string to ``num_tokens`` tokens with samples from the target.

    Parameters
    ----------
    target_model : Model
    tokens : torch.Tensor
        ``[batch_size, length]`` int64, e.g. emitted strings from :func:`emitted_tokens`.
    lengths : torch.Tensor
        ``[batch_size]`` int64, the valid tokens of each row (at most ``num_tokens`` are kept).
    num_tokens : int
    generator : torch.Generator or InjectedUniforms, optional
    prefix : sequence of int
        The context before the strings.
    correction : CarriedCorrection, optional
        A carried correction positioned after the strings (``VerifyOutput.correction`` of
        the iteration that emitted them): the continuation then follows the corrected
        target, as the decoding loop's would.
    draft_model : Model, optional
        Required with ``correction``: corrections may read draft conditionals.

    Returns
    -------
    torch.Tensor
        ``[batch_size, num_tokens]`` int64.

    Examples
    --------
    >>> import torch
    >>> from spectr_audit.drafting.models import ContextFreeModel
    >>> out = complete(ContextFreeModel([0.0, 1.0]), torch.tensor([[0, -1]]), torch.tensor([1]), 3)
    >>> out.tolist()
    [[0, 1, 1]]
    """
    if not isinstance(num_tokens, int) or num_tokens < 1:
        raise InvalidArgument(f"num_tokens: expected an integer >= 1, got {num_tokens!r}")
    if tokens.dim() != 2 or tokens.dtype != torch.int64:
        raise InvalidArgument(f"tokens: expected int64 [batch_size, length], got {tokens.dtype} {tuple(tokens.shape)}")
    if tuple(lengths.shape) != (tokens.shape[0],) or bool(((lengths < 0) | (lengths > tokens.shape[1])).any()):
        raise InvalidArgument(f"lengths: expected [{tokens.shape[0]}] values in [0, {tokens.shape[1]}], got {lengths.tolist()}")
    if correction is not None and draft_model is None:
        raise InvalidArgument("draft_model: required when a correction is given (it reads draft conditionals)")
    vocab_size = target_model.vocab_size
    prefix_tokens = _check_prefix(prefix, vocab_size)
    batch_size = tokens.shape[0]
    lengths = lengths.clamp(max=num_tokens)
    width = max(num_tokens, tokens.shape[1])
    generated = torch.full((batch_size, width), PAD, dtype=torch.int64)
    generated[:, : tokens.shape[1]] = tokens
    valid = torch.arange(tokens.shape[1]) < lengths.unsqueeze(1)
    if bool(((tokens < 0) | (tokens >= vocab_size))[valid].any()):
        raise InvalidArgument(f"tokens: the first lengths[b] tokens of each row must lie in [0, {vocab_size})")
    chain = CorrectionChain(() if correction is None else (correction,))
    rows = (lengths < num_tokens).nonzero().squeeze(1)
    chain = chain.select(rows)
    while rows.numel():
        contexts = _contexts(prefix_tokens, generated[rows], lengths[rows])
        target = target_model(contexts).double()  # [n, vocab_size]
        if chain.corrections:
            # The node is a one-level tree: its draft conditional at level 0, a placeholder leaf.
            draft_dist = draft_model(contexts).double()
            tree_tokens = draft_dist.argmax(-1).view(-1, 1, 1)
            target_tree = target.view(-1, 1, 1, vocab_size).expand(-1, 1, 2, -1)
            adjusted, seen = chain.adjust(tree_tokens, draft_dist.view(-1, 1, 1, vocab_size), target_tree)
            target = adjusted[:, 0, 0]
        next_token = sample_categorical(target, uniform(generator, (rows.numel(),), target.device))
        new_generated, new_lengths = append_tokens(
            generated[rows], lengths[rows], next_token.unsqueeze(1), torch.ones_like(next_token)
        )
        generated[rows], lengths[rows] = new_generated, new_lengths
        if chain.corrections:
            zeros = torch.zeros_like(next_token)
            chain = chain.advance(tree_tokens, draft_dist.view(-1, 1, 1, vocab_size), seen, zeros, zeros, next_token)
        unfinished = (new_lengths < num_tokens).nonzero().squeeze(1)
        rows, chain = rows[unfinished], chain.select(unfinished)
    return generated[:, :num_tokens]
