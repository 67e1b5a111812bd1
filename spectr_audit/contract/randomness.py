"""The one randomness seam of the built-in verifiers.

Every built-in verifier draws its randomness through :func:`uniform`, from the
``generator`` it was given.  A test can pass an :class:`InjectedUniforms` instead
of a ``torch.Generator`` to pin accept/reject decisions and CDF look-ups at
chosen values (a uniform of exactly 0, one just below 1, a CDF boundary).

Notes
-----
Uniforms lie in ``[0, 1)``.  Verifiers test acceptance as ``u < accept_prob``
(strict), so ``u = 0`` never accepts a token whose acceptance probability is
0, and categorical draws use ``searchsorted(cdf, u * total, right=True)`` so a
zero-probability token can never be selected, even at a CDF tie.
"""

from __future__ import annotations

from collections import deque
from typing import Iterable, Union

import torch

from spectr_audit.errors import InvalidArgument

__all__ = [
    "CATEGORICAL_BLOCK",
    "InjectedUniforms",
    "RandomSource",
    "block_sums",
    "sample_categorical",
    "sample_categorical_from_cdf",
    "sample_categorical_with_total",
    "splitmix64",
    "uniform",
]


class InjectedUniforms:
    """A replacement for a ``torch.Generator`` that serves given uniforms.

    Parameters
    ----------
    values : iterable of tensors or floats
        Served in order: each call to :func:`uniform` with shape ``S`` takes the
        next item, which must broadcast to ``S`` (a float fills the whole shape).
    fallback : torch.Generator, optional
        Used once ``values`` is exhausted; without it, running out is an error.
    cycle : bool
        Serve ``values`` round and round instead of running out.

    Examples
    --------
    >>> import torch
    >>> src = InjectedUniforms([0.0, torch.tensor([0.5])])
    >>> uniform(src, (2,), torch.device("cpu")).tolist()
    [0.0, 0.0]
    """

    def __init__(self, values: Iterable, fallback: torch.Generator | None = None, cycle: bool = False):
        self._values = deque(values)
        self.fallback = fallback
        self.cycle = cycle
        self.calls: list[tuple[int, ...]] = []

    @classmethod
    def constant(cls, value: float) -> "InjectedUniforms":
        """Serve ``value`` for every draw (e.g. 0.0, or ``1 - 2**-53``)."""
        return cls([value], cycle=True)

    def next(self, shape: tuple[int, ...], device: torch.device) -> torch.Tensor:
        """Return the next injected block, broadcast to ``shape``."""
        self.calls.append(tuple(shape))
        if not self._values:
            if self.fallback is None:
                raise InvalidArgument(
                    f"generator: InjectedUniforms ran out of values at a draw of shape {tuple(shape)}"
                )
            return torch.rand(shape, generator=self.fallback, dtype=torch.float64, device="cpu").to(device)
        item = self._values.popleft()
        if self.cycle:
            self._values.append(item)
        value = torch.as_tensor(item, dtype=torch.float64, device=device)
        if ((value < 0) | (value >= 1)).any():
            raise InvalidArgument("generator: injected uniforms must lie in [0, 1)")
        return torch.broadcast_to(value, shape).clone()


RandomSource = Union[torch.Generator, InjectedUniforms, None]


def uniform(generator: RandomSource, shape: tuple[int, ...], device: torch.device) -> torch.Tensor:
    """Draw float64 uniforms in ``[0, 1)`` of ``shape`` on ``device`` from ``generator``."""
    shape = tuple(int(s) for s in shape)
    if isinstance(generator, InjectedUniforms):
        return generator.next(shape, device)
    draw_device = generator.device if generator is not None else device
    return torch.rand(shape, generator=generator, dtype=torch.float64, device=draw_device).to(device)


#: Block size of the two-level inverse-CDF draw; vocabularies up to twice this use one cumulative sum.
CATEGORICAL_BLOCK = 256


