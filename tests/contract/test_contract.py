"""The verifier contract: input validation, adapters, and finding verifiers."""

from __future__ import annotations

import dataclasses
import textwrap

import pytest
import torch

from spectr_audit.contract.verifier import FunctionVerifier, VerifyOutput, check_verify_inputs
from spectr_audit.contract.convert import as_verifier
from spectr_audit.errors import InvalidArgument, SpectrAuditError, VerifierError
from spectr_audit.registry import builtin_names, load_verifier


def _good(batch_size=2, num_drafts=2, draft_len=1, vocab_size=3):
    draft_tokens = torch.zeros(batch_size, num_drafts, draft_len, dtype=torch.int64)
    draft_probs = torch.full((batch_size, num_drafts, draft_len, vocab_size), 1.0 / vocab_size)
    target_probs = torch.full((batch_size, num_drafts, draft_len + 1, vocab_size), 1.0 / vocab_size)
    return draft_tokens, draft_probs, target_probs


def _with(index, value, fn=None):
    args = list(_good())
    args[index] = value if fn is None else fn(args[index])
    return args


def _set(tensor, idx, value):
    tensor = tensor.clone()
    tensor[idx] = value
    return tensor


@dataclasses.dataclass(frozen=True)
class BadInput:
    name: str
    args: list
    message: str


BAD_INPUTS = [
    BadInput("tokens not a tensor", _with(0, [[[0]]]), "draft_tokens: expected a torch.Tensor"),
    BadInput("tokens int32", _with(0, None, lambda t: t.int()), "draft_tokens: expected dtype torch.int64"),
    BadInput("tokens 2-D", _with(0, None, lambda t: t[:, :, 0]), "draft_tokens: expected shape [batch_size, num_drafts, draft_len]"),
    BadInput("zero drafts", _with(0, torch.zeros(2, 0, 1, dtype=torch.int64)), "num_drafts must be >= 1"),
    BadInput("draft_probs 3-D", _with(1, None, lambda t: t[:, :, 0]), "draft_probs: expected shape"),
    BadInput("draft_probs int", _with(1, None, lambda t: t.long()), "draft_probs: expected a floating-point tensor"),
    BadInput("draft_probs wrong K", _with(1, torch.full((2, 3, 1, 3), 1 / 3)), "draft_probs: expected shape (2, 2, 1, 3)"),
    BadInput("target_probs missing bonus row", _with(2, torch.full((2, 2, 1, 3), 1 / 3)), "target_probs: expected shape (2, 2, 2, 3)"),
    BadInput("target_probs other V", _with(2, torch.full((2, 2, 2, 4), 1 / 4)), "target_probs: expected shape (2, 2, 2, 3)"),
    BadInput("NaN draft prob", _with(1, None, lambda t: _set(t, (0, 0, 0, 1), float("nan"))), "draft_probs: probabilities must be finite"),
    BadInput("inf target prob", _with(2, None, lambda t: _set(t, (1, 0, 1, 2), float("inf"))), "target_probs: probabilities must be finite"),
    BadInput("negative target prob", _with(2, None, lambda t: _set(t, (0, 1, 0, 0), -0.1)), "target_probs: probabilities must be non-negative"),
    BadInput("draft row sums to 1.5", _with(1, None, lambda t: _set(t, (1, 1, 0, 0), 1 / 3 + 0.5)), "draft_probs: each distribution must sum to 1"),
    BadInput("target row all zero", _with(2, None, lambda t: _set(t, (0, 0, 1), 0.0)), "target_probs: each distribution must sum to 1"),
    BadInput("token id = V", _with(0, None, lambda t: _set(t, (0, 1, 0), 3)), "draft_tokens: token ids must lie in [0, 3)"),
    BadInput("token id negative", _with(0, None, lambda t: _set(t, (1, 0, 0), -1)), "draft_tokens: token ids must lie in [0, 3)"),
    BadInput(
        "drafted token with zero draft probability",
        [
            torch.tensor([[[2]]]),
            torch.tensor([[[[0.5, 0.5, 0.0]]]]),
            torch.full((1, 1, 2, 3), 1 / 3),
        ],
        "has zero draft probability",
    ),
]


