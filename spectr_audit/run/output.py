"""The output folder of ``spectr-audit run``: checked before a run, and holding only that run's reports.

* :func:`check_out` refuses (``InvalidArgument``, exit 2) an ``--out`` that is a file, lies under
  one, or cannot be created or written, before any audit runs.
* :func:`clear_earlier_run` removes, before the first audit, the report files an earlier run
  left in the folder: those its manifest lists, and report files by the names a run writes that
  are recognisably spectr-audit's (a folder written by a version without a manifest).  A file of
  such a name that spectr-audit did not write is never removed: the run refuses, naming it.
  Other files of the folder are not touched.
* :func:`write_manifest` records, after the reports are written, the files this run wrote.

So after a run (finished, interrupted or failed) the folder's report files are exactly the
ones that run wrote: a ``report.json`` of an earlier run can never sit there looking current.

Examples
--------
>>> import pathlib, tempfile
>>> out = pathlib.Path(tempfile.mkdtemp()) / "reports"
>>> check_out(out) == out, clear_earlier_run(out)
(True, [])
>>> _ = (out / "report.json").write_text('{"spectr_audit_version": "0.1.0", "results": []}')
>>> _ = write_manifest(out, [out / "report.json"])
>>> [p.name for p in clear_earlier_run(out)], sorted(p.name for p in out.iterdir())
(['report.json'], [])
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Iterable, Union

from spectr_audit._files import write_text_atomic
from spectr_audit.errors import InvalidArgument

__all__ = ["MANIFEST", "REPORT_FILES", "check_out", "clear_earlier_run", "write_manifest"]

#: The files a run may write into its output folder.
REPORT_FILES = ("report.json", "report.md", "report.html", "real-lm-tables.md")
#: The record of what the last run wrote (a hidden file of the folder).
MANIFEST = ".spectr-audit-run.json"


def check_out(out: Union[str, Path], argument: str = "--out") -> Path:
    """Create the output folder ``out`` (and its parents) or refuse with a clear message; returns it."""
    out = Path(out)
    for parent in [out, *out.parents]:
        if parent.exists() and not parent.is_dir():
            if parent == out:
                raise InvalidArgument(f"{argument}: {str(out)!r} is a file, not a folder; choose a folder for the reports")
            raise InvalidArgument(f"{argument}: {str(out)!r} lies under {str(parent)!r}, which is a file, not a folder")
        if parent.is_dir():
            break
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise InvalidArgument(f"{argument}: cannot create the folder {str(out)!r}: {exc.strerror or exc}") from None
    if not os.access(out, os.W_OK | os.X_OK):
        raise InvalidArgument(f"{argument}: the folder {str(out)!r} is not writable")
    return out


def _ours(path: Path) -> bool:
    """Whether an existing report file was written by spectr-audit (for folders without a manifest)."""
    try:
        with open(path, encoding="utf-8", errors="replace") as handle:
            head = handle.read(4096)
    except OSError:
        return False
    if path.suffix == ".json":
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return False
        return isinstance(data, dict) and "spectr_audit_version" in data
    return "spectr-audit" in head


def _manifest_files(out: Path) -> list[Path]:
    try:
        data = json.loads((out / MANIFEST).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return []
    names = data.get("files", []) if isinstance(data, dict) else []
    # Only plain names of this folder: a manifest cannot send the run to delete files elsewhere.
    return [out / name for name in names if isinstance(name, str) and name == Path(name).name and name != MANIFEST]


def clear_earlier_run(out: Path, argument: str = "--out") -> list[Path]:
    """Remove the report files of an earlier run from ``out``; returns what was removed.

    Raises ``InvalidArgument`` (before removing anything) when a file of a report's name is not
    spectr-audit's.
    """
    out = Path(out)
    listed = [p for p in _manifest_files(out) if p.is_file()]
    unlisted = [out / name for name in REPORT_FILES if (out / name).is_file() and out / name not in listed]
    foreign = [p for p in unlisted if not _ours(p)]
    if foreign:
        names = ", ".join(repr(p.name) for p in foreign)
        raise InvalidArgument(
            f"{argument}: the folder {str(out)!r} holds {names}, which spectr-audit did not write and this run "
            f"would replace; choose another --out, or move {'it' if len(foreign) == 1 else 'them'} away")
    removed = []
    for path in listed + unlisted:
        try:
            path.unlink()
        except FileNotFoundError:
            continue
        except OSError as exc:
            raise InvalidArgument(f"{argument}: cannot remove {str(path)!r} of an earlier run: {exc.strerror or exc}") from None
        removed.append(path)
    try:
        (out / MANIFEST).unlink()
    except FileNotFoundError:
        pass
    return removed


def write_manifest(out: Path, paths: Iterable[Union[str, Path]], complete: bool = True) -> Path:
    """Record the files of ``out`` this run wrote (others, e.g. a JUnit file elsewhere, are not the folder's)."""
    out = Path(out)
    resolved = out.resolve()
    names = sorted({Path(p).name for p in paths if Path(p).resolve().parent == resolved})
    return write_text_atomic(out / MANIFEST, json.dumps({"files": names, "complete": complete}, indent=1) + "\n")
