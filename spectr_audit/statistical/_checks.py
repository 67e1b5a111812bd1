"""Argument checks and the chunk schedule shared by the statistical audits (private)."""

from __future__ import annotations

import math
from typing import Iterator, Optional

import torch

from spectr_audit import defaults
from spectr_audit._validation import check_positive_int, check_prob  # noqa: F401 (the audits' checks)
from spectr_audit.errors import InvalidArgument
from spectr_audit.drafting.models import Model, contexts_from

#: Smallest chunk of the geometric chunk schedule (the e-process then sees blatant bugs early).
FIRST_CHUNK = defaults.FIRST_CHUNK


def check_seconds(value) -> Optional[float]:
    """A positive, finite number of seconds (or None)."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < math.inf:
        raise InvalidArgument(f"max_seconds: expected a positive number, got {value!r}")
    return float(value)


def check_models(draft_model: Model, target_model: Model) -> int:
    """Both are :class:`Model` with one vocabulary; returns V."""
    for name, model in (("draft_model", draft_model), ("target_model", target_model)):
        if not isinstance(model, Model):
            raise InvalidArgument(f"{name}: expected a spectr_audit.drafting.models.Model, got {type(model).__name__}")
    if draft_model.vocab_size != target_model.vocab_size:
        raise InvalidArgument(
            f"target_model: vocab_size {target_model.vocab_size} differs from draft_model's {draft_model.vocab_size}"
        )
    return int(target_model.vocab_size)


def check_prefix(prefix, vocab_size: int) -> tuple:
    """A tuple of token ids in [0, V)."""
    try:
        prefix = tuple(int(t) for t in prefix)
    except (TypeError, ValueError) as exc:
        raise InvalidArgument(f"prefix: expected a sequence of token ids, got {prefix!r}") from exc
    bad = [t for t in prefix if not 0 <= t < vocab_size]
    if bad:
        raise InvalidArgument(f"prefix: token ids must lie in [0, {vocab_size}); found {bad}")
    return prefix


def root_laws(draft_model: Model, target_model: Model, prefix: tuple, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Draft and target next-token laws ``[vocab_size]`` after ``prefix`` (float64, CPU)."""
    ctx = contexts_from(prefix, torch.zeros(1, 0, dtype=torch.int64, device=device))
    return draft_model(ctx)[0].double().cpu(), target_model(ctx)[0].double().cpu()


def chunk_schedule(total: int, chunk_size: int) -> Iterator[int]:
    """Chunk sizes 2^12, 2^13, ... doubling up to ``chunk_size``, summing to ``total``."""
    done, size = 0, min(FIRST_CHUNK, chunk_size)
    while done < total:
        step = min(size, total - done)
        yield step
        done += step
        size = min(size * 2, chunk_size)
