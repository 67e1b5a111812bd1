"""Broken verifiers that take logits and sampling parameters: each one slip in the processing.

Engines verify from raw logits and the requests' sampling parameters, and many fidelity bugs
live in that processing rather than in the acceptance rule.  Each verifier here is
single-draft speculative sampling (K = 1, any L) that processes the logits itself, with one
slip; each has an exact law, so the audit's verdict comes with the exact TV distance
(``tests/verifiers/test_sampling_bugs.py``, against an independent oracle).  The laws are
those of :func:`spectr_audit.contract.sampling.process_logits` with the verifier's ``order``
(vLLM's by default); ``raw`` below is the plain softmax of the logits.

============================  =====================================================================
name                          the slip
============================  =====================================================================
logits-speculative            none: the correct control (both sides processed, every draw)
params-draft-only             the parameters reach the draft but not the target: the acceptance,
                              the residual and the bonus use the raw target
params-target-only            the verifier's draft probabilities are raw, while the drafts were
                              drawn from the processed draft law
top-p-before-temperature      the target is processed with top-p first, before temperature
bonus-unprocessed             the bonus token is drawn from the raw target
residual-unprocessed          the residual is (raw target - draft)_+, the acceptance is right
top-p-unrenormalised-target   top-p masks the target without renormalising it (the draft side is
                              renormalised): the acceptance ratio uses the unnormalised masses
============================  =====================================================================

Exact TVs at L = 1 (V = 6; draft logits (1.2, 0.3, -0.5, 0.9, -1.4, 0.1), target logits
(0.2, 1.1, 0.4, -0.8, 0.6, -0.3), the same at every node; vLLM's order).  The test holds the
table for L = 1 and 2 and recomputes every entry with the oracle; 0 means the setting cannot
reach the slip (no binding top-p, or under greedy decoding no draft is ever accepted):

============================  =======  =======  =======  ============  ===================  ======
name                          T 0.6    top-k 3  top-p .8  T .6, p .8   T .7 k5 p.75 m.05    greedy
============================  =======  =======  =======  ============  ===================  ======
params-draft-only             0.1331   0.3286   0.1778   0.3099        0.3159               0.6559
params-target-only            0.0439   0.0637   0.0581   0.0490        0.0496               0
top-p-before-temperature      0        0        0        0.1271        0.1481               0
bonus-unprocessed             0.0410   0.0523   0.0444   0.0337        0.0396               0
residual-unprocessed          0.0912   0.1111   0.0175   0.1667        0.1365               0.5999
top-p-unrenormalised-target   0        0        0.0325   0.0127        0.0178               0
============================  =======  =======  =======  ============  ===================  ======

Every rule's residual falls back to its own (normalised) target row when ``(target - draft)_+``
has no mass, as the reference verifiers do.
"""

from __future__ import annotations

import dataclasses
import importlib
from typing import Optional, Sequence, Union

import torch

from spectr_audit.contract.logits import LogitsVerifier
from spectr_audit.contract.sampling import ProcessingOrder, SamplingParams, process_logits, processing_order
from spectr_audit.errors import InvalidArgument
from spectr_audit.verifiers._walk import normalise
from spectr_audit.verifiers.library._chain import chain_law, chain_sample

__all__ = [
    "SAMPLING_BUG_VERIFIERS",
    "BonusUnprocessed",
    "LogitsSpeculativeSampling",
    "ParamsDraftOnly",
    "ParamsTargetOnly",
    "ResidualUnprocessed",
    "TopPBeforeTemperature",
    "TopPUnrenormalisedTarget",
    "load_sampling_bug",
    "sampling_bug_names",
]

_MODULE = "spectr_audit.verifiers.library.sampling_bugs"

#: Short name -> "module:Class" of every broken logits verifier (each ``expected = "inexact"``).
SAMPLING_BUG_VERIFIERS: dict[str, str] = {
    "params-draft-only": f"{_MODULE}:ParamsDraftOnly",
    "params-target-only": f"{_MODULE}:ParamsTargetOnly",
    "top-p-before-temperature": f"{_MODULE}:TopPBeforeTemperature",
    "bonus-unprocessed": f"{_MODULE}:BonusUnprocessed",
    "residual-unprocessed": f"{_MODULE}:ResidualUnprocessed",
    "top-p-unrenormalised-target": f"{_MODULE}:TopPUnrenormalisedTarget",
}


