"""Block verification (Sun et al., ICLR 2025; docs/rules/block.md).

Block verification and greedy block verification (docs/rules/greedy-block.md) share one shape.
Along the single draft ``x_1..x_L`` each prefix ``x^i`` carries a weight
``w_i`` (``w_0 = 1``), and with

    r_i = sum_x (w_i q(x | x^i) - p(x | x^i))_+        (mass the target wants more of)
    s_i = sum_x (p(x | x^i) - w_i q(x | x^i))_+        (mass the draft has too much of)

level ``i < L`` passes with ``h_i = min(r_i, s_i) / s_i`` (1 when ``s_i = 0``),
level ``L`` with ``h_L = min(1, w_L)``; ``tau`` is the LAST passing level (a
backward scan, 0 if none).  The step emits ``x^tau`` plus a bonus from
``q(. | x^L)`` if ``tau = L``, else a correction from ``(w_tau q(. | x^tau) -
p(. | x^tau))_+`` normalised.  Then ``P(tau >= i | x^i) = min(1, w_i)``.

* Block verification clamps the weights, ``w_i = min(1, w_{i-1} q(x_i|x^{i-1}) /
  p(x_i|x^{i-1}))``, so ``s_i = r_i + 1 - w_i`` and ``h_i = r_i / (r_i + 1 - w_i)``,
  the paper's rule.
* Greedy block verification uses the raw joint ratio ``w_i = q(x^i) / p(x^i)``;
  its ``h_i = (A - D_+) / (A - D)`` is the same expression divided by
  ``p(x^i)``.  Computing ``s_i`` directly (not as ``r_i + 1 - w_i``) avoids a
  cancellation when ``w_i > 1``.
"""

from __future__ import annotations

import torch

from spectr_audit.contract.verifier import Verifier, VerifyOutput
from spectr_audit.contract.correction import has_carried_correction
from spectr_audit.contract.randomness import sample_categorical, uniform
from spectr_audit.verifiers import triton_kernels
from spectr_audit.verifiers._walk import _rows_of, _sample_or_fallback, _sampler_dtype, normalise

__all__ = ["BlockVerification", "LastPassingVerifier"]


def _pass_probs(
    wanted: torch.Tensor,  # [B, L] r_0 .. r_{L-1}
    surplus: torch.Tensor,  # [B, L] s_0 .. s_{L-1}
    weights: torch.Tensor,  # [B, L + 1] w_0 .. w_L
) -> torch.Tensor:  # [B, L] h_1 .. h_L
    """``h_i = min(r_i, s_i) / s_i`` (1 where ``s_i = 0``) for levels 1 .. L-1, and ``h_L = min(1, w_L)``."""
    wanted, surplus = wanted[:, 1:], surplus[:, 1:]
    inner = torch.where(
        surplus > 0,
        torch.minimum(wanted, surplus) / torch.where(surplus > 0, surplus, torch.ones_like(surplus)),
        torch.ones_like(surplus),
    )
    return torch.cat([inner, weights[:, -1:].clamp(max=1.0)], dim=1)


