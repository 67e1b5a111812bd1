"""Contract <-> vLLM ragged-batch conversions (spectr_audit/engines/ragged.py).

Round trips on random batches (hypothesis), the layout of vLLM's own worked example
(``gpu_model_runner._calc_spec_decode_metadata``'s comment) and of its ``SpecDecodeMetadata``,
the output conversions, and one run of vLLM's ``rejection_sample`` on a converted batch.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from spectr_audit.contract.verifier import VerifyOutput, check_verify_inputs
from spectr_audit.engines.ragged import (
    PLACEHOLDER_TOKEN_ID,
    RaggedBatch,
    expand_batch_to_tokens,
    from_ragged,
    output_from_ragged,
    output_to_ragged,
    to_ragged,
)
from spectr_audit.errors import InvalidArgument, VerifierError


@st.composite
def contract_batches(draw):
    batch_size = draw(st.integers(1, 5))
    draft_len = draw(st.integers(1, 4))
    vocab_size = draw(st.integers(2, 6))
    seed = draw(st.integers(0, 2**16))
    gen = torch.Generator().manual_seed(seed)
    draft_probs = torch.rand(batch_size, 1, draft_len, vocab_size, generator=gen, dtype=torch.float64) + 0.01
    draft_probs /= draft_probs.sum(-1, keepdim=True)
    target_probs = torch.rand(batch_size, 1, draft_len + 1, vocab_size, generator=gen, dtype=torch.float64) + 0.01
    target_probs /= target_probs.sum(-1, keepdim=True)
    draft_tokens = torch.randint(vocab_size, (batch_size, 1, draft_len), generator=gen)
    counts = draw(st.lists(st.integers(0, draft_len), min_size=batch_size, max_size=batch_size))
    return draft_tokens, draft_probs, target_probs, counts


@settings(max_examples=80, deadline=None)
@given(contract_batches(), st.booleans())
def test_round_trip_contract_to_ragged(case, with_draft_probs):
    draft_tokens, draft_probs, target_probs, counts = case
    batch = to_ragged(draft_tokens, draft_probs if with_draft_probs else None, target_probs, counts)
    assert batch.num_tokens == sum(counts) == int(batch.cu_num_draft_tokens[-1])
    assert batch.target_probs.shape[0] == sum(counts) + len(counts)
    tokens, probs, target, back_counts = from_ragged(batch, draft_len=draft_tokens.shape[2])
    assert back_counts.tolist() == counts
    for b, n in enumerate(counts):
        assert torch.equal(tokens[b, 0, :n], draft_tokens[b, 0, :n])
        assert torch.equal(target[b, 0, : n + 1], target_probs[b, 0, : n + 1])
        if with_draft_probs:
            assert torch.equal(probs[b, 0, :n], draft_probs[b, 0, :n])
        # the request's own rows, found through vLLM's indices
        start = int(batch.cu_num_draft_tokens[b]) - n
        assert torch.equal(batch.draft_token_ids[start : start + n], draft_tokens[b, 0, :n])
        assert torch.equal(batch.target_rows[start : start + n], target_probs[b, 0, :n])
        assert torch.equal(batch.bonus_rows[b], target_probs[b, 0, n])
    if with_draft_probs:
        check_verify_inputs(tokens, probs, target)  # the padding keeps the contract's checks happy
    # and back again: identical, field by field
    assert to_ragged(tokens, probs, target, back_counts).equals(batch)


@settings(max_examples=40, deadline=None)
@given(contract_batches())
def test_full_length_round_trip_is_identity(case):
    draft_tokens, draft_probs, target_probs, _ = case
    tokens, probs, target, counts = from_ragged(to_ragged(draft_tokens, draft_probs, target_probs))
    assert torch.equal(tokens, draft_tokens) and torch.equal(probs, draft_probs) and torch.equal(target, target_probs)


@settings(max_examples=80, deadline=None)
@given(contract_batches(), st.data())
def test_round_trip_outputs(case, data):
    draft_tokens, draft_probs, target_probs, counts = case
    vocab_size = target_probs.shape[-1]
    batch = to_ragged(draft_tokens, draft_probs, target_probs, counts)
    tokens, _, _, _ = from_ragged(batch, draft_len=draft_tokens.shape[2])
    accepted = torch.tensor([data.draw(st.integers(0, n)) for n in counts])
    next_token = torch.tensor([data.draw(st.integers(0, vocab_size - 1)) for _ in counts])
    out = VerifyOutput(accepted, torch.zeros_like(accepted), next_token)
    ragged = output_to_ragged(out, tokens, batch.max_spec_len)
    assert ragged.dtype == torch.int32 and ragged.shape == (len(counts), batch.max_spec_len + 1)
    assert ((ragged != PLACEHOLDER_TOKEN_ID).sum(-1) == accepted + 1).all()
    back = output_from_ragged(ragged, batch)
    assert torch.equal(back.num_accepted, accepted) and torch.equal(back.next_token, next_token)
    assert out.emitted(tokens) == back.emitted(tokens)
    assert torch.equal(output_to_ragged(back, tokens, batch.max_spec_len), ragged)


def test_vllm_worked_example():
    """vLLM's own example: drafts per request [3, 0, 2, 0, 1]."""
    counts = [3, 0, 2, 0, 1]
    draft_tokens = torch.arange(15).reshape(5, 1, 3) % 7
    target = torch.arange(5 * 4 * 7, dtype=torch.float64).reshape(5, 1, 4, 7)
    batch = to_ragged(draft_tokens, None, target, counts)
    assert batch.cu_num_draft_tokens.tolist() == [3, 3, 5, 5, 6]
    assert batch.cu_num_sampled_tokens.tolist() == [4, 5, 8, 9, 11]
    assert batch.target_logits_indices.tolist() == [0, 1, 2, 5, 6, 9]
    assert batch.bonus_logits_indices.tolist() == [3, 4, 7, 8, 10]
    assert batch.cu_num_draft_tokens.dtype == torch.int32 and batch.max_spec_len == 3
    assert batch.draft_token_ids.tolist() == [0, 1, 2, 6, 0, 5]
    values = torch.tensor([1.0, 2.0, 3.0, 4.0, 5.0])
    assert expand_batch_to_tokens(values, batch.cu_num_draft_tokens).tolist() == [1, 1, 1, 3, 3, 5]