def sampling_bug_names() -> list[str]:
    """Short names of the broken logits verifiers, in library order."""
    return list(SAMPLING_BUG_VERIFIERS)


def load_sampling_bug(name: str, **kwargs) -> LogitsVerifier:
    """A fresh instance of the broken logits verifier called ``name`` (``order=`` may be given)."""
    spec = SAMPLING_BUG_VERIFIERS.get(name)
    if spec is None:
        raise InvalidArgument(f"name: unknown sampling bug {name!r}; known: {', '.join(SAMPLING_BUG_VERIFIERS)}")
    module, _, attr = spec.partition(":")
    return getattr(importlib.import_module(module), attr)(**kwargs)


class LogitsSpeculativeSampling(LogitsVerifier):
    """Single-draft speculative sampling from raw logits and sampling parameters (K = 1, any L).

    Processes draft and target logits with ``order`` (:func:`process_logits`), then runs the
    maximal coupling token by token: accept ``x`` with ``min(1, q(x) / p(x))``; at the first
    rejection draw from ``(q - p)_+`` normalised; after a full accept draw the bonus from ``q``.
    Subclasses change what feeds the coupling, one slip each: the draft law
    (:meth:`_draft_law`), the target law (:meth:`_target_law`), or one of the five laws of
    :meth:`_laws`.

    Examples
    --------
    >>> import torch
    >>> from spectr_audit.contract.sampling import SamplingParams
    >>> verifier = LogitsSpeculativeSampling()
    >>> draft_logits = torch.tensor([[[[1.0, 0.0, -1.0]]]])
    >>> target_logits = torch.tensor([[[[0.0, 1.0, -1.0], [0.0, 0.0, 0.0]]]])
    >>> law = verifier.output_probs_logits(torch.tensor([[[0]]]), draft_logits, target_logits,
    ...                                    SamplingParams(top_k=1))
    >>> law[0, 0, 0].tolist()   # top-k 1: the draft is token 0, the target token 1: always rejected
    [0.0, 1.0, 0.0]
    """

    name = "logits-speculative"
    description = "speculative sampling from logits and sampling parameters (both sides processed)"
    max_drafts = 1
    guarantees = frozenset({"optimal"})

    def __init__(self, order: Union[str, Sequence[str], ProcessingOrder] = "vllm"):
        self.order = processing_order(order)

    # -- the laws each draw uses: [B, L, V] x 4 and the bonus [B, V] --------------------------
    def _process(self, logits: torch.Tensor, params: SamplingParams, steps: Optional[Sequence[str]] = None):
        order = self.order if steps is None else self.order.with_steps(steps)
        return process_logits(logits, params, order)

    def _raw(self, logits: torch.Tensor) -> torch.Tensor:
        return process_logits(logits, None, self.order)  # neutral parameters: the plain softmax

    def _draft_law(self, draft_logits, params):  # [B, L, V]: the law the verifier takes the drafts from
        return self._process(draft_logits, params)

    def _target_law(self, target_logits, params):  # [B, L + 1, V]
        return self._process(target_logits, params)

    def _laws(self, draft_logits, target_logits, params):
        """Draft and target laws of the acceptance, of the residual, and the bonus law."""
        draft = self._draft_law(draft_logits, params)
        target = self._target_law(target_logits, params)
        draft_len = draft.shape[1]
        return draft, target[:, :draft_len], draft, target[:, :draft_len], target[:, draft_len]

    def _acceptance(self, draft_tokens, draft_logits, target_logits, params):
        accept_draft, accept_target, residual_draft, residual_target, bonus = self._laws(
            draft_logits[:, 0], target_logits[:, 0], params
        )
        tokens = draft_tokens[:, 0].unsqueeze(-1)  # [B, L, 1]
        drafted = accept_draft.gather(-1, tokens).squeeze(-1)
        targeted = accept_target.gather(-1, tokens).squeeze(-1)
        ratio = targeted / torch.where(drafted > 0, drafted, torch.ones_like(drafted))
        # a drafted token the rule itself gives no draft mass: accepted when the target has mass
        accept = torch.where(drafted > 0, ratio.clamp(max=1.0), (targeted > 0).to(ratio.dtype))
        fallback = residual_target / residual_target.sum(-1, keepdim=True)
        residual = normalise((residual_target - residual_draft).clamp(min=0), fallback)
        bonus = bonus / bonus.sum(-1, keepdim=True)
        return accept, residual, bonus  # [B, L], [B, L, V], [B, V]

    def _output_probs_logits(self, draft_tokens, draft_logits, target_logits, params):
        return chain_law(*self._acceptance(draft_tokens, draft_logits, target_logits, params))

    def _verify_logits(self, draft_tokens, draft_logits, target_logits, params, generator):
        return chain_sample(*self._acceptance(draft_tokens, draft_logits, target_logits, params), generator)


