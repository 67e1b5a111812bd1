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
