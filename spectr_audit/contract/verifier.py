"""The verifier contract: one shape for every verification rule.

Glossary
--------
A verification step sees ``num_drafts`` (K) drafts of ``draft_len`` (L) tokens
each, drafted from the draft model, and the target model's next-token
distributions at every node of that draft tree.  It returns, per row:

* ``num_accepted``: how many draft tokens are kept (the *accepted* tokens);
* ``draft_index``: which draft they are taken from;
* ``next_token``: one more token, sampled by the verifier: a *correction*
  token when a draft position was rejected (``num_accepted < L``), or the
  *bonus* token drawn from the target at the end of a fully accepted draft
  (``num_accepted == L``).

The emitted string is ``draft_tokens[b, draft_index, :num_accepted] + [next_token]``.
It is 1 to L + 1 tokens long.

Canonical draft index: when several drafts share the emitted prefix, built-in
verifiers report the smallest such index, and exact laws (``output_probs``)
use the same convention, so that a sampler and its law can be compared cell
by cell.  Audits compare emitted strings only, never verdict fields alone.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Literal, Optional

import torch

from spectr_audit._validation import LAW_MASS_ATOL, LAW_NEGATIVE_ATOL, SIMPLEX_ATOL, check_simplex
from spectr_audit.errors import InvalidArgument, VerifierError
from spectr_audit.contract.randomness import RandomSource

__all__ = [
    "DRAFT_SCHEMES",
    "DraftScheme",
    "PROB_ATOL",
    "Verifier",
    "FunctionVerifier",
    "VerifyOutput",
    "as_verifier",
    "check_verify_inputs",
    "check_verify_output",
    "check_output_probs",
]

DraftScheme = Literal["iid", "without_replacement"]
DRAFT_SCHEMES: tuple[str, ...] = ("iid", "without_replacement")

#: Tolerance on ``|sum(probs) - 1|`` for float32/float64 inputs: the one simplex tolerance,
#: :data:`spectr_audit._validation.SIMPLEX_ATOL`.  Half-precision inputs get it widened to their
#: rounding (:func:`spectr_audit._validation.simplex_atol`).
PROB_ATOL = SIMPLEX_ATOL

Expected = Optional[Literal["exact", "inexact"]]


@dataclasses.dataclass(frozen=True)
class VerifyOutput:
    """What one verification step decided, per batch row.

    Attributes
    ----------
    num_accepted : torch.Tensor
        ``[batch_size]`` int64, in ``[0, draft_len]``.
    draft_index : torch.Tensor
        ``[batch_size]`` int64, in ``[0, num_drafts)``.
    next_token : torch.Tensor
        ``[batch_size]`` int64, in ``[0, vocab_size)``: the correction or bonus token.
    correction : object, optional
        A carried correction for verifiers that repair the *next* iteration's
        target (see :mod:`spectr_audit.contract.correction`); ``None`` for ordinary verifiers.
    """

    # [batch_size]
    num_accepted: torch.Tensor
    # [batch_size]
    draft_index: torch.Tensor
    # [batch_size]
    next_token: torch.Tensor
    correction: Any = None

    def emitted(self, draft_tokens: torch.Tensor) -> list[list[int]]:
        """The emitted strings, as Python lists (for reports and small tests)."""
        out = []
        for b in range(draft_tokens.shape[0]):
            k = int(self.draft_index[b])
            n = int(self.num_accepted[b])
            out.append(draft_tokens[b, k, :n].tolist() + [int(self.next_token[b])])
        return out


def _check_probs(name: str, probs: torch.Tensor, expected_shape: tuple[int, ...]) -> None:
    if not isinstance(probs, torch.Tensor):
        raise InvalidArgument(f"{name}: expected a torch.Tensor, got {type(probs).__name__}")
    if not probs.is_floating_point():
        raise InvalidArgument(f"{name}: expected a floating-point tensor, got dtype {probs.dtype}")
    if tuple(probs.shape) != tuple(expected_shape):
        raise InvalidArgument(f"{name}: expected shape {tuple(expected_shape)}, got {tuple(probs.shape)}")
    check_simplex(name, probs)


def _normalised64(probs: torch.Tensor) -> torch.Tensor:
    probs = probs.double()
    return probs / probs.sum(-1, keepdim=True)


def check_verify_inputs(
    draft_tokens: torch.Tensor,
    draft_probs: torch.Tensor,
    target_probs: torch.Tensor,
) -> tuple[int, int, int, int]:
    """Validate one verification step's inputs; return ``(B, K, L, V)``.

    Raises
    ------
    InvalidArgument
        naming the argument and the problem: shapes, dtypes, non-finite or
        negative probabilities, rows off the simplex, token ids out of range,
        or a drafted token that has zero draft probability.
    """
    if not isinstance(draft_tokens, torch.Tensor):
        raise InvalidArgument(f"draft_tokens: expected a torch.Tensor, got {type(draft_tokens).__name__}")
    if draft_tokens.dtype != torch.int64:
        raise InvalidArgument(f"draft_tokens: expected dtype torch.int64, got {draft_tokens.dtype}")
    if draft_tokens.dim() != 3:
        raise InvalidArgument(
            f"draft_tokens: expected shape [batch_size, num_drafts, draft_len], got {tuple(draft_tokens.shape)}"
        )
    batch_size, num_drafts, draft_len = draft_tokens.shape
    if num_drafts < 1:
        raise InvalidArgument(f"draft_tokens: num_drafts must be >= 1, got shape {tuple(draft_tokens.shape)}")
    if draft_len < 1:
        raise InvalidArgument(f"draft_tokens: draft_len must be >= 1, got shape {tuple(draft_tokens.shape)}")
    if not isinstance(draft_probs, torch.Tensor) or draft_probs.dim() != 4:
        shape = tuple(draft_probs.shape) if isinstance(draft_probs, torch.Tensor) else type(draft_probs).__name__
        raise InvalidArgument(
            f"draft_probs: expected shape [batch_size, num_drafts, draft_len, vocab_size], got {shape}"
        )
    vocab_size = draft_probs.shape[-1]
    if vocab_size < 1:
        raise InvalidArgument("draft_probs: vocab_size must be >= 1")
    _check_probs("draft_probs", draft_probs, (batch_size, num_drafts, draft_len, vocab_size))
    _check_probs("target_probs", target_probs, (batch_size, num_drafts, draft_len + 1, vocab_size))
    if draft_probs.device != draft_tokens.device or target_probs.device != draft_tokens.device:
        raise InvalidArgument(
            f"draft_tokens, draft_probs, target_probs: must share one device, got "
            f"{draft_tokens.device}, {draft_probs.device}, {target_probs.device}"
        )
    if draft_tokens.numel() == 0:
        return batch_size, num_drafts, draft_len, vocab_size
    out_of_range = (draft_tokens < 0) | (draft_tokens >= vocab_size)
    if bool(out_of_range.any()):
        bad = out_of_range.nonzero()[0].tolist()
        raise InvalidArgument(
            f"draft_tokens: token ids must lie in [0, {vocab_size}); found {draft_tokens[tuple(bad)].item()} "
            f"at index {tuple(bad)}"
        )
    drafted_mass = draft_probs.gather(-1, draft_tokens.unsqueeze(-1)).squeeze(-1)
    zero = drafted_mass <= 0
    if bool(zero.any()):
        bad = zero.nonzero()[0].tolist()
        raise InvalidArgument(
            f"draft_tokens: token {draft_tokens[tuple(bad)].item()} at index {tuple(bad)} has zero draft "
            f"probability, so it cannot have been drafted from draft_probs"
        )
    return batch_size, num_drafts, draft_len, vocab_size


def _within(value: torch.Tensor, lo: int, hi: int) -> bool:
    """Every entry of a non-empty integer tensor in ``[lo, hi]``: one ``aminmax`` pass, one host read."""
    bounds = torch.stack(torch.aminmax(value)).tolist()
    return lo <= bounds[0] and bounds[1] <= hi


def check_verify_output(
    output: Any, batch_size: int, num_drafts: int, draft_len: int, vocab_size: int, who: str = "verifier"
) -> VerifyOutput:
    """Validate what a (possibly third-party) verifier returned; normalise it to :class:`VerifyOutput`.

    Accepts a :class:`VerifyOutput` or a 3-tuple ``(num_accepted, draft_index, next_token)``.
    Raises :class:`VerifierError` naming the field and the problem.
    """
    if isinstance(output, VerifyOutput):
        fields = (output.num_accepted, output.draft_index, output.next_token)
        correction = output.correction
    elif isinstance(output, (tuple, list)) and len(output) == 3:
        fields = tuple(output)
        correction = None
    else:
        raise VerifierError(
            f"{who}: verify must return VerifyOutput or (num_accepted, draft_index, next_token); "
            f"got {type(output).__name__}"
        )
    names = ("num_accepted", "draft_index", "next_token")
    bounds = ((0, draft_len), (0, num_drafts - 1), (0, vocab_size - 1))
    checked = []
    for name, value, (lo, hi) in zip(names, fields, bounds):
        if not isinstance(value, torch.Tensor):
            raise VerifierError(f"{who}: {name} must be a torch.Tensor, got {type(value).__name__}")
        if value.dtype != torch.int64:
            raise VerifierError(f"{who}: {name} must have dtype torch.int64, got {value.dtype}")
        if tuple(value.shape) != (batch_size,):
            raise VerifierError(f"{who}: {name} must have shape [{batch_size}], got {tuple(value.shape)}")
        if value.numel() and not _within(value, lo, hi):
            bad = ((value < lo) | (value > hi)).nonzero()[0].item()
            raise VerifierError(f"{who}: {name}[{bad}] = {value[bad].item()} is outside [{lo}, {hi}]")
        checked.append(value)
    return VerifyOutput(*checked, correction=correction)


def check_output_probs(
    output_probs: Any, batch_size: int, num_drafts: int, draft_len: int, vocab_size: int, who: str = "verifier"
) -> torch.Tensor:
    """Validate an exact law returned by ``output_probs``: shape, finiteness, sign, total mass 1."""
    expected = (batch_size, num_drafts, draft_len + 1, vocab_size)
    if not isinstance(output_probs, torch.Tensor) or not output_probs.is_floating_point():
        raise VerifierError(f"{who}: output_probs must return a floating-point torch.Tensor")
    if tuple(output_probs.shape) != expected:
        raise VerifierError(f"{who}: output_probs must have shape {expected}, got {tuple(output_probs.shape)}")
    if output_probs.numel() == 0:
        return output_probs
    low, high = torch.aminmax(output_probs)  # one pass: NaN propagates into both, inf shows in one
    if not bool(torch.isfinite(low) & torch.isfinite(high)):
        raise VerifierError(f"{who}: output_probs contains NaN or Inf")
    if bool(low < -LAW_NEGATIVE_ATOL):
        raise VerifierError(f"{who}: output_probs contains negative probabilities (min {low.item():.3g})")
    totals = (output_probs if output_probs.dtype == torch.float64 else output_probs.double()).sum((1, 2, 3))
    if batch_size and bool(((totals - 1).abs() > LAW_MASS_ATOL).any()):
        bad = ((totals - 1).abs() > LAW_MASS_ATOL).nonzero()[0].item()
        raise VerifierError(f"{who}: output_probs row {bad} sums to {totals[bad].item():.9g}, not 1")
    return output_probs


class Verifier:
    """Base class of verifiers: one required method, ``_verify``.

    Subclasses set the class attributes below and implement ``_verify`` (and
    ``_output_probs`` when they know their exact law).  The public ``verify``
    and ``output_probs`` validate inputs once, at this boundary.

    Class attributes
    ----------------
    name : str
        Short name used by the CLI and reports.
    draft_scheme : {"iid", "without_replacement"}
        How the drafts must be drawn for the verifier to be exact.
    min_drafts, max_drafts, min_draft_len, max_draft_len : int or None
        The (K, L) the verifier supports; ``None`` means unbounded.
    expected : {"exact", "inexact"} or None
        A declared verdict (like a strict xfail): a published rule under audit
        or a lossy-by-design mode.  Reports keep the measured verdict; only a
        verdict that differs from its declaration fails a run.
    guarantees : frozenset of str
        Optimality claims the audit should check: ``"spectr"`` for
        acceptance >= (1 - (1 - 1/K)^K) alpha*, ``"optimal"`` for acceptance = alpha*.
    takes_logits : bool
        ``False`` (this base): ``verify`` takes processed probabilities.  ``True`` for a
        :class:`spectr_audit.contract.logits.LogitsVerifier`, which takes raw draft and target
        logits and :class:`~spectr_audit.contract.sampling.SamplingParams`, as engines do.
    """

    name: str = ""
    description: str = ""
    draft_scheme: DraftScheme = "iid"
    min_drafts: int = 1
    max_drafts: Optional[int] = None
    min_draft_len: int = 1
    max_draft_len: Optional[int] = None
    expected: Expected = None
    guarantees: frozenset = frozenset()
    takes_logits: bool = False

    # -- public, validated -------------------------------------------------
    def verify(
        self,
        draft_tokens: torch.Tensor,  # [batch_size, num_drafts, draft_len]
        draft_probs: torch.Tensor,  # [batch_size, num_drafts, draft_len, vocab_size]
        target_probs: torch.Tensor,  # [batch_size, num_drafts, draft_len + 1, vocab_size]
        generator: RandomSource = None,
        *,
        validate: bool = True,
    ) -> VerifyOutput:
        """Verify one step; see the module docstring for the meaning of the outputs.

        ``validate=False`` skips the input checks (several passes over the probabilities);
        use it only in a hot loop whose inputs are already known to be valid.
        """
        if validate:
            _, num_drafts, draft_len, _ = check_verify_inputs(draft_tokens, draft_probs, target_probs)
            self.check_supports(num_drafts, draft_len)
        return self._verify(draft_tokens, draft_probs, target_probs, generator)

    def output_probs(
        self,
        draft_tokens: torch.Tensor,  # [batch_size, num_drafts, draft_len]
        draft_probs: torch.Tensor,  # [batch_size, num_drafts, draft_len, vocab_size]
        target_probs: torch.Tensor,  # [batch_size, num_drafts, draft_len + 1, vocab_size]
        *,
        validate: bool = True,
    ) -> torch.Tensor:  # [batch_size, num_drafts, draft_len + 1, vocab_size]
        """Exact law P(draft_index=k, num_accepted=n, next_token=y | drafts), float64.

        ``validate=False`` skips the input checks; the exact audit uses it after validating the
        conditionals its enumerated draft tuples are built from, once.
        """
        if not self.has_exact_law:
            raise NotImplementedError(f"verifier {self.name!r} has no exact output law")
        if validate:
            _, num_drafts, draft_len, _ = check_verify_inputs(draft_tokens, draft_probs, target_probs)
        else:
            num_drafts, draft_len = draft_tokens.shape[1], draft_tokens.shape[2]
        self.check_supports(num_drafts, draft_len)
        # Exact laws are computed in float64 on rows renormalised to sum to 1 (inputs are on the
        # simplex only within a tolerance, e.g. half-precision rounding).
        return self._output_probs(draft_tokens, _normalised64(draft_probs), _normalised64(target_probs))

    @property
    def has_exact_law(self) -> bool:
        """Whether ``output_probs`` is available."""
        return type(self)._output_probs is not Verifier._output_probs

    def supports(self, num_drafts: int, draft_len: int) -> bool:
        """Whether the verifier accepts K = ``num_drafts`` and L = ``draft_len``."""
        return (
            num_drafts >= self.min_drafts
            and (self.max_drafts is None or num_drafts <= self.max_drafts)
            and draft_len >= self.min_draft_len
            and (self.max_draft_len is None or draft_len <= self.max_draft_len)
        )

    def check_supports(self, num_drafts: int, draft_len: int) -> None:
        """Raise :class:`InvalidArgument` when (K, L) is outside what the verifier supports."""
        if not self.supports(num_drafts, draft_len):
            raise InvalidArgument(
                f"draft_tokens: verifier {self.name!r} supports num_drafts in {self.drafts_range()} and "
                f"draft_len in {self.draft_len_range()}; got num_drafts={num_drafts}, draft_len={draft_len}"
            )

    def drafts_range(self) -> str:
        """Human-readable range of supported K."""
        return _range_str(self.min_drafts, self.max_drafts)

    def draft_len_range(self) -> str:
        """Human-readable range of supported L."""
        return _range_str(self.min_draft_len, self.max_draft_len)

    # -- to implement ------------------------------------------------------
    def _verify(self, draft_tokens, draft_probs, target_probs, generator) -> VerifyOutput:  # pragma: no cover
        raise NotImplementedError

    def _output_probs(self, draft_tokens, draft_probs, target_probs) -> torch.Tensor:  # pragma: no cover
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name!r}>"


def _range_str(lo: int, hi: Optional[int]) -> str:
    return f"[{lo}, {hi}]" if hi is not None else f"[{lo}, inf)"


class FunctionVerifier(Verifier):
    """Adapter: audit a third party's plain function, or any object with a ``verify`` method.

    The wrapped callable receives ``(draft_tokens, draft_probs, target_probs, generator)``
    and returns ``VerifyOutput`` or ``(num_accepted, draft_index, next_token)``.  Its
    output is validated (shape, dtype, range), raising :class:`VerifierError` on a
    contract breach.

    Examples
    --------
    >>> import torch
    >>> def always_reject(draft_tokens, draft_probs, target_probs, generator):
    ...     b = draft_tokens.shape[0]
    ...     tok = target_probs[:, 0, 0].argmax(-1)
    ...     z = torch.zeros(b, dtype=torch.int64)
    ...     return z, z, tok
    >>> v = FunctionVerifier(always_reject, name="always_reject")
    >>> v.has_exact_law
    False
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

    def _verify(self, draft_tokens, draft_probs, target_probs, generator) -> VerifyOutput:
        batch_size, num_drafts, draft_len = draft_tokens.shape
        try:
            raw = self._fn(draft_tokens, draft_probs, target_probs, generator)
        except (VerifierError, InvalidArgument):
            raise
        except Exception as exc:  # a third party's bug: report it, do not crash the run
            raise VerifierError(f"{self.name}: verify raised {type(exc).__name__}: {exc}") from exc
        return check_verify_output(raw, batch_size, num_drafts, draft_len, draft_probs.shape[-1], who=self.name)

    def _output_probs(self, draft_tokens, draft_probs, target_probs) -> torch.Tensor:
        batch_size, num_drafts, draft_len = draft_tokens.shape
        try:
            law = self._law(draft_tokens, draft_probs, target_probs)
        except (VerifierError, InvalidArgument):
            raise
        except Exception as exc:
            raise VerifierError(f"{self.name}: output_probs raised {type(exc).__name__}: {exc}") from exc
        return check_output_probs(law, batch_size, num_drafts, draft_len, draft_probs.shape[-1], who=self.name)


