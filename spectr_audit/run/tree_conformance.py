"""The conformance check of a tree verifier: :func:`check_verifier(verifier, tree=...) <spectr_audit.run.conformance.check_verifier>`.

The same checks as for a chain verifier (:data:`~spectr_audit.run.conformance_checks.CONTRACT_CHECKS`, a
chain being the tree ``DraftTree.chains(K, L)``), in two parts, for every (tree, draft scheme) asked for:

*Contract* (deterministic, on drafted trees): ``verify_tree`` runs on float64 and float32 inputs,
returns int64 ``[batch_size]`` fields in range, leaves its inputs untouched, is deterministic
under a fixed ``torch.Generator``, never emits a token of zero target probability along the
emitted path; where it has an exact law (``tree_output_probs``) the law is a distribution and
the sampler follows it on a few fixed realisations (Pearson's test).

*Fidelity*: :func:`spectr_audit.run.runner.audit_case` on a standard small suite on each tree
(:func:`standard_tree_suite`): the exact tree audit where a law exists and the enumeration is in
reach, the statistical audit on sampled trees otherwise; acceptance and accepted length against
the tree's bound.
"""

from __future__ import annotations

from typing import Any, Callable, Optional, Sequence

import torch

from spectr_audit.contract.tree import DraftTree
from spectr_audit.contract.tree_verifier import (
    FunctionTreeVerifier,
    TreeVerifier,
    check_tree_output,
    check_tree_output_probs,
)
from spectr_audit.drafting.tree import draft_tree
from spectr_audit.errors import InvalidArgument
from spectr_audit.registry import load_tree_verifier
from spectr_audit.run import guard
from spectr_audit.run.runner import AuditOptions, audit_case, tree_fits
from spectr_audit.run.suite import Case, Suite, load_suite, model_from_spec, tree_from_spec
from spectr_audit.statistical.sampling import tree_emitted_strings
from spectr_audit.run.conformance_checks import (
    _CONTRACT_DRAFT,
    _CONTRACT_TARGET,
    ConformanceFailure,
    _call_checks,
    _conformance_result,
    _sampler_law_checks,
    _test_alpha,
)

__all__ = ["check_tree_verifier", "standard_tree_suite"]


def _trees(tree: Any) -> list:
    """One tree, a spec string, or a list of them (a bare path list counts as one tree)."""
    if isinstance(tree, (DraftTree, str)):
        items = [tree]
    elif isinstance(tree, (list, tuple)) and tree and all(isinstance(p, (list, tuple)) for p in tree) and all(
            all(isinstance(r, int) for r in p) for p in tree):
        items = [list(tree)]  # one path list
    elif isinstance(tree, (list, tuple)) and tree:
        items = list(tree)
    else:
        raise InvalidArgument(f"tree: expected a DraftTree, a spec such as 'cartesian:2,2', a path list or a list of "
                              f"them, got {tree!r}")
    return [tree_from_spec(item, "tree") for item in items]


def _to_tree_verifier(verifier: Any, name: Optional[str], output_probs: Optional[Callable],
                      draft_scheme: Optional[str]):
    is_plain_function = (callable(verifier) and not isinstance(verifier, (type, str, TreeVerifier))
                         and not hasattr(verifier, "verify_tree") and not hasattr(verifier, "verify"))
    if is_plain_function:
        return FunctionTreeVerifier(verifier, name=name, tree_output_probs=output_probs,
                                    draft_schemes=(draft_scheme or "iid",))
    if output_probs is not None:
        raise InvalidArgument("output_probs: only for a plain verify_tree function; a class or object declares its own")
    converted = load_tree_verifier(verifier)
    if name:
        converted.name = name
    return converted


def _scheme_models(scheme: str, tree, seed: int = 1):
    """Context-free contract models on which ``scheme`` can draft ``tree`` (zero masses where i.i.d. allows)."""
    if scheme == "iid":
        return model_from_spec(_CONTRACT_DRAFT, "conformance draft"), model_from_spec(_CONTRACT_TARGET, "conformance target")
    vocab_size = max(5, tree.max_children, max(tree.ranks) + 1)
    return (model_from_spec({"dirichlet": {"vocab_size": vocab_size, "seed": seed}}, "conformance draft"),
            model_from_spec({"dirichlet": {"vocab_size": vocab_size, "seed": seed + 1}}, "conformance target"))


