"""Triton kernels for the samplers' hottest passes on CUDA, each with its eager twin.

Eager PyTorch pays a full memory pass, and often an allocation, for every elementwise operation,
so a sampler built from a dozen of them cannot come near one read of its inputs.  Three passes
dominate, and each becomes one read here:

* the residual of single-draft speculative sampling, ``(q - p)_+``, and of block verification's
  levels, ``(w q - p / max(w, 1))_+`` with ``w`` clamped at 1, with the sums the level probabilities
  need (docs/rules/block.md);
* K-SEQ's ``beta = sum_x min(p, q / rho)`` and its residual ``(q - s min(p, q / rho))_+``
  (docs/rules/kseq.md);
* the low sums of the sort-free rho* solve (``sum p`` and ``sum q`` over the tokens with ``q <= c p``).

A residual is never written out: the kernel returns its sums over blocks of
:data:`~spectr_audit.contract.randomness.CATEGORICAL_BLOCK` tokens, and the two-level inverse-CDF
draw (:func:`~spectr_audit.contract.randomness.sample_categorical`) recomputes the values of the one
block it lands in (:class:`LazyResidual`).  Each token's value is computed with the same IEEE
operations as the eager twin, so only the order of the additions inside a block sum differs: draws
agree with the eager sampler's except within float rounding of a block boundary.

On by default on CUDA where Triton imports; off with ``SPECTR_AUDIT_TRITON=0`` or
:func:`use_triton`.  A kernel that fails to launch runs its eager twin instead, with one warning.
On a CPU the kernels run only under Triton's interpreter (``TRITON_INTERPRET=1`` set before the
kernels are first loaded, and ``use_triton(True)``), which is how the tests compare them with their
twins without a GPU.

Examples
--------
>>> import torch
>>> from spectr_audit.verifiers import triton_kernels
>>> triton_kernels.triton_enabled(torch.device("cpu"))   # never on a CPU outside the interpreter
False
>>> draft, target = torch.tensor([[0.5, 0.5]]), torch.tensor([[0.2, 0.8]])
>>> residual = triton_kernels.difference_residual(target, draft, torch.ones(1), -torch.ones(1))
>>> residual.materialise()                   # (q - p)_+, computed eagerly here
tensor([[0.0000, 0.3000]])
"""

from __future__ import annotations

import importlib.util
import os
import warnings
from typing import Callable, Optional

import torch

from spectr_audit.contract.randomness import CATEGORICAL_BLOCK, block_sums

__all__ = [
    "LazyResidual",
    "difference_residual",
    "fused_rows",
    "kseq_beta",
    "kseq_excess_residual",
    "kseq_low_sums",
    "triton_available",
    "triton_enabled",
    "use_triton",
]

#: Residual modes (the kernels compare ``MODE`` with these numbers).
DIFFERENCE = 0  # max(q x + p y, 0), and the signed sums of q x + p y
MINIMUM = 1  # min(p, q / x)
KSEQ_EXCESS = 2  # max(q - y min(p, q / x), 0)

#: Blocks of CATEGORICAL_BLOCK tokens per program, and tokens per program of the low-sums kernel.
GROUP = 8
CHUNK = GROUP * CATEGORICAL_BLOCK

ENV = "SPECTR_AUDIT_TRITON"

_override: Optional[bool] = None
_available: Optional[bool] = None
_jit = None
_interpreted = False
_failed: set[str] = set()


def use_triton(enabled: Optional[bool] = True) -> None:
    """Turn the kernels on or off for this process (``None``: back to ``SPECTR_AUDIT_TRITON``, default on)."""
    global _override
    _override = None if enabled is None else bool(enabled)


def triton_available() -> bool:
    """Whether Triton is installed (checked once, without importing it)."""
    global _available
    if _available is None:
        _available = importlib.util.find_spec("triton") is not None
    return _available


def _switched_on() -> bool:
    if _override is not None:
        return _override
    return os.environ.get(ENV, "1").strip().lower() not in ("0", "false", "no", "off")


