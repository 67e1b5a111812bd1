"""Conversions between the contract's padded tensors and vLLM-style flat ragged batches.

The contract hands a verifier ``[batch_size, num_drafts, draft_len]`` tokens and
``[batch_size, num_drafts, draft_len (+ 1), vocab_size]`` rows.  vLLM's v1 rejection sampler
(``vllm/v1/sample/rejection_sampler.py``, ``vllm/v1/spec_decode/metadata.py``) takes one chain
per request, flattened, with a per-request number of drafts:

* ``draft_token_ids [num_tokens]``: request 0's drafts, then request 1's, ...;
* ``num_draft_tokens``: a list, the drafts of each request (0 is allowed);
* ``cu_num_draft_tokens [batch_size]``: its inclusive cumulative sum (int32), so request ``b``
  owns ``draft_token_ids[cu[b] - n_b : cu[b]]``; ``cu_num_sampled_tokens`` the same for
  ``n_b + 1``;
* the target's logits ``[num_tokens + batch_size, vocab_size]``, request-major: each request's
  ``n_b`` rows at its draft positions followed by its bonus row; ``target_logits_indices
  [num_tokens]`` and ``bonus_logits_indices [batch_size]`` pick the two kinds out
  (``rejection_sample`` itself takes the ``[num_tokens, vocab_size]`` draft-position rows and the
  bonus token ids ``[batch_size, 1]``);
* the output ``output_token_ids [batch_size, max_spec_len + 1]`` int32: the emitted tokens of
  each request, then ``-1`` (:data:`PLACEHOLDER_TOKEN_ID`) in the unused slots.

:func:`to_ragged` / :func:`from_ragged` convert the inputs both ways, :func:`output_to_ragged` /
:func:`output_from_ragged` the outputs; :func:`expand_batch_to_tokens` spreads per-request values
over the request's draft positions (vLLM's helper of that name).  The conversions are layout
only: rows may hold probabilities or logits.

Examples
--------
>>> import torch
>>> draft_tokens = torch.tensor([[[4, 2, 7]], [[1, 1, 5]]])          # [batch_size=2, 1, draft_len=3]
>>> target = torch.zeros(2, 1, 4, 8)
>>> batch = to_ragged(draft_tokens, None, target, num_draft_tokens=[3, 1])
>>> batch.draft_token_ids.tolist(), batch.cu_num_draft_tokens.tolist()
([4, 2, 7, 1], [3, 4])
>>> batch.target_logits_indices.tolist(), batch.bonus_logits_indices.tolist()
([0, 1, 2, 4], [3, 5])
>>> output = torch.tensor([[4, 2, 0, -1], [1, 6, -1, -1]], dtype=torch.int32)
>>> out = output_from_ragged(output, batch)
>>> out.num_accepted.tolist(), out.next_token.tolist()
([2, 1], [0, 6])
"""

from __future__ import annotations

import dataclasses
from typing import Optional, Sequence, Union

import torch

from spectr_audit.contract.verifier import VerifyOutput
from spectr_audit.errors import InvalidArgument, VerifierError

__all__ = [
    "PLACEHOLDER_TOKEN_ID",
    "RaggedBatch",
    "expand_batch_to_tokens",
    "from_ragged",
    "output_from_ragged",
    "output_to_ragged",
    "to_ragged",
]

#: vLLM's marker of an unused output slot.
PLACEHOLDER_TOKEN_ID = -1


