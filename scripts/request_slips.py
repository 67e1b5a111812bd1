"""The planted slips of the whole request: the smallest budget at which the audit finds each, and the false
alarms of the correct loop with every feature on.

    python scripts/request_slips.py budgets [--seeds 5] [--rounds 1,2,4,8,16] [--out FILE]
    python scripts/request_slips.py false-alarms [--seeds 200] [--alpha 0.001,0.05] [--out FILE]

``budgets``: per slip of ``spectr_audit.generation.library.request_slips.REQUEST_SLIPS``, the smallest number of
rounds at which at least 4 of the seeds' audits find it (a FINDING; for a seed slip, the determinism line), with
the mean tokens scored and seconds per audit there.  ``false-alarms``: the correct loop on every feature, one
round per seed: how many audits end FINDING, and how many show a determinism difference, with the exact
Clopper-Pearson upper bound of the rate at 95 %.  Prints a Markdown table (and writes JSON with ``--out``).
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from scipy import stats

from spectr_audit.generation.library.request_slips import (
    REQUEST_SLIPS,
    audit_every_feature,
    audit_request_slip,
    found,
)


def budgets(seeds: int, rounds: list) -> list:
    rows = []
    for name, slip in REQUEST_SLIPS.items():
        row = {"slip": name, "truth": slip.truth, "check": slip.check, "rounds": None}
        for r in rounds:
            start = time.process_time()
            results = [audit_request_slip(name, rounds=r, seed=s) for s in range(seeds)]
            hits = sum(found(res, slip) for res in results)
            row.update(rounds=r, found=hits, seeds=seeds,
                       tokens=round(sum(res.num_tokens for res in results) / seeds),
                       seconds=round((time.process_time() - start) / seeds, 2),
                       decided_by=sorted({res.test for res in results if found(res, slip)}))
            if hits >= max(1, (4 * seeds + 4) // 5):
                break
        rows.append(row)
        print(json.dumps(row), file=sys.stderr, flush=True)
    return rows


def false_alarms(seeds: int, alphas: list) -> list:
    out = []
    results = []
    start = time.process_time()
    for s in range(seeds):
        results.append(audit_every_feature(rounds=1, seed=s))
        r = results[-1]
        print(json.dumps({"seed": s, "pvalue": r.pvalue, "test": r.test, "findings": len(r.request_findings),
                          "determinism_differing": (r.determinism or {}).get("differing")}), file=sys.stderr,
              flush=True)
    seconds = (time.process_time() - start) / seeds
    for alpha in alphas:
        findings = sum(r.pvalue <= alpha or bool(r.request_findings) for r in results)
        det = sum(bool(r.determinism and r.determinism.get("differing")) for r in results)
        upper = stats.beta.ppf(0.95, findings + 1, seeds - findings) if findings < seeds else 1.0
        out.append({"alpha": alpha, "seeds": seeds, "findings": findings, "rate_upper_95": round(float(upper), 4),
                    "determinism_differences": det, "tokens": round(sum(r.num_tokens for r in results) / seeds),
                    "seconds": round(seconds, 2)})
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("what", choices=["budgets", "false-alarms"])
    parser.add_argument("--seeds", type=int, default=None)
    parser.add_argument("--rounds", default="1,2,4,8,16")
    parser.add_argument("--alpha", default="0.001,0.05")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    if args.what == "budgets":
        rows = budgets(args.seeds or 5, [int(r) for r in args.rounds.split(",")])
        print("| slip | ground truth | found by | rounds | found | tokens | seconds |")
        print("|---|---|---|---|---|---|---|")
        for r in rows:
            print(f"| {r['slip']} | {r['truth']} | {', '.join(r['decided_by']) or r['check']} | "
                  f"{r['rounds'] if r['found'] * 5 >= 4 * r['seeds'] else 'not found by ' + str(r['rounds'])} | "
                  f"{r['found']}/{r['seeds']} | {r['tokens']} | {r['seconds']} |")
    else:
        rows = false_alarms(args.seeds or 200, [float(a) for a in args.alpha.split(",")])
        print("| alpha | seeded audits | findings | upper 95 % of the rate | determinism differences | tokens | s |")
        print("|---|---|---|---|---|---|---|")
        for r in rows:
            print(f"| {r['alpha']} | {r['seeds']} | {r['findings']} | {r['rate_upper_95']} | "
                  f"{r['determinism_differences']} | {r['tokens']} | {r['seconds']} |")
    if args.out:
        with open(args.out, "w", encoding="utf-8") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
