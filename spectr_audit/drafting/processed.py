"""Audits with sampling parameters: the processed laws, the raw logits, and logits verifiers bound to a case.

An audit case with sampling parameters has *raw* models (their logits are what an engine's
model returns) and holds the verifier to the law the engine's non-speculative sampler draws
from, :func:`~spectr_audit.contract.sampling.process_logits` of those logits with the case's
parameters and processing order (docs/sampling.md).  This module gives the pieces every
audit uses:

* :func:`processed_model`: a model whose next-token law is the processed law of a raw model
  (:class:`ProcessedModel`, or :class:`ProcessedContextFreeModel` for a context-free one).
  The drafts are drawn from the processed draft model, the verifier is held to the processed
  target model, and the bounds (alpha*, the block LP) are those of the processed laws.
* :func:`model_logits`: a model's raw logits at given contexts (its ``logits`` method, or the
  log of its probabilities: every processing step is invariant to a shift of a row's logits,
  so ``log(probs)`` stands for the logits of a probability model).
* :class:`ContextFreeLogitsModel`: a context-free model given by its logits (``-inf`` allowed).
* :class:`BoundLogitsVerifier`: a verifier that takes logits, seen through the probability
  contract at one context: it recomputes the raw logits of every node from the drafted tokens
  and hands them, with the parameters, to the verifier
  (:func:`~spectr_audit.contract.logits.verify_with_params`).
* :func:`bind_params`: the processed models and the verifier to audit, for one case.

A verifier that takes probabilities needs no binding: it is handed the processed laws, which is
exactly what :func:`~spectr_audit.contract.logits.verify_with_params` gives it.

Examples
--------
>>> import torch
>>> from spectr_audit.contract.sampling import SamplingParams
>>> raw = ContextFreeLogitsModel([2.0, 1.0, 0.0, -1.0])
>>> processed = processed_model(raw, SamplingParams(top_k=2))
>>> [round(x, 6) for x in processed(torch.zeros(1, 0, dtype=torch.int64))[0].tolist()]
[0.731059, 0.268941, 0.0, 0.0]
"""

from __future__ import annotations

import copy

from typing import Optional, Sequence, Union

import torch

from spectr_audit.contract.logits import output_probs_with_params, takes_logits, verify_with_params
from spectr_audit.contract.sampling import ProcessingOrder, SamplingParams, process_logits, processing_order
from spectr_audit.contract.tree import DraftTree
from spectr_audit.contract.verifier import SHAPE_ATTRS, Verifier, VerifyOutput
from spectr_audit.drafting.models import ContextFreeModel, Model, contexts_from
from spectr_audit.errors import InvalidArgument

__all__ = [
    "BoundLogitsVerifier",
    "ContextFreeLogitsModel",
    "ProcessedContextFreeModel",
    "ProcessedModel",
    "audit_params",
    "bind_params",
    "is_processed",
    "model_logits",
    "node_logits",
    "processed_model",
    "sampling_summary",
    "tree_node_logits",
]

OrderLike = Union[str, Sequence[str], ProcessingOrder]


def audit_params(params, argument: str = "params") -> SamplingParams:
    """Check that ``params`` is one setting for every row (an audit enumerates or samples its own rows)."""
    if not isinstance(params, SamplingParams):
        raise InvalidArgument(f"{argument}: expected SamplingParams, got {type(params).__name__}")
    if params.batch_size is not None:
        raise InvalidArgument(
            f"{argument}: an audit takes one setting for all its rows; got per-row tensors of {params.batch_size} rows "
            f"(give scalars)"
        )
    return params


class ContextFreeLogitsModel(ContextFreeModel):
    """The same logits at every position: ``softmax(logits)`` as the law, the logits kept as they are.

    Parameters
    ----------
    logits : sequence of float or tensor
        ``[vocab_size]``, finite or ``-inf`` (not all ``-inf``).
    """

    def __init__(self, logits):
        values = torch.as_tensor(logits, dtype=torch.float64).flatten().clone()
        if values.numel() < 1:
            raise InvalidArgument("logits: expected at least one value")
        if bool(torch.isnan(values).any() | (values == float("inf")).any()):
            raise InvalidArgument(f"logits: must be finite or -inf, got {values.tolist()}")
        if bool((values == float("-inf")).all()):
            raise InvalidArgument("logits: every value is -inf (no token can be drawn)")
        # [vocab_size]
        self.raw_logits = values
        super().__init__(torch.softmax(values, dim=0))

    def logits(self, contexts: torch.Tensor) -> torch.Tensor:  # [batch_size, vocab_size]
        """The raw logits at every context."""
        return self.raw_logits.to(contexts.device).expand(contexts.shape[0], -1).clone()

    def describe(self) -> str:
        return "context-free logits " + ", ".join(f"{x:.4g}" for x in self.raw_logits.tolist())


