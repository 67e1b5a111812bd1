"""Rounds until the generation audit finds each planted serving slip, beside the correct loop under the same conditions.

Each serving slip of the toy (``spectr_audit.generation.library.serving.SERVING_SLIPS``) is audited through its
engine spec (``toy:SLIP``, under the conditions it is audited with by default) at 1, 2, 4, ... rounds, for
several audit seeds; a row gives the fewest rounds whose audit is a FINDING decided on the slip's condition, the
tokens of that condition's stratum and of the whole audit then, and the seconds.  The correct loop (``toy``) runs
under the same conditions at the largest budget and must not be a finding.

    python scripts/serving_slip_budgets.py                       # seeds 0-4, up to 64 rounds
    python scripts/serving_slip_budgets.py --seeds 0 1 --max-rounds 32
"""

from __future__ import annotations

import argparse
import time

import torch

from spectr_audit.generation.engine_specs import audit_engine, load_generation_engine
from spectr_audit.generation.library.serving import SERVING_SLIPS


def _first_finding(spec: str, seed: int, max_rounds: int, conditions=None) -> tuple:
    """``(rounds, result, seconds)`` of the fewest doubling rounds that find the slip (None when none did)."""
    engine = load_generation_engine(spec)
    rounds = 1
    while rounds <= max_rounds:
        start = time.perf_counter()
        result = audit_engine(engine, rounds=rounds, seed=seed, conditions=conditions)
        seconds = time.perf_counter() - start
        if result.verdict == "FINDING":
            return rounds, result, seconds
        rounds *= 2
    return None, result, seconds


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seeds", type=int, nargs="*", default=[0, 1, 2, 3, 4])
    parser.add_argument("--max-rounds", type=int, default=64)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    print("| slip | conditions | seed | rounds to a FINDING | deciding test | its stratum's tokens | tokens | seconds |")
    print("|---|---|---|---|---|---|---|---|")
    for name in SERVING_SLIPS:
        spec = f"toy:{name}"
        conditions = load_generation_engine(spec).default_conditions
        for seed in args.seeds:
            rounds, result, seconds = _first_finding(spec, seed, args.max_rounds)
            deciding = next((c for c in result.conditions if result.test.endswith(f"condition {c['name']}")), None)
            print(f"| {name} | {', '.join(conditions)} | {seed} | {rounds if rounds else f'none by {args.max_rounds}'} | "
                  f"{result.test} | {deciding['tokens'] if deciding else '-'} | {result.num_tokens} | {seconds:.1f} |",
                  flush=True)
        correct = audit_engine(load_generation_engine("toy"), rounds=args.max_rounds, seed=args.seeds[0],
                               conditions=list(conditions))
        print(f"| (correct loop) | {', '.join(conditions)} | {args.seeds[0]} | {correct.verdict} at {args.max_rounds} "
              f"rounds | {correct.test}, p = {correct.pvalue:.3g} | - | {correct.num_tokens} | - |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
