"""Record (or compare) the golden audit results of the built-in suites.

A restructure of the audit must leave its results as they were: this script runs the built-in suites
``default``, ``edge-cases``, ``sampling`` and ``historic-bugs`` with every built-in verifier at a fixed
sample budget and seed, and writes each report's JSON (without the wall times, the only field that varies
between runs) to ``tests/run/golden/<cpu capability>/<suite>.json``, with the torch version, CPU capability
and thread count they were recorded on.  torch picks its CPU kernels by the machine's capability (AVX2,
AVX512, ...), and vectorised kernels round differently, so each kernel family has its own record; a
restructure keeps every record that exists (check on each family's machine, or record a family anew only
from code whose results on another family did not move).  ``tests/run/test_golden_results.py`` reruns the
suites and compares with the record of the machine's family.

A machine can also run a family below its own (``--family AVX2`` on an AVX512 machine): torch reads its
kernels' family from ``ATEN_CPU_CAPABILITY`` and numpy, whose AVX512 paths round differently too, its
SIMD targets from ``NPY_DISABLE_CPU_FEATURES``, both at import, so the script runs itself again with both
set.  Measured on an AVX512 machine (torch 2.13.0, numpy 2.4.6): the AVX2 family so run reproduces the
AVX2 records made on an AVX2 machine, all 536 results bit for bit; torch's setting alone does not (1,324
values of ``default`` and ``historic-bugs`` differ).  So an AVX512 machine records and checks both families.

numpy's and scipy's OpenBLAS pick their kernels by the CPU too, and the block LPs' last bits follow them
(measured on an AMD EPYC AVX512 machine: with OpenBLAS's own choice, 271 values of ``default``, 59 of
``edge-cases`` and 23 of ``sampling`` differ from the records; with ``OPENBLAS_CORETYPE=Haswell`` or ``Zen``,
none).  Every record is made, and every check runs, with OpenBLAS's Haswell kernels (:data:`OPENBLAS_CORE`,
AVX2 code that every x86-64 machine with AVX2 runs): OpenBLAS reads the variable when it loads, so the script
runs itself again with it set where the caller's environment names another core or none.

    python scripts/record_golden.py                          # record every suite
    python scripts/record_golden.py --check                  # compare with the recorded files (exit 1 on a difference)
    python scripts/record_golden.py --check --family AVX2    # the same with AVX2 kernels (on an AVX512 machine)
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import torch

from spectr_audit.run.runner import AuditOptions, run_suite
from spectr_audit.run.suite import load_suite

GOLDEN = Path(__file__).resolve().parent.parent / "tests" / "run" / "golden"
SUITES = ("default", "edge-cases", "sampling", "historic-bugs")
#: The sample budget of each statistical audit: small, so that the whole record takes minutes.
MAX_SAMPLES = 20_000
SEED = 0
#: torch's intra-op threads while recording and comparing: a parallel reduction splits its sum by the number of
#: threads, so the last bits of a float depend on it (measured: 49 of the default suite's values move between 1
#: and 2 threads).
THREADS = 1
#: OpenBLAS's kernels while recording and comparing (``OPENBLAS_CORETYPE``, read when OpenBLAS loads).
OPENBLAS_CORE = "Haswell"


def platform() -> dict:
    """What bit-identical results depend on beyond the code: torch's version and the CPU kernels it picks."""
    return {"torch": torch.__version__, "cpu_capability": torch.backends.cpu.get_cpu_capability(), "threads": THREADS,
            "openblas_coretype": os.environ.get("OPENBLAS_CORETYPE")}


def pinned_environment(family: str | None = None) -> dict:
    """The environment a record is made and checked in: OpenBLAS's :data:`OPENBLAS_CORE` kernels, and
    ``family``'s torch and numpy kernels where one below the machine's is asked for."""
    return {**(family_environment(family) if family else os.environ), "OPENBLAS_CORETYPE": OPENBLAS_CORE}


def record_path(suite: str) -> Path:
    """The record of ``suite`` for this machine's CPU kernel family."""
    return GOLDEN / torch.backends.cpu.get_cpu_capability() / f"{suite}.json"


def _without_times(value):
    if isinstance(value, dict):
        return {k: _without_times(v) for k, v in value.items() if k != "seconds"}
    if isinstance(value, list):
        return [_without_times(v) for v in value]
    return value


