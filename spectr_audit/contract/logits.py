"""Verifiers that take logits and sampling parameters, as engines do.

An engine's verifier is handed the *raw* logits of the draft and the target model and the
requests' :class:`~spectr_audit.contract.sampling.SamplingParams`; it applies the processing
itself (temperature, top-k, top-p, min-p), and every slip there (a parameter applied to one
side only, in another order, skipped on the residual or the bonus draw) is a fidelity bug.
Such a verifier declares ``takes_logits = True`` by deriving from :class:`LogitsVerifier`.

The audit talks to both kinds through one seam: :func:`verify_with_params` and
:func:`output_probs_with_params` hand a logits verifier the raw logits and the parameters,
and any other verifier the probabilities :func:`~spectr_audit.contract.sampling.process_logits`
computes with the audit's processing order.  The law both are held to is that of the
engine's non-speculative sampler with those parameters.

A :class:`LogitsVerifier` still works where probabilities are given (today's audits): its
``verify`` and ``output_probs`` hand it ``log(probs)`` with neutral parameters.

Examples
--------
>>> import torch
>>> from spectr_audit.contract.sampling import SamplingParams, process_logits
>>> def accept_all(draft_tokens, draft_logits, target_logits, params, generator):
...     batch_size, _, draft_len = draft_tokens.shape
...     bonus = process_logits(target_logits[:, 0, -1], params).argmax(-1)
...     return torch.full((batch_size,), draft_len), torch.zeros(batch_size, dtype=torch.int64), bonus
>>> verifier = FunctionLogitsVerifier(accept_all, name="accept-all")
>>> verifier.takes_logits
True
>>> out = verify_with_params(verifier, torch.tensor([[[1]]]), torch.zeros(1, 1, 1, 3),
...                          torch.tensor([[[[0.0, 1.0, 0.0], [3.0, 0.0, 0.0]]]]), SamplingParams(temperature=0.5))
>>> out.emitted(torch.tensor([[[1]]]))
[[1, 0]]
"""

from __future__ import annotations

import math
from typing import Any, Optional, Sequence, Union

import torch

from spectr_audit.contract._checks import (
    call_third_party,
    check_dims,
    check_drafted,
    check_same_device,
    check_shape,
    check_token_range,
    check_token_tensor,
    instantiate,
    renamed,
)
from spectr_audit.contract.randomness import RandomSource
from spectr_audit.contract.sampling import (
    ProcessingOrder,
    SamplingParams,
    _check_logits,
    logits_from_probs,
    process_logits,
    processing_order,
)
from spectr_audit.contract.verifier import (
    SHAPE_ATTRS,
    Verifier,
    VerifyOutput,
    _FunctionAdapter,
    check_output_probs,
    check_verify_inputs,
    check_verify_output,
)
from spectr_audit.errors import InvalidArgument

__all__ = [
    "FunctionLogitsVerifier",
    "LogitsVerifier",
    "as_logits_verifier",
    "check_logits_inputs",
    "output_probs_with_params",
    "takes_logits",
    "verify_with_params",
]

Order = Union[str, Sequence[str], ProcessingOrder]


def takes_logits(verifier: Any) -> bool:
    """Whether ``verifier`` declares that it takes logits and parameters (``takes_logits = True``)."""
    return bool(getattr(verifier, "takes_logits", False))