@dataclasses.dataclass(frozen=True)
class RaggedBatch:
    """A flat ragged batch in vLLM's layout (see the module docstring).

    Attributes
    ----------
    draft_token_ids : torch.Tensor
        ``[num_tokens]`` int64.
    num_draft_tokens : list of int
        ``[batch_size]``.
    cu_num_draft_tokens, cu_num_sampled_tokens : torch.Tensor
        ``[batch_size]``, inclusive cumulative sums of ``n_b`` and ``n_b + 1`` (``index_dtype``).
    target_logits_indices : torch.Tensor
        ``[num_tokens]``: rows of ``target_probs`` at draft positions.
    bonus_logits_indices : torch.Tensor
        ``[batch_size]``: rows of ``target_probs`` at bonus positions.
    draft_probs : torch.Tensor or None
        ``[num_tokens, vocab_size]``.
    target_probs : torch.Tensor
        ``[num_tokens + batch_size, vocab_size]``, request-major (probabilities or logits).
    """

    # [num_tokens]
    draft_token_ids: torch.Tensor
    num_draft_tokens: list
    # [batch_size]
    cu_num_draft_tokens: torch.Tensor
    # [batch_size]
    cu_num_sampled_tokens: torch.Tensor
    # [num_tokens]
    target_logits_indices: torch.Tensor
    # [batch_size]
    bonus_logits_indices: torch.Tensor
    # [num_tokens, vocab_size] or None
    draft_probs: Optional[torch.Tensor]
    # [num_tokens + batch_size, vocab_size]
    target_probs: torch.Tensor

    @property
    def batch_size(self) -> int:
        return len(self.num_draft_tokens)

    @property
    def num_tokens(self) -> int:
        return int(self.draft_token_ids.shape[0])

    @property
    def max_spec_len(self) -> int:
        """The largest per-request draft count (vLLM's ``max_spec_len``; 0 for an empty batch)."""
        return max(self.num_draft_tokens, default=0)

    @property
    def target_rows(self) -> torch.Tensor:  # [num_tokens, vocab_size]
        """The target rows at draft positions (``rejection_sample``'s ``target_logits`` argument)."""
        return self.target_probs[self.target_logits_indices.long()]

    @property
    def bonus_rows(self) -> torch.Tensor:  # [batch_size, vocab_size]
        """The target rows at bonus positions."""
        return self.target_probs[self.bonus_logits_indices.long()]

    def equals(self, other: "RaggedBatch") -> bool:
        """Field-by-field equality (tensors compared with ``torch.equal``)."""
        if not isinstance(other, RaggedBatch) or self.num_draft_tokens != other.num_draft_tokens:
            return False
        for field in dataclasses.fields(self):
            mine, theirs = getattr(self, field.name), getattr(other, field.name)
            if isinstance(mine, torch.Tensor) or isinstance(theirs, torch.Tensor):
                if not (isinstance(mine, torch.Tensor) and isinstance(theirs, torch.Tensor) and torch.equal(mine, theirs)):
                    return False
        return True


def _counts(num_draft_tokens, batch_size: int, draft_len: int) -> list[int]:
    if num_draft_tokens is None:
        return [draft_len] * batch_size
    if isinstance(num_draft_tokens, torch.Tensor):
        num_draft_tokens = num_draft_tokens.tolist()
    counts = list(num_draft_tokens)
    if len(counts) != batch_size:
        raise InvalidArgument(f"num_draft_tokens: expected {batch_size} counts, got {len(counts)}")
    for b, n in enumerate(counts):
        if isinstance(n, bool) or not isinstance(n, int) or not 0 <= n <= draft_len:
            raise InvalidArgument(f"num_draft_tokens: count {n!r} of request {b} must be an integer in [0, {draft_len}]")
    return counts


def _cumsum(counts: Sequence[int], dtype: torch.dtype, device) -> torch.Tensor:
    return torch.tensor(counts, dtype=torch.int64, device=device).cumsum(0).to(dtype)


