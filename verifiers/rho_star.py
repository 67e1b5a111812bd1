"""K-SEQ's acceptance scale rho*: the exact solve, the bisection oracle and the sampler's fast solve."""

from __future__ import annotations

import operator
from typing import Optional, Union

import numpy as np
import torch

from spectr_audit.errors import InvalidArgument
from spectr_audit.verifiers.compiled import compiled_enabled, kseq_low_sums

#: Bisection steps for rho*: 64 halvings of [1, K] reach adjacent floats for any K < 2**10.
_BISECTION_STEPS = 64


def _row_slots(mask: torch.Tensor, counts: torch.Tensor, vocab_size: int) -> tuple:
    """Where ``mask`` (``[n, V]``, contiguous) is true, row-major: ``(flat, rows, slot)``, the flat position
    ``row * V + token`` (each row's tokens in order), the row, and the entry's place among its row's true entries
    (``counts``: how many each row holds), for packing each row's entries left-aligned."""
    flat = mask.view(-1).nonzero().squeeze(1)
    rows = flat.div(vocab_size, rounding_mode="floor")
    slot = torch.arange(flat.shape[0], device=flat.device) - (counts.cumsum(0) - counts).index_select(0, rows)
    return flat, rows, slot


def check_num_drafts(num_drafts: object) -> int:
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
    if value > _MAX_NUM_DRAFTS:
        raise InvalidArgument(f"num_drafts: at most 2**63 - 1 (torch's 64-bit integers), got {value}")
    return value


#: The largest num_drafts: torch takes integer scalars as 64-bit signed integers.
_MAX_NUM_DRAFTS = 2**63 - 1