def results(suite: str) -> dict:
    """The report of ``suite`` as JSON data, wall times removed (run on ``THREADS`` torch threads)."""
    before = torch.get_num_threads()
    torch.set_num_threads(THREADS)
    try:
        report = run_suite(load_suite(suite), options=AuditOptions(max_samples=MAX_SAMPLES, seed=SEED))
    finally:
        torch.set_num_threads(before)
    # through the JSON text, as a user reads it: floats as JSON writes them
    return _without_times(json.loads(json.dumps(report.to_dict(), allow_nan=False)))


def differences(recorded, now, where: str = "") -> list[str]:
    """Every path at which ``now`` differs from ``recorded`` (exact equality, floats included)."""
    if isinstance(recorded, dict) and isinstance(now, dict):
        out = []
        for key in sorted(set(recorded) | set(now)):
            if key not in now or key not in recorded:
                out.append(f"{where}/{key}: {'missing now' if key not in now else 'new'}")
            else:
                out.extend(differences(recorded[key], now[key], f"{where}/{key}"))
        return out
    if isinstance(recorded, list) and isinstance(now, list):
        if len(recorded) != len(now):
            return [f"{where}: {len(recorded)} entries recorded, {len(now)} now"]
        return [d for i, (a, b) in enumerate(zip(recorded, now)) for d in differences(a, b, f"{where}[{i}]")]
    return [] if recorded == now and type(recorded) is type(now) else [f"{where}: recorded {recorded!r}, now {now!r}"]


#: The families a machine runs below its own, and the numpy SIMD targets (by name prefix) each must leave out.
EMULATED = {"AVX2": ("AVX512", "X86_V4")}


def family_environment(family: str) -> dict:
    """The environment that makes torch and numpy pick ``family``'s kernels on a machine above it."""
    if family not in EMULATED:
        raise SystemExit(f"--family: expected one of {sorted(EMULATED)}, got {family!r}")
    try:
        from numpy._core._multiarray_umath import __cpu_dispatch__ as targets
    except ImportError:  # numpy 1.x
        from numpy.core._multiarray_umath import __cpu_dispatch__ as targets
    left_out = [t for t in targets if t.startswith(EMULATED[family])]
    # numpy's OpenBLAS picks its kernels by the CPU as well; Haswell's are the AVX2 ones (no record moves with or
    # without this, measured)
    return {**os.environ, "ATEN_CPU_CAPABILITY": family.lower(), "NPY_DISABLE_CPU_FEATURES": " ".join(left_out)}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="compare with the recorded files instead of writing them")
    parser.add_argument("--suite", action="append", choices=SUITES, help="only this suite (repeatable)")
    parser.add_argument("--family", help="run with this CPU kernel family's kernels (one below the machine's: "
                                         f"{', '.join(EMULATED)})")
    args = parser.parse_args(argv)
    other_family = args.family and args.family != torch.backends.cpu.get_cpu_capability()
    if other_family or os.environ.get("OPENBLAS_CORETYPE") != OPENBLAS_CORE:
        rest = (["--check"] if args.check else []) + [f"--suite={s}" for s in args.suite or ()]
        rest += [f"--family={args.family}"] if other_family else []
        done = subprocess.run([sys.executable, __file__, *rest],
                              env=pinned_environment(args.family if other_family else None))
        return done.returncode
    failed = False
    for suite in args.suite or SUITES:
        path = record_path(suite)
        if args.check and not path.exists():
            print(f"{suite}: no record for this machine's CPU kernels ({path} is absent); the records: "
                  f"{', '.join(sorted(p.parent.name for p in GOLDEN.glob(f'*/{suite}.json'))) or 'none'}")
            failed = True
            continue
        now = results(suite)
        if args.check:
            recorded = json.loads(path.read_text())
            found = differences(recorded["report"], now)
            print(f"{suite}: {len(now['results'])} results, {len(found)} differences"
                  + (f" (recorded on {recorded['platform']}, now {platform()})" if found else ""))
            for line in found[:20]:
                print("  " + line)
            failed |= bool(found)
        else:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps({"platform": platform(), "max_samples": MAX_SAMPLES, "seed": SEED,
                                        "report": now}, indent=1, sort_keys=True) + "\n")
            print(f"{suite}: {len(now['results'])} results -> {path}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
