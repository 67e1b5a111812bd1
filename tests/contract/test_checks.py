"""The checks the chain, logits and tree contracts share (spectr_audit/contract/_checks.py).

One problem gets one message at every boundary that can meet it: the adapters' arguments, the
conversion of a class, a third party's exception, the exact law a verifier returns.  Messages are
written out by hand.
"""

from __future__ import annotations

import pytest
import torch

from spectr_audit.contract.logits import FunctionLogitsVerifier, as_logits_verifier, check_logits_inputs
from spectr_audit.contract.tree import DraftTree
from spectr_audit.contract.tree_verifier import FunctionTreeVerifier, check_tree_inputs
from spectr_audit.contract.convert import as_tree_verifier
from spectr_audit.contract.verifier import FunctionVerifier, check_verify_inputs
from spectr_audit.contract.convert import as_verifier
from spectr_audit.errors import InvalidArgument, VerifierError

ADAPTERS = [FunctionVerifier, FunctionLogitsVerifier, FunctionTreeVerifier]
CONVERSIONS = [as_verifier, as_logits_verifier, as_tree_verifier]


def _stop(*args):
    """Stops at once."""


@pytest.mark.parametrize("adapter", ADAPTERS, ids=lambda a: a.__name__)
def test_adapters_refuse_the_same_bad_arguments_with_the_same_messages(adapter):
    with pytest.raises(InvalidArgument, match=r"^fn: expected a callable verify function, got int$"):
        adapter(3)
    with pytest.raises(InvalidArgument, match=r"^expected: must be None, 'exact' or 'inexact', got 'maybe'$"):
        adapter(_stop, expected="maybe")
    # the function is checked before anything else
    with pytest.raises(InvalidArgument, match=r"^fn: "):
        adapter(3, expected="maybe")


@pytest.mark.parametrize("adapter", ADAPTERS, ids=lambda a: a.__name__)
def test_adapters_take_name_and_description_from_the_function(adapter):
    verifier = adapter(_stop, guarantees=["spectr"])
    assert (verifier.name, verifier.description, verifier.guarantees) == ("_stop", "Stops at once.", frozenset({"spectr"}))
    verifier = adapter(_stop, name="mine", description="given", expected="exact")
    assert (verifier.name, verifier.description, verifier.expected) == ("mine", "given", "exact")


def test_chain_adapters_check_the_draft_scheme_before_the_declared_verdict():
    for adapter in (FunctionVerifier, FunctionLogitsVerifier):
        with pytest.raises(InvalidArgument, match=r"^draft_scheme: expected one of \('iid', 'without_replacement'\), got 'x'$"):
            adapter(_stop, draft_scheme="x", expected="maybe")


def test_the_tree_adapter_checks_the_declared_verdict_before_the_draft_schemes():
    with pytest.raises(InvalidArgument, match=r"^expected: "):
        FunctionTreeVerifier(_stop, draft_schemes=("x",), expected="maybe")
    with pytest.raises(InvalidArgument, match=r"^draft_schemes: "):
        FunctionTreeVerifier(_stop, draft_schemes=("x",))


def test_only_the_logits_adapter_checks_its_law_when_built():
    with pytest.raises(InvalidArgument, match=r"^output_probs: expected a callable or None, got int$"):
        FunctionLogitsVerifier(_stop, output_probs=3)
    assert FunctionVerifier(_stop, output_probs=3).has_exact_law  # a non-callable law fails when called


class _Unbuildable:
    def __init__(self):
        raise RuntimeError("needs a checkpoint")


@pytest.mark.parametrize("convert", CONVERSIONS, ids=lambda c: c.__name__)
def test_conversions_report_a_class_they_cannot_build(convert):
    with pytest.raises(InvalidArgument) as info:
        convert(_Unbuildable)
    assert str(info.value) == "verifier: could not instantiate class _Unbuildable with no arguments: needs a checkpoint"
    assert isinstance(info.value.__cause__, RuntimeError)


