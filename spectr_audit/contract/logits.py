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
from typing import Any, Callable, Optional, Sequence, Union

import torch

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
    DRAFT_SCHEMES,
    DraftScheme,
    Expected,
    Verifier,
    VerifyOutput,
    check_output_probs,
    check_verify_inputs,
    check_verify_output,
)
from spectr_audit.errors import InvalidArgument, VerifierError

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
    if not isinstance(draft_tokens, torch.Tensor):
        raise InvalidArgument(f"draft_tokens: expected a torch.Tensor, got {type(draft_tokens).__name__}")
    if draft_tokens.dtype != torch.int64:
        raise InvalidArgument(f"draft_tokens: expected dtype torch.int64, got {draft_tokens.dtype}")
    if draft_tokens.dim() != 3 or draft_tokens.shape[1] < 1 or draft_tokens.shape[2] < 1:
        raise InvalidArgument(
            f"draft_tokens: expected shape [batch_size, num_drafts >= 1, draft_len >= 1], got {tuple(draft_tokens.shape)}"
        )
    batch_size, num_drafts, draft_len = draft_tokens.shape
    for name, logits, length in (("draft_logits", draft_logits, draft_len), ("target_logits", target_logits, draft_len + 1)):
        if not isinstance(logits, torch.Tensor) or logits.dim() != 4:
            shape = tuple(logits.shape) if isinstance(logits, torch.Tensor) else type(logits).__name__
            raise InvalidArgument(f"{name}: expected shape [batch_size, num_drafts, {'draft_len' if length == draft_len else 'draft_len + 1'}, vocab_size], got {shape}")
        expected = (batch_size, num_drafts, length, logits.shape[-1])
        if tuple(logits.shape) != expected:
            raise InvalidArgument(f"{name}: expected shape {expected}, got {tuple(logits.shape)}")
        _check_logits(logits, name)
    vocab_size = draft_logits.shape[-1]
    if target_logits.shape[-1] != vocab_size:
        raise InvalidArgument(
            f"target_logits: vocab_size {target_logits.shape[-1]} differs from draft_logits' {vocab_size}"
        )
    if draft_logits.device != draft_tokens.device or target_logits.device != draft_tokens.device:
        raise InvalidArgument(
            f"draft_tokens, draft_logits, target_logits: must share one device, got "
            f"{draft_tokens.device}, {draft_logits.device}, {target_logits.device}"
        )
    if params is not None:
        if not isinstance(params, SamplingParams):
            raise InvalidArgument(f"params: expected SamplingParams, got {type(params).__name__}")
        params.check_batch_size(batch_size)
    if draft_tokens.numel():
        out_of_range = (draft_tokens < 0) | (draft_tokens >= vocab_size)
        if bool(out_of_range.any()):
            bad = tuple(out_of_range.nonzero()[0].tolist())
            raise InvalidArgument(
                f"draft_tokens: token ids must lie in [0, {vocab_size}); found {draft_tokens[bad].item()} at index {bad}"
            )
        drafted = draft_logits.gather(-1, draft_tokens.unsqueeze(-1)).squeeze(-1)
        impossible = drafted == -math.inf
        if bool(impossible.any()):
            bad = tuple(impossible.nonzero()[0].tolist())
            raise InvalidArgument(
                f"draft_tokens: token {draft_tokens[bad].item()} at index {bad} has draft logit -inf, so it "
                f"cannot have been drafted"
            )
    return batch_size, num_drafts, draft_len, vocab_size


