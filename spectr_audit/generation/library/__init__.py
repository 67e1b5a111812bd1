"""Generation loops to audit: a correct one over a small model pair, and planted slips with their ground truth.

* :mod:`.toy`: :class:`ToyLM` (context-, cache- and position-dependent), :class:`ToyPair` (target,
  draft, sampling parameters, scorers, reference) and :class:`SpecEngine`, a correct batched
  speculative loop;
* :mod:`.slips`: one override of the correct loop per slip real engines shipped (:data:`SLIPS`);
* :mod:`.serving`: :class:`ServingSpecEngine`, the correct loop with a serving engine's prefix cache,
  chunked prefill, preemption and staggered arrivals, and the slips shipped in them (:data:`SERVING_SLIPS`).
"""

from __future__ import annotations

from spectr_audit.errors import InvalidArgument
from spectr_audit.generation.library.serving import (
    PREEMPTION_KV_BUDGET,
    SERVING_SLIPS,
    SERVING_STATS,
    ServingSlip,
    ServingSpecEngine,
    serving_engine,
)
from spectr_audit.generation.library.slips import SLIP_PROMPTS, SLIPS, Slip, audit_slip
from spectr_audit.generation.library.toy import SpecEngine, ToyLM, ToyPair, ToyState

__all__ = ["PREEMPTION_KV_BUDGET", "SERVING_SLIPS", "SERVING_STATS", "SLIPS", "SLIP_PROMPTS",
           "ServingSlip", "ServingSpecEngine", "Slip", "SpecEngine", "ToyLM", "ToyPair", "ToyState", "audit_slip",
           "correct_engine", "serving_engine", "slip_engine"]


def correct_engine(pair: ToyPair, draft_len: int = 3) -> SpecEngine:
    """The correct speculative loop over ``pair``."""
    return SpecEngine(pair, draft_len)


def slip_engine(name: str, pair: ToyPair, draft_len: int = 3) -> SpecEngine:
    """The loop with the planted slip ``name`` (a key of :data:`SLIPS`)."""
    if name not in SLIPS:
        raise InvalidArgument(f"name: expected one of {sorted(SLIPS)}, got {name!r}")
    return SLIPS[name].engine(pair, draft_len)