@pytest.mark.parametrize("adapter,convert", list(zip(ADAPTERS, CONVERSIONS)), ids=lambda x: x.__name__)
def test_conversions_rename_only_when_a_name_is_given(adapter, convert):
    verifier = adapter(_stop, name="kept")
    assert convert(verifier) is verifier and verifier.name == "kept"
    assert convert(verifier, name="renamed") is verifier and verifier.name == "renamed"


def _crash(*args):
    raise KeyError("lost")


def _passes_on(*args):
    raise InvalidArgument("draft_probs: refused by the verifier")


TREE = DraftTree.from_paths([(0,), (1,), (0, 0)])
NODE_TOKENS = torch.tensor([[0, 0, 1, 2], [0, 1, 0, 0]])
TREE_PROBS = torch.full((2, 4, 3), 1 / 3, dtype=torch.float64)
DRAFT_TOKENS = torch.tensor([[[0, 1]], [[2, 2]]])
CHAIN_DRAFT = torch.full((2, 1, 2, 3), 1 / 3, dtype=torch.float64)
CHAIN_TARGET = torch.full((2, 1, 3, 3), 1 / 3, dtype=torch.float64)


def _calls(fn):
    """Each adapter's two entry points, wrapping ``fn``: (method name, call)."""
    chain = FunctionVerifier(fn, output_probs=fn, name="third-party")
    logits = FunctionLogitsVerifier(fn, output_probs=fn, name="third-party")
    tree = FunctionTreeVerifier(fn, tree_output_probs=fn, name="third-party", draft_schemes=("iid",))
    chain_args = (DRAFT_TOKENS, CHAIN_DRAFT, CHAIN_TARGET)
    logits_args = (DRAFT_TOKENS, CHAIN_DRAFT.log(), CHAIN_TARGET.log())
    tree_args = (TREE, NODE_TOKENS, TREE_PROBS, TREE_PROBS)
    return [
        ("verify", lambda: chain.verify(*chain_args)),
        ("output_probs", lambda: chain.output_probs(*chain_args)),
        ("verify", lambda: logits.verify_logits(*logits_args)),
        ("output_probs", lambda: logits.output_probs_logits(*logits_args)),
        ("verify_tree", lambda: tree.verify_tree(*tree_args)),
        ("tree_output_probs", lambda: tree.tree_output_probs(*tree_args)),
    ]


def test_a_third_party_exception_becomes_a_verifier_error_naming_the_method():
    for method, call in _calls(_crash):
        with pytest.raises(VerifierError) as info:
            call()
        assert str(info.value) == f"third-party: {method} raised KeyError: 'lost'"
        assert isinstance(info.value.__cause__, KeyError)


def test_the_contracts_own_errors_pass_through_unchanged():
    for _, call in _calls(_passes_on):
        with pytest.raises(InvalidArgument, match=r"^draft_probs: refused by the verifier$"):
            call()


def _law_messages(value_for_shape):
    """The VerifierError messages of the chain law check and the tree law check for one kind of bad law."""
    chain = FunctionVerifier(_stop, output_probs=lambda *a: value_for_shape((2, 1, 3, 3)), name="v")
    tree = FunctionTreeVerifier(_stop, tree_output_probs=lambda *a: value_for_shape((2, 4, 3)), name="v")
    messages = []
    for call in (lambda: chain.output_probs(DRAFT_TOKENS, CHAIN_DRAFT, CHAIN_TARGET),
                 lambda: tree.tree_output_probs(TREE, NODE_TOKENS, TREE_PROBS, TREE_PROBS)):
        with pytest.raises(VerifierError) as info:
            call()
        messages.append(str(info.value))
    return messages


def _one_cell(shape, value=1.0, rest=0.0):
    law = torch.full(shape, rest, dtype=torch.float64)
    law[(slice(None),) + (0,) * (len(shape) - 1)] = value
    return law


