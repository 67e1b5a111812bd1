"""SGLang's EAGLE tree verification on its CPU-engine / XPU greedy route, Triton kernels run interpreted.

What SGLang 0.5.23 does in ``eagle_utils.eagle_sample`` (EAGLE's verify step, also NGRAM's):

* the route: ``_verify_uses_greedy(is_all_greedy, is_cpu, is_hip, is_xpu, use_rejection_sampling)``
  is ``is_all_greedy or is_cpu or is_xpu or (is_hip and not use_rejection_sampling)``
  (``sglang/srt/speculative/eagle_utils.py:500``, called at ``:641-647``).  Three configurations
  verify *every* batch greedily, whatever the requests' temperatures: SGLang's CPU engine
  (``is_cpu()``, ``sglang/srt/utils/common.py:221-224``: ``SGLANG_USE_CPU_ENGINE=1`` on an x86-64 or
  arm64 host); XPU (``torch.xpu.is_available()``, ``common.py:173-174``); and HIP/ROCm
  (``torch.version.hip is not None``, ``common.py:141-142``) without
  ``--speculative-use-rejection-sampling``.  0.5.23 turns that option on by default on HIP only
  for plain EAGLE with ``speculative_eagle_topk = 1``, no token map, accept thresholds 1.0, no
  deterministic inference and no ``SGLANG_SIMULATE_ACC_LEN``
  (``_handle_eagle_family``, ``sglang/srt/arg_groups/speculative_hook.py:53-63, 1187-1201``);
  other HIP configurations (EAGLE3, top-k > 1, a token map, ...) stay greedy unless it is set by
  hand.  A host merely without CUDA is none of these: without ``SGLANG_USE_CPU_ENGINE=1``
  ``is_cpu`` is False, and NPU and MUSA do not enter the predicate.  ``is_all_greedy`` is
  ``all(top_k <= 1)`` after ``SamplingParams`` turns a temperature below 1e-6 into ``top_k = 1``.
  The sampling route, ``tree_speculative_sampling_target_only``, is a CUDA kernel JIT-compiled
  from ``sampling.cuh`` and does not run here;
* the greedy route: ``target_predict = torch.argmax(next_token_logits, dim=-1)`` and
  ``verify_tree_greedy_func``, whose Triton implementation (the XPU backend's;
  ``verify_tree_greedy_triton``) this adapter runs (the CPU backend runs sgl-kernel's C++ port of
  the same walk, not on PyPI for CPUs): from the root, follow ``retrieve_next_token`` /
  ``retrieve_next_sibling`` to the child whose token is the target's argmax, and emit the argmax
  at the last accepted node.

Supported signature::

    verify_tree_greedy_triton(predicts,             # [batch_size * (N + 1)] int32, out: token at each node slot
                              accept_index,         # [batch_size, max_depth + 1] int32, out: accepted slots
                              accept_token_num,     # [batch_size] int32, out: accepted draft tokens
                              candidates,           # [batch_size, N + 1]: the root's token, then the drafts
                              retrieve_index,       # [batch_size, N + 1] global slot of each node
                              retrieve_next_token,  # [batch_size, N + 1] first child, -1 for none
                              retrieve_next_sibling,  # [batch_size, N + 1] next sibling, -1 for none
                              target_predict)       # [batch_size, N + 1] the target's argmax at each node

Trees (SGLang's top-k x depth drafting, ``speculative_eagle_topk = k``, ``speculative_num_steps =
D``, ``speculative_num_draft_tokens = N + 1``): the layout comes from SGLang's own tree builder,
``sgl_build_tree_kernel_triton``, given the drafter's ``parent_list`` and ``top_scores_index``
(``organize_draft_results``).  The adapter takes the trees whose shape does not depend on the
draft scores: ``DraftTree.topk_depth(k, D)`` with every candidate kept, for ``D <= 2`` or
``k = 1`` (a chain); deeper beams keep a score-dependent subtree.

The route predicate is compiled from the installed ``sglang/srt/speculative/eagle_utils.py``
(the module itself imports SGLang's server stack, torchvision among it, which ``--no-deps``
does not install); the kernels come from ``sglang.kernels.ops.speculative.spec_tree``.
``TRITON_INTERPRET=1`` must be set before Triton is first imported (the adapter sets it, and
refuses to run when Triton was imported without it, as :mod:`~spectr_audit.engines.sglang_chain`).

Installing: ``pip install triton && pip install --no-deps "sglang>=0.5.23"``.
"""

from __future__ import annotations

import ast
import importlib.util
import os
from pathlib import Path
from typing import Optional

import torch

from spectr_audit.contract.sampling import PROCESSING_ORDERS, SamplingParams
from spectr_audit.contract.tree import DraftTree
from spectr_audit.contract.tree_verifier import TreeVerifyOutput
from spectr_audit.engines._tree import EngineTreeVerifier
from spectr_audit.errors import InvalidArgument, VerifierError

__all__ = ["SGLangTreeVerifier", "sglang_tree_arguments", "shipped_trees"]