def to_ragged(
    draft_tokens: torch.Tensor,  # [batch_size, 1, draft_len]
    draft_probs: Optional[torch.Tensor],  # [batch_size, 1, draft_len, vocab_size] or None
    target_probs: torch.Tensor,  # [batch_size, 1, draft_len + 1, vocab_size]
    num_draft_tokens: Union[Sequence[int], torch.Tensor, None] = None,
    *,
    index_dtype: torch.dtype = torch.int32,
) -> RaggedBatch:
    """Flatten a single-draft contract batch into vLLM's ragged layout.

    Parameters
    ----------
    draft_tokens, draft_probs, target_probs
        The contract's tensors with ``num_drafts = 1`` (``draft_probs`` may be ``None``, as for
        vLLM's n-gram drafts).  Rows may be probabilities or logits.
    num_draft_tokens : sequence of int, optional
        Drafts of each request, each in ``[0, draft_len]`` (default ``draft_len`` for all):
        request ``b`` keeps its first ``n_b`` drafts and its target rows ``0 .. n_b``, the last
        being its bonus row.
    index_dtype : torch.dtype
        dtype of the cumulative counts and indices (vLLM uses int32).
    """
    if not isinstance(draft_tokens, torch.Tensor) or draft_tokens.dim() != 3:
        raise InvalidArgument("draft_tokens: expected shape [batch_size, num_drafts, draft_len]")
    batch_size, num_drafts, draft_len = draft_tokens.shape
    if num_drafts != 1:
        raise InvalidArgument(f"draft_tokens: vLLM's ragged layout holds one chain per request, got num_drafts={num_drafts}")
    if not isinstance(target_probs, torch.Tensor) or target_probs.dim() != 4 or tuple(target_probs.shape[:3]) != (batch_size, 1, draft_len + 1):
        shape = tuple(target_probs.shape) if isinstance(target_probs, torch.Tensor) else type(target_probs).__name__
        raise InvalidArgument(f"target_probs: expected shape ({batch_size}, 1, {draft_len + 1}, vocab_size), got {shape}")
    vocab_size = target_probs.shape[-1]
    if draft_probs is not None and (not isinstance(draft_probs, torch.Tensor) or tuple(draft_probs.shape) != (batch_size, 1, draft_len, vocab_size)):
        shape = tuple(draft_probs.shape) if isinstance(draft_probs, torch.Tensor) else type(draft_probs).__name__
        raise InvalidArgument(f"draft_probs: expected shape ({batch_size}, 1, {draft_len}, {vocab_size}) or None, got {shape}")
    counts = _counts(num_draft_tokens, batch_size, draft_len)
    device = draft_tokens.device
    counts_t = torch.tensor(counts, dtype=torch.int64, device=device)
    positions = torch.arange(draft_len, device=device)
    draft_mask = positions.unsqueeze(0) < counts_t.unsqueeze(1)  # [B, L]
    target_mask = torch.arange(draft_len + 1, device=device).unsqueeze(0) <= counts_t.unsqueeze(1)  # [B, L + 1]
    cu_draft = _cumsum(counts, index_dtype, device)
    cu_sampled = _cumsum([n + 1 for n in counts], index_dtype, device)
    starts = cu_sampled.long() - (counts_t + 1)  # first target row of each request
    target_index = (starts.repeat_interleave(counts_t) + _arange_within(counts_t)).to(index_dtype)
    return RaggedBatch(
        draft_token_ids=draft_tokens[:, 0][draft_mask].to(torch.int64),
        num_draft_tokens=counts,
        cu_num_draft_tokens=cu_draft,
        cu_num_sampled_tokens=cu_sampled,
        target_logits_indices=target_index,
        bonus_logits_indices=(cu_sampled.long() - 1).to(index_dtype),
        draft_probs=None if draft_probs is None else draft_probs[:, 0][draft_mask],
        target_probs=target_probs[:, 0][target_mask],
    )


def _arange_within(counts: torch.Tensor) -> torch.Tensor:
    """``[0 .. n_0 - 1, 0 .. n_1 - 1, ...]`` for counts ``[n_0, n_1, ...]``."""
    total = int(counts.sum())
    starts = counts.cumsum(0) - counts
    return torch.arange(total, device=counts.device) - starts.repeat_interleave(counts)


