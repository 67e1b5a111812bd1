"""Measures of the package's structure: module sizes, deferred imports, import cycles, private imports.

    python scripts/measure_structure.py            # a summary
    python scripts/measure_structure.py --json     # the numbers, machine-readable

- lines of code per module (non-blank, non-comment lines outside docstrings), the longest listed;
- imports between the project's modules, and how many are deferred (inside a function or class
  body rather than at module level); the deferred imports of the lazy-loading points
  (``LAZY_LOADING``: the pytest plugin, the light faces it reads, the registry, the memory budget,
  optional kernels) are counted apart from those anywhere else, which should be none;
- import cycles: strongly connected components of the module import graph with every import as an
  edge (a cycle held open by a deferred import is still a cycle of the design);
- private names (a leading underscore) or private modules imported from another package of the
  project (the root package's shared leaves ``_validation``, ``_arguments``, ``_files`` and ``_deadline`` excepted);
- the audit's stage tables (module-level tuples of ``Stage(...)`` entries) and the classes that run
  them (classes with a ``stages`` method or a ``run`` method beside ``_exact``): one of each when chain
  and tree cases run through one table.
"""

from __future__ import annotations

import argparse
import ast
import io
import json
import sys
import tokenize
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FOLDERS = {"spectr_audit": "spectr_audit", "verifiers": "spectr_audit.verifiers", "reports": "spectr_audit.reports"}
SHARED_LEAVES = {"spectr_audit._validation", "spectr_audit._arguments", "spectr_audit._files", "spectr_audit._deadline"}
#: The modules whose imports of the project may sit inside functions, and why (docs/architecture.md).
LAZY_LOADING = {
    "spectr_audit.plugin": "pytest loads the plugin in every run of every project that has spectr-audit installed",
    "spectr_audit.plugin_report": "part of the plugin: the audit's modules load when a test used the fixture",
    "spectr_audit.generation.checks": "the generation faces the plugin loads: torch-free until an audit runs",
    "spectr_audit.generation.cases": "read by generation.checks and run.suite at load: torch-free",
    "spectr_audit.generation.engine_specs": "read by generation.checks at load: torch-free",
    "spectr_audit.generation.suite": "read by generation.checks at load: torch-free",
    "spectr_audit.run.budget": "the memory budget is decided before anything is allocated: torch- and scipy-free",
    "spectr_audit.registry": "a verifier's module is imported when its name is asked for",
    "spectr_audit.verifiers.library.historic": "a historic rule built on block verification is built when asked for",
    "spectr_audit.verifiers.triton_kernels": "the Triton kernels (triton: optional, slow to import) load on first launch",
}


def module_name(path: Path) -> str:
    for folder, dotted in FOLDERS.items():
        try:
            rel = path.relative_to(ROOT / folder)
        except ValueError:
            continue
        parts = [p for p in rel.with_suffix("").parts if p != "__init__"]
        return ".".join([dotted, *parts])
    raise ValueError(path)


def modules() -> dict:
    return {module_name(p): p for folder in FOLDERS for p in sorted((ROOT / folder).rglob("*.py"))}


def code_lines(source: str) -> int:
    """Lines holding code: not blank, not only a comment, not inside a docstring."""
    tree = ast.parse(source)
    doc_lines = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(getattr(body[0], "value", None), ast.Constant) \
                    and isinstance(body[0].value.value, str):
                doc_lines.update(range(body[0].lineno, body[0].end_lineno + 1))
    lines = set()
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type in (tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT,
                          tokenize.ENDMARKER):
            continue
        lines.update(range(token.start[0], token.end[0] + 1))
    return len(lines - doc_lines)


def longest_functions(name: str, source: str, count: int = 5) -> list:
    """The longest functions (lines from ``def`` to the body's end, docstring excluded) of a module."""
    sizes = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            start = node.lineno
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(getattr(body[0], "value", None), ast.Constant) \
                    and isinstance(body[0].value.value, str):
                start = body[0].end_lineno + 1 if len(body) > 1 else body[0].end_lineno
            sizes.append((node.end_lineno - start + 1, f"{name}.{node.name}"))
    return sorted(sizes, reverse=True)[:count]


def _package(name: str) -> str:
    return ".".join(name.split(".")[:2])


