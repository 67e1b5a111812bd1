"""Verifier speed against the physical limit: one read of draft_probs and target_probs.

Run:  python benchmarks/bench_verifiers.py [--quick] [--compiled] [--device cpu|cuda] [--parts verifiers,...]
                                         [--verifiers kseq,...] [--repeats ROUNDS] [--json out.json]

One command, one table per part, one JSON file (default ``benchmarks/results.json``):

* verifiers: every built-in at V = 32k and 128k, K up to 8, L up to 8, batch chosen so the inputs
  hold about 2^26 probabilities (``--quick``: 2^22, V = 32k only), as a ratio to a memory pass
  (``draft_probs.sum() + target_probs.sum()``) over the same tensors measured in the same run.  The
  calls are interleaved: ``--repeats`` rounds, each timing every configuration's memory pass, its
  verifier and the validated call side by side (fast calls repeated within one sample of at least
  20 ms), so that load on a shared machine hits them alike.  The table gives the fastest sample of
  each (load only adds time) and the ratio fastest over fastest, with the per-round ratios' median
  and quartiles as its spread.  On a CPU the clock is the process's CPU time with one thread (a
  shared machine's load then barely moves it; ``--clock wall --threads N`` for wall time), on CUDA
  wall time; freed memory is kept by malloc (``--system-malloc`` to turn that off), so that page
  faults on fresh allocations do not come and go between rounds;
* K-SEQ's rho*: 64-step bisection, the exact piecewise solve (sort by q/p), and the sampler's
  sort-free solve, each as a ratio to a memory pass over its rows;
* the closed-form alpha* at V = 128k, K = 8;
* exact-audit enumeration cost against V and K: ordered tuples (what the audit enumerates, since
  K-SEQ's law depends on the draft order) against the multiset count an order-invariant verifier
  would need;
* Monte-Carlo audit throughput (verifications per second) at V = 8, K = 4.

``--compiled`` adds a column with :mod:`spectr_audit.verifiers.compiled`'s fused kernels (torch.compile; the
first call compiles for several seconds, excluded by the warm-up).  The same script runs unchanged
on CUDA (``--device cuda``; times are synchronised), where the samplers use the Triton kernels of
:mod:`spectr_audit.verifiers.triton_kernels` and an ``eager`` column times them switched off.
"""

from __future__ import annotations

import argparse
import json
import os
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
    ("greedy-block", 1, 4),
    ("greedy-block-repaired", 1, 4),
    ("spectr-gbv-published", 2, 4),
    ("spectr-gbv-published-alg2", 2, 4),
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


#: One timed sample lasts at least this long: a fast call is repeated inside it (as timeit's autorange does),
#: so that the clock's resolution and a call's fixed cost do not dominate it.
MIN_SAMPLE_SECONDS = 0.02
MAX_CALLS_PER_SAMPLE = 4096


#: The clocks of the verifier table: wall time, or this process's CPU time (all its threads), which a
#: shared machine's load leaves nearly alone as long as the process runs one thread (its time slices are
#: then not counted, and no thread spins waiting for a descheduled sibling).
CLOCKS = {"wall": time.perf_counter_ns, "process": time.process_time_ns}
_clock = time.perf_counter_ns


def _seconds_per_call(fn, device: torch.device, calls: int) -> float:
    start = _clock()
    for _ in range(calls):
        fn()
    _sync(device)
    return (_clock() - start) * 1e-9 / calls


def _calls_per_sample(fn, device: torch.device) -> int:
    """Warm ``fn`` up (caches, kernels compiled) and find how many calls one sample needs."""
    fn()
    _sync(device)
    calls = 1
    while calls < MAX_CALLS_PER_SAMPLE:
        seconds = _seconds_per_call(fn, device, calls) * calls
        if seconds >= MIN_SAMPLE_SECONDS:
            break
        calls = min(MAX_CALLS_PER_SAMPLE, max(2 * calls, int(calls * 1.2 * MIN_SAMPLE_SECONDS / max(seconds, 1e-9))))
    return calls


