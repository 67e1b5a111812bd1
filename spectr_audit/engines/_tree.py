"""What the tree-engine adapters share: raw logits and sampling parameters in, the engine's own processing.

A tree engine is handed what a serving engine hands its verifier: the drafted token of every node,
the draft model's and the target model's *raw* logits at every node, and the request's sampling
parameters.  Each adapter applies them through the engine's own logits processing (EAGLE's
``prepare_logits_processor``, Medusa's ``softmax(logits / temperature)``, SGLang's request
normalisation) and calls the engine's own verification function.  The law the audit holds it
to is that of the engine's non-speculative sampler with those parameters, the reference
:func:`~spectr_audit.contract.sampling.process_logits` under the adapter's
:attr:`EngineTreeVerifier.processing_order` (:mod:`spectr_audit.engines.tree_audit`).

Given probabilities instead (the tree contract's :meth:`verify_tree`), an adapter is handed their
logarithms and neutral parameters, so the tree audits of :mod:`spectr_audit.exact` and
:mod:`spectr_audit.statistical` apply at temperature 1.
"""

from __future__ import annotations

from typing import Optional

import torch

from spectr_audit.contract.randomness import RandomSource
from spectr_audit.contract.sampling import ProcessingOrder, SamplingParams, logits_from_probs, process_logits
from spectr_audit.contract.tree import DraftTree
from spectr_audit.contract.tree_verifier import TreeVerifier, TreeVerifyOutput, check_tree_inputs, check_tree_output
from spectr_audit.errors import InvalidArgument

__all__ = ["EngineTreeVerifier", "contiguous_ranks", "uniform_params"]


def contiguous_ranks(tree: DraftTree) -> bool:
    """Whether the children of every node have the ranks ``0, 1, ..., k - 1`` (no gaps)."""
    return all([tree.ranks[c] for c in kids] == list(range(len(kids))) for kids in tree.children)


def uniform_params(params: SamplingParams, batch_size: int, who: str) -> dict:
    """The parameters as scalars, refusing per-row values that differ (engines that take one set per call)."""
    out = {}
    for name in ("temperature", "top_k", "top_p", "min_p"):
        column = params.column(name, batch_size)
        if batch_size and bool((column != column[0]).any()):
            raise InvalidArgument(
                f"params: {who} takes one {name} per call; got per-row values {column.tolist()}"
            )
        default = {"temperature": 1.0, "top_k": 0, "top_p": 1.0, "min_p": 0.0}[name]
        out[name] = column[0].item() if batch_size else default
    return out


