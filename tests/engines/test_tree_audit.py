"""The tree-engine audit (spectr_audit.engines.tree_audit) on adapters whose answer is known.

Reference adapters wrap the project's exact tree verifiers behind the logits-and-parameters
seam: one applies the parameters everywhere (lossless), one draws its bonus from the raw law
(the slip EAGLE-1 makes).  Statistical verdicts use fixed seeds and ``alpha = 1e-3`` (their
false-alarm rate); rerun with another seed before reading a failure as a bug.  Exact verdicts
are compared with hand-derived TVs.
"""

from __future__ import annotations

import pytest
import torch

from spectr_audit.contract.sampling import PROCESSING_ORDERS, SamplingParams, process_logits
from spectr_audit.contract.tree import DraftTree
from spectr_audit.contract.tree_verifier import TreeVerifyOutput
from spectr_audit.drafting.models import ContextFreeModel, MarkovModel
from spectr_audit.engines._tree import EngineTreeVerifier
from spectr_audit.drafting.processed import ProcessedModel
from spectr_audit.drafting.processed import tree_node_logits as node_logits
from spectr_audit.engines.tree_audit import tree_engine_audit
from spectr_audit.errors import InvalidArgument, VerifierError
from spectr_audit.registry import load_tree_verifier

pytestmark = pytest.mark.usefixtures("single_thread")

DRAFT = ContextFreeModel([0.3, 0.25, 0.2, 0.15, 0.1])
TARGET = ContextFreeModel([0.1, 0.2, 0.35, 0.25, 0.1])
TREE = DraftTree.from_paths([(0,), (1,), (0, 0)])


class _Reference(EngineTreeVerifier):
    """Processed laws everywhere, then the exact tree RRS without replacement: lossless."""

    name = "reference"
    draft_schemes = ("without_replacement",)
    processing_order = PROCESSING_ORDERS["vllm"]
    raw_bonus = False

    def __init__(self):
        self._rule = load_tree_verifier("tree-rrs-wor")

    def drafting_params(self, params):
        return params

    def _verify_tree_logits(self, tree, node_tokens, draft_logits, target_logits, params, generator):
        draft = process_logits(draft_logits, params, self.processing_order)
        target = process_logits(target_logits, params, self.processing_order)
        if self.raw_bonus:  # the leaves' rows are the bonus rows: the raw softmax there
            leaves = list(tree.leaves)
            target[:, leaves] = torch.softmax(target_logits[:, leaves].double(), dim=-1)
        return self._rule.verify_tree(tree, node_tokens, draft, target, generator, validate=False)


class _RawBonus(_Reference):
    name = "raw-bonus"
    raw_bonus = True


class _StopAtRoot(EngineTreeVerifier):
    """Deterministic: accepts nothing and emits the processed target's argmax at the root."""

    name = "stop-at-root"
    draft_schemes = ("topk",)
    processing_order = PROCESSING_ORDERS["vllm"]
    random_tie = False

    def is_deterministic(self, params, batch_size=1):
        return True

    def _verify_tree_logits(self, tree, node_tokens, draft_logits, target_logits, params, generator):
        batch_size = node_tokens.shape[0]
        target = process_logits(target_logits[:, 0], params, self.processing_order)
        token = target.argmax(-1)
        if self.random_tie:  # declared deterministic, draws anyway
            token = torch.randint(0, target.shape[-1], (batch_size,), generator=generator)
        return TreeVerifyOutput(torch.zeros(batch_size, dtype=torch.int64), token)


class _Liar(_StopAtRoot):
    name = "liar"
    random_tie = True


@pytest.mark.parametrize("params", [SamplingParams(), SamplingParams(temperature=0.6), SamplingParams(top_k=3),
                                    SamplingParams(temperature=0.8, top_p=0.8)])
def test_a_lossless_adapter_is_not_rejected(params):
    result = tree_engine_audit(_Reference(), DRAFT, TARGET, TREE, params, num_samples=3_000, seed=1)
    assert result.method == "statistical" and not result.rejects(), result.to_dict()
    assert result.acceptance <= result.best_acceptance + 4 * (result.best_acceptance / 3_000) ** 0.5


@pytest.mark.parametrize("params", [SamplingParams(temperature=0.5), SamplingParams(top_k=3)])
def test_a_raw_bonus_is_rejected(params):
    result = tree_engine_audit(_RawBonus(), DRAFT, TARGET, TREE, params, num_samples=6_000, seed=1)
    assert result.rejects(), result.to_dict()
    assert result.verdict == "lossy"