_PASSTHROUGH_ATTRS = (
    "draft_scheme",
    "min_drafts",
    "max_drafts",
    "min_draft_len",
    "max_draft_len",
    "expected",
    "guarantees",
    "description",
)


def as_verifier(obj: Any, name: Optional[str] = None) -> Verifier:
    """Turn a verifier class, instance, or plain function into a :class:`Verifier`.

    * a :class:`Verifier` instance is returned as it is (renamed if ``name`` is given);
    * a class is instantiated with no arguments, then converted;
    * an object with a ``verify`` method is wrapped, keeping its ``output_probs``
      and the contract attributes it declares;
    * an object or function that declares ``takes_logits = True``, or has a ``verify_logits``
      method, goes through :func:`~spectr_audit.contract.logits.as_logits_verifier`;
    * a plain callable of the ``verify`` signature is wrapped by :class:`FunctionVerifier`.
    """
    if isinstance(obj, type):
        try:
            obj = obj()
        except Exception as exc:
            raise InvalidArgument(f"verifier: could not instantiate class {obj.__name__} with no arguments: {exc}") from exc
    if isinstance(obj, Verifier):
        if name:
            obj.name = name
        return obj
    if getattr(obj, "takes_logits", False) or callable(getattr(obj, "verify_logits", None)):
        # it takes raw logits and sampling parameters (docs/sampling.md)
        from spectr_audit.contract.logits import as_logits_verifier

        return as_logits_verifier(obj, name=name)
    if hasattr(obj, "verify") and callable(obj.verify):
        kwargs = {attr: getattr(obj, attr) for attr in _PASSTHROUGH_ATTRS if hasattr(obj, attr)}
        law = getattr(obj, "output_probs", None)
        wrapped = FunctionVerifier(
            obj.verify,
            name=name or getattr(obj, "name", None) or type(obj).__name__,
            output_probs=law if callable(law) else None,
            **kwargs,
        )
        if callable(getattr(obj, "carried_correction", None)):
            # verifiers that repair the next iteration are judged by the multi-iteration audit
            wrapped.carried_correction = obj.carried_correction
        return wrapped
    if callable(obj):
        return FunctionVerifier(obj, name=name)
    raise InvalidArgument(
        f"verifier: expected a Verifier, a class, an object with a verify method, or a function; "
        f"got {type(obj).__name__}"
    )