class EngineTreeVerifier(TreeVerifier):
    """Base of the tree-engine adapters: black boxes that take raw logits and sampling parameters.

    Subclasses set ``name``, ``engine`` (the distribution), ``engine_version`` (read when built),
    ``draft_schemes`` and ``processing_order``, and implement ``_verify_tree_logits`` with the
    signature of :meth:`verify_tree_logits` (inputs already validated).

    Class attributes
    ----------------
    takes_logits : bool
        True: :meth:`verify_tree_logits` takes raw logits and :class:`SamplingParams`.
    processing_order : ProcessingOrder
        The engine's non-speculative sampler (the law the audit holds the adapter to).
    declared_lossy : str
        Non-empty where the engine itself declares its rule lossy, the reason (Medusa: "typical
        acceptance, by design"): a rejected audit is then the declared loss, reported as the
        verdict ``"declared lossy"``, not a finding.  Empty (default): the engine claims to be lossless.
    """

    takes_logits = True
    engine: str = ""
    engine_version: str = ""
    declared_lossy: str = ""
    processing_order: ProcessingOrder

    # -- what the audit asks -------------------------------------------------------------
    def check_params(self, params: SamplingParams, batch_size: int) -> None:
        """Raise :class:`InvalidArgument` for parameters the engine does not take (default: none refused)."""

    def draft_scheme_for(self, params: SamplingParams, batch_size: int = 1) -> str:
        """The draft scheme the engine's drafter uses under ``params`` (default: the first of ``draft_schemes``)."""
        return self.draft_schemes[0]

    def drafting_params(self, params: SamplingParams) -> SamplingParams:
        """The parameters the engine's drafter applies to the draft logits (default: none, the raw softmax).

        Top-k drafters rank the draft model's own distribution; a sampling drafter (EAGLE-1)
        draws from the processed one.
        """
        return SamplingParams()

    def is_deterministic(self, params: SamplingParams, batch_size: int = 1) -> bool:
        """Whether the output is a function of the inputs under ``params`` (no random draw); default False."""
        return False

    # -- the logits entry point ----------------------------------------------------------
    def verify_tree_logits(
        self,
        tree: DraftTree,
        node_tokens: torch.Tensor,  # [batch_size, num_nodes] int64; entry 0 (the root) is the last verified token
        draft_logits: Optional[torch.Tensor],  # [batch_size, num_nodes, vocab_size]; None under scheme "none"
        target_logits: torch.Tensor,  # [batch_size, num_nodes, vocab_size]
        params: Optional[SamplingParams] = None,
        generator: RandomSource = None,
        *,
        validate: bool = True,
    ) -> TreeVerifyOutput:
        """Verify one step on ``tree`` from raw logits and the request's sampling parameters.

        Row ``n`` of ``draft_logits`` is the draft model's raw logits at node ``n`` (its children
        were drafted from their processing), row ``n`` of ``target_logits`` the target's.  With
        ``validate``, the inputs are checked as the tree contract checks probabilities: the
        logits must be finite or ``-inf`` (never ``-inf`` everywhere), and the tokens possible
        under one of the adapter's draft schemes given the reference processing of the draft
        logits.  The output is always checked.
        """
        params = SamplingParams() if params is None else params
        if not isinstance(params, SamplingParams):
            raise InvalidArgument(f"params: expected SamplingParams, got {type(params).__name__}")
        if validate:
            if not isinstance(target_logits, torch.Tensor):
                raise InvalidArgument(f"target_logits: expected a torch.Tensor, got {type(target_logits).__name__}")
            batch_size = node_tokens.shape[0] if isinstance(node_tokens, torch.Tensor) else 0
            params.check_batch_size(batch_size)
            self.check_params(params, batch_size)
            target_probs = _processed("target_logits", target_logits, params, self.processing_order)
            draft_probs = None
            if draft_logits is not None:
                draft_probs = _processed("draft_logits", draft_logits, self.drafting_params(params), self.processing_order)
            check_tree_inputs(tree, node_tokens, draft_probs, target_probs, self.draft_schemes, who=repr(self.name))
            self.check_supports_tree(tree)
        raw = self._verify_tree_logits(tree, node_tokens, draft_logits, target_logits, params, generator)
        return check_tree_output(raw, tree, node_tokens.shape[0], target_logits.shape[-1], who=self.name)

    # -- the probability entry point (the tree contract): log-probabilities, neutral parameters
    def _verify_tree(self, tree, node_tokens, draft_probs, target_probs, generator) -> TreeVerifyOutput:
        draft_logits = None if draft_probs is None else logits_from_probs(draft_probs)
        raw = self._verify_tree_logits(
            tree, node_tokens, draft_logits, logits_from_probs(target_probs), SamplingParams(), generator
        )
        return check_tree_output(raw, tree, node_tokens.shape[0], target_probs.shape[-1], who=self.name)

    def _verify_tree_logits(self, tree, node_tokens, draft_logits, target_logits, params, generator):  # pragma: no cover
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name!r} {self.engine} {self.engine_version}>"


def _processed(name: str, logits: torch.Tensor, params: SamplingParams, order: ProcessingOrder) -> torch.Tensor:
    """The reference processing of ``logits``, its errors naming the argument."""
    if not isinstance(logits, torch.Tensor) or logits.dim() != 3:
        shape = tuple(logits.shape) if isinstance(logits, torch.Tensor) else type(logits).__name__
        raise InvalidArgument(f"{name}: expected shape [batch_size, num_nodes, vocab_size], got {shape}")
    try:
        return process_logits(logits, params, order)
    except InvalidArgument as exc:
        message = str(exc)
        raise InvalidArgument(f"{name}: {message[len('logits: '):] if message.startswith('logits: ') else message}") from None
