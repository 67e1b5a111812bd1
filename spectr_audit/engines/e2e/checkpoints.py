"""Small random-weight Llama checkpoints for end-to-end engine audits, written by the caller on the spot.

:func:`write_llama` saves a transformers ``LlamaForCausalLM`` with random weights (safetensors,
float32) and no tokenizer: engines run it on token-id prompts (vLLM with
``skip_tokenizer_init=True``).  ``init_std`` sets how peaked its laws are; a draft is either the
target's weights perturbed (:func:`write_llama` with ``base=``; it agrees with the target most of
the time, so the accept path and the bonus token are exercised) or an independent model (the
rejection path).  vLLM's CPU attention needs a head size of at least 32.

Nothing is downloaded: the weights are drawn from a seeded generator.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional, Union

__all__ = ["write_llama"]


def write_llama(path: Union[str, Path], *, seed: int = 0, vocab_size: int = 512, hidden_size: int = 64,
                num_layers: int = 2, num_heads: int = 2, init_std: float = 0.12, base: Optional[Union[str, Path]] = None,
                noise: float = 0.3, max_positions: int = 1024) -> Path:
    """Write a random Llama to ``path`` (a folder) and return it.

    Parameters
    ----------
    path : str or Path
    seed : int
    vocab_size, hidden_size, num_layers, num_heads : int
        The head size is ``hidden_size / num_heads`` (at least 32 for vLLM's CPU build).
    init_std : float
        Standard deviation of the weight matrices (biases and norms keep their defaults).
    base : str or Path, optional
        A checkpoint written by this function: the new one is its weights, each moved by
        ``noise`` times its own standard deviation (a draft that mostly agrees with ``base``).
    """
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    path = Path(path)
    if base is not None:
        model = LlamaForCausalLM.from_pretrained(str(base), torch_dtype=torch.float32)
        generator = torch.Generator().manual_seed(int(seed))
        with torch.no_grad():
            for parameter in model.parameters():
                if parameter.dim() > 1:
                    spread = parameter.std()
                    parameter.add_(noise * spread * torch.randn(parameter.shape, generator=generator))
        model.save_pretrained(str(path), safe_serialization=True)
        return path
    config = LlamaConfig(vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=2 * hidden_size,
                         num_hidden_layers=num_layers, num_attention_heads=num_heads, num_key_value_heads=num_heads,
                         max_position_embeddings=max_positions, bos_token_id=1, eos_token_id=2,
                         tie_word_embeddings=False)
    torch.manual_seed(int(seed))
    model = LlamaForCausalLM(config)
    generator = torch.Generator().manual_seed(int(seed))
    with torch.no_grad():
        for parameter in model.parameters():
            if parameter.dim() > 1:
                parameter.copy_(init_std * torch.randn(parameter.shape, generator=generator))
    model.save_pretrained(str(path), safe_serialization=True)
    return path