LAW_CASES = [
    ("integer", lambda s: torch.zeros(s, dtype=torch.int64), "{m} must return a floating-point torch.Tensor"),
    ("nan", lambda s: torch.full(s, float("nan")), "{m} contains NaN or Inf"),
    ("inf", lambda s: _one_cell(s, float("inf")), "{m} contains NaN or Inf"),
    ("negative", lambda s: _one_cell(s, 1.0 + 1e-9, -1e-9 / 2), "{m} contains negative probabilities (min -5e-10)"),
    ("mass", lambda s: _one_cell(s, 0.75), "{m} row 0 sums to 0.75, not 1"),
]


@pytest.mark.parametrize("name,value_for_shape,message", LAW_CASES, ids=[c[0] for c in LAW_CASES])
def test_chain_and_tree_laws_are_judged_alike(name, value_for_shape, message):
    chain, tree = _law_messages(value_for_shape)
    assert chain == "v: " + message.format(m="output_probs")
    assert tree == "v: " + message.format(m="tree_output_probs")


def test_rounding_residue_within_tolerance_is_accepted_by_both_law_checks():
    residue = 1e-13  # below the per-cell tolerance on negative mass and far below the mass tolerance
    chain = FunctionVerifier(_stop, output_probs=lambda *a: _one_cell((2, 1, 3, 3), 1.0, -residue / 8), name="v")
    tree = FunctionTreeVerifier(_stop, tree_output_probs=lambda *a: _one_cell((2, 4, 3), 1.0, -residue / 11), name="v")
    assert chain.output_probs(DRAFT_TOKENS, CHAIN_DRAFT, CHAIN_TARGET).shape == (2, 1, 3, 3)
    assert tree.tree_output_probs(TREE, NODE_TOKENS, TREE_PROBS, TREE_PROBS).shape == (2, 4, 3)


def test_token_tensors_are_refused_alike():
    int32 = DRAFT_TOKENS.int()
    for call, name in [
        (lambda: check_verify_inputs(int32, CHAIN_DRAFT, CHAIN_TARGET), "draft_tokens"),
        (lambda: check_logits_inputs(int32, CHAIN_DRAFT, CHAIN_TARGET), "draft_tokens"),
        (lambda: check_tree_inputs(TREE, NODE_TOKENS.int(), TREE_PROBS, TREE_PROBS), "node_tokens"),
    ]:
        with pytest.raises(InvalidArgument, match=rf"^{name}: expected dtype torch.int64, got torch.int32$"):
            call()
    for call, name in [
        (lambda: check_verify_inputs([[[0]]], CHAIN_DRAFT, CHAIN_TARGET), "draft_tokens"),
        (lambda: check_logits_inputs([[[0]]], CHAIN_DRAFT, CHAIN_TARGET), "draft_tokens"),
        (lambda: check_tree_inputs(TREE, [[0]], TREE_PROBS, TREE_PROBS), "node_tokens"),
    ]:
        with pytest.raises(InvalidArgument, match=rf"^{name}: expected a torch.Tensor, got list$"):
            call()


def test_out_of_vocabulary_tokens_are_refused_alike_by_the_chain_and_logits_contracts():
    tokens = torch.tensor([[[0, 1]], [[3, 2]]])
    message = r"^draft_tokens: token ids must lie in \[0, 3\); found 3 at index \(1, 0, 0\)$"
    with pytest.raises(InvalidArgument, match=message):
        check_verify_inputs(tokens, CHAIN_DRAFT, CHAIN_TARGET)
    with pytest.raises(InvalidArgument, match=message):
        check_logits_inputs(tokens, CHAIN_DRAFT.log(), CHAIN_TARGET.log())


def test_a_draft_row_on_another_device_is_named_with_both_devices():
    # the tree contract compares devices before reading the draft rows, so "meta" shows it on a CPU
    with pytest.raises(InvalidArgument, match=r"^node_tokens, draft_probs: must share one device, got cpu, meta$"):
        check_tree_inputs(TREE, NODE_TOKENS, TREE_PROBS.to("meta"), TREE_PROBS)