def model_logits(model: Model, contexts: torch.Tensor) -> torch.Tensor:  # [batch_size, vocab_size] float64
    """Raw logits of ``model`` at ``contexts``: its ``logits`` method, else ``log`` of its law (``-inf`` at 0)."""
    method = getattr(model, "logits", None)
    if callable(method):
        return method(contexts).double()
    return model(contexts).double().log()


class ProcessedModel(Model):
    """The law of a raw model after an engine's processing: ``process_logits(logits, params, order)``.

    Parameters
    ----------
    model : Model
        The raw model (see :func:`model_logits` for its logits).
    params : SamplingParams
        One setting (scalars) for every context.
    order : str, sequence of str or ProcessingOrder
        The engine's processing conventions (default vLLM's).
    """

    def __init__(self, model: Model, params: SamplingParams, order: OrderLike = "vllm"):
        if not isinstance(model, Model):
            raise InvalidArgument(f"model: expected a Model, got {type(model).__name__}")
        self.model = model
        self.params = audit_params(params)
        self.order = processing_order(order)
        self.vocab_size = model.vocab_size

    def logits(self, contexts: torch.Tensor) -> torch.Tensor:  # [batch_size, vocab_size]
        """The raw model's logits (what an engine's verifier is handed)."""
        return model_logits(self.model, contexts)

    def __call__(self, contexts: torch.Tensor) -> torch.Tensor:  # [batch_size, vocab_size]
        return process_logits(self.logits(contexts), self.params, self.order)

    def describe(self) -> str:
        return f"{self.model.describe()}, processed ({sampling_summary(self.params, self.order)})"


class ProcessedContextFreeModel(ContextFreeModel):
    """:class:`ProcessedModel` of a context-free raw model: itself context-free, so the audits' fast paths apply."""

    def __init__(self, model: ContextFreeModel, params: SamplingParams, order: OrderLike = "vllm"):
        self.model = model
        self.params = audit_params(params)
        self.order = processing_order(order)
        # [1, vocab_size]
        self._raw_logits = model_logits(model, torch.zeros(1, 0, dtype=torch.int64))
        super().__init__(process_logits(self._raw_logits, self.params, self.order)[0])

    def logits(self, contexts: torch.Tensor) -> torch.Tensor:  # [batch_size, vocab_size]
        """The raw model's logits (what an engine's verifier is handed)."""
        return self._raw_logits[0].to(contexts.device).expand(contexts.shape[0], -1).clone()

    def describe(self) -> str:
        return f"{self.model.describe()}, processed ({sampling_summary(self.params, self.order)})"


def processed_model(model: Model, params: SamplingParams, order: OrderLike = "vllm") -> Model:
    """``model``'s law after the processing: a :class:`ProcessedContextFreeModel` for a context-free
    model, else a :class:`ProcessedModel`."""
    if isinstance(model, ContextFreeModel):
        return ProcessedContextFreeModel(model, params, order)
    return ProcessedModel(model, params, order)


def is_processed(model: Model) -> bool:
    """Whether ``model`` is a processed law (it knows its raw model, parameters and order)."""
    return isinstance(model, (ProcessedModel, ProcessedContextFreeModel))


def sampling_summary(params: Optional[SamplingParams], order: OrderLike = "vllm") -> str:
    """One line for reports: ``"temperature=0.5, top_k=3; vllm order"`` (``"neutral"`` with no parameter set).

    Examples
    --------
    >>> sampling_summary(SamplingParams(temperature=0.5, top_p=0.9))
    'temperature=0.5, top_p=0.9; vllm order'
    >>> sampling_summary(SamplingParams(), "sglang")
    'neutral; sglang order'
    """
    described = (params or SamplingParams()).describe()
    text = ", ".join(f"{key}={value:g}" if isinstance(value, (int, float)) else f"{key}={value}"
                     for key, value in described.items())
    return f"{text or 'neutral'}; {processing_order(order).name} order"


