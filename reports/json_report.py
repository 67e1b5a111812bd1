"""The JSON report: the machine contract (see :mod:`spectr_audit.results` for the schema)."""

from __future__ import annotations

import json
from pathlib import Path

from spectr_audit._files import write_text_atomic
from spectr_audit.results import AuditReport

__all__ = ["render_json", "write_json"]


def render_json(report: AuditReport) -> str:
    """The report as indented JSON text."""
    return json.dumps(report.to_dict(), indent=2, allow_nan=False)


def write_json(report: AuditReport, path: Path) -> Path:
    """Write ``report.json``-style output to ``path`` atomically (a temporary file, then a rename); returns the path."""
    path = Path(path)
    write_text_atomic(path, render_json(report) + "\n")
    return path
