"""The statistical audit's validate stage (private): its own arguments, after the shared ones.

:func:`with_params` binds sampling parameters to the verifier and the models before anything is
validated; :func:`validate_audit` checks what :func:`spectr_audit.statistical.audit.statistical_audit`
takes beyond :func:`spectr_audit.statistical._stages.validate_common` and returns the
:class:`AuditArgs` every later stage reads.
"""

from __future__ import annotations

import dataclasses
from typing import Optional, Union

from spectr_audit._validation import check_positive_int
from spectr_audit.contract.logits import as_logits_verifier, takes_logits
from spectr_audit.drafting.processed import bind_params
from spectr_audit.errors import InvalidArgument
from spectr_audit.statistical._stages import CommonArgs
from spectr_audit.statistical.sharding import current_shards


@dataclasses.dataclass(frozen=True)
class AuditArgs(CommonArgs):
    """The audit's validated arguments: those shared with the sampler-vs-law check, then its own."""

    num_tokens: int
    stratify: Union[bool, str]
    sequential: bool
    claimed_acceptance: Optional[float]
    claimed_block_efficiency: Optional[float]
    max_cells: int
    max_strata: int
    #: certify TV(F, q) <= certify_tv on the partition (None: no certification)
    certify_tv: Optional[float] = None
    #: the torch.distributed processes the chunks are spread over (None: this process)
    shards: Optional[object] = None

    @property
    def tv_confidence(self) -> float:
        """Level of the TV interval and of the certificate: ``1 - alpha``, the audit's error rate."""
        return 1.0 - self.alpha

    @property
    def one_iteration(self) -> bool:
        """Whether the completed strings are one iteration's (``N = L + 1``): acceptance is measured."""
        return self.num_tokens == self.draft_len + 1


def validate_audit(common: CommonArgs, num_tokens, stratify, sequential, claimed_acceptance, claimed_block_efficiency,
                   max_cells, max_strata, certify_tv=None, distributed="auto") -> AuditArgs:
    """Validate stage: the audit's own arguments, after the shared ones."""
    draft_len = common.draft_len
    num_tokens = draft_len + 1 if num_tokens is None else check_positive_int("num_tokens", num_tokens, False)
    if num_tokens < draft_len + 1:
        raise InvalidArgument(f"num_tokens: must be >= draft_len + 1 = {draft_len + 1}, got {num_tokens}")
    if common.tree is not None and num_tokens != draft_len + 1:
        raise InvalidArgument(f"num_tokens: a tree audit samples one step, max_depth + 1 = {draft_len + 1} tokens; "
                              f"got {num_tokens}")
    if stratify not in (True, False, "auto"):
        raise InvalidArgument(f"stratify: expected True, False or 'auto', got {stratify!r}")
    if claimed_acceptance is not None and not 0 <= claimed_acceptance <= 1:
        raise InvalidArgument(f"claimed_acceptance: expected a number in [0, 1], got {claimed_acceptance!r}")
    if claimed_block_efficiency is not None and not 1 <= claimed_block_efficiency <= draft_len + 1:
        raise InvalidArgument(
            f"claimed_block_efficiency: expected a number in [1, {draft_len + 1}], got {claimed_block_efficiency!r}")
    if certify_tv is not None and (isinstance(certify_tv, bool) or not isinstance(certify_tv, (int, float))
                                   or not 0 < certify_tv < 1):
        raise InvalidArgument(f"certify_tv: expected a number in (0, 1), got {certify_tv!r}")
    if not (isinstance(distributed, bool) or distributed == "auto" or hasattr(distributed, "rank")):
        raise InvalidArgument(f"distributed: expected 'auto', True, False or a process group, got {distributed!r}")
    return AuditArgs(**vars(common), num_tokens=num_tokens, stratify=stratify, sequential=sequential,
                     claimed_acceptance=claimed_acceptance, claimed_block_efficiency=claimed_block_efficiency,
                     max_cells=max_cells, max_strata=max_strata,
                     certify_tv=None if certify_tv is None else float(certify_tv),
                     shards=current_shards(distributed))


def with_params(verifier, draft_model, target_model, params, order, prefix, num_tokens, draft_len, tree):
    """The verifier and models to audit with sampling parameters (:func:`spectr_audit.drafting.processed.bind_params`)."""
    if takes_logits(verifier) or callable(getattr(verifier, "verify_logits", None)):
        if tree is not None:
            raise InvalidArgument("params: a verifier that takes logits verifies chains; a tree audit hands "
                                  "processed probabilities to tree verifiers")
        if num_tokens is not None and num_tokens != draft_len + 1:
            raise InvalidArgument(f"num_tokens: a verifier that takes logits is audited for one iteration "
                                  f"(num_tokens = draft_len + 1 = {draft_len + 1}) by the statistical audit; the exact "
                                  f"multi-iteration audit takes it over more, got {num_tokens}")
        verifier = as_logits_verifier(verifier)
    return bind_params(verifier, draft_model, target_model, params, order, prefix)
