"""K-SEQ's acceptance scale rho*: the exact solve, the bisection oracle and the sampler's fast solve."""

from __future__ import annotations

import math
import operator
from typing import Union

import numpy as np
import torch

from spectr_audit.errors import InvalidArgument
from spectr_audit.verifiers.compiled import compiled_enabled, kseq_low_sums

#: Bisection steps for rho*: 64 halvings of [1, K] reach adjacent floats for any K < 2**10.
_BISECTION_STEPS = 64


def _check_num_drafts(num_drafts: object) -> int:
    """num_drafts as a Python int >= 1."""
    if isinstance(num_drafts, bool):
        raise InvalidArgument(f"num_drafts: expected an integer >= 1, got {num_drafts!r}")
    try:
        value = operator.index(num_drafts)
    except TypeError:
        raise InvalidArgument(
            f"num_drafts: expected an integer >= 1, got {num_drafts!r} ({type(num_drafts).__name__})"
        ) from None
    if value < 1:
        raise InvalidArgument(f"num_drafts: expected an integer >= 1, got {value}")
    return value


def _num_drafts_tensor(
    num_drafts: Union[int, torch.Tensor], batch_shape: torch.Size, device: torch.device
) -> torch.Tensor:
    """num_drafts as a float64 tensor of shape batch_shape; shape checks only (no host sync)."""
    if isinstance(num_drafts, torch.Tensor):
        if num_drafts.dtype == torch.bool or num_drafts.is_complex():
            raise InvalidArgument(f"num_drafts: expected an integer or float tensor, got dtype {num_drafts.dtype}")
        # (numpy's broadcast rule: torch.broadcast_shapes imports sympy on first use, ~1 s)
        try:
            shape = torch.Size(np.broadcast_shapes(tuple(num_drafts.shape), tuple(batch_shape)))
        except ValueError:
            shape = None
        if shape != batch_shape:
            raise InvalidArgument(
                f"num_drafts: expected a tensor broadcastable to the batch shape {tuple(batch_shape)}, "
                f"got shape {tuple(num_drafts.shape)}"
            )
        return num_drafts.to(device=device, dtype=torch.float64).expand(batch_shape)
    value = _check_num_drafts(num_drafts)
    return torch.full(batch_shape, float(value), dtype=torch.float64, device=device)


# ---------------------------------------------------------------------------------------------
# K-SEQ
# ---------------------------------------------------------------------------------------------


def kseq_accept_prob(
    # [...]
    beta: torch.Tensor,
    # [...] or int
    num_drafts: Union[int, torch.Tensor],
) -> torch.Tensor:
    """K-SEQ's ``P_A = 1 - (1 - beta)^K``, computed without cancellation.

    Parameters
    ----------
    beta : torch.Tensor, shape ``[...]``
        ``beta(rho) = sum_x min(p(x), q(x) / rho)``; values are clamped to ``[0, 1]``.
    num_drafts : int or torch.Tensor broadcastable to ``[...]``
        K.

    Returns
    -------
    torch.Tensor
        ``[...]`` float64.

    Notes
    -----
    Evaluated as ``-expm1(K log1p(-beta))``: exact to a few ulps even for tiny beta, where
    ``1 - (1 - beta)**K`` loses all relative precision.

    Examples
    --------
    >>> kseq_accept_prob(torch.tensor([0.0, 0.5, 1.0], dtype=torch.float64), 2)
    tensor([0.0000, 0.7500, 1.0000], dtype=torch.float64)
    """
    beta = beta.to(torch.float64).clamp(0.0, 1.0)
    if isinstance(num_drafts, torch.Tensor):
        num_drafts = num_drafts.to(device=beta.device, dtype=torch.float64)
    return -torch.expm1(num_drafts * torch.log1p(-beta))


def _kseq_beta(draft: torch.Tensor, target: torch.Tensor, rho: torch.Tensor) -> torch.Tensor:
    """beta(rho) = sum_x min(p(x), q(x) / rho), per row."""
    return torch.minimum(draft, target / rho.unsqueeze(-1)).sum(-1)


