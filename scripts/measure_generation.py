"""Measures of the generation audit's structure: where it lives, its longest positional argument list, its
string-keyed records.

    python scripts/measure_generation.py           # a summary
    python scripts/measure_generation.py --json    # the numbers, machine-readable

- the generation audit's modules: every module of the project whose dotted name contains ``generation`` or lies in
  a package of whole-engine adapters (``engines.e2e``, ``engine_adapters``), less the deprecated aliases (a module
  that only re-exports and warns); the places are the packages those modules sit in, a package named
  ``generation`` counting with its subpackages as one place;
- the longest positional argument list: the most positional parameters of a function (``self`` and ``cls`` not
  counted) and the most positional arguments of a call, in those modules;
- string-keyed records: the keys built as f-strings (a subscript, a dict display's key, the first argument of
  ``get``/``pop``/``setdefault``) in those modules.
"""

from __future__ import annotations

import argparse
import ast
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FOLDERS = {"spectr_audit": "spectr_audit", "reports": "spectr_audit.reports"}
ADAPTER_PACKAGES = ("spectr_audit.engines.e2e", "spectr_audit.engine_adapters")


def modules() -> dict:
    """Every module of the project: dotted name -> path."""
    out = {}
    for folder, package in FOLDERS.items():
        for path in sorted((ROOT / folder).rglob("*.py")):
            parts = path.relative_to(ROOT / folder).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            out[".".join((package, *parts))] = path
    return out


def _is_alias(tree: ast.Module) -> bool:
    """A deprecated alias: warns with DeprecationWarning (itself or through ``deprecation.moved_module``) and
    defines no function or class of its own."""
    defines = any(isinstance(n, (ast.FunctionDef, ast.ClassDef)) and n.name != "__getattr__" for n in tree.body)
    warns = any((isinstance(n, ast.Name) and n.id in ("DeprecationWarning", "moved_module")) for n in ast.walk(tree))
    return warns and not defines


def generation_modules() -> dict:
    out = {}
    for name, path in modules().items():
        if "generation" in name or name.startswith(ADAPTER_PACKAGES):
            tree = ast.parse(path.read_text())
            if not _is_alias(tree):
                out[name] = (path, tree)
    return out


def place(name: str, path: Path) -> str:
    """The package a module sits in: the outermost package named ``generation`` (or of engine adapters) above it,
    else its own package."""
    parts = name.split(".")
    for i, part in enumerate(parts[:-1] if path.name != "__init__.py" else parts):
        if part == "generation":
            return ".".join(parts[:i + 1])
    for adapters in ADAPTER_PACKAGES:
        if name.startswith(adapters):
            return adapters
    return name if path.name == "__init__.py" else ".".join(parts[:-1])


def measure() -> dict:
    found = generation_modules()
    places = sorted({place(name, path) for name, (path, _) in found.items()})
    longest_def = (0, "")
    longest_call = (0, "")
    fstring_keys = []
    for name, (path, tree) in found.items():
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                params = [a.arg for a in node.args.posonlyargs + node.args.args]
                n = len([p for p in params if p not in ("self", "cls")])
                if n > longest_def[0]:
                    longest_def = (n, f"{name}.{node.name} (line {node.lineno})")
            elif isinstance(node, ast.Call):
                n = len([a for a in node.args if not isinstance(a, ast.Starred)])
                if n > longest_call[0]:
                    longest_call = (n, f"{name} line {node.lineno}: {ast.unparse(node.func)}(...)")
            keys = []
            if isinstance(node, ast.Subscript):
                keys.append(node.slice)
            elif isinstance(node, ast.Dict):
                keys.extend(k for k in node.keys if k is not None)
            elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                  and node.func.attr in ("get", "pop", "setdefault") and node.args):
                keys.append(node.args[0])
            fstring_keys.extend(f"{name} line {k.lineno}: {ast.unparse(k)}" for k in keys if isinstance(k, ast.JoinedStr))
    return {"modules": sorted(found), "places": places, "longest_positional_parameters": list(longest_def),
            "longest_positional_call": list(longest_call), "fstring_keys": fstring_keys}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    numbers = measure()
    if args.json:
        print(json.dumps(numbers, indent=1))
        return 0
    print(f"modules of the generation audit: {len(numbers['modules'])}")
    print(f"places ({len(numbers['places'])}): {', '.join(numbers['places'])}")
    print("longest positional parameter list: {} ({})".format(*numbers["longest_positional_parameters"]))
    print("longest positional call: {} ({})".format(*numbers["longest_positional_call"]))
    print(f"f-string record keys: {len(numbers['fstring_keys'])}")
    for line in numbers["fstring_keys"]:
        print("  " + line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
