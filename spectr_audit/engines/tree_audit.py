"""Audit a tree-engine adapter at given sampling parameters: the law of the engine's sampler is the reference.

The draft and target models give the *raw* next-token laws (the softmax of the models' logits).
One audited step after ``prefix``:

1. the tree is drafted under the engine's draft scheme from the draft law the engine's drafter
   uses (:meth:`~spectr_audit.engines._tree.EngineTreeVerifier.drafting_params`: the processed
   law for EAGLE-1's sampling drafter, the raw one for top-k drafters), with
   :func:`spectr_audit.drafting.tree.draft_tree`;
2. the adapter gets the raw logits ``log(model law)`` of both models at every node and the
   parameters, and applies them through the engine's own processing;
3. the emitted string (the accepted path and the next token) is completed to ``D + 1`` tokens
   with samples of the processed target law and compared with the target's string law
   ``q^(D + 1)`` under the parameters (:func:`~spectr_audit.contract.sampling.process_logits` with
   the adapter's processing order): what the engine's non-speculative sampler emits.

Two methods:

``exact``
    when the adapter is deterministic under the parameters (no random draw: greedy EAGLE,
    Medusa's typical acceptance, SGLang's greedy verification) and the drafts are too (schemes
    ``topk`` and ``none``), one run gives the emitted string ``s`` with probability 1, so the law
    of the completed string is ``q`` conditioned on starting with ``s`` and
    ``TV(F, q) = 1 - q(s)`` exactly.  The adapter is run twice with different generators, and a
    difference is reported as a :class:`~spectr_audit.errors.VerifierError`.
``statistical``
    otherwise: ``num_samples`` independent steps, counted on the prefix partition of
    :func:`~spectr_audit.statistical.sampling.build_partition`; a G-test of every prefix depth
    and of the whole partition, and the support test (a string of target probability 0),
    Holm-adjusted: the audit rejects
    exactness when the smallest adjusted p-value is at most ``alpha`` (its false-alarm rate).
    The plug-in TV with its interval at level ``1 - alpha`` is reported too.

Acceptance (the first emitted token is a token of one of the root's children) and the accepted
length (draft tokens kept) are reported against the best any lossless verifier achieves with the
tree and the draft scheme on the processed laws (:func:`spectr_audit.bounds.tree_lp.tree_bound`).

Examples
--------
>>> from spectr_audit.drafting.models import ContextFreeModel
>>> from spectr_audit.contract.sampling import SamplingParams
>>> from spectr_audit.engines.eagle_tree import EagleTreeVerifier          # doctest: +SKIP
>>> result = tree_engine_audit(EagleTreeVerifier(), ContextFreeModel([0.5, 0.3, 0.2]),
...                            ContextFreeModel([0.2, 0.3, 0.5]), DraftTree.from_paths([(0,), (1,), (0, 0)]),
...                            SamplingParams(temperature=0.0))                # doctest: +SKIP
>>> result.method, result.tv                                               # doctest: +SKIP
('exact', 0.0)
"""

from __future__ import annotations

import dataclasses
import math
import time
from typing import Optional, Sequence

import torch

from spectr_audit import defaults
from spectr_audit._validation import check_positive_int, check_prob
from spectr_audit.bounds.tree_lp import tree_bound
from spectr_audit.contract.sampling import ProcessingOrder, SamplingParams
from spectr_audit.contract.tree import DraftTree
from spectr_audit.drafting.models import PAD, Model, contexts_from
from spectr_audit.drafting.processed import ProcessedModel, tree_node_logits
from spectr_audit.drafting.tree import draft_tree
from spectr_audit.engines._tree import EngineTreeVerifier
from spectr_audit.errors import InvalidArgument, VerifierError
from spectr_audit.exact.tree import tree_enumeration_size
from spectr_audit.statistical.confidence import tv_interval
from spectr_audit.statistical.depths import depth_truncations
from spectr_audit.statistical.gof import TestResult, g_test, holm
from spectr_audit.statistical.sampling import build_partition, complete_with_target

__all__ = ["TreeEngineAuditResult", "tree_engine_audit"]

#: An exact audit calls TV below this zero (float64 products along a path).
EXACT_TV_TOLERANCE = 1e-9
#: The tree LP's bound runs only for enumerations up to this many realisations.
MAX_BOUND_REALISATIONS = defaults.TREE_LP_MAX_REALISATIONS