def shipped_trees() -> dict[str, DraftTree]:
    """SGLang's score-independent top-k x depth trees used by the audits (SGLang ships no fixed list).

    ``topk=1, steps=3`` is SGLang's most common EAGLE configuration (4 draft tokens: a chain).
    """
    return {
        "topk=1,steps=3": DraftTree.topk_depth(1, 3),
        "topk=2,steps=2": DraftTree.topk_depth(2, 2),
        "topk=4,steps=2": DraftTree.topk_depth(4, 2),
    }


def sglang_tree_arguments(tree: DraftTree) -> Optional[tuple[int, int, torch.Tensor, torch.Tensor]]:
    """``(topk, num_steps, parent_list [1, P], top_scores_index [1, N])`` of SGLang's drafter for ``tree``.

    None when ``tree`` is not a score-independent SGLang tree (see the module docstring).  The
    drafter's candidates are numbered step by step: step 0's ``k`` children of the root, then for
    each later step ``i`` the ``k * k`` children of that step's beam of ``k`` nodes,
    ``k + (i - 1) k^2 + b k + r`` for beam node ``b``'s child of rank ``r``; ``parent_list``
    concatenates ``arange(-1, k)`` (step 0) and each later step's beam candidates but the last
    (``_select_top_k_tokens_first`` / ``_later``, ``organize_draft_results``).

    Examples
    --------
    >>> topk, steps, parents, selected = sglang_tree_arguments(DraftTree.topk_depth(2, 2))
    >>> topk, steps, parents.tolist(), selected.tolist()
    (2, 2, [[-1, 0, 1]], [[0, 1, 2, 3, 4, 5]])
    >>> sglang_tree_arguments(DraftTree.chains(1, 3))[2].tolist()
    [[-1, 0, 1]]
    """
    topk, depth = len(tree.children[0]), tree.max_depth
    if tree != DraftTree.topk_depth(topk, depth) or not (depth <= 2 or topk == 1):
        return None
    if depth == 1:
        parent_list = torch.empty(1, 0, dtype=torch.int64)
    elif topk == 1:
        # every step's beam is its only candidate, number i - 1 at step i
        parent_list = torch.arange(-1, depth - 1, dtype=torch.int64).unsqueeze(0)
    else:
        parent_list = torch.arange(-1, topk, dtype=torch.int64).unsqueeze(0)
    # every candidate is kept: the top scores are all of them, in index order
    return topk, depth, parent_list, torch.arange(tree.num_draft_nodes, dtype=torch.int64).unsqueeze(0)


def _route_predicate():
    """``_verify_uses_greedy`` compiled from the installed ``eagle_utils.py`` (a pure function of four flags)."""
    spec = importlib.util.find_spec("sglang")
    if spec is None or not spec.submodule_search_locations:
        raise ImportError("sglang is not installed")
    path = Path(list(spec.submodule_search_locations)[0]) / "srt" / "speculative" / "eagle_utils.py"
    module = ast.parse(path.read_text(), str(path))
    found = [node for node in module.body if isinstance(node, ast.FunctionDef) and node.name == "_verify_uses_greedy"]
    if not found:
        raise ImportError(f"sglang: {path} has no _verify_uses_greedy; this adapter knows SGLang 0.5.23's verify route")
    namespace: dict = {}
    exec(compile(ast.Module(body=found, type_ignores=[]), str(path), "exec"), namespace)
    return namespace["_verify_uses_greedy"]


