"""The law of one verification step's emitted string and what the exact audit derives from it.

Both faces of the exact audit (:func:`spectr_audit.exact.iteration.exact_iteration` for chains and
:func:`spectr_audit.exact.tree.exact_tree` for draft trees) sum the verifier's exact law over every
realisation of the drafts into ``E_m(s)``, the law of emitted strings of ``m`` tokens; this module holds
the result type and the quantities derived from ``E`` (docs/audit/exact.md): the implied law ``F`` of the
first ``D + 1`` tokens when decoding continues with the unmodified target, the prefix caps ``B(u)``,
the TV distances and the worst strings.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import torch

from spectr_audit.drafting.models import Model, contexts_from
from spectr_audit.errors import InvalidArgument

__all__ = ["ExactIterationResult", "check_vocab", "string_of", "target_laws"]


def _product_grid(base: int, length: int) -> torch.Tensor:  # [base ** length, length] int64
    """``itertools.product(range(base), repeat=length)`` as a tensor, in the same order (last index fastest)."""
    codes = torch.arange(base**length, dtype=torch.int64).unsqueeze(1)
    powers = base ** torch.arange(length - 1, -1, -1, dtype=torch.int64)
    return codes // powers % base


def check_vocab(draft_model: Model, target_model: Model) -> int:
    """The models' common vocabulary size; they must agree."""
    vocab_size = draft_model.vocab_size
    if target_model.vocab_size != vocab_size:
        raise InvalidArgument(
            f"target_model: vocab_size {target_model.vocab_size} differs from draft_model's {vocab_size}"
        )
    return vocab_size


def string_of(code: int, length: int, vocab_size: int) -> tuple[int, ...]:
    """Decode a base-V string code (most significant token first)."""
    out = []
    for _ in range(length):
        out.append(code % vocab_size)
        code //= vocab_size
    return tuple(reversed(out))


@dataclasses.dataclass(frozen=True)
class ExactIterationResult:
    """Exact law of one verification step and the quantities derived from it.

    Laws over strings of length m are flat float64 tensors of size ``V**m``,
    indexed by the base-V code of the string (first token most significant).
    """

    vocab_size: int
    num_drafts: int
    draft_len: int
    num_draft_tuples: int
    #: E_m(s) = P(the step emits exactly s), for m = 1 .. L + 1
    emitted_law: tuple
    #: q(w) over strings of length m = 1 .. L + 1
    target_law: tuple
    #: F(w): law of the first L + 1 tokens when decoding continues with the unmodified target
    # [vocab_size ** (draft_len + 1)]
    implied_law: torch.Tensor
    #: B_m(u) = P(the emitted string starts with u), m = 1 .. L + 1
    prefix_law: tuple
    tv_distance: float
    max_abs_error: float
    token_tv_distance: float
    prefix_cap_excess: float
    worst_prefix: tuple
    #: E[len(s)], the mean emitted length
    block_efficiency: float
    #: membership acceptance: P(first emitted token is among the drafts' first tokens)
    acceptance: float

    @property
    def first_token_law(self) -> torch.Tensor:  # [vocab_size]
        """P(first emitted token = y)."""
        return self.prefix_law[0]

    def worst_strings(self, count: int = 5) -> list[dict]:
        """The strings w of length L + 1 with the largest |F(w) - q(w)|."""
        return _worst_strings(self.implied_law, self.target_law[-1], "implied", self.draft_len + 1, self.vocab_size,
                              count)


def _worst_strings(law: torch.Tensor, target: torch.Tensor, law_key: str, length: int, vocab_size: int,
                   count: int) -> list[dict]:
    """The (at most ``count``) strings of ``length`` tokens with the largest ``|law - target|`` > 0, largest first."""
    diff = (law - target).abs()
    top = torch.topk(diff, min(count, diff.numel()))
    return [
        {
            "string": list(string_of(int(code), length, vocab_size)),
            law_key: float(law[code]),
            "target": float(target[code]),
        }
        for code in top.indices.tolist()
        if float(diff[code]) > 0
    ]


def target_laws(target_model: Model, prefix: Sequence[int], num_tokens: int) -> tuple[list, list]:
    """The target's conditionals after every string of m tokens (``[V^m, V]``) and its laws of strings of
    m + 1 tokens (``[V^(m+1)]``), for m = 0 .. ``num_tokens - 1``."""
    vocab_size = target_model.vocab_size
    conditionals, laws = [], []
    joint = torch.ones(1, dtype=torch.float64)
    for m in range(num_tokens):
        cond = target_model(contexts_from(prefix, _product_grid(vocab_size, m))).double()  # [V^m, V]
        joint = (joint.unsqueeze(-1) * cond).reshape(-1)
        conditionals.append(cond)
        laws.append(joint)
    return conditionals, laws


def _target_and_implied_laws(target_model: Model, prefix: Sequence[int], emitted: list) -> tuple[list, torch.Tensor]:
    """Target laws q(w) over strings of length 1 .. L + 1, and the implied law F of the first L + 1 tokens."""
    conditionals, target_law = target_laws(target_model, prefix, len(emitted))
    implied = emitted[0]
    for m in range(1, len(emitted)):
        implied = (implied.unsqueeze(-1) * conditionals[m]).reshape(-1) + emitted[m]
    return target_law, implied


def _prefix_laws(emitted: list, vocab_size: int) -> list:
    """``B_m(u) = E_m(u) + sum_x B_{m+1}(ux)``: P(the emitted string starts with u), m = 1 .. L + 1."""
    prefix_law = [emitted[-1]]
    for m in range(len(emitted) - 2, -1, -1):
        prefix_law.insert(0, emitted[m] + prefix_law[0].reshape(-1, vocab_size).sum(-1))
    return prefix_law


def _worst_prefix_cap(prefix_law: list, target_law: list, vocab_size: int) -> tuple[float, tuple]:
    """``max_u B(u) - q(u)`` and the u where it occurs (0 and () when no cap is exceeded)."""
    excess, worst = 0.0, ()
    for m, (cap, target) in enumerate(zip(prefix_law, target_law)):
        over = cap - target
        value, code = over.max(0)
        if float(value) > excess:
            excess, worst = float(value), string_of(int(code), m + 1, vocab_size)
    return excess, worst


def _law_fields(target_model: Model, prefix: Sequence[int], emitted: list, vocab_size: int) -> dict:
    """The :class:`ExactIterationResult` fields that follow from the emitted laws ``E_m`` and the target."""
    target_law, implied = _target_and_implied_laws(target_model, prefix, emitted)
    prefix_law = _prefix_laws(emitted, vocab_size)
    excess, worst = _worst_prefix_cap(prefix_law, target_law, vocab_size)
    diff = implied - target_law[-1]
    return dict(
        emitted_law=tuple(emitted),
        target_law=tuple(target_law),
        implied_law=implied,
        prefix_law=tuple(prefix_law),
        tv_distance=float(diff.abs().sum() / 2),
        max_abs_error=float(diff.abs().max()),
        token_tv_distance=float((prefix_law[0] - target_law[0]).abs().sum() / 2),
        prefix_cap_excess=excess,
        worst_prefix=worst,
    )
