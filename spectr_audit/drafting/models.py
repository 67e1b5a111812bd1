"""Models: maps from contexts to next-token distributions.

A model is called on ``contexts`` of shape ``[batch_size, context_len]`` (int64)
and returns ``[batch_size, vocab_size]`` float64 next-token distributions.
Contexts are right-aligned: the last column is the most recent token, and
``-1`` marks padding before the start of a shorter context (so rows of one
batch may have different true lengths).
"""

from __future__ import annotations

from typing import Callable, Sequence

import numpy as np
import torch

from spectr_audit._validation import as_distribution
from spectr_audit.errors import InvalidArgument

__all__ = [
    "Model",
    "ContextFreeModel",
    "MarkovModel",
    "TableModel",
    "TorchModel",
    "PAD",
    "as_distribution",
    "random_markov",
]

#: Padding id in right-aligned contexts.
PAD = -1


class Model:
    """Base class: ``model(contexts [B, T]) -> [B, V]`` next-token distributions (float64)."""

    vocab_size: int

    def __call__(self, contexts: torch.Tensor) -> torch.Tensor:  # [batch_size, vocab_size]
        raise NotImplementedError

    def describe(self) -> str:
        """One line for reports."""
        return type(self).__name__


class ContextFreeModel(Model):
    """The same distribution at every position (the token-level audits' setting)."""

    def __init__(self, probs):
        # [vocab_size]
        self.probs = as_distribution(probs, "probs")
        self.vocab_size = self.probs.numel()

    def __call__(self, contexts: torch.Tensor) -> torch.Tensor:
        return self.probs.to(contexts.device).expand(contexts.shape[0], -1).clone()

    def describe(self) -> str:
        return "context-free " + ", ".join(f"{x:.4g}" for x in self.probs.tolist())


class MarkovModel(Model):
    """An order-n Markov model given by an explicit table.

    Parameters
    ----------
    table : array of shape ``[(V + 1)] * order + [V]``
        ``table[s_1, ..., s_n]`` is the next-token law after the last ``n`` tokens
        ``s_1 .. s_n`` (oldest first); index ``V`` stands for "before the start".
    """

    def __init__(self, table, order: int):
        table = torch.as_tensor(np.asarray(table, dtype=np.float64))
        if order < 0:
            raise InvalidArgument(f"order: must be >= 0, got {order}")
        vocab_size = table.shape[-1]
        expected = (vocab_size + 1,) * order + (vocab_size,)
        if tuple(table.shape) != expected:
            raise InvalidArgument(f"table: expected shape {expected} for order {order}, got {tuple(table.shape)}")
        flat = table.reshape(-1, vocab_size)
        for i, row in enumerate(flat):
            as_distribution(row, f"table[row {i}]")
        self.order = order
        self.vocab_size = vocab_size
        # [(V + 1) ** order, vocab_size]
        self.table = flat / flat.sum(-1, keepdim=True)

    def __call__(self, contexts: torch.Tensor) -> torch.Tensor:
        batch_size = contexts.shape[0]
        base = self.vocab_size + 1
        state = torch.zeros(batch_size, dtype=torch.int64, device=contexts.device)
        for i in range(self.order):
            col = contexts.shape[1] - self.order + i
            if col >= 0:
                token = contexts[:, col]
                token = torch.where(token < 0, torch.full_like(token, self.vocab_size), token)
            else:
                token = torch.full((batch_size,), self.vocab_size, dtype=torch.int64, device=contexts.device)
            state = state * base + token
        return self.table.to(contexts.device)[state]

    def describe(self) -> str:
        return f"order-{self.order} Markov, V={self.vocab_size}"


