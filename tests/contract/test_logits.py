"""Verifiers that take logits and sampling parameters (spectr_audit/contract/logits.py)."""

from __future__ import annotations

import math

import pytest
import torch

from spectr_audit.contract.logits import (
    FunctionLogitsVerifier,
    LogitsVerifier,
    as_logits_verifier,
    check_logits_inputs,
    output_probs_with_params,
    takes_logits,
    verify_with_params,
)
from spectr_audit.contract.randomness import InjectedUniforms
from spectr_audit.contract.sampling import SamplingParams, logits_from_probs, process_logits
from spectr_audit.contract.verifier import Verifier, VerifyOutput
from spectr_audit.errors import InvalidArgument, VerifierError
from spectr_audit.verifiers.library.sampling_bugs import LogitsSpeculativeSampling
from spectr_audit.verifiers.speculative import SpeculativeSampling

GEN = torch.Generator().manual_seed(0)
DRAFT_LOGITS = torch.randn(3, 1, 2, 5, generator=GEN, dtype=torch.float64)
TARGET_LOGITS = torch.randn(3, 1, 3, 5, generator=GEN, dtype=torch.float64)
PARAMS = SamplingParams(temperature=[0.5, 1.0, 2.0], top_k=[3, 0, 4], top_p=0.9)
DRAFT_TOKENS = process_logits(DRAFT_LOGITS, PARAMS).argmax(-1)  # in the processed support


def test_declaration():
    assert Verifier.takes_logits is False and not takes_logits(SpeculativeSampling())
    assert LogitsVerifier.takes_logits is True and takes_logits(LogitsSpeculativeSampling())
    assert not LogitsVerifier().has_exact_law and LogitsSpeculativeSampling().has_exact_law


def test_probabilities_verifier_gets_processed_laws():
    """A probabilities verifier handed logits sees exactly process_logits' output."""
    seen = {}

    def spy(draft_tokens, draft_probs, target_probs, generator):
        seen["draft"], seen["target"] = draft_probs, target_probs
        zeros = torch.zeros(draft_tokens.shape[0], dtype=torch.int64)
        return zeros, zeros, target_probs[:, 0, 0].argmax(-1)

    from spectr_audit.contract.verifier import FunctionVerifier

    verify_with_params(FunctionVerifier(spy), DRAFT_TOKENS, DRAFT_LOGITS, TARGET_LOGITS, PARAMS, order="sglang")
    assert torch.equal(seen["draft"], process_logits(DRAFT_LOGITS, PARAMS, "sglang"))
    assert torch.equal(seen["target"], process_logits(TARGET_LOGITS, PARAMS, "sglang"))


def test_logits_verifier_matches_probabilities_verifier():
    """The correct logits verifier and the probabilities rule on processed laws: one law, one sampler
    draw for the same uniforms."""
    logits_law = output_probs_with_params(LogitsSpeculativeSampling(), DRAFT_TOKENS, DRAFT_LOGITS, TARGET_LOGITS, PARAMS)
    probs_law = output_probs_with_params(SpeculativeSampling(), DRAFT_TOKENS, DRAFT_LOGITS, TARGET_LOGITS, PARAMS)
    assert torch.allclose(logits_law, probs_law, atol=1e-12, rtol=0)
    for u in (0.0, 0.3, 0.999):
        a = verify_with_params(LogitsSpeculativeSampling(), DRAFT_TOKENS, DRAFT_LOGITS, TARGET_LOGITS, PARAMS,
                               InjectedUniforms.constant(u))
        assert a.num_accepted.shape == (3,)
        law_rows = logits_law[torch.arange(3), 0, a.num_accepted]
        assert bool((law_rows.gather(1, a.next_token.view(-1, 1)) > 0).all())


def test_probability_entry_point_uses_neutral_parameters():
    draft_probs = torch.softmax(DRAFT_LOGITS, -1)
    target_probs = torch.softmax(TARGET_LOGITS, -1)
    tokens = draft_probs.argmax(-1)
    via_probs = LogitsSpeculativeSampling().output_probs(tokens, draft_probs, target_probs)
    via_logits = LogitsSpeculativeSampling().output_probs_logits(tokens, logits_from_probs(draft_probs), logits_from_probs(target_probs))
    assert torch.allclose(via_probs, via_logits, atol=1e-12, rtol=0)
    assert torch.allclose(via_probs, SpeculativeSampling().output_probs(tokens, draft_probs, target_probs), atol=1e-12, rtol=0)


