"""Exact-audit time of the largest chain enumerations, against another commit's code measured in the same run.

Run:  python benchmarks/bench_exact.py [--against REV] [--rounds N] [--quick] [--json out.json]

The cases (``--quick``: the same verifiers at sizes that take a fraction of a second):

* kseq V=100 K=3 L=1: ``exact_iteration(load_verifier("kseq"), random_markov(100, seed=1),
  random_markov(100, seed=2), 3, 1)``, 1,000,000 draft tuples;
* rrs-wor V=30 K=4 L=1: ``exact_iteration(load_verifier("rrs-wor"), random_markov(30, seed=1),
  random_markov(30, seed=2), 4, 1)``, 657,720 ordered tuples of distinct tokens.

Each timing is one call in a fresh process on one torch thread, clocked by the process's CPU time
(``time.process_time``) around the call alone.  As in ``bench_verifiers.py``, glibc's malloc is told to keep
freed memory (``KEEP_HEAP``; ``--system-malloc`` to keep its defaults): with the defaults every chunk's large
tensors get fresh pages from the kernel, and the page faults, about half of the process time, come and go
with the machine's load (measured on two shared cores: 4.7 to 11.3 s of system time for the same run of the
same code), which hides the code's own time; the table gives the user and system seconds of each run.  The code under test is what ``import spectr_audit`` gives here
(this checkout, with the editable install); the code it is compared with is ``REV`` (default ``824b892``, the
exact audit before chains were audited as trees), laid out as installed from ``git archive REV`` in a
temporary folder put first on ``PYTHONPATH``.  The two alternate within each of ``--rounds`` rounds, so that
load on a shared machine hits both alike; the table gives each side's fastest time and the ratio fastest over
fastest, with each round's ratio.  Each run also reports the result's TV distance, acceptance and block
efficiency as hex floats, and the script fails (exit 1) when the two codes' results differ in a bit.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
#: (label, verifier, V, K, L)
CASES = [("kseq V=100 K=3 L=1", "kseq", 100, 3, 1), ("rrs-wor V=30 K=4 L=1", "rrs-wor", 30, 4, 1)]
QUICK_CASES = [("kseq V=20 K=3 L=1", "kseq", 20, 3, 1), ("rrs-wor V=12 K=4 L=1", "rrs-wor", 12, 4, 1)]
#: glibc's malloc, told to keep freed memory (as ``bench_verifiers.py`` does), for both sides.
KEEP_HEAP = {"MALLOC_MMAP_MAX_": "0", "MALLOC_TRIM_THRESHOLD_": str(1 << 40), "MALLOC_TOP_PAD_": str(1 << 28)}
#: The folders installed inside the package (setuptools package-dir).
INSTALLED_INSIDE = ("verifiers", "reports", "suites")


def run_case(verifier_name: str, vocab_size: int, num_drafts: int, draft_len: int) -> dict:
    """One exact audit of the case on one thread: its CPU seconds and its key results (in the child)."""
    import torch

    from spectr_audit.drafting.models import random_markov
    from spectr_audit.exact.iteration import exact_iteration
    from spectr_audit.registry import load_verifier

    torch.set_num_threads(1)
    args = (load_verifier(verifier_name), random_markov(vocab_size, seed=1), random_markov(vocab_size, seed=2),
            num_drafts, draft_len)
    before = resource.getrusage(resource.RUSAGE_SELF)
    start = time.process_time()
    audit = exact_iteration(*args)
    seconds = time.process_time() - start
    after = resource.getrusage(resource.RUSAGE_SELF)
    import spectr_audit

    return {"seconds": seconds, "user": after.ru_utime - before.ru_utime, "system": after.ru_stime - before.ru_stime,
            "page_faults": after.ru_minflt - before.ru_minflt,
            "tuples": audit.num_draft_tuples, "tv_distance": audit.tv_distance.hex(),
            "acceptance": audit.acceptance.hex(), "block_efficiency": audit.block_efficiency.hex(),
            "package": str(Path(spectr_audit.__file__).parent)}


def install_revision(revision: str, folder: Path) -> Path:
    """``revision``'s package laid out as installed under ``folder`` (returned: the folder to put on the path)."""
    source = folder / "source"
    source.mkdir(parents=True)
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", revision], check=True, capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(source)], input=archive, check=True)
    lib = folder / "lib"
    shutil.copytree(source / "spectr_audit", lib / "spectr_audit")
    for sub in INSTALLED_INSIDE:
        if (source / sub).is_dir():
            shutil.copytree(source / sub, lib / "spectr_audit" / sub)
    return lib


