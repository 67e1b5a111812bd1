"""The smallest budget at which the generation audit finds each planted slip (spectr_audit.generation.library).

For each slip of SLIPS, audits over the toy pair (audit_slip: four prompts, every arm, alpha 1e-3)
at doubling budgets: 128, 256 and 512 engine tokens (``max_tokens`` inside the first round), then
1, 2, 4, ... rounds (about 850 tokens each) up to ``--max-rounds``.  A budget finds the slip when at
least 4 of 5 seeds give a FINDING (the seeds stop as soon as 2 miss).  The table: the slip, the
verdicts at the smallest such budget (or at the largest tried), the deciding test, the held-out TV
lower bound (mean over the seeds), the engine tokens scored and the seconds (means per audit), and
the smallest budget.

    python scripts/generation_slips.py                    # every slip, up to 128 rounds
    python scripts/generation_slips.py --slips rows-permuted shared-stream --max-rounds 8
"""

from __future__ import annotations

import argparse
import collections
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from spectr_audit.generation.library import SLIPS, audit_slip  # noqa: E402

SEEDS = 5
NEEDED = 4


def budgets(max_rounds: int) -> list:
    """``(label, planned tokens or None, rounds, max_tokens)`` in increasing order."""
    out = [(f"{n} tok", n, 1, n) for n in (128, 256, 512)]
    rounds = 1
    while rounds <= max_rounds:
        out.append((f"{rounds} round{'s' if rounds > 1 else ''}", None, rounds, None))
        rounds *= 2
    return out


def measure(name: str, rounds: int, max_tokens, seeds: int = SEEDS) -> list:
    results = []
    misses = 0
    for seed in range(seeds):
        start = time.perf_counter()
        result = audit_slip(name, rounds, seed, max_tokens=max_tokens)
        results.append((result, time.perf_counter() - start))
        misses += result.verdict != "FINDING"
        if misses > seeds - NEEDED:  # 4 of 5 is out of reach at this budget
            break
    return results


def row(name: str, max_rounds: int) -> dict:
    last = None
    for label, planned, rounds, max_tokens in budgets(max_rounds):
        results = measure(name, rounds, max_tokens)
        found = sum(r.verdict == "FINDING" for r, _ in results)
        verdicts = collections.Counter(r.verdict for r, _ in results)
        findings = [r for r, _ in results if r.verdict == "FINDING"]
        last = dict(
            slip=name, verdict=", ".join(f"{k} {v}/{len(results)}" for k, v in sorted(verdicts.items())),
            test=(findings[0] if findings else results[0][0]).test,
            tv_lower=sum(r.tv_lower for r, _ in results) / len(results),
            tokens=sum(r.num_tokens for r, _ in results) / len(results),
            seconds=sum(s for _, s in results) / len(results),
            budget=f"{label} ({max(r.num_tokens for r, _ in results):,} tok)" if found >= NEEDED else None,
        )
        if found >= NEEDED:
            return last
    last["budget"] = f"not found within {int(last['tokens']):,} tokens ({max_rounds} rounds)"
    return last


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--slips", nargs="*", default=list(SLIPS), choices=list(SLIPS))
    parser.add_argument("--max-rounds", type=int, default=128)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    start = time.perf_counter()
    header = ("slip", "verdict", "deciding test", "TV lower", "tokens", "seconds", "smallest budget (4 of 5 seeds)")
    print("| " + " | ".join(header) + " |")
    print("|" + "|".join("---" for _ in header) + "|")
    for name in args.slips:
        r = row(name, args.max_rounds)
        print(f"| {r['slip']} | {r['verdict']} | {r['test']} | {r['tv_lower']:.3f} | {r['tokens']:,.0f} | "
              f"{r['seconds']:.2f} | {r['budget']} |", flush=True)
    print(f"\nwall time {time.perf_counter() - start:.0f} s", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