def _kseq_gap(draft: torch.Tensor, target: torch.Tensor, rho: torch.Tensor, num_drafts: torch.Tensor) -> torch.Tensor:
    """f(rho) = rho beta - (1 - (1 - beta)^K), evaluated without cancellation (see kseq_rho_star)."""
    scaled_target = target / rho.unsqueeze(-1)
    diff = draft - scaled_target
    beta = torch.minimum(draft, scaled_target, out=scaled_target).sum(-1)  # reuse the buffer
    positive = diff.clamp(min=0)
    draft_excess = positive.sum(-1)  # 1 - beta for a normalised draft row
    target_excess = positive.sub_(diff).sum(-1)  # (-diff)_+ summed: (1 - rho beta) / rho for a normalised target row
    near_one = draft_excess.pow(num_drafts) - rho * target_excess
    small = rho * beta + torch.expm1(num_drafts * torch.log1p(-beta.clamp(max=1.0)))
    return torch.where(beta < 0.5, small, near_one)


def kseq_rho_star(
    # [..., vocab_size]
    draft_probs: torch.Tensor,
    # [..., vocab_size]
    target_probs: torch.Tensor,
    # [...] or int
    num_drafts: Union[int, torch.Tensor],
) -> torch.Tensor:
    """rho*, K-SEQ's acceptance scale, by bisection on ``[1, K]``; batched, no host sync.

    Parameters
    ----------
    draft_probs : torch.Tensor, shape ``[..., vocab_size]``
        Draft distributions p (float; computed in float64 on their device).
    target_probs : torch.Tensor, shape ``[..., vocab_size]``
        Target distributions q.
    num_drafts : int or torch.Tensor broadcastable to ``[...]``
        K per row (int or float dtype; rows may differ).

    Returns
    -------
    torch.Tensor
        ``[...]`` float64: rho*, the smallest rho in ``[1, K]`` with ``f(rho) >= 0`` (to the
        float64 resolution), where ``f(rho) = rho beta(rho) - (1 - (1 - beta(rho))^K)`` and
        ``beta(rho) = sum_x min(p(x), q(x) / rho)``.

    Notes
    -----
    This is the hot path of the K-SEQ verifier, so only shapes and dtypes are checked: rows
    are assumed to be distributions and K >= 1 (use :func:`kseq_acceptance` for a validated
    entry point).  It runs a fixed 64 bisection steps, each O(V) per row, with no Python loop
    over rows or tokens and no device-to-host sync.

    ``f`` is non-decreasing on ``[1, K]`` with ``f(1) <= 0 <= f(K)``; every rho with
    ``f(rho) >= 0`` is valid (the residual ``q - (P_A / beta) min(p, q / rho)`` is
    non-negative) and a rho just below rho* is not.  The bisection therefore keeps the upper
    bracket, where ``f`` evaluated in floating point is non-negative, and returns it.

    ``f`` is a difference of nearly equal numbers, so it is evaluated in the form that keeps
    its relative accuracy.  For ``beta < 1/2``: ``rho beta + expm1(K log1p(-beta))``.  For
    ``beta >= 1/2``, with normalised rows, ``1 - beta = sum_x (p(x) - q(x)/rho)_+`` and
    ``rho beta - 1 = -rho sum_x (q(x)/rho - p(x))_+``, so
    ``f = (sum_x (p - q/rho)_+)^K - rho sum_x (q/rho - p)_+``: sums of non-negative terms, a
    difference of two monotone terms (hence non-decreasing in floating point too), and exactly
    ``(1 - 1/rho)^K >= 0`` when p = q, so rho* = 1 there rather than wherever rounding noise
    of size 1e-16 first looks non-negative (with K = 8 that can be 1.01).

    Edge cases: K = 1 gives rho* = 1; disjoint supports (``beta = 0``, so ``f = 0``) give
    rho* = 1 and ``P_A = 0``; p = q gives rho* = 1 and ``P_A = 1``.

    Examples
    --------
    >>> draft = torch.tensor([0.6, 0.4], dtype=torch.float64)
    >>> target = torch.tensor([0.3, 0.7], dtype=torch.float64)
    >>> rho = kseq_rho_star(draft, target, 2)
    >>> bool(abs(rho - (0.8 + 0.34 ** 0.5)) < 1e-12)
    True
    """
    if not isinstance(draft_probs, torch.Tensor) or not isinstance(target_probs, torch.Tensor):
        raise InvalidArgument(
            f"draft_probs, target_probs: expected torch tensors, got "
            f"{type(draft_probs).__name__} and {type(target_probs).__name__}"
        )
    if not draft_probs.is_floating_point() or not target_probs.is_floating_point():
        raise InvalidArgument(
            f"draft_probs, target_probs: expected floating-point tensors, got {draft_probs.dtype} and "
            f"{target_probs.dtype}"
        )
    if target_probs.dim() == 0:
        raise InvalidArgument("target_probs: expected shape [..., vocab_size], got a scalar")
    if draft_probs.shape != target_probs.shape:
        raise InvalidArgument(
            f"draft_probs: expected shape [..., vocab_size] matching target_probs {tuple(target_probs.shape)}, "
            f"got {tuple(draft_probs.shape)}"
        )
    if draft_probs.device != target_probs.device:
        raise InvalidArgument(
            f"draft_probs: expected the device of target_probs ({target_probs.device}), got {draft_probs.device}"
        )
    draft = draft_probs.to(torch.float64)
    target = target_probs.to(torch.float64)
    batch_shape = draft.shape[:-1]
    k = _num_drafts_tensor(num_drafts, batch_shape, draft.device)
    return _rho_star_sorted(draft, target, k)


