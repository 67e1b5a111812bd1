"""Models: context-free, Markov (right-aligned contexts with padding), explicit tables, torch callables."""

from __future__ import annotations

import pytest
import torch

from spectr_audit.errors import InvalidArgument
from spectr_audit.drafting.models import PAD, MarkovModel, TableModel, TorchModel, random_markov


def test_markov_reads_the_last_token_and_treats_padding_as_the_start():
    # order 1, V = 2: rows for previous token 0, 1, and "start" (index V)
    model = MarkovModel([[0.9, 0.1], [0.2, 0.8], [0.5, 0.5]], order=1)
    contexts = torch.tensor([[PAD, PAD], [PAD, 0], [1, 1], [0, 1]])
    torch.testing.assert_close(
        model(contexts), torch.tensor([[0.5, 0.5], [0.9, 0.1], [0.2, 0.8], [0.2, 0.8]], dtype=torch.float64)
    )
    assert model(torch.zeros(3, 0, dtype=torch.int64)).tolist() == [[0.5, 0.5]] * 3


def test_random_markov_temperature_sharpens_rows():
    hot, cold = random_markov(5, 1, seed=3, temperature=1.0), random_markov(5, 1, seed=3, temperature=0.2)
    ctx = torch.tensor([[2]])
    assert float(cold(ctx).max()) > float(hot(ctx).max())
    assert int(cold(ctx).argmax()) == int(hot(ctx).argmax())


def test_table_model_lookup_default_and_missing_context():
    model = TableModel({(): [0.5, 0.5], (0,): [0.9, 0.1]}, default=[0.3, 0.7])
    out = model(torch.tensor([[PAD, PAD], [PAD, 0], [1, 1]]))
    torch.testing.assert_close(out, torch.tensor([[0.5, 0.5], [0.9, 0.1], [0.3, 0.7]], dtype=torch.float64))
    with pytest.raises(InvalidArgument, match="no distribution for context"):
        TableModel({(): [1.0, 0.0]})(torch.tensor([[1]]))
    with pytest.raises(InvalidArgument, match="one length"):
        TableModel({(): [1.0], (0,): [0.5, 0.5]})


def test_torch_model_applies_softmax_and_temperature_and_checks_shapes():
    logits = torch.tensor([0.0, 1.0, 2.0])
    model = TorchModel(lambda ctx: logits.expand(ctx.shape[0], -1), vocab_size=3, temperature=0.5)
    torch.testing.assert_close(model(torch.zeros(2, 1, dtype=torch.int64))[0], torch.softmax(logits.double() / 0.5, -1))
    probs = TorchModel(lambda ctx: torch.tensor([[2.0, 6.0]]), vocab_size=2, outputs="probs")
    assert probs(torch.zeros(1, 0, dtype=torch.int64)).tolist() == [[0.25, 0.75]]
    with pytest.raises(InvalidArgument, match=r"fn: must return \[batch_size, 4\]"):
        TorchModel(lambda ctx: torch.zeros(1, 3), vocab_size=4)(torch.zeros(1, 1, dtype=torch.int64))
    with pytest.raises(InvalidArgument, match="temperature"):
        TorchModel(lambda ctx: ctx, vocab_size=2, temperature=0.0)
