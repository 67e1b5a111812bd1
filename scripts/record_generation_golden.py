"""Record (or compare) the golden outputs of the generation audit.

A restructure of the generation audit must leave its results as they were: this script runs the built-in
``generation`` suite and a fixed set of toy audits (the correct loop under several options, every planted slip of
:mod:`spectr_audit.generation.library`, a store written and resumed) at small budgets and fixed seeds, and writes
each result's JSON report, without the wall-clock seconds (the only fields that vary between runs), to
``tests/generation/golden/<cpu capability>/<run>.json`` with the torch version, CPU capability and thread count
they were recorded on (floats' last bits depend on them, as in ``scripts/record_golden.py``).
``tests/generation/test_golden_outputs.py`` reruns them and compares exactly.  The whole set takes about half a
minute of CPU time.

    python scripts/record_generation_golden.py            # record every run
    python scripts/record_generation_golden.py --check    # compare with the recorded files (exit 1 on a difference)
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
import tempfile
from pathlib import Path
from typing import Callable

import torch

GOLDEN = Path(__file__).resolve().parent.parent / "tests" / "generation" / "golden"
SEED = 0
#: torch's intra-op threads while recording and comparing (a parallel reduction's last bits depend on them).
THREADS = 1


def platform() -> dict:
    """What bit-identical results depend on beyond the code: torch's version and the CPU kernels it picks."""
    return {"torch": torch.__version__, "cpu_capability": torch.backends.cpu.get_cpu_capability(), "threads": THREADS}


def record_path(run: str) -> Path:
    """The record of ``run`` for this machine's CPU kernel family."""
    return GOLDEN / torch.backends.cpu.get_cpu_capability() / f"{run}.json"


def _without_times(value):
    if isinstance(value, dict):
        return {k: _without_times(v) for k, v in value.items() if k not in ("seconds", "spectr_audit_version")}
    if isinstance(value, list):
        return [_without_times(v) for v in value]
    return value


def _suite() -> dict:
    from spectr_audit.run.generation_suite import run_generation_suite

    return run_generation_suite("generation", seed=SEED).to_dict()


def _toy(spec: str = "toy", engine: dict | None = None, **audit) -> Callable[[], dict]:
    """A toy audit as the command line runs it: the engine spec resolved, then audited with ``audit``."""

    def run() -> dict:
        from spectr_audit.generation.engine_specs import audit_engine, load_generation_engine

        made = load_generation_engine(spec, **(engine or {}))
        return audit_engine(made, seed=SEED, **audit).to_dict()

    return run


def _slip(name: str, **audit) -> Callable[[], dict]:
    def run() -> dict:
        from spectr_audit.generation.library import audit_slip

        return audit_slip(name, seed=SEED, **audit).to_dict()

    return run


def _logits_scorer() -> dict:
    """The correct loop scored by logits (the zero-mass numerics margin), with a draft scorer's ratio order."""
    from spectr_audit.generation import audit_generation
    from spectr_audit.generation.library import ToyPair, correct_engine
    from spectr_audit.contract.sampling import SamplingParams

    pair = ToyPair(16, seed=1, params=SamplingParams(temperature=0.8, top_p=0.9))
    return audit_generation(correct_engine(pair), pair.logits_scorer(), [[1, 2], [3, 4, 5], [6]], vocab_size=16,
                            draft_score=pair.draft_scorer(), max_new_tokens=12, rounds=2, seed=SEED,
                            orderings=("ratio", "probability"), position_buckets=(4, 8), progress=False).to_dict()


def _resumed() -> dict:
    """An audit written into a store, half its jobs dropped (as an interrupted audit leaves it), then resumed: both
    results (the second reads the stored jobs back and runs the others)."""
    import sqlite3

    from spectr_audit.generation.engine_specs import audit_engine, load_generation_engine

    with tempfile.TemporaryDirectory() as folder:
        store = str(Path(folder) / "audit.sqlite")
        first = audit_engine(load_generation_engine("toy"), seed=SEED, max_new_tokens=12, store=store)
        with sqlite3.connect(store) as db:
            db.execute("DELETE FROM jobs WHERE job >= 8")
        second = audit_engine(load_generation_engine("toy"), seed=SEED, max_new_tokens=12, store=store, resume=True)
        return {"first": first.to_dict(), "resumed": second.to_dict()}


#: Every run recorded, by name.
RUNS: dict = {
    "suite-generation": _suite,
    "toy-reference": _toy(max_new_tokens=12, reference=True, arms=("single", "equal", "ragged")),
    "toy-greedy-reference": _toy(engine={"temperature": 0.0}, max_new_tokens=10, reference=True),
    "toy-unrelated-draft-top-p": _toy(engine={"draft_noise": None, "top_p": 0.8, "toy_seed": 3}, max_new_tokens=12,
                                      batch_size=3, rounds=2, alpha=0.01, min_detectable_tv=0.2),
    "toy-token-budget": _toy(max_new_tokens=16, max_tokens=200),
    "toy-eos": _toy(engine={"eos_token_id": 5, "vocab_size": 12}, max_new_tokens=20, arms=("single", "repeated")),
    "toy-logits-scorer": _logits_scorer,
    "toy-store-resumed": _resumed,
    **{f"slip-{name}": _slip(name) for name in (
        "phantom-context", "positions-by-block", "bonus-wrong-position", "residual-unprocessed", "params-draft-only",
        "low-precision-draft", "rows-permuted", "eos-inside-block", "shared-stream", "past-context-length")},
    "slip-correct-eos": _slip("eos-inside-block", correct=True),
    "slip-correct-residual": _slip("residual-unprocessed", correct=True, rounds=2),
}


def results(run: str) -> dict:
    """The JSON report of ``run``, wall-clock seconds removed (run on ``THREADS`` torch threads)."""
    before = torch.get_num_threads()
    torch.set_num_threads(THREADS)
    try:
        report = RUNS[run]()
    finally:
        torch.set_num_threads(before)
    # through the JSON text, as a user reads it
    return _without_times(json.loads(json.dumps(report, allow_nan=False)))


def _record_golden():
    """The verifier audit's golden script, beside this one: its exact comparison serves both."""
    spec = importlib.util.spec_from_file_location("record_golden", Path(__file__).with_name("record_golden.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


#: Every path at which ``now`` differs from ``recorded`` (exact equality, floats included).
differences = _record_golden().differences


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="compare with the recorded files instead of writing them")
    parser.add_argument("--run", action="append", choices=sorted(RUNS), help="only this run (repeatable)")
    args = parser.parse_args(argv)
    failed = False
    for run in args.run or RUNS:
        path = record_path(run)
        if args.check and not path.exists():
            print(f"{run}: no record for this machine's CPU kernels ({path} is absent)")
            failed = True
            continue
        now = results(run)
        if args.check:
            recorded = json.loads(path.read_text())
            found = differences(recorded["report"], now)
            print(f"{run}: {len(found)} differences" + (f" (recorded on {recorded['platform']}, now {platform()})"
                                                        if found else ""))
            for line in found[:20]:
                print("  " + line)
            failed |= bool(found)
        else:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps({"platform": platform(), "seed": SEED, "report": now}, indent=1,
                                       sort_keys=True) + "\n")
            print(f"{run} -> {path}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
