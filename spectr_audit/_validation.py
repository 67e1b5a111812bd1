"""Input validation shared by every boundary: probability rows, probability vectors, numbers.

One simplex tolerance, :data:`SIMPLEX_ATOL`, for every probability an audit is given: the
verifier contract (``check_verify_inputs``), the alpha* bounds, the models and suite files, the
command line.  Half-precision rows get it widened to their rounding (:func:`simplex_atol`).
Every error is an :class:`~spectr_audit.errors.InvalidArgument` whose message starts with the
name of the argument.

A leaf module, like :mod:`spectr_audit.errors`: it imports only that, numpy and torch, so the
contract may use it.

Examples
--------
>>> import torch
>>> check_simplex("draft_probs", torch.tensor([[0.5, 0.5], [0.6, 0.6]]))
Traceback (most recent call last):
...
spectr_audit.errors.InvalidArgument: draft_probs: each distribution must sum to 1 within 1.0e-04; the row at index (1,) sums to 1.2
"""

from __future__ import annotations

import math
from typing import Any, Optional

import numpy as np
import torch

from spectr_audit._arguments import check_int_at_least, check_number, check_positive_int, check_prob
from spectr_audit.errors import InvalidArgument

__all__ = [
    "SIMPLEX_ATOL",
    "LAW_MASS_ATOL",
    "LAW_NEGATIVE_ATOL",
    "as_distribution",
    "as_float64",
    "check_int_at_least",
    "check_number",
    "check_positive_int",
    "check_prob",
    "check_simplex",
    "simplex_atol",
]

#: Tolerance on ``|sum(row) - 1|`` of every probability row an audit is given (float32 and
#: float64; half precision widens it, see :func:`simplex_atol`).  Rows inside it are accepted and
#: renormalised in float64 wherever exact arithmetic follows (exact laws, bounds, models).
SIMPLEX_ATOL = 1e-4
#: Tolerance on the total mass of an exact law returned by a verifier's ``output_probs``.  Not an
#: input tolerance: laws are computed in float64 from renormalised rows, so a larger error is a
#: bug of the law, not rounding.
LAW_MASS_ATOL = 1e-6
#: The most negative float64 rounding residue an exact law may hold in one cell.
LAW_NEGATIVE_ATOL = 1e-12


def simplex_atol(dtype: torch.dtype, vocab_size: int) -> float:
    """The row-sum tolerance for rows of ``dtype`` and length ``vocab_size``.

    :data:`SIMPLEX_ATOL`, widened for float16 and bfloat16, whose rounding of V entries sums to
    about ``eps * sqrt(V)``.

    Examples
    --------
    >>> simplex_atol(torch.float32, 50_000)
    0.0001
    >>> simplex_atol(torch.bfloat16, 50_000) > 1
    True
    """
    if dtype in (torch.float16, torch.bfloat16):
        eps = torch.finfo(dtype).eps
        return max(SIMPLEX_ATOL, 4 * eps * math.sqrt(vocab_size) + eps)
    return SIMPLEX_ATOL


def check_simplex(
    name: str,
    probs: torch.Tensor,  # [..., vocab_size]
    atol: Optional[float] = None,
    *,
    index_name: str = "index",
) -> None:
    """Finite, non-negative rows (last dimension) that sum to 1 within ``atol``.

    Parameters
    ----------
    name : str
        The argument, first word of every message.
    probs : torch.Tensor
        Floating point, ``[..., vocab_size]``.
    atol : float, optional
        Default: :func:`simplex_atol` of the tensor's dtype and last dimension.
    index_name : str
        How messages name the index of an offending row (``"index"``, ``"batch index"``).

    Raises
    ------
    InvalidArgument
        Naming the argument, the problem and the first offending entry or row.
    """
    if probs.numel() == 0:
        return
    if atol is None:
        atol = simplex_atol(probs.dtype, probs.shape[-1])
    # One pass finds the extremes (NaN propagates into them, inf and negatives show up there); the
    # offending index is located only when something is wrong.
    low, high = torch.aminmax(probs)
    if not bool(torch.isfinite(low) & torch.isfinite(high)):
        bad = tuple((~torch.isfinite(probs)).nonzero()[0].tolist())
        raise InvalidArgument(f"{name}: probabilities must be finite; found {probs[bad].item()} at index {bad}")
    if bool(low < 0):
        bad = tuple((probs < 0).nonzero()[0].tolist())
        raise InvalidArgument(
            f"{name}: probabilities must be non-negative; found {probs[bad].item():.3g} at index {bad}"
        )
    # Row sums in the rows' own precision for float32/float64 (a float64 copy of every row would cost
    # more than a verifier; float32's cascade summation is accurate to ~1e-7, far inside the tolerance),
    # half precision in float32.
    sums = (probs if probs.dtype in (torch.float32, torch.float64) else probs.float()).sum(-1).double()
    off = (sums - 1).abs() > atol
    if bool(off.any()):
        bad = tuple(off.nonzero()[0].tolist())
        raise InvalidArgument(
            f"{name}: each distribution must sum to 1 within {atol:.1e}; the row at {index_name} {bad} "
            f"sums to {sums[bad].item():.6g}"
        )


