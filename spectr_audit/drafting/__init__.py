"""Drafting: models, the drafting harness and the decoding loop.
"""

from __future__ import annotations

from .models import (
    Model,
    ContextFreeModel,
    MarkovModel,
    TableModel,
    TorchModel,
    PAD,
    as_distribution,
    random_markov,
)
from .harness import (
    DraftBatch,
    draft,
    verify_step,
    left_pad,
)
from .tree import (
    TreeDraftBatch,
    draft_tree,
    verify_tree_step,
)
from .decoding import (
    complete,
    decode,
    emitted_tokens,
)

__all__ = [
    "Model",
    "ContextFreeModel",
    "MarkovModel",
    "TableModel",
    "TorchModel",
    "PAD",
    "as_distribution",
    "random_markov",
    "DraftBatch",
    "draft",
    "verify_step",
    "left_pad",
    "TreeDraftBatch",
    "draft_tree",
    "verify_tree_step",
    "complete",
    "decode",
    "emitted_tokens",
]
