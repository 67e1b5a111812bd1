"""SpecTr-GBV (Lin, Sheng, Cai, Zhou, 2026): the PUBLISHED rule, under audit.

Sources (docs/rules/spectr-gbv.md): the paper describes
Algorithm 1 (iterate over the K drafts, skip sub-blocks already rejected,
acceptance h_ik by Eq. 2, residual Eq. 4) and Algorithm 2 (modify the target at
unaccepted positions before the next iteration).  The public implementation (repository junemily/SpecTr-GBV,
``src/engine.py``) computes, with joint prefix probabilities ``p(y), q(y)`` and
``c(y) = q(y) [1 - (1 - min(1, p(y)/q(y)))^K]``::

    tau = 0; sel = 0; H = {}
    for j = 1..K:
        for i = tau+1 .. L-1:
            y = x_j[1..i]
            h = (c(y) - sum_x c(yx)) / (1 - (1 - p(y))^K - sum_x c(yx))
            if y in H: skip
            if U < h: tau = i; sel = j          (no break: a later, longer acceptance wins)
            else: add y to H
        y = x_j[1..L]
        if U < c(y) / (1 - (1 - p(y))^K): tau = L; sel = j; stop     (no H check)
    tau < L: next ~ q(yx) (1 - min(1, p(yx)/q(yx))^K) normalised, y = x_sel[1..tau]
    tau = L: next ~ q(. | x_sel[1..L])

This module implements exactly that, including what may look like slips: the
test of draft j at length i does not check that x_j shares the already
accepted prefix; the residual uses ``1 - min(1, ratio)^K`` (the code's operator
precedence), not ``(1 - min(1, ratio))^K`` as in ``c``.  Numerics: the code's
guards are replaced by their limits (``x / (d + 1e-20)`` by ``x / d`` for
``d > 0`` and 0 for ``d = 0``; a residual with no mass, which the code cannot
sample, by the target ``q(. | x_sel[1..tau])``), and ``1 - (1 - x)^K`` and
``1 - x^K`` are evaluated with ``expm1``/``log1p`` in the exact law and as sums of
powers by Horner's rule in the sampler (same values, without the cancellation that the
literal formulas suffer for joint probabilities near 0 or 1; docs/rules/spectr-gbv.md).
For K = 1 the rule is greedy block verification (``c(y) = min(p(y), q(y))``).

What the audit found (block verification's worked example, docs/rules/block.md: context-free
p = (2/3, 1/3), q = (1/3, 2/3), L = 2; single iteration by
``spectr_audit.exact.iteration.exact_iteration``, the loop by
``spectr_audit.exact.multi_iteration.exact_multi_iteration``, optima by
``spectr_audit.bounds.block_lp.block_lp``):

* K = 1 (greedy block verification): TV 1/9 with the unmodified target, prefix
  cap respected, block efficiency 21/9 (the repair-allowed optimum; the exact
  optimum is block verification's 20/9).  The loop stays off by TV 1/9 (N = 3, 4).
* K = 2: TV 0.0646, prefix-cap excess 0.0238 at u = (1,), block efficiency
  2.4034, below the exact SpecTr tree's 2.4055 and the optima 212/81 = 2.6173
  (exact) and 215/81 = 2.6543 (repair allowed).  Loop TV 0.0586 (N = 3), 0.0608 (N = 4).
* K = 3: TV 0.0582, excess 0.0137 at (1,), efficiency 2.4995 (tree 2.5933, both
  optima 2080/729 = 2.8532).  Loop TV 0.0552 (N = 3), 0.0556 (N = 4).

For K >= 2 the prefix cap ``B(u) <= q(u)`` is exceeded, so no correction of
later iterations (Algorithm 2 or any other) can make the rule exact.  One
mechanism, hand-derived on p = (1, 0), q = (1/2, 1/2), L = 2: with identical
drafts each copy gets the full-draft test ``c(y) / (1 - (1 - p(y))^K) = q(y)``
independently, so the full draft is emitted with probability
``1 - (1 - q(y))^K`` instead of ``q(y)`` (excess 3/16 at K = 2): SpecTr's
"naive independent acceptance" of each copy.
"""

from __future__ import annotations

import dataclasses

import torch

from spectr_audit.contract.correction import (
    JointResidualCorrection,
    has_carried_correction,
)
from spectr_audit.contract.randomness import uniform
from spectr_audit.contract.verifier import Verifier, VerifyOutput
from spectr_audit.errors import InvalidArgument
from spectr_audit.verifiers._walk import _sample_or_fallback, normalise