def node_logits(
    model: Model,
    contexts: torch.Tensor,  # [batch_size, context_len]: the context of each row (right-aligned)
    draft_tokens: torch.Tensor,  # [batch_size, num_drafts, draft_len]
    depth: int,
) -> torch.Tensor:  # [batch_size, num_drafts, depth, vocab_size] float64
    """Raw logits of ``model`` at the nodes ``context + draft_tokens[:, k, :l]`` for ``l < depth``.

    A context-free raw model is evaluated once and broadcast.
    """
    batch_size, num_drafts, _ = draft_tokens.shape
    vocab_size = model.vocab_size
    device = draft_tokens.device
    raw = model.model if is_processed(model) else model
    if isinstance(raw, ContextFreeModel):
        row = model_logits(raw, torch.zeros(1, 0, dtype=torch.int64, device=device))[0]
        return row.expand(batch_size, num_drafts, depth, vocab_size).clone()
    rows = contexts.repeat_interleave(num_drafts, dim=0)  # [B * K, T]
    tokens = draft_tokens.reshape(batch_size * num_drafts, -1)
    levels = [model_logits(raw, torch.cat([rows, tokens[:, :level]], dim=1)) for level in range(depth)]
    return torch.stack(levels, dim=1).reshape(batch_size, num_drafts, depth, vocab_size)


def tree_node_logits(
    model: Model,
    tree: DraftTree,
    node_tokens: torch.Tensor,  # [batch_size, num_nodes]
    prefix: Sequence[int] = (),
) -> torch.Tensor:  # [batch_size, num_nodes, vocab_size] float64
    """Raw logits of ``model`` (:func:`model_logits`) at every node of ``tree``: after ``prefix`` and the node's path."""
    batch_size = node_tokens.shape[0]
    path_index = tree.path_index(node_tokens.device)
    out = torch.empty(batch_size, tree.num_nodes, model.vocab_size, dtype=torch.float64, device=node_tokens.device)
    for depth in range(tree.max_depth + 1):
        nodes = list(tree.level(depth))
        paths = node_tokens[:, path_index[nodes, :depth]].reshape(batch_size * len(nodes), depth)
        rows = model_logits(model, contexts_from(prefix, paths))
        out[:, nodes] = rows.reshape(batch_size, len(nodes), -1)
    return out


