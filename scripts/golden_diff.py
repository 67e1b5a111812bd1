"""Summarise how the golden records moved: every value that differs between the records at a git revision and
the records in the working tree, field by field, with the verdicts and check outcomes that changed.

A change that moves the audit's results re-records ``tests/run/golden`` once; this script is its review:

    python scripts/golden_diff.py --against HEAD~1          # the records of HEAD~1 against the working tree's
    python scripts/golden_diff.py --against main --list     # ... and every moved value, one a line

For each kernel family and suite it prints the results compared, the results and values that moved,
and per field (the path in a result, a check named by its name rather than its position) how many
values moved and the largest absolute move of a number (a string, ``null`` or a type change is counted
as moved, with no size).  Then the verdicts (``verdict``, ``passed``) and check outcomes (a check's
``passed`` and ``inconclusive``, a check present on one side only) that changed: a change that only
moves numbers has none.  Exit 1 when any verdict or check outcome changed.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

__all__ = ["compare_results", "flatten", "main"]

ROOT = Path(__file__).resolve().parent.parent
GOLDEN = Path("tests") / "run" / "golden"


def flatten(value, path: str = "") -> dict:
    """Every leaf of a result as ``{path: value}``; the checks keyed by name (``checks[exact].threshold``)."""
    if isinstance(value, dict):
        out = {}
        for key, item in value.items():
            if key == "checks" and isinstance(item, list) and path == "":
                for check in item:
                    out.update(flatten({k: v for k, v in check.items() if k != "name"}, f"checks[{check['name']}]"))
            else:
                out.update(flatten(item, f"{path}.{key}" if path else key))
        return out
    if isinstance(value, list) and value and all(isinstance(v, (dict, list)) for v in value):
        out = {}
        for i, item in enumerate(value):
            out.update(flatten(item, f"{path}[{i}]"))
        return out
    return {path: value}


def _field(path: str) -> str:
    """The field a path belongs to: list positions dropped (``details.worst_strings[3].implied`` ->
    ``details.worst_strings[].implied``); a check keeps its name."""
    return re.sub(r"\[\d+\]", "[]", path)


def _outcomes(result: dict) -> dict:
    outcomes = {"verdict": result.get("verdict"), "passed": result.get("passed"), "error": result.get("error")}
    for check in result.get("checks", ()):
        outcomes[f"checks[{check['name']}]"] = (check.get("passed"), bool(check.get("inconclusive", False)))
    return outcomes


def compare_results(before: list, now: list) -> dict:
    """The moves between two lists of results (matched by verifier and case)."""
    old = {(r["verifier"], r["case"]): r for r in before}
    new = {(r["verifier"], r["case"]): r for r in now}
    moved_results, moved_values, outcome_changes, unmatched = 0, [], [], sorted(set(old) ^ set(new))
    for name in sorted(set(old) & set(new)):
        a, b = flatten(old[name]), flatten(new[name])
        moves = [(path, a.get(path, "<absent>"), b.get(path, "<absent>")) for path in sorted(set(a) | set(b))
                 if a.get(path, "<absent>") != b.get(path, "<absent>")
                 or type(a.get(path)) is not type(b.get(path))]
        moved_results += bool(moves)
        moved_values += [(name, path, x, y) for path, x, y in moves]
        was, now_ = _outcomes(old[name]), _outcomes(new[name])
        outcome_changes += [(name, what, was.get(what), now_.get(what)) for what in sorted(set(was) | set(now_))
                            if was.get(what) != now_.get(what)]
    return {"results": len(set(old) & set(new)), "moved_results": moved_results, "moved_values": moved_values,
            "outcome_changes": outcome_changes, "unmatched": unmatched}


def _by_field(moved_values: list) -> dict:
    fields: dict = defaultdict(lambda: [0, 0.0, 0])  # count, max abs move, non-numeric moves
    for _, path, x, y in moved_values:
        entry = fields[_field(path)]
        entry[0] += 1
        numeric = all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in (x, y))
        if numeric and math.isfinite(x) and math.isfinite(y):
            entry[1] = max(entry[1], abs(y - x))
        else:
            entry[2] += 1
    return fields


def _recorded(revision: str, path: Path) -> dict:
    text = subprocess.run(["git", "show", f"{revision}:{path.as_posix()}"], cwd=ROOT, capture_output=True, text=True,
                          check=True).stdout
    return json.loads(text)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--against", required=True, help="the git revision whose records are the 'before'")
    parser.add_argument("--list", action="store_true", help="also list every moved value")
    args = parser.parse_args(argv)
    changed = False
    for path in sorted((ROOT / GOLDEN).glob("*/*.json")):
        relative = path.relative_to(ROOT)
        found = compare_results(_recorded(args.against, relative)["report"]["results"],
                                json.loads(path.read_text())["report"]["results"])
        print(f"{relative.parent.name}/{path.stem}: {found['results']} results, {found['moved_results']} moved, "
              f"{len(found['moved_values'])} values moved, {len(found['outcome_changes'])} verdicts or check "
              f"outcomes changed" + (f", {len(found['unmatched'])} results on one side only" if found["unmatched"] else ""))
        for field, (count, largest, other) in sorted(_by_field(found["moved_values"]).items()):
            size = f"max |move| {largest:.3g}" if count > other else ""
            print(f"  {field}: {count} moved" + (f", {size}" if size else "") + (f", {other} not numbers" if other else ""))
        for name, what, was, now in found["outcome_changes"]:
            print(f"  OUTCOME {name[0]} on {name[1]}: {what}: {was!r} -> {now!r}")
        if args.list:
            for name, field, x, y in found["moved_values"]:
                print(f"    {name[0]} on {name[1]}: {field}: {x!r} -> {y!r}")
        changed |= bool(found["outcome_changes"] or found["unmatched"])
    return 1 if changed else 0


if __name__ == "__main__":
    sys.exit(main())
