"""Trace the path of one verifier through ``audit_case``: how often each module of the project is entered
before the verifier's ``verify`` runs, the forms the verifier takes on the way, and the calls up the layers.

    python scripts/trace_verifier_path.py                       # a chain verifier on a chain case
    python scripts/trace_verifier_path.py --verifier kseq --case seed-spectr
    python scripts/trace_verifier_path.py --verifier logits-speculative --suite sampling --case temperature

An *entry* into a module is a call of one of its functions from a function of another module; a
*conversion* is a call of ``as_verifier``, ``as_tree_verifier``, ``as_logits_verifier`` or
``bind_params``; a *form* is an object built to stand for the verifier (an adapter of the contract, a time
limit, a binding of sampling parameters: :data:`FORMS`), counted once per object; a *call up the layers*
is a call of a function of the run layer (``spectr_audit.run``) from a module of a layer below it (the
contract, the verifiers, the audit: drafting, exact, statistical, bounds), such as a run-layer object
handed down and called from below.  All are counted from the call of ``audit_case`` to the first call of
the verifier's own ``verify`` (the path), and over the whole audit.  ``audit_case`` limits every verifier
call in time (the default ``verifier_timeout``), as a run does.
"""

from __future__ import annotations

import argparse
import collections
import sys
from pathlib import Path

import spectr_audit
from spectr_audit.registry import load_verifier
from spectr_audit.run.runner import AuditOptions, audit_case
from spectr_audit.run.suite import load_suite

#: The folder holding the imported package (a source tree, or a copy laid out as installed).
ROOT = Path(spectr_audit.__file__).resolve().parent.parent
#: The modules whose entries the issue of one stack is about, printed whether entered or not.
WATCHED = ("spectr_audit.run.runner", "spectr_audit.contract.tree_verifier", "spectr_audit.contract.chain_trees")
CONVERSIONS = {"as_verifier", "as_tree_verifier", "as_logits_verifier", "bind_params"}
#: The classes whose objects stand for a verifier on its way down (this code's and earlier versions').
FORMS = {"ChainVerifierAsTree", "TreeVerifierAsChain", "BoundLogitsVerifier", "TimeLimited", "TimeLimitedVerifier",
         "TimeLimitedTreeVerifier", "FunctionVerifier", "FunctionTreeVerifier", "FunctionLogitsVerifier"}
#: The layers below the run layer (``import-linter`` forbids them to import it).
BELOW_RUN = ("spectr_audit.contract", "spectr_audit.verifiers", "spectr_audit.drafting", "spectr_audit.exact",
             "spectr_audit.statistical", "spectr_audit.bounds")


def _module(filename: str):
    path = Path(filename)
    try:
        relative = path.resolve().relative_to(ROOT)
    except ValueError:
        return None
    if relative.parts[0] not in ("spectr_audit", "verifiers", "reports"):
        return None
    parts = relative.with_suffix("").parts
    if parts[-1] == "__init__":
        parts = parts[:-1]
    # in a source tree verifiers/ and reports/ are installed inside the package
    return ".".join(parts if parts[0] == "spectr_audit" else ("spectr_audit",) + parts)


def trace(verifier_name: str, case_name: str, suite: str = "default", black_box: bool = False) -> dict:
    verifier = load_verifier(verifier_name)
    verify_code = type(verifier).verify.__code__  # the rule's own verify, wrapped or not
    if black_box:
        # the same rule without its law: the statistical audit's path
        from spectr_audit.contract.verifier import FunctionVerifier

        verifier = FunctionVerifier(verifier.verify, name=f"{verifier.name} (black box)",
                                    min_drafts=verifier.min_drafts, max_drafts=verifier.max_drafts,
                                    min_draft_len=verifier.min_draft_len, max_draft_len=verifier.max_draft_len)
    case = next(c for c in load_suite(suite).cases if c.name == case_name)
    counts = {"path": collections.Counter(), "audit": collections.Counter()}
    conversions = {"path": collections.Counter(), "audit": collections.Counter()}
    forms = {"path": {}, "audit": {}}  # id of each object built -> its class's name
    calls_up = {"path": collections.Counter(), "audit": collections.Counter()}
    state = {"phase": "path"}

    def profile(frame, event, arg):
        if event != "call":
            return
        code = frame.f_code
        if code is verify_code and state["phase"] == "path":
            state["phase"] = "audit"
        module = _module(code.co_filename)
        if module is None:
            return
        caller = frame.f_back
        caller_module = _module(caller.f_code.co_filename) if caller is not None else None
        phases = ("path", "audit") if state["phase"] == "path" else ("audit",)
        name = code.co_name
        self_obj = frame.f_locals.get("self") if name == "__init__" else None
        form = self_obj is not None and type(self_obj).__name__ in FORMS
        up = (module.startswith("spectr_audit.run") and caller_module is not None
              and caller_module.startswith(BELOW_RUN))
        for phase in phases:
            if caller_module != module:
                counts[phase][module] += 1
            if name in CONVERSIONS:
                conversions[phase][name] += 1
            if form:
                forms[phase][id(self_obj)] = type(self_obj).__name__
            if up:
                calls_up[phase][f"{caller_module} -> {module}.{name}"] += 1

    sys.setprofile(profile)
    try:
        result = audit_case(verifier, case, AuditOptions(max_samples=2_000))
    finally:
        sys.setprofile(None)
    return {"verifier": verifier.name, "case": case.name, "error": result.error, "entries": counts,
            "conversions": conversions,
            "forms": {phase: collections.Counter(built.values()) for phase, built in forms.items()},
            "calls_up": calls_up}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--verifier", default="speculative")
    parser.add_argument("--case", default="seq-markov-v2/K=1/L=3")
    parser.add_argument("--suite", default="default")
    parser.add_argument("--black-box", action="store_true", help="the verifier without its output_probs")
    args = parser.parse_args(argv)
    found = trace(args.verifier, args.case, args.suite, args.black_box)
    print(f"verifier {found['verifier']} on case {found['case']}" + (f" (error: {found['error']})" if found["error"] else ""))
    for phase, what in (("path", "from audit_case to the first verify"), ("audit", "the whole audit")):
        entries = found["entries"][phase]
        conv = found["conversions"][phase]
        forms = found["forms"][phase]
        up = found["calls_up"][phase]
        print(f"{what}: {sum(entries.values())} module entries over {len(entries)} modules; "
              f"conversions {sum(conv.values())} {dict(sorted(conv.items()))}; "
              f"forms {sum(forms.values())} {dict(sorted(forms.items()))}; "
              f"calls up the layers (into run/ from below) {sum(up.values())}")
        for call, count in up.most_common(4):
            print(f"    {count:5d}  up: {call}")
        for module in WATCHED:
            print(f"    {entries.get(module, 0):5d}  {module}")
        for module, count in entries.most_common(6):
            if module not in WATCHED:
                print(f"    {count:5d}  {module}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