def test_the_raw_bonus_is_invisible_at_neutral_parameters():
    result = tree_engine_audit(_RawBonus(), DRAFT, TARGET, TREE, SamplingParams(), num_samples=3_000, seed=1)
    assert not result.rejects(), result.to_dict()


# params -> exact TV of emitting the root's processed argmax, token 2: 1 - q(2)
EXACT_CASES = [
    (SamplingParams(), 1 - 0.35),
    (SamplingParams(top_k=2), 1 - 0.35 / 0.6),  # top 2 of (0.1, 0.2, 0.35, 0.25, 0.1): tokens 2, 3
    (SamplingParams(temperature=0.0), 0.0),
]


@pytest.mark.parametrize("params, tv", EXACT_CASES)
def test_the_exact_method_gives_one_minus_the_emitted_strings_mass(params, tv):
    result = tree_engine_audit(_StopAtRoot(), DRAFT, TARGET, TREE, params)
    assert result.method == "exact" and result.num_samples == 1
    assert result.tv == pytest.approx(tv, abs=1e-12)
    assert result.rejects() is (tv > 0)
    assert (result.acceptance, result.accepted_length) == (0.0, 0.0)  # token 2 is no root child's (tokens 0, 1)


def test_a_declared_deterministic_adapter_that_draws_is_caught():
    with pytest.raises(VerifierError, match="deterministic"):
        tree_engine_audit(_Liar(), DRAFT, TARGET, TREE, SamplingParams())


def test_node_logits_are_the_models_at_each_path():
    # order-1 Markov over 3 tokens: the law after a path is the row of its last token (row 3: the start)
    table = torch.tensor([[0.6, 0.3, 0.1], [0.2, 0.5, 0.3], [0.1, 0.1, 0.8], [0.4, 0.4, 0.2]], dtype=torch.float64)
    model = MarkovModel(table, 1)
    node_tokens = torch.tensor([[0, 2, 1, 0]])  # TREE: node 1 = token 2, node 2 = token 1, node 3 (under 1) = 0
    logits = node_logits(model, TREE, node_tokens)
    assert torch.allclose(logits[0].exp(), table[[3, 2, 1, 0]])
    assert torch.allclose(node_logits(model, TREE, node_tokens, prefix=(1,))[0, 0].exp(), table[1])


def test_processed_model_is_the_reference_processing():
    model = ProcessedModel(TARGET, SamplingParams(top_k=2), "vllm")
    out = model(torch.zeros(2, 0, dtype=torch.int64))
    assert torch.allclose(out, torch.tensor([[0, 0, 0.35 / 0.6, 0.25 / 0.6, 0]] * 2, dtype=torch.float64))


BAD_ARGUMENTS = [
    (dict(verifier=load_tree_verifier("tree-rrs")), "EngineTreeVerifier"),
    (dict(params=SamplingParams(temperature=[0.5, 1.0])), "one value per field"),
    (dict(method="fast"), "method"),
    (dict(num_samples=0), "num_samples"),
    (dict(alpha=1.5), "alpha"),
    (dict(target_model=ContextFreeModel([0.5, 0.5])), "vocab_size"),
    (dict(tree="paths"), "tree"),
]


@pytest.mark.parametrize("change, message", BAD_ARGUMENTS)
def test_bad_arguments_are_refused_by_name(change, message):
    arguments = dict(verifier=_Reference(), draft_model=DRAFT, target_model=TARGET, tree=TREE, params=SamplingParams())
    arguments.update(change)
    with pytest.raises(InvalidArgument, match=message):
        tree_engine_audit(**arguments)


def test_the_exact_method_is_refused_for_a_random_adapter():
    with pytest.raises(InvalidArgument, match="exact method"):
        tree_engine_audit(_Reference(), DRAFT, TARGET, TREE, SamplingParams(), method="exact")


def test_logits_inputs_are_validated_by_name():
    node_tokens = torch.tensor([[0, 0, 1, 2]])
    logits = torch.zeros(1, 4, 5)
    bad = logits.clone()
    bad[0, 1] = float("nan")
    with pytest.raises(InvalidArgument, match="target_logits"):
        _Reference().verify_tree_logits(TREE, node_tokens, logits, bad, SamplingParams())
    with pytest.raises(InvalidArgument, match="draft_logits"):
        _Reference().verify_tree_logits(TREE, node_tokens, torch.zeros(1, 4), logits, SamplingParams())
    with pytest.raises(InvalidArgument, match="siblings|sibling"):
        _Reference().verify_tree_logits(TREE, torch.tensor([[0, 1, 1, 2]]), logits, logits, SamplingParams())
