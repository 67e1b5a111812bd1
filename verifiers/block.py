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
from spectr_audit.verifiers._walk import _sample_or_fallback, _sampler_dtype, normalise

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
        rows' dtype.  ``s_i`` comes from the identity ``s_i = r_i - sum_x (w_i q - p)`` (one sum over the
        signed difference) instead of a second clamped pass; the residual is clamped in place.
        """
        draft_len = draft_tokens.shape[-1]
        draft = _sampler_dtype(draft_probs[:, 0])  # [batch_size, draft_len, vocab_size]
        target = _sampler_dtype(target_probs[:, 0])  # [batch_size, draft_len + 1, vocab_size]
        weights = self._path_weights(draft_tokens, draft, target)
        level_weight = weights[:, :draft_len].unsqueeze(-1)
        # (w q - p) / max(w, 1), as in _levels, in one allocation and one fused in-place pass
        diff = torch.mul(draft, (-1 / level_weight.clamp(min=1.0)).to(draft.dtype))
        diff.addcmul_(target[:, :draft_len], level_weight.clamp(max=1.0).to(draft.dtype))
        net = diff.sum(-1).double()  # r_i - s_i
        residual = diff.clamp_(min=0)
        wanted = residual.sum(-1).double()  # r_i
        surplus = (wanted - net).clamp(min=0)  # s_i
        return _pass_probs(wanted, surplus, weights), residual

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
        levels = self._triton_levels if lazy else self._sampler_levels if fast else self._levels
        pass_probs, residual = levels(draft_tokens, draft_probs, target_probs)
        u = uniform(generator, (batch_size, draft_len + 1), device)
        passed = u[:, :draft_len] < pass_probs
        level_ids = torch.arange(1, draft_len + 1, device=device)
        tau = (passed * level_ids).amax(-1)  # the last passing level, 0 if none
        # Draw the correction from the residual row at tau (rows with no residual mass: the target there),
        # and the bonus from the target at the end of the draft; keep the one that applies.
        rows = torch.arange(batch_size, device=device)
        level = tau.clamp(max=draft_len - 1)
        target = target_probs[:, 0]
        correction = _sample_or_fallback(
            residual.take(rows, level) if lazy else residual[rows, level], lambda: _sampler_dtype(target[rows, level]), u[:, draft_len]
        )
        bonus = sample_categorical(_sampler_dtype(target[:, draft_len]), u[:, draft_len])
        next_token = torch.where(tau < draft_len, correction, bonus)
        draft_index = torch.zeros_like(tau)
        correction = None
        if has_carried_correction(self):
            correction = self.carried_correction(draft_tokens, draft_probs, target_probs, tau, draft_index, next_token)
        return VerifyOutput(tau, draft_index, next_token, correction=correction)

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