def interleaved(items: dict, device: torch.device, rounds: int) -> dict:
    """Seconds per call of each ``items[key]()``, ``rounds`` samples each, taken round-robin.

    Every round times every item once, in the order of ``items`` (reversed on odd rounds, so that no
    item always follows the same one): a verifier and the memory pass it is compared with are measured
    side by side in every round, and a burst of load on a shared machine hits all of them alike.
    """
    calls = {key: _calls_per_sample(fn, device) for key, fn in items.items()}
    times = {key: [] for key in items}
    keys = list(items)
    for round_index in range(rounds):
        for key in keys if round_index % 2 == 0 else keys[::-1]:
            times[key].append(_seconds_per_call(items[key], device, calls[key]))
    return {key: (times[key], calls[key]) for key in keys}


def _quartiles(values: list) -> tuple:
    if len(values) == 1:
        return values[0], values[0], values[0]
    low, mid, high = statistics.quantiles(values, n=4, method="inclusive")
    return low, mid, high


def _summary(times: list, memory: list) -> dict:
    """A verifier's timings against the memory pass's from the same rounds.

    ``ratio``: fastest call over fastest memory pass (load only ever adds time, so the minima are the
    steadiest estimate of the work itself); ``ratio_median`` and ``ratio_spread`` (25th, 75th percentile):
    of the per-round ratios, each a verifier sample over the memory pass measured next to it.
    """
    paired = [t / m for t, m in zip(times, memory)]
    low, mid, high = _quartiles(paired)
    return {"ms": 1e3 * min(times), "ms_median": 1e3 * statistics.median(times), "ratio": min(times) / min(memory),
            "ratio_median": mid, "ratio_spread": [low, high]}


def _with_triton(enabled: bool, fn):
    from spectr_audit.verifiers import triton_kernels

    def run():
        saved = triton_kernels._override
        triton_kernels.use_triton(enabled)
        try:
            return fn()
        finally:
            triton_kernels._override = saved

    return run


def _with_compiled(fn):
    from spectr_audit.verifiers import compiled

    def run():
        compiled.use_compiled(True)
        try:
            return fn()
        finally:
            compiled.use_compiled(False)

    return run