def check_logits_inputs(
    draft_tokens: torch.Tensor,  # [batch_size, num_drafts, draft_len]
    draft_logits: torch.Tensor,  # [batch_size, num_drafts, draft_len, vocab_size]
    target_logits: torch.Tensor,  # [batch_size, num_drafts, draft_len + 1, vocab_size]
    params: Optional[SamplingParams] = None,
) -> tuple[int, int, int, int]:
    """Validate one verification step given as logits; return ``(B, K, L, V)``.

    Logits may be ``-inf`` (a token that cannot be drawn); NaN, ``+inf`` and rows that are
    ``-inf`` everywhere are refused, as is a drafted token whose draft logit is ``-inf``.

    Raises
    ------
    InvalidArgument
        naming the argument and the problem.
    """
    check_token_tensor("draft_tokens", draft_tokens)
    if draft_tokens.dim() != 3 or draft_tokens.shape[1] < 1 or draft_tokens.shape[2] < 1:
        raise InvalidArgument(
            f"draft_tokens: expected shape [batch_size, num_drafts >= 1, draft_len >= 1], got {tuple(draft_tokens.shape)}"
        )
    batch_size, num_drafts, draft_len = draft_tokens.shape
    for name, logits, length, length_name in (
        ("draft_logits", draft_logits, draft_len, "draft_len"),
        ("target_logits", target_logits, draft_len + 1, "draft_len + 1"),
    ):
        check_dims(name, logits, 4, f"batch_size, num_drafts, {length_name}, vocab_size")
        check_shape(name, logits, (batch_size, num_drafts, length, logits.shape[-1]))
        _check_logits(logits, name)
    vocab_size = draft_logits.shape[-1]
    if target_logits.shape[-1] != vocab_size:
        raise InvalidArgument(
            f"target_logits: vocab_size {target_logits.shape[-1]} differs from draft_logits' {vocab_size}"
        )
    check_same_device(draft_tokens=draft_tokens, draft_logits=draft_logits, target_logits=target_logits)
    if params is not None:
        if not isinstance(params, SamplingParams):
            raise InvalidArgument(f"params: expected SamplingParams, got {type(params).__name__}")
        params.check_batch_size(batch_size)
    if draft_tokens.numel():
        check_token_range(draft_tokens, vocab_size)
        check_drafted(
            draft_tokens,
            draft_logits,
            lambda drafted: drafted == -math.inf,
            "has draft logit -inf, so it cannot have been drafted",
        )
    return batch_size, num_drafts, draft_len, vocab_size


def _check_drafted_support(draft_tokens: torch.Tensor, draft_probs: torch.Tensor, order_name: str) -> None:
    check_drafted(
        draft_tokens,
        draft_probs,
        lambda drafted: drafted <= 0,
        f"has probability 0 under the processed draft law (order {order_name!r}), so it cannot have been drafted",
    )


class LogitsVerifier(Verifier):
    """Base of verifiers that take raw logits and sampling parameters (``takes_logits = True``).

    Subclasses implement ``_verify_logits`` (and ``_output_probs_logits`` when they know their
    exact law) with the signature of :meth:`verify_logits`; the public methods validate once.
    Given probabilities instead (``verify`` / ``output_probs``), the verifier is handed
    ``log(probs)`` and neutral parameters.
    """

    takes_logits = True

    def verify_logits(
        self,
        draft_tokens: torch.Tensor,  # [batch_size, num_drafts, draft_len]
        draft_logits: torch.Tensor,  # [batch_size, num_drafts, draft_len, vocab_size]
        target_logits: torch.Tensor,  # [batch_size, num_drafts, draft_len + 1, vocab_size]
        params: Optional[SamplingParams] = None,
        generator: RandomSource = None,
        *,
        validate: bool = True,
    ) -> VerifyOutput:
        """Verify one step from raw logits and the rows' sampling parameters."""
        params = SamplingParams() if params is None else params
        if validate:
            _, num_drafts, draft_len, _ = check_logits_inputs(draft_tokens, draft_logits, target_logits, params)
            self.check_supports(num_drafts, draft_len)
        return self._verify_logits(draft_tokens, draft_logits, target_logits, params, generator)

    def output_probs_logits(
        self,
        draft_tokens: torch.Tensor,  # [batch_size, num_drafts, draft_len]
        draft_logits: torch.Tensor,  # [batch_size, num_drafts, draft_len, vocab_size]
        target_logits: torch.Tensor,  # [batch_size, num_drafts, draft_len + 1, vocab_size]
        params: Optional[SamplingParams] = None,
        *,
        validate: bool = True,
    ) -> torch.Tensor:  # [batch_size, num_drafts, draft_len + 1, vocab_size] float64
        """Exact law P(draft_index=k, num_accepted=n, next_token=y | drafts, logits, params)."""
        if not self.has_exact_law:
            raise NotImplementedError(f"verifier {self.name!r} has no exact output law")
        params = SamplingParams() if params is None else params
        if validate:
            _, num_drafts, draft_len, _ = check_logits_inputs(draft_tokens, draft_logits, target_logits, params)
        else:
            num_drafts, draft_len = draft_tokens.shape[1], draft_tokens.shape[2]
        self.check_supports(num_drafts, draft_len)
        return self._output_probs_logits(draft_tokens, draft_logits, target_logits, params)

    @property
    def has_exact_law(self) -> bool:
        return type(self)._output_probs_logits is not LogitsVerifier._output_probs_logits

    def standard_entry(self, method: str) -> bool:
        """:meth:`Verifier.standard_entry`, with ``"verify_logits"`` and ``"output_probs_logits"``."""
        if method in ("verify_logits", "output_probs_logits"):
            return getattr(type(self), method) is getattr(LogitsVerifier, method)
        return super().standard_entry(method)

    # -- the probability entry points: log-probabilities, neutral parameters ---------------
    def _verify(self, draft_tokens, draft_probs, target_probs, generator) -> VerifyOutput:
        return self._verify_logits(
            draft_tokens, logits_from_probs(draft_probs), logits_from_probs(target_probs), SamplingParams(), generator
        )

    def _output_probs(self, draft_tokens, draft_probs, target_probs) -> torch.Tensor:
        return self._output_probs_logits(
            draft_tokens, logits_from_probs(draft_probs), logits_from_probs(target_probs), SamplingParams()
        )

    # -- to implement ------------------------------------------------------------------------
    def _verify_logits(self, draft_tokens, draft_logits, target_logits, params, generator) -> VerifyOutput:  # pragma: no cover
        raise NotImplementedError

    def _output_probs_logits(self, draft_tokens, draft_logits, target_logits, params) -> torch.Tensor:  # pragma: no cover
        raise NotImplementedError