def from_ragged(
    batch: RaggedBatch,
    draft_len: Optional[int] = None,
    *,
    pad_token: int = 0,
) -> tuple[torch.Tensor, Optional[torch.Tensor], torch.Tensor, torch.Tensor]:
    """Pad a ragged batch back to the contract's tensors.

    Returns ``(draft_tokens [B, 1, L], draft_probs [B, 1, L, V] or None, target_probs
    [B, 1, L + 1, V], num_draft_tokens [B])`` with ``L = draft_len`` (default ``max_spec_len``,
    at least 1).  A request with ``n_b < L`` drafts is padded so that the result still passes the
    contract's input checks when its rows are probabilities: draft token ``pad_token`` with a
    one-hot draft row, and its bonus row repeated at target positions after ``n_b``.  Only the
    first ``n_b`` drafts and target rows ``0 .. n_b`` carry meaning.
    """
    if not isinstance(batch, RaggedBatch):
        raise InvalidArgument(f"batch: expected a RaggedBatch, got {type(batch).__name__}")
    counts = torch.tensor(batch.num_draft_tokens, dtype=torch.int64, device=batch.draft_token_ids.device)
    length = max(batch.max_spec_len, 1) if draft_len is None else draft_len
    if length < max(batch.max_spec_len, 1):
        raise InvalidArgument(f"draft_len: {length} is shorter than the batch's longest request ({batch.max_spec_len})")
    batch_size, vocab_size = batch.batch_size, batch.target_probs.shape[-1]
    if not 0 <= pad_token < vocab_size:
        raise InvalidArgument(f"pad_token: must lie in [0, {vocab_size}), got {pad_token}")
    device = batch.target_probs.device
    draft_mask = torch.arange(length, device=device).unsqueeze(0) < counts.unsqueeze(1)  # [B, L]
    draft_tokens = torch.full((batch_size, length), pad_token, dtype=torch.int64, device=device)
    draft_tokens[draft_mask] = batch.draft_token_ids.to(torch.int64)
    draft_probs = None
    if batch.draft_probs is not None:
        draft_probs = torch.zeros(batch_size, length, vocab_size, dtype=batch.draft_probs.dtype, device=device)
        draft_probs[..., pad_token] = 1
        draft_probs[draft_mask] = batch.draft_probs
        draft_probs = draft_probs.unsqueeze(1)
    bonus = batch.bonus_rows  # [B, V]
    target = bonus.unsqueeze(1).expand(batch_size, length + 1, vocab_size).clone()
    target_mask = torch.arange(length + 1, device=device).unsqueeze(0) <= counts.unsqueeze(1)
    target[target_mask] = batch.target_probs
    return draft_tokens.unsqueeze(1), draft_probs, target.unsqueeze(1), counts


def output_to_ragged(
    output: VerifyOutput,
    draft_tokens: torch.Tensor,  # [batch_size, num_drafts, draft_len]
    max_spec_len: Optional[int] = None,
) -> torch.Tensor:  # [batch_size, max_spec_len + 1] int32
    """The emitted strings of ``output`` as vLLM's ``output_token_ids``, ``-1`` in unused slots."""
    batch_size, _, draft_len = draft_tokens.shape
    width = (draft_len if max_spec_len is None else max_spec_len) + 1
    num_accepted = output.num_accepted.to(draft_tokens.device)
    if batch_size and int(num_accepted.max()) + 1 > width:
        raise InvalidArgument(f"max_spec_len: {width - 1} cannot hold {int(num_accepted.max())} accepted tokens")
    chosen = draft_tokens[torch.arange(batch_size, device=draft_tokens.device), output.draft_index.to(draft_tokens.device)]  # [B, L]
    slots = torch.arange(width, device=draft_tokens.device).unsqueeze(0)  # [1, W]
    padded = torch.cat([chosen, chosen.new_zeros(batch_size, max(width - draft_len, 0))], dim=1)[:, :width]
    out = torch.where(slots < num_accepted.unsqueeze(1), padded, torch.full_like(padded, PLACEHOLDER_TOKEN_ID))
    out = out.scatter(1, num_accepted.unsqueeze(1), output.next_token.to(draft_tokens.device).unsqueeze(1))
    return out.to(torch.int32)