def kseq_rho_star_bisection(
    # [..., vocab_size]
    draft_probs: torch.Tensor,
    # [..., vocab_size]
    target_probs: torch.Tensor,
    # [...] or int
    num_drafts: Union[int, torch.Tensor],
) -> torch.Tensor:
    """rho* by 64 bisection steps over the whole vocabulary: the slow reference for :func:`kseq_rho_star`."""
    draft = draft_probs.to(torch.float64)
    target = target_probs.to(torch.float64)
    batch_shape = draft.shape[:-1]
    k = _num_drafts_tensor(num_drafts, batch_shape, draft.device)
    low = torch.ones(batch_shape, dtype=torch.float64, device=draft.device)
    high = k.clone()
    for _ in range(_BISECTION_STEPS):
        mid = 0.5 * (low + high)
        valid = _kseq_gap(draft, target, mid, k) >= 0
        high = torch.where(valid, mid, high)
        low = torch.where(valid, low, mid)
    return high


def _segment_gap(rho, draft_high, target_high, draft_low, target_low, k):
    """f(rho) on a segment where the tokens with q/p <= rho are fixed ("low") and the rest are "high".

    With normalised rows, ``rho beta - 1 = rho P_high - Q_high`` and
    ``1 - beta = P_low - Q_low / rho`` (a sum of non-negative terms ``p - q/rho``), so
    ``f = rho P_high - Q_high + (P_low - Q_low / rho)^K``: exactly ``(1 - 1/rho)^K`` when p = q.
    For ``beta < 1/2`` the direct form ``rho beta + expm1(K log1p(-beta))`` is the accurate one
    (exactly 0 for disjoint supports), as in :func:`_kseq_gap`.
    """
    return _segment_gap_and_slope(rho, draft_high, target_high, draft_low, target_low, k)[0]


def _segment_gap_and_slope(rho, draft_high, target_high, draft_low, target_low, k):
    """``(f, df/drho)`` of :func:`_segment_gap`; ``df/drho = P_high + K (1 - beta)^(K-1) Q_low / rho^2``."""
    beta = target_low / rho + draft_high
    one_minus_beta = (draft_low - target_low / rho).clamp(min=0)
    power_below = one_minus_beta ** (k - 1)  # (1 - beta)^(K-1); times (1 - beta) gives the K-th power
    near_one = rho * draft_high - target_high + power_below * one_minus_beta
    small = rho * beta + torch.expm1(k * torch.log1p(-beta.clamp(max=1.0)))
    slope = draft_high + k * power_below * target_low / (rho * rho)
    return torch.where(beta < 0.5, small, near_one), slope


