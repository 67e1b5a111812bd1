"""The Triton kernels of :mod:`spectr_audit.verifiers.triton_kernels` (imported only where they run).

Each program reads ``GROUP`` consecutive blocks of :data:`~spectr_audit.contract.randomness.CATEGORICAL_BLOCK`
tokens of one row, so the whole row is read once.  Elementwise values are computed with the same
IEEE operations as the eager twins (round-to-nearest division, no fused multiply-add: the launcher
turns fp fusion off), so a token's value is bit for bit the eager one; only the order of the
additions in a block sum differs.
"""

from __future__ import annotations

import triton
import triton.language as tl

# MODE of row_block_sums (the numbers of spectr_audit.verifiers.triton_kernels): 0 max(q x + p y, 0), and the
# signed sums of q x + p y; 1 min(p, q / x); 2 max(q - y min(p, q / x), 0).


@triton.jit
def _divide(numerator, denominator, IS_FP32: tl.constexpr):
    # round-to-nearest division, as torch's eager division on every device
    if IS_FP32:
        return tl.math.div_rn(numerator, denominator)
    else:
        return numerator / denominator


@triton.jit
def row_block_sums(
    draft_ptr, target_ptr, x_ptr, y_ptr, sums_ptr, signed_ptr,
    vocab_size, num_blocks, inner, draft_outer, draft_inner, target_outer, target_inner,
    MODE: tl.constexpr, WITH_SIGNED: tl.constexpr, IS_FP32: tl.constexpr,
    BLOCK: tl.constexpr, GROUP: tl.constexpr,
):
    """Block sums ``[rows, num_blocks]`` of one elementwise value of ``(p, q)`` with per-row scalars ``x, y``.

    Row ``r`` is ``(r // inner, r % inner)`` of ``[outer, inner, vocab_size]`` inputs with the given strides
    (the last stride is 1).
    """
    row = tl.program_id(0)
    group = tl.program_id(1)
    # int64 offsets: a batch of rows may hold more than 2^31 probabilities
    outer_index = (row // inner).to(tl.int64)
    inner_index = (row % inner).to(tl.int64)
    blocks = group * GROUP + tl.arange(0, GROUP)  # [GROUP]
    columns = blocks[:, None] * BLOCK + tl.arange(0, BLOCK)[None, :]  # [GROUP, BLOCK]
    inside = columns < vocab_size
    draft = tl.load(draft_ptr + outer_index * draft_outer + inner_index * draft_inner + columns, mask=inside, other=0.0)
    target = tl.load(target_ptr + outer_index * target_outer + inner_index * target_inner + columns, mask=inside,
                     other=0.0)
    x = tl.load(x_ptr + row)
    if MODE == 0:
        y = tl.load(y_ptr + row)
        value = tl.maximum(target * x + draft * y, 0.0)
    elif MODE == 1:
        value = tl.minimum(draft, _divide(target, x, IS_FP32))
    else:
        y = tl.load(y_ptr + row)
        value = tl.maximum(target - y * tl.minimum(draft, _divide(target, x, IS_FP32)), 0.0)
    value = tl.where(inside, value, 0.0)
    out = row.to(tl.int64) * num_blocks + blocks
    keep = blocks < num_blocks
    tl.store(sums_ptr + out, tl.sum(value, axis=1), mask=keep)
    if WITH_SIGNED:  # MODE 0 only: the sums of q x + p y before the clamp
        y_signed = tl.load(y_ptr + row)
        tl.store(signed_ptr + out, tl.sum(tl.where(inside, target * x + draft * y_signed, 0.0), axis=1), mask=keep)


@triton.jit
def kseq_low_sums(
    draft_ptr, target_ptr, thresholds_ptr, partial_ptr,
    vocab_size, num_chunks, draft_stride, target_stride,
    CANDIDATES: tl.constexpr, CHUNK: tl.constexpr,
):
    """Partial float64 sums ``[rows, num_chunks, 2, CANDIDATES]`` of p and q over the tokens with ``q <= c p``, ``p > 0``."""
    row = tl.program_id(0)
    chunk = tl.program_id(1)
    columns = chunk * CHUNK + tl.arange(0, CHUNK)
    inside = columns < vocab_size
    draft = tl.load(draft_ptr + row.to(tl.int64) * draft_stride + columns, mask=inside, other=0.0)
    target = tl.load(target_ptr + row.to(tl.int64) * target_stride + columns, mask=inside, other=0.0)
    base = (row.to(tl.int64) * num_chunks + chunk) * 2 * CANDIDATES
    for c in tl.static_range(CANDIDATES):
        threshold = tl.load(thresholds_ptr + row * CANDIDATES + c)
        low = (target <= threshold * draft) & (draft > 0) & inside
        tl.store(partial_ptr + base + c, tl.sum(tl.where(low, draft.to(tl.float64), 0.0), axis=0))
        tl.store(partial_ptr + base + CANDIDATES + c, tl.sum(tl.where(low, target.to(tl.float64), 0.0), axis=0))