__all__ = ["MAX_EXACT_TESTS", "PublishedSpecTrGBV", "PublishedSpecTrGBVWithCorrection"]

#: The exact law enumerates the verifier's coin outcomes: at most K * L tests.
MAX_EXACT_TESTS = 12

#: Rows (batch rows times coin paths) processed at once by the exact law.
_LAW_CHUNK_ROWS = 1 << 18


@dataclasses.dataclass(frozen=True)
class _Quantities:
    """Everything the published rule reads from one draft tree."""

    # [batch_size, num_drafts, draft_len - 1]: h at lengths 1 .. L-1
    inner_pass: torch.Tensor
    # [batch_size, num_drafts]: the full-draft test
    final_pass: torch.Tensor
    # [batch_size, num_drafts, draft_len, vocab_size]: unnormalised residual after x_k[1..tau], tau < L
    # (None in the sampler, which builds only the row each scan ends at)
    residual: torch.Tensor | None
    # [batch_size, num_drafts, num_drafts, draft_len + 1]: x_j[1..i] == x_k[1..i]
    same_prefix: torch.Tensor


@dataclasses.dataclass(frozen=True)
class _ScanState:
    """The scan's variables on a set of rows (batch rows, or batch rows times coin paths)."""

    # [n]: batch row of each scan row
    row: torch.Tensor
    # [n]
    tau: torch.Tensor
    # [n]
    sel: torch.Tensor
    # [n]: a full draft was accepted (the scan stopped)
    done: torch.Tensor
    # [n, num_drafts, draft_len - 1]: x_j[1..i] was tested and rejected (the set H)
    rejected: torch.Tensor
    # [n]: probability of the coin path (exact law only)
    weight: torch.Tensor

    def take(self, index: torch.Tensor) -> _ScanState:
        return _ScanState(*(getattr(self, f.name)[index] for f in dataclasses.fields(self)))


def _min_ratio(draft_joint: torch.Tensor, target_joint: torch.Tensor) -> torch.Tensor:
    """min(1, p / q); where q = 0 the value is multiplied by q = 0 afterwards, so 1 is as good as any."""
    safe = torch.where(target_joint > 0, target_joint, torch.ones_like(target_joint))
    return torch.where(target_joint > 0, (draft_joint / safe).clamp(max=1.0), torch.ones_like(draft_joint))


def _one_minus_power(base_complement: torch.Tensor, num_drafts: int) -> torch.Tensor:
    """1 - (1 - x)^K for x = ``base_complement`` in [0, 1], without the cancellation of the literal
    formula when x is tiny (joint probabilities of long prefixes are)."""
    return -torch.expm1(num_drafts * torch.log1p(-base_complement))


def _covered(draft_joint: torch.Tensor, target_joint: torch.Tensor, num_drafts: int) -> torch.Tensor:
    """c(y) = q(y) [1 - (1 - min(1, p(y)/q(y)))^K]."""
    return target_joint * _one_minus_power(_min_ratio(draft_joint, target_joint), num_drafts)


def _divide(numerator: torch.Tensor, denominator: torch.Tensor) -> torch.Tensor:
    """numerator / denominator, 0 where the denominator is 0 (the limit of the code's + 1e-20 guard at 0/0)."""
    safe = torch.where(denominator != 0, denominator, torch.ones_like(denominator))
    return torch.where(denominator != 0, numerator / safe, torch.zeros_like(numerator))


def _joints(draft_tokens, draft_probs, target_probs) -> tuple[torch.Tensor, torch.Tensor]:
    """Joint prefix probabilities ``p(x_k[1..i]), q(x_k[1..i])``, i = 0..L, ``[B, K, L + 1]`` float64.

    The drafted entries are read first and widened after (the same values as widening every row first).
    """
    draft_len = draft_tokens.shape[-1]
    drafted = draft_probs.gather(-1, draft_tokens.unsqueeze(-1)).squeeze(-1).double()  # [B, K, L]
    targeted = target_probs[:, :, :draft_len].gather(-1, draft_tokens.unsqueeze(-1)).squeeze(-1).double()
    ones = torch.ones_like(drafted[..., :1])
    return torch.cat([ones, drafted], -1).cumprod(-1), torch.cat([ones, targeted], -1).cumprod(-1)