@dataclasses.dataclass(frozen=True)
class TreeEngineAuditResult:
    """One tree-engine audit at one setting.

    Attributes
    ----------
    engine, engine_version, verifier : str
    tree : str
        :meth:`DraftTree.describe`.
    params : dict
        :meth:`SamplingParams.describe` (empty: neutral).
    processing_order : str
        The engine conventions of the reference law.
    draft_scheme : str
    method : {"exact", "statistical"}
    num_samples : int
        Audited steps (1 for the exact method).
    seed, alpha : the audit's seed and false-alarm rate.
    pvalue : float
        Smallest Holm-adjusted p-value (statistical); 1 or 0 for an exact TV of zero or not.
    tv, tv_lower, tv_upper : float
        Exact TV (bounds equal to it), or the plug-in estimate with its interval at ``1 - alpha``.
    tests : tuple of TestResult
        The sub-tests (statistical).
    acceptance, accepted_length : float
        Measured membership acceptance and mean accepted draft tokens.
    best_acceptance : float
        alpha*: the best acceptance of a lossless verifier with this tree and scheme.
    best_accepted_length : float or None
        The best expected accepted length, where a closed form or the LP applies.
    bound_source : str
    seconds : float
    declared_lossy : str
        The adapter's :attr:`~spectr_audit.engines._tree.EngineTreeVerifier.declared_lossy`: non-empty
        where the engine declares itself lossy (Medusa: "typical acceptance, by design").
    """

    engine: str
    engine_version: str
    verifier: str
    tree: str
    params: dict
    processing_order: str
    draft_scheme: str
    method: str
    num_samples: int
    seed: int
    alpha: float
    pvalue: float
    tv: float
    tv_lower: float
    tv_upper: float
    tests: tuple
    acceptance: float
    accepted_length: float
    best_acceptance: float
    best_accepted_length: Optional[float]
    bound_source: str
    seconds: float
    declared_lossy: str = ""

    def rejects(self) -> bool:
        """Whether the audit rejects exactness (the verdict "lossy", or "declared lossy")."""
        if self.method == "exact":
            return self.tv > EXACT_TV_TOLERANCE
        return self.pvalue <= self.alpha

    @property
    def verdict(self) -> str:
        """``"lossy"`` when exactness is rejected (``"declared lossy"`` for an engine that declares itself lossy),
        else ``"lossless"`` (exact) or ``"not rejected"``."""
        if self.rejects():
            return "declared lossy" if self.declared_lossy else "lossy"
        return "lossless" if self.method == "exact" else "not rejected"

    def to_dict(self) -> dict:
        """Plain JSON values."""
        out = dataclasses.asdict(self)
        out["tests"] = [t.to_dict() for t in self.tests]
        out["verdict"] = self.verdict
        return {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in out.items()}


