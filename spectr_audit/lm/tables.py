"""The real-LM suite's tables: rows of numbers, stored in a report as ``meta["real_lm"]``.

The rows are plain records (``nan`` where a value was not measured); the reports
(:mod:`spectr_audit.reports.markdown`, :mod:`spectr_audit.reports.html`,
:mod:`spectr_audit.reports.figures`) render them from :meth:`RealLMTables.to_dict`, the only
form they see.
"""

from __future__ import annotations

import dataclasses
import math

__all__ = ["AcceptanceRow", "BlockEfficiencyRow", "FidelityRow", "RealLMTables"]


@dataclasses.dataclass(frozen=True)
class AcceptanceRow:
    """Token-level acceptance at one K, averaged over the contexts (``nan`` where not run)."""

    num_drafts: int
    #: mean alpha* over the contexts
    optimal: float
    #: mean SpecTr bound (1 - (1 - 1/K)^K) alpha*
    spectr_bound: float
    #: mean (1 - 1/e) alpha*
    e_bound: float
    #: single-draft acceptance sum_x min(p, q) (independent of K)
    single_draft: float
    #: K-SEQ's closed-form P_A at rho*
    kseq_closed_form: float
    #: K-SEQ measured (Rao-Blackwellised; on the first ``kseq_rb_contexts`` contexts), with its alpha* there
    kseq_measured: float
    kseq_measured_half_width: float
    kseq_optimal_same_contexts: float
    #: recursive rejection sampling measured (Rao-Blackwellised)
    rrs_measured: float
    rrs_measured_half_width: float
    num_contexts: int


@dataclasses.dataclass(frozen=True)
class BlockEfficiencyRow:
    """Block efficiency of one (method, K, L): emitted tokens per iteration (one target call)."""

    method: str
    verifier: str
    num_drafts: int
    draft_len: int
    block_efficiency: float
    ci_low: float
    ci_high: float
    num_iterations: int
    num_rows: int
    seconds: float


@dataclasses.dataclass(frozen=True)
class FidelityRow:
    """First-token fidelity of one verifier configuration at V = 49,152."""

    verifier: str
    level: str  # "token" or "sequence"
    num_drafts: int
    draft_len: int
    num_samples: int
    sampled_pvalue: float
    #: smallest TV on the ratio cells the sampled test detects with the suite's power, at ``test_alpha``
    sampled_min_detectable_tv: float
    rb_pvalue: float
    rb_tv_partition: float
    rb_l2sq: float
    rb_l2sq_se: float
    #: ratio cells of the sampled test after pooling
    num_cells: int = 0
    #: level the verdict applies to the sampled test (the false-alarm rate over the result's Holm family)
    test_alpha: float = math.nan
    #: False for a verifier declared inexact: its numbers are reported, not judged
    judged: bool = True


@dataclasses.dataclass(frozen=True)
class RealLMTables:
    """The suite's tables: block efficiency (method, K, L), acceptance against K, first-token fidelity."""

    block_efficiency: tuple = ()
    acceptance: tuple = ()
    fidelity: tuple = ()
    partition: str = ""
    setup: str = ""
    #: false-alarm rate of one result and the power its minimum detectable TVs are stated at
    alpha: float = math.nan
    power: float = math.nan

    def to_dict(self) -> dict:
        """Plain values (rows as dicts; ``nan`` stays until the JSON writer makes it null)."""
        return {
            "setup": self.setup,
            "partition": self.partition,
            "alpha": self.alpha,
            "power": self.power,
            "block_efficiency": [dataclasses.asdict(r) for r in self.block_efficiency],
            "acceptance": [dataclasses.asdict(r) for r in self.acceptance],
            "fidelity": [dataclasses.asdict(r) for r in self.fidelity],
        }