def num_drafts_tensor(
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
    value = check_num_drafts(num_drafts)
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


def kseq_beta(draft: torch.Tensor, target: torch.Tensor, rho: torch.Tensor) -> torch.Tensor:
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
    """rho*, K-SEQ's acceptance scale, by the exact piecewise solve on ``[1, K]``; batched.

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
    This is the solve of K-SEQ's exact law, so only shapes and dtypes are checked: rows are
    assumed to be distributions and K >= 1 (use :func:`kseq_acceptance` for a validated entry
    point).  Each row's tokens are sorted by ``q/p`` once (O(V log V)); ``f`` is evaluated at
    every ratio inside ``[1, K]`` at once, and ``f = 0`` is solved on the segment that brackets
    rho* by safeguarded Newton, which needs no further pass over the vocabulary.  No Python loop
    runs over rows or tokens; rows stop once converged, which is checked on the host after each
    Newton step (the sampler's solve, :func:`kseq_rho_star_sampler`, avoids that sync).
    :func:`kseq_rho_star_bisection` is its slow oracle (docs/rules/kseq.md).

    ``f`` is non-decreasing on ``[1, K]`` with ``f(1) <= 0 <= f(K)``; every rho with
    ``f(rho) >= 0`` is valid (the residual ``q - (P_A / beta) min(p, q / rho)`` is
    non-negative) and a rho just below rho* is not.  The solve therefore keeps the upper
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
    k = num_drafts_tensor(num_drafts, batch_shape, draft.device)
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
    k = num_drafts_tensor(num_drafts, batch_shape, draft.device)
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
    # the arithmetic of _segment_gap_and_slope, without the slope (this one runs inside grid searches, on
    # [n, columns, 64] points: the same operations in the same order, in place on fresh temporaries)
    scaled = target_low / rho
    beta = scaled + draft_high
    one_minus_beta = (draft_low - scaled).clamp_(min=0)
    near_one = rho * draft_high - target_high + one_minus_beta.pow(k - 1).mul_(one_minus_beta)
    small = rho * beta + (k * beta.clamp(max=1.0).neg_().log1p_()).expm1_()
    return torch.where(beta < 0.5, small, near_one)


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

#: Passes over the vocabulary of the sort-free rho* solve (at most: on the CPU it stops once converged).
#: Seven leave every row of the randomised and peaked cases in tests/verifiers/test_rho_star.py within
#: the margin's cost of the optimum; six leave an occasional row 1e-5 short.
_SORT_FREE_PASSES = 7

#: With ``stop_early`` the sort-free solve stops once every row's acceptance is provably within this
#: fraction of its validity margin (about 2e-6 for float32 rows) of the best acceptance a valid rho
#: allows (a bound from the bracket, see :func:`_bracket_models`): a small share of what the margin costs.
_SORT_FREE_STOP_FRACTION = 1 / 8


def _grid_root(is_valid, below: torch.Tensor, above: torch.Tensor, *, rounds: int = 4, points: int = 64) -> torch.Tensor:
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


def _complement(low_mass: torch.Tensor, snap: float) -> torch.Tensor:
    """``1 - low_mass``, with values within ``snap`` of 0 (the rounding of ``1 - sum``) set to exactly 0.

    Exact zeros matter: disjoint supports give beta = 0 and f(1) = 0 only if the high draft mass is 0.
    """
    high = 1 - low_mass
    return torch.where(high > snap, high, torch.zeros_like(high))


def _bracket_models(
    low: torch.Tensor,  # [n]
    high: torch.Tensor,  # [n]
    low_sums: torch.Tensor,  # [n, 2]: normalised P, Q over the tokens with q/p <= low
    high_sums: torch.Tensor,  # [n, 2]: the same at high
    snap: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:  # four [n, 4]
    """Four segment functions on the bracket ``[low, high]``, as :func:`_segment_gap`'s sums ``(P_high, Q_high, P_low, Q_low)``.

    Every function here is ``F(x, b(x))`` with ``F(x, b) = x b - 1 + (1 - b)^K`` and a linear model
    ``b(x) = Q'/x + P'`` of ``beta(x) = sum_x min(p, q/x)``.  ``F(x, .)`` is convex with
    ``F(x, 0) = 0``, so where ``F(x, b) > 0`` it is increasing in b from b on: a model
    ``b >= beta`` is >= f wherever f > 0, and a model ``b <= beta`` that is > 0 makes f > 0.

    Columns 0 and 1, the tokens split at ``low`` and at ``high`` (each exact on its own segment):
    a token on the wrong side contributes max(p, q/x) instead of the min, so ``b >= beta`` and
    their roots are lower bounds on f's root (the next candidates from below).

    Columns 2 and 3, lower bounds on beta over the bracket: a token with ratio r in
    ``(low, high]`` (masses P_mid, Q_mid) has ``min(p, q/x) >= p low / x`` and ``>= q / high``,
    so ``b = (Q_low + low P_mid) / x + P_high`` and ``b = Q_low / x + P_high + Q_mid / high``
    (sums at low, P_high at high) are <= beta, exact at ``low`` and at ``high`` respectively,
    and exact everywhere when no token lies inside the bracket.  Their roots are valid rhos
    (upper bounds on f's root) without another pass over the vocabulary.
    """
    d_lo, t_lo = low_sums[:, 0], low_sums[:, 1]
    d_hi, t_hi = high_sums[:, 0], high_sums[:, 1]
    d_mid = (d_hi - d_lo).clamp(min=0)
    t_mid = (t_hi - t_lo).clamp(min=0)
    t_low_2 = t_lo + low * d_mid  # the inside tokens as low tokens of ratio `low`
    d_high_3 = _complement(d_hi, snap) + t_mid / high  # the inside tokens as high tokens with p = q / high
    d_hi_high, t_lo_high = _complement(d_hi, snap), _complement(t_lo, snap)
    draft_high = torch.stack([_complement(d_lo, snap), d_hi_high, d_hi_high, d_high_3], -1)
    target_high = torch.stack([t_lo_high, _complement(t_hi, snap), _complement(t_low_2, snap), t_lo_high], -1)
    draft_low = torch.stack([d_lo, d_hi, d_hi, (d_hi - t_mid / high).clamp(min=0)], -1)
    target_low = torch.stack([t_lo, t_hi, t_low_2, t_lo], -1)
    return draft_high, target_high, draft_low, target_low


def _inverse_hermite(
    ends: torch.Tensor,  # [n, 2]: a bracket (low, high)
    values: torch.Tensor,  # [n, 2]: an increasing function there, < 0 at low and >= 0 at high
    slopes: torch.Tensor,  # [n, 2]: its derivatives there (> 0)
) -> torch.Tensor:  # [n]
    """Where the cubic Hermite interpolant of the inverse function (x against the value) crosses 0."""
    span = (values[:, 1] - values[:, 0]).clamp(min=torch.finfo(values.dtype).tiny)
    t = (-values[:, 0] / span).clamp(0, 1)
    t2, t3 = t * t, t * t * t
    inverse_slopes = span.unsqueeze(-1) / slopes  # dx/dvalue, scaled to the unit interval
    guess = (
        (2 * t3 - 3 * t2 + 1) * ends[:, 0]
        + (t3 - 2 * t2 + t) * inverse_slopes[:, 0]
        + (3 * t2 - 2 * t3) * ends[:, 1]
        + (t3 - t2) * inverse_slopes[:, 1]
    )
    return torch.minimum(torch.maximum(guess, ends[:, 0]), ends[:, 1])


def _model_beta(x: torch.Tensor, draft_high: torch.Tensor, target_low: torch.Tensor) -> torch.Tensor:
    """A segment model's beta at x: ``Q_low / x + P_high``."""
    return target_low / x + draft_high


#: The sort-free solve's later passes read only the tokens with 1 < q/p <= K when no row has more than this
#: fraction of its tokens there (else full passes: the gathering would cost more than it saves).
_INSIDE_FRACTION = 0.25


class _InsideTokens:
    """The tokens with ``1 < q/p <= K`` of the sort-free solve's rows, gathered once after its first pass.

    At a candidate ``c`` in ``[1, K]`` the low tokens (``q/p <= c``) are those with ``q/p <= 1`` and the
    gathered ones with ``q/p <= c``, so the low sums at c are the sums at 1 plus a sum over the gathered
    tokens: the same classification as a full pass, summed in float64 in another order (within the
    rounding that the solve's margin allows for float64 sums over the vocabulary).  The gathered tokens
    sit left-aligned in rows of the largest row's count (padding: p = q = 0, q/p = inf, never low), so a
    pass is the full pass's comparison and batched matrix product on those rows.
    """

    def __init__(self, values, ratios, base):
        self.values = values  # [n, 2, W] float64: p and q of each row's gathered tokens
        self.ratios = ratios  # [n, 1, W]: their q/p in the rows' dtype
        self.base = base  # [n, 2] float64: the sums of p and q over the tokens with q/p <= 1
        self.mask = torch.empty_like(values)

    @classmethod
    def of(cls, stacked, ratio, low_mask, sums):
        """From the first pass (candidates 1 and K): ``stacked [n, 2, V]`` p and q, ``ratio [n, 1, V]``, its
        masks ``[n, 2, V]`` and sums ``[n, 2, 2]``; None where the padded rows would hold over
        :data:`_INSIDE_FRACTION` of the tokens."""
        n, _, vocab_size = stacked.shape
        inside = low_mask[:, 1] > low_mask[:, 0]  # q/p <= K and not q/p <= 1, [n, V]
        counts = inside.sum(-1)  # [n]
        width = int(counts.max()) if n else 0
        if width > _INSIDE_FRACTION * vocab_size:
            return None
        width = max(width, 1)
        # flat positions (1-D index_select and index_copy_: several times faster than advanced indexing)
        flat, rows, slot = _row_slots(inside, counts, vocab_size)
        source = flat + rows * vocab_size  # p of the token in the flat [n, 2, V]; q is V further
        target = rows * (2 * width) + slot  # its place in the flat [n, 2, W]; q is W further
        values = torch.zeros(n * 2 * width, dtype=stacked.dtype, device=stacked.device)
        whole = stacked.reshape(-1)
        values.index_copy_(0, target, whole.index_select(0, source))
        values.index_copy_(0, target + width, whole.index_select(0, source + vocab_size))
        ratios = torch.full((n * width,), float("inf"), dtype=ratio.dtype, device=ratio.device)
        ratios.index_copy_(0, rows * width + slot, ratio.reshape(-1).index_select(0, flat))
        return cls(values.view(n, 2, width), ratios.view(n, 1, width), sums[:, :, 0].clone())

    def low_sums(self, candidates):  # [n, 2] -> [n, 2, 2]: sums of p and q (dim 1) at each candidate (dim 2)
        """The low sums at ``candidates`` ``[n, 2]`` (in the ratios' dtype, as a full pass compares them)."""
        torch.le(self.ratios, candidates.unsqueeze(-1), out=self.mask)
        return self.base.unsqueeze(-1) + torch.bmm(self.values, self.mask.transpose(1, 2))


class _AboveOneTokens:
    """The tokens with ``q/p > 1`` of the sort-free solve's rows, gathered once from the rows themselves.

    Every candidate c lies in ``[1, K]``, so a token with ``q/p <= 1`` is low at every candidate: the low
    sums at c are the rows' totals less the sums over the gathered tokens with ``q/p > c``.  That is the
    full pass's classification (``q/p <= c`` in the rows' dtype) summed in float64 in another order (within
    the rounding that the solve's margin allows for float64 sums over the vocabulary), and it needs neither
    a float64 copy of the rows nor a mask over every token: one comparison, one count and the gathering
    read the vocabulary, and every pass, the first included, reads the gathered tokens only (a tenth of
    the vocabulary on peaked rows, where most of the draft's tokens are over-proposed).  The gathered
    tokens sit left-aligned in rows of the largest row's count (padding: p = q = 0, never above c).

    A difference within ``snap`` (relative to the total) of 0 is set to exactly 0, as a full pass would sum
    no mass where no low token has any (disjoint supports: beta = 0, f(1) = 0, rho = 1).
    """

    def __init__(self, values, ratios, totals, snap):
        self.values = values  # [n, 2, W] float64: p and q of each row's gathered tokens
        self.ratios = ratios  # [n, 1, W]: their q/p in the rows' dtype
        self.totals = totals  # [n, 2, 1] float64: the rows' totals
        self.floor = snap * totals  # [n, 2, 1]: low sums at most this are 0
        self.mask = torch.empty_like(values)

    @classmethod
    def of(cls, draft, target, totals, snap):
        """From the rows ``[n, V]`` and their ``totals [n, 2, 1]``; None where the padded rows would hold over
        :data:`_INSIDE_FRACTION` of the tokens."""
        n, vocab_size = draft.shape
        # [n, V] bool: q/p > 1 in the rows' dtype is q > p (if q > p, q is at least p plus an ulp of p, and the
        # quotient, above 1 by more than half an ulp of 1, rounds above 1; if q <= p it is at most 1), also
        # where p = 0 (q/p = inf is above, 0/0 = nan is not): the same tokens, without forming the quotient
        above = torch.gt(target, draft)
        # counted before the positions are found, whose cost grows with the count (where the rows are dense, the
        # full passes run without it); summed as int8 into int32: several times faster than a bool sum
        counts = above.view(torch.int8).sum(-1, dtype=torch.int32).long()  # [n]
        width = int(counts.max()) if n else 0
        if width > _INSIDE_FRACTION * vocab_size:
            return None
        width = max(width, 1)
        flat, rows, slot = _row_slots(above, counts, vocab_size)
        # [n, W] each row's tokens left-aligned (1-D index_copy_: several times faster than advanced indexing);
        # the padding points at token 0 and is zeroed below
        index = torch.zeros(n * width, dtype=torch.int64, device=flat.device)
        index.index_copy_(0, rows * width + slot, flat - rows * vocab_size)
        index = index.view(n, width)
        values = torch.empty(n, 2, width, dtype=torch.float64, device=draft.device)
        values[:, 0].copy_(draft.gather(-1, index))  # the rows read in place, strided views or not
        values[:, 1].copy_(target.gather(-1, index))
        padding = torch.arange(width, device=flat.device) >= counts.unsqueeze(-1)  # [n, W]
        values.masked_fill_(padding.unsqueeze(1), 0.0)
        # their q/p as the full pass forms it (the same division of the same numbers); padding 0, never above
        ratios = torch.div(values[:, 1:], values[:, :1]).to(draft.dtype).nan_to_num_(nan=0.0, posinf=float("inf"))
        return cls(values, ratios, totals, snap)

    def low_sums(self, candidates):  # [n, 2] -> [n, 2, 2]: sums of p and q (dim 1) at each candidate (dim 2)
        """The low sums at ``candidates`` ``[n, 2]`` (in the ratios' dtype, as a full pass compares them)."""
        torch.gt(self.ratios, candidates.unsqueeze(-1), out=self.mask)
        sums = self.totals - torch.bmm(self.values, self.mask.transpose(1, 2))
        return torch.where(sums > self.floor, sums, torch.zeros_like(sums))


def kseq_rho_star_sampler(
    # [n, vocab_size] float32 or float64
    draft_probs: torch.Tensor,
    # [n, vocab_size]
    target_probs: torch.Tensor,
    # [n] float64
    num_drafts: torch.Tensor,
    *,
    passes: int = _SORT_FREE_PASSES,
    stop_early: Optional[bool] = None,
) -> torch.Tensor:  # [n] float64
    """A valid rho for K-SEQ's sampler, equal to rho* to the inputs' precision; no sort, no host sync on accelerators.

    The exact law uses :func:`kseq_rho_star`; a sampler only needs a rho with ``f(rho) >= 0``
    (then the residual is non-negative and the output law is exactly q) that is as small as the
    inputs' precision allows (acceptance).  Small vocabularies take the sorted solve with a fixed
    number of Newton steps.  Larger ones avoid the O(V log V) sort: each pass classifies tokens at
    two candidates c (``q/p <= c``) and sums p and q over the low tokens with one batched matrix
    product accumulated in float64 (float32 sums over V round far above the margin below), which
    gives f(c) exactly and keeps the bracket ``[low, high]`` (f < margin at low, >= margin at high)
    with its sums.  From those sums alone (:func:`_bracket_models`) come a lower and an upper bound
    on the root, each found by a grid search inside the bracket to 1/64^4 of its width (no pass
    over the vocabulary).  The next candidates are the lower bound (exact, hence valid, once no
    token lies between it and low) and, where the last pass moved the upper end, the root of the
    inverse cubic through both ends' values and slopes (fast where many ratios lie inside and f is
    smooth on the bracket's scale), else the upper bound; each is rounded up to the next value of
    the inputs' dtype.  The answer is the upper bound's root on the final bracket: valid however
    many passes ran, and rho*'s own segment solve once no token lies inside the bracket.

    f counts as valid only above a margin of ``max(16, K)`` ulps of the inputs' dtype (plus the
    rounding of float64 sums over V): a token within rounding of c may be classified on either
    side, and the sampler uses rho in the rows' dtype.  With float32 rows that costs acceptance of
    order 1e-6 and leaves residual mass of that order on tokens whose exact residual at rho* is 0
    (the output law is still exactly q: any valid rho gives it).

    Parameters
    ----------
    draft_probs, target_probs : torch.Tensor, shape ``[n, vocab_size]``
        Distributions (within the input tolerance of summing to 1), float32 or float64.
    num_drafts : torch.Tensor, shape ``[n]``
        K >= 1 per row, float64.
    passes : int
        Passes over the vocabulary (sort-free path; at most, with ``stop_early``), >= 1.
    stop_early : bool, optional
        Stop once every row's acceptance is provably within :data:`_SORT_FREE_STOP_FRACTION` of
        its margin of the best a valid rho allows, checked on the host after each pass; default:
        on the CPU only, where that check costs no device round trip.

    Returns
    -------
    torch.Tensor
        ``[n]`` float64: rho with ``f(rho) >= 0`` on the rows renormalised, at least rho*.

    Examples
    --------
    >>> draft = torch.softmax(torch.linspace(0.0, 3.0, 1000), dim=0).unsqueeze(0)
    >>> target = torch.softmax(torch.linspace(3.0, 0.0, 1000), dim=0).unsqueeze(0)
    >>> rho = kseq_rho_star_sampler(draft, target, torch.tensor([4.0], dtype=torch.float64))
    >>> exact = kseq_rho_star(draft.double(), target.double(), 4)
    >>> bool(exact <= rho <= exact * (1 + 1e-5))
    True
    """
    if isinstance(passes, bool) or not isinstance(passes, int) or passes < 1:
        raise InvalidArgument(f"passes: expected an integer >= 1, got {passes!r}")
    n, vocab_size = draft_probs.shape
    k = num_drafts.to(torch.float64)
    if vocab_size <= _SORT_FREE_MIN_VOCAB:
        return _rho_star_sorted(draft_probs.double(), target_probs.double(), k, hot=True)
    dtype, device = draft_probs.dtype, draft_probs.device
    if stop_early is None:
        stop_early = device.type == "cpu"  # a host check costs no device round trip there
    eps64 = torch.finfo(torch.float64).eps
    # [n] f(c) >= margin counts as valid: tokens within rounding of c may be classified on either side
    # (each moves beta by up to p ulp/2, f by K times that), and float64 sums over V round
    margin = torch.finfo(dtype).eps * k.clamp(min=16) + 16 * vocab_size * eps64
    snap = 4 * vocab_size * eps64  # the rounding of 1 - (a float64 sum over the vocabulary)
    fused = compiled_enabled()
    # [n, 2, 1], summed from the rows as given (the same values in float64: a quarter of the bytes read)
    totals = torch.stack(
        [draft_probs.sum(-1, dtype=torch.float64), target_probs.sum(-1, dtype=torch.float64)], dim=-1
    ).unsqueeze(-1)
    above = None  # the tokens with q/p > 1, where few enough (eager path): every pass reads only those
    if not fused:
        above = _AboveOneTokens.of(draft_probs, target_probs, totals, snap)
    if not fused and above is None:
        # [n, 1, V] q/p in the rows' dtype (a token within its rounding of a candidate is within the margin, as
        # in the fused pass's q <= c p); inf (p = 0 < q), nan (0/0): never "low"
        ratio = torch.div(target_probs, draft_probs).unsqueeze(1)
        # [n, 2, V] float64 p and q, so one bmm against the low masks sums both in float64: a float32
        # product rounds V terms far above the margin (and may run in TF32 on a GPU)
        stacked = torch.empty(n, 2, vocab_size, dtype=torch.float64, device=device)
        stacked[:, 0].copy_(draft_probs)
        stacked[:, 1].copy_(target_probs)
        # [n, 2, V], reused by every pass: a comparison written straight into a float buffer is one cheap
        # pass, where a bool mask and its conversion cost an allocation and two more
        low_mask = torch.empty(n, 2, vocab_size, dtype=torch.float64, device=device)
    ones = torch.ones(n, dtype=torch.float64, device=device)
    low, high = ones.clone(), k.clone()
    low_sums = torch.zeros(n, 2, dtype=torch.float64, device=device)  # set by the first pass (c = 1)
    high_sums = torch.ones(n, 2, dtype=torch.float64, device=device)  # set by the first pass (c = K)
    up = torch.tensor(float("inf"), dtype=dtype, device=device)
    kk = k.unsqueeze(-1)
    candidates = torch.stack([ones, k], dim=-1)  # [n, 2]: two candidates per pass
    inside = None  # the tokens with 1 < q/p <= K, once the first pass has found them (eager path)
    for step in range(passes):
        threshold = candidates.to(dtype)
        candidates = threshold.double()
        high_before = high
        if fused:
            sums = kseq_low_sums(draft_probs, target_probs, threshold)  # [n, 2, 2] float64
        elif above is not None:
            sums = above.low_sums(threshold)
        elif inside is not None:
            sums = inside.low_sums(threshold)
        else:
            # (the candidates in the ratio's dtype, which holds them exactly: no widened copy of the ratio)
            torch.le(ratio, threshold.unsqueeze(-1), out=low_mask)
            sums = torch.bmm(stacked, low_mask.transpose(1, 2))  # [n, 2, 2] float64
            if step == 0 and passes > 1:
                # Every later candidate lies in [1, K]: tokens with q/p <= 1 are low at all of them and tokens
                # with q/p > K at none, so later passes read only the tokens in between (few, as a rule).
                inside = _InsideTokens.of(stacked, ratio, low_mask, sums)
        sums = sums / totals  # normalised P_low, Q_low at each candidate
        d_low, t_low = sums[:, 0], sums[:, 1]  # [n, 2]
        gap = _segment_gap(candidates, _complement(d_low, snap), _complement(t_low, snap), d_low, t_low, kk)
        # f(1) = (1 - beta)^K - (1 - beta) <= 0 is exactly 0 for p = q, disjoint supports or K = 1, and
        # negative otherwise by far more than the rounding: judged without the margin.  f(K) >= 0 always.
        valid = (gap >= torch.where(candidates == 1, 0.0, margin.unsqueeze(-1))) | (candidates >= kk)
        for side in range(2):
            c, s, v = candidates[:, side], sums[:, :, side], valid[:, side]
            new_high, new_low = v & (c <= high), ~v & (c >= low)
            high = torch.where(new_high, c, high)
            high_sums = torch.where(new_high.unsqueeze(-1), s, high_sums)
            low = torch.where(new_low, c, low)
            low_sums = torch.where(new_low.unsqueeze(-1), s, low_sums)
        # rho = 1 valid: the bracket is [1, 1], with the sums found there at both ends
        low_sums = torch.where((low == high).unsqueeze(-1), high_sums, low_sums)
        if step == passes - 1:
            break
        # Next candidates: the lower and the upper bound on the root from the bracket's models, rounded up
        # to the next value of the dtype (so the lower one is valid once the bracket holds no token).
        models = _bracket_models(low, high, low_sums, high_sums, snap)  # four [n, 4]
        columns = tuple(m.unsqueeze(-1) for m in models)
        roots = _grid_root(
            lambda x: _segment_gap(x, *columns, kk.unsqueeze(-1)) >= margin[:, None, None],
            low.unsqueeze(-1).expand(n, 4), high.unsqueeze(-1).expand(n, 4),
        )
        from_below, from_above = roots[:, :2].amax(-1), roots[:, 2:].amin(-1)
        if stop_early:
            # beta(x) <= the exact models' beta at from_below (<= f's root), >= the bounds' at from_above
            most = _model_beta(from_below.unsqueeze(-1), models[0][:, :2], models[3][:, :2]).amin(-1)
            least = _model_beta(from_above.unsqueeze(-1), models[0][:, 2:], models[3][:, 2:]).amax(-1)
            loss = kseq_accept_prob(most, k) - kseq_accept_prob(least, k)
            if bool((loss <= _SORT_FREE_STOP_FRACTION * margin).all()):
                break
        lower = torch.nextafter(from_below.to(dtype), up).double()
        lower = torch.where((lower > low) & (lower < high), lower, 0.5 * (low + high))
        # The second candidate: where the last pass moved the upper end, the root of the inverse cubic through
        # both ends' values and slopes (fast where many ratios lie inside the bracket and f is smooth on its
        # scale, where the bounds are loose); else the upper bound's root, which is valid and moves it.
        upper = torch.nextafter(from_above.to(dtype), up).double()
        ends = torch.stack([low, high], dim=-1)  # columns 0 and 1 of the models are exact there
        gap_ends, slope_ends = _segment_gap_and_slope(ends, *(m[:, :2] for m in models), kk)
        guess = _inverse_hermite(ends, gap_ends - margin.unsqueeze(-1), slope_ends)
        guess = torch.nextafter(guess.to(dtype), up).double()
        upper = torch.where((guess > lower) & (guess < upper) & (high < high_before), guess, upper)
        # where the upper bound is no better than the bracket's end (much mass inside it), halve the rest
        upper = torch.where((upper > lower) & (upper < high), upper, 0.5 * (lower + high))
        candidates = torch.stack([lower, upper], dim=-1)
    # The answer: the smallest point where a lower bound on f (columns 2 and 3) is >= margin on the final
    # bracket, to 1/64^4 of its width; `high` itself where none is (it was found valid by a pass).
    columns = tuple(m[:, 2:].unsqueeze(-1) for m in _bracket_models(low, high, low_sums, high_sums, snap))
    roots = _grid_root(
        lambda x: _segment_gap(x, *columns, kk.unsqueeze(-1)) >= margin[:, None, None],
        low.unsqueeze(-1).expand(n, 2), high.unsqueeze(-1).expand(n, 2),
    )
    rho = torch.minimum(roots.amin(-1), high)
    return torch.where(k <= 1, ones, rho)  # K = 1: f(1) = 0 exactly