def as_float64(name: str, probs: Any) -> tuple[torch.Tensor, float]:
    """A tensor, array or nested list of rows as float64 torch (same device for torch input).

    Also returns the row-sum tolerance of the input's own dtype (half-precision input keeps its
    wider tolerance after the conversion).  Checks the type and that there is a last dimension of
    size >= 1; the values are checked by :func:`check_simplex`.
    """
    if isinstance(probs, torch.Tensor):
        if not probs.is_floating_point():
            raise InvalidArgument(f"{name}: expected a floating-point tensor, got dtype {probs.dtype}")
        dtype = probs.dtype
        tensor = probs.detach().to(torch.float64)
    else:
        try:
            array = np.asarray(probs, dtype=np.float64)
        except (TypeError, ValueError) as exc:
            raise InvalidArgument(
                f"{name}: expected a torch tensor, numpy array or nested list of floats, "
                f"got {type(probs).__name__} ({exc})"
            ) from None
        dtype = torch.float64
        tensor = torch.as_tensor(array)
    if tensor.dim() == 0:
        raise InvalidArgument(f"{name}: expected shape [..., vocab_size], got a scalar")
    if tensor.shape[-1] == 0:
        raise InvalidArgument(f"{name}: vocab_size must be >= 1, got shape {tuple(tensor.shape)}")
    return tensor, simplex_atol(dtype, tensor.shape[-1])


def as_distribution(values: Any, argument: str, vocab_size: Optional[int] = None,
                    atol: Optional[float] = None) -> torch.Tensor:  # [vocab_size]
    """Validate one probability vector (list, numpy or torch); return it float64, renormalised.

    ``atol`` defaults to :data:`SIMPLEX_ATOL`.  Messages list the values (a user typed them).

    Examples
    --------
    >>> as_distribution([0.6, 0.4], "draft").tolist()
    [0.6, 0.4]
    >>> as_distribution([0.6, 0.5], "draft")
    Traceback (most recent call last):
    ...
    spectr_audit.errors.InvalidArgument: draft: probabilities must sum to 1 (within 0.0001), got sum 1.1
    """
    atol = SIMPLEX_ATOL if atol is None else atol
    try:
        tensor = torch.as_tensor(np.asarray(values, dtype=np.float64) if not isinstance(values, torch.Tensor) else values)
    except (TypeError, ValueError) as exc:
        raise InvalidArgument(f"{argument}: expected a sequence of probabilities, got {values!r}") from exc
    tensor = tensor.to(torch.float64)
    if tensor.dim() != 1 or tensor.numel() == 0:
        raise InvalidArgument(f"{argument}: expected a non-empty 1-D probability vector, got shape {tuple(tensor.shape)}")
    if vocab_size is not None and tensor.numel() != vocab_size:
        raise InvalidArgument(f"{argument}: expected {vocab_size} probabilities, got {tensor.numel()}")
    if not bool(torch.isfinite(tensor).all()):
        raise InvalidArgument(f"{argument}: probabilities must be finite, got {tensor.tolist()}")
    if bool((tensor < 0).any()):
        raise InvalidArgument(f"{argument}: probabilities must be non-negative, got {tensor.tolist()}")
    total = float(tensor.sum())
    if abs(total - 1) > atol:
        raise InvalidArgument(f"{argument}: probabilities must sum to 1 (within {atol:g}), got sum {total:.9g}")
    return tensor / total


