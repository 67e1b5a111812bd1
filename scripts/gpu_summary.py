"""One Markdown table from a GPU check: the CUDA verdicts of every built-in and the benchmark on that GPU.

Run by ``scripts/gpu_check.sh``; by hand::

    python scripts/gpu_summary.py --device-junit OUT/device.xml --triton-junit OUT/triton.xml \\
        --bench OUT/bench.json [--out OUT/summary.md]

Verdict columns come from the JUnit reports of ``tests/integration/test_device.py`` (its CUDA cases,
each of which compares CUDA with the CPU) and ``tests/verifiers/test_triton_kernels.py``: ``ok``
(passed), ``FAIL``, ``known`` (a strict xfail: a documented host sync), ``skip``, ``-`` (not run).
Benchmark columns come from ``benchmarks/bench_verifiers.py --json``: the fastest call in ms, its
ratio to a memory pass over the same tensors on the same GPU, and the same with the Triton kernels
off (``eager``).  Exit status: 0 when every verdict is ok or known, 1 otherwise.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

#: The CUDA cases of tests/integration/test_device.py, by column: the test ids (``{name}``: the verifier's).
COLUMNS = {
    "sampler = law, rows = CPU": r"test_sampler_follows_its_exact_law\[cuda-{name}\]",
    "contract + exact audit = CPU": r"test_contract_checks_and_exact_audit\[cuda-{name}\]",
    "statistical audit = CPU": r"test_statistical_audit\[cuda-{name}\]",
    "no host sync": r"test_no_host_sync_in_the_sampler_on_cuda\[{name}-\d+\]",  # both vocabulary sizes
}


def builtin_names() -> list:
    sys.path.insert(0, str(ROOT))
    from spectr_audit.registry import BUILTIN_VERIFIERS

    return list(BUILTIN_VERIFIERS)


def read_junit(path) -> dict:
    """``{test id: outcome}`` with outcomes ``ok``, ``FAIL``, ``known`` (xfail) and ``skip``; empty if absent."""
    if not path or not Path(path).is_file():
        return {}
    outcomes = {}
    for case in ET.parse(path).getroot().iter("testcase"):
        kinds = {child.tag: child for child in case}
        if "failure" in kinds or "error" in kinds:
            outcome = "FAIL"
        elif "skipped" in kinds:
            skipped = kinds["skipped"]
            outcome = "known" if "xfail" in (skipped.get("type", "") + skipped.get("message", "")) else "skip"
        else:
            outcome = "ok"
        outcomes[case.get("name", "")] = outcome
    return outcomes


def _combine(outcomes: list) -> str:
    if not outcomes:
        return "-"
    for worst in ("FAIL", "skip", "known"):
        if worst in outcomes:
            return worst
    return "ok"


def verdicts(outcomes: dict, name: str) -> dict:
    """The four verdict cells of one verifier."""
    cells = {}
    for column, pattern in COLUMNS.items():
        wanted = re.compile(pattern.format(name=re.escape(name)))
        cells[column] = _combine([o for test, o in outcomes.items() if wanted.fullmatch(test)])
    return cells


def table(names: list, outcomes: dict, triton: dict, bench: dict) -> tuple[str, bool]:
    """The Markdown table and whether every verdict held."""
    rows = bench.get("verifiers", []) if bench else []
    machine = bench.get("machine", {}) if bench else {}
    eager = any("ratio_eager" in row for row in rows)
    head = ["verifier", "K", "L", "V", *COLUMNS, "verify ms", "ratio", "ratio median [IQR]"]
    if eager:
        head += ["ratio eager (Triton off)", "Triton speed-up"]
    lines = [
        f"GPU check on {machine.get('device_name', '?')} (torch {machine.get('torch', '?')}): verdicts of the "
        "CUDA cases (each compared with the CPU); times are the fastest of the interleaved rounds, ratios to a "
        "memory pass over the same tensors on the same GPU",
        "",
        "| " + " | ".join(head) + " |",
        "|" + "---|" * len(head),
    ]
    held = True
    for name in names:
        cells = verdicts(outcomes, name)
        held &= all(c in ("ok", "known") for c in cells.values())
        mine = [row for row in rows if row["verifier"] == name] or [None]
        for row in mine:
            if row is None:
                numbers = ["-", "-", "-", "-", "-", "-"] + (["-", "-"] if eager else [])
            else:
                spread = row.get("ratio_spread", [float("nan")] * 2)
                numbers = [str(row["num_drafts"]), str(row["draft_len"]), str(row["vocab_size"]),
                           f"{row['verify_ms']:.3f}", f"{row['ratio']:.2f}",
                           f"{row.get('ratio_median', float('nan')):.2f} [{spread[0]:.2f}, {spread[1]:.2f}]"]
                if eager:
                    ratio_eager = row.get("ratio_eager")
                    numbers += ([f"{ratio_eager:.2f}", f"{ratio_eager / row['ratio']:.2f}x"] if ratio_eager
                                else ["-", "-"])
            k_l_v, times = numbers[:3], numbers[3:]
            lines.append("| " + " | ".join([name, *k_l_v, *cells.values(), *times]) + " |")
    passed = sum(o == "ok" for o in triton.values())
    failed = sum(o == "FAIL" for o in triton.values())
    skipped = sum(o == "skip" for o in triton.values())
    held &= bool(triton) and failed == 0 and skipped == 0
    lines += ["", f"Triton kernels against their eager twins (tests/verifiers/test_triton_kernels.py on CUDA): "
                  f"{passed} passed, {failed} failed, {skipped} skipped" + ("" if triton else " (not run)")]
    return "\n".join(lines), held


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device-junit")
    parser.add_argument("--triton-junit")
    parser.add_argument("--bench")
    parser.add_argument("--out")
    args = parser.parse_args(argv)
    bench = json.loads(Path(args.bench).read_text()) if args.bench and Path(args.bench).is_file() else {}
    text, held = table(builtin_names(), read_junit(args.device_junit), read_junit(args.triton_junit), bench)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
    return 0 if held else 1


if __name__ == "__main__":
    sys.exit(main())