def _check_drafted_support(draft_tokens: torch.Tensor, draft_probs: torch.Tensor, order_name: str) -> None:
    drafted = draft_probs.gather(-1, draft_tokens.unsqueeze(-1)).squeeze(-1)
    zero = drafted <= 0
    if bool(zero.any()):
        bad = tuple(zero.nonzero()[0].tolist())
        raise InvalidArgument(
            f"draft_tokens: token {draft_tokens[bad].item()} at index {bad} has probability 0 under the processed "
            f"draft law (order {order_name!r}), so it cannot have been drafted"
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


class FunctionLogitsVerifier(LogitsVerifier):
    """Adapter: audit a plain function ``fn(draft_tokens, draft_logits, target_logits, params, generator)``.

    It returns :class:`~spectr_audit.contract.verifier.VerifyOutput` or
    ``(num_accepted, draft_index, next_token)``; ``output_probs``, when given, has the signature
    ``(draft_tokens, draft_logits, target_logits, params)``.  Outputs are validated
    (:class:`VerifierError` on a contract breach); a third party's exception becomes a
    :class:`VerifierError` naming the verifier.
    """

    def __init__(
        self,
        fn: Callable[..., Any],
        *,
        name: Optional[str] = None,
        output_probs: Optional[Callable[..., torch.Tensor]] = None,
        draft_scheme: DraftScheme = "iid",
        min_drafts: int = 1,
        max_drafts: Optional[int] = None,
        min_draft_len: int = 1,
        max_draft_len: Optional[int] = None,
        expected: Expected = None,
        guarantees: frozenset = frozenset(),
        description: str = "",
    ):
        if not callable(fn):
            raise InvalidArgument(f"fn: expected a callable verify function, got {type(fn).__name__}")
        if output_probs is not None and not callable(output_probs):
            raise InvalidArgument(f"output_probs: expected a callable or None, got {type(output_probs).__name__}")
        if draft_scheme not in DRAFT_SCHEMES:
            raise InvalidArgument(f"draft_scheme: expected one of {DRAFT_SCHEMES}, got {draft_scheme!r}")
        if expected not in (None, "exact", "inexact"):
            raise InvalidArgument(f"expected: must be None, 'exact' or 'inexact', got {expected!r}")
        self._fn = fn
        self._law = output_probs
        self.name = name or getattr(fn, "__qualname__", None) or getattr(fn, "__name__", "verifier")
        self.draft_scheme = draft_scheme
        self.min_drafts, self.max_drafts = min_drafts, max_drafts
        self.min_draft_len, self.max_draft_len = min_draft_len, max_draft_len
        self.expected = expected
        self.guarantees = frozenset(guarantees)
        doc = (getattr(fn, "__doc__", None) or "").strip()
        self.description = description or (doc.splitlines()[0] if doc else "")

    @property
    def has_exact_law(self) -> bool:
        return self._law is not None

    def _verify_logits(self, draft_tokens, draft_logits, target_logits, params, generator) -> VerifyOutput:
        batch_size, num_drafts, draft_len = draft_tokens.shape
        try:
            raw = self._fn(draft_tokens, draft_logits, target_logits, params, generator)
        except (VerifierError, InvalidArgument):
            raise
        except Exception as exc:  # a third party's bug: report it, do not crash the run
            raise VerifierError(f"{self.name}: verify raised {type(exc).__name__}: {exc}") from exc
        return check_verify_output(raw, batch_size, num_drafts, draft_len, draft_logits.shape[-1], who=self.name)

    def _output_probs_logits(self, draft_tokens, draft_logits, target_logits, params) -> torch.Tensor:
        batch_size, num_drafts, draft_len = draft_tokens.shape
        try:
            law = self._law(draft_tokens, draft_logits, target_logits, params)
        except (VerifierError, InvalidArgument):
            raise
        except Exception as exc:
            raise VerifierError(f"{self.name}: output_probs raised {type(exc).__name__}: {exc}") from exc
        return check_output_probs(law, batch_size, num_drafts, draft_len, draft_logits.shape[-1], who=self.name)


def as_logits_verifier(obj: Any, name: Optional[str] = None) -> LogitsVerifier:
    """Turn a logits verifier class, instance, object with ``verify_logits``, or function into a :class:`LogitsVerifier`.

    A plain function is taken to have the :class:`FunctionLogitsVerifier` signature.
    """
    if isinstance(obj, type):
        try:
            obj = obj()
        except Exception as exc:
            raise InvalidArgument(f"verifier: could not instantiate class {obj.__name__} with no arguments: {exc}") from exc
    if isinstance(obj, LogitsVerifier):
        if name:
            obj.name = name
        return obj
    method = getattr(obj, "verify_logits", None)
    if callable(method):
        law = getattr(obj, "output_probs_logits", None)
        attrs = ("draft_scheme", "min_drafts", "max_drafts", "min_draft_len", "max_draft_len", "expected",
                 "guarantees", "description")
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
    params = SamplingParams() if params is None else params
    if validate:
        check_logits_inputs(draft_tokens, draft_logits, target_logits, params)
    if takes_logits(verifier):
        if validate:
            _check_drafted_support(draft_tokens, process_logits(draft_logits, params, order), _order_name(order))
        return verifier.verify_logits(draft_tokens, draft_logits, target_logits, params, generator, validate=validate)
    draft_probs = process_logits(draft_logits, params, order)
    target_probs = process_logits(target_logits, params, order)
    if validate:
        _check_drafted_support(draft_tokens, draft_probs, _order_name(order))
        check_verify_inputs(draft_tokens, draft_probs, target_probs)
    return verifier.verify(draft_tokens, draft_probs, target_probs, generator, validate=False)


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
    params = SamplingParams() if params is None else params
    if validate:
        check_logits_inputs(draft_tokens, draft_logits, target_logits, params)
    if takes_logits(verifier):
        if validate:
            _check_drafted_support(draft_tokens, process_logits(draft_logits, params, order), _order_name(order))
        return verifier.output_probs_logits(draft_tokens, draft_logits, target_logits, params, validate=validate)
    draft_probs = process_logits(draft_logits, params, order)
    target_probs = process_logits(target_logits, params, order)
    if validate:
        _check_drafted_support(draft_tokens, draft_probs, _order_name(order))
    return verifier.output_probs(draft_tokens, draft_probs, target_probs, validate=validate)


def _order_name(order: Order) -> str:
    return processing_order(order).name