def test_function_logits_verifier_and_errors():
    def accept_none(draft_tokens, draft_logits, target_logits, params, generator):
        b = draft_tokens.shape[0]
        token = process_logits(target_logits[:, 0, 0], params).argmax(-1)
        return torch.zeros(b, dtype=torch.int64), torch.zeros(b, dtype=torch.int64), token

    verifier = FunctionLogitsVerifier(accept_none, name="accept-none")
    out = verify_with_params(verifier, DRAFT_TOKENS, DRAFT_LOGITS, TARGET_LOGITS, PARAMS)
    assert isinstance(out, VerifyOutput) and out.num_accepted.tolist() == [0, 0, 0]
    assert not verifier.has_exact_law
    with pytest.raises(NotImplementedError):
        verifier.output_probs_logits(DRAFT_TOKENS, DRAFT_LOGITS, TARGET_LOGITS, PARAMS)

    def crashes(*args):
        raise RuntimeError("boom")

    with pytest.raises(VerifierError, match="crash: verify raised RuntimeError: boom"):
        FunctionLogitsVerifier(crashes, name="crash").verify_logits(DRAFT_TOKENS, DRAFT_LOGITS, TARGET_LOGITS, PARAMS)

    def bad_output(draft_tokens, *args):
        return torch.zeros(1), torch.zeros(1), torch.zeros(1)

    with pytest.raises(VerifierError, match="num_accepted must have dtype torch.int64"):
        FunctionLogitsVerifier(bad_output, name="bad").verify_logits(DRAFT_TOKENS, DRAFT_LOGITS, TARGET_LOGITS, PARAMS)
    with pytest.raises(InvalidArgument, match="fn: expected a callable"):
        FunctionLogitsVerifier(3)


def test_as_logits_verifier():
    class Engine:
        name = "engine"
        max_drafts = 1

        def verify_logits(self, draft_tokens, draft_logits, target_logits, params, generator):
            b = draft_tokens.shape[0]
            return torch.zeros(b, dtype=torch.int64), torch.zeros(b, dtype=torch.int64), torch.zeros(b, dtype=torch.int64)

    wrapped = as_logits_verifier(Engine())
    assert wrapped.name == "engine" and wrapped.max_drafts == 1 and wrapped.takes_logits
    assert as_logits_verifier(LogitsSpeculativeSampling).name == "logits-speculative"
    with pytest.raises(InvalidArgument, match="expected a LogitsVerifier"):
        as_logits_verifier(SpeculativeSampling())


BAD_INPUTS = [
    (dict(draft_tokens=DRAFT_TOKENS.int()), "draft_tokens: expected dtype torch.int64"),
    (dict(draft_tokens=DRAFT_TOKENS[:, 0]), "draft_tokens: expected shape"),
    (dict(draft_logits=DRAFT_LOGITS[:, :, :1]), r"draft_logits: expected shape \(3, 1, 2, 5\)"),
    (dict(target_logits=TARGET_LOGITS[..., :4]), r"target_logits: expected shape \(3, 1, 3, 4\)|vocab_size 4 differs"),
    (dict(draft_logits=DRAFT_LOGITS.clone().fill_(math.nan)), "draft_logits: logits must be finite or -inf"),
    (dict(target_logits=TARGET_LOGITS.clone().fill_(-math.inf)), "target_logits: the row at index"),
    (dict(draft_tokens=torch.full((3, 1, 2), 7)), r"draft_tokens: token ids must lie in \[0, 5\)"),
    (dict(draft_logits=DRAFT_LOGITS.clone().scatter_(-1, DRAFT_TOKENS.unsqueeze(-1), -math.inf)), "has draft logit -inf"),
    (dict(params=SamplingParams(temperature=[1.0, 1.0])), "sampling parameters have 2 rows, the batch has 3"),
    (dict(params="hot"), "params: expected SamplingParams"),
]


@pytest.mark.parametrize("change, message", BAD_INPUTS)
def test_bad_logits_inputs(change, message):
    kwargs = dict(draft_tokens=DRAFT_TOKENS, draft_logits=DRAFT_LOGITS, target_logits=TARGET_LOGITS, params=PARAMS)
    kwargs.update(change)
    with pytest.raises(InvalidArgument, match=message):
        check_logits_inputs(**kwargs)
    with pytest.raises(InvalidArgument, match=message):
        verify_with_params(LogitsSpeculativeSampling(), **kwargs)


def test_drafted_token_outside_processed_support():
    """top-k 1 leaves one token: a draft of any other is refused, naming the order."""
    params = SamplingParams(top_k=1)
    other = (process_logits(DRAFT_LOGITS, params).argmax(-1) + 1) % 5
    for verifier in (LogitsSpeculativeSampling(), SpeculativeSampling()):
        with pytest.raises(InvalidArgument, match="probability 0 under the processed draft law \\(order 'vllm'\\)"):
            verify_with_params(verifier, other, DRAFT_LOGITS, TARGET_LOGITS, params)
        with pytest.raises(InvalidArgument, match="cannot have been drafted"):
            output_probs_with_params(verifier, other, DRAFT_LOGITS, TARGET_LOGITS, params)


@pytest.mark.parametrize("verifier", [SpeculativeSampling(), LogitsSpeculativeSampling()], ids=["probs", "logits"])
def test_a_shape_the_verifier_does_not_support_is_refused_on_both_paths(verifier):
    """Single-draft speculative sampling handed K = 2 through the logits entry points: the same refusal as
    :meth:`Verifier.verify` gives, naming the supported ranges."""
    tokens = torch.zeros(1, 2, 1, dtype=torch.int64)
    draft_logits, target_logits = torch.zeros(1, 2, 1, 4), torch.zeros(1, 2, 2, 4)
    with pytest.raises(InvalidArgument, match=r"supports num_drafts in \[1, 1\].*got num_drafts=2"):
        verify_with_params(verifier, tokens, draft_logits, target_logits, None, torch.Generator())
    with pytest.raises(InvalidArgument, match=r"supports num_drafts in \[1, 1\].*got num_drafts=2"):
        output_probs_with_params(verifier, tokens, draft_logits, target_logits)
