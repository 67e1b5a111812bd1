"""Statistical helpers shared by the samplers-against-their-law tests."""

from __future__ import annotations

import torch
from scipy import stats

__all__ = ["pooled_chisquare_pvalue"]


def pooled_chisquare_pvalue(
    counts: torch.Tensor,  # [num_cells] observed counts
    expected: torch.Tensor,  # [num_cells] expected counts (the law times the number of draws)
    max_zero_fraction: float = 0.0,
) -> float:
    """Pearson chi-square p-value, cells with expected count < 5 pooled into one.

    Draws in cells of expected count 0 are a support failure, not a chi-square matter: at most
    ``max_zero_fraction`` of all draws may land there (0: none at all).  With fewer than two cells
    left there is nothing to test and the p-value is 1.
    """
    if max_zero_fraction == 0.0:
        assert counts[expected == 0].sum() == 0, "sampled a verdict of zero probability"
    else:
        assert counts[expected == 0].sum() <= max_zero_fraction * counts.sum(), "sampled verdicts of zero probability"
    big = expected >= 5
    obs = torch.cat([counts[big], counts[~big].sum().unsqueeze(0)])
    exp = torch.cat([expected[big], expected[~big].sum().unsqueeze(0)])
    if exp[-1] == 0:
        obs, exp = obs[:-1], exp[:-1]
    if obs.numel() < 2:
        return 1.0
    return float(stats.chisquare(obs.numpy(), exp.numpy() * obs.sum().item() / exp.sum().item()).pvalue)