class LastPassingVerifier(Verifier):
    """Single-draft verifiers that emit up to the last passing level (see the module docstring).

    Subclasses implement ``_weights``.  Randomness: one call to
    :func:`spectr_audit.contract.randomness.uniform` of shape ``[batch_size, draft_len + 1]``:
    ``draft_len`` level uniforms, then the correction/bonus token's uniform.
    """

    min_drafts = 1
    max_drafts = 1

    def _weights(
        self,
        log_token_ratio: torch.Tensor,  # [batch_size, draft_len], log q(x_i | x^{i-1}) - log p(x_i | x^{i-1})
    ) -> torch.Tensor:  # [batch_size, draft_len + 1], w_0 = 1 .. w_L, in [0, inf]
        raise NotImplementedError

    def _path_weights(self, draft_tokens, draft, target):
        """``w_0 .. w_L`` ``[B, L + 1]`` float64 along the draft, from rows ``draft [B, L, V]``, ``target [B, L + 1, V]``."""
        draft_len = draft_tokens.shape[-1]
        path = draft_tokens[:, 0].unsqueeze(-1)  # [batch_size, draft_len, 1]
        # In logs, so that a near-zero draft probability cannot overflow a product into inf * 0.
        # The contract guarantees p(x_i | x^{i-1}) > 0 for drafted tokens; log q may be -inf.
        log_token_ratio = (
            target[:, :draft_len].gather(-1, path).double().log() - draft.gather(-1, path).double().log()
        ).squeeze(-1)
        return self._weights(log_token_ratio)

    def _levels(self, draft_tokens, draft_probs, target_probs):
        """Pass probabilities ``[B, L]`` (levels 1..L) and unnormalised residuals ``[B, L, V]`` (levels 0..L-1)."""
        draft_len = draft_tokens.shape[-1]
        draft = draft_probs[:, 0].double()  # [batch_size, draft_len, vocab_size]
        target = target_probs[:, 0].double()  # [batch_size, draft_len + 1, vocab_size]
        weights = self._path_weights(draft_tokens, draft, target)
        # (w q - p)_+ and (p - w q)_+ divided by max(w, 1): h and the normalised residual are unchanged, and a
        # weight of inf (greedy block verification after a near-impossible draft) stays finite.
        level_weight = weights[:, :draft_len].unsqueeze(-1)
        diff = level_weight.clamp(max=1.0) * target[:, :draft_len] - draft / level_weight.clamp(min=1.0)
        residual = diff.clamp(min=0)
        wanted = residual.sum(-1)  # r_i (scaled)
        surplus = (-diff).clamp(min=0).sum(-1)  # s_i (scaled)
        return _pass_probs(wanted, surplus, weights), residual

    def _next_token_law(self, residual, target, tau):
        """Law of the token emitted after ``x^tau``: ``[B, V]``."""
        draft_len = residual.shape[1]
        rows = torch.arange(residual.shape[0], device=residual.device)
        level = tau.clamp(max=draft_len - 1)
        correction = normalise(residual[rows, level], target[rows, level])
        return torch.where((tau < draft_len).unsqueeze(-1), correction, target[rows, tau])

    def _sampler_levels(self, draft_tokens, draft_probs, target_probs):
        """:meth:`_levels` for the sampler: the rows' own dtype (float32 stays float32), fewer passes.

        Returns pass probabilities ``[B, L]`` (float64) and unnormalised residuals ``[B, L, V]`` in the
        rows' dtype: :meth:`_signed_sampler_levels` at every level, with the residuals' sign made positive.
        """
        pass_probs, residual, negated, _ = self._signed_sampler_levels(draft_tokens, draft_probs, target_probs)
        return pass_probs, residual.neg_() if negated else residual

    def _signed_sampler_levels(self, draft_tokens, draft_probs, target_probs, first_level=0):
        """:meth:`_sampler_levels` from level ``first_level`` (0 or 1) on, with residuals that may come negated.

        Returns ``(pass_probs, residual, negated, rows)``: pass probabilities ``[B, L]``; the residuals
        ``[B, L - first_level, V]`` of levels ``first_level .. L-1``, negated where ``negated`` is True;
        ``rows = (draft, target, a, b)``, the rows in the sampler's dtype and the per-level factors
        ``[B, L, 1]`` that make level ``i``'s residual ``(a p + b q)_+`` (``a = -1 / max(w_i, 1)``,
        ``b = min(w_i, 1)``, in the rows' dtype, in that order of operations).

        ``s_i`` comes from the identity ``s_i = r_i - sum_x (w_i q - p)`` (one sum over the signed
        difference) instead of a second clamped pass; the residual is clamped in place.  Level 0's sums
        are never read (``h_0 = 1``), so ``first_level = 1`` leaves that level out: its residual is then
        needed only on the rows that stop there, built from ``rows`` by whoever draws them.  Where every
        weight is at most 1 (always for block verification, whose weights are clamped), ``a = -1`` and
        the difference is ``-(p - w q)``: one fused ``addcmul`` writes ``p - w q``, whose rounding is
        that of the two-op form negated, bit for bit (negation is exact, and ``addcmul``'s fused
        multiply-add rounds ``-x`` to minus what it rounds ``x`` to).  The residual then stays negated,
        which saves the pass that would flip it: the sampler reads one row per batch row of it.
        """
        draft_len = draft_tokens.shape[-1]
        draft = _sampler_dtype(draft_probs[:, 0])  # [batch_size, draft_len, vocab_size]
        target = _sampler_dtype(target_probs[:, 0])  # [batch_size, draft_len + 1, vocab_size]
        weights = self._path_weights(draft_tokens, draft, target)
        level_weight = weights[:, :draft_len].unsqueeze(-1)
        # (w q - p) / max(w, 1), as in _levels: a p + b q
        a = (-1 / level_weight.clamp(min=1.0)).to(draft.dtype)
        b = level_weight.clamp(max=1.0).to(draft.dtype)
        levels = slice(first_level, draft_len)
        # checked on the CPU only, where reading a flag costs no device round trip; elsewhere the general form
        negated = draft.device.type == "cpu" and bool((level_weight[:, levels] <= 1.0).all())
        if negated:
            # p - w q, one allocation and one fused pass; the sums of its negation are its sums negated
            diff = torch.addcmul(draft[:, levels], target[:, levels], b[:, levels], value=-1)
            net = diff.sum(-1).double().neg_()  # r_i - s_i
            residual = diff.clamp_(max=0)  # -(w q - p)_+
            wanted = residual.sum(-1).double().neg_()  # r_i
        else:
            # one allocation and one fused in-place pass
            diff = torch.mul(draft[:, levels], a[:, levels])
            diff.addcmul_(target[:, levels], b[:, levels])
            net = diff.sum(-1).double()  # r_i - s_i
            residual = diff.clamp_(min=0)
            wanted = residual.sum(-1).double()  # r_i
        if first_level:  # level 0's sums, never read
            wanted, net = (torch.cat([torch.zeros_like(weights[:, :first_level]), x], dim=1) for x in (wanted, net))
        surplus = (wanted - net).clamp(min=0)  # s_i
        return _pass_probs(wanted, surplus, weights), residual, negated, (draft, target, a, b)

    def _triton_levels(self, draft_tokens, draft_probs, target_probs):
        """:meth:`_sampler_levels` with the Triton kernels (spectr_audit.verifiers.triton_kernels): one read.

        The residuals are a :class:`~spectr_audit.verifiers.triton_kernels.LazyResidual` over the levels
        (never written out); ``r_i`` and ``r_i - s_i`` come from its block sums, accumulated in float64.
        """
        draft_len = draft_tokens.shape[-1]
        draft = draft_probs[:, 0]  # [batch_size, draft_len, vocab_size]
        target = target_probs[:, 0]  # [batch_size, draft_len + 1, vocab_size]
        weights = self._path_weights(draft_tokens, draft, target)
        level_weight = weights[:, :draft_len]
        # (w q - p) / max(w, 1) as in _sampler_levels, with the per-level scalars in the rows' dtype
        residual = triton_kernels.difference_residual(
            target[:, :draft_len], draft, level_weight.clamp(max=1.0), -1 / level_weight.clamp(min=1.0),
            with_signed=True,
        )
        wanted = residual.totals()  # r_i
        surplus = (wanted - residual.signed_totals()).clamp(min=0)  # s_i
        return _pass_probs(wanted, surplus, weights), residual

    def _verify(self, draft_tokens, draft_probs, target_probs, generator) -> VerifyOutput:
        batch_size, _, draft_len = draft_tokens.shape
        device = draft_tokens.device
        # Subclasses that redefine _levels (e.g. the historic-bug library) keep it on the sampler path too.
        fast = type(self)._levels is LastPassingVerifier._levels
        lazy = fast and triton_kernels.fused_rows(draft_probs)
        by_rows = device.type == "cpu" and not lazy
        negated, first_level, rows_at = False, 0, None
        if lazy:
            pass_probs, residual = self._triton_levels(draft_tokens, draft_probs, target_probs)
        elif fast:
            # on the CPU, level 0's residual is built on the rows that stop there only (_next_tokens_by_rows)
            first_level = 1 if by_rows else 0
            pass_probs, residual, negated, rows_at = self._signed_sampler_levels(
                draft_tokens, draft_probs, target_probs, first_level
            )
        else:
            pass_probs, residual = self._levels(draft_tokens, draft_probs, target_probs)
        u = uniform(generator, (batch_size, draft_len + 1), device)
        passed = u[:, :draft_len] < pass_probs
        level_ids = torch.arange(1, draft_len + 1, device=device)
        tau = (passed * level_ids).amax(-1)  # the last passing level, 0 if none
        target = target_probs[:, 0]
        if by_rows:
            next_token = self._next_tokens_by_rows(residual, negated, first_level, rows_at, target, tau, u[:, draft_len])
        else:
            # Draw the correction from the residual row at tau (rows with no residual mass: the target there),
            # and the bonus from the target at the end of the draft; keep the one that applies.
            rows = torch.arange(batch_size, device=device)
            level = tau.clamp(max=draft_len - 1)
            if lazy:
                at_tau = residual.take(rows, level)
            else:
                at_tau = residual[rows, level]
                at_tau = at_tau.neg_() if negated else at_tau
            correction = _sample_or_fallback(at_tau, lambda: _sampler_dtype(target[rows, level]), u[:, draft_len])
            bonus = sample_categorical(_sampler_dtype(target[:, draft_len]), u[:, draft_len])
            next_token = torch.where(tau < draft_len, correction, bonus)
        draft_index = torch.zeros_like(tau)
        correction = None
        if has_carried_correction(self):
            correction = self.carried_correction(draft_tokens, draft_probs, target_probs, tau, draft_index, next_token)
        return VerifyOutput(tau, draft_index, next_token, correction=correction)

    @staticmethod
    def _next_tokens_by_rows(residual, negated, first_level, rows_at, target, tau, u):
        """The correction or bonus token of each row, reading only the rows it is drawn from (the CPU path).

        ``residual [B, L - first_level, V]``: the residuals of levels ``first_level ..`` (negated where
        ``negated``); ``rows_at``: the rows and factors that build a level's residual
        (:meth:`_signed_sampler_levels`), or None where ``first_level`` is 0; ``target [B, L + 1, V]``.  On
        the CPU, where counting rows costs no device round trip, a row that stopped at ``tau < L`` copies
        out its residual row at ``tau`` (one row, not the ``L`` levels; below ``first_level``, built from
        that row's ``p`` and ``q`` with the same operations as the other levels) and draws its correction
        from it, and the target's row at the end of the draft is read only for the rows that passed every
        level: by a copy of those rows when they are few, else in place.  Each row's draw depends on that
        row and its uniform only, so the tokens are those of drawing every row from both.
        """
        batch_size, draft_len = tau.shape[0], target.shape[1] - 1
        next_token = torch.zeros(batch_size, dtype=torch.int64, device=tau.device)
        stopped = tau < draft_len
        for below in (True, False):  # the rows that stopped below first_level, then the others
            corrected = (stopped & ((tau < first_level) if below else (tau >= first_level))).nonzero().squeeze(1)
            if corrected.numel() == 0:
                continue
            level = tau.index_select(0, corrected)
            if below:
                draft, rows_target, a, b = rows_at
                at_tau = torch.mul(_rows_of(draft, tau, corrected), _rows_of(a, tau, corrected))
                at_tau = at_tau.addcmul_(_rows_of(rows_target, tau, corrected), _rows_of(b, tau, corrected))
                at_tau = at_tau.clamp_(min=0)
            else:
                at_tau = _rows_of(residual, tau - first_level, corrected)  # a copy: negated in place
                at_tau = at_tau.neg_() if negated else at_tau
            drawn = _sample_or_fallback(
                at_tau, lambda rows=corrected, at=level: _sampler_dtype(target[rows, at]), u.index_select(0, corrected)
            )
            next_token.index_copy_(0, corrected, drawn)
        finished = (~stopped).nonzero().squeeze(1)
        if finished.numel() > 0:
            end = target[:, draft_len]
            if 3 * finished.numel() <= batch_size:
                drawn = sample_categorical(_sampler_dtype(end.index_select(0, finished)), u.index_select(0, finished))
            else:
                drawn = sample_categorical(_sampler_dtype(end), u).index_select(0, finished)
            next_token.index_copy_(0, finished, drawn)
        return next_token

    def _output_probs(self, draft_tokens, draft_probs, target_probs) -> torch.Tensor:
        batch_size, _, draft_len = draft_tokens.shape
        pass_probs, residual = self._levels(draft_tokens, draft_probs, target_probs)
        target = target_probs[:, 0].double()
        # P(tau = i) = h_i prod_{j > i} (1 - h_j), with h_0 = 1.
        fail = 1 - pass_probs
        after = torch.cat([fail.flip(-1).cumprod(-1).flip(-1), torch.ones_like(fail[:, :1])], dim=1)  # [B, L + 1]
        stop = torch.cat([torch.ones_like(pass_probs[:, :1]), pass_probs], dim=1) * after
        # normalise works on [n, V]: flatten the levels into rows
        vocab_size = residual.shape[-1]
        corrections = normalise(residual.reshape(-1, vocab_size), target[:, :draft_len].reshape(-1, vocab_size))
        laws = torch.cat([corrections.reshape(residual.shape), target[:, draft_len:]], dim=1)  # [B, L + 1, V]
        return (stop.unsqueeze(-1) * laws).unsqueeze(1)


