"""The whole generation audit's false-alarm count on the correct speculative loop (tests/generation/test_calibration.py).

Seeded audits of the correct loop over the toy pair (each with its own pair, two small prompts,
16-32 tokens a row, an end-of-sequence token on a third of them), at each alpha and in each mode:
plain (against the scorer), with a reference generator (two-sample mode) and with a draft scorer
(ratio order), and with rounds until the planned power (auto, TV 0.15).  Prints the FINDINGs of each setting and the upper 99% quantile of
Binomial(audits, alpha) the test asserts.

    python scripts/generation_false_alarms.py                     # 240 audits per setting
    python scripts/generation_false_alarms.py --audits 1000 --alphas 0.05
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.generation.test_calibration import _false_alarms, _limit  # noqa: E402


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--audits", type=int, default=240)
    parser.add_argument("--alphas", type=float, nargs="*", default=[0.05, 1e-3])
    parser.add_argument("--modes", nargs="*", default=["plain", "reference", "draft", "auto"])
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    print("| mode | alpha | audits | FINDINGs | expected | limit (99%) | seconds |")
    print("|---|---|---|---|---|---|---|")
    for mode in args.modes:
        for alpha in args.alphas:
            start = time.perf_counter()
            count, which = _false_alarms(args.audits, alpha, mode)
            print(f"| {mode} | {alpha:g} | {args.audits} | {count} | {alpha * args.audits:.2f} | "
                  f"{_limit(args.audits, alpha, 1)} | {time.perf_counter() - start:.0f} |", flush=True)
            for test, pvalue in which:
                print(f"|   | | | {test}: p = {pvalue:.3g} | | | |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
