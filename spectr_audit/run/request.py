"""One audit of one verifier on one case, bound once (:class:`AuditRequest`).

:func:`~spectr_audit.run.runner.audit_case` builds it once and hands it to every stage: the
verifier as the audit calls it (under its per-call time limit), the case as the suite wrote it and
its laws, the options, and the case's sampling parameters bound to the verifier and the models.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

from spectr_audit.drafting.processed import bind_params
from spectr_audit.run.options import AuditOptions

__all__ = ["AuditRequest"]


@dataclasses.dataclass(frozen=True)
class AuditRequest:
    """What every stage of one audit reads.

    Attributes
    ----------
    verifier
        The verifier as the audit calls it: converted by the caller, limited per call by the guard.
    case
        The case as the suite wrote it: with sampling parameters, the raw models and ``params`` /
        ``order``.
    options : AuditOptions
    """

    verifier: Any
    case: Any
    options: AuditOptions

    @functools.cached_property
    def laws(self) -> Any:
        """The case with the laws the audit compares against: processed by the sampling parameters when the case
        has them (``case.laws()``), the case itself otherwise.  The bounds, the block LP and the probe read them."""
        return self.case.laws() if hasattr(self.case, "laws") else self.case

    @property
    def params(self) -> Any:
        """The case's sampling parameters (None: the probability path)."""
        return getattr(self.case, "params", None)

    @functools.cached_property
    def sampling(self) -> dict:
        """``params`` and ``order`` for the audits that take the raw models and the parameters (empty without)."""
        return {} if self.params is None else {"params": self.params, "order": self.case.order}

    @functools.cached_property
    def probed(self) -> Any:
        """The verifier as the contract probe calls it: with sampling parameters, one that takes logits is handed
        the raw logits and the parameters on the case's drafts, its probability entry on the probe's synthetic
        ones (:class:`~spectr_audit.drafting.processed.BoundLogitsVerifier`)."""
        if self.params is None:
            return self.verifier
        case = self.case
        return bind_params(self.verifier, case.draft_model, case.target_model, case.params, case.order, case.prefix,
                           foreign_inputs="probabilities")[0]

    @functools.cached_property
    def bound(self) -> tuple:
        """``(verifier, draft_model, target_model)`` for the audits that run the verifier on processed laws (the
        sampler check): with sampling parameters the processed models, and a logits verifier handed the raw
        logits; the verifier and the case's models otherwise."""
        case = self.case
        return bind_params(self.verifier, case.draft_model, case.target_model, self.params,
                           getattr(case, "order", "vllm"), case.prefix)

    def with_options(self, options: AuditOptions) -> "AuditRequest":
        """The same request under other options (after the probe has spent part of a sample budget)."""
        renewed = dataclasses.replace(self, options=options)
        # what is bound does not depend on the options: keep it
        for name in ("laws", "sampling", "probed", "bound"):
            if name in self.__dict__:
                renewed.__dict__[name] = self.__dict__[name]
        return renewed
