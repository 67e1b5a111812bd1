"""Checks the contract's boundaries share: what a verifier is given, what it returns, how it is built.

The chain contract (:mod:`.verifier`), the logits contract (:mod:`.logits`) and the tree contract
(:mod:`.tree_verifier`) validate the same kinds of things: token tensors, probability tensors and
their devices, the integer fields and the exact law a verifier returns, the arguments of the
adapters that wrap a third party's function.  Each check lives here once, so that one problem gets
one message wherever it is found.  Bad input raises :class:`~spectr_audit.errors.InvalidArgument`;
a verifier's breach of the contract raises :class:`~spectr_audit.errors.VerifierError`.  Every
message starts with the argument (or the verifier) it is about.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch

from spectr_audit._validation import LAW_MASS_ATOL, LAW_NEGATIVE_ATOL, check_simplex
from spectr_audit.errors import InvalidArgument, VerifierError


# -- inputs --------------------------------------------------------------------------------------
def check_token_tensor(name: str, tokens: Any) -> None:
    """A torch int64 tensor of token ids (its shape is the caller's to check)."""
    if not isinstance(tokens, torch.Tensor):
        raise InvalidArgument(f"{name}: expected a torch.Tensor, got {type(tokens).__name__}")
    if tokens.dtype != torch.int64:
        raise InvalidArgument(f"{name}: expected dtype torch.int64, got {tokens.dtype}")


def check_dims(name: str, tensor: Any, dims: int, layout: str) -> None:
    """A tensor of ``dims`` dimensions; the message spells the expected ``layout``."""
    if not isinstance(tensor, torch.Tensor) or tensor.dim() != dims:
        shape = tuple(tensor.shape) if isinstance(tensor, torch.Tensor) else type(tensor).__name__
        raise InvalidArgument(f"{name}: expected shape [{layout}], got {shape}")


def check_shape(name: str, tensor: torch.Tensor, expected: tuple[int, ...]) -> None:
    """A tensor of exactly the ``expected`` shape."""
    if tuple(tensor.shape) != tuple(expected):
        raise InvalidArgument(f"{name}: expected shape {tuple(expected)}, got {tuple(tensor.shape)}")


def check_probs(name: str, probs: Any, expected_shape: tuple[int, ...]) -> None:
    """A floating-point tensor of ``expected_shape`` whose last dimension holds distributions."""
    if not isinstance(probs, torch.Tensor):
        raise InvalidArgument(f"{name}: expected a torch.Tensor, got {type(probs).__name__}")
    if not probs.is_floating_point():
        raise InvalidArgument(f"{name}: expected a floating-point tensor, got dtype {probs.dtype}")
    check_shape(name, probs, expected_shape)
    check_simplex(name, probs)


def check_same_device(**tensors: torch.Tensor) -> None:
    """The tensors (named by keyword, in order) live on the device of the first."""
    first, *others = tensors.values()
    if any(tensor.device != first.device for tensor in others):
        raise InvalidArgument(
            f"{', '.join(tensors)}: must share one device, got {', '.join(str(t.device) for t in tensors.values())}"
        )


def check_token_range(
    draft_tokens: torch.Tensor,  # [batch_size, num_drafts, draft_len]
    vocab_size: int,
) -> None:
    """Every drafted token id in ``[0, vocab_size)``."""
    out_of_range = (draft_tokens < 0) | (draft_tokens >= vocab_size)
    if bool(out_of_range.any()):
        bad = tuple(out_of_range.nonzero()[0].tolist())
        raise InvalidArgument(
            f"draft_tokens: token ids must lie in [0, {vocab_size}); found {draft_tokens[bad].item()} at index {bad}"
        )


def check_drafted(
    draft_tokens: torch.Tensor,  # [batch_size, num_drafts, draft_len]
    draft_values: torch.Tensor,  # [batch_size, num_drafts, draft_len, vocab_size]
    impossible: Callable[[torch.Tensor], torch.Tensor],
    why: str,
) -> None:
    """Refuse a drafted token whose draft value (a probability or a logit) says it cannot be drawn.

    ``impossible`` maps the drafted tokens' values to a mask of the impossible ones; ``why`` ends
    the message (``"has draft logit -inf, so it cannot have been drafted"``).
    """
    drafted = draft_values.gather(-1, draft_tokens.unsqueeze(-1)).squeeze(-1)
    bad_mask = impossible(drafted)
    if bool(bad_mask.any()):
        bad = tuple(bad_mask.nonzero()[0].tolist())
        raise InvalidArgument(f"draft_tokens: token {draft_tokens[bad].item()} at index {bad} {why}")


# -- outputs -------------------------------------------------------------------------------------
def _within(value: torch.Tensor, lo: int, hi: int) -> bool:
    """Every entry of a non-empty integer tensor in ``[lo, hi]``: one ``aminmax`` pass, one host read."""
    bounds = torch.stack(torch.aminmax(value)).tolist()
    return lo <= bounds[0] and bounds[1] <= hi


def check_output_field(who: str, name: str, value: Any, batch_size: int, lo: int, hi: int) -> torch.Tensor:
    """One integer field a verifier returned: an int64 tensor ``[batch_size]`` with entries in ``[lo, hi]``."""
    if not isinstance(value, torch.Tensor):
        raise VerifierError(f"{who}: {name} must be a torch.Tensor, got {type(value).__name__}")
    if value.dtype != torch.int64:
        raise VerifierError(f"{who}: {name} must have dtype torch.int64, got {value.dtype}")
    if tuple(value.shape) != (batch_size,):
        raise VerifierError(f"{who}: {name} must have shape [{batch_size}], got {tuple(value.shape)}")
    if value.numel() and not _within(value, lo, hi):
        bad = ((value < lo) | (value > hi)).nonzero()[0].item()
        raise VerifierError(f"{who}: {name}[{bad}] = {value[bad].item()} is outside [{lo}, {hi}]")
    return value


def check_law(who: str, method: str, law: Any, expected: tuple[int, ...]) -> torch.Tensor:
    """An exact law a verifier's ``method`` returned: shape, finiteness, sign, total mass 1 per batch row."""
    if not isinstance(law, torch.Tensor) or not law.is_floating_point():
        raise VerifierError(f"{who}: {method} must return a floating-point torch.Tensor")
    if tuple(law.shape) != expected:
        raise VerifierError(f"{who}: {method} must have shape {expected}, got {tuple(law.shape)}")
    if law.numel() == 0:
        return law
    low, high = torch.aminmax(law)  # one pass: NaN propagates into both, inf shows in one
    if not bool(torch.isfinite(low) & torch.isfinite(high)):
        raise VerifierError(f"{who}: {method} contains NaN or Inf")
    if bool(low < -LAW_NEGATIVE_ATOL):
        raise VerifierError(f"{who}: {method} contains negative probabilities (min {low.item():.3g})")
    totals = (law if law.dtype == torch.float64 else law.double()).sum(tuple(range(1, law.dim())))
    off = (totals - 1).abs() > LAW_MASS_ATOL
    if bool(off.any()):
        bad = off.nonzero()[0].item()
        raise VerifierError(f"{who}: {method} row {bad} sums to {totals[bad].item():.9g}, not 1")
    return law


def call_third_party(who: str, method: str, fn: Callable[..., Any], *args: Any) -> Any:
    """``fn(*args)``; any exception but the contract's own becomes a :class:`VerifierError` naming ``who``."""
    try:
        return fn(*args)
    except (VerifierError, InvalidArgument):
        raise
    except Exception as exc:  # a third party's bug: report it, do not crash the run
        raise VerifierError(f"{who}: {method} raised {type(exc).__name__}: {exc}") from exc


# -- adapters and conversions --------------------------------------------------------------------
def check_verify_function(fn: Any) -> None:
    """The function an adapter wraps is callable."""
    if not callable(fn):
        raise InvalidArgument(f"fn: expected a callable verify function, got {type(fn).__name__}")


def adopt_function(
    verifier: Any,
    fn: Callable[..., Any],
    law: Optional[Callable[..., torch.Tensor]],
    *,
    name: Optional[str],
    default_name: str,
    expected: Optional[str],
    guarantees: Any,
    description: str,
) -> None:
    """Check ``expected``, then set what every function adapter keeps of the function it wraps.

    The name defaults to the function's qualified name, the description to the first line of its
    docstring.
    """
    if expected not in (None, "exact", "inexact"):
        raise InvalidArgument(f"expected: must be None, 'exact' or 'inexact', got {expected!r}")
    verifier._fn = fn
    verifier._law = law
    verifier.name = name or getattr(fn, "__qualname__", None) or getattr(fn, "__name__", default_name)
    verifier.expected = expected
    verifier.guarantees = frozenset(guarantees)
    doc = (getattr(fn, "__doc__", None) or "").strip()
    verifier.description = description or (doc.splitlines()[0] if doc else "")


def instantiate(obj: Any) -> Any:
    """``obj()`` when ``obj`` is a class (built with no arguments), else ``obj`` itself."""
    if isinstance(obj, type):
        try:
            return obj()
        except Exception as exc:
            raise InvalidArgument(f"verifier: could not instantiate class {obj.__name__} with no arguments: {exc}") from exc
    return obj


def renamed(verifier: Any, name: Optional[str]) -> Any:
    """``verifier``, renamed to ``name`` when one is given."""
    if name:
        verifier.name = name
    return verifier
