"""Post-stratification of the main sample by draft tuple: the stratified test without a second sample.

When the draft space is small, the draft-sampling noise of an i.i.d. sample can be removed:
with strata g of known probability P(g) (groups of draft tuples) and f_g the verifier's law
given a draft of group g, the stratified estimate ``F_hat = sum_g P(g) f_hat_g`` has only the
within-group noise, and :func:`~spectr_audit.statistical.gof.stratified_pearson_test` tests
``sum_g P(g) f_g = q`` against it.  The audit's main sample already draws its tuples i.i.d.,
so it is its own stratified sample: each row is tagged with its tuple's group before the
verifier sees it, and given the group counts the rows of a group are i.i.d. from f_g.  One
sample then serves every test (and a budget counts every verification once).

The groups are fixed before any sample is drawn, from the tuples' probabilities alone: a tuple
expected at least ``min_per_group`` times is a group of its own; the rarer ones are merged, most
probable first, into groups expected at least that often.  Merging is always valid (the rows
of a merged group are i.i.d. from its mixture law); it only gives up the noise reduction among
the merged tuples.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Optional

import torch

from spectr_audit.exact.iteration import DraftEnumeration

__all__ = ["PostStrata", "post_strata"]


@dataclasses.dataclass(frozen=True)
class PostStrata:
    """Groups of draft tuples with their probabilities, and a lookup from drafts to groups.

    Attributes
    ----------
    group_probs : torch.Tensor
        ``[num_groups]`` float64: P(group), summing to 1.
    codes : torch.Tensor
        ``[num_tuples]`` int64, sorted: each enumerated tuple's base-V code (its K x L tokens).
    code_group : torch.Tensor
        ``[num_tuples]`` int64: the group of the tuple of each code.
    vocab_size : int
    num_tuples : int
    """

    # [num_groups]
    group_probs: torch.Tensor
    # [num_tuples]
    codes: torch.Tensor
    # [num_tuples]
    code_group: torch.Tensor
    vocab_size: int
    num_tuples: int

    @property
    def num_groups(self) -> int:
        """Number of strata."""
        return int(self.group_probs.numel())

    def group_of(self, draft_tokens: torch.Tensor) -> torch.Tensor:  # [batch_size] int64
        """The group of each row's drafts ``[batch_size, num_drafts, draft_len]``; -1 for a tuple not enumerated."""
        flat = draft_tokens.reshape(draft_tokens.shape[0], -1).to(torch.int64).cpu()
        powers = self.vocab_size ** torch.arange(flat.shape[1] - 1, -1, -1, dtype=torch.int64)
        codes = (flat * powers).sum(1)
        index = torch.searchsorted(self.codes, codes).clamp(max=self.codes.numel() - 1)
        found = self.codes[index] == codes
        return torch.where(found, self.code_group[index], torch.full_like(codes, -1))


def group_strata(weights: torch.Tensor, num_samples: int, min_per_group: float = 32.0) -> torch.Tensor:
    """The group of each stratum ``[num_strata]`` (int64), from the strata's probabilities ``weights`` alone.

    A stratum expected at least ``min_per_group`` times in ``num_samples`` rows is a group of its
    own; the rarer ones, most probable first, fill groups until each is expected that often; an
    under-filled last group joins the one before it.

    Examples
    --------
    >>> group_strata(torch.tensor([0.5, 0.3, 0.1, 0.06, 0.04], dtype=torch.float64), 100, min_per_group=10).tolist()
    [0, 1, 2, 3, 3]
    """
    weights = weights.double() / weights.double().sum()
    order = torch.argsort(weights, descending=True, stable=True)
    group = torch.empty(weights.numel(), dtype=torch.int64)
    num_groups, open_mass = 0, 0.0
    for index in order.tolist():
        mass = float(weights[index])
        if open_mass == 0.0:
            num_groups += 1
        group[index] = num_groups - 1
        open_mass = 0.0 if (open_mass + mass) * num_samples >= min_per_group * (1 - 1e-12) else open_mass + mass
    if open_mass > 0.0 and num_groups >= 2:
        group[group == num_groups - 1] = num_groups - 2
    return group


def post_strata(enumeration: DraftEnumeration, vocab_size: int, num_samples: int,
                min_per_group: float = 32.0) -> Optional[PostStrata]:
    """The strata of a main sample of ``num_samples`` rows over the tuples of ``enumeration``.

    Returns None when fewer than two groups would result, or when a tuple's code would not fit
    in int64.

    Examples
    --------
    >>> from spectr_audit.drafting.models import ContextFreeModel
    >>> from spectr_audit.exact.iteration import enumerate_drafts
    >>> draft = ContextFreeModel([0.6, 0.3, 0.1])
    >>> strata = post_strata(enumerate_drafts(draft, draft, 2, 1), 3, 1000)
    >>> strata.num_tuples, strata.num_groups          # 0.01 * 1000 = 10 < 32: the rare tuples merge
    (9, 7)
    >>> strata.group_of(torch.tensor([[[0], [0]], [[2], [2]]])).tolist()
    [0, 6]
    """
    tokens = enumeration.draft_tokens.reshape(enumeration.weights.numel(), -1).to(torch.int64)
    positions = tokens.shape[1]
    if positions * math.log2(max(vocab_size, 2)) >= 62:
        return None
    weights = enumeration.weights.double()
    group = group_strata(weights, num_samples, min_per_group)
    probs = torch.zeros(int(group.max()) + 1, dtype=torch.float64).index_add_(0, group, weights / weights.sum())
    if probs.numel() < 2:
        return None
    powers = vocab_size ** torch.arange(positions - 1, -1, -1, dtype=torch.int64)
    codes = (tokens * powers).sum(1)
    sort = torch.argsort(codes)
    return PostStrata(probs, codes[sort], group[sort], vocab_size, int(weights.numel()))
