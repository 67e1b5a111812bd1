"""``spectr-audit list``: the registered verifiers (every namespace), the generation engines and the suites."""

from __future__ import annotations

import json

from spectr_audit.cli._args import GENERATION_SUITE, REAL_LM_SUITE, suite_names
from spectr_audit.registry import describe, entries, namespaces
from spectr_audit.generation.engine_specs import generation_engine_names

__all__ = ["command"]


def command(args) -> int:
    """Run ``spectr-audit list``; its exit code."""
    rows = [describe(entry) for entry in entries()]
    engines = generation_engine_names()
    if args.json:
        print(json.dumps({"namespaces": namespaces(), "verifiers": rows, "generation_engines": engines,
                          "suites": suite_names()}, indent=2))
        return 0
    # Columns aligned on the longest entry of each, across every namespace.
    for r in rows:
        if "trees" in r:  # which draft trees each verifier takes, under which draft schemes
            r["tree_cell"] = f"{r['trees']} ({r['tree_draft_schemes'].replace(',', ', ')})"
    fields = {"name": "name", "num_drafts": "K", "draft_len": "L", "draft_scheme": "drafts", "tree_cell": "trees"}
    width = {key: max([len(title)] + [len(str(r.get(key, ""))) for r in rows]) for key, title in fields.items()}
    print("verifiers (by short name, or namespace:name; trees: 'any' draft tree or only 'chains' of K x L, "
          "and the tree draft schemes):")
    for namespace in namespaces():
        print(f"{namespace}:")
        print("  " + "  ".join(f"{title:<{width[key]}}" for key, title in fields.items()) + "  exact law  notes")
        for r in (r for r in rows if r["namespace"] == namespace):
            if "error" in r:
                print(f"  {r['name']:<{width['name']}}  unavailable: {r['error']}")
                continue
            cells = "  ".join(f"{str(r[key]):<{width[key]}}" for key in fields)
            notes = [f"declared {r['expected']}"] if r["expected"] else []
            if r["extra"]:
                notes.append(f"extra: spectr-audit[{r['extra']}]")
            if r.get("takes_logits"):
                notes.append("takes logits and sampling parameters")
            notes.append(r["description"])
            print(f"  {cells}  {'yes' if r['exact_law'] else 'no ':<9}  {'; '.join(n for n in notes if n)}")
    print("generation engines (spectr-audit generation --engine SPEC; also package.module:factory or "
          "path/file.py:factory):")
    spec_width = max(len(e["spec"]) for e in engines)
    for e in engines:
        mark = "planted slip: " if e["expected"] == "finding" else ""
        print(f"  {e['spec']:<{spec_width}}  {mark}{e['needs']}")
    print("suites:")
    suites = suite_names()
    suite_width = max(len(s) for s in suites)
    for s in suites:
        note = "  (SmolLM2-135M in the loop; needs the lm extra, see README)" if s == REAL_LM_SUITE else ""
        if s == GENERATION_SUITE:
            note = "  (generation audits: spectr-audit generation --suite generation)"
        print(f"  {s:<{suite_width}}{note}".rstrip())
    return 0