def _emitted(tree: DraftTree, node_tokens: torch.Tensor, accepted_node: torch.Tensor, next_token: torch.Tensor,
             num_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Emitted strings ``[batch_size, num_tokens]`` (PAD after them) and their lengths."""
    batch_size = node_tokens.shape[0]
    path_index = tree.path_index(node_tokens.device)[accepted_node]  # [batch_size, max_depth], -1 padded
    depth = torch.tensor(tree.depths, device=node_tokens.device)[accepted_node]  # [batch_size]
    strings = torch.full((batch_size, num_tokens), PAD, dtype=torch.int64, device=node_tokens.device)
    path_tokens = node_tokens.gather(1, path_index.clamp(min=0))
    strings[:, : tree.max_depth] = torch.where(path_index >= 0, path_tokens, torch.full_like(path_tokens, PAD))
    strings.scatter_(1, depth.unsqueeze(1), next_token.unsqueeze(1))
    return strings, depth + 1


def _bound(draft: Model, target: Model, tree: DraftTree, scheme: str, prefix, lp: bool):
    small = tree_enumeration_size(tree, scheme, draft.vocab_size) <= MAX_BOUND_REALISATIONS
    bound = tree_bound(draft, target, tree, scheme, prefix=tuple(prefix), lp=lp and small)
    source = bound.accepted_length_source
    if bound.accepted_length is None and not small:
        source = f"skipped: more than {MAX_BOUND_REALISATIONS} realisations of the drafts for the tree LP"
    return bound.acceptance, bound.accepted_length, source


def tree_engine_audit(
    verifier: EngineTreeVerifier,
    draft_model: Model,
    target_model: Model,
    tree: DraftTree,
    params: Optional[SamplingParams] = None,
    *,
    prefix: Sequence[int] = (),
    num_samples: int = defaults.CHECK_SAMPLES,
    seed: int = defaults.SEED,
    alpha: float = defaults.ALPHA,
    chunk_size: int = defaults.ENGINE_TREE_CHUNK,
    method: str = "auto",
    bound_lp: bool = True,
) -> TreeEngineAuditResult:
    """Audit ``verifier`` on ``tree`` at ``params`` against the law of the engine's non-speculative sampler.

    Parameters
    ----------
    verifier : EngineTreeVerifier
        A tree-engine adapter (it takes raw logits and sampling parameters).
    draft_model, target_model : Model
        The raw laws (the softmax of each model's logits).
    tree : DraftTree
    params : SamplingParams, optional
        Scalar parameters (neutral by default).
    prefix : sequence of int
        The context before the audited step.
    num_samples : int
        Steps of the statistical method.
    seed : int
        Seeds the drafts, the adapter's generator and the completions.
    alpha : float
        False-alarm rate of the statistical verdict (and level ``1 - alpha`` of its TV interval).
    chunk_size : int
        Steps per adapter call.
    method : {"auto", "exact", "statistical"}
        ``auto``: exact when the adapter is deterministic under ``params`` and the drafts are.
    bound_lp : bool
        Solve the tree LP for the best accepted length where no closed form applies (small cases).

    Returns
    -------
    TreeEngineAuditResult

    Raises
    ------
    InvalidArgument
        For parameters the engine refuses, a tree it does not support, or models of different
        vocabularies.
    VerifierError
        When the adapter breaks the contract, or differs between two runs it declared deterministic.
    """
    if not isinstance(verifier, EngineTreeVerifier):
        raise InvalidArgument(f"verifier: expected an EngineTreeVerifier (a tree-engine adapter), got {type(verifier).__name__}")
    if not isinstance(tree, DraftTree):
        raise InvalidArgument(f"tree: expected a DraftTree, got {type(tree).__name__}")
    params = SamplingParams() if params is None else params
    if not isinstance(params, SamplingParams) or params.batch_size is not None:
        raise InvalidArgument("params: expected SamplingParams with one value per field (no per-row tensors)")
    if draft_model.vocab_size != target_model.vocab_size:
        raise InvalidArgument(
            f"target_model: vocab_size {target_model.vocab_size} differs from draft_model's {draft_model.vocab_size}")
    num_samples = check_positive_int("num_samples", num_samples, False)
    chunk_size = check_positive_int("chunk_size", chunk_size, False)
    check_prob("alpha", alpha)
    if method not in ("auto", "exact", "statistical"):
        raise InvalidArgument(f"method: expected 'auto', 'exact' or 'statistical', got {method!r}")
    verifier.check_params(params, 1)
    verifier.check_supports_tree(tree)
    order: ProcessingOrder = verifier.processing_order
    scheme = verifier.draft_scheme_for(params)
    drafter = ProcessedModel(draft_model, verifier.drafting_params(params), order)
    target = ProcessedModel(target_model, params, order)
    deterministic = verifier.is_deterministic(params) and scheme in ("topk", "none")
    if method == "exact" and not deterministic:
        raise InvalidArgument(
            f"method: the exact method needs a deterministic adapter and drafts; {verifier.name!r} under "
            f"{params.describe() or 'neutral parameters'} drafts {scheme!r} and draws at random")
    exact = method == "exact" or (method == "auto" and deterministic)
    best_acceptance, best_length, bound_source = _bound(drafter, target, tree, scheme, prefix, bound_lp)
    common = dict(engine=verifier.engine, engine_version=verifier.engine_version, verifier=verifier.name,
                  tree=tree.describe(), params=params.describe(), processing_order=order.name, draft_scheme=scheme,
                  seed=seed, alpha=alpha, best_acceptance=best_acceptance, best_accepted_length=best_length,
                  bound_source=bound_source, declared_lossy=getattr(verifier, "declared_lossy", ""))
    start = time.perf_counter()
    if exact:
        return _exact(verifier, draft_model, target_model, drafter, target, tree, params, scheme, prefix, seed,
                      common, start)
    return _statistical(verifier, draft_model, target_model, drafter, target, tree, params, scheme, prefix,
                        num_samples, seed, alpha, chunk_size, common, start)


def _step(verifier, draft_model, target_model, drafter, target, tree, params, scheme, prefix, batch_size, generator,
          validate):
    """Draft ``batch_size`` trees, verify them from raw logits; the drafted batch and the output."""
    contexts = contexts_from(prefix, torch.zeros(batch_size, 0, dtype=torch.int64))
    batch = draft_tree(drafter, target, contexts, tree, generator, scheme)
    draft_logits = None if scheme == "none" else tree_node_logits(draft_model, tree, batch.node_tokens, prefix)
    target_logits = tree_node_logits(target_model, tree, batch.node_tokens, prefix)
    out = verifier.verify_tree_logits(tree, batch.node_tokens, draft_logits, target_logits, params, generator,
                                      validate=validate)
    return batch, out


def _exact(verifier, draft_model, target_model, drafter, target, tree, params, scheme, prefix, seed, common, start):
    runs = []
    for offset in (0, 1):
        generator = torch.Generator().manual_seed(seed + offset)
        runs.append(_step(verifier, draft_model, target_model, drafter, target, tree, params, scheme, prefix, 1,
                          generator, validate=offset == 0))
    (batch, out), (_, again) = runs
    if not (torch.equal(out.accepted_node, again.accepted_node) and torch.equal(out.next_token, again.next_token)):
        raise VerifierError(f"{verifier.name}: declared deterministic under {params.describe()}, but two runs differ")
    node, next_token = int(out.accepted_node[0]), int(out.next_token[0])
    path = tree.path_nodes(node)
    tokens = batch.node_tokens[0]
    # q(s): the processed target's probability of each emitted token at its node
    mass = 1.0
    parent = 0
    for n in path:
        mass *= float(batch.target_probs[0, parent, tokens[n]])
        parent = n
    mass *= float(batch.target_probs[0, node, next_token])
    tv = max(0.0, 1.0 - mass)
    first = int(tokens[path[0]]) if path else next_token
    accepted = float(first in [int(tokens[c]) for c in tree.children[0]])
    return TreeEngineAuditResult(
        **common, method="exact", num_samples=1, pvalue=0.0 if tv > EXACT_TV_TOLERANCE else 1.0, tv=tv, tv_lower=tv,
        tv_upper=tv, tests=(), acceptance=accepted, accepted_length=float(len(path)),
        seconds=time.perf_counter() - start,
    )


def _statistical(verifier, draft_model, target_model, drafter, target, tree, params, scheme, prefix, num_samples,
                 seed, alpha, chunk_size, common, start):
    num_tokens = tree.max_depth + 1
    partition = build_partition(target, num_tokens, num_samples, prefix=tuple(prefix))
    counts = torch.zeros(partition.num_cells, dtype=torch.float64)
    generator = torch.Generator().manual_seed(seed)
    members = 0.0
    length_sum = 0.0
    done = 0
    root_children = list(tree.children[0])
    while done < num_samples:
        size = min(chunk_size, num_samples - done)
        batch, out = _step(verifier, draft_model, target_model, drafter, target, tree, params, scheme, prefix, size,
                           generator, validate=done == 0)
        strings, lengths = _emitted(tree, batch.node_tokens, out.accepted_node, out.next_token, num_tokens)
        members += float((batch.node_tokens[:, root_children] == strings[:, :1]).any(-1).sum())
        length_sum += float((lengths - 1).sum())
        complete_with_target(strings, lengths, target, generator, prefix=tuple(prefix))
        counts += torch.bincount(partition.cells_of(strings), minlength=partition.num_cells).double()
        done += size
    cell_probs = partition.cell_probs.double()
    violations = float(counts[cell_probs == 0].sum())
    support = TestResult("support", violations, 0.0 if violations > 0 else 1.0, num_samples=num_samples,
                         detail="strings of target probability 0")
    # a G-test per prefix depth (where a slip first shows) and on the whole partition (docs/audit/statistical.md)
    tests = [dataclasses.replace(g_test(t.counts(counts), t.cell_probs), name=f"g-test@{t.depth}")
             for t in depth_truncations(partition)]
    tests += [g_test(counts, cell_probs), support]
    adjusted = holm([t.pvalue for t in tests])
    tests = tuple(dataclasses.replace(t, pvalue_adjusted=a) for t, a in zip(tests, adjusted))
    interval = tv_interval(counts, cell_probs, confidence=1 - alpha)
    return TreeEngineAuditResult(
        **common, method="statistical", num_samples=num_samples, pvalue=min(adjusted), tv=interval.estimate,
        tv_lower=interval.lower, tv_upper=interval.upper, tests=tests, acceptance=members / num_samples,
        accepted_length=length_sum / num_samples, seconds=time.perf_counter() - start,
    )