def timed(case: tuple, path: str | None, cwd: str, keep_heap: bool) -> dict:
    """Run one case in a fresh process, with ``path`` first on ``PYTHONPATH`` (None: this environment's code)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", **(KEEP_HEAP if keep_heap else {})}
    env.pop("PYTHONPATH", None)
    if path is not None:
        env["PYTHONPATH"] = path
    _, name, vocab_size, num_drafts, draft_len = case
    done = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--child", name, str(vocab_size),
                           str(num_drafts), str(draft_len)], env=env, cwd=cwd, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"{case[0]} ({'this checkout' if path is None else path}) failed:\n{done.stderr}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--against", default="824b892", help="the revision to compare with (default 824b892)")
    parser.add_argument("--rounds", type=int, default=2, help="rounds of interleaved runs (default 2)")
    parser.add_argument("--quick", action="store_true", help="small cases (seconds in all)")
    parser.add_argument("--json", type=Path, help="write the measurements here")
    parser.add_argument("--case", action="append", help="only the cases whose label starts with this (repeatable)")
    parser.add_argument("--system-malloc", action="store_true",
                        help="keep glibc malloc's defaults (fresh pages, hence page faults, for large tensors)")
    parser.add_argument("--child", nargs=4, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        name, vocab_size, num_drafts, draft_len = args.child
        print(json.dumps(run_case(name, int(vocab_size), int(num_drafts), int(draft_len))))
        return 0
    if args.rounds < 1:
        raise SystemExit(f"--rounds: expected an integer >= 1, got {args.rounds}")
    cases = [c for c in (QUICK_CASES if args.quick else CASES)
             if not args.case or any(c[0].startswith(prefix) for prefix in args.case)]
    if not cases:
        raise SystemExit(f"--case: no case starts with {args.case}")
    with tempfile.TemporaryDirectory(prefix="bench-exact-") as tmp:
        other = str(install_revision(args.against, Path(tmp) / "other"))
        runs: dict = {case[0]: {"now": [], "other": []} for case in cases}
        for _ in range(args.rounds):
            for case in cases:
                runs[case[0]]["now"].append(timed(case, None, tmp, not args.system_malloc))
                runs[case[0]]["other"].append(timed(case, other, tmp, not args.system_malloc))
    print(f"exact_iteration, process CPU seconds on one torch thread, fastest of {args.rounds} round(s); "
          f"this checkout against {args.against}; {'system malloc' if args.system_malloc else 'freed memory kept'}")
    first = next(iter(runs.values()))
    print(f"now: {first['now'][0]['package']}; {args.against}: {first['other'][0]['package']}")
    print(f"{'case':<22} {'tuples':>9} {'now':>8} {args.against:>8} {'ratio':>6}  per round (user + system seconds)")
    failed = False
    table = []
    for label, by_code in runs.items():
        now = min(r["seconds"] for r in by_code["now"])
        before = min(r["seconds"] for r in by_code["other"])
        rounds = [a["seconds"] / b["seconds"] for a, b in zip(by_code["now"], by_code["other"])]
        keys = ("tuples", "tv_distance", "acceptance", "block_efficiency")
        same = all({k: r[k] for k in keys} == {k: by_code["other"][0][k] for k in keys}
                   for r in by_code["now"] + by_code["other"])
        failed |= not same
        split = " ".join(f"{r:.2f} ({a['user']:.1f}+{a['system']:.1f} vs {b['user']:.1f}+{b['system']:.1f})"
                         for r, a, b in zip(rounds, by_code["now"], by_code["other"]))
        print(f"{label:<22} {by_code['now'][0]['tuples']:>9} {now:>8.2f} {before:>8.2f} {now / before:>6.2f}  "
              + split + ("" if same else "  RESULTS DIFFER"))
        table.append({"case": label, "now": now, "other": before, "ratio": now / before, "round_ratios": rounds,
                      "results_identical": same, "runs": by_code})
    if args.json is not None:
        args.json.write_text(json.dumps({"against": args.against, "rounds": args.rounds,
                                         "malloc": "glibc defaults" if args.system_malloc else "freed memory kept",
                                         "cases": table}, indent=1))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
