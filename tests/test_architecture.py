"""docs/architecture.md's module index lists every module of the distribution, and nothing else."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FOLDERS = ("spectr_audit", "verifiers", "reports")


def _modules() -> set:
    return {str(path.relative_to(ROOT)) for folder in FOLDERS for path in (ROOT / folder).rglob("*.py")}


def _index() -> dict:
    text = (ROOT / "docs" / "architecture.md").read_text(encoding="utf-8")
    assert "## Module index" in text
    index = text.split("## Module index", 1)[1]
    listed, folder = {}, None
    for line in index.splitlines():
        heading = re.match(r"### `([^`]+)/`$", line)
        if heading:
            folder = heading.group(1)
            continue
        row = re.match(r"\| `([^`]+\.py)` \| (.*) \|$", line)
        if row:
            assert folder is not None, f"a module row before any folder heading: {line}"
            listed[f"{folder}/{row.group(1)}"] = row.group(2).strip()
    return listed


def test_the_index_lists_every_module():
    missing = sorted(_modules() - set(_index()))
    assert not missing, f"modules missing from docs/architecture.md's index: {missing}"


def test_the_index_lists_no_module_that_does_not_exist():
    stale = sorted(set(_index()) - _modules())
    assert not stale, f"docs/architecture.md's index lists modules that do not exist: {stale}"


def test_every_entry_says_what_the_module_holds():
    empty = sorted(path for path, what in _index().items() if len(what) < 12)
    assert not empty, f"index entries without a description: {empty}"


def test_pyproject_installs_every_package():
    """A package folder missing from [tool.setuptools] packages is absent from a built wheel (an editable
    install hides it)."""
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10
        import tomli as tomllib

    config = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["tool"]["setuptools"]
    installed_as = {folder: package for package, folder in config["package-dir"].items()}
    expected = set()
    for folder in FOLDERS:
        for init in (ROOT / folder).rglob("__init__.py"):
            parts = init.parent.relative_to(ROOT / folder).parts
            expected.add(".".join([installed_as.get(folder, folder), *parts]))
    missing = sorted(expected - set(config["packages"]))
    assert not missing, f"packages missing from pyproject.toml's [tool.setuptools] packages: {missing}"


def _measure_structure():
    import importlib.util

    spec = importlib.util.spec_from_file_location("measure_structure", ROOT / "scripts" / "measure_structure.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_no_import_cycles_and_no_private_names_across_packages():
    # imports inside functions count: a cycle held open by a deferred import is still a cycle
    measured = _measure_structure().measure()
    assert measured["cycles"] == [], f"import cycles: {measured['cycles']}"
    assert measured["private_cross_package"] == [], measured["private_cross_package"]


def test_the_cycle_finder_finds_a_planted_cycle():
    cycles = _measure_structure().cycles
    assert cycles({"a": ["b"], "b": ["c"], "c": ["a"], "d": ["a"]}) == [["a", "b", "c"]]
    assert cycles({"a": ["b"], "b": [], "c": ["a", "b"]}) == []


def test_every_name_the_top_level_package_offers_resolves():
    # the package's names are resolved lazily from their modules: a name whose module moved would only fail
    # when a user first reads it
    import spectr_audit

    missing = []
    for name in spectr_audit.__all__:
        try:
            getattr(spectr_audit, name)
        except AttributeError as exc:
            missing.append(f"{name}: {exc}")
    assert not missing, missing


def test_every_public_name_of_every_module_exists():
    # __all__ is what `from module import *` and the API pages promise
    import importlib

    broken = []
    for path in sorted((ROOT / "spectr_audit").rglob("*.py")):
        relative = path.relative_to(ROOT).with_suffix("")
        name = ".".join(relative.parts[:-1] if relative.name == "__init__" else relative.parts)
        if name.endswith("__main__") or ".engines." in name or ".lm." in name:
            continue  # entry points; optional engines and models whose imports may be absent
        module = importlib.import_module(name)
        broken += [f"{name}.{n}" for n in getattr(module, "__all__", ()) if not hasattr(module, n)]
    assert not broken, broken


def test_imports_inside_functions_only_at_the_lazy_loading_points():
    structure = _measure_structure()
    measured = structure.measure()
    assert measured["deferred_outside_lazy_loading"] == [], (
        "imports of the project inside functions outside the lazy-loading modules (move them to the top, or name "
        f"the module in scripts/measure_structure.py's LAZY_LOADING with its reason): "
        f"{measured['deferred_outside_lazy_loading']}")
    found = structure.modules()
    deferring = {name for name, path in found.items()
                 for target, _, deferred in structure.imports(name, path, set(found)) if deferred and target != name}
    stale = sorted(set(structure.LAZY_LOADING) - deferring)
    assert not stale, f"LAZY_LOADING names modules that defer no import (remove them): {stale}"
    text = (ROOT / "docs" / "architecture.md").read_text(encoding="utf-8")
    undocumented = sorted(name for name in structure.LAZY_LOADING if f"`{name}`" not in text)
    assert not undocumented, f"lazy-loading modules docs/architecture.md does not name: {undocumented}"


def test_the_deferred_import_finder_sees_an_import_inside_a_function(tmp_path):
    structure = _measure_structure()
    path = tmp_path / "mod.py"
    path.write_text("import spectr_audit.errors\n\ndef f():\n    from spectr_audit.defaults import ALPHA\n    return ALPHA\n")
    found = structure.imports("spectr_audit.mod", path, {"spectr_audit.errors", "spectr_audit.defaults"})
    assert sorted(found) == [("spectr_audit.defaults", "ALPHA", True), ("spectr_audit.errors", None, False)]
