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

from spectr_audit._validation import SIMPLEX_ATOL
from spectr_audit.errors import InvalidArgument, VerifierError
from spectr_audit.contract._checks import (
    adopt_function,
    call_third_party,
    check_dims,
    check_drafted,
    check_law,
    check_output_field,
    check_probs,
    check_same_device,
    check_token_range,
    check_token_tensor,
    check_verify_function,
)
from spectr_audit.contract.randomness import RandomSource

__all__ = [
    "DRAFT_SCHEMES",
    "DraftScheme",
    "PROB_ATOL",
    "Verifier",
    "FunctionVerifier",
    "VerifyOutput",
    "check_verify_inputs",
    "check_verify_output",
    "check_output_probs",
    "SHAPE_ATTRS",
    "declared_values",
]

DraftScheme = Literal["iid", "without_replacement"]
DRAFT_SCHEMES: tuple[str, ...] = ("iid", "without_replacement")

#: Tolerance on ``|sum(probs) - 1|`` for float32/float64 inputs: the one simplex tolerance,
#: :data:`spectr_audit._validation.SIMPLEX_ATOL`.  Half-precision inputs get it widened to their
#: rounding (:func:`spectr_audit._validation.simplex_atol`).
PROB_ATOL = SIMPLEX_ATOL

Expected = Optional[Literal["exact", "inexact"]]

#: The attributes that say which (K, L) a verifier supports: the bounds, and the exact values
#: (``num_drafts`` / ``draft_len``: an int, a list or a ``range``).  Every wrapper copies all six.
SHAPE_ATTRS = ("min_drafts", "max_drafts", "min_draft_len", "max_draft_len", "num_drafts", "draft_len")


def declared_values(value: Any, where: str) -> Optional[tuple]:
    """The exact K or L values a verifier declares (``num_drafts`` / ``draft_len``), sorted; ``None`` for none.

    ``value`` is ``None``, a positive integer, or a non-empty list, tuple, set or ``range`` of them.

    Examples
    --------
    >>> declared_values(3, "draft_len"), declared_values(range(1, 4), "draft_len"), declared_values(None, "x")
    ((3,), (1, 2, 3), None)
    >>> declared_values([2, 0], "MyVerifier.num_drafts")
    Traceback (most recent call last):
    ...
    spectr_audit.errors.InvalidArgument: MyVerifier.num_drafts: expected a positive integer, or a list or range of them, got [2, 0]
    """
    if value is None:
        return None
    values = [value] if isinstance(value, int) else (list(value) if isinstance(value, (list, tuple, set, frozenset,
                                                                                           range)) else None)
    if not values or not all(isinstance(v, int) and not isinstance(v, bool) and v >= 1 for v in values):
        raise InvalidArgument(f"{where}: expected a positive integer, or a list or range of them, got {value!r}")
    return tuple(sorted(set(values)))


def _values_text(values: tuple) -> str:
    """``{1, 2, 3}`` as ``[1, 3]`` when contiguous (with more than two values), else the set."""
    if len(values) > 2 and values[-1] - values[0] == len(values) - 1:
        return f"[{values[0]}, {values[-1]}]"
    return "{" + ", ".join(map(str, values)) + "}"


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
    check_token_tensor("draft_tokens", draft_tokens)
    if draft_tokens.dim() != 3:
        raise InvalidArgument(
            f"draft_tokens: expected shape [batch_size, num_drafts, draft_len], got {tuple(draft_tokens.shape)}"
        )
    batch_size, num_drafts, draft_len = draft_tokens.shape
    if num_drafts < 1:
        raise InvalidArgument(f"draft_tokens: num_drafts must be >= 1, got shape {tuple(draft_tokens.shape)}")
    if draft_len < 1:
        raise InvalidArgument(f"draft_tokens: draft_len must be >= 1, got shape {tuple(draft_tokens.shape)}")
    check_dims("draft_probs", draft_probs, 4, "batch_size, num_drafts, draft_len, vocab_size")
    vocab_size = draft_probs.shape[-1]
    if vocab_size < 1:
        raise InvalidArgument("draft_probs: vocab_size must be >= 1")
    check_probs("draft_probs", draft_probs, (batch_size, num_drafts, draft_len, vocab_size))
    check_probs("target_probs", target_probs, (batch_size, num_drafts, draft_len + 1, vocab_size))
    check_same_device(draft_tokens=draft_tokens, draft_probs=draft_probs, target_probs=target_probs)
    if draft_tokens.numel() == 0:
        return batch_size, num_drafts, draft_len, vocab_size
    check_token_range(draft_tokens, vocab_size)
    check_drafted(
        draft_tokens,
        draft_probs,
        lambda drafted_mass: drafted_mass <= 0,
        "has zero draft probability, so it cannot have been drafted from draft_probs",
    )
    return batch_size, num_drafts, draft_len, vocab_size


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
    checked = [
        check_output_field(who, name, value, batch_size, lo, hi) for name, value, (lo, hi) in zip(names, fields, bounds)
    ]
    return VerifyOutput(*checked, correction=correction)


