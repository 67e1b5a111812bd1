"""Fixtures of the real-engine tests."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """A random-weight two-layer Llama target and its draft (the target's weights perturbed), loaded by
    transformers: written in a temporary folder, nothing downloaded."""
    pytest.importorskip("transformers", reason="the transformers extra (pip install -e '.[transformers]')")
    from spectr_audit.engine_adapters.checkpoints import write_llama
    from spectr_audit.engine_adapters.hf import load_causal_lm

    folder = tmp_path_factory.mktemp("llama")
    target = write_llama(folder / "target", seed=0)
    draft = write_llama(folder / "draft", seed=1, base=target, noise=0.3)
    return load_causal_lm(target), load_causal_lm(draft)
