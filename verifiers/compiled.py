"""Opt-in fused kernels (``torch.compile``) for the samplers' hottest passes.

Eager PyTorch on a CPU pays a full memory pass, and often a fresh allocation, for every
elementwise operation, so a verifier built from a dozen of them cannot come near one read of
its inputs.  ``torch.compile`` fuses such a chain into one loop (C++ on a CPU, Triton on a
GPU).  It is off by default: the first call compiles for several seconds (cached on disk
afterwards), and it needs a working C++ compiler or Triton.  Turn it on with the environment
variable ``SPECTR_AUDIT_COMPILE=1`` or :func:`use_compiled`; if compiling fails the eager code
runs and a warning says why, once.

Every fused kernel here has an eager twin that the tests compare it with; the samplers'
results do not depend on which one ran beyond float32 rounding.
"""

from __future__ import annotations

import os
import warnings
from typing import Callable, Optional

import torch

from spectr_audit.verifiers import triton_kernels

__all__ = ["compiled_enabled", "kseq_beta", "kseq_excess", "kseq_low_sums", "use_compiled"]

_enabled: Optional[bool] = None
_cache: dict[str, Callable] = {}
_failed: set[str] = set()


def use_compiled(enabled: bool = True) -> None:
    """Turn the fused kernels on or off for this process (overrides ``SPECTR_AUDIT_COMPILE``)."""
    global _enabled
    _enabled = bool(enabled)


def compiled_enabled() -> bool:
    """Whether the fused kernels are in use (``use_compiled``, else ``SPECTR_AUDIT_COMPILE=1``)."""
    if _enabled is not None:
        return _enabled
    return os.environ.get("SPECTR_AUDIT_COMPILE", "").strip().lower() in ("1", "true", "yes", "on")


def _run(name: str, eager: Callable, *args):
    """``torch.compile(eager)(*args)``, compiled once per process; the eager function if compiling fails."""
    if name in _failed:
        return eager(*args)
    fn = _cache.get(name)
    if fn is None:
        fn = _cache[name] = torch.compile(eager, dynamic=True)
    try:
        return fn(*args)
    except Exception as error:  # a missing compiler, an unsupported backend: fall back, say so once
        _failed.add(name)
        warnings.warn(f"spectr_audit.verifiers.compiled: {name} runs eagerly, torch.compile failed: {error}", RuntimeWarning)
        return eager(*args)


#: The eager pass (the Triton kernels' twin, defined beside them).
_kseq_low_sums_eager = triton_kernels.kseq_low_sums_eager


def kseq_low_sums(draft: torch.Tensor, target: torch.Tensor, thresholds: torch.Tensor) -> torch.Tensor:
    """One pass of the sort-free rho* solve, fused: ``[n, 2, C]`` float64 low sums of p and q at ``C`` candidates per row.

    A token is "low" at candidate c when ``q <= c p`` and ``p > 0`` (ratio ``q/p <= c``).  Where the
    Triton kernels are on (CUDA, :mod:`spectr_audit.verifiers.triton_kernels`) their one-read pass runs
    instead of ``torch.compile``'s.
    """
    if triton_kernels.triton_enabled(draft.device):
        return triton_kernels.kseq_low_sums(draft, target, thresholds)
    return _run("kseq_low_sums", _kseq_low_sums_eager, draft, target, thresholds)


def _kseq_beta_eager(draft: torch.Tensor, target: torch.Tensor, rho: torch.Tensor) -> torch.Tensor:  # [n, 1]
    return torch.minimum(draft, target / rho).sum(-1, keepdim=True)


def _kseq_excess_eager(draft: torch.Tensor, target: torch.Tensor, rho: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return (target - scale * torch.minimum(draft, target / rho)).clamp(min=0)  # [n, V]


def kseq_beta(draft: torch.Tensor, target: torch.Tensor, rho: torch.Tensor) -> torch.Tensor:
    """K-SEQ's ``beta = sum_x min(p(x), q(x) / rho)`` per row (``rho``: ``[n, 1]``), fused into one pass."""
    return _run("kseq_beta", _kseq_beta_eager, draft, target, rho)


def kseq_excess(draft: torch.Tensor, target: torch.Tensor, rho: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """K-SEQ's unnormalised residual ``(q - scale min(p, q / rho))_+``, ``[n, V]``, in one pass."""
    return _run("kseq_excess", _kseq_excess_eager, draft, target, rho, scale)