def _same_prefix(draft_tokens) -> torch.Tensor:
    """``[B, K, K, L + 1]``: x_j[1..i] == x_k[1..i] for i = 0..L (all of the first i positions agree)."""
    agree = draft_tokens.unsqueeze(2) == draft_tokens.unsqueeze(1)  # [B, K, K, L]
    mismatch_before = torch.cat([torch.zeros_like(agree[..., :1]), (~agree).cumsum(-1) > 0], -1)
    return ~mismatch_before


def _tests_from_cover(draft_joint, target_joint, child_cover, num_drafts):
    """The tests' pass probabilities: h at lengths 1 .. L-1 ``[B, K, L - 1]`` (from ``child_cover[..., 1:]``,
    ``sum_x c(yx)`` below x_k[1..i]) and the full-draft test ``[B, K]``."""
    draft_len = draft_joint.shape[-1] - 1
    cover = _covered(draft_joint, target_joint, num_drafts)  # [B, K, L + 1]
    none_drafted = _one_minus_power(draft_joint, num_drafts)  # 1 - (1 - p(y))^K
    inner = _divide(cover[..., 1:draft_len] - child_cover[..., 1:], none_drafted[..., 1:draft_len] - child_cover[..., 1:])
    final = _divide(cover[..., draft_len], none_drafted[..., draft_len])
    return inner, final


def _residual(child_draft: torch.Tensor, child_target: torch.Tensor, num_drafts: int) -> torch.Tensor:
    """The published residual ``q(yx) (1 - min(1, p(yx)/q(yx))^K)``, unnormalised."""
    # 1 - m^K = -expm1(K log m): accurate when m is near 1
    residual = child_target * -torch.expm1(num_drafts * torch.log(_min_ratio(child_draft, child_target)))
    return torch.where(child_target > 0, residual, torch.zeros_like(residual))


def _quantities(draft_tokens, draft_probs, target_probs) -> _Quantities:
    """Everything the exact law reads, the residual at every node below the root included."""
    _, num_drafts, draft_len = draft_tokens.shape
    draft = draft_probs.double()
    target = target_probs.double()
    draft_joint, target_joint = _joints(draft_tokens, draft_probs, target_probs)
    # Children of every non-leaf node x_k[1..i], i = 0..L-1: joint p(yx), q(yx).
    child_draft = draft_joint[..., :draft_len, None] * draft  # [B, K, L, V]
    child_target = target_joint[..., :draft_len, None] * target[:, :, :draft_len]
    child_cover = _covered(child_draft, child_target, num_drafts).sum(-1)  # [B, K, L]
    inner, final = _tests_from_cover(draft_joint, target_joint, child_cover, num_drafts)
    residual = _residual(child_draft, child_target, num_drafts)
    return _Quantities(inner, final, residual, _same_prefix(draft_tokens))


#: The sampler's children's cover is computed this many probabilities at a time (a few rows of the vocabulary),
#: so that its elementwise steps run on buffers that stay in the CPU's cache instead of one memory pass each.
_COVER_CHUNK = 1 << 17

#: The smallest positive float64 (a subnormal): a clamp to it replaces zeros and nothing else.
_SMALLEST = 5e-324


def _row_view(probs: torch.Tensor):
    """``probs [B, K, N, V]`` as rows ``[R, V]`` with row ``(b, k, l)`` at ``b * stride_b + k * stride_k + l``:
    ``(rows, stride_b, stride_k)``, or None where the strides allow no such view."""
    stride_b, stride_k, stride_l, stride_v = probs.stride()
    if stride_v != 1 or stride_l <= 0 or stride_b % stride_l or stride_k % stride_l:
        return None
    batch_size, num_drafts, num_levels, vocab_size = probs.shape
    count = ((batch_size - 1) * stride_b + (num_drafts - 1) * stride_k) // stride_l + num_levels
    return probs.as_strided((count, vocab_size), (stride_l, 1)), stride_b // stride_l, stride_k // stride_l


def _gather_rows(probs: torch.Tensor, batch_rows, drafts, levels) -> torch.Tensor:  # [n, V]
    """``probs[batch_rows, drafts, levels]`` (``[n]`` each): by ``index_select`` on a flat view where the strides
    allow one (a contiguous copy of the rows, several times faster on the CPU than advanced indexing)."""
    view = _row_view(probs)
    if view is None:
        return probs[batch_rows, drafts, levels]
    rows, stride_b, stride_k = view
    return rows.index_select(0, batch_rows * stride_b + drafts * stride_k + levels)