def _emitted_counts(tree, node_tokens, output) -> dict:
    """Emitted strings (as tuples) and their counts."""
    strings, _ = tree_emitted_strings(tree, node_tokens, output, tree.max_depth + 1)
    unique, counts = torch.unique(strings, dim=0, return_counts=True)
    return {tuple(t for t in row if t >= 0): int(c) for row, c in zip(unique.tolist(), counts.tolist())}


def _tree_law_checks(verifier, tree, batch, num_samples: int, alpha: float, seed: int, where: str) -> list:
    """The exact tree law is a distribution, and the sampler follows it on up to three realisations."""
    batch_size, vocab_size = batch.node_tokens.shape[0], batch.target_probs.shape[-1]

    def checked_law():
        return check_tree_output_probs(
            verifier.tree_output_probs(tree, batch.node_tokens, batch.draft_probs, batch.target_probs),
            tree, batch_size, vocab_size, who=verifier.name)

    def sample(law, row: int, per_row: int):
        """The realisation of row ``row``: its label, the sampler's strings over ``per_row`` calls, the law's."""
        tokens = batch.node_tokens[row : row + 1].expand(per_row, -1).contiguous()
        draft = None if batch.draft_probs is None else batch.draft_probs[row : row + 1].expand(per_row, -1, -1).contiguous()
        target = batch.target_probs[row : row + 1].expand(per_row, -1, -1).contiguous()
        output = verifier.verify_tree(tree, tokens, draft, target, torch.Generator().manual_seed(seed + 1 + row))
        observed = _emitted_counts(tree, tokens, output)
        expected: dict = {}
        node_tokens = batch.node_tokens[row].tolist()
        for node, y in (law[row] > 0).nonzero().tolist():
            key = tuple(node_tokens[n] for n in tree.path_nodes(node)) + (y,)
            expected[key] = expected.get(key, 0.0) + float(law[row, node, y]) * per_row
        return f"node tokens {node_tokens}", observed, expected

    return _sampler_law_checks(checked_law, sample, batch_size, num_samples, alpha, where,
                               law_name="tree_output_probs", worst_cell=False)


def _tree_contract_checks(verifier, tree, scheme: str, seed: int, batch_size: int, num_samples: int,
                          alpha: float) -> list:
    where = f"{tree.describe()}, {scheme}"
    draft_model, target_model = _scheme_models(scheme, tree)
    vocab_size = draft_model.vocab_size
    contexts = torch.zeros(batch_size, 0, dtype=torch.int64)
    batch = draft_tree(draft_model, target_model, contexts, tree, torch.Generator().manual_seed(seed), scheme)
    inputs = [batch.node_tokens, batch.draft_probs, batch.target_probs]

    def run(args, seed_value):
        raw = verifier.verify_tree(tree, *args, torch.Generator().manual_seed(seed_value))
        return check_tree_output(raw, tree, batch_size, vocab_size, who=verifier.name)

    def emitted_ok(first):
        """Every emitted token has positive target probability at the node it is emitted from."""
        rows = torch.arange(batch_size)
        ok = torch.ones(batch_size, dtype=torch.bool)
        path = tree.path_index()[first.accepted_node]  # [batch_size, max_depth]
        for depth in range(tree.max_depth + 1):
            if depth < tree.max_depth:
                node = path[:, depth].clamp(min=0)
                parent = torch.tensor(tree.parents)[node].clamp(min=0)
                on_path = path[:, depth] >= 0
                mass = batch.target_probs[rows, parent].gather(1, batch.node_tokens[rows, node].unsqueeze(1)).squeeze(1)
                ok &= ~(on_path & (mass <= 0))
        mass = batch.target_probs[rows, first.accepted_node].gather(1, first.next_token.unsqueeze(1)).squeeze(1)
        return ok & (mass > 0)

    return _call_checks(
        run, inputs, ("node_tokens", "draft_probs", "target_probs"), where, seed, verb="verify_tree", fields=("accepted_node", "next_token"), emitted_ok=emitted_ok,
        law_checks=(lambda: _tree_law_checks(verifier, tree, batch, num_samples, alpha, seed, where))
        if verifier.has_tree_law else None)