def imports(name: str, path: Path, known: set) -> list:
    """(target module, imported name or None, deferred) for each import of a project module."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    found = []

    def visit(node, deferred):
        for child in ast.iter_child_nodes(node):
            inner = deferred or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Lambda))
            if isinstance(child, ast.Import):
                for alias in child.names:
                    if alias.name.startswith("spectr_audit"):
                        found.append((_resolve(alias.name, known), None, deferred))
            elif isinstance(child, ast.ImportFrom) and child.level == 0 and (child.module or "").startswith("spectr_audit"):
                for alias in child.names:
                    sub = f"{child.module}.{alias.name}"
                    if sub in known:  # "from package import module"
                        found.append((sub, None, deferred))
                    else:
                        found.append((_resolve(child.module, known), alias.name, deferred))
            elif not isinstance(child, (ast.Import, ast.ImportFrom)):
                visit(child, inner)

    visit(tree, False)
    return found


def _resolve(dotted: str, known: set) -> str:
    while dotted not in known and "." in dotted:
        dotted = dotted.rsplit(".", 1)[0]
    return dotted


def cycles(edges: dict) -> list:
    """Strongly connected components with more than one module (Tarjan, iterative)."""
    index, low, on_stack, stack, result, counter = {}, {}, set(), [], [], [0]
    for start in edges:
        if start in index:
            continue
        work = [(start, iter(edges[start]))]
        index[start] = low[start] = counter[0]
        counter[0] += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            advanced = False
            for child in children:
                if child not in edges:
                    continue
                if child not in index:
                    index[child] = low[child] = counter[0]
                    counter[0] += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(edges[child])))
                    advanced = True
                    break
                if child in on_stack:
                    low[node] = min(low[node], index[child])
            if advanced:
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    result.append(sorted(component))
    return sorted(result)


def stage_tables(name: str, source: str) -> tuple[list, list]:
    """The module's stage tables (module-level tuples of ``Stage(...)`` calls, with their sizes) and the classes
    that run stages (a ``run`` method beside stage methods such as ``_exact``)."""
    tree = ast.parse(source)
    tables, drivers = [], []
    for node in tree.body:
        value = node.value if isinstance(node, (ast.Assign, ast.AnnAssign)) else None
        if isinstance(value, ast.Tuple) and value.elts and all(
                isinstance(e, ast.Call) and getattr(e.func, "id", None) == "Stage" for e in value.elts):
            target = node.targets[0] if isinstance(node, ast.Assign) else node.target
            tables.append((f"{name}.{getattr(target, 'id', '?')}", len(value.elts)))
        if isinstance(node, ast.ClassDef):
            methods = {f.name for f in node.body if isinstance(f, ast.FunctionDef)}
            if "_exact" in methods:
                drivers.append(f"{name}.{node.name}")
    return tables, drivers


def measure() -> dict:
    found = modules()
    known = set(found)
    sizes = {name: code_lines(path.read_text(encoding="utf-8")) for name, path in found.items()}
    edges = {name: set() for name in found}
    eager = {name: set() for name in found}
    total = deferred = 0
    private, elsewhere = [], []
    for name, path in found.items():
        for target, imported, is_deferred in imports(name, path, known):
            if target == name or target not in known:
                continue
            # a package importing its own submodule is not an edge of the design (its __init__ re-exports)
            if target.startswith(name + ".") and found[name].name == "__init__.py":
                continue
            edges[name].add(target)
            if not is_deferred:
                eager[name].add(target)
            total += 1
            deferred += is_deferred
            if is_deferred and name not in LAZY_LOADING:
                elsewhere.append(f"{name} imports {target}{'.' + imported if imported else ''}")
            if _package(target) != _package(name) and target not in SHARED_LEAVES:
                private_module = any(p.startswith("_") and not p.startswith("__") for p in target.split(".")[1:])
                private_name = imported is not None and imported.startswith("_") and not imported.startswith("__")
                if private_module or private_name:
                    private.append(f"{name} imports {target}{'.' + imported if imported else ''}")
    longest = sorted(sizes.items(), key=lambda item: -item[1])
    functions = sorted((f for name, path in found.items()
                        for f in longest_functions(name, path.read_text(encoding="utf-8"))), reverse=True)[:5]
    tables, drivers = [], []
    for name, path in found.items():
        found_tables, found_drivers = stage_tables(name, path.read_text(encoding="utf-8"))
        tables += found_tables
        drivers += found_drivers
    pairs = sum(len(v) for v in edges.values())
    deferred_pairs = sum(len(edges[n] - eager[n]) for n in edges)
    return {"modules": len(found), "imports": total, "deferred_imports": deferred,
            "deferred_outside_lazy_loading": sorted(elsewhere), "module_pairs": pairs,
            "deferred_only_pairs": deferred_pairs,
            "cycles": cycles({k: sorted(v) for k, v in edges.items()}), "private_cross_package": sorted(private),
            "over_500_lines": [(n, s) for n, s in longest if s > 500], "longest": longest[:10],
            "longest_functions": [(n, s) for s, n in functions], "stage_tables": tables, "stage_drivers": drivers}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    result = measure()
    if args.json:
        print(json.dumps(result, indent=2))
        return 0
    print(f"modules: {result['modules']}")
    print(f"imported names between them: {result['imports']}, deferred: {result['deferred_imports']}")
    outside = result["deferred_outside_lazy_loading"]
    print(f"deferred outside the {len(LAZY_LOADING)} lazy-loading modules: {len(outside)}")
    for line in outside:
        print(f"  {line}")
    print(f"importing module pairs: {result['module_pairs']}, reached only by deferred imports: "
          f"{result['deferred_only_pairs']}")
    print(f"import cycles: {len(result['cycles'])}")
    for component in result["cycles"]:
        print(f"  {' <-> '.join(component) if len(component) < 6 else f'{len(component)} modules: ' + ', '.join(component)}")
    print(f"private names imported across packages: {len(result['private_cross_package'])}")
    for line in result["private_cross_package"]:
        print(f"  {line}")
    print(f"modules over 500 lines of code: {len(result['over_500_lines'])}")
    for name, size in result["longest"]:
        print(f"  {size:5d}  {name}")
    print("longest functions (lines of body):")
    for name, size in result["longest_functions"]:
        print(f"  {size:5d}  {name}")
    print(f"stage tables: {len(result['stage_tables'])} "
          f"({', '.join(f'{name}: {size} stages' for name, size in result['stage_tables'])})")
    print(f"classes running stages: {len(result['stage_drivers'])} ({', '.join(result['stage_drivers'])})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