class BoundLogitsVerifier(Verifier):
    """A verifier that takes logits, audited through the probability contract after ``prefix``.

    The audit hands it the processed laws of :class:`ProcessedModel` draft and target models;
    it recomputes the raw logits of every node (``prefix + draft_tokens[:, k, :l]``) and calls
    the verifier with them and the parameters, as an engine would
    (:func:`~spectr_audit.contract.logits.verify_with_params`).  Valid for one verification
    step after ``prefix``: the exact single-iteration audit and the one-iteration statistical
    audit.  With ``foreign_inputs="probabilities"`` inputs that are not the models' processed laws
    at those nodes (a probe's synthetic batch, say) go to the verifier's probability entry
    (``log(probs)``, neutral parameters) instead; the default trusts the audit's inputs.
    """

    def __init__(self, verifier: Verifier, draft_model: Model, target_model: Model, prefix: Sequence[int] = (),
                 foreign_inputs: Optional[str] = None):
        if not takes_logits(verifier):
            raise InvalidArgument(f"verifier: {getattr(verifier, 'name', verifier)!r} takes probabilities; it needs no binding")
        if not (is_processed(draft_model) and is_processed(target_model)):
            raise InvalidArgument("draft_model, target_model: expected processed models (processed_model)")
        self.verifier = verifier
        self.draft_model, self.target_model = draft_model, target_model
        self.params, self.order = target_model.params, target_model.order
        self.prefix = tuple(int(t) for t in prefix)
        if foreign_inputs not in (None, "probabilities"):
            raise InvalidArgument(f"foreign_inputs: expected None or 'probabilities', got {foreign_inputs!r}")
        self.foreign_inputs = foreign_inputs
        for attr in ("name", "draft_scheme", *SHAPE_ATTRS, "expected", "guarantees", "description"):
            setattr(self, attr, getattr(verifier, attr))

    @property
    def has_exact_law(self) -> bool:
        return self.verifier.has_exact_law

    def trusting(self) -> "BoundLogitsVerifier":
        """The same binding (the same processed models) trusting its inputs: for an audit that hands it only the
        models' processed laws at the drafted nodes (the statistical audit), where the check for foreign inputs
        would cost a pass per call and never fire."""
        if self.foreign_inputs is None:
            return self
        view = copy.copy(self)
        view.foreign_inputs = None
        return view

    def _logits(self, draft_tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        batch_size, _, draft_len = draft_tokens.shape
        contexts = contexts_from(self.prefix, torch.zeros(batch_size, 0, dtype=torch.int64, device=draft_tokens.device))
        padded = torch.cat([draft_tokens, draft_tokens[:, :, :1]], dim=2)  # the last column is never read
        draft_logits = node_logits(self.draft_model, contexts, draft_tokens, draft_len)
        target_logits = node_logits(self.target_model, contexts, padded, draft_len + 1)
        return draft_logits, target_logits

    def _foreign(self, draft_tokens, draft_probs, target_probs, draft_logits, target_logits) -> bool:
        """Whether the inputs are not the processed laws of the models at the drafted nodes."""
        if self.foreign_inputs is None:
            return False
        drafted = draft_logits.gather(-1, draft_tokens.unsqueeze(-1))
        if bool((drafted == float("-inf")).any()):
            return True
        laws = ((process_logits(draft_logits, self.params, self.order), draft_probs),
                (process_logits(target_logits, self.params, self.order), target_probs))
        return not all(torch.allclose(law, given.double(), rtol=0, atol=1e-9) for law, given in laws)

    def _verify(self, draft_tokens, draft_probs, target_probs, generator) -> VerifyOutput:
        draft_logits, target_logits = self._logits(draft_tokens)
        if self._foreign(draft_tokens, draft_probs, target_probs, draft_logits, target_logits):
            return self.verifier.verify(draft_tokens, draft_probs, target_probs, generator, validate=False)
        return verify_with_params(self.verifier, draft_tokens, draft_logits, target_logits, self.params, generator,
                                  order=self.order, validate=False)

    def _output_probs(self, draft_tokens, draft_probs, target_probs) -> torch.Tensor:
        draft_logits, target_logits = self._logits(draft_tokens)
        if self._foreign(draft_tokens, draft_probs, target_probs, draft_logits, target_logits):
            return self.verifier.output_probs(draft_tokens, draft_probs, target_probs, validate=False)
        return output_probs_with_params(self.verifier, draft_tokens, draft_logits, target_logits, self.params,
                                        order=self.order, validate=False)


def bind_params(verifier, draft_model: Model, target_model: Model, params: Optional[SamplingParams],
                order: OrderLike = "vllm", prefix: Sequence[int] = (), foreign_inputs: Optional[str] = None):
    """``(verifier, draft_model, target_model)`` to audit one step with ``params``.

    With ``params`` ``None`` everything is returned unchanged (the probability path).  Otherwise
    the models become processed ones (:func:`processed_model`) and a verifier that takes logits becomes a
    :class:`BoundLogitsVerifier` (one that takes probabilities is handed the processed laws as
    it is; ``foreign_inputs`` goes to the binding).

    Raises
    ------
    InvalidArgument
        For per-row parameters, an unknown order, or a parameter the order has no step for
        (checked on the first context).
    """
    if params is None:
        return verifier, draft_model, target_model
    params = audit_params(params)
    order = processing_order(order)
    if is_processed(draft_model) or is_processed(target_model):
        raise InvalidArgument("draft_model, target_model: give the raw models; the parameters process them")
    # a parameter the order cannot apply (eagle has no min-p step, say) fails here, naming it
    draft_processed = processed_model(draft_model, params, order)
    target_processed = processed_model(target_model, params, order)
    target_processed(contexts_from(tuple(prefix), torch.zeros(1, 0, dtype=torch.int64)))
    if takes_logits(verifier):
        verifier = BoundLogitsVerifier(verifier, draft_processed, target_processed, prefix, foreign_inputs)
    return verifier, draft_processed, target_processed