def test_matches_vllm_spec_decode_metadata():
    pytest.importorskip("vllm")
    from vllm.v1.spec_decode.metadata import SpecDecodeMetadata

    drafts = [[4, 1, 2], [], [3, 3], [5]]
    dummy = SpecDecodeMetadata.make_dummy(drafts, torch.device("cpu"))
    tokens = torch.zeros(4, 1, 3, dtype=torch.int64)
    for b, row in enumerate(drafts):
        tokens[b, 0, : len(row)] = torch.tensor(row, dtype=torch.int64)
    batch = to_ragged(tokens, None, torch.zeros(4, 1, 4, 6), [len(r) for r in drafts])
    assert torch.equal(batch.cu_num_draft_tokens, dummy.cu_num_draft_tokens)
    assert torch.equal(batch.cu_num_sampled_tokens, dummy.cu_num_sampled_tokens)
    assert batch.draft_token_ids.tolist() == dummy.draft_token_ids.tolist()
    assert batch.max_spec_len == dummy.max_spec_len


def test_vllm_rejection_sample_on_converted_batch():
    """A target that is one-hot at each draft accepts every draft: vLLM's output is drafts + bonus."""
    pytest.importorskip("vllm")
    from spectr_audit.engines.vllm_v1 import _import_vllm, _sampling_metadata

    _, rejection_sample, metadata_cls = _import_vllm()
    counts = [2, 0, 3]
    draft_tokens = torch.tensor([[[1, 4, 0]], [[2, 2, 2]], [[3, 0, 5]]])
    vocab_size = 6
    one_hot = torch.nn.functional.one_hot(draft_tokens, vocab_size).double()  # [B, 1, L, V]
    target = torch.cat([one_hot, torch.full((3, 1, 1, vocab_size), 1 / vocab_size, dtype=torch.float64)], dim=2)
    batch = to_ragged(draft_tokens, one_hot.float(), target.float(), counts)
    bonus = torch.tensor([[5], [1], [2]])
    out = rejection_sample(
        batch.draft_token_ids, batch.num_draft_tokens, batch.max_spec_len, batch.cu_num_draft_tokens,
        batch.draft_probs.contiguous(), batch.target_rows.log().contiguous(), bonus, _sampling_metadata(metadata_cls, 3),
    )
    verdict = output_from_ragged(out, batch)
    assert verdict.num_accepted.tolist() == counts
    assert verdict.next_token.tolist() == [5, 1, 2]