def check_output_probs(
    output_probs: Any, batch_size: int, num_drafts: int, draft_len: int, vocab_size: int, who: str = "verifier"
) -> torch.Tensor:
    """Validate an exact law returned by ``output_probs``: shape, finiteness, sign, total mass 1."""
    return check_law(who, "output_probs", output_probs, (batch_size, num_drafts, draft_len + 1, vocab_size))


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
    num_drafts, draft_len : int, list or range, or None
        The exact K and L values it supports, where not every value in the bounds is
        (``draft_len = 3`` for a verifier written for a fixed draft length, as an engine runs a
        fixed ``num_speculative_tokens``; ``num_drafts = (1, 2, 4)``); ``None``: every value in
        the bounds.  An audit runs it only at these values.
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
    num_drafts: Any = None
    draft_len: Any = None
    expected: Expected = None
    guarantees: frozenset = frozenset()
    takes_logits: bool = False
    #: Whether the verifier says which (K, L) it supports: a class does (its bounds, by default
    #: any); a plain function wrapped with none of :data:`SHAPE_ATTRS` does not, and a suite run
    #: audits it at K = 1, L = 1 unless told otherwise (:func:`spectr_audit.run.suite.case_selection`).
    declares_shape: bool = True

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

    def standard_entry(self, method: str) -> bool:
        """Whether the public ``method`` (``"verify"``, ``"output_probs"``) is the contract's own entry point: it checks
        the inputs unless called with ``validate=False``, then calls the private one.  False where a subclass
        overrides it (it may check nothing, or take no ``validate``), and for any other name.

        The audits read it to check inputs once instead of per call; a verifier that stands for another (a
        time-limited one) answers for the one it calls.
        """
        return method in ("verify", "output_probs") and getattr(type(self), method) is getattr(Verifier, method)

    def supports(self, num_drafts: int, draft_len: int) -> bool:
        """Whether the verifier accepts K = ``num_drafts`` and L = ``draft_len`` (its bounds and declared values)."""
        return self.supports_num_drafts(num_drafts) and self.supports_draft_len(draft_len)

    def supports_num_drafts(self, num_drafts: int) -> bool:
        """Whether K = ``num_drafts`` is within the verifier's bounds and among its declared values."""
        return _within(self, "num_drafts", num_drafts, self.min_drafts, self.max_drafts)

    def supports_draft_len(self, draft_len: int) -> bool:
        """Whether L = ``draft_len`` is within the verifier's bounds and among its declared values."""
        return _within(self, "draft_len", draft_len, self.min_draft_len, self.max_draft_len)

    def check_supports(self, num_drafts: int, draft_len: int) -> None:
        """Raise :class:`InvalidArgument` when (K, L) is outside what the verifier supports."""
        if not self.supports(num_drafts, draft_len):
            raise InvalidArgument(
                f"draft_tokens: verifier {self.name!r} supports num_drafts in {self.drafts_range()} and "
                f"draft_len in {self.draft_len_range()}; got num_drafts={num_drafts}, draft_len={draft_len}"
            )

    def drafts_range(self) -> str:
        """Human-readable range (or declared values) of supported K."""
        return _support_text(self, "num_drafts", self.min_drafts, self.max_drafts)

    def draft_len_range(self) -> str:
        """Human-readable range (or declared values) of supported L."""
        return _support_text(self, "draft_len", self.min_draft_len, self.max_draft_len)

    # -- to implement ------------------------------------------------------
    def _verify(self, draft_tokens, draft_probs, target_probs, generator) -> VerifyOutput:  # pragma: no cover
        raise NotImplementedError

    def _output_probs(self, draft_tokens, draft_probs, target_probs) -> torch.Tensor:  # pragma: no cover
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name!r}>"


