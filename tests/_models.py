"""Models shared by several test modules.

Module-level objects, not fixtures, because case tables passed to ``pytest.mark.parametrize`` are
built at import time.  The models are never mutated by the code under test (models return fresh
tensors), so sharing one instance between modules is safe.
"""

from __future__ import annotations

import numpy as np

from spectr_audit.drafting.models import ContextFreeModel, random_markov

__all__ = ["DRAFT8", "TARGET8", "DRAFT_MARKOV", "TARGET_MARKOV", "PAPER", "dirichlet"]


def dirichlet(vocab_size: int, seed: int) -> ContextFreeModel:
    """A context-free model whose distribution is one Dirichlet(1) draw with ``seed``."""
    return ContextFreeModel(np.random.default_rng(seed).dirichlet(np.ones(vocab_size)))


#: The standard token-level case: V = 8, draft and target drawn from Dirichlet(1) with seeds 1 and 2.
DRAFT8, TARGET8 = dirichlet(8, 1), dirichlet(8, 2)

#: A first-order Markov pair over V = 4 (seeds 1 and 2).
DRAFT_MARKOV, TARGET_MARKOV = random_markov(4, 1, seed=1), random_markov(4, 1, seed=2)

#: The block-verification paper's example (Sun et al.): context-free p = (2/3, 1/3), q = (1/3, 2/3).
PAPER = (ContextFreeModel([2 / 3, 1 / 3]), ContextFreeModel([1 / 3, 2 / 3]))