@pytest.mark.parametrize("case", BAD_INPUTS, ids=lambda c: c.name)
def test_bad_inputs_raise_invalid_argument_naming_the_problem(case):
    with pytest.raises(InvalidArgument, match=None) as info:
        check_verify_inputs(*case.args)
    assert case.message in str(info.value)
    assert isinstance(info.value, ValueError) and isinstance(info.value, SpectrAuditError)
    # every built-in verifier validates at its boundary with the same errors
    verifier = load_verifier("rrs")
    with pytest.raises(InvalidArgument):
        verifier.verify(*case.args, torch.Generator().manual_seed(0))


def test_good_inputs_pass_and_report_sizes():
    assert check_verify_inputs(*_good(2, 3, 4, 5)) == (2, 3, 4, 5)


def test_unsupported_shape_is_an_invalid_argument():
    with pytest.raises(InvalidArgument, match="supports num_drafts in \\[1, 1\\]"):
        load_verifier("speculative").verify(*_good(num_drafts=2), None)


def _first_token_verify(draft_tokens, draft_probs, target_probs, generator):
    batch_size = draft_tokens.shape[0]
    zeros = torch.zeros(batch_size, dtype=torch.int64)
    return zeros, zeros, target_probs[:, 0, 0].argmax(-1)


@pytest.mark.parametrize(
    "returned,message",
    [
        (lambda b: "nope", "must return VerifyOutput"),
        (lambda b: (torch.zeros(b), torch.zeros(b, dtype=torch.int64), torch.zeros(b, dtype=torch.int64)), "num_accepted must have dtype torch.int64"),
        (lambda b: (torch.zeros(b + 1, dtype=torch.int64),) * 3, "must have shape [2]"),
        (lambda b: (torch.full((b,), 5, dtype=torch.int64), torch.zeros(b, dtype=torch.int64), torch.zeros(b, dtype=torch.int64)), "num_accepted[0] = 5 is outside [0, 1]"),
        (lambda b: (torch.zeros(b, dtype=torch.int64), torch.full((b,), 2, dtype=torch.int64), torch.zeros(b, dtype=torch.int64)), "draft_index[0] = 2 is outside [0, 1]"),
        (lambda b: (torch.zeros(b, dtype=torch.int64), torch.zeros(b, dtype=torch.int64), torch.full((b,), -1, dtype=torch.int64)), "next_token[0] = -1 is outside [0, 2]"),
    ],
)
def test_third_party_output_is_validated(returned, message):
    verifier = FunctionVerifier(lambda t, d, g, gen: returned(t.shape[0]), name="bad")
    with pytest.raises(VerifierError) as info:
        verifier.verify(*_good(), None)
    assert message in str(info.value)


def test_third_party_exception_becomes_verifier_error():
    def explode(*args):
        raise KeyError("boom")

    with pytest.raises(VerifierError, match="bad: verify raised KeyError"):
        FunctionVerifier(explode, name="bad").verify(*_good(), None)


def test_function_adapter_keeps_declarations():
    verifier = as_verifier(_first_token_verify)
    assert verifier.name == "_first_token_verify" and not verifier.has_exact_law
    out = verifier.verify(*_good(), None)
    assert isinstance(out, VerifyOutput) and out.next_token.tolist() == [0, 0]


