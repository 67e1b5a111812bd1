"""The options of an audit run that are not part of a case (:class:`AuditOptions`).

A leaf of the run package: the runner, the memory budget and the conformance check read them.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

from spectr_audit import defaults

__all__ = ["AuditOptions"]


@dataclasses.dataclass(frozen=True)
class AuditOptions:
    """Knobs of a run that are not part of a case."""

    seed: int = defaults.SEED
    #: Statistical audits: false-alarm rate, and caps on samples / seconds.
    alpha: float = defaults.ALPHA
    max_samples: Optional[int] = None
    max_seconds: Optional[float] = None
    min_detectable_tv: float = defaults.MIN_DETECTABLE_TV
    power: float = defaults.POWER
    #: Sample cap of the sampler-versus-exact-law check of verifiers with ``output_probs``.
    sampler_max_samples: Optional[int] = defaults.SAMPLER_MAX_SAMPLES
    device: str = "cpu"
    #: Certify TV <= this on every result (``--certify-tv``): black boxes by the statistical audit's
    #: anytime-valid upper bound on the partition, verifiers with an exact law by their exact TV.
    certify_tv: Optional[float] = None
    #: Memory budget in bytes (or a size such as ``"4GiB"``); ``None``: a fraction of the machine's
    #: memory (:func:`spectr_audit.run.budget.default_max_memory`).  Audits over it are refused.
    max_memory: Optional[int] = None
    #: Seconds one verifier call may take before it becomes an error result (``None``: no limit);
    #: see :mod:`spectr_audit.run.guard` for the mechanism and its limits.
    verifier_timeout: Optional[float] = defaults.VERIFIER_TIMEOUT