class BlockVerification(LastPassingVerifier):
    """Block verification (Sun et al., "Block Verification Accelerates Speculative Decoding").

    One draft of length L.  Weights ``p_i = min(1, p_{i-1} q(x_i|x^{i-1}) / p(x_i|x^{i-1}))``;
    level ``i < L`` passes with ``h_i = r_i / (r_i + 1 - p_i)``,
    ``r_i = sum_x (p_i q(x|x^i) - p(x|x^i))_+``, level L with ``h_L = p_L``; ``tau`` is the
    last passing level; the correction comes from ``(p_tau q(.|x^tau) - p(.|x^tau))_+``.
    Exact in one iteration with the plain target; ``E[tau] = sum_i E[p_i]``, the optimum
    over single-draft verifiers (the block LP at K = 1).  For L = 1 it is speculative sampling.

    Examples
    --------
    >>> import torch
    >>> v = BlockVerification()
    >>> draft_probs = torch.tensor([[[[2/3, 1/3], [2/3, 1/3]]]], dtype=torch.float64)
    >>> target_probs = torch.tensor([[[[1/3, 2/3]] * 3]], dtype=torch.float64)
    >>> law = v.output_probs(torch.tensor([[[0, 1]]]), draft_probs, target_probs)
    >>> round(float(law[0, 0, 2].sum()), 6)   # the draft (0, 1) is always accepted in full
    1.0
    """

    name = "block"
    description = "block verification (Sun et al.): last passing level, clamped weights"
    expected = "exact"

    def _weights(self, log_token_ratio):
        log_weights = [torch.zeros_like(log_token_ratio[:, 0])]
        for level in range(log_token_ratio.shape[1]):
            log_weights.append((log_weights[-1] + log_token_ratio[:, level]).clamp(max=0.0))
        return torch.stack(log_weights, dim=1).exp()