class FunctionLogitsVerifier(_FunctionAdapter, LogitsVerifier):
    """Adapter: audit a plain function ``fn(draft_tokens, draft_logits, target_logits, params, generator)``.

    It returns :class:`~spectr_audit.contract.verifier.VerifyOutput` or
    ``(num_accepted, draft_index, next_token)``; ``output_probs``, when given, has the signature
    ``(draft_tokens, draft_logits, target_logits, params)``.  Outputs are validated
    (:class:`VerifierError` on a contract breach); a third party's exception becomes a
    :class:`VerifierError` naming the verifier.
    """

    _checks_law_at_init = True

    def _verify_logits(self, draft_tokens, draft_logits, target_logits, params, generator) -> VerifyOutput:
        batch_size, num_drafts, draft_len = draft_tokens.shape
        raw = call_third_party(self.name, "verify", self._fn, draft_tokens, draft_logits, target_logits, params, generator)
        return check_verify_output(raw, batch_size, num_drafts, draft_len, draft_logits.shape[-1], who=self.name)

    def _output_probs_logits(self, draft_tokens, draft_logits, target_logits, params) -> torch.Tensor:
        batch_size, num_drafts, draft_len = draft_tokens.shape
        law = call_third_party(self.name, "output_probs", self._law, draft_tokens, draft_logits, target_logits, params)
        return check_output_probs(law, batch_size, num_drafts, draft_len, draft_logits.shape[-1], who=self.name)


def as_logits_verifier(obj: Any, name: Optional[str] = None) -> LogitsVerifier:
    """Turn a logits verifier class, instance, object with ``verify_logits``, or function into a :class:`LogitsVerifier`.

    A plain function is taken to have the :class:`FunctionLogitsVerifier` signature.
    """
    obj = instantiate(obj)
    if isinstance(obj, LogitsVerifier):
        return renamed(obj, name)
    method = getattr(obj, "verify_logits", None)
    if callable(method):
        law = getattr(obj, "output_probs_logits", None)
        attrs = ("draft_scheme", *SHAPE_ATTRS, "expected", "guarantees", "description")
        return FunctionLogitsVerifier(
            method,
            name=name or getattr(obj, "name", None) or type(obj).__name__,
            output_probs=law if callable(law) else None,
            **{attr: getattr(obj, attr) for attr in attrs if hasattr(obj, attr)},
        )
    if callable(obj) and not isinstance(obj, Verifier):
        return FunctionLogitsVerifier(obj, name=name)
    raise InvalidArgument(
        f"verifier: expected a LogitsVerifier, an object with verify_logits, or a function; got {type(obj).__name__}"
    )