BAD = [
    (lambda: to_ragged(torch.zeros(2, 2, 1, dtype=torch.int64), None, torch.zeros(2, 2, 2, 3)), InvalidArgument, "one chain per request"),
    (lambda: to_ragged(torch.zeros(2, 1, 2, dtype=torch.int64), None, torch.zeros(2, 1, 2, 3)), InvalidArgument, r"target_probs: expected shape \(2, 1, 3, vocab_size\)"),
    (lambda: to_ragged(torch.zeros(2, 1, 2, dtype=torch.int64), torch.zeros(2, 1, 2, 4), torch.zeros(2, 1, 3, 3)), InvalidArgument, "draft_probs: expected shape"),
    (lambda: to_ragged(torch.zeros(2, 1, 2, dtype=torch.int64), None, torch.zeros(2, 1, 3, 3), [1]), InvalidArgument, "expected 2 counts"),
    (lambda: to_ragged(torch.zeros(2, 1, 2, dtype=torch.int64), None, torch.zeros(2, 1, 3, 3), [1, 3]), InvalidArgument, r"count 3 of request 1 must be an integer in \[0, 2\]"),
    (lambda: output_from_ragged(torch.tensor([[-1, 2]])), VerifierError, "request 0: output row \\[-1, 2\\] has a placeholder before"),
    (lambda: output_from_ragged(torch.tensor([[-1, -1]])), VerifierError, "none emitted"),
    (lambda: output_from_ragged(torch.tensor([[1, 9]]), vocab_size=4), VerifierError, r"token id 9 is outside \[0, 4\)"),
    (lambda: output_from_ragged(torch.tensor([1, 2])), VerifierError, "must be a \\[batch_size"),
    (lambda: expand_batch_to_tokens(torch.ones(2), torch.tensor([1, 2, 3])), InvalidArgument, "expected 3 per-request values"),
]


@pytest.mark.parametrize("call, error, message", BAD)
def test_bad_input(call, error, message):
    with pytest.raises(error, match=message):
        call()


def test_output_checks_against_batch():
    batch = to_ragged(torch.tensor([[[1, 2]], [[3, 0]]]), None, torch.zeros(2, 1, 3, 5), [2, 1])
    with pytest.raises(VerifierError, match="request 1 emitted 3 tokens with 1 drafts"):
        output_from_ragged(torch.tensor([[1, 2, 4], [3, 0, 1]]), batch)
    with pytest.raises(VerifierError, match="request 0: emitted token 4 at position 1 is not the draft 2"):
        output_from_ragged(torch.tensor([[1, 4, 4], [3, -1, -1]]), batch)
    with pytest.raises(InvalidArgument, match="draft_len: 1 is shorter"):
        from_ragged(batch, draft_len=1)
    assert isinstance(batch, RaggedBatch) and not batch.equals("x")
