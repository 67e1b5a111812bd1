"""Verifier speed against the physical limit: one read of draft_probs and target_probs.

Run:  python benchmarks/bench_verifiers.py [--quick] [--compiled] [--device cpu|cuda] [--json out.json]

One command, one table per part, one JSON file (default ``benchmarks/results.json``):

* verifiers: every built-in at V = 32k and 128k, K up to 8, L up to 8, batch chosen so the inputs
  hold about 2^26 probabilities (``--quick``: 2^22, V = 32k only), as a ratio to a memory pass
  (``draft_probs.sum() + target_probs.sum()``) over the same tensors measured in the same run;
* K-SEQ's rho*: 64-step bisection, the exact piecewise solve (sort by q/p), and the sampler's
  sort-free solve, each as a ratio to a memory pass over its rows;
* the closed-form alpha* at V = 128k, K = 8;
* exact-audit enumeration cost against V and K: ordered tuples (what the audit enumerates, since
  K-SEQ's law depends on the draft order) against the multiset count an order-invariant verifier
  would need;
* Monte-Carlo audit throughput (verifications per second) at V = 8, K = 4.

``--compiled`` adds a column with :mod:`spectr_audit.verifiers.compiled`'s fused kernels (torch.compile; the
first call compiles for several seconds, excluded by the warm-up).  The same script runs unchanged
on CUDA (``--device cuda``; times are synchronised).
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time

import torch

from spectr_audit.contract.randomness import sample_categorical
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
    ("multi-block", 4, 4),
    ("multi-block", 8, 8),
]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


class Timing(float):
    """A median wall time in seconds (a float), with the spread of the calls it is the median of.

    ``low`` and ``high``: the 25th and 75th percentiles; ``fastest``; ``runs``: how many calls.
    """

    low: float
    high: float
    fastest: float
    runs: int

    def __new__(cls, times: list):
        quartiles = statistics.quantiles(times, n=4, method="inclusive") if len(times) > 1 else [times[0]] * 3
        out = super().__new__(cls, quartiles[1])
        out.low, out.high, out.fastest, out.runs = quartiles[0], quartiles[2], min(times), len(times)
        return out

    def spread_ms(self) -> list:
        """``[25th, 75th percentile]`` in milliseconds."""
        return [1e3 * self.low, 1e3 * self.high]

    def text(self) -> str:
        """``median [25th, 75th] ms (runs)``."""
        return f"{1e3 * self:7.2f} ms [{1e3 * self.low:.2f}, {1e3 * self.high:.2f}] ({self.runs} runs)"


#: Each timing repeats its call until this much time has passed (and at least ``repeats`` times):
#: a call of a millisecond gets hundreds of runs, so a median and its spread are measured, not guessed.
MIN_TOTAL_SECONDS = 0.25
MAX_RUNS = 1000


def timed(fn, device: torch.device, repeats: int) -> Timing:
    """Median wall time of ``fn()`` in seconds, with its spread (:class:`Timing`; one warm-up call first).

    ``time.perf_counter_ns`` (integer nanoseconds: no float rounding of the clock), at least
    ``repeats`` calls and at least :data:`MIN_TOTAL_SECONDS` of them.  On a loaded machine the
    calls of a multi-threaded op wait for CPU time slices (milliseconds each): the spread shows it.
    """
    fn()
    _sync(device)
    times = []
    began = time.perf_counter_ns()
    while len(times) < max(1, repeats) or (
            time.perf_counter_ns() - began < MIN_TOTAL_SECONDS * 1e9 and len(times) < MAX_RUNS):
        start = time.perf_counter_ns()
        fn()
        _sync(device)
        times.append((time.perf_counter_ns() - start) * 1e-9)
    return Timing(times)


def make_inputs(batch_size, num_drafts, draft_len, vocab_size, device, seed=0):
    """Random peaked float32 distributions and drafts sampled from them."""
    gen = torch.Generator(device=device).manual_seed(seed)
    shape = (batch_size, num_drafts, draft_len + 1, vocab_size)
    target = torch.softmax(3 * torch.randn(shape, generator=gen, device=device), dim=-1)
    draft = torch.softmax(0.7 * target.log() + torch.randn(shape, generator=gen, device=device), dim=-1)[:, :, :draft_len]
    u = torch.rand(draft.shape[:-1], generator=gen, device=device, dtype=torch.float64)
    tokens = sample_categorical(draft, u)
    return tokens, draft.contiguous(), target.contiguous()


def bench_verifiers(total_probs: int, vocab_sizes, device, repeats, with_compiled=False) -> list[dict]:
    from spectr_audit.verifiers import compiled

    compiled.use_compiled(False)
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
            row = {
                "verifier": name, "vocab_size": vocab_size, "num_drafts": num_drafts, "draft_len": draft_len,
                "batch_size": batch_size, "memory_pass_ms": 1e3 * memory, "verify_ms": 1e3 * run,
                "ratio": run / memory, "ratio_with_validation": checked / memory,
                # the spread of each median (25th, 75th percentile) and the calls timed
                "memory_pass_ms_spread": memory.spread_ms(), "verify_ms_spread": run.spread_ms(),
                "memory_pass_runs": memory.runs, "verify_runs": run.runs,
            }
            note = ""
            if with_compiled:
                compiled.use_compiled(True)
                fused = timed(lambda: verifier.verify(tokens, draft_probs, target_probs, gen, validate=False), device, repeats)
                compiled.use_compiled(False)
                row["ratio_compiled"] = fused / memory
                note = f"  compiled {fused / memory:6.2f}"
            rows.append(row)
            print(f"  {name:<12} V={vocab_size:<6} K={num_drafts} L={draft_len} B={batch_size:<5} "
                  f"memory {memory.text()}  verify {run.text()}  ratio {run / memory:6.2f}  "
                  f"(validated {checked / memory:6.2f}){note}", flush=True)
            del tokens, draft_probs, target_probs
    return rows


def bench_bounds(device, repeats) -> list[dict]:
    from spectr_audit.bounds.acceptance import optimal_acceptance
    from spectr_audit.verifiers._rho_star import kseq_rho_star, kseq_rho_star_bisection, kseq_rho_star_sampler

    rows = []
    gen = torch.Generator(device=device).manual_seed(2)
    for vocab_size, batch_size in [(32768, 64), (131072, 16)]:
        draft = torch.softmax(2 * torch.randn(batch_size, vocab_size, generator=gen, device=device), -1)
        target = torch.softmax(2 * torch.randn(batch_size, vocab_size, generator=gen, device=device), -1)
        memory = timed(lambda: (draft.sum(), target.sum()), device, repeats)
        k = torch.full((batch_size,), 8.0, dtype=torch.float64, device=device)
        solvers = [
            ("bisection (64 passes, float64)", lambda: kseq_rho_star_bisection(draft, target, 8)),
            ("exact piecewise (sort q/p, float64)", lambda: kseq_rho_star(draft, target, 8)),
            ("sampler (sort-free, float32)", lambda: kseq_rho_star_sampler(draft, target, k)),
        ]
        for what, fn in solvers:
            seconds = timed(fn, device, max(1, repeats // 2))
            rows.append({"what": f"kseq rho* {what}", "vocab_size": vocab_size, "batch_size": batch_size,
                         "num_drafts": 8, "ms": 1e3 * seconds, "memory_pass_ms": 1e3 * memory, "ratio": seconds / memory})
            print(f"  rho* {what:<38} V={vocab_size:<6} B={batch_size:<3} {1e3 * seconds:8.1f} ms  "
                  f"ratio {seconds / memory:7.1f}", flush=True)
    one_draft, one_target = draft[0].double(), target[0].double()
    closed = timed(lambda: optimal_acceptance(one_draft, one_target, 8), device, repeats)
    rows.append({"what": "closed-form alpha*", "vocab_size": 131072, "num_drafts": 8, "ms": 1e3 * closed})
    print(f"  closed-form alpha*  V=131072 K=8: {1e3 * closed:.1f} ms")
    return rows


def bench_exact_audit(repeats, quick=False) -> list[dict]:
    import math

    from spectr_audit.exact.iteration import exact_iteration
    from spectr_audit.drafting.models import ContextFreeModel

    rows = []
    torch.manual_seed(3)
    kseq = load_verifier("kseq")
    cases = [(4, 4), (8, 3), (8, 4), (8, 6), (16, 3)] if quick else [(4, 4), (8, 3), (8, 4), (8, 5), (8, 6), (16, 3), (16, 4), (32, 3)]
    for vocab_size, num_drafts in cases:
        draft = ContextFreeModel(torch.distributions.Dirichlet(torch.ones(vocab_size)).sample())
        target = ContextFreeModel(torch.distributions.Dirichlet(torch.ones(vocab_size)).sample())
        seconds = timed(lambda: exact_iteration(kseq, draft, target, num_drafts), torch.device("cpu"), repeats)
        tuples = vocab_size**num_drafts
        multisets = math.comb(vocab_size + num_drafts - 1, num_drafts)
        rows.append({"what": "exact K-SEQ audit", "vocab_size": vocab_size, "num_drafts": num_drafts,
                     "ordered_tuples": tuples, "multisets": multisets, "seconds": seconds,
                     "us_per_tuple": 1e6 * seconds / tuples,
                     "multiset_projection_seconds": seconds * multisets / tuples})
        print(f"  exact K-SEQ audit V={vocab_size:<3} K={num_drafts}: {tuples:>8} ordered tuples {seconds:7.3f} s "
              f"({1e6 * seconds / tuples:5.2f} us/tuple); {multisets:>6} multisets "
              f"(order-invariant verifiers only: ~{seconds * multisets / tuples:.4f} s)", flush=True)
    return rows


def bench_montecarlo(samples: int) -> dict:
    """Monte-Carlo audit throughput at V = 8, K = 4: K-SEQ, RRS and the harness alone (a verifier that does
    nothing), in 1 and 2 local gloo processes (the sharded audit; the counts' digests must agree)."""
    from bench_montecarlo import timed_audit  # same case as bench_montecarlo

    from spectr_audit.statistical.sharding import spawn_local

    out = {}
    for name in ("kseq", "rrs", "noop"):
        label = "harness only" if name == "noop" else name
        rows = {processes: (timed_audit(name, samples, repeats=2) if processes == 1
                            else spawn_local(timed_audit, processes, name, samples, 2)) for processes in (1, 2)}
        out[label] = {"samples": samples, **{f"{p}_processes": row for p, row in rows.items()},
                      "bit_identical": rows[1]["counts_digest"] == rows[2]["counts_digest"]}
        for processes, row in rows.items():
            print(f"  Monte-Carlo audit V=8 K=4 {label:<13} {processes} process(es) "
                  f"{row['verifications_per_second']:12,.0f} verifications/s wall, "
                  f"{row['per_cpu_second']:12,.0f} per CPU-second ({samples} in {row['seconds']:.2f} s)", flush=True)
    return out


def print_summary(result: dict) -> None:
    """The verifier table in Markdown (ratios to the memory pass), ready to paste into a report."""
    with_compiled = any("ratio_compiled" in row for row in result["verifiers"])
    extra = " ratio compiled |" if with_compiled else ""
    print("\nmedians, [25th, 75th percentile] of the timed calls")
    print(f"| verifier | V | K | L | B | memory pass ms | verify ms | ratio | ratio with validation |{extra}")
    print("|---|---|---|---|---|---|---|---|---|" + ("---|" if with_compiled else ""))
    for row in result["verifiers"]:
        cell = f" {row['ratio_compiled']:.1f} |" if with_compiled else ""
        memory, verify = row["memory_pass_ms_spread"], row["verify_ms_spread"]
        print(f"| {row['verifier']} | {row['vocab_size']} | {row['num_drafts']} | {row['draft_len']} | "
              f"{row['batch_size']} | {row['memory_pass_ms']:.2f} [{memory[0]:.2f}, {memory[1]:.2f}] | "
              f"{row['verify_ms']:.2f} [{verify[0]:.2f}, {verify[1]:.2f}] | {row['ratio']:.1f} | "
              f"{row['ratio_with_validation']:.1f} |{cell}")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="2^22 probabilities instead of 2^26")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--json", default="benchmarks/results.json")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--compiled", action="store_true",
                        help="also time each verifier with spectr_audit.verifiers.compiled's fused kernels (torch.compile)")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: this torch build sees no CUDA device")
    total = 2**22 if args.quick else 2**26
    print(f"spectr-audit verifier benchmark on {device} ({platform.processor() or platform.machine()}, "
          f"torch {torch.__version__}, {torch.get_num_threads()} threads), {total} probabilities per input set")
    result = {
        "machine": {"device": str(device), "platform": platform.platform(), "threads": torch.get_num_threads(),
                    "torch": torch.__version__, "python": sys.version.split()[0]},
        "verifiers": bench_verifiers(total, [32768] if args.quick else [32768, 131072], device, args.repeats,
                                     with_compiled=args.compiled),
        "bounds": bench_bounds(device, args.repeats),
        "exact_audit": bench_exact_audit(1 if args.quick else 3, quick=args.quick),
        "montecarlo": bench_montecarlo(1 << 18 if args.quick else 1 << 21),
    }
    with open(args.json, "w") as fh:
        json.dump(result, fh, indent=2)
    print_summary(result)
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