class SGLangTreeVerifier(EngineTreeVerifier):
    """Audit SGLang's EAGLE tree verification on its XPU or CPU-engine route (its Triton kernels, interpreted).

    Parameters
    ----------
    platform : {"xpu", "cpu"}
        The backend whose route is taken (``is_xpu``, or ``is_cpu``, i.e. ``SGLANG_USE_CPU_ENGINE=1``, in
        SGLang's route predicate); both verify greedily and run the same walk.

    Notes
    -----
    Sampling parameters go through SGLang's own ``SamplingParams`` (temperature below 1e-6 is
    greedy, ``top_k = 1``), then the route.  The law it is held to is SGLang's non-speculative
    sampler (:data:`~spectr_audit.contract.sampling.PROCESSING_ORDERS` ``["sglang"]``).
    """

    name = "sglang-tree"
    description = ("SGLang EAGLE tree verify on the CPU engine / XPU greedy route: route predicate, "
                   "verify_tree_greedy_triton (Triton interpreter)")
    engine = "sglang"
    draft_schemes = ("topk", "none")
    processing_order = PROCESSING_ORDERS["sglang"]

    def __init__(self, platform: str = "xpu"):
        if platform not in ("xpu", "cpu"):
            raise InvalidArgument(
                f"platform: expected 'xpu' or 'cpu', got {platform!r} (the CUDA route's sampling kernel is "
                f"JIT-compiled CUDA and does not run here)"
            )
        os.environ.setdefault("TRITON_INTERPRET", "1")
        import triton.language as tl

        if type(tl.sum).__name__ != "InterpretedFunction":
            raise ImportError(
                "sglang-tree adapter: Triton was imported before TRITON_INTERPRET=1 was set, so its kernels "
                "cannot run on this CPU; start Python with TRITON_INTERPRET=1"
            )
        import sglang
        from sglang.kernels.ops.speculative import spec_tree
        from sglang.srt.sampling.sampling_params import SamplingParams as SGLangSamplingParams

        self._spec_tree = spec_tree
        self._request_params = SGLangSamplingParams
        self._uses_greedy = _route_predicate()
        self.platform = platform
        self.engine_version = sglang.__version__
        self._layouts: dict = {}

    # -- what the audit asks ----------------------------------------------------------------
    def supports_tree(self, tree: DraftTree) -> bool:
        return sglang_tree_arguments(tree) is not None

    def check_params(self, params: SamplingParams, batch_size: int) -> None:
        self._route(params, max(batch_size, 1))  # SGLang's SamplingParams validates them

    def is_deterministic(self, params: SamplingParams, batch_size: int = 1) -> bool:
        return self._route(params, max(batch_size, params.batch_size or 1))

    def _route(self, params: SamplingParams, batch_size: int) -> bool:
        """SGLang's route for a batch of requests with ``params``: True for the greedy verification."""
        columns = {name: params.column(name, batch_size).tolist() for name in ("temperature", "top_k", "top_p", "min_p")}
        top_ks = []
        for row in range(batch_size):
            request = self._request_params(
                temperature=columns["temperature"][row], top_p=columns["top_p"][row],
                top_k=int(columns["top_k"][row]) or -1, min_p=columns["min_p"][row],
            )
            top_ks.append(request.top_k)
        is_all_greedy = all(k <= 1 for k in top_ks)  # SamplingBatchInfo.from_schedule_batch
        return self._uses_greedy(is_all_greedy=is_all_greedy, is_cpu=self.platform == "cpu", is_hip=False,
                                 is_xpu=self.platform == "xpu", use_rejection_sampling=False)

    # -- the engine's tree layout -----------------------------------------------------------
    def _layout(self, tree: DraftTree):
        """``retrieve_index, retrieve_next_token, retrieve_next_sibling`` of one request, from SGLang's builder."""
        if tree not in self._layouts:
            topk, steps, parent_list, selected = sglang_tree_arguments(tree)
            num_tokens = tree.num_nodes
            seq_lens = torch.tensor([1], dtype=torch.int64)
            tree_mask = torch.ones(num_tokens * num_tokens, dtype=torch.bool)  # QLEN_ONLY, the CPU default
            positions = torch.empty(num_tokens, dtype=torch.int64)
            retrieve = torch.full((3, 1, num_tokens), -1, dtype=torch.int64)
            self._spec_tree.sgl_build_tree_kernel_triton(
                parent_list, selected, seq_lens, tree_mask, positions, retrieve[0], retrieve[1], retrieve[2],
                topk, steps, num_tokens, self._spec_tree.TreeMaskMode.QLEN_ONLY,
            )
            self._layouts[tree] = retrieve[:, 0].clone()
        return self._layouts[tree]

    def _verify_tree_logits(self, tree, node_tokens, draft_logits, target_logits, params, generator) -> TreeVerifyOutput:
        batch_size, num_tokens = node_tokens.shape
        if not self._route(params, batch_size):  # pragma: no cover - the XPU and CPU-engine routes are greedy
            raise VerifierError("sglang-tree: the route asks for the CUDA sampling kernel")
        layout = self._layout(tree)
        offsets = (torch.arange(batch_size, dtype=torch.int64) * num_tokens).unsqueeze(1)
        retrieve_index = (layout[0].unsqueeze(0) + offsets).contiguous()  # global slots, as the builder numbers them
        next_token = layout[1].expand(batch_size, -1).contiguous()
        next_sibling = layout[2].expand(batch_size, -1).contiguous()
        candidates = node_tokens.cpu().contiguous()
        target_predict = torch.argmax(target_logits.cpu(), dim=-1).contiguous()  # eagle_sample's greedy route
        predicts = torch.zeros(batch_size * num_tokens, dtype=torch.int32)
        accept_index = torch.full((batch_size, tree.max_depth + 1), -1, dtype=torch.int32)
        accept_token_num = torch.empty(batch_size, dtype=torch.int32)
        self._spec_tree.verify_tree_greedy_triton(
            predicts, accept_index, accept_token_num, candidates, retrieve_index, next_token, next_sibling,
            target_predict,
        )
        num_accepted = accept_token_num.to(torch.int64)
        slots = accept_index.to(torch.int64).gather(1, num_accepted.unsqueeze(1)).squeeze(1)
        if bool((slots < 0).any()):
            raise VerifierError("sglang-tree: accept_index has no slot for the last accepted node")
        accepted_node = slots - offsets.squeeze(1)
        final = predicts.to(torch.int64)[slots]
        device = node_tokens.device
        return TreeVerifyOutput(accepted_node.to(device), final.to(device))
