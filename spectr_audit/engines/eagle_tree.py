"""EAGLE-1's tree verification, ``eagle.model.utils.evaluate_posterior``, from the ``eagle-llm`` package.

Supported signature (eagle-llm 1.2.1, pure torch)::

    evaluate_posterior(logits,                # [num_paths, max_depth + 1, V] target logits along each path
                       candidates,            # [num_paths, max_depth + 1] tokens along each path, -1 after its end
                       logits_processor,      # prepare_logits_processor(temperature, 0, top_p, top_k), None: greedy
                       cart_candidates_prob,  # [num_paths, max_depth + 1] draft probability of each token
                       op,                    # per depth: [internal nodes of that depth, V] processed draft laws
                       p_indices, tree_candidates, b_indices)  # tree buffers, the tree's tokens
        -> (best_candidate, accept_length, sample_p)           # the path, the accepted draft tokens, the
                                                               # law the next token is drawn from

The adapter drives, per batch row (the engine handles one sequence), the engine's own pipeline of
one step: ``prepare_logits_processor`` from the sampling parameters; ``generate_tree_buffers`` of
the tree's path list (cached per tree); the drafter's output in EAGLE's layout (``ss_token``,
``ss_prob``, ``ss_op`` of ``cnets.Model.topK_genrate``: each node's children tokens, their
sampled probabilities and the processed draft law); ``generate_candidates``; ``tree_decoding``
with the target's logits at every node in place of the model; ``evaluate_posterior``; and the
next-token draw of ``update_inference_inputs`` (``torch.multinomial(sample_p, 1)``, or the argmax
when greedy).

Drafting (``cnets.Model.sample``): with a logits processor the children of a node are drawn
*without replacement* from the processed draft law, ``softmax(logits_processor(logits))``, and
child ``r``'s ``ss_prob`` is its conditional probability ``q(x_r) / (1 - q(x_0) - ... -
q(x_{r-1}))`` (clamped to [0, 1], non-finite values to 0, as ``sample`` computes it); greedy
(temperature <= 1e-5, no processor) the children are the top-k of the raw logits.  The adapter
computes ``ss_prob`` with that formula from the processed draft logits it is given, so sibling
ranks must be contiguous (``0 .. k - 1``: the drafter's earlier draws are the earlier siblings).

A finding the adapter shows as shipped (eagle-llm 1.2.1): when the walk takes the ``else`` branch of
``if adjustflag and accept_length != candidates.shape[1]:`` (``eagle/model/utils.py:407``) because
the path is accepted to the tree's full depth, or the walk stops where no child was tried and
rejected, ``sample_p`` is ``torch.softmax(logits[best_candidate, accept_length - 1], dim=0)``
(``:410-411``), without the logits processor.  With any processor active (temperature != 1,
top-p < 1 or top-k > 0) that token ignores it.  Upstream applied the processor on that line for
EAGLE-2/3 in commit bf10ac5; the EAGLE-1 wheel (upstream's ``v1`` branch) keeps it
(docs/historic-bugs.md entry 33; ``tests/engines/test_tree_engines.py``, ``EAGLE_BONUS``).

Randomness: ``evaluate_posterior`` draws one acceptance coin per tried child from Python's
``random``; the next token comes from ``torch.multinomial``.  Both are seeded from the audit's
generator and restored afterwards (:func:`spectr_audit.engines.rng.engine_random_state`).

Shipped trees: ``eagle.model.choices`` (read at run time by :func:`shipped_trees`; 1.2.1 ships
``mc_sim_7b_63``, 25 draft nodes, depth 5).

Installing: ``pip install --no-deps eagle-llm==1.2.1`` (its declared dependencies include CUDA
builds and pinned versions; the verification needs only torch and the transformers logits warpers).
"""

from __future__ import annotations

import importlib.metadata
from typing import Optional

import torch