def output_from_ragged(
    output_token_ids: torch.Tensor,  # [batch_size, max_spec_len + 1]
    batch: Optional[RaggedBatch] = None,
    *,
    vocab_size: Optional[int] = None,
    who: str = "engine",
) -> VerifyOutput:
    """vLLM's ``output_token_ids`` as a :class:`VerifyOutput` (``draft_index`` 0).

    Checks, raising :class:`VerifierError` naming ``who`` and the request: at least one emitted
    token, no placeholder before an emitted token, token ids in range (``vocab_size``, or the
    batch's), and, given ``batch``, at most ``n_b + 1`` emitted tokens whose accepted prefix
    equals the request's drafts.
    """
    if not isinstance(output_token_ids, torch.Tensor) or output_token_ids.dim() != 2:
        raise VerifierError(f"{who}: output_token_ids must be a [batch_size, max_spec_len + 1] tensor")
    out = output_token_ids.to(torch.int64)
    emitted_mask = out != PLACEHOLDER_TOKEN_ID
    emitted = emitted_mask.sum(-1)
    leading = emitted_mask.to(torch.int64).cumprod(-1).sum(-1)
    bad = (emitted < 1) | (leading != emitted)
    if bool(bad.any()):
        row = int(bad.nonzero()[0])
        raise VerifierError(f"{who}: request {row}: output row {out[row].tolist()} has a placeholder before an emitted token or none emitted")
    limit = vocab_size if vocab_size is not None else (batch.target_probs.shape[-1] if batch is not None else None)
    invalid = emitted_mask & ((out < 0) | ((out >= limit) if limit is not None else torch.zeros_like(emitted_mask)))
    if bool(invalid.any()):
        row, col = invalid.nonzero()[0].tolist()
        raise VerifierError(f"{who}: request {row}: token id {out[row, col].item()} is outside [0, {limit})")
    num_accepted = emitted - 1
    if batch is not None:
        if out.shape[0] != batch.batch_size:
            raise VerifierError(f"{who}: output has {out.shape[0]} rows, the batch {batch.batch_size} requests")
        counts = torch.tensor(batch.num_draft_tokens, dtype=torch.int64, device=out.device)
        too_many = num_accepted > counts
        if bool(too_many.any()):
            row = int(too_many.nonzero()[0])
            raise VerifierError(f"{who}: request {row} emitted {int(emitted[row])} tokens with {int(counts[row])} drafts")
        drafts, _, _, _ = from_ragged(batch, draft_len=max(out.shape[1] - 1, batch.max_spec_len, 1))
        drafts = drafts[:, 0].to(out.device)
        width = min(out.shape[1], drafts.shape[1])
        accepted_slot = torch.arange(width, device=out.device).unsqueeze(0) < num_accepted.unsqueeze(1)
        mismatch = accepted_slot & (out[:, :width] != drafts[:, :width])
        if bool(mismatch.any()):
            row, col = mismatch.nonzero()[0].tolist()
            raise VerifierError(
                f"{who}: request {row}: emitted token {out[row, col].item()} at position {col} is not the draft "
                f"{drafts[row, col].item()} it claims to accept"
            )
    next_token = out.gather(1, num_accepted.unsqueeze(1)).squeeze(1)
    return VerifyOutput(num_accepted, torch.zeros_like(num_accepted), next_token)


def expand_batch_to_tokens(
    values: torch.Tensor,  # [batch_size]
    cu_num_draft_tokens: torch.Tensor,  # [batch_size]
) -> torch.Tensor:  # [num_tokens]
    """Repeat request ``b``'s value over its draft positions (``[a, b, c]`` with cu ``[2, 5, 6]`` gives
    ``[a, a, b, b, b, c]``, as vLLM's helper of that name).

    Examples
    --------
    >>> import torch
    >>> expand_batch_to_tokens(torch.tensor([0.5, 1.0, 2.0]), torch.tensor([2, 5, 6])).tolist()
    [0.5, 0.5, 1.0, 1.0, 1.0, 2.0]
    """
    cu = cu_num_draft_tokens.to(torch.int64)
    if values.shape[0] != cu.shape[0]:
        raise InvalidArgument(f"values: expected {cu.shape[0]} per-request values, got {values.shape[0]}")
    counts = torch.diff(cu, prepend=cu.new_zeros(1))
    if bool((counts < 0).any()):
        raise InvalidArgument("cu_num_draft_tokens: must be non-decreasing")
    return values.repeat_interleave(counts.to(values.device))