def sample_categorical(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF draw from unnormalised non-negative ``probs`` with uniforms ``u``.

    ``probs`` is ``[..., vocab_size]``, ``u`` is ``[...]`` in ``[0, 1)``; returns int64 ``[...]``.
    Half-precision rows are widened to float32 first (a bf16 running sum stalls after a few
    hundred terms).

    A token of zero mass is never returned: the cumulative sum of non-negative numbers is
    non-decreasing in floating point and stays flat across a zero-mass token, the search
    is right-sided (``cdf[i] > point``), and the point ``u * total`` is kept strictly below
    the total even when ``u`` rounds up in the CDF's dtype.  Rows with no mass at all
    return ``vocab_size - 1``; callers never use such rows.

    Large vocabularies are drawn in two levels, which reads each row once instead of running
    a sequential cumulative sum over it: block sums over blocks of :data:`CATEGORICAL_BLOCK`
    tokens, an inverse-CDF draw of the block, then an inverse-CDF draw inside the chosen block
    at the remaining point.  This is the same inverse-CDF map up to the rounding of the sums,
    and keeps the zero-mass guarantee (a block of zero mass is flat in the block CDF, and the
    point inside the chosen block is kept below that block's own total).
    """
    return sample_categorical_with_total(probs, u)[0]


def sample_categorical_with_total(probs: torch.Tensor, u: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`sample_categorical` and the rows' total mass ``[...]`` (e.g. to detect rows with none)."""
    if probs.dtype in (torch.float16, torch.bfloat16):
        probs = probs.float()
    vocab_size = probs.shape[-1]
    if vocab_size <= 2 * CATEGORICAL_BLOCK:
        cdf = probs.cumsum(-1)
        return sample_categorical_from_cdf(cdf, u), cdf[..., -1]
    sums = block_sums(probs)
    return _sample_two_level(probs, u, sums), sums.sum(-1)


def block_sums(probs: torch.Tensor) -> torch.Tensor:  # [..., num_blocks]
    """Sums of ``probs [..., vocab_size]`` over consecutive blocks of :data:`CATEGORICAL_BLOCK` tokens."""
    vocab_size = probs.shape[-1]
    full = vocab_size // CATEGORICAL_BLOCK * CATEGORICAL_BLOCK
    sums = probs[..., :full].reshape(*probs.shape[:-1], -1, CATEGORICAL_BLOCK).sum(-1)
    if full < vocab_size:
        sums = torch.cat([sums, probs[..., full:].sum(-1, keepdim=True)], dim=-1)
    return sums


def _sample_two_level(probs: torch.Tensor, u: torch.Tensor, sums: torch.Tensor) -> torch.Tensor:
    """Two-level inverse-CDF draw given ``sums = block_sums(probs)`` (see :func:`sample_categorical`)."""
    vocab_size = probs.shape[-1]
    block_cdf = sums.cumsum(-1)  # [..., num_blocks]
    total = block_cdf[..., -1:]
    point = torch.minimum(u.to(block_cdf.dtype).unsqueeze(-1) * total, torch.nextafter(total, torch.zeros_like(total)))
    block = torch.searchsorted(block_cdf, point, right=True).clamp_(max=block_cdf.shape[-1] - 1)  # [..., 1]
    before = torch.where(block > 0, block_cdf.gather(-1, (block - 1).clamp(min=0)), torch.zeros_like(point))
    offsets = torch.arange(CATEGORICAL_BLOCK, device=probs.device)
    index = block * CATEGORICAL_BLOCK + offsets  # [..., BLOCK]
    inside = index < vocab_size
    local = torch.where(inside, probs.gather(-1, index.clamp(max=vocab_size - 1)), torch.zeros((), dtype=probs.dtype, device=probs.device))
    local_cdf = local.cumsum(-1)
    local_total = local_cdf[..., -1:]
    local_point = (point - before).clamp(min=0).to(local_cdf.dtype)
    local_point = torch.minimum(local_point, torch.nextafter(local_total, torch.zeros_like(local_total)))
    within = torch.searchsorted(local_cdf, local_point, right=True).clamp_(max=CATEGORICAL_BLOCK - 1)
    return (block * CATEGORICAL_BLOCK + within).squeeze(-1).clamp_(max=vocab_size - 1)


def sample_categorical_from_cdf(cdf: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """:func:`sample_categorical` given ``cdf = probs.cumsum(-1)`` (``[..., vocab_size]``), e.g. to reuse its total."""
    total = cdf[..., -1:]
    point = u.to(cdf.dtype).unsqueeze(-1) * total
    point = torch.minimum(point, torch.nextafter(total, torch.zeros_like(total)))
    idx = torch.searchsorted(cdf, point, right=True).squeeze(-1)
    return idx.clamp_(max=cdf.shape[-1] - 1)


_MASK64 = (1 << 64) - 1


def splitmix64(state: int) -> int:
    """One SplitMix64 step (Steele, Lea and Flood, 2014): ``state`` plus the golden-ratio increment, mixed.

    The seed derivations of the sharded sampler and of the engines' random streams are chains of
    these steps, so their reproducibility rests on this one function.

    >>> hex(splitmix64(0))
    '0xe220a8397b1dcdaf'
    """
    state = (int(state) + 0x9E3779B97F4A7C15) & _MASK64
    z = state
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)
