"""The built-in tree verifiers: exact laws against plain-Python oracles, losslessness over every
realisation of the drafts, samplers against their laws, chains against the chain verifiers, and
hand-derived values."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
import torch
from hypothesis import assume, given, settings, strategies as st
from scipy import stats

from spectr_audit.contract.chain_trees import (
    ChainVerifierAsTree,
    TreeVerifierAsChain,
    chain_law_as_tree,
    chains_as_tree_inputs,
)
from spectr_audit.contract.randomness import InjectedUniforms
from spectr_audit.contract.tree import DraftTree
from spectr_audit.drafting.harness import draft
from spectr_audit.drafting.models import ContextFreeModel, random_markov
from spectr_audit.drafting.tree import draft_tree
from spectr_audit.exact.iteration import exact_iteration
from spectr_audit.registry import load_verifier
from spectr_audit.verifiers.tree import (
    TreeRecursiveRejection,
    TreeRecursiveRejectionWithoutReplacement,
    TreeSpecTr,
    TreeTargetOnly,
)

from tests.oracles.tree_rules import (
    TREE_RULES,
    implied_law,
    path_tokens,
    realisations,
    string_law,
    tree_law,
)

VERIFIERS = {
    "tree-rrs": TreeRecursiveRejection,
    "tree-rrs-wor": TreeRecursiveRejectionWithoutReplacement,
    "tree-target-only": TreeTargetOnly,
    "tree-spectr": TreeSpecTr,
}
#: every (verifier, draft scheme) pair the verifiers declare exact
PAIRS = [(name, scheme) for name, cls in VERIFIERS.items() for scheme in cls.draft_schemes]


class PathModel:
    """A random next-token law for every token path (plain Python lists, cached), some entries exactly 0."""

    def __init__(self, seed: int, vocab_size: int, min_support: int = 1, concentration: float = 0.7):
        self.seed, self.vocab_size, self.min_support, self.concentration = seed, vocab_size, min_support, concentration
        self.cache: dict = {}

    def __call__(self, path: tuple) -> list:
        if path not in self.cache:
            rng = np.random.default_rng([self.seed, len(path), *path])
            values = rng.dirichlet(np.full(self.vocab_size, self.concentration))
            zeros = rng.permutation(self.vocab_size)[: rng.integers(0, self.vocab_size - self.min_support + 1)]
            values[zeros] = 0.0
            self.cache[path] = (values / values.sum()).tolist()
        return self.cache[path]


def _tensors(tree: DraftTree, rows: list, draft_fn, target_fn, vocab_size: int, with_draft: bool = True):
    """Batched inputs ``[R, N + 1, ...]`` for realisations ``rows`` (tuples of node tokens)."""
    node_tokens = torch.tensor([list(r) for r in rows], dtype=torch.int64)
    draft_probs = torch.zeros(len(rows), tree.num_nodes, vocab_size, dtype=torch.float64)
    target_probs = torch.zeros(len(rows), tree.num_nodes, vocab_size, dtype=torch.float64)
    for i, tokens in enumerate(rows):
        for n in range(tree.num_nodes):
            path = path_tokens(tree.parents, tokens, n)
            target_probs[i, n] = torch.tensor(target_fn(path), dtype=torch.float64)
            if tree.children[n]:
                draft_probs[i, n] = torch.tensor(draft_fn(path), dtype=torch.float64)
    return node_tokens, (draft_probs if with_draft else None), target_probs


@st.composite
def tree_cases(draw, scheme: str, max_nodes: int = 7):
    """A random tree (breadth-first canonical, ranks with gaps under top-k) and random path models."""
    vocab_size = draw(st.integers(2, 4))
    num_draft_nodes = draw(st.integers(1, max_nodes))
    distinct = scheme in ("without_replacement", "topk", "none")
    parents, counts = [-1], [0]
    for n in range(1, num_draft_nodes + 1):
        allowed = [p for p in range(n) if not distinct or counts[p] < vocab_size]
        parent = draw(st.sampled_from(allowed))
        parents.append(parent)
        counts[parent] += 1
        counts.append(0)
    tree = DraftTree.from_parents(parents)
    if scheme in ("topk", "none") and draw(st.booleans()):
        # sibling ranks with gaps (a path list holding (0,) and (2,) but not (1,))
        ranks = [-1] * tree.num_nodes
        for kids in tree.children:
            if kids:
                chosen = sorted(draw(st.permutations(range(vocab_size)))[: len(kids)])
                for c, r in zip(kids, chosen):
                    ranks[c] = r
        tree = DraftTree(tree.parents, ranks)
    seed = draw(st.integers(0, 2**31 - 1))
    min_support = tree.max_children if scheme == "without_replacement" else 1
    draft_fn = PathModel(seed, vocab_size, min_support)
    target_fn = draft_fn if draw(st.integers(0, 5)) == 0 else PathModel(seed + 1, vocab_size)
    return tree, vocab_size, draft_fn, target_fn


def _realisations(tree, scheme, draft_fn, vocab_size, seed=0):
    if scheme == "none":
        # target-only: any given tokens (here random ones, siblings distinct)
        rng = np.random.default_rng(seed)
        tokens = [0] * tree.num_nodes
        for kids in tree.children:
            for c, x in zip(kids, rng.permutation(vocab_size)):
                tokens[c] = int(x)
        return [(tuple(tokens), 1.0)]
    return realisations(list(tree.parents), list(tree.ranks), scheme, draft_fn, vocab_size)


@pytest.mark.parametrize("name,scheme", PAIRS, ids=lambda x: x)
@settings(max_examples=40, deadline=None)
@given(data=st.data())
def test_fast_law_matches_plain_python_oracle(name, scheme, data):
    tree, vocab_size, draft_fn, target_fn = data.draw(tree_cases(scheme))
    rows = _realisations(tree, scheme, draft_fn, vocab_size, seed=data.draw(st.integers(0, 99)))
    assume(rows)
    picks = data.draw(st.lists(st.integers(0, len(rows) - 1), min_size=1, max_size=8))
    chosen = [rows[i][0] for i in picks]
    node_tokens, draft_probs, target_probs = _tensors(tree, chosen, draft_fn, target_fn, vocab_size, scheme != "none")
    law = VERIFIERS[name]().tree_output_probs(tree, node_tokens, draft_probs, target_probs)
    for i, tokens in enumerate(chosen):
        expected = tree_law(
            TREE_RULES[name], list(tree.parents), list(tokens),
            draft_probs[i].tolist() if draft_probs is not None else target_probs[i].tolist(), target_probs[i].tolist(),
        )
        dense = torch.zeros_like(law[i])
        for (node, y), mass in expected.items():
            dense[node, y] += mass
        torch.testing.assert_close(law[i], dense, atol=1e-12, rtol=0)


def _lossless_gap(verifier, tree, scheme, draft_fn, target_fn, vocab_size, seed=0) -> float:
    """max_w |F(w) - q(w)| over strings of length max_depth + 1, the drafts marginalised per ``scheme``."""
    rows = _realisations(tree, scheme, draft_fn, vocab_size, seed)
    node_tokens, draft_probs, target_probs = _tensors(
        tree, [r for r, _ in rows], draft_fn, target_fn, vocab_size, scheme != "none"
    )
    weights = torch.tensor([w for _, w in rows], dtype=torch.float64)
    law = verifier.tree_output_probs(tree, node_tokens, draft_probs, target_probs) * weights.view(-1, 1, 1)
    emitted: dict = {}
    for r, n, y in (law > 0).nonzero().tolist():
        s = path_tokens(tree.parents, rows[r][0], n) + (y,)
        emitted[s] = emitted.get(s, 0.0) + float(law[r, n, y])
    implied = implied_law(emitted, target_fn, tree.max_depth + 1)
    target = string_law(target_fn, tree.max_depth + 1)
    return max(abs(implied.get(w, 0.0) - target.get(w, 0.0)) for w in set(implied) | set(target))


@pytest.mark.parametrize("name,scheme", PAIRS, ids=lambda x: x)
@settings(max_examples=40, deadline=None)
@given(data=st.data())
def test_emitted_law_is_the_target_law_over_every_realisation(name, scheme, data):
    tree, vocab_size, draft_fn, target_fn = data.draw(tree_cases(scheme))
    if scheme == "iid":
        assume(vocab_size ** tree.num_draft_nodes <= 4096)
    gap = _lossless_gap(VERIFIERS[name](), tree, scheme, draft_fn, target_fn, vocab_size, data.draw(st.integers(0, 99)))
    assert gap <= 1e-12, (name, scheme, tree, gap)


@pytest.mark.parametrize(
    "name,scheme",
    [("tree-rrs", "without_replacement"), ("tree-rrs-wor", "iid"), ("tree-spectr", "without_replacement"),
     ("tree-rrs", "topk")],
)
def test_the_lossless_check_sees_a_scheme_mismatch(name, scheme):
    """The same check fails where the rule is used off its scheme: it can fail.

    (Two siblings; with a residual on a single token, e.g. V = 3 and p = (.5, .3, .2), q = (.2, .3, .5),
    the mismatches happen to cancel, so V = 4 with a residual on two tokens.)
    """
    tree = DraftTree.chains(2, 1)
    draft_fn = lambda path: [0.4, 0.3, 0.2, 0.1]
    target_fn = lambda path: [0.1, 0.2, 0.3, 0.4]
    verifier = VERIFIERS[name]()
    verifier.draft_schemes = ("iid", "without_replacement", "topk")  # let the mismatched drafts through the boundary
    assert _lossless_gap(verifier, tree, scheme, draft_fn, target_fn, 4) > 1e-2


TREES = {
    "mixed": DraftTree.from_paths([(0,), (1,), (2,), (0, 0), (0, 1), (1, 0), (0, 0, 0)]),
    "chains-3x2": DraftTree.chains(3, 2),
    "wide-root": DraftTree.from_paths([(0,), (1,), (2,), (3,), (0, 0)]),
}

SAMPLER_CASES = [
    ("tree-rrs", "iid", "mixed"),
    ("tree-rrs", "iid", "chains-3x2"),
    ("tree-rrs-wor", "without_replacement", "mixed"),
    ("tree-target-only", "topk", "mixed"),
    ("tree-target-only", "none", "wide-root"),
    ("tree-target-only", "iid", "wide-root"),
    ("tree-spectr", "iid", "mixed"),
    ("tree-spectr", "iid", "wide-root"),
]


@pytest.mark.parametrize("name,scheme,tree_name", SAMPLER_CASES)
def test_sampled_verdicts_follow_tree_output_probs(name, scheme, tree_name):
    """Pearson chi-square of sampled (accepted_node, next_token) cells against the exact law.

    Each (drafted tree, verifier) pair is one test at false-alarm rate 1e-4 with a fixed seed
    (cells of expected count < 5 pooled); 24 such tests, so about 2.4e-3 for the file if the seed
    were redrawn.  A failure means the sampler and ``tree_output_probs`` disagree: rerun with another
    seed only to confirm, never to hide it.
    """
    verifier, tree, vocab_size = VERIFIERS[name](), TREES[tree_name], 4
    draft_model = random_markov(vocab_size, 1, seed=3, concentration=0.7)
    target_model = random_markov(vocab_size, 1, seed=4, concentration=0.7)
    gen = torch.Generator().manual_seed(1234)
    contexts = torch.tensor([[0], [1], [2]], dtype=torch.int64)
    batch = draft_tree(draft_model, target_model, contexts, tree, gen, scheme)
    law = verifier.tree_output_probs(tree, batch.node_tokens, batch.draft_probs, batch.target_probs)
    reps = 40_000
    for b in range(contexts.shape[0]):
        rep = lambda t: None if t is None else t[b : b + 1].expand(reps, *t.shape[1:]).contiguous()
        out = verifier.verify_tree(tree, rep(batch.node_tokens), rep(batch.draft_probs), rep(batch.target_probs), gen)
        cells = out.accepted_node * vocab_size + out.next_token
        counts = torch.bincount(cells, minlength=law[b].numel()).double()
        expected = law[b].reshape(-1) * reps
        assert counts[expected == 0].sum() == 0, "sampled a verdict of zero probability"
        big = expected >= 5
        obs = torch.cat([counts[big], counts[~big].sum().unsqueeze(0)])
        exp = torch.cat([expected[big], expected[~big].sum().unsqueeze(0)])
        if exp[-1] == 0:
            obs, exp = obs[:-1], exp[:-1]
        if obs.numel() < 2:
            continue
        pvalue = stats.chisquare(obs.numpy(), exp.numpy() * obs.sum().item() / exp.sum().item()).pvalue
        assert pvalue > 1e-4, (name, scheme, tree_name, b, pvalue)


#: (tree verifier, chain verifier for L = 1, chain verifier for L >= 2, chain draft scheme)
CHAIN_PAIRS = [
    ("tree-rrs", "rrs", "rrs", "iid"),
    ("tree-rrs-wor", "rrs-wor", None, "without_replacement"),
    ("tree-spectr", "kseq", "spectr-tree", "iid"),
]


@pytest.mark.parametrize("tree_name,chain_l1,chain_deep,scheme", CHAIN_PAIRS)
@settings(max_examples=25, deadline=None)
@given(
    vocab_size=st.integers(2, 4),
    num_drafts=st.integers(1, 4),
    draft_len=st.integers(1, 3),
    seed=st.integers(0, 10_000),
)
def test_chain_trees_reproduce_the_chain_verifiers_laws(tree_name, chain_l1, chain_deep, scheme, vocab_size, num_drafts,
                                                        draft_len, seed):
    if scheme == "without_replacement":
        draft_len = 1
        num_drafts = min(num_drafts, vocab_size)
    chain = load_verifier(chain_l1 if draft_len == 1 else chain_deep)
    draft_model = random_markov(vocab_size, 1, seed=seed, concentration=0.5)
    target_model = random_markov(vocab_size, 1, seed=seed + 7, concentration=0.5)
    if scheme == "without_replacement":
        assume(int((draft_model(torch.full((1, 1), -1))[0] > 0).sum()) >= num_drafts)
    batch = draft(draft_model, target_model, torch.full((8, 1), -1, dtype=torch.int64), num_drafts, draft_len,
                  torch.Generator().manual_seed(seed), scheme)
    inputs = chains_as_tree_inputs(batch.draft_tokens, batch.draft_probs, batch.target_probs)
    tree_law_ = VERIFIERS[tree_name]().tree_output_probs(inputs.tree, inputs.node_tokens, inputs.draft_probs,
                                                         inputs.target_probs)
    chain_law = chain.output_probs(batch.draft_tokens, batch.draft_probs, batch.target_probs)
    torch.testing.assert_close(tree_law_, chain_law_as_tree(chain_law, num_drafts, draft_len), atol=1e-12, rtol=0)
    # the other way round: the chain verifier run as a tree verifier on the chain tree
    adapted = ChainVerifierAsTree(chain).tree_output_probs(inputs.tree, inputs.node_tokens, inputs.draft_probs,
                                                           inputs.target_probs)
    torch.testing.assert_close(tree_law_, adapted, atol=1e-12, rtol=0)


@pytest.mark.parametrize("name", ["tree-rrs", "tree-spectr", "tree-target-only"])
def test_tree_verifiers_pass_the_chain_exact_audit_on_chains(name):
    """A tree verifier adapted to the chain contract is exact under the chain audit (i.i.d. K x L drafts)."""
    verifier = TreeVerifierAsChain(VERIFIERS[name]())
    draft_model, target_model = random_markov(3, 1, seed=11), random_markov(3, 1, seed=12)
    audit = exact_iteration(verifier, draft_model, target_model, num_drafts=2, draft_len=2, prefix=(1,))
    assert audit.max_abs_error <= 1e-12
    assert audit.prefix_cap_excess <= 1e-12


@dataclasses.dataclass(frozen=True)
class HandCase:
    """A hand-derived value (derivation in the comment above each case)."""

    verifier: str
    scheme: str
    paths: tuple
    draft: tuple  # context-free draft law
    target: tuple  # context-free target law
    acceptance: float = None  # P(accepted_node != 0)
    accepted_length: float = None  # E[depth(accepted_node)]


HAND_CASES = [
    # i.i.d. RRS with two siblings, p = (.6, .4), q = (.3, .7): (A, A) w.p. .36 accepted only at the
    # first try (.5), every other pair holds B, accepted surely -> .36 * .5 + .64 = .82
    HandCase("tree-rrs", "iid", ((0,), (1,)), (0.6, 0.4), (0.3, 0.7), acceptance=0.82),
    # without replacement, V = 2, two siblings: both tokens are drafted, something is always accepted
    HandCase("tree-rrs-wor", "without_replacement", ((0,), (1,)), (0.6, 0.4), (0.3, 0.7), acceptance=1.0),
    # K-SEQ, K = 2: P_A = 0.62 + 0.4 sqrt(0.34) (ALGORITHMS' worked example at rho*)
    HandCase("tree-spectr", "iid", ((0,), (1,)), (0.6, 0.4), (0.3, 0.7), acceptance=0.62 + 0.4 * math.sqrt(0.34)),
    # target-only, top-1 chain of 2 under q = (.5, .5): token 0 accepted w.p. .5 at each level ->
    # E[accepted] = .5 + .25
    HandCase("tree-target-only", "topk", ((0,), (0, 0)), (0.5, 0.5), (0.5, 0.5), accepted_length=0.75),
    # target-only, top-2 at the root under q = (.2, .3, .5), draft (.5, .3, .2): tokens 0 and 1 are
    # drafted and accepted w.p. q(0) + q(1) = .5
    HandCase("tree-target-only", "topk", ((0,), (1,)), (0.5, 0.3, 0.2), (0.2, 0.3, 0.5), acceptance=0.5),
    # p = q: the first child is accepted surely at every node, so the walk follows first children:
    # (0,) then (0, 0), depth 2 always, whatever the second child carries
    HandCase("tree-rrs", "iid", ((0,), (1,), (0, 0)), (0.25, 0.75), (0.25, 0.75), acceptance=1.0, accepted_length=2.0),
    # disjoint supports: nothing is ever accepted
    HandCase("tree-spectr", "iid", ((0,), (1,), (0, 0)), (1.0, 0.0), (0.0, 1.0), acceptance=0.0, accepted_length=0.0),
]


@pytest.mark.parametrize("case", HAND_CASES, ids=lambda c: f"{c.verifier}-{c.scheme}-{len(c.paths)}")
def test_hand_derived_values(case):
    tree = DraftTree.from_paths(case.paths)
    draft_fn, target_fn = (lambda path: list(case.draft)), (lambda path: list(case.target))
    rows = realisations(list(tree.parents), list(tree.ranks), case.scheme, draft_fn, len(case.draft))
    node_tokens, draft_probs, target_probs = _tensors(tree, [r for r, _ in rows], draft_fn, target_fn, len(case.draft))
    weights = torch.tensor([w for _, w in rows], dtype=torch.float64)
    law = VERIFIERS[case.verifier]().tree_output_probs(tree, node_tokens, draft_probs, target_probs)
    node_law = (law.sum(-1) * weights.unsqueeze(1)).sum(0)  # P(accepted_node = n)
    depths = torch.tensor(tree.depths, dtype=torch.float64)
    if case.acceptance is not None:
        assert float(node_law[1:].sum()) == pytest.approx(case.acceptance, abs=1e-12)
    if case.accepted_length is not None:
        assert float((node_law * depths).sum()) == pytest.approx(case.accepted_length, abs=1e-12)


@pytest.mark.parametrize("name", sorted(VERIFIERS))
def test_same_generator_seed_same_verdicts(name):
    verifier = VERIFIERS[name]()
    scheme = verifier.draft_schemes[0]
    tree = TREES["mixed"]
    models = random_markov(5, 1, seed=1), random_markov(5, 1, seed=2)
    batch = draft_tree(*models, torch.full((64, 1), -1, dtype=torch.int64), tree, torch.Generator().manual_seed(0), scheme)
    args = (tree, batch.node_tokens, batch.draft_probs, batch.target_probs)
    first = verifier.verify_tree(*args, torch.Generator().manual_seed(7))
    second = verifier.verify_tree(*args, torch.Generator().manual_seed(7))
    other = verifier.verify_tree(*args, torch.Generator().manual_seed(8))
    assert torch.equal(first.accepted_node, second.accepted_node) and torch.equal(first.next_token, second.next_token)
    assert not (torch.equal(first.accepted_node, other.accepted_node) and torch.equal(first.next_token, other.next_token))


def test_injected_uniforms_pin_the_walk():
    """u = 0 accepts every child with positive acceptance probability; the walk follows first children."""
    tree = TREES["mixed"]
    models = ContextFreeModel([0.4, 0.3, 0.2, 0.1]), ContextFreeModel([0.1, 0.2, 0.3, 0.4])
    batch = draft_tree(*models, torch.zeros(1, 1, dtype=torch.int64), tree, draft_scheme="topk")
    out = TreeTargetOnly().verify_tree(tree, batch.node_tokens, batch.draft_probs, batch.target_probs,
                                       InjectedUniforms.constant(0.0))
    assert out.accepted_node.tolist() == [7]  # (0,) -> (0, 0) -> (0, 0, 0), then the bonus
    assert out.next_token.tolist() == [0]  # u = 0 draws the first token of positive target mass


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_low_precision_inputs_give_valid_verdicts(dtype):
    tree = TREES["mixed"]
    models = random_markov(6, 1, seed=5), random_markov(6, 1, seed=6)
    batch = draft_tree(*models, torch.full((32, 1), -1, dtype=torch.int64), tree, torch.Generator().manual_seed(0))
    for verifier in (TreeSpecTr(), TreeRecursiveRejection(), TreeTargetOnly()):
        out = verifier.verify_tree(tree, batch.node_tokens, batch.draft_probs.to(dtype), batch.target_probs.to(dtype),
                                   torch.Generator().manual_seed(1))
        assert out.next_token.dtype == torch.int64
        assert bool(((out.next_token >= 0) & (out.next_token < 6)).all())
        assert bool(((out.accepted_node >= 0) & (out.accepted_node < tree.num_nodes)).all())