def verify_with_params(
    verifier: Verifier,
    draft_tokens: torch.Tensor,  # [batch_size, num_drafts, draft_len]
    draft_logits: torch.Tensor,  # [batch_size, num_drafts, draft_len, vocab_size]
    target_logits: torch.Tensor,  # [batch_size, num_drafts, draft_len + 1, vocab_size]
    params: Optional[SamplingParams] = None,
    generator: RandomSource = None,
    *,
    order: Order = "vllm",
    validate: bool = True,
) -> VerifyOutput:
    """Hand one step to ``verifier`` as an engine would see it.

    A logits verifier gets the raw logits and ``params``; any other verifier gets the
    probabilities :func:`process_logits` computes with ``order``.  With ``validate`` the drafted
    tokens must have positive probability under the processed draft law.
    """
    params, probs = _prepared_step(verifier, draft_tokens, draft_logits, target_logits, params, order, validate)
    if probs is None:
        return verifier.verify_logits(draft_tokens, draft_logits, target_logits, params, generator, validate=validate)
    if validate:
        check_verify_inputs(draft_tokens, *probs)
        verifier.check_supports(draft_tokens.shape[1], draft_tokens.shape[2])
    return verifier.verify(draft_tokens, *probs, generator, validate=False)


def output_probs_with_params(
    verifier: Verifier,
    draft_tokens: torch.Tensor,  # [batch_size, num_drafts, draft_len]
    draft_logits: torch.Tensor,  # [batch_size, num_drafts, draft_len, vocab_size]
    target_logits: torch.Tensor,  # [batch_size, num_drafts, draft_len + 1, vocab_size]
    params: Optional[SamplingParams] = None,
    *,
    order: Order = "vllm",
    validate: bool = True,
) -> torch.Tensor:  # [batch_size, num_drafts, draft_len + 1, vocab_size] float64
    """The exact law of ``verifier`` on one step given as logits and parameters (see :func:`verify_with_params`)."""
    params, probs = _prepared_step(verifier, draft_tokens, draft_logits, target_logits, params, order, validate)
    if probs is None:
        return verifier.output_probs_logits(draft_tokens, draft_logits, target_logits, params, validate=validate)
    return verifier.output_probs(draft_tokens, *probs, validate=validate)


def _prepared_step(
    verifier: Verifier,
    draft_tokens: torch.Tensor,  # [batch_size, num_drafts, draft_len]
    draft_logits: torch.Tensor,  # [batch_size, num_drafts, draft_len, vocab_size]
    target_logits: torch.Tensor,  # [batch_size, num_drafts, draft_len + 1, vocab_size]
    params: Optional[SamplingParams],
    order: Order,
    validate: bool,
) -> tuple[SamplingParams, Optional[tuple[torch.Tensor, torch.Tensor]]]:
    """Validate one step given as logits and put it in the form ``verifier`` takes.

    Returns the parameters (neutral ones for ``None``) and, for a verifier that takes
    probabilities, the ``(draft_probs, target_probs)`` :func:`process_logits` computes with
    ``order``; ``None`` in their place for a logits verifier.  With ``validate`` the drafted tokens
    must have positive probability under the processed draft law.
    """
    params = SamplingParams() if params is None else params
    if validate:
        check_logits_inputs(draft_tokens, draft_logits, target_logits, params)
    if takes_logits(verifier):
        if validate:
            _check_drafted_support(draft_tokens, process_logits(draft_logits, params, order), _order_name(order))
        return params, None
    probs = (process_logits(draft_logits, params, order), process_logits(target_logits, params, order))
    if validate:
        _check_drafted_support(draft_tokens, probs[0], _order_name(order))
    return params, probs


def _order_name(order: Order) -> str:
    return processing_order(order).name
