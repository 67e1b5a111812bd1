"""SmolLM2 written as a transformers checkpoint: the weights the real-LM suite runs, loadable by transformers.

The engines-e2e factories and the standalone reproduction scripts write SmolLM2 with one function
(``repro_template.write_smollm2``, behind ``checkpoints.write_smollm2``); the checkpoint must be the real-LM
suite's dequantised weights, tensor for tensor, with a layer-dropped draft renumbered in order.
"""

from __future__ import annotations

import pytest
import torch

from spectr_audit.errors import InvalidArgument
from spectr_audit.lm import smollm

AVAILABLE, WHY = smollm.availability()
needs_model = pytest.mark.skipif(not AVAILABLE, reason=WHY or "real-LM extra not installed")


@pytest.mark.parametrize("drop_layers", [(-1,), (30,), tuple(range(30))])
@needs_model
def test_bad_layers_to_drop_are_named(tmp_path, drop_layers):
    from spectr_audit.engine_adapters.checkpoints import write_smollm2

    with pytest.raises(InvalidArgument, match="drop_layers"):
        write_smollm2(tmp_path / "m", drop_layers=drop_layers)


@needs_model
@pytest.mark.slow
def test_the_written_checkpoint_is_the_real_lm_weights_with_layers_dropped(tmp_path):
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from spectr_audit.engine_adapters.checkpoints import write_smollm2

    smollm.load_smollm()  # the real-LM suite's dequantised weights, cached
    cached = load_file(str(smollm.cache_folder(smollm.locate_gguf()) / "model.safetensors"))
    folder = write_smollm2(tmp_path / "draft", drop_layers=(3, 7))
    written = load_file(str(folder / "model.safetensors"))
    kept = [i for i in range(30) if i not in (3, 7)]
    expected = {}
    for name, tensor in cached.items():
        if name.startswith("model.layers."):
            index, rest = name[len("model.layers."):].split(".", 1)
            if int(index) not in kept:
                continue
            name = f"model.layers.{kept.index(int(index))}.{rest}"
        expected[name] = tensor
    assert sorted(written) == sorted(expected)
    assert all(torch.equal(written[name], expected[name]) for name in expected)
    model = AutoModelForCausalLM.from_pretrained(str(folder))  # transformers loads it as an ordinary Llama
    assert model.config.num_hidden_layers == 28 and model.config.tie_word_embeddings
    assert torch.equal(model.lm_head.weight, model.model.embed_tokens.weight)
