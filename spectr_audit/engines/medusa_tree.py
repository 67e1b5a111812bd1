"""Medusa's tree verification, ``medusa.model.utils.evaluate_posterior``, from the ``medusa-llm`` package.

Supported signature (medusa-llm 0.1, pure torch)::

    evaluate_posterior(logits,               # [num_paths, num_heads + 1, V] target logits along each path
                       candidates,           # [num_paths, num_heads + 1] tokens along each path (column 0: the root)
                       temperature,          # 0: greedy matching; > 0: typical acceptance
                       posterior_threshold,  # epsilon of typical acceptance (medusa_generate: 0.09)
                       posterior_alpha)      # delta, its entropy-scaled threshold (medusa_generate: 0.3)
        -> (best_candidate, accept_length)

Typical acceptance accepts a candidate token x when its target probability at temperature T
exceeds ``min(posterior_threshold, posterior_alpha * exp(-entropy))`` (``medusa/model/utils.py:314``,
``posterior_mask = candidates_prob > threshold``); the longest accepted prefix wins (ties to the
most likely).  There is no random draw anywhere: the token after the accepted prefix is the next
step's ``generate_candidates``' ``torch.argmax(logits[:, -1])`` (``utils.py:213``) at the accepted
node, at every temperature.  Medusa is declared lossy (typical acceptance, by design): its README
relaxes "the requirement of matching the distribution of the original model", so the audits'
TVs at T > 0 measure a declared loss, not a defect.

The adapter drives, per batch row (the engine handles one sequence), one step of
``medusa_generate``: ``generate_medusa_buffers`` of ``medusa_choices`` (cached); the Medusa
heads' logits from the draft logits (head ``d``: the draft row of the first node of depth ``d``;
Medusa's heads read the root context only, so every node of one depth has the same children);
``generate_candidates`` (the cartesian product of each head's top-k; the adapter checks that
it reproduces the node tokens); ``tree_decoding`` with the target's logits at every node in
place of the model; ``evaluate_posterior``; and the next token as ``update_inference_inputs``
and the next ``generate_candidates`` pick it.

Trees: ``medusa_choices = [1, k_1, ..., k_H]`` (the root's one token, then each head's top-k)
gives :meth:`DraftTree.cartesian` ``([k_1, ..., k_H])``; :func:`shipped_trees` reads the
default of ``MedusaModel.medusa_generate`` at run time (0.1: ``[1, 7, 6]``, 49 draft nodes).

Installing: ``pip install --no-deps medusa-llm==0.1`` (its declared dependencies pin fschat and
others the verification does not import).
"""

from __future__ import annotations

import importlib.metadata
import inspect
from typing import Optional

import torch

from spectr_audit.contract.sampling import ProcessingOrder, SamplingParams
from spectr_audit.contract.tree import DraftTree
from spectr_audit.contract.tree_verifier import TreeVerifyOutput
from spectr_audit.engines._tree import EngineTreeVerifier
from spectr_audit.engines.rng import engine_random_state
from spectr_audit.errors import InvalidArgument, VerifierError

__all__ = ["MEDUSA_ORDER", "MedusaTreeVerifier", "shipped_trees"]

#: Medusa's sampler: ``softmax(logits / temperature)``, greedy (argmax) at temperature 0.
MEDUSA_ORDER = ProcessingOrder(
    "medusa", ("temperature",),
    description="Medusa 0.1 evaluate_posterior: softmax(logits / temperature); temperature 0 greedy",
)


def _generate_defaults() -> dict:
    from medusa.model.medusa_model import MedusaModel

    parameters = inspect.signature(MedusaModel.medusa_generate).parameters
    return {name: parameters[name].default for name in ("medusa_choices", "posterior_threshold", "posterior_alpha")}


def shipped_trees() -> dict[str, DraftTree]:
    """Medusa's default tree, ``medusa_generate``'s ``medusa_choices``, read from the installed package.

    Examples
    --------
    >>> shipped_trees()["medusa_choices=[1, 7, 6]"].num_draft_nodes   # doctest: +SKIP
    49
    """
    choices = list(_generate_defaults()["medusa_choices"])
    return {f"medusa_choices={choices}": DraftTree.cartesian(choices[1:])}


def medusa_choices(tree: DraftTree) -> Optional[list]:
    """``[1, k_1, ..., k_H]`` when ``tree`` is :meth:`DraftTree.cartesian` ``([k_1, ..., k_H])``, else None."""
    widths = []
    node = 0
    for _ in range(tree.max_depth):
        widths.append(len(tree.children[node]))
        node = tree.children[node][0]
    return [1] + widths if DraftTree.cartesian(widths) == tree else None