def bench_verifiers(total_probs: int, vocab_sizes, device, repeats, with_compiled=False, only=None) -> list[dict]:
    """Every configuration at each vocabulary size, timed round-robin (:func:`interleaved`), ``repeats`` rounds.

    The inputs of every configuration of one vocabulary size are held at once (about ``total_probs``
    float32 probabilities each).  Where the Triton kernels run (CUDA), an ``eager`` column times the
    same call with them off.
    """
    from spectr_audit.verifiers import compiled, triton_kernels

    compiled.use_compiled(False)
    with_eager = triton_kernels.triton_enabled(device)
    rows = []
    for vocab_size in vocab_sizes:
        configs, items = [], {}
        for name, num_drafts, draft_len in CONFIGS:
            if name not in BUILTIN_VERIFIERS or (only is not None and name not in only):
                continue
            verifier = load_verifier(name)
            per_row = num_drafts * (2 * draft_len + 1) * vocab_size
            batch_size = max(1, total_probs // per_row)
            tokens, draft_probs, target_probs = make_inputs(batch_size, num_drafts, draft_len, vocab_size, device)
            gen = torch.Generator(device=device).manual_seed(1)
            index = len(configs)
            configs.append((name, num_drafts, draft_len, batch_size))
            items[index, "memory"] = lambda d=draft_probs, t=target_probs: (d.sum(), t.sum())
            # the generator reseeded at every call: every call draws the same uniforms, so does the same work
            # (where the walk stops depends on them: at a small batch that moved a call's time by half)
            run = (lambda v=verifier, a=(tokens, draft_probs, target_probs), g=gen:
                   v.verify(*a, g.manual_seed(1), validate=False))
            items[index, "verify"] = run
            items[index, "validated"] = (lambda v=verifier, a=(tokens, draft_probs, target_probs), g=gen:
                                         v.verify(*a, g.manual_seed(1)))
            if with_eager:
                items[index, "eager"] = _with_triton(False, run)
            if with_compiled:
                items[index, "compiled"] = _with_compiled(run)
        print(f"  V={vocab_size}: {len(configs)} configurations, {repeats} interleaved rounds", flush=True)
        timings = interleaved(items, device, max(1, repeats))
        for index, (name, num_drafts, draft_len, batch_size) in enumerate(configs):
            memory, memory_calls = timings[index, "memory"]
            verify, calls = timings[index, "verify"]
            row = {
                "verifier": name, "vocab_size": vocab_size, "num_drafts": num_drafts, "draft_len": draft_len,
                "batch_size": batch_size, "rounds": len(memory), "calls_per_sample": calls,
                "memory_pass_ms": 1e3 * min(memory), "memory_pass_ms_median": 1e3 * statistics.median(memory),
                "memory_pass_ms_spread": [1e3 * q for q in _quartiles(memory)[::2]],
            }
            for column in ("verify", "validated", "eager", "compiled"):
                if (index, column) not in timings:
                    continue
                summary = _summary(timings[index, column][0], memory)
                prefix = {"verify": "", "validated": "_with_validation", "eager": "_eager",
                          "compiled": "_compiled"}[column]
                if column == "verify":
                    row.update(verify_ms=summary["ms"], verify_ms_median=summary["ms_median"])
                row[f"ratio{prefix}"] = summary["ratio"]
                row[f"ratio{prefix}_median"] = summary["ratio_median"]
                row[f"ratio{prefix}_spread"] = summary["ratio_spread"]
            # validation only adds passes: a validated call faster than the plain one is noise, and says so
            row["validation_within_noise"] = row["ratio_with_validation"] < row["ratio"]
            rows.append(row)
            extra = "".join(f"  {c} {row[f'ratio_{c}']:6.2f}" for c in ("eager", "compiled") if f"ratio_{c}" in row)
            print(f"  {name:<25} V={vocab_size:<6} K={num_drafts} L={draft_len} B={batch_size:<5} "
                  f"memory {row['memory_pass_ms']:8.3f} ms  verify {row['verify_ms']:9.3f} ms  "
                  f"ratio {row['ratio']:6.2f} (median {row['ratio_median']:6.2f} "
                  f"[{row['ratio_spread'][0]:.2f}, {row['ratio_spread'][1]:.2f}])  "
                  f"validated {row['ratio_with_validation']:6.2f}{extra}", flush=True)
        del items, timings
    return rows


def bench_bounds(device, repeats) -> list[dict]:
    from spectr_audit.bounds.acceptance import optimal_acceptance
    from spectr_audit.verifiers.rho_star import kseq_rho_star, kseq_rho_star_bisection, kseq_rho_star_sampler

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
    rows = result["verifiers"]
    extras = [c for c in ("eager", "compiled") if any(f"ratio_{c}" in row for row in rows)]
    rounds = max((row["rounds"] for row in rows), default=0)
    machine = result["machine"]
    print(f"\n{machine['device_name']}, {machine['threads']} thread(s), {machine['clock']} clock: fastest of {rounds} "
          "interleaved rounds (ms); ratios to the memory pass: fastest over fastest, then the per-round ratio's "
          "median [25th, 75th percentile]")
    heads = "".join(f" ratio {c} |" for c in extras)
    print(f"| verifier | V | K | L | B | memory pass ms | verify ms | ratio | median [IQR] | with validation |{heads}")
    print("|---|---|---|---|---|---|---|---|---|---|" + "---|" * len(extras))
    for row in rows:
        spread = row["ratio_spread"]
        checked = f"{row['ratio_with_validation']:.2f}" + (" (within noise)" if row["validation_within_noise"] else "")
        cells = "".join(f" {row[f'ratio_{c}']:.2f} |" for c in extras)
        print(f"| {row['verifier']} | {row['vocab_size']} | {row['num_drafts']} | {row['draft_len']} | "
              f"{row['batch_size']} | {row['memory_pass_ms']:.3f} | {row['verify_ms']:.3f} | {row['ratio']:.2f} | "
              f"{row['ratio_median']:.2f} [{spread[0]:.2f}, {spread[1]:.2f}] | {checked} |{cells}")


PARTS = ("verifiers", "bounds", "exact_audit", "montecarlo")

#: glibc's malloc, told to keep freed memory: a large tensor otherwise gets fresh pages from the kernel on
#: every call (mmap, then a page fault per 4 KiB touched), and how many depends on the allocator's state:
#: it doubled some calls' time from one round to the next.  Set before the interpreter starts (re-exec).
KEEP_HEAP = {"MALLOC_MMAP_MAX_": "0", "MALLOC_TRIM_THRESHOLD_": str(1 << 40), "MALLOC_TOP_PAD_": str(1 << 28)}


def _device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return platform.processor() or platform.machine()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="2^22 probabilities instead of 2^26")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--json", default="benchmarks/results.json")
    parser.add_argument("--repeats", type=int, default=7,
                        help="interleaved rounds of the verifier table (and repeats of the other parts)")
    parser.add_argument("--clock", choices=sorted(CLOCKS),
                        help="the verifier table's clock (default: process CPU time on a CPU, wall time on CUDA)")
    parser.add_argument("--threads", type=int,
                        help="torch threads (default: 1 on a CPU with the process clock, else torch's own)")
    parser.add_argument("--parts", default=",".join(PARTS),
                        help=f"comma-separated parts to run (default all: {','.join(PARTS)})")
    parser.add_argument("--verifiers",
                        help="comma-separated verifiers of the verifier table (default all: "
                             f"{','.join(dict.fromkeys(c[0] for c in CONFIGS))})")
    parser.add_argument("--compiled", action="store_true",
                        help="also time each verifier with spectr_audit.verifiers.compiled's fused kernels (torch.compile)")
    parser.add_argument("--system-malloc", action="store_true",
                        help="keep glibc malloc's defaults (fresh pages, hence page faults, for large tensors)")
    args = parser.parse_args(argv)
    if not args.system_malloc and argv is None and any(os.environ.get(k) != v for k, v in KEEP_HEAP.items()):
        sys.stdout.flush()
        os.execve(sys.executable, [sys.executable, *sys.argv], {**os.environ, **KEEP_HEAP})
    kept = all(os.environ.get(k) == v for k, v in KEEP_HEAP.items())
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: this torch build sees no CUDA device")
    parts = [p.strip() for p in args.parts.split(",") if p.strip()]
    unknown = sorted(set(parts) - set(PARTS))
    if unknown or not parts:
        parser.error(f"--parts: unknown part(s) {', '.join(unknown) or '(none given)'}; choose from {', '.join(PARTS)}")
    global _clock
    clock = args.clock or ("wall" if device.type == "cuda" else "process")
    _clock = CLOCKS[clock]
    threads = args.threads or (1 if clock == "process" and device.type == "cpu" else None)
    if threads is not None:
        if threads < 1:
            parser.error(f"--threads: expected a positive number, got {threads}")
        torch.set_num_threads(threads)
    only = None
    if args.verifiers is not None:
        only = {v.strip() for v in args.verifiers.split(",") if v.strip()}
        known = {c[0] for c in CONFIGS}
        if not only or only - known:
            parser.error(f"--verifiers: unknown verifier(s) {', '.join(sorted(only - known)) or '(none given)'}; "
                         f"choose from {', '.join(sorted(known))}")
    total = 2**22 if args.quick else 2**26
    name = _device_name(device)
    print(f"spectr-audit verifier benchmark on {device} ({name}, torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads), {total} probabilities per input set; verifier table on the "
          f"{clock} clock, {'freed memory kept' if kept else 'system malloc'}")
    result = {
        "machine": {"device": str(device), "device_name": name, "platform": platform.platform(),
                    "threads": torch.get_num_threads(), "clock": clock,
                    "malloc": "freed memory kept (KEEP_HEAP)" if kept else "glibc defaults", "torch": torch.__version__, "python": sys.version.split()[0],
                    "load_average": list(os.getloadavg()) if hasattr(os, "getloadavg") else None},
    }
    if "verifiers" in parts:
        result["verifiers"] = bench_verifiers(total, [32768] if args.quick else [32768, 131072], device, args.repeats,
                                              with_compiled=args.compiled, only=only)
    if "bounds" in parts:
        result["bounds"] = bench_bounds(device, args.repeats)
    if "exact_audit" in parts:
        result["exact_audit"] = bench_exact_audit(1 if args.quick else 3, quick=args.quick)
    if "montecarlo" in parts:
        result["montecarlo"] = bench_montecarlo(1 << 18 if args.quick else 1 << 21)
    if hasattr(os, "getloadavg"):
        result["machine"]["load_average_after"] = list(os.getloadavg())
    with open(args.json, "w") as fh:
        json.dump(result, fh, indent=2)
    if "verifiers" in result:
        print_summary(result)
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
