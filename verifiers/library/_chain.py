"""The single-draft chain shared by the library: accept level by level, stop at the first rejection.

A chain is fixed once the draft is known: acceptance probabilities ``accept_probs [B, L]``, the
law emitted after a rejection at each level ``corrections [B, L, V]``, the bonus law ``bonus [B, V]``.
Law and sampler both come from those numbers, so a slip planted in one of them is the only bug.
Randomness: one ``uniform`` of shape ``[batch_size, draft_len + 1]`` (the acceptance coins, then the
emitted token's inverse-CDF uniform).
"""

from __future__ import annotations

import torch

from spectr_audit.contract.randomness import RandomSource, sample_categorical, uniform
from spectr_audit.contract.verifier import VerifyOutput


def chain_law(
    accept_probs: torch.Tensor,  # [batch_size, draft_len]
    corrections: torch.Tensor,  # [batch_size, draft_len, vocab_size]
    bonus: torch.Tensor,  # [batch_size, vocab_size]
) -> torch.Tensor:  # [batch_size, 1, draft_len + 1, vocab_size]
    """Exact law of the chain: stop at level n with ``prod_{i < n} a_i (1 - a_n)``, then the correction or bonus."""
    reach = torch.cat([torch.ones_like(accept_probs[:, :1]), accept_probs.cumprod(-1)], dim=1)  # [B, L + 1]
    stop = reach * torch.cat([1 - accept_probs, torch.ones_like(accept_probs[:, :1])], dim=1)
    laws = torch.cat([corrections, bonus.unsqueeze(1)], dim=1)  # [B, L + 1, V]
    return (stop.unsqueeze(-1) * laws).unsqueeze(1)


def chain_sample(
    accept_probs: torch.Tensor,  # [batch_size, draft_len]
    corrections: torch.Tensor,  # [batch_size, draft_len, vocab_size]
    bonus: torch.Tensor,  # [batch_size, vocab_size]
    generator: RandomSource,
    inclusive: bool = False,
) -> VerifyOutput:
    """One draw of the chain; ``inclusive`` tests ``u <= a`` instead of ``u < a`` (same law, other coin boundary)."""
    batch_size, draft_len = accept_probs.shape
    device = accept_probs.device
    u = uniform(generator, (batch_size, draft_len + 1), device)
    coins = u[:, :draft_len]
    passed = coins <= accept_probs if inclusive else coins < accept_probs
    # number of leading passes = index of the first failure (draft_len if none)
    num_accepted = passed.to(torch.int64).cumprod(-1).sum(-1)
    rows = torch.arange(batch_size, device=device)
    laws = torch.cat([corrections, bonus.unsqueeze(1)], dim=1)  # [B, L + 1, V]
    next_token = sample_categorical(laws[rows, num_accepted], u[:, draft_len])
    return VerifyOutput(num_accepted, torch.zeros_like(num_accepted), next_token)