def _chunk_rows(count: int, vocab_size: int, device: torch.device) -> int:
    """Rows per chunk of the sampler's float64 passes: on the CPU a few vocabularies, so that every step of a chunk
    runs while its rows are in cache; elsewhere every row at once (a loop of small kernels would only add launches).
    Each row's numbers depend on that row alone, whatever the chunk."""
    if device.type != "cpu":
        return max(1, count)
    return max(1, min(count, _COVER_CHUNK // vocab_size))


def _cover_sums(draft_rows, target_rows, joint_p, joint_q, num_drafts: int, index=None) -> torch.Tensor:
    """``sum_x c(yx)`` below the rows ``[R, V]`` (p and q after y) with joint prefix probabilities ``[R]``,
    for the rows ``index`` ``[n]`` (all R when None): ``[n]`` float64.

    The sampler's form of :func:`_covered`: ``c = min(p(yx), q(yx)) S(m)`` with ``m = min(1, p(yx)/q(yx))`` and
    ``S(m) = sum_{j < K} (1 - m)^j = (1 - (1 - m)^K) / m`` by Horner's rule: a sum of non-negative terms, so it
    keeps the relative accuracy of the ``expm1``/``log1p`` form (a few ulps) with no transcendental function.
    Rows of a few vocabularies at a time go through every step while they are in cache; each row is read once.
    Each row's sum depends on that row alone (not on which rows share its chunk).
    """
    count = target_rows.shape[0] if index is None else index.shape[0]
    vocab_size = target_rows.shape[-1]
    device = target_rows.device
    sums = torch.empty(count, dtype=torch.float64, device=device)
    if count == 0:
        return sums
    step = _chunk_rows(count, vocab_size, device)
    buffers = torch.empty(3, step, vocab_size, dtype=torch.float64, device=device)
    if index is not None:
        picked_p = torch.empty(step, vocab_size, dtype=draft_rows.dtype, device=device)
        picked_q = torch.empty(step, vocab_size, dtype=target_rows.dtype, device=device)
        joint_p, joint_q = joint_p[index], joint_q[index]
    joint_p, joint_q = joint_p.unsqueeze(-1), joint_q.unsqueeze(-1)
    # the K = 2 series 1 + (1 - m) = 2 - m in one step; 1 - m for the longer series
    first = torch.full((), 2.0 if num_drafts == 2 else 1.0, dtype=torch.float64, device=device)
    one = torch.ones((), dtype=torch.float64, device=device)
    for start in range(0, count, step):
        stop = min(start + step, count)
        child_p, child_q, series = buffers[:, : stop - start]
        if index is None:
            rows_p, rows_q = draft_rows[start:stop], target_rows[start:stop]
        else:
            rows_p = torch.index_select(draft_rows, 0, index[start:stop], out=picked_p[: stop - start])
            rows_q = torch.index_select(target_rows, 0, index[start:stop], out=picked_q[: stop - start])
        child_p.copy_(rows_p).mul_(joint_p[start:stop])  # float64 p(yx)
        child_q.copy_(rows_q).mul_(joint_q[start:stop])
        low = torch.minimum(child_p, child_q, out=child_p)  # min(p, q) = q min(1, p/q)
        if num_drafts > 1:
            # m = min(p, q) / q (0 where q = 0, where min(p, q) = 0 as well)
            child_q.clamp_(min=_SMALLEST)
            if num_drafts == 2:
                low.mul_(torch.addcdiv(first, low, child_q, value=-1, out=series))  # 2 - m
            else:
                rest = torch.addcdiv(first, low, child_q, value=-1, out=child_q)  # 1 - m
                torch.add(rest, 1, out=series)
                for _ in range(num_drafts - 2):
                    torch.addcmul(one, series, rest, out=series)
                low.mul_(series)
        torch.sum(low, -1, out=sums[start:stop])
    return sums


def _child_cover_sampler(draft_probs, target_probs, draft_joint, target_joint, num_drafts: int) -> torch.Tensor:
    """``sum_x c(yx)`` below x_k[1..i] for i = 1 .. L-1 (index 0, which no test reads, left 0), ``[B, K, L]``:
    :func:`_cover_sums` on every draft's rows at levels 1 .. L-1."""
    draft_len = draft_joint.shape[-1] - 1
    out = torch.zeros(draft_joint.shape[:-1] + (draft_len,), dtype=torch.float64, device=draft_probs.device)
    for draft in range(draft_joint.shape[1]):
        for level in range(1, draft_len):
            out[:, draft, level] = _cover_sums(draft_probs[:, draft, level], target_probs[:, draft, level],
                                               draft_joint[:, draft, level], target_joint[:, draft, level], num_drafts)
    return out


def _residual_sampler(draft_rows, target_rows, joint_p, joint_q, num_drafts: int) -> torch.Tensor:
    """The sampler's form of :func:`_residual` on rows ``[n, V]`` below joint prefix probabilities ``[n]``.

    ``q (1 - m^K) = (q - p)_+ sum_{j < K} m^j`` with ``m = min(1, p/q)`` (Horner's rule): the same values
    to a few ulps, a sum of non-negative terms, no transcendental function.
    """
    out = torch.empty(target_rows.shape, dtype=torch.float64, device=target_rows.device)
    return _residual_into(out, draft_rows, target_rows, joint_p, joint_q, num_drafts)


def _residual_into(out, draft_rows, target_rows, joint_p, joint_q, num_drafts: int) -> torch.Tensor:
    """:func:`_residual_sampler` written into ``out`` ``[n, V]`` float64, a few rows at a time (in cache)."""
    count, vocab_size = out.shape
    if count == 0:
        return out
    step = _chunk_rows(count, vocab_size, out.device)
    buffers = torch.empty(2, step, vocab_size, dtype=torch.float64, device=out.device)
    one = torch.ones((), dtype=torch.float64, device=out.device)
    joint_p, joint_q = joint_p.unsqueeze(-1), joint_q.unsqueeze(-1)
    for start in range(0, count, step):
        stop = min(start + step, count)
        child_p, child_q = buffers[:, : stop - start]
        excess = out[start:stop]
        child_p.copy_(draft_rows[start:stop]).mul_(joint_p[start:stop])
        child_q.copy_(target_rows[start:stop]).mul_(joint_q[start:stop])
        torch.sub(child_q, child_p, out=excess).clamp_(min=0)  # (q - p)_+ = q (1 - m)
        if num_drafts == 2:
            # 1 + m, m = min(p, q) / q in [0, 1] (0 where q = 0, where the excess is 0 as well), in one step
            # (the quotient rounded, then the sum: the same value as a division and an addition)
            low = torch.minimum(child_p, child_q, out=child_p)
            excess.mul_(torch.addcdiv(one, low, child_q.clamp_(min=_SMALLEST), out=child_q))
        elif num_drafts > 2:
            ratio = torch.minimum(child_p, child_q, out=child_p).div_(child_q.clamp_(min=_SMALLEST))
            series = torch.add(ratio, 1, out=child_q)
            for _ in range(num_drafts - 2):
                series.mul_(ratio).add_(1)
            excess.mul_(series)
    return out


def _sampler_tests(draft_tokens, draft_probs, target_probs):
    """The sampler's view of :func:`_quantities`: the tests and the joints, no residual (it is built only for
    the node each row's scan ends at)."""
    num_drafts = draft_tokens.shape[1]
    draft_joint, target_joint = _joints(draft_tokens, draft_probs, target_probs)
    child_cover = _child_cover_sampler(draft_probs, target_probs, draft_joint, target_joint, num_drafts)
    inner, final = _tests_from_cover(draft_joint, target_joint, child_cover, num_drafts)
    return _Quantities(inner, final, None, _same_prefix(draft_tokens)), draft_joint, target_joint


def _inner_active(state: _ScanState, quantities: _Quantities, draft: int, length: int) -> torch.Tensor:
    """Whether draft ``draft`` is tested at ``length``: not stopped, beyond tau, and not in H."""
    if draft > 0:
        # x_draft[1..length] is in H iff an earlier draft with the same prefix was rejected there.
        same = quantities.same_prefix[state.row, draft, :draft, length]  # [n, draft]
        in_rejected = (state.rejected[:, :draft, length - 1] & same).any(-1)
    else:
        in_rejected = torch.zeros_like(state.done)
    return ~state.done & (length > state.tau) & ~in_rejected


def _after_test(state: _ScanState, draft: int, length: int, final: bool, active, passed) -> _ScanState:
    """The scan's variables after one test (``length`` = L for the full-draft test)."""
    rejected = state.rejected
    if not final:
        rejected = rejected.clone()
        rejected[:, draft, length - 1] = active & ~passed
    return dataclasses.replace(
        state,
        tau=torch.where(passed, length, state.tau),
        sel=torch.where(passed, draft, state.sel),
        done=state.done | (passed & final),
        rejected=rejected,
    )


def _tests(num_drafts: int, draft_len: int):
    """The published scan's tests in order: (draft, length, is_final)."""
    for draft in range(num_drafts):
        for length in range(1, draft_len):
            yield draft, length, False
        yield draft, draft_len, True


def _initial_state(rows: torch.Tensor, num_drafts: int, draft_len: int) -> _ScanState:
    n = rows.shape[0]
    zeros = torch.zeros(n, dtype=torch.int64, device=rows.device)
    return _ScanState(
        row=rows,
        tau=zeros,
        sel=zeros.clone(),
        done=torch.zeros(n, dtype=torch.bool, device=rows.device),
        rejected=torch.zeros(n, num_drafts, max(draft_len - 1, 0), dtype=torch.bool, device=rows.device),
        weight=torch.ones(n, dtype=torch.float64, device=rows.device),
    )


def _scan(draft_probs, target_probs, draft_joint, target_joint, same_prefix, u, *, lazy: bool) -> _ScanState:
    """The published scan of every batch row with its uniforms ``u`` ``[B, K L + 1]`` (one per test, in order).

    With ``lazy``, draft k's children's covers are computed just before its tests, for the rows that
    test it at each length and for no other: whether draft k is tested at length i is fixed when its
    tests begin (a test of draft k moves tau only to a length below the next one, and H changes only
    by draft k's own lengths), so :func:`_inner_active` on the state then says which.  The values read
    are the same either way (each row's cover depends on that row alone).
    """
    batch_size, num_drafts, draft_len = draft_joint.shape
    draft_len -= 1
    state = _initial_state(torch.arange(batch_size, device=u.device), num_drafts, draft_len)
    if lazy:
        child_cover = torch.zeros(batch_size, num_drafts, draft_len, dtype=torch.float64, device=u.device)
    else:
        child_cover = _child_cover_sampler(draft_probs, target_probs, draft_joint, target_joint, num_drafts)
    quantities = _Quantities(*_tests_from_cover(draft_joint, target_joint, child_cover, num_drafts), None, same_prefix)
    for index, (draft, length, final) in enumerate(_tests(num_drafts, draft_len)):
        if lazy and length == 1 and draft_len > 1:
            for level in range(1, draft_len):
                tested = _inner_active(state, quantities, draft, level)
                rows = None if bool(tested.all()) else tested.nonzero().squeeze(-1)
                sums = _cover_sums(draft_probs[:, draft, level], target_probs[:, draft, level],
                                   draft_joint[:, draft, level], target_joint[:, draft, level], num_drafts, rows)
                child_cover[:, draft, level] = sums if rows is None else child_cover[:, draft, level].index_put((rows,), sums)
            inner, final_pass = _tests_from_cover(draft_joint, target_joint, child_cover, num_drafts)
            quantities = _Quantities(inner, final_pass, None, same_prefix)
        active = ~state.done if final else _inner_active(state, quantities, draft, length)
        passed = active & (u[:, index] < _pass_prob(quantities, state, draft, length, final))
        state = _after_test(state, draft, length, final, active, passed)
    return state


def _pass_prob(quantities: _Quantities, state: _ScanState, draft: int, length: int, final: bool) -> torch.Tensor:
    if final:
        return quantities.final_pass[state.row, draft]
    return quantities.inner_pass[state.row, draft, length - 1]


def _canonical_index(quantities: _Quantities, rows, tau, sel) -> torch.Tensor:
    """Smallest draft index sharing x_sel[1..tau] (the contract's convention)."""
    return quantities.same_prefix[rows, sel, :, tau].to(torch.int8).argmax(-1)


def _next_token_law(residual: torch.Tensor, target_probs, rows, tau, sel) -> torch.Tensor:  # [n, V]
    """The next token's law after the scan: the normalised residual row ``residual`` ``[n, V]`` after
    ``x_sel[1..tau]`` where ``tau < L``, else the target's row there (rows read first, then widened)."""
    draft_len = target_probs.shape[2] - 1
    level = tau.clamp(max=draft_len - 1)
    correction = normalise(residual, target_probs[rows, sel, level].double())
    return torch.where((tau < draft_len).unsqueeze(-1), correction, target_probs[rows, sel, tau].double())


class PublishedSpecTrGBV(Verifier):
    """SpecTr-GBV as published (public code, Algorithm 1): K i.i.d. drafts, any L.

    See the module docstring for the rule, transcribed from the public implementation.
    No carried correction.  Randomness: one call to
    :func:`spectr_audit.contract.randomness.uniform` of shape ``[batch_size, K * L + 1]``: one
    uniform per test in scan order (draft 1 lengths 1..L, draft 2, ...), then the
    correction/bonus token's uniform.  The exact law enumerates the coin outcomes of
    the tests actually performed (at most ``2^(K L)`` paths; K * L <= 12).

    Audit findings (paper example p = (2/3, 1/3), q = (1/3, 2/3), L = 2): inexact in one
    iteration at every K; at K = 1 (greedy block verification) the prefix cap holds, so a
    repair of later iterations exists, and for K >= 2 it is exceeded, so none does (see the
    module docstring and docs/rules/spectr-gbv.md).
    """

    name = "spectr-gbv-published"
    description = "SpecTr-GBV, the published rule (public code): multi-draft greedy block verification"
    expected = "inexact"
    # A block rule.  At L = 1 only the full-draft tests remain: each copy is accepted on its own
    # (the module docstring's "naive independent acceptance"), inexact for K >= 2, exact at K = 1.
    min_draft_len = 2

    def _verify(self, draft_tokens, draft_probs, target_probs, generator) -> VerifyOutput:
        batch_size, num_drafts, draft_len = draft_tokens.shape
        device = draft_tokens.device
        draft_joint, target_joint = _joints(draft_tokens, draft_probs, target_probs)
        u = uniform(generator, (batch_size, num_drafts * draft_len + 1), device)
        same_prefix = _same_prefix(draft_tokens)
        # On the CPU the children's covers are computed only where a test reads them (a host read of which rows
        # that is costs nothing there); an accelerator computes them all, with no host sync.
        state = _scan(draft_probs, target_probs, draft_joint, target_joint, same_prefix, u, lazy=device.type == "cpu")
        # the residual of the one node each row ends at, drawn unnormalised (the target where it has no mass)
        rows, sel, tau = state.row, state.sel, state.tau
        full = tau == draft_len
        level = tau.clamp(max=draft_len - 1)
        # A row that accepted a full draft draws from the target after it: its residual with p = 0 and
        # joints (0, 1) is that row exactly ((q - 0)_+ (1 + 0) = q), so one formula serves every row.
        zero = torch.zeros((), dtype=torch.float64, device=device)
        mass = _residual_into(
            torch.empty(batch_size, draft_probs.shape[-1], dtype=torch.float64, device=device),
            _gather_rows(draft_probs, rows, sel, level), _gather_rows(target_probs, rows, sel, tau),
            torch.where(full, zero, draft_joint[rows, sel, level]), torch.where(full, zero + 1, target_joint[rows, sel, level]),
            num_drafts)
        next_token = _sample_or_fallback(mass, lambda: target_probs[rows, sel, tau].double(), u[:, -1])
        draft_index = _canonical_index(_Quantities(None, None, None, same_prefix), state.row, state.tau, state.sel)
        correction = None
        if has_carried_correction(self):
            correction = self.carried_correction(draft_tokens, draft_probs, target_probs, state.tau, draft_index, next_token)
        return VerifyOutput(state.tau, draft_index, next_token, correction=correction)

    def _output_probs(self, draft_tokens, draft_probs, target_probs) -> torch.Tensor:
        batch_size, num_drafts, draft_len = draft_tokens.shape
        if num_drafts * draft_len > MAX_EXACT_TESTS:
            raise InvalidArgument(
                f"draft_tokens: the exact law of {self.name!r} enumerates up to 2^(K L) coin paths; "
                f"K * L = {num_drafts * draft_len} exceeds {MAX_EXACT_TESTS}"
            )
        quantities = _quantities(draft_tokens, draft_probs, target_probs)
        vocab_size = draft_probs.shape[-1]
        out = torch.zeros(batch_size, num_drafts, draft_len + 1, vocab_size, dtype=torch.float64, device=draft_tokens.device)
        chunk = max(1, _LAW_CHUNK_ROWS >> (num_drafts * draft_len))
        for start in range(0, batch_size, chunk):
            rows = torch.arange(start, min(start + chunk, batch_size), device=draft_tokens.device)
            state = _initial_state(rows, num_drafts, draft_len)
            for draft, length, final in _tests(num_drafts, draft_len):
                state = self._branch(state, quantities, draft, length, final)
            level = state.tau.clamp(max=draft_len - 1)
            law = _next_token_law(quantities.residual[state.row, state.sel, level], target_probs, state.row,
                                  state.tau, state.sel)
            index = _canonical_index(quantities, state.row, state.tau, state.sel)
            out.index_put_((state.row, index, state.tau), state.weight.unsqueeze(-1) * law, accumulate=True)
        return out

    @staticmethod
    def _branch(state: _ScanState, quantities: _Quantities, draft: int, length: int, final: bool) -> _ScanState:
        """Split every path on one test: a pass copy (weight h) and a fail-or-skip copy (1 - h, or 1 if skipped)."""
        active = ~state.done if final else _inner_active(state, quantities, draft, length)
        # A test passes when U < h with U uniform in [0, 1): probability h clamped to [0, 1].
        pass_prob = _pass_prob(quantities, state, draft, length, final).clamp(0.0, 1.0)
        fail = _after_test(state, draft, length, final, active, torch.zeros_like(active))
        fail = dataclasses.replace(fail, weight=state.weight * torch.where(active, 1 - pass_prob, torch.ones_like(pass_prob)))
        passing = state.take(active & (pass_prob > 0))
        passing_prob = pass_prob[active & (pass_prob > 0)]
        all_true = torch.ones_like(passing.done)
        passing = _after_test(passing, draft, length, final, all_true, all_true)
        passing = dataclasses.replace(passing, weight=passing.weight * passing_prob)
        fail = fail.take(fail.weight > 0)
        return _ScanState(*(torch.cat([getattr(fail, f.name), getattr(passing, f.name)]) for f in dataclasses.fields(state)))


class PublishedSpecTrGBVWithCorrection(PublishedSpecTrGBV):
    """The published rule plus a carried correction standing in for Algorithm 2.

    The sources say only that Algorithm 2 modifies the target distribution at the
    unaccepted positions before the next iteration; the public code does not
    implement it and its formula is not available to this project.  ASSUMPTION: the modification continues the
    published residual below the emitted string: at every node ``u`` that extends the
    emitted string and lies fewer than L tokens below the iteration start, the next
    target is ``q(ux) (1 - min(1, p(ux)/q(ux))^K)`` normalised (joint probabilities
    from the iteration start; the target is left unchanged where that has no mass).
    For K = 1 this is exactly the repair that makes greedy block verification exact
    (``greedy-block-repaired``), which is the one case where the sources pin it down, so
    this variant starts at K = 2.

    ``expected = "inexact"``, as measured by the multi-iteration audit on the paper example
    (L = 2): loop TV 0.0505 (N = 3) and 0.0527 (N = 4) at K = 2, 0.0544 and 0.0555 at K = 3,
    against 0.0586 / 0.0608 and 0.0552 / 0.0556 without the correction; the verdicts'
    prefix cap is exceeded (by 0.0238 at K = 2, up to 0.0192 at K = 3 in later iterations),
    so no correction could have repaired it.
    """

    name = "spectr-gbv-published-alg2"
    description = "published SpecTr-GBV + assumed Algorithm 2 (published residual carried below the emitted string)"
    expected = "inexact"
    # K = 1 is greedy-block-repaired exactly (same verdicts, same correction).
    min_drafts = 2

    def carried_correction(self, draft_tokens, draft_probs, target_probs, num_accepted, draft_index, next_token):
        """The assumed Algorithm 2 correction after these verdicts (None if no row has one).

        The correction reads only the probabilities of the emitted string: at each level of the
        selected draft, its token's and the next token's.  It is handed a two-token tree that holds
        just those (token 0: the draft's, token 1: the next token; one draft), so it widens and
        gathers ``[B, L + 1, 2]`` values instead of the selected draft's whole rows: the same numbers.
        """
        batch_size, _, draft_len = draft_tokens.shape
        rows = torch.arange(batch_size, device=draft_tokens.device).unsqueeze(-1)
        drafts = draft_index.unsqueeze(-1)
        levels = torch.arange(draft_len + 1, device=draft_tokens.device)
        path = draft_tokens[rows, drafts, levels[:draft_len]]  # [B, L]
        following = next_token.unsqueeze(-1)
        draft_pair = torch.stack([draft_probs[rows, drafts, levels[:draft_len], path],
                                  draft_probs[rows, drafts, levels[:draft_len], following]], -1)  # [B, L, 2]
        # the target's level L: no drafted token there (token 0 is never read at it)
        target_pair = torch.stack([target_probs[rows, drafts, levels, torch.cat([path, following], -1)],
                                   target_probs[rows, drafts, levels, following]], -1)  # [B, L + 1, 2]
        return JointResidualCorrection.after_emission(
            torch.zeros_like(path).unsqueeze(1), draft_pair.unsqueeze(1), target_pair.unsqueeze(1),
            num_accepted, torch.zeros_like(draft_index), torch.ones_like(next_token),
            horizon=draft_len, exponent=draft_tokens.shape[1],
        )
