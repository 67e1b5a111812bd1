"""A verifier whose every call is limited in time: an adapter of each contract, as honest as any other.

:class:`TimeLimitedVerifier` is a :class:`~spectr_audit.contract.verifier.Verifier` that holds another chain
verifier and calls it under a per-call time limit (:func:`spectr_audit._deadline.call_limit`): ``verify`` and
``output_probs``, and ``verify_logits`` / ``output_probs_logits`` for one that takes logits, each raise
``error`` when the verifier's own call runs longer than ``seconds``.  :class:`TimeLimitedTreeVerifier` does the
same for a :class:`~spectr_audit.contract.tree_verifier.TreeVerifier` (``verify_tree``, ``tree_output_probs``).

Each declares what the verifier it holds declares (name, draft scheme(s), the sizes or trees it supports,
whether it has an exact law, which entry points are the contract's own, ``takes_logits``, ``expected``,
``guarantees``), and reads any other attribute (a carried correction, say) from it; it is an instance of its
contract's base class, not of the verifier's class.  The verifier's own object is never modified, so a frozen
dataclass or a class with ``__slots__`` is limited alike.  The run layer builds them
(:func:`spectr_audit.run.guard.time_limited`); the audits below call them as they call any verifier.

Examples
--------
>>> import time
>>> from spectr_audit.contract.verifier import FunctionVerifier
>>> def slow(draft_tokens, draft_probs, target_probs, generator):
...     time.sleep(5)
>>> limited = TimeLimitedVerifier(FunctionVerifier(slow, name="slow"), 0.2)
>>> limited.name, isinstance(limited, Verifier), isinstance(limited, FunctionVerifier)
('slow', True, False)
"""

from __future__ import annotations

from typing import Any

from spectr_audit import _deadline
from spectr_audit.contract.tree_verifier import TreeVerifier
from spectr_audit.contract.verifier import Verifier

__all__ = ["TimeLimitedTreeVerifier", "TimeLimitedVerifier"]

#: What a chain verifier declares, read once from the verifier held.
_CHAIN_DECLARATIONS = ("name", "description", "draft_scheme", "min_drafts", "max_drafts", "min_draft_len",
                       "max_draft_len", "expected", "guarantees", "takes_logits")
#: What a tree verifier declares.
_TREE_DECLARATIONS = ("name", "description", "draft_schemes", "expected", "guarantees")


class _Limited:
    """What both adapters share: the verifier held, the limit, and the limited call."""

    def _hold(self, verifier: Any, seconds: float, error: type, hint: str, declarations: tuple) -> None:
        # set through object.__setattr__'s twin, the instance dict: attribute reads fall through to the verifier
        self.__dict__.update(wrapped=verifier, seconds=float(seconds), error=error, hint=hint)
        for name in declarations:
            if hasattr(verifier, name):
                setattr(self, name, getattr(verifier, name))

    def _call(self, method: str, *args, **kwargs):
        """``wrapped.<method>(*args, **kwargs)``, raising ``error`` when it runs past ``seconds``."""
        hint = f" ({self.hint})" if self.hint else ""
        message = f"verifier {self.name!r}: {method.lstrip('_')} did not return within {self.seconds:g} s{hint}"
        with _deadline.call_limit(self.seconds, message, self.error):
            return getattr(self.wrapped, method)(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        # only for what neither the adapter nor its contract defines (a carried correction, a rule's own settings)
        if name.startswith("__") or "wrapped" not in self.__dict__:
            raise AttributeError(name)
        return getattr(self.__dict__["wrapped"], name)

    def standard_entry(self, method: str) -> bool:
        """The held verifier's answer: the call goes to its entry point as given."""
        return bool(getattr(self.wrapped, "standard_entry", lambda _: False)(method))

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.wrapped!r}, {self.seconds:g} s>"


class TimeLimitedVerifier(_Limited, Verifier):
    """A chain verifier called under a per-call time limit (see the module docstring).

    Parameters
    ----------
    verifier : Verifier
        The verifier to call (its object is left as it is).
    seconds : float
        The limit on each call.
    error : type
        The exception raised when a call runs past it (``TimeoutError`` unless given).
    hint : str
        Appended to the message in parentheses (where the limit is set, say).
    """

    def __init__(self, verifier: Verifier, seconds: float, error: type = TimeoutError, hint: str = ""):
        self._hold(verifier, seconds, error, hint, _CHAIN_DECLARATIONS)

    @property
    def has_exact_law(self) -> bool:
        return bool(self.wrapped.has_exact_law)

    def supports(self, num_drafts: int, draft_len: int) -> bool:
        return bool(self.wrapped.supports(num_drafts, draft_len))

    def verify(self, *args, **kwargs):
        return self._call("verify", *args, **kwargs)

    def output_probs(self, *args, **kwargs):
        return self._call("output_probs", *args, **kwargs)

    def verify_logits(self, *args, **kwargs):
        return self._call("verify_logits", *args, **kwargs)

    def output_probs_logits(self, *args, **kwargs):
        return self._call("output_probs_logits", *args, **kwargs)

    # where the contract's own entry point is the verifier's, an audit that checked the inputs once calls these
    def _verify(self, *args):
        return self._call("_verify", *args)

    def _output_probs(self, *args):
        return self._call("_output_probs", *args)


class TimeLimitedTreeVerifier(_Limited, TreeVerifier):
    """A tree verifier called under a per-call time limit; the parameters are :class:`TimeLimitedVerifier`'s."""

    def __init__(self, verifier: TreeVerifier, seconds: float, error: type = TimeoutError, hint: str = ""):
        self._hold(verifier, seconds, error, hint, _TREE_DECLARATIONS)

    @property
    def has_tree_law(self) -> bool:
        return bool(self.wrapped.has_tree_law)

    def supports_tree(self, tree) -> bool:
        return bool(self.wrapped.supports_tree(tree))

    def verify_tree(self, *args, **kwargs):
        return self._call("verify_tree", *args, **kwargs)

    def tree_output_probs(self, *args, **kwargs):
        return self._call("tree_output_probs", *args, **kwargs)

    def _verify_tree(self, *args):
        return self._call("_verify_tree", *args)

    def _tree_output_probs(self, *args):
        return self._call("_tree_output_probs", *args)