class _ProcessingSlip(LogitsSpeculativeSampling):
    """A slip in the processing: declared inexact, with no optimality claim."""

    expected = "inexact"
    guarantees = frozenset()


class ParamsDraftOnly(_ProcessingSlip):
    """The sampling parameters are applied to the draft only: the target side uses the raw softmax."""

    name = "params-draft-only"
    description = "BROKEN: sampling parameters applied to the draft but not the target"

    def _target_law(self, target_logits, params):
        return self._raw(target_logits)  # the slip: no sampling parameters


class ParamsTargetOnly(_ProcessingSlip):
    """The verifier's draft probabilities are the raw softmax, though the drafts were drawn with the parameters."""

    name = "params-target-only"
    description = "BROKEN: draft probabilities computed without the sampling parameters"

    def _draft_law(self, draft_logits, params):
        return self._raw(draft_logits)  # the slip: no sampling parameters


class TopPBeforeTemperature(_ProcessingSlip):
    """The target is processed with top-p first, on the unscaled logits, then temperature and the rest."""

    name = "top-p-before-temperature"
    description = "BROKEN: target top-p applied before temperature"

    def _target_law(self, target_logits, params):
        steps = ("top_p",) + tuple(s for s in self.order.steps if s != "top_p")  # the slip: top-p moved first
        return self._process(target_logits, params, steps)


class BonusUnprocessed(_ProcessingSlip):
    """The bonus token is drawn from the raw target softmax, without the sampling parameters."""

    name = "bonus-unprocessed"
    description = "BROKEN: bonus token drawn without the sampling parameters"

    def _laws(self, draft_logits, target_logits, params):
        draft, accept_target, residual_draft, residual_target, _ = super()._laws(draft_logits, target_logits, params)
        return draft, accept_target, residual_draft, residual_target, self._raw(target_logits[:, -1])  # the slip


class ResidualUnprocessed(_ProcessingSlip):
    """The residual is built from the raw target, ``(softmax(target) - draft)_+``; the acceptance is right."""

    name = "residual-unprocessed"
    description = "BROKEN: residual built from the target without the sampling parameters"

    def _laws(self, draft_logits, target_logits, params):
        draft, accept_target, residual_draft, _, bonus = super()._laws(draft_logits, target_logits, params)
        raw = self._raw(target_logits[:, : draft.shape[1]])  # the slip: the residual's target unprocessed
        return draft, accept_target, residual_draft, raw, bonus


class TopPUnrenormalisedTarget(_ProcessingSlip):
    """Top-p masks the target without renormalising it; the draft side is renormalised."""

    name = "top-p-unrenormalised-target"
    description = "BROKEN: target top-p mask without renormalisation"

    def _target_law(self, target_logits, params):
        processed = self._process(target_logits, params)
        before = self._process(target_logits, dataclasses.replace(params, top_p=1.0))  # every step but top-p
        return torch.where(processed > 0, before, torch.zeros_like(before))  # the slip: masked, not renormalised
