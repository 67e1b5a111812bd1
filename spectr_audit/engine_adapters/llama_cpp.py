"""llama.cpp (through ``llama-cpp-python``) as a generator and as its own scorer, on a GGUF file.

:class:`LlamaCppGenerator` runs ``Llama.generate`` on token-id prompts, one request at a time
(the Python binding decodes one sequence), each seeded with ``Llama.set_seed`` from the audit's
seed and the row, with every sampler of llama-cpp-python's chain set explicitly (its defaults
are top-k 40, top-p 0.95, min-p 0.05, temperature 0.8). With ``prompt_lookup_num_tokens`` the
engine speculates with ``LlamaPromptLookupDecoding`` (n-gram prompt lookup): each step
evaluates the drafted tokens in one batch and samples every position from the batch's logits,
keeping drafts while the sampled token equals the drafted one.

:class:`LlamaCppScorer` is the same GGUF evaluated by llama.cpp without speculation
(``logits_all=True``, one evaluation of each prompt and continuation): the raw logits at every
emitted position, as :class:`~spectr_audit.generation.contract.ScoredLogits` with llama.cpp's
processing order (top-k, top-p, min-p, then temperature). The scorer is the engine's own
numerics (float32 logits from its quantised kernels); the reference (the same engine without
speculation) measures the numerics floor between a batched and a one-token evaluation.

llama-cpp-python installs from PyPI as a source distribution and compiles llama.cpp (about 7
minutes on 2 cores). Built for the build machine's own CPU (its default) it crashed in
``llama_decode`` on this project's virtual machines; built with
``CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX512=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_TILE=OFF
-DGGML_AMX_BF16=OFF"`` it runs (docs/engines-e2e.md).
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

from spectr_audit.contract.sampling import PROCESSING_ORDERS, SamplingParams
from spectr_audit.generation.contract import ScoredLogits

__all__ = ["LLAMA_CPP_ORDER", "LlamaCppGenerator", "LlamaCppScorer", "llama_cpp_version", "load_llama"]

#: llama-cpp-python's sampler chain (``Llama._init_sampler``): top-k, typical, top-p, min-p, temperature, draw
#: (vLLM's conventions otherwise: top-p keeps the token that crosses the mass, temperature 0 is greedy).
LLAMA_CPP_ORDER = PROCESSING_ORDERS["vllm"].with_steps(("top_k", "top_p", "min_p", "temperature"), name="llama.cpp")


def llama_cpp_version() -> str:
    """``llama-cpp-python X.Y.Z``."""
    import importlib.metadata

    try:
        return f"llama-cpp-python {importlib.metadata.version('llama-cpp-python')}"
    except importlib.metadata.PackageNotFoundError:  # pragma: no cover - imported from a source tree
        return "llama-cpp-python (version unknown)"


def load_llama(model_path: str, *, prompt_lookup_num_tokens: Optional[int] = None, logits_all: bool = False,
               n_ctx: int = 1024, n_threads: Optional[int] = None):
    """A ``llama_cpp.Llama`` on ``model_path``, quiet, with prompt-lookup speculation when asked."""
    from llama_cpp import Llama

    draft = None
    if prompt_lookup_num_tokens:
        from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

        draft = LlamaPromptLookupDecoding(num_pred_tokens=int(prompt_lookup_num_tokens))
    return Llama(model_path=str(model_path), draft_model=draft, logits_all=logits_all, n_ctx=n_ctx, verbose=False,
                 seed=0, n_threads=n_threads)


class LlamaCppGenerator:
    """``Llama.generate`` on token-id prompts, one row at a time, seeded per row.

    Parameters
    ----------
    llm : llama_cpp.Llama
    params : SamplingParams
        Temperature 0 is greedy; top-k 0 and top-p 1 are off; min-p is the request's (0 off).
    label : str
    """

    per_row_max_new_tokens = True

    def __init__(self, llm: Any, params: Optional[SamplingParams] = None, label: str = ""):
        self.llm, self.params = llm, params or SamplingParams()
        self.name = f"{llama_cpp_version()} Llama.generate{' (' + label + ')' if label else ''}"

    def generate(self, prompts, max_new_tokens, seed):
        p = self.params
        limits = list(max_new_tokens) if isinstance(max_new_tokens, Sequence) else [max_new_tokens] * len(prompts)
        out = []
        for row, (prompt, limit) in enumerate(zip(prompts, limits)):
            self.llm.set_seed((int(seed) * 1_000_003 + row) % (1 << 31))
            tokens: list = []
            if limit > 0:
                for token in self.llm.generate(list(prompt), top_k=int(p.top_k), top_p=float(p.top_p),
                                               min_p=float(p.min_p), typical_p=1.0, temp=float(p.temperature),
                                               repeat_penalty=1.0, frequency_penalty=0.0, presence_penalty=0.0,
                                               reset=True):
                    tokens.append(int(token))
                    if len(tokens) >= limit:
                        break
            out.append(tokens)
        return out


class LlamaCppScorer:
    """The GGUF's logits at every emitted position, evaluated by llama.cpp without speculation.

    Parameters
    ----------
    llm : llama_cpp.Llama
        Loaded with ``logits_all=True`` and no draft model.
    params : SamplingParams
    """

    def __init__(self, llm: Any, params: Optional[SamplingParams] = None):
        self.llm, self.params = llm, params or SamplingParams()
        self.name = f"{llama_cpp_version()} without speculation (float32 logits)"

    def score(self, prompts, continuations):
        import numpy as np
        import torch

        out = []
        for prompt, continuation in zip(prompts, continuations):
            if not continuation:
                out.append(torch.zeros(0, self.llm.n_vocab(), dtype=torch.float64))
                continue
            self.llm.reset()
            self.llm.eval(list(prompt) + list(continuation))
            first = len(prompt) - 1
            logits = np.array(self.llm.scores[first:first + len(continuation)], dtype=np.float64)
            out.append(torch.from_numpy(logits))
        return ScoredLogits(out, self.params, LLAMA_CPP_ORDER)