def _range_str(lo: int, hi: Optional[int]) -> str:
    return f"[{lo}, {hi}]" if hi is not None else f"[{lo}, inf)"


def _within(verifier: Any, attr: str, value: int, lo: int, hi: Optional[int]) -> bool:
    values = declared_values(getattr(verifier, attr, None), f"{getattr(verifier, 'name', '') or 'verifier'}.{attr}")
    return value >= lo and (hi is None or value <= hi) and (values is None or value in values)


def _support_text(verifier: Any, attr: str, lo: int, hi: Optional[int]) -> str:
    """The K or L a verifier supports: its declared values within its bounds, else the bounds."""
    values = declared_values(getattr(verifier, attr, None), f"{getattr(verifier, 'name', '') or 'verifier'}.{attr}")
    if values is None:
        return _range_str(lo, hi)
    inside = tuple(v for v in values if v >= lo and (hi is None or v <= hi))
    return _values_text(inside) if inside else "{} (none within " + _range_str(lo, hi) + ")"


class _FunctionAdapter:
    """The constructor and law flag :class:`FunctionVerifier` and
    :class:`~spectr_audit.contract.logits.FunctionLogitsVerifier` share: one signature, one set of checks.

    A mixin, so that each adapter keeps its own contract base; listed before that base, so that its
    ``has_exact_law`` (a law was given) is the one that counts.
    """

    #: Whether a given ``output_probs`` is checked to be callable when the adapter is built
    #: (otherwise the first call reports it).
    _checks_law_at_init: bool = False

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
        num_drafts: Any = None,
        draft_len: Any = None,
    ):
        check_verify_function(fn)
        if self._checks_law_at_init and output_probs is not None and not callable(output_probs):
            raise InvalidArgument(f"output_probs: expected a callable or None, got {type(output_probs).__name__}")
        if draft_scheme not in DRAFT_SCHEMES:
            raise InvalidArgument(f"draft_scheme: expected one of {DRAFT_SCHEMES}, got {draft_scheme!r}")
        adopt_function(
            self, fn, output_probs, name=name, default_name="verifier", expected=expected, guarantees=guarantees,
            description=description,
        )
        self.draft_scheme = draft_scheme
        self.min_drafts, self.max_drafts = min_drafts, max_drafts
        self.min_draft_len, self.max_draft_len = min_draft_len, max_draft_len
        name_ = self.name or "verifier"
        self.num_drafts = declared_values(num_drafts, f"{name_}: num_drafts")
        self.draft_len = declared_values(draft_len, f"{name_}: draft_len")
        # a function given none of the shape arguments has said nothing about its (K, L)
        self.declares_shape = (min_drafts != 1 or max_drafts is not None or min_draft_len != 1
                               or max_draft_len is not None or num_drafts is not None or draft_len is not None)

    @property
    def has_exact_law(self) -> bool:
        return self._law is not None


class FunctionVerifier(_FunctionAdapter, Verifier):
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

    def _verify(self, draft_tokens, draft_probs, target_probs, generator) -> VerifyOutput:
        batch_size, num_drafts, draft_len = draft_tokens.shape
        raw = call_third_party(self.name, "verify", self._fn, draft_tokens, draft_probs, target_probs, generator)
        return check_verify_output(raw, batch_size, num_drafts, draft_len, draft_probs.shape[-1], who=self.name)

    def _output_probs(self, draft_tokens, draft_probs, target_probs) -> torch.Tensor:
        batch_size, num_drafts, draft_len = draft_tokens.shape
        law = call_third_party(self.name, "output_probs", self._law, draft_tokens, draft_probs, target_probs)
        return check_output_probs(law, batch_size, num_drafts, draft_len, draft_probs.shape[-1], who=self.name)