from spectr_audit.contract.sampling import PROCESSING_ORDERS, SamplingParams
from spectr_audit.contract.tree import DraftTree
from spectr_audit.contract.tree_verifier import TreeVerifyOutput
from spectr_audit.engines._tree import EngineTreeVerifier, contiguous_ranks
from spectr_audit.engines.rng import engine_random_state
from spectr_audit.errors import InvalidArgument, VerifierError

__all__ = ["EagleTreeVerifier", "shipped_trees"]

#: EAGLE samples only above this temperature (``prepare_logits_processor``: ``temperature > 1e-5``).
GREEDY_TEMPERATURE = 1e-5


def shipped_trees() -> dict[str, DraftTree]:
    """The trees ``eagle.model.choices`` ships, by name, read from the installed package.

    Examples
    --------
    >>> trees = shipped_trees()                        # doctest: +SKIP
    >>> trees["mc_sim_7b_63"].num_draft_nodes          # doctest: +SKIP
    25
    """
    from eagle.model import choices

    return {
        name: DraftTree.from_paths(value)
        for name, value in vars(choices).items()
        if not name.startswith("_") and isinstance(value, list) and value and all(isinstance(p, list) for p in value)
    }


def _conditional_probs(processed: torch.Tensor, children: torch.Tensor) -> torch.Tensor:  # [rows, k]
    """``ss_prob`` of ``cnets.Model.sample``: each draw's probability given the earlier draws."""
    sampled = processed.gather(1, children)
    cumulative = torch.cumsum(sampled, dim=1)
    cumulative = torch.cat((torch.zeros(cumulative.shape[0], 1, dtype=cumulative.dtype), cumulative[:, :-1]), dim=-1)
    sampled = sampled / (1 - cumulative)
    sampled[torch.isinf(sampled)] = -1
    sampled[torch.isnan(sampled)] = -1
    return torch.clamp(sampled, min=0.0, max=1.0)


