"""The transformers scorer's throughput: one row per forward pass against padded batches, measured in one run.

The scorer of the generation audit (``spectr_audit.engine_adapters.hf.TransformersScorer``) teacher-forces the
target over each prompt and continuation in float64.  Here on the random Llama of the end-to-end suite
(``engine_adapters.checkpoints.write_llama``: vocabulary 512, hidden 64, 2 layers) with ragged prompts (1-19
tokens) and continuations (up to the given length), the two settings alternate for ``--rounds`` rounds on the
process clock with one thread; printed: tokens scored per second of each (fastest round), their ratio, and the
largest difference of the logits (float64), which must stay at rounding.

    python benchmarks/bench_scoring.py [--rows 24] [--max-new-tokens 32] [--batch 8] [--rounds 5]
"""

from __future__ import annotations

import argparse
import tempfile
import time


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, default=24)
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--batch", type=int, default=8, help="rows per forward pass of the batched setting")
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args(argv)
    import torch

    from spectr_audit.engine_adapters.checkpoints import write_llama
    from spectr_audit.engine_adapters.hf import TransformersScorer

    torch.set_num_threads(1)
    folder = write_llama(tempfile.mkdtemp(prefix="bench-scoring-"), seed=0)
    generator = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 512, (n,), generator=generator).tolist()
               for n in torch.randint(1, 20, (args.rows,), generator=generator).tolist()]
    continuations = [torch.randint(0, 512, (n,), generator=generator).tolist()
                     for n in torch.randint(1, args.max_new_tokens + 1, (args.rows,), generator=generator).tolist()]
    tokens = sum(len(c) for c in continuations)
    scorers = {"one row per pass": TransformersScorer(folder, max_rows=1),
               f"{args.batch} rows per pass": TransformersScorer(folder, max_rows=args.batch)}
    best = {name: float("inf") for name in scorers}
    logits = {}
    for _ in range(args.rounds):
        for name, scorer in scorers.items():
            start = time.process_time()
            logits[name] = scorer.score(prompts, continuations).logits
            best[name] = min(best[name], time.process_time() - start)
    (one, base), (many, fast) = best.items()
    gap = max(float((a - b).abs().max()) for a, b in zip(logits[one], logits[many]))
    print(f"{tokens} tokens of {args.rows} rows, process clock, one thread, fastest of {args.rounds} rounds")
    for name, seconds in best.items():
        print(f"  {name:>20}: {seconds * 1000:8.1f} ms, {tokens / seconds:10.0f} tokens scored per second")
    print(f"  ratio {base / fast:.2f}x; largest logit difference {gap:.2g} (float64)")
    return 0 if gap < 1e-9 else 1


if __name__ == "__main__":
    raise SystemExit(main())