def random_markov(
    vocab_size: int,
    order: int = 1,
    *,
    concentration: float = 1.0,
    temperature: float = 1.0,
    seed: int = 0,
) -> MarkovModel:
    """A random order-n Markov model: Dirichlet(concentration) rows, then a temperature.

    ``temperature`` reshapes each row as ``probs ** (1 / T)`` renormalised (T -> 0 is greedy).
    """
    if vocab_size < 1:
        raise InvalidArgument(f"vocab_size: must be >= 1, got {vocab_size}")
    if concentration <= 0:
        raise InvalidArgument(f"concentration: must be > 0, got {concentration}")
    if temperature <= 0:
        raise InvalidArgument(f"temperature: must be > 0, got {temperature}")
    rng = np.random.default_rng(seed)
    rows = rng.dirichlet(np.full(vocab_size, concentration), size=(vocab_size + 1) ** order)
    logits = np.log(np.clip(rows, 1e-300, None)) / temperature
    logits -= logits.max(-1, keepdims=True)
    rows = np.exp(logits)
    rows /= rows.sum(-1, keepdims=True)
    return MarkovModel(rows.reshape((vocab_size + 1,) * order + (vocab_size,)), order)


class TableModel(Model):
    """Explicit next-token laws for given contexts, e.g. ``{(): [.5, .5], (0,): [.9, .1]}``.

    Contexts not in the table fall back to ``default`` (a distribution), or are an error.
    """

    def __init__(self, table: dict, default=None):
        if not table:
            raise InvalidArgument("table: must contain at least one context")
        self.table = {tuple(int(t) for t in k): as_distribution(v, f"table[{tuple(k)}]") for k, v in table.items()}
        sizes = {v.numel() for v in self.table.values()}
        if len(sizes) != 1:
            raise InvalidArgument(f"table: all distributions must have one length, got {sorted(sizes)}")
        self.vocab_size = sizes.pop()
        self.default = None if default is None else as_distribution(default, "default", self.vocab_size)

    def __call__(self, contexts: torch.Tensor) -> torch.Tensor:
        rows = []
        for ctx in contexts.tolist():
            key = tuple(t for t in ctx if t >= 0)
            if key in self.table:
                rows.append(self.table[key])
            elif self.default is not None:
                rows.append(self.default)
            else:
                raise InvalidArgument(f"contexts: no distribution for context {key} and no default")
        return torch.stack(rows).to(contexts.device)


class TorchModel(Model):
    """Adapter for any torch callable (a real language model, for instance).

    Parameters
    ----------
    fn : callable
        ``fn(contexts [B, T] int64) -> [B, V]`` logits or probabilities.
    vocab_size : int
    outputs : {"logits", "probs"}
    temperature : float
        Applied to logits (``softmax(logits / T)``).
    """

    def __init__(self, fn: Callable[[torch.Tensor], torch.Tensor], vocab_size: int, outputs: str = "logits", temperature: float = 1.0):
        if outputs not in ("logits", "probs"):
            raise InvalidArgument(f"outputs: must be 'logits' or 'probs', got {outputs!r}")
        if temperature <= 0:
            raise InvalidArgument(f"temperature: must be > 0, got {temperature}")
        self.fn, self.vocab_size, self.outputs, self.temperature = fn, vocab_size, outputs, temperature

    def __call__(self, contexts: torch.Tensor) -> torch.Tensor:
        raw = self.fn(contexts)
        if not isinstance(raw, torch.Tensor) or tuple(raw.shape) != (contexts.shape[0], self.vocab_size):
            shape = tuple(raw.shape) if isinstance(raw, torch.Tensor) else type(raw).__name__
            raise InvalidArgument(f"fn: must return [batch_size, {self.vocab_size}], got {shape}")
        raw = raw.double()
        if self.outputs == "logits":
            return torch.softmax(raw / self.temperature, dim=-1)
        return raw / raw.sum(-1, keepdim=True)


def contexts_from(prefix: Sequence[int], suffixes: torch.Tensor) -> torch.Tensor:
    """``[prefix + suffix]`` for each row of ``suffixes [N, T]`` (a fixed prefix, no padding)."""
    head = torch.as_tensor(list(prefix), dtype=torch.int64, device=suffixes.device).expand(suffixes.shape[0], -1)
    return torch.cat([head, suffixes], dim=1)