def _solve_segment(draft_high, target_high, draft_low, target_low, k, low, high, *, steps, until_converged=False):
    """The smallest rho in ``[low, high]`` with segment gap >= 0, by safeguarded Newton.

    Requires gap(low) < 0 <= gap(high) on a segment where the formula is exact.  Newton steps
    that leave the bracket, or do not at least halve the previous step (slow, multiple-root-like
    convergence, e.g. p close to q), are replaced by bisection (``rtsafe``).  Returns the valid
    upper bracket.  With ``until_converged`` (CPU-side exact laws) rows stop once the bracket or
    the step is at the float64 resolution, checked with a host sync per step, for at most
    ``steps`` steps; otherwise exactly ``steps`` steps run (no host sync, for hot paths).  Each
    row's result depends only on that row.
    """
    x = high.clone()
    step_before = high - low
    done = torch.zeros_like(high, dtype=torch.bool)
    for _ in range(steps):
        gap, slope = _segment_gap_and_slope(x, draft_high, target_high, draft_low, target_low, k)
        valid = gap >= 0
        high = torch.where(valid & ~done, torch.minimum(high, x), high)
        low = torch.where(valid | done, low, torch.maximum(low, x))
        newton = x - gap / slope
        step = newton - x
        use_newton = (newton > low) & (newton < high) & (step.abs() <= 0.5 * step_before.abs())
        moved = torch.where(use_newton, newton, 0.5 * (low + high))
        tiny = 4 * torch.finfo(torch.float64).eps * high
        done = done | (high - low <= tiny) | ((moved - x).abs() <= tiny) | (gap == 0)
        step_before = torch.where(done, step_before, moved - x)
        x = torch.where(done, x, moved)
        if until_converged and bool(done.all()):
            break
    # Newton may converge from the invalid side (f concave there): probe a few ulps upwards.
    ulps = torch.tensor([0, 1, 2, 4, 8, 16, 64, 256], dtype=torch.float64, device=x.device)
    probes = x.unsqueeze(-1) * (1 + ulps * torch.finfo(torch.float64).eps)  # [..., 8], all at once
    columns = (t.unsqueeze(-1) for t in (draft_high, target_high, draft_low, target_low, k))
    gap = _segment_gap(probes, *columns)
    first_valid = torch.where(gap >= 0, probes, torch.full_like(probes, float("inf"))).amin(-1)
    return torch.minimum(high, first_valid)