class MedusaTreeVerifier(EngineTreeVerifier):
    """Audit Medusa 0.1's ``evaluate_posterior`` (typical acceptance) on its cartesian trees.

    Parameters
    ----------
    posterior_threshold, posterior_alpha : float, optional
        Typical acceptance's epsilon and delta; default: ``medusa_generate``'s defaults.
    num_threads : int or None
        ``torch.set_num_threads`` during the row loop (default 1).

    Notes
    -----
    Only the temperature applies (Medusa 0.1 has no top-k, top-p or min-p).  The drafts are the
    heads' top-k (scheme ``"topk"``); verification reads no draft probability.
    """

    name = "medusa"
    description = ("Medusa 0.1 evaluate_posterior (medusa-llm), typical acceptance on cartesian trees "
                   "(declared lossy, by design)")
    engine = "medusa-llm"
    declared_lossy = "typical acceptance, by design"
    draft_schemes = ("topk",)
    processing_order = MEDUSA_ORDER

    def __init__(self, posterior_threshold: Optional[float] = None, posterior_alpha: Optional[float] = None,
                 num_threads: Optional[int] = 1):
        try:
            from medusa.model import utils

            defaults = _generate_defaults()
        except ImportError as exc:
            raise ImportError(f"medusa adapter: pip install --no-deps medusa-llm==0.1 ({exc})") from exc
        self._utils = utils
        self.posterior_threshold = defaults["posterior_threshold"] if posterior_threshold is None else posterior_threshold
        self.posterior_alpha = defaults["posterior_alpha"] if posterior_alpha is None else posterior_alpha
        for name in ("posterior_threshold", "posterior_alpha"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise InvalidArgument(f"{name}: expected a positive number, got {value!r}")
        self.engine_version = importlib.metadata.version("medusa-llm")
        self.num_threads = num_threads
        self._buffers: dict = {}

    def supports_tree(self, tree: DraftTree) -> bool:
        return medusa_choices(tree) is not None

    def check_params(self, params: SamplingParams, batch_size: int) -> None:
        size = max(batch_size, 1)
        for name, neutral in (("top_k", 0), ("top_p", 1.0), ("min_p", 0.0)):
            if not bool((params.column(name, size) == neutral).all()):
                raise InvalidArgument(f"params: {name} is not supported by Medusa 0.1 (temperature only)")

    def is_deterministic(self, params: SamplingParams, batch_size: int = 1) -> bool:
        return True

    def _tree_buffers(self, tree: DraftTree) -> dict:
        if tree not in self._buffers:
            choices = medusa_choices(tree)
            buffers = self._utils.generate_medusa_buffers(choices, device="cpu")
            buffers["medusa_topk"] = choices[1:]
            # head d's draft row: the first node of depth d (every node of one depth has the same children)
            buffers["head_rows"] = [tree.level(d)[0] for d in range(tree.max_depth)]
            self._buffers[tree] = buffers
        return self._buffers[tree]

    def _verify_row(self, buffers, tokens, draft_logits, target_logits, temperature):
        utils = self._utils
        vocab_size = target_logits.shape[-1]
        medusa_logits = draft_logits[buffers["head_rows"]].float().view(-1, 1, 1, vocab_size)  # [heads, 1, 1, V]
        root_logits = torch.zeros(1, 1, vocab_size)
        root_logits[0, 0, tokens[0]] = 1.0  # its argmax is the root's token, the previous step's last
        candidates, tree_candidates = utils.generate_candidates(
            medusa_logits, root_logits, buffers["medusa_topk"], buffers["tree_indices"], temperature
        )
        if not torch.equal(tree_candidates[0, 1:], tokens[1:]):
            raise InvalidArgument(
                f"node_tokens: Medusa's heads propose {tree_candidates[0, 1:].tolist()} (each depth's top-k of its "
                f"head's draft row), not the given {tokens[1:].tolist()}"
            )
        num_heads = len(buffers["medusa_topk"])

        def target_model(*args, **kwargs):  # tree_decoding's model call: (medusa_logits, outputs, logits)
            return torch.zeros(num_heads, 1, tokens.numel(), vocab_size), None, target_logits.float().unsqueeze(0)

        _, logits, _ = utils.tree_decoding(target_model, tree_candidates, None, buffers["medusa_position_ids"],
                                           torch.zeros(1, 1, dtype=torch.int64), buffers["retrieve_indices"])
        best_candidate, accept_length = utils.evaluate_posterior(
            logits, candidates, temperature, self.posterior_threshold, self.posterior_alpha
        )
        best_candidate, accept_length = int(best_candidate), int(accept_length)
        # update_inference_inputs keeps the logits at the accepted node; the next generate_candidates
        # takes their argmax as the next step's first token
        next_logits = logits[None, best_candidate, accept_length : accept_length + 1]
        _, next_candidates = utils.generate_candidates(
            medusa_logits, next_logits, buffers["medusa_topk"], buffers["tree_indices"], temperature
        )
        node = int(buffers["retrieve_indices"][best_candidate, accept_length])
        if node < 0:
            raise VerifierError(f"medusa: path {best_candidate} has no node at depth {accept_length}")
        return node, int(next_candidates[0, 0])

    def _verify_tree_logits(self, tree, node_tokens, draft_logits, target_logits, params, generator) -> TreeVerifyOutput:
        if draft_logits is None:
            raise InvalidArgument("draft_logits: Medusa's candidates come from its heads' logits; got None")
        batch_size = node_tokens.shape[0]
        buffers = self._tree_buffers(tree)
        tokens, draft, target = node_tokens.cpu(), draft_logits.cpu(), target_logits.cpu()
        temperatures = params.column("temperature", batch_size).tolist()
        accepted_node = torch.empty(batch_size, dtype=torch.int64)
        next_token = torch.empty(batch_size, dtype=torch.int64)
        # Medusa draws nothing at random; the block only pins the thread count (and would seed a draw)
        with engine_random_state(generator, numpy=False, num_threads=self.num_threads):
            for row in range(batch_size):
                accepted_node[row], next_token[row] = self._verify_row(
                    buffers, tokens[row], draft[row], target[row], temperatures[row]
                )
        device = node_tokens.device
        return TreeVerifyOutput(accepted_node.to(device), next_token.to(device))