def standard_tree_suite(trees: Sequence[Any], draft_schemes: Sequence[str]) -> Any:
    """The small suite a tree verifier is audited on: each tree under each scheme, on three model pairs.

    SpecTr's seed example (V = 2, where the scheme can draft the tree on two tokens), a Dirichlet
    pair of V = 4 (at least the widest node's children and the largest rank plus one) and an
    order-1 Markov pair of V = 3 (where the tree fits three tokens).

    Returns
    -------
    spectr_audit.run.suite.Suite
    """
    cases = []
    for t, tree in enumerate(trees):
        need = max(tree.max_children, max(tree.ranks) + 1)
        models = [("seed-spectr", [0.6, 0.4], [0.3, 0.7], 2),
                  ("dirichlet", {"dirichlet": {"vocab_size": max(4, need), "seed": 1}},
                   {"dirichlet": {"vocab_size": max(4, need), "seed": 2}}, max(4, need)),
                  ("markov-v3", {"markov": {"vocab_size": 3, "order": 1, "seed": 5}},
                   {"markov": {"vocab_size": 3, "order": 1, "seed": 6}}, 3)]
        for scheme in draft_schemes:
            for label, draft_spec, target_spec, vocab_size in models:
                if scheme != "iid" and vocab_size < need:
                    continue  # the scheme cannot draft the tree on so few tokens
                cases.append(Case(
                    name=f"tree{t}/{scheme}/{label}", draft_model=model_from_spec(draft_spec, f"{label} draft"),
                    target_model=model_from_spec(target_spec, f"{label} target"), num_drafts=len(tree.children[0]),
                    draft_len=tree.max_depth, tree=tree, draft_scheme=scheme,
                    tree_spec="paths:" + str([list(p) for p in tree.to_paths()]).replace(" ", ""),
                ))
    return Suite(name="tree-conformance", cases=tuple(cases))


def check_tree_verifier(
    verifier: Any,
    *,
    tree: Any,
    name: Optional[str] = None,
    output_probs: Optional[Callable] = None,
    draft_scheme: Optional[str] = None,
    seed: int,
    num_samples: int,
    alpha: float,
    batch_size: int,
    suite: Any = None,
    raise_on_failure: bool = True,
    max_seconds: Optional[float] = None,
    verifier_timeout: Optional[float] = None,
):
    """:func:`~spectr_audit.run.conformance.check_verifier` for a tree verifier (see the module docstring).

    ``tree``: a :class:`~spectr_audit.contract.tree.DraftTree`, a spec (``"cartesian:2,2"``,
    ``"paths:[[0],[1],[0,0]]"``), a path list, or a list of them.  ``draft_scheme``: the scheme
    to check (default every scheme the verifier declares); for a plain ``verify_tree`` function,
    the one it is meant for (default ``"iid"``), ``output_probs`` its exact law.  Every call of
    ``verify_tree`` and ``tree_output_probs`` is limited to ``verifier_timeout`` seconds (None: no limit).
    """
    trees = _trees(tree)
    verifier = _to_tree_verifier(verifier, name, output_probs, draft_scheme)
    if draft_scheme is not None and draft_scheme not in verifier.draft_schemes:
        raise InvalidArgument(f"draft_scheme: {verifier.name!r} declares the schemes {verifier.draft_schemes}; "
                              f"got {draft_scheme!r}")
    schemes = (draft_scheme,) if draft_scheme is not None else tuple(verifier.draft_schemes)
    for t in trees:
        verifier.check_supports_tree(t)
    if suite is None:
        suite = standard_tree_suite(trees, schemes)
    elif isinstance(suite, str):
        suite = load_suite(suite)
    elif not isinstance(suite, Suite):
        raise InvalidArgument(f"suite: expected a Suite or a suite name/path, got {type(suite).__name__}")
    cases = [c for c in suite.cases if c.tree is not None and tree_fits(verifier, c)]
    if not cases:
        raise InvalidArgument(f"suite: no tree case of {suite.name!r} fits verifier {verifier.name!r}")
    combos = [(t, s) for t in trees for s in schemes]
    test_alpha = _test_alpha(alpha, len(combos), len(cases), verifier.has_tree_law)
    checks: list = []
    options = AuditOptions(seed=seed, alpha=test_alpha, max_samples=num_samples, max_seconds=max_seconds,
                           verifier_timeout=verifier_timeout)
    with guard.time_limited(verifier, verifier_timeout) as limited:
        for t, scheme in combos:
            checks += _tree_contract_checks(limited, t, scheme, seed, batch_size, num_samples, test_alpha)
        # audit_case limits the calls itself (the outer limit holds where both do)
        results = [audit_case(verifier, case, options) for case in cases]
    report = _conformance_result(verifier, checks, results, suite, seed, alpha)
    if raise_on_failure and not report.passed:
        raise ConformanceFailure(report)
    return report