def _rho_star_sorted(draft: torch.Tensor, target: torch.Tensor, k: torch.Tensor, *, hot: bool = False) -> torch.Tensor:
    """Exact piecewise solve: sort tokens by q/p, locate rho*'s segment, solve a scalar equation there.

    beta(rho) changes formula only at the ratios q(x)/p(x); between two consecutive ratios f
    is a smooth function of rho with a handful of per-row constants (prefix and suffix sums
    in ratio order).  f is evaluated at every ratio inside [1, K] at once, the last ratio
    with f < 0 and the first with f >= 0 bracket rho*, and a safeguarded Newton iteration
    inside that segment (no pass over the vocabulary) returns the valid upper bracket.
    ``hot``: at most :data:`_HOT_NEWTON_STEPS` Newton steps, and no host sync on accelerators
    (sampler hot path; on the CPU rows still stop once converged).
    """
    # The segment formula assumes rows that sum to 1; inputs may be off by the validation tolerance.
    draft = draft / draft.sum(-1, keepdim=True)
    target = target / target.sum(-1, keepdim=True)
    inf = torch.tensor(float("inf"), dtype=torch.float64, device=draft.device)
    ratio = torch.where(draft > 0, target / torch.where(draft > 0, draft, torch.ones_like(draft)), inf)
    ratio, order = ratio.sort(dim=-1)
    draft_sorted = draft.gather(-1, order)
    target_sorted = target.gather(-1, order)
    # low[j] = sum over the first j + 1 tokens; high[j] = sum over the rest (exactly 0 when empty)
    draft_low = draft_sorted.cumsum(-1)
    target_low = target_sorted.cumsum(-1)
    draft_high = draft_sorted.flip(-1).cumsum(-1).flip(-1)
    target_high = target_sorted.flip(-1).cumsum(-1).flip(-1)
    zero = torch.zeros_like(draft_high[..., :1])
    draft_high = torch.cat([draft_high[..., 1:], zero], dim=-1)
    target_high = torch.cat([target_high[..., 1:], zero], dim=-1)
    kk = k.unsqueeze(-1)
    inside = (ratio >= 1) & (ratio <= kk)
    rho_at = torch.where(inside, ratio, torch.ones_like(ratio))
    gap_at = _segment_gap(rho_at, draft_high, target_high, draft_low, target_low, kk)
    ones = torch.ones_like(k)
    low_end = torch.where(inside & (gap_at < 0), ratio, -inf).amax(-1).clamp(min=1.0)
    high_end = torch.minimum(torch.where(inside & (gap_at >= 0), ratio, inf).amin(-1), k)
    # The segment (low_end, high_end): tokens with ratio <= low_end are "low".
    count = torch.searchsorted(ratio, low_end.unsqueeze(-1).contiguous(), right=True)  # [..., 1]

    def at(prefix_sums: torch.Tensor, empty_value: float) -> torch.Tensor:
        idx = (count - 1).clamp(min=0)
        value = prefix_sums.gather(-1, idx).squeeze(-1)
        return torch.where(count.squeeze(-1) > 0, value, torch.full_like(value, empty_value))

    d_low, t_low = at(draft_low, 0.0), at(target_low, 0.0)
    # high sums over tokens after the first `count`: total minus nothing when count = 0
    d_high = torch.where(count.squeeze(-1) > 0, at(draft_high, 0.0), draft_sorted.sum(-1))
    t_high = torch.where(count.squeeze(-1) > 0, at(target_high, 0.0), target_sorted.sum(-1))
    high = _solve_segment(
        d_high, t_high, d_low, t_low, k, low_end, high_end,
        steps=_HOT_NEWTON_STEPS if hot else 4 * _BISECTION_STEPS,
        # On the CPU a convergence check costs no device round trip, so the hot path stops early there too.
        until_converged=not hot or draft.device.type == "cpu",
    )
    at_one = _segment_gap(ones, d_high, t_high, d_low, t_low, k) >= 0
    return torch.where((low_end <= 1) & at_one, ones, high)


#: Safeguarded Newton steps inside rho*'s segment on the hot path (quadratic convergence from a bracket).
_HOT_NEWTON_STEPS = 24

#: Vocabulary size above which the sampler finds rho* without sorting (:func:`kseq_rho_star_sampler`).
_SORT_FREE_MIN_VOCAB = 256

#: Passes over the vocabulary of the sort-free rho* solve.
_SORT_FREE_PASSES = 6


def _grid_root(is_valid, below: torch.Tensor, above: torch.Tensor, *, rounds: int = 6, points: int = 16) -> torch.Tensor:
    """Smallest valid point of a monotone predicate on ``[below, above]``, to ``(above - below) / points**rounds``.

    Each round evaluates ``is_valid`` (``[..., points] -> [..., points]`` bool) at ``points`` evenly
    spaced points at once and keeps the cell where it turns true: a grid search instead of
    ``rounds * log2(points)`` sequential bisection steps (each a dozen tiny kernel launches).
    ``above`` is assumed valid; the result is always a point found valid (or ``above``).
    """
    steps = torch.arange(1, points + 1, dtype=below.dtype, device=below.device) / points
    for _ in range(rounds):
        grid = below.unsqueeze(-1) + (above - below).unsqueeze(-1) * steps  # [..., points]; the last is `above`
        valid = is_valid(grid)
        valid[..., -1] = True
        first = valid.to(torch.int8).argmax(-1, keepdim=True)  # first valid grid point
        new_above = grid.gather(-1, first).squeeze(-1)
        new_below = torch.where(first.squeeze(-1) > 0, grid.gather(-1, (first - 1).clamp(min=0)).squeeze(-1), below)
        below, above = new_below, torch.minimum(new_above, above)
    return above