def test_object_adapter_keeps_output_probs_and_scheme():
    class Mine:
        name = "mine"
        draft_scheme = "without_replacement"
        max_draft_len = 1

        def verify(self, *args):
            return _first_token_verify(*args)

        def output_probs(self, draft_tokens, draft_probs, target_probs):
            out = torch.zeros(*draft_tokens.shape[:2], 2, draft_probs.shape[-1], dtype=torch.float64)
            out[:, 0, 0, 0] = 1.0
            return out

    verifier = as_verifier(Mine)
    assert verifier.name == "mine" and verifier.has_exact_law and verifier.draft_scheme == "without_replacement"
    assert not verifier.supports(2, 2)
    assert float(verifier.output_probs(*_good()).sum()) == 2.0


def test_as_verifier_rejects_non_callables():
    with pytest.raises(InvalidArgument, match="verifier: expected a Verifier"):
        as_verifier(42)


def test_every_builtin_is_addressable_by_short_name():
    for name in builtin_names():
        assert load_verifier(name).name == name


def test_load_verifier_from_module_and_file(tmp_path, monkeypatch):
    source = textwrap.dedent(
        """
        import torch
        def my_verify(draft_tokens, draft_probs, target_probs, generator):
            b = draft_tokens.shape[0]
            z = torch.zeros(b, dtype=torch.int64)
            return z, z, target_probs[:, 0, 0].argmax(-1)
        """
    )
    (tmp_path / "my_engine.py").write_text(source)
    from_file = load_verifier(f"{tmp_path / 'my_engine.py'}:my_verify")
    assert from_file.name == "my_verify"
    monkeypatch.syspath_prepend(str(tmp_path))
    from_module = load_verifier("my_engine:my_verify")
    assert from_module.verify(*_good(), None).next_token.tolist() == [0, 0]


@pytest.mark.parametrize(
    "spec,message",
    [
        ("nonexistent", "is neither a built-in name"),
        ("no_such_module_xyz:fn", "cannot import module"),
        ("spectr_audit.contract.verifier:nope", "has no attribute"),
        ("missing/file.py:fn", "does not exist"),
    ],
)
def test_load_verifier_errors(spec, message):
    with pytest.raises(InvalidArgument, match=message):
        load_verifier(spec)


def test_the_contract_declares_which_entry_points_check_their_inputs():
    # an audit checks inputs once and calls with validate=False only where the entry point is the contract's own
    from spectr_audit.contract.chain_trees import ChainVerifierAsTree
    from spectr_audit.contract.limited import TimeLimitedTreeVerifier, TimeLimitedVerifier
    from spectr_audit.verifiers.speculative import SpeculativeSampling
    from spectr_audit.verifiers.tree import TreeRecursiveRejection

    class OwnVerify(SpeculativeSampling):
        def verify(self, draft_tokens, draft_probs, target_probs, generator=None):
            return super().verify(draft_tokens, draft_probs, target_probs, generator)

    class OwnTreeLaw(TreeRecursiveRejection):
        def tree_output_probs(self, *args):
            return super().tree_output_probs(*args)

    plain, own = SpeculativeSampling(), OwnVerify()
    assert plain.standard_entry("verify") and plain.standard_entry("output_probs")
    assert not own.standard_entry("verify") and own.standard_entry("output_probs")
    assert not plain.standard_entry("verify_tree") and not plain.standard_entry("_verify")
    logits = load_verifier("logits-speculative")
    assert logits.standard_entry("verify_logits") and logits.standard_entry("output_probs_logits")
    assert TreeRecursiveRejection().standard_entry("tree_output_probs")
    assert not OwnTreeLaw().standard_entry("tree_output_probs") and OwnTreeLaw().standard_entry("verify_tree")
    # the chain adapter's tree law takes validate=False; a time-limited verifier answers for the one it calls
    assert ChainVerifierAsTree(own).standard_entry("tree_output_probs")
    assert not TimeLimitedVerifier(own, 5).standard_entry("verify")
    assert TimeLimitedVerifier(own, 5).standard_entry("output_probs")
    assert not TimeLimitedTreeVerifier(OwnTreeLaw(), 5).standard_entry("tree_output_probs")