class EagleTreeVerifier(EngineTreeVerifier):
    """Audit EAGLE-1's ``evaluate_posterior`` on its trees, through its own logits processing.

    Parameters
    ----------
    num_threads : int or None
        ``torch.set_num_threads`` during the row loop (default 1: the loop of small batch-1 calls
        runs far faster on one thread); ``None`` leaves the setting alone.

    Notes
    -----
    Supported parameters: temperature, top-p, top-k (``prepare_logits_processor``; its order,
    temperature then top-p then top-k, is :data:`~spectr_audit.contract.sampling.PROCESSING_ORDERS`
    ``["eagle"]``); min-p is refused.  Trees: any path list whose sibling ranks are contiguous,
    at most ``eagle.model.utils.TOPK`` (10) children per node.  The audit drafts a node's children
    only from a processed law with at least as many tokens (``draft_tree`` refuses fewer); EAGLE's
    own drafter then draws zero-probability tokens (``torch.multinomial`` without replacement),
    which ``evaluate_posterior`` skips (``qx <= 0``).
    """

    name = "eagle"
    description = "EAGLE-1 evaluate_posterior (eagle-llm), tree verification with its logits processor"
    engine = "eagle-llm"
    draft_schemes = ("without_replacement", "topk")
    processing_order = PROCESSING_ORDERS["eagle"]

    def __init__(self, num_threads: Optional[int] = 1):
        try:
            from eagle.model import utils
        except ImportError as exc:
            raise ImportError(f"eagle adapter: pip install --no-deps eagle-llm==1.2.1 ({exc})") from exc

        self._utils = utils
        self.engine_version = importlib.metadata.version("eagle-llm")
        self.num_threads = num_threads
        self._buffers: dict = {}

    # -- what the audit asks ----------------------------------------------------------------
    def supports_tree(self, tree: DraftTree) -> bool:
        return contiguous_ranks(tree) and tree.max_children <= self._utils.TOPK

    def check_params(self, params: SamplingParams, batch_size: int) -> None:
        if not bool((params.column("min_p", max(batch_size, 1)) == 0).all()):
            raise InvalidArgument("params: min_p is not supported by EAGLE's prepare_logits_processor")

    def _greedy_rows(self, params: SamplingParams, batch_size: int) -> torch.Tensor:  # [batch_size] bool
        return params.column("temperature", batch_size) <= GREEDY_TEMPERATURE

    def draft_scheme_for(self, params: SamplingParams, batch_size: int = 1) -> str:
        greedy = self._greedy_rows(params, max(batch_size, params.batch_size or 1))
        if bool(greedy.any()) and not bool(greedy.all()):
            raise InvalidArgument("params: EAGLE drafts top-k when greedy and samples otherwise; mix no greedy and "
                                  "sampled rows in one audit")
        return "topk" if bool(greedy.all()) else "without_replacement"

    def drafting_params(self, params: SamplingParams) -> SamplingParams:
        greedy = self._greedy_rows(params, params.batch_size or 1)
        return SamplingParams() if bool(greedy.all()) else params

    def is_deterministic(self, params: SamplingParams, batch_size: int = 1) -> bool:
        return bool(self._greedy_rows(params, max(batch_size, params.batch_size or 1)).all())

    # -- the engine's buffers -----------------------------------------------------------------
    def _tree_buffers(self, tree: DraftTree) -> dict:
        if tree not in self._buffers:
            paths = [list(p) for p in tree.to_paths()]
            buffers = self._utils.generate_tree_buffers(paths, device="cpu")
            internal = list(tree.internal_nodes)
            buffers["internal"] = internal
            slot = {n: i for i, n in enumerate(internal)}
            # ss_op of topK_genrate: one [internal nodes of that depth, V] block per depth
            buffers["op_rows"] = [[slot[n] for n in internal if tree.depths[n] == d] for d in range(tree.max_depth)]
            width = tree.max_children
            children = torch.full((len(internal), width), -1, dtype=torch.int64)
            for row, node in enumerate(internal):
                children[row, : len(tree.children[node])] = torch.tensor(tree.children[node])
            buffers["children"], buffers["children_mask"] = children, children >= 0
            self._buffers[tree] = buffers
        return self._buffers[tree]

    def _processor(self, temperature: float, top_p: float, top_k: int):
        # EAGLE's own builder; top_p 1 and top_k 0 add no warper, as in the engine's defaults
        return self._utils.prepare_logits_processor(temperature=temperature, top_p=top_p, top_k=top_k)

    def _draft_outputs(self, tree, buffers, tokens, draft_logits, processor):
        """``(ss_token, ss_prob, processed)`` of ``topK_genrate`` for a batch of drafted trees.

        ``ss_token``, ``ss_prob``: ``[batch_size, num_internal, TOPK]``, each internal node's children
        tokens and sampled probabilities in rank order (columns past the children are never read);
        ``processed``: ``[batch_size, num_internal, V]`` draft laws, None when greedy.
        """
        topk = self._utils.TOPK
        kids, mask = buffers["children"], buffers["children_mask"]  # [num_internal, max_children]
        batch_size, num_internal, max_children = tokens.shape[0], kids.shape[0], kids.shape[1]
        logits = draft_logits[:, buffers["internal"]].float()  # [batch_size, num_internal, V]
        children = tokens[:, kids.clamp(min=0)]  # [batch_size, num_internal, max_children]
        ss_token = torch.zeros(batch_size, num_internal, topk, dtype=torch.int64)
        ss_prob = torch.zeros(batch_size, num_internal, topk, dtype=torch.float32)
        ss_token[:, :, :max_children] = torch.where(mask, children, torch.zeros_like(children))
        processed = None
        if processor is not None:
            flat = logits.reshape(batch_size * num_internal, -1)
            processed = torch.softmax(processor(None, flat), dim=1)
            sampled = _conditional_probs(processed, children.reshape(batch_size * num_internal, max_children))
            ss_prob[:, :, :max_children] = sampled.reshape(batch_size, num_internal, max_children) * mask
            processed = processed.reshape(batch_size, num_internal, -1)
        else:  # greedy: topK_genrate keeps torch.topk's values (raw logits), which verification does not read
            ss_prob[:, :, :max_children] = logits.gather(2, children) * mask
        return ss_token, ss_prob, processed

    def _verify_row(self, buffers, tokens, tree_logits, target_logits, processor):
        utils = self._utils
        sample_token = tokens[:1].view(1, 1)  # the last verified token, the root's
        cart_candidates, cart_candidates_prob, tree_candidates = utils.generate_candidates(
            tree_logits, buffers["tree_indices"], buffers["retrieve_indices"], sample_token, processor
        )

        def target_model(*args, **kwargs):  # tree_decoding's model call: (outputs, tree_logits, hidden_state)
            return None, target_logits.float().unsqueeze(0), None

        input_ids = torch.zeros(1, 1, dtype=torch.int64)
        logits, _, _ = utils.tree_decoding(target_model, tree_candidates, None, buffers["tree_position_ids"],
                                           input_ids, buffers["retrieve_indices"])
        best_candidate, accept_length, sample_p = utils.evaluate_posterior(
            logits, cart_candidates, processor, cart_candidates_prob, tree_logits[2], buffers["p_indices"],
            tree_candidates, buffers["b_indices"],
        )
        # update_inference_inputs: the next token
        if processor is not None:
            next_token = int(torch.multinomial(sample_p, 1))
        else:
            next_token = int(torch.argmax(sample_p))
        node = int(buffers["retrieve_indices"][int(best_candidate), int(accept_length)])
        if node < 0:
            raise VerifierError(f"eagle: path {int(best_candidate)} has no node at depth {int(accept_length)}")
        return node, next_token

    def _verify_tree_logits(self, tree, node_tokens, draft_logits, target_logits, params, generator) -> TreeVerifyOutput:
        batch_size = node_tokens.shape[0]
        if draft_logits is None:
            raise InvalidArgument("draft_logits: EAGLE's verification reads the draft probabilities; got None")
        buffers = self._tree_buffers(tree)
        tokens = node_tokens.cpu()
        draft = draft_logits.cpu()  # [batch_size, num_nodes, vocab_size]
        target = target_logits.cpu()  # [batch_size, num_nodes, vocab_size]
        columns = [params.column(name, batch_size).tolist() for name in ("temperature", "top_p", "top_k")]
        keys = [tuple(column[row] for column in columns) for row in range(batch_size)]
        accepted_node = torch.empty(batch_size, dtype=torch.int64)
        next_token = torch.empty(batch_size, dtype=torch.int64)
        with engine_random_state(generator, numpy=False, num_threads=self.num_threads):
            # rows of one setting share one logits processor (one generation's, in the engine)
            groups: dict = {}
            for row, key in enumerate(keys):
                groups.setdefault(key, []).append(row)
            drafted = {}
            for key, rows in groups.items():
                processor = self._processor(key[0], key[1], int(key[2]))
                drafted[key] = (processor, rows, self._draft_outputs(tree, buffers, tokens[rows], draft[rows], processor))
            position = {row: (key, i) for key, rows in groups.items() for i, row in enumerate(rows)}
            # one row at a time, in batch order, as the engine's batch-1 loop: the coins follow that order
            for row in range(batch_size):
                key, i = position[row]
                processor, _, (ss_token, ss_prob, processed) = drafted[key]
                ss_op = None if processed is None else [processed[i, rows_at] for rows_at in buffers["op_rows"]]
                tree_logits = (ss_token[i], ss_prob[i], ss_op)
                accepted_node[row], next_token[row] = self._verify_row(buffers, tokens[row], tree_logits, target[row],
                                                                       processor)
        device = node_tokens.device
        return TreeVerifyOutput(accepted_node.to(device), next_token.to(device))