def triton_enabled(device: torch.device) -> bool:
    """Whether the kernels run on ``device``: CUDA with Triton and the switch on; a CPU only under the interpreter.

    The interpreter runs the kernels on CPU tensors (slowly) when ``TRITON_INTERPRET=1`` was set before
    they were first loaded; the CPU path is taken only after an explicit ``use_triton(True)``.
    """
    device = torch.device(device)
    if not _switched_on() or not triton_available():
        return False
    if device.type == "cuda":
        return True
    if device.type == "cpu" and _override is True:
        return os.environ.get("TRITON_INTERPRET", "") == "1" and (_jit is None or _interpreted)
    return False


def fused_rows(rows: torch.Tensor) -> bool:
    """Whether a sampler takes the kernels for rows ``[..., V]``: enabled on their device, two-level draws, float32/64.

    Vocabularies up to ``2 * CATEGORICAL_BLOCK`` are drawn with one cumulative sum over the whole row
    (:func:`~spectr_audit.contract.randomness.sample_categorical`), where a lazy residual saves nothing.
    """
    return (
        rows.shape[-1] > 2 * CATEGORICAL_BLOCK
        and rows.dtype in (torch.float32, torch.float64)
        and triton_enabled(rows.device)
    )


def _kernels():
    global _jit, _interpreted
    if _jit is None:
        _interpreted = os.environ.get("TRITON_INTERPRET", "") == "1"
        # deferred: _triton_jit imports triton (optional, slow to import); loaded on the first launch
        from spectr_audit.verifiers import _triton_jit

        _jit = _triton_jit
    return _jit


def _launch(name: str, launch: Callable, eager: Callable):
    """``launch()``; the eager twin if the kernel fails to compile or launch (one warning per kernel)."""
    if name not in _failed:
        try:
            return launch()
        except Exception as error:  # no compiler for this GPU, an unsupported dtype: fall back, say so once
            _failed.add(name)
            warnings.warn(f"spectr_audit.verifiers.triton_kernels: {name} runs eagerly, the kernel failed: {error}",
                          RuntimeWarning)
    return eager()


def _options() -> dict:
    # no fused multiply-add: every token's value is then the eager twin's, bit for bit
    return {"enable_fp_fusion": False}


# -- the elementwise values (the eager twins, and the lazy residual's recomputation) ------------------------

def _values(
    mode: int,
    draft: torch.Tensor,  # [..., V]
    target: torch.Tensor,  # [..., V]
    x: torch.Tensor,  # [..., 1], the rows' dtype
    y: Optional[torch.Tensor],  # [..., 1] or None
) -> torch.Tensor:  # [..., V]
    if mode == DIFFERENCE:
        return torch.add(target * x, draft * y).clamp_(min=0)
    if mode == MINIMUM:
        return torch.minimum(draft, target / x)
    return (target - y * torch.minimum(draft, target / x)).clamp_(min=0)


def _signed(draft, target, x, y) -> torch.Tensor:  # [..., V], q x + p y before the clamp
    return torch.add(target * x, draft * y)


def _as_3d(rows: torch.Tensor) -> torch.Tensor:
    """``[n, V]`` or ``[outer, inner, V]`` rows as ``[outer, inner, V]`` with unit last stride (a view when possible)."""
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    return rows.unsqueeze(1) if rows.dim() == 2 else rows


def _row_scalars(value, like: torch.Tensor, shape) -> torch.Tensor:
    """A per-row scalar (number or tensor broadcastable to ``shape``) as a contiguous tensor in ``like``'s dtype."""
    if not isinstance(value, torch.Tensor):  # a number: filled on the device (a host tensor would be a copy, a sync)
        return torch.full(tuple(shape), float(value), dtype=like.dtype, device=like.device)
    value = value.to(device=like.device, dtype=like.dtype)
    if value.numel() == shape[0] * shape[1]:  # one per row, [n] or [outer, inner]
        return value.reshape(shape).contiguous()
    return value.expand(shape).contiguous()


def _block_sums_eager(mode, draft, target, x, y, with_signed):
    values = _values(mode, draft, target, x.unsqueeze(-1), None if y is None else y.unsqueeze(-1))
    signed = block_sums(_signed(draft, target, x.unsqueeze(-1), y.unsqueeze(-1))) if with_signed else None
    return block_sums(values), signed


