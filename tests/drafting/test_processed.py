"""Processed laws, raw logits and logits verifiers bound to a case (spectr_audit.drafting.processed).

The processed laws are checked against the plain-Python oracle of :mod:`tests.oracles.sampling`
(written from docs/sampling.md, not from the reference processing).
"""

from __future__ import annotations

import math

import pytest
import torch

from spectr_audit.contract.sampling import SamplingParams
from spectr_audit.drafting.models import ContextFreeModel, random_markov
from spectr_audit.drafting.processed import (
    BoundLogitsVerifier,
    ContextFreeLogitsModel,
    ProcessedContextFreeModel,
    ProcessedModel,
    bind_params,
    node_logits,
    processed_model,
    sampling_summary,
)
from spectr_audit.errors import InvalidArgument
from spectr_audit.verifiers.library.sampling_bugs import LogitsSpeculativeSampling
from spectr_audit.verifiers.speculative import SpeculativeSampling

from tests.oracles import sampling as oracle

LOGITS = [1.2, 0.3, -0.5, 0.9, -math.inf, 0.1]
SETTINGS = [dict(temperature=0.6), dict(top_k=3), dict(top_p=0.8), dict(temperature=0.7, top_k=4, min_p=0.1),
            dict(temperature=0.0)]


@pytest.mark.parametrize("order", ["vllm", "sglang", "transformers"])
@pytest.mark.parametrize("setting", SETTINGS)
def test_processed_context_free_law_matches_the_oracle(setting, order):
    model = processed_model(ContextFreeLogitsModel(LOGITS), SamplingParams(**setting), order)
    assert isinstance(model, ProcessedContextFreeModel)
    expected = oracle.process_engine(LOGITS, order, **setting)
    assert model.probs.tolist() == pytest.approx(expected, abs=1e-12)
    # the raw logits are kept as given, -inf included
    assert model.logits(torch.zeros(2, 0, dtype=torch.int64))[1].tolist() == LOGITS


def test_processed_markov_law_and_node_logits():
    raw = random_markov(3, 1, seed=4)
    params = SamplingParams(temperature=0.5, top_k=2)
    model = processed_model(raw, params)
    assert isinstance(model, ProcessedModel)
    contexts = torch.tensor([[0], [2], [-1]])
    for row, law in zip(raw(contexts).log().tolist(), model(contexts).tolist()):
        assert law == pytest.approx(oracle.process_engine(row, "vllm", temperature=0.5, top_k=2), abs=1e-12)
    tokens = torch.tensor([[[1, 0]], [[2, 2]]])  # [2, 1, 2]
    logits = node_logits(model, torch.zeros(2, 0, dtype=torch.int64), tokens, 2)
    # node l of row b: the raw logits after the first l drafted tokens
    assert torch.equal(logits[0, 0, 1], raw(torch.tensor([[1]]))[0].log())
    assert torch.equal(logits[1, 0, 0], raw(torch.zeros(1, 0, dtype=torch.int64))[0].log())


def test_probability_models_stand_for_their_logits():
    """log(probs) stands for the logits: the processed law of a probability model is that of its log."""
    probs = torch.tensor([0.5, 0.3, 0.2, 0.0], dtype=torch.float64)
    model = processed_model(ContextFreeModel(probs), SamplingParams(temperature=2.0))
    expected = oracle.process_engine(probs.log().tolist(), "vllm", temperature=2.0)
    assert model.probs.tolist() == pytest.approx(expected, abs=1e-12)
    assert model.probs[3] == 0


def test_bind_params_errors_and_the_probability_path():
    draft, target = ContextFreeModel([0.5, 0.5]), ContextFreeModel([0.3, 0.7])
    verifier = SpeculativeSampling()
    assert bind_params(verifier, draft, target, None) == (verifier, draft, target)
    same, _, _ = bind_params(verifier, draft, target, SamplingParams(top_k=1))
    assert same is verifier  # handed the processed laws as it is
    with pytest.raises(InvalidArgument, match="one setting for all its rows"):
        bind_params(verifier, draft, target, SamplingParams(temperature=[0.5, 1.0]))
    with pytest.raises(InvalidArgument, match="min_p"):
        bind_params(verifier, draft, target, SamplingParams(min_p=0.1), order="eagle")
    processed = processed_model(draft, SamplingParams())
    with pytest.raises(InvalidArgument, match="give the raw models"):
        bind_params(verifier, processed, target, SamplingParams())


def test_bound_verifier_hands_logits_and_falls_back_on_foreign_inputs():
    params = SamplingParams(temperature=0.5)
    bound, draft, target = bind_params(LogitsSpeculativeSampling(), ContextFreeLogitsModel(LOGITS),
                                       ContextFreeLogitsModel(LOGITS[::-1]), params, foreign_inputs="probabilities")
    assert isinstance(bound, BoundLogitsVerifier) and bound.name == "logits-speculative"
    tokens = torch.tensor([[[0]], [[3]]])
    draft_probs = draft.probs.expand(2, 1, 1, 6).clone()
    target_probs = target.probs.expand(2, 1, 2, 6).clone()
    inner = LogitsSpeculativeSampling()
    law = bound.output_probs(tokens, draft_probs, target_probs)
    raw = torch.tensor(LOGITS, dtype=torch.float64)
    expected = inner.output_probs_logits(tokens, raw.expand(2, 1, 1, 6), raw.flip(0).expand(2, 1, 2, 6), params)
    assert torch.allclose(law, expected, atol=1e-15)
    # synthetic probabilities (not the models' laws): the verifier's probability entry, neutral parameters
    dense = torch.full((2, 1, 1, 6), 1 / 6, dtype=torch.float64)
    dense_target = torch.full((2, 1, 2, 6), 1 / 6, dtype=torch.float64)
    assert torch.allclose(bound.output_probs(tokens, dense, dense_target), inner.output_probs(tokens, dense, dense_target))


def test_sampling_summary():
    assert sampling_summary(SamplingParams(temperature=0.0, top_k=3), "eagle") == "temperature=0, top_k=3; eagle order"