def _complement(low_mass: torch.Tensor, margin: float) -> torch.Tensor:
    """``1 - low_mass``, with values within ``margin`` of 0 (the rounding of ``1 - sum``) set to exactly 0.

    Exact zeros matter: disjoint supports give beta = 0 and f(1) = 0 only if the high draft mass is 0.
    """
    high = 1 - low_mass
    return torch.where(high > margin, high, torch.zeros_like(high))


def kseq_rho_star_sampler(
    # [n, vocab_size] float32 or float64
    draft_probs: torch.Tensor,
    # [n, vocab_size]
    target_probs: torch.Tensor,
    # [n] float64
    num_drafts: torch.Tensor,
    *,
    passes: int = _SORT_FREE_PASSES,
) -> torch.Tensor:  # [n] float64
    """A valid rho for K-SEQ's sampler, equal to rho* to the inputs' precision; no sort, no host sync on accelerators.

    The exact law uses :func:`kseq_rho_star`; a sampler only needs a rho with ``f(rho) >= 0``
    (then the residual is non-negative and the output law is exactly q) that is as small as the
    inputs' precision allows (acceptance).  Small vocabularies take the sorted solve with a fixed
    number of Newton steps.  Larger ones avoid the O(V log V) sort: each pass classifies tokens at
    two candidates c (``q/p <= c``) and sums p, q and the count over the low tokens with one batched
    matrix product, which gives f(c) exactly and f on the whole segment around c.  The next two
    candidates are the roots of the segment functions through the bracket's lower and upper ends
    (a Newton-like step that knows f's curvature; where the upper end's root is no better, the
    lower end's root overshot by four of its steps), each rounded up to the next value of the
    inputs' dtype so that it lands on the valid side of a root inside the segment (the roots come
    from a grid search inside the bracket to 1/16^6 of its width: no pass over the vocabulary).
    The answer is the smallest candidate found valid, refined by an exact segment solve when no
    ratio lies between it and the largest invalid candidate.  f(c) counts as valid only above a
    margin of 16 ulps of the inputs' dtype, which covers the rounding of float32 sums; with float32
    rows that leaves residual mass of order 1e-6 on tokens whose exact residual at rho* is 0 (the
    output law is still exactly q: any valid rho gives it).

    Parameters
    ----------
    draft_probs, target_probs : torch.Tensor, shape ``[n, vocab_size]``
        Distributions (within the input tolerance of summing to 1), float32 or float64.
    num_drafts : torch.Tensor, shape ``[n]``
        K >= 1 per row, float64.
    passes : int
        Passes over the vocabulary (sort-free path).
    """
    n, vocab_size = draft_probs.shape
    k = num_drafts.to(torch.float64)
    if vocab_size <= _SORT_FREE_MIN_VOCAB:
        return _rho_star_sorted(draft_probs.double(), target_probs.double(), k, hot=True)
    dtype, device = draft_probs.dtype, draft_probs.device
    margin = 16 * torch.finfo(dtype).eps
    fused = compiled_enabled()
    if fused:  # one fused kernel per pass (spectr_audit.verifiers.compiled), nothing materialised
        totals = torch.stack([draft_probs.sum(-1), target_probs.sum(-1)], dim=-1).double().unsqueeze(-1)
    else:
        ratio = (target_probs / draft_probs).unsqueeze(1)  # [n, 1, V]; inf (p = 0 < q), nan (0/0): never "low"
        # [n, 3, V]: p, q and ones, so one bmm against the low masks gives P_low, Q_low and the low count
        stacked = torch.stack([draft_probs, target_probs, torch.ones_like(draft_probs)], dim=1)
        totals = stacked[:, :2].sum(-1).double().unsqueeze(-1)  # [n, 2, 1]
    ones = torch.ones(n, dtype=torch.float64, device=device)
    low, high = ones.clone(), k.clone()
    low_sums = torch.zeros(n, 3, dtype=torch.float64, device=device)
    high_sums = torch.full((n, 3), -1.0, dtype=torch.float64, device=device)  # count -1: not evaluated
    up = torch.tensor(float("inf"), dtype=dtype, device=device)
    kk = k.unsqueeze(-1)
    candidates = torch.stack([ones, k], dim=-1)  # [n, 2]: two candidates per pass, one from each side
    # [n, 2, V], reused by every pass: a comparison written straight into a float buffer is one cheap
    # pass, where a bool mask and its conversion cost an allocation and two more
    low_mask = None if fused else torch.empty(n, 2, vocab_size, dtype=dtype, device=device)
    for _ in range(passes):
        threshold = candidates.to(dtype)
        candidates = threshold.double()
        if fused:
            sums = kseq_low_sums(draft_probs, target_probs, threshold).double()  # [n, 3, 2]
        else:
            torch.le(ratio, threshold.unsqueeze(-1), out=low_mask)
            sums = torch.bmm(stacked, low_mask.transpose(1, 2)).double()  # [n, 3, 2]
        sums = torch.cat([sums[:, :2] / totals, sums[:, 2:]], dim=1)  # normalised P_low, Q_low; count
        d_low, t_low = sums[:, 0], sums[:, 1]  # [n, 2]
        d_high, t_high = _complement(d_low, margin), _complement(t_low, margin)
        gap = _segment_gap(candidates, d_high, t_high, d_low, t_low, kk)
        for side in range(2):
            c, s = candidates[:, side], sums[:, :, side]
            # rho = 1 is judged without the margin: f(1) = (1 - beta)^K - (1 - beta) is exactly 0 for p = q,
            # disjoint supports or K = 1, and negative otherwise by far more than the rounding
            valid = gap[:, side] >= torch.where(c == 1, 0.0, margin)
            new_high = valid & (c <= high)
            new_low = ~valid & (c >= low)
            high = torch.where(new_high, c, high)
            high_sums = torch.where(new_high.unsqueeze(-1), s, high_sums)
            low = torch.where(new_low, c, low)
            low_sums = torch.where(new_low.unsqueeze(-1), s, low_sums)
        # Next candidates: the roots of the segment functions through the bracket's two ends, found by a
        # grid search inside the bracket (robust where Newton crawls, e.g. p close to q; no pass over the
        # vocabulary), on the side where they are >= margin, rounded up to the next value of the dtype.
        ends = torch.stack([low_sums, high_sums.clamp(min=0)], dim=-1)  # [n, 3, 2]
        e_low_d, e_low_t = ends[:, 0], ends[:, 1]
        e_high_d, e_high_t = _complement(e_low_d, margin), _complement(e_low_t, margin)
        above = _grid_root(
            lambda x: _segment_gap(x, *(t.unsqueeze(-1) for t in (e_high_d, e_high_t, e_low_d, e_low_t, kk))) >= margin,
            low.unsqueeze(-1).expand(n, 2), high.unsqueeze(-1).expand(n, 2),
        )
        roots = torch.nextafter(above.to(dtype), up).double()
        # Where the upper end's root does not lie above the lower end's (the lower end's model creeps up
        # on rho*, e.g. p close to q), overshoot the lower end's root by 4 of its steps instead.
        from_low, from_high = roots[:, 0], roots[:, 1]
        overshoot = from_low + 4 * (from_low - low)
        roots = torch.stack([from_low, torch.where(from_high > from_low, from_high, overshoot)], dim=-1)
        inside = (roots > low.unsqueeze(-1)) & (roots < high.unsqueeze(-1)) & torch.isfinite(roots)
        middle = (0.5 * (low + high)).unsqueeze(-1)
        candidates = torch.where(inside, roots, middle)
    same_segment = low_sums[:, 2] == high_sums[:, 2]
    d_low, t_low = low_sums[:, 0], low_sums[:, 1]
    d_high, t_high = _complement(d_low, margin), _complement(t_low, margin)
    refined = _solve_segment(d_high, t_high, d_low, t_low, k, low, high, steps=_HOT_NEWTON_STEPS)
    # the same margin as the candidates: move up until f is at least `margin` (one Newton step on the segment)
    gap, slope = _segment_gap_and_slope(refined, d_high, t_high, d_low, t_low, k)
    refined = refined + (margin - gap).clamp(min=0) / slope
    return torch.where(same_segment, torch.minimum(refined, high), high)


