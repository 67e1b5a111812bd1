"""Slow oracle for categorical draws: the one-level inverse CDF over the whole row.

:func:`spectr_audit.contract.randomness.sample_categorical` draws in two levels at large
vocabularies (a block, then a token inside it); the oracle takes one float64 running sum over the
whole row and searches it once.
"""

from __future__ import annotations

import torch

from spectr_audit.contract.randomness import sample_categorical_from_cdf

__all__ = ["one_level_draw"]


def one_level_draw(
    probs: torch.Tensor,  # [..., vocab_size]
    u: torch.Tensor,  # [...]
) -> torch.Tensor:  # [...] int64
    """The obviously correct draw: a float64 running sum over the whole row."""
    return sample_categorical_from_cdf(probs.double().cumsum(-1), u)
