"""Verifier speed against the physical limit: one read of draft_probs and target_probs.

Run:  python benchmarks/bench_verifiers.py [--quick] [--device cpu|cuda] [--json out.json]

Every timing is reported as a ratio to a memory pass (``draft_probs.sum() +
target_probs.sum()``) over the same tensors, measured in the same run, so the numbers
compare across machines.  Inputs are float32 and hold about 2^26 probabilities
(``--quick``: 2^22), as in the performance issue.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time

import torch

from spectr_audit.randomness import sample_categorical
from spectr_audit.registry import BUILTIN_VERIFIERS, load_verifier

CONFIGS = [
    # (verifier, num_drafts, draft_len)
    ("speculative", 1, 1),
    ("speculative", 1, 4),
    ("kseq", 2, 1),
    ("kseq", 4, 1),
    ("kseq", 8, 1),
    ("rrs", 4, 1),
    ("rrs-wor", 4, 1),
    ("spectr-tree", 4, 4),
    ("spectr-tree", 8, 8),
    ("block", 1, 4),
    ("block", 1, 8),
]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def timed(fn, device: torch.device, repeats: int) -> float:
    """Median wall time of ``fn()`` in seconds (one warm-up call first)."""
    fn()
    _sync(device)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def make_inputs(batch_size, num_drafts, draft_len, vocab_size, device, seed=0):
    """Random peaked float32 distributions and drafts sampled from them."""
    gen = torch.Generator(device=device).manual_seed(seed)
    shape = (batch_size, num_drafts, draft_len + 1, vocab_size)
    target = torch.softmax(3 * torch.randn(shape, generator=gen, device=device), dim=-1)
    draft = torch.softmax(0.7 * target.log() + torch.randn(shape, generator=gen, device=device), dim=-1)[:, :, :draft_len]
    u = torch.rand(draft.shape[:-1], generator=gen, device=device, dtype=torch.float64)
    tokens = sample_categorical(draft, u)
    return tokens, draft.contiguous(), target.contiguous()


def bench_verifiers(total_probs: int, vocab_sizes, device, repeats) -> list[dict]:
    rows = []
    for vocab_size in vocab_sizes:
        for name, num_drafts, draft_len in CONFIGS:
            if name not in BUILTIN_VERIFIERS:
                continue
            verifier = load_verifier(name)
            per_row = num_drafts * (2 * draft_len + 1) * vocab_size
            batch_size = max(1, total_probs // per_row)
            tokens, draft_probs, target_probs = make_inputs(batch_size, num_drafts, draft_len, vocab_size, device)
            memory = timed(lambda: (draft_probs.sum(), target_probs.sum()), device, repeats)
            gen = torch.Generator(device=device).manual_seed(1)
            run = timed(lambda: verifier.verify(tokens, draft_probs, target_probs, gen, validate=False), device, repeats)
            checked = timed(lambda: verifier.verify(tokens, draft_probs, target_probs, gen), device, max(1, repeats // 2))
            rows.append({
                "verifier": name, "vocab_size": vocab_size, "num_drafts": num_drafts, "draft_len": draft_len,
                "batch_size": batch_size, "memory_pass_ms": 1e3 * memory, "verify_ms": 1e3 * run,
                "ratio": run / memory, "ratio_with_validation": checked / memory,
            })
            print(f"  {name:<12} V={vocab_size:<6} K={num_drafts} L={draft_len} B={batch_size:<5} "
                  f"memory {1e3 * memory:7.1f} ms  verify {1e3 * run:8.1f} ms  ratio {run / memory:6.2f}  "
                  f"(validated {checked / memory:6.2f})", flush=True)
            del tokens, draft_probs, target_probs
    return rows


def bench_bounds(device, repeats) -> list[dict]:
    from spectr_audit.bounds import kseq_rho_star, optimal_acceptance

    rows = []
    gen = torch.Generator(device=device).manual_seed(2)
    for vocab_size, batch_size in [(32768, 64), (131072, 16)]:
        draft = torch.softmax(2 * torch.randn(batch_size, vocab_size, generator=gen, device=device), -1)
        target = torch.softmax(2 * torch.randn(batch_size, vocab_size, generator=gen, device=device), -1)
        memory = timed(lambda: (draft.sum(), target.sum()), device, repeats)
        rho = timed(lambda: kseq_rho_star(draft, target, 8), device, max(1, repeats // 2))
        rows.append({"what": "kseq_rho_star (bisection)", "vocab_size": vocab_size, "batch_size": batch_size,
                     "ms": 1e3 * rho, "ratio": rho / memory})
        print(f"  rho* bisection   V={vocab_size:<6} B={batch_size:<3} {1e3 * rho:8.1f} ms  ratio {rho / memory:7.1f}")
    one_draft, one_target = draft[0], target[0]
    closed = timed(lambda: optimal_acceptance(one_draft, one_target, 8), device, repeats)
    rows.append({"what": "closed-form alpha*", "vocab_size": 131072, "num_drafts": 8, "ms": 1e3 * closed})
    print(f"  closed-form alpha*  V=131072 K=8: {1e3 * closed:.1f} ms")
    return rows


def bench_exact_audit(repeats) -> list[dict]:
    from spectr_audit.exact import exact_iteration
    from spectr_audit.models import ContextFreeModel

    rows = []
    gen = torch.Generator().manual_seed(3)
    kseq = load_verifier("kseq")
    for vocab_size, num_drafts in [(4, 4), (8, 3), (8, 4), (8, 5), (8, 6), (16, 3), (16, 4)]:
        draft = ContextFreeModel(torch.distributions.Dirichlet(torch.ones(vocab_size)).sample())
        target = ContextFreeModel(torch.distributions.Dirichlet(torch.ones(vocab_size)).sample())
        seconds = timed(lambda: exact_iteration(kseq, draft, target, num_drafts), torch.device("cpu"), repeats)
        import math

        tuples = vocab_size**num_drafts
        multisets = math.comb(vocab_size + num_drafts - 1, num_drafts)
        rows.append({"what": "exact K-SEQ audit", "vocab_size": vocab_size, "num_drafts": num_drafts,
                     "ordered_tuples": tuples, "multisets": multisets, "seconds": seconds})
        print(f"  exact K-SEQ audit V={vocab_size:<3} K={num_drafts}: {tuples:>8} ordered tuples "
              f"({multisets} multisets) {seconds:7.3f} s")
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="2^22 probabilities instead of 2^26")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--json", default="benchmarks/results.json")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    total = 2**22 if args.quick else 2**26
    print(f"spectr-audit verifier benchmark on {device} ({platform.processor() or platform.machine()}, "
          f"torch {torch.__version__}, {torch.get_num_threads()} threads), {total} probabilities per input set")
    result = {
        "machine": {"device": str(device), "platform": platform.platform(), "threads": torch.get_num_threads(),
                    "torch": torch.__version__, "python": sys.version.split()[0]},
        "verifiers": bench_verifiers(total, [32768] if args.quick else [32768, 131072], device, args.repeats),
        "bounds": bench_bounds(device, args.repeats),
        "exact_audit": bench_exact_audit(1 if args.quick else 3),
    }
    with open(args.json, "w") as fh:
        json.dump(result, fh, indent=2)
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
