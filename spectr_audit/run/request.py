"""One audit of one verifier on one case, bound once (:class:`AuditRequest`).

:func:`~spectr_audit.run.runner.audit_case` builds it once and hands it to every stage: the
verifier as the audit calls it (under its per-call time limit), the case as the suite wrote it and
its laws, the options, and, once for every stage that runs the verifier on one step, the case's
sampling parameters bound to the verifier and the models (:attr:`AuditRequest.bound`).
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
        The verifier as the audit calls it: converted by the caller, limited per call by the guard
        (:func:`~spectr_audit.run.guard.time_limited`).
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
        """``params`` and ``order`` for the audits that take the raw models and the parameters (the multi-iteration
        audit, which binds each iteration's context itself; empty without)."""
        return {} if self.params is None else {"params": self.params, "order": self.case.order}

    @functools.cached_property
    def bound(self) -> tuple:
        """``(verifier, draft_model, target_model)`` for the stages that run the verifier on one step of processed
        laws (the probe, the exact audit, the sampler check), bound once: with sampling parameters the processed
        models, and a verifier that takes logits as a
        :class:`~spectr_audit.drafting.processed.BoundLogitsVerifier` handed the raw logits on the case's drafts
        and its probability entry on other inputs (the probe's synthetic ones); the verifier and the case's models
        otherwise."""
        case = self.case
        if self.params is None:
            return self.verifier, case.draft_model, case.target_model
        return bind_params(self.verifier, case.draft_model, case.target_model, self.params, case.order, case.prefix,
                           foreign_inputs="probabilities")

    @property
    def probed(self) -> Any:
        """The verifier as the contract probe calls it: the bound one (:attr:`bound`)."""
        return self.bound[0]

    def with_options(self, options: AuditOptions) -> "AuditRequest":
        """The same request under other options (after the probe has spent part of a sample budget)."""
        renewed = dataclasses.replace(self, options=options)
        # what is bound does not depend on the options: keep it
        for name in ("laws", "sampling", "bound"):
            if name in self.__dict__:
                renewed.__dict__[name] = self.__dict__[name]
        return renewed
