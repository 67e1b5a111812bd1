"""The converters: whatever a user hands the audit, as the contract's verifier classes.

:func:`as_verifier` turns a chain verifier (a :class:`~spectr_audit.contract.verifier.Verifier`, a
class, an object with ``verify``, one that takes logits, or a plain function) into a ``Verifier``;
:func:`as_tree_verifier` turns a tree verifier, or a chain verifier run on chain trees, into a
:class:`~spectr_audit.contract.tree_verifier.TreeVerifier`.  They live above the contract's classes
and adapters because they must know every one of them.
"""

from __future__ import annotations

from typing import Any, Optional

from spectr_audit.contract._checks import instantiate, renamed
from spectr_audit.contract.chain_trees import ChainVerifierAsTree, TreeVerifierAsChain
from spectr_audit.contract.logits import as_logits_verifier
from spectr_audit.contract.tree_verifier import FunctionTreeVerifier, TreeVerifier
from spectr_audit.contract.verifier import SHAPE_ATTRS, FunctionVerifier, Verifier
from spectr_audit.errors import InvalidArgument

__all__ = ["as_tree_verifier", "as_verifier"]


_PASSTHROUGH_ATTRS = (
    "draft_scheme",
    "min_drafts",
    "max_drafts",
    "min_draft_len",
    "max_draft_len",
    "num_drafts",
    "draft_len",
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
    obj = instantiate(obj)
    if isinstance(obj, Verifier):
        return renamed(obj, name)
    if getattr(obj, "takes_logits", False) or callable(getattr(obj, "verify_logits", None)):
        # it takes raw logits and sampling parameters (docs/sampling.md)
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
        # an object that names none of its (K, L) attributes has declared nothing (run.suite's default applies)
        wrapped.declares_shape = any(hasattr(obj, attr) for attr in SHAPE_ATTRS)
        if callable(getattr(obj, "carried_correction", None)):
            # verifiers that repair the next iteration are judged by the multi-iteration audit
            wrapped.carried_correction = obj.carried_correction
        return wrapped
    if callable(obj):  # a function may carry its (K, L) as attributes: my_verify.draft_len = 3
        return FunctionVerifier(obj, name=name, **{attr: getattr(obj, attr) for attr in SHAPE_ATTRS if hasattr(obj, attr)})
    raise InvalidArgument(
        f"verifier: expected a Verifier, a class, an object with a verify method, or a function; "
        f"got {type(obj).__name__}"
    )


def as_tree_verifier(obj: Any, name: Optional[str] = None) -> TreeVerifier:
    """Turn a tree verifier, a chain verifier, or a plain function into a :class:`TreeVerifier`.

    * a :class:`TreeVerifier` instance is returned as it is (renamed if ``name`` is given);
    * a class is instantiated with no arguments, then converted;
    * a chain :class:`~spectr_audit.contract.verifier.Verifier` runs on chain trees
      (:class:`~spectr_audit.contract.chain_trees.ChainVerifierAsTree`), except a
      :class:`~spectr_audit.contract.chain_trees.TreeVerifierAsChain`, whose tree verifier is
      returned (renamed if ``name`` is given);
    * an object with a ``verify_tree`` method is wrapped, keeping its ``tree_output_probs``,
      ``draft_schemes`` and ``supports_tree``;
    * a plain callable of the ``verify_tree`` signature is wrapped by :class:`FunctionTreeVerifier`.
    """
    obj = instantiate(obj)
    if isinstance(obj, TreeVerifier):
        return renamed(obj, name)
    if isinstance(obj, TreeVerifierAsChain):
        return renamed(obj.tree_verifier, name)
    if isinstance(obj, Verifier):
        return ChainVerifierAsTree(obj, name=name)
    if hasattr(obj, "verify_tree") and callable(obj.verify_tree):
        law = getattr(obj, "tree_output_probs", None)
        supports = getattr(obj, "supports_tree", None)
        return FunctionTreeVerifier(
            obj.verify_tree,
            name=name or getattr(obj, "name", None) or type(obj).__name__,
            tree_output_probs=law if callable(law) else None,
            draft_schemes=getattr(obj, "draft_schemes", ("iid",)),
            supports_tree=supports if callable(supports) else None,
            expected=getattr(obj, "expected", None),
            guarantees=getattr(obj, "guarantees", frozenset()),
            description=getattr(obj, "description", ""),
        )
    if callable(obj):
        return FunctionTreeVerifier(obj, name=name)
    raise InvalidArgument(
        f"verifier: expected a TreeVerifier, a Verifier, a class, an object with a verify_tree method, or a "
        f"function; got {type(obj).__name__}"
    )