def _block_sums(mode, draft, target, x, y, with_signed):
    """Block sums ``[outer, inner, num_blocks]`` of the mode's values (and of the signed values), by kernel or eagerly."""
    if not triton_enabled(draft.device):
        return _block_sums_eager(mode, draft, target, x, y, with_signed)

    def launch():
        jit = _kernels()
        outer, inner, vocab_size = draft.shape
        num_blocks = -(-vocab_size // CATEGORICAL_BLOCK)
        sums = torch.empty(outer, inner, num_blocks, dtype=draft.dtype, device=draft.device)
        signed = torch.empty_like(sums) if with_signed else sums
        grid = (outer * inner, -(-num_blocks // GROUP))
        jit.row_block_sums[grid](
            draft, target, x, x if y is None else y, sums, signed,
            vocab_size, num_blocks, inner, draft.stride(0), draft.stride(1), target.stride(0), target.stride(1),
            MODE=mode, WITH_SIGNED=with_signed, IS_FP32=draft.dtype == torch.float32,
            BLOCK=CATEGORICAL_BLOCK, GROUP=GROUP, **_options(),
        )
        return sums, (signed if with_signed else None)

    return _launch(f"row_block_sums[{mode}]", launch, lambda: _block_sums_eager(mode, draft, target, x, y, with_signed))


class LazyResidual:
    """A non-negative residual over rows ``[outer, inner, V]`` known by its block sums; values recomputed where drawn.

    Only :func:`spectr_audit.verifiers._walk._sample_or_fallback` (through :meth:`sample_with_total`) and
    the tests (:meth:`materialise`) read it.  :meth:`take` selects one row per ``(outer, inner)`` pair.
    """

    def __init__(self, mode, draft, target, x, y, sums, signed=None, rows=None):
        self.mode, self.draft, self.target, self.x, self.y = mode, draft, target, x, y
        self.block_sums = sums  # [outer, inner, num_blocks]
        self.signed_sums = signed  # [outer, inner, num_blocks] or None
        self.rows = rows  # None (every row, flattened) or (outer index [n], inner index [n])

    @property
    def vocab_size(self) -> int:
        return self.draft.shape[-1]

    def take(self, outer: torch.Tensor, inner: torch.Tensor) -> "LazyResidual":
        """The residual of rows ``(outer[i], inner[i])``, ``[n]`` each (nothing is copied but their block sums)."""
        return LazyResidual(self.mode, self.draft, self.target, self.x, self.y, self.block_sums, self.signed_sums,
                            (outer, inner))

    def _index(self):
        if self.rows is not None:
            return self.rows
        outer, inner = self.draft.shape[:2]
        flat = torch.arange(outer * inner, device=self.draft.device)
        return flat // inner, flat % inner

    def _sums(self) -> torch.Tensor:  # [n, num_blocks]
        outer, inner = self._index()
        return self.block_sums[outer, inner] if self.rows is not None else self.block_sums.flatten(0, 1)

    def totals(self, dtype=torch.float64) -> torch.Tensor:  # [outer, inner]
        """Row sums of the residual (over every row, before :meth:`take`), accumulated in ``dtype``."""
        return self.block_sums.sum(-1, dtype=dtype)

    def signed_totals(self, dtype=torch.float64) -> torch.Tensor:  # [outer, inner]
        """Row sums of the values before the clamp (difference mode with signed sums only)."""
        return self.signed_sums.sum(-1, dtype=dtype)

    def values_at(self, index: torch.Tensor) -> torch.Tensor:  # [n, m]
        """The residual at tokens ``index [n, m]`` of the selected rows, computed as the eager twin does."""
        outer, inner = (i.unsqueeze(-1) for i in self._index())
        draft, target = self.draft[outer, inner, index], self.target[outer, inner, index]
        x = self.x[outer, inner]
        y = None if self.y is None else self.y[outer, inner]
        return _values(self.mode, draft, target, x, y)

    def materialise(self) -> torch.Tensor:  # [n, V]
        """Every value of the selected rows (a full pass: for tests and callers that need the tensor)."""
        index = torch.arange(self.vocab_size, device=self.draft.device)
        return self.values_at(index.expand(self._index()[0].shape[0], -1))

    def sample_with_total(self, u: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # ([n] int64, [n])
        """:func:`~spectr_audit.contract.randomness.sample_categorical_with_total` of the residual, read lazily."""
        sums = self._sums()
        return draw_from_block_sums(sums, u, self.values_at, self.vocab_size), sums.sum(-1)


def draw_from_block_sums(
    sums: torch.Tensor,  # [n, num_blocks] block sums of non-negative rows
    u: torch.Tensor,  # [n] uniforms in [0, 1)
    values_at: Callable[[torch.Tensor], torch.Tensor],  # token ids [n, BLOCK] -> the rows' values there
    vocab_size: int,
) -> torch.Tensor:  # [n] int64
    """The two-level inverse-CDF draw of :func:`~spectr_audit.contract.randomness.sample_categorical`, given block sums.

    The same operations as the contract's two-level draw, except that the chosen block's values come
    from ``values_at`` instead of a gather from a materialised row; with the same sums and values the
    token is the same.  A token of zero value is never returned (the point is kept below the block's
    total, the search is right-sided), and a block has a positive sum exactly when one of its values
    is positive, because the kernel's values are the eager ones bit for bit.
    """
    block_cdf = sums.cumsum(-1)  # [n, num_blocks]
    total = block_cdf[..., -1:]
    point = torch.minimum(u.to(block_cdf.dtype).unsqueeze(-1) * total, torch.nextafter(total, torch.zeros_like(total)))
    block = torch.searchsorted(block_cdf, point, right=True).clamp_(max=block_cdf.shape[-1] - 1)  # [n, 1]
    before = torch.where(block > 0, block_cdf.gather(-1, (block - 1).clamp(min=0)), torch.zeros_like(point))
    offsets = torch.arange(CATEGORICAL_BLOCK, device=sums.device)
    index = block * CATEGORICAL_BLOCK + offsets  # [n, BLOCK]
    inside = index < vocab_size
    local = torch.where(inside, values_at(index.clamp(max=vocab_size - 1)), torch.zeros((), dtype=sums.dtype,
                                                                                         device=sums.device))
    local_cdf = local.cumsum(-1)
    local_total = local_cdf[..., -1:]
    local_point = (point - before).clamp(min=0).to(local_cdf.dtype)
    local_point = torch.minimum(local_point, torch.nextafter(local_total, torch.zeros_like(local_total)))
    within = torch.searchsorted(local_cdf, local_point, right=True).clamp_(max=CATEGORICAL_BLOCK - 1)
    return (block * CATEGORICAL_BLOCK + within).squeeze(-1).clamp_(max=vocab_size - 1)


# -- the passes ---------------------------------------------------------------------------------------------

def difference_residual(
    target: torch.Tensor,  # [n, V] or [outer, inner, V]
    draft: torch.Tensor,  # same shape
    target_scale,  # per row: [n] / [outer, inner] (or a number), the rows' dtype
    draft_scale,  # per row, as target_scale
    *,
    with_signed: bool = False,
) -> LazyResidual:
    """``(target_scale q + draft_scale p)_+`` as a :class:`LazyResidual`, in one read of ``p`` and ``q``.

    Speculative sampling's residual is ``(1, -1)``; block verification's level ``i`` is
    ``(min(w_i, 1), -1 / max(w_i, 1))``.  ``with_signed`` also keeps the sums of the values before
    the clamp (block verification's ``r_i - s_i``, :meth:`LazyResidual.signed_totals`).
    """
    target3, draft3 = _as_3d(target), _as_3d(draft)
    shape = draft3.shape[:2]
    x = _row_scalars(target_scale, draft3, shape)
    y = _row_scalars(draft_scale, draft3, shape)
    sums, signed = _block_sums(DIFFERENCE, draft3, target3, x, y, with_signed)
    return LazyResidual(DIFFERENCE, draft3, target3, x, y, sums, signed)


def kseq_beta(
    draft: torch.Tensor,  # [n, V]
    target: torch.Tensor,  # [n, V]
    rho: torch.Tensor,  # [n, 1], the rows' dtype
) -> torch.Tensor:  # [n, 1], the rows' dtype
    """K-SEQ's ``beta = sum_x min(p(x), q(x) / rho)`` per row, in one read."""
    draft3, target3 = _as_3d(draft), _as_3d(target)
    x = _row_scalars(rho, draft3, draft3.shape[:2])
    sums, _ = _block_sums(MINIMUM, draft3, target3, x, None, False)
    return sums.sum(-1, dtype=torch.float64).to(draft.dtype)  # [n, 1]


def kseq_excess_residual(
    draft: torch.Tensor,  # [n, V]
    target: torch.Tensor,  # [n, V]
    rho: torch.Tensor,  # [n, 1], the rows' dtype
    scale: torch.Tensor,  # [n, 1], the rows' dtype
) -> LazyResidual:
    """K-SEQ's unnormalised residual ``(q - scale min(p, q / rho))_+`` as a :class:`LazyResidual`, in one read."""
    draft3, target3 = _as_3d(draft), _as_3d(target)
    shape = draft3.shape[:2]
    x = _row_scalars(rho, draft3, shape)
    y = _row_scalars(scale, draft3, shape)
    sums, _ = _block_sums(KSEQ_EXCESS, draft3, target3, x, y, False)
    return LazyResidual(KSEQ_EXCESS, draft3, target3, x, y, sums)


def kseq_low_sums_eager(
    draft: torch.Tensor,  # [n, V]
    target: torch.Tensor,  # [n, V]
    thresholds: torch.Tensor,  # [n, C], the rows' dtype
) -> torch.Tensor:  # [n, 2, C] float64: sums of p and q over the tokens with q <= c p (p > 0)
    """The eager low sums of :func:`kseq_low_sums` (``torch.compile``'s input, and the kernels' fallback)."""
    low = (target.unsqueeze(1) <= thresholds.unsqueeze(-1) * draft.unsqueeze(1)) & (draft.unsqueeze(1) > 0)  # [n, C, V]
    # accumulated in float64: rounding V float32 terms costs far more than the sampler's validity margin
    low_draft = torch.where(low, draft.unsqueeze(1), torch.zeros_like(draft).unsqueeze(1)).sum(-1, dtype=torch.float64)
    low_target = torch.where(low, target.unsqueeze(1), torch.zeros_like(target).unsqueeze(1)).sum(-1, dtype=torch.float64)
    return torch.stack([low_draft, low_target], dim=1)


def kseq_low_sums(
    draft: torch.Tensor,  # [n, V]
    target: torch.Tensor,  # [n, V]
    thresholds: torch.Tensor,  # [n, C], the rows' dtype
) -> torch.Tensor:  # [n, 2, C] float64
    """One pass of the sort-free rho* solve: float64 sums of p and q over the tokens with ``q <= c p``, ``p > 0``.

    The twin of :func:`spectr_audit.verifiers.compiled.kseq_low_sums` (same masks, bit for bit; the
    float64 sums differ only in the order of their additions).
    """
    if not triton_enabled(draft.device):
        return kseq_low_sums_eager(draft, target, thresholds)

    def launch():
        jit = _kernels()
        rows_draft = draft if draft.stride(-1) == 1 else draft.contiguous()
        rows_target = target if target.stride(-1) == 1 else target.contiguous()
        n, vocab_size = rows_draft.shape
        candidates = thresholds.shape[-1]
        num_chunks = -(-vocab_size // CHUNK)
        partial = torch.empty(n, num_chunks, 2, candidates, dtype=torch.float64, device=draft.device)
        jit.kseq_low_sums[(n, num_chunks)](
            rows_draft, rows_target, thresholds.to(draft.dtype).contiguous(), partial,
            vocab_size, num_chunks, rows_draft.stride(0), rows_target.stride(0),
            CANDIDATES=candidates, CHUNK=CHUNK, **_options(),
        )
        return partial.sum(1)

    return _launch("kseq_low_sums", launch, lambda: kseq_low_sums_eager(draft, target, thresholds))
