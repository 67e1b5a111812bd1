"""What the HTML reports share: the stylesheet, value formatting, and figures embedded as base64 PNG."""

from __future__ import annotations

import base64
import html
import math
from typing import Any, Optional

_CSS = """
body { font-family: -apple-system, "Segoe UI", Roboto, "DejaVu Sans", sans-serif; margin: 2em auto;
       max-width: 1200px; color: #1d1d1f; padding: 0 1em; }
h1 { font-size: 1.6em; margin-bottom: 0.2em; }
h2 { border-bottom: 2px solid #ddd; padding-bottom: 0.2em; margin-top: 1.6em; }
h3 { margin-bottom: 0.3em; }
.meta { color: #555; }
.incomplete { background: #fff4e5; border-left: 4px solid #d97706; padding: 0.5em 0.8em; }
.badge { display: inline-block; padding: 0.15em 0.7em; border-radius: 0.4em; font-weight: bold; color: white; }
.pass { background: #1a7f37; } .fail { background: #cf222e; } .warn { background: #9a6700; }
table { border-collapse: collapse; margin: 0.6em 0; font-size: 0.86em; }
th, td { border: 1px solid #d0d7de; padding: 0.25em 0.55em; text-align: right; white-space: nowrap; }
th { background: #f6f8fa; position: sticky; top: 0; }
td.text, th.text { text-align: left; }
td.wrap { white-space: normal; }
.scroll { overflow-x: auto; max-width: 100%; }
table.findings { width: 100%; }
table.findings td.text, table.findings th { white-space: normal; }
table.findings td.worst { min-width: 17em; }
table.verifiers th { white-space: normal; }
table.verifiers { width: 100%; }
table.verifiers td.text { white-space: normal; overflow-wrap: anywhere; }
table.results th { white-space: normal; }
table.findings td.text code { white-space: nowrap; }
table.findings { table-layout: fixed; }
table.findings td { white-space: normal; overflow-wrap: anywhere; }
table.findings td.wrap code.error { white-space: pre-wrap; overflow-wrap: anywhere; }
.detail { color: #555; font-size: 0.88em; font-weight: normal; }
nav a { margin-right: 1em; }
tr.finding td { background: #fff0f0; }
tr.unexpected td { background: #ffe0e0; font-weight: bold; }
tr.declared td { background: #fff8e6; }
tr.inconclusive td { background: #fdf6d8; }
code { background: #f6f8fa; padding: 0.05em 0.3em; border-radius: 0.3em; }
figure { margin: 0.6em 1% 0.6em 0; display: inline-block; vertical-align: top; width: 48.5%; }
figure.wide { width: 99%; }
figure img { width: 100%; border: 1px solid #eee; }
figcaption { color: #555; font-size: 0.85em; }
.note { color: #555; font-size: 0.9em; max-width: 900px; }
"""


def _fmt(value: Any, digits: int = 4) -> str:
    if value is None:
        return "-"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, float):
        if not math.isfinite(value):
            return str(value)
        if value != 0 and (abs(value) < 1e-3 or abs(value) >= 1e5):
            return f"{value:.2e}"
        return f"{value:.{digits}f}"
    return html.escape(str(value))


def _text_cells(*values: Any) -> str:
    """Left-aligned text cells, one per value, escaped."""
    return "".join(f'<td class="text">{html.escape(str(value))}</td>' for value in values)


def _num(value: Any) -> Optional[float]:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value) if math.isfinite(value) else None


def _figure_html(png: bytes, css: str, alt: str, title: str, caption: str) -> str:
    """A figure embedded as a base64 PNG, with its title and caption (every text escaped)."""
    data = base64.b64encode(png).decode("ascii")
    return (f'<figure class="{css}"><img alt="{html.escape(alt)}" src="data:image/png;base64,{data}">'
            f"<figcaption><b>{html.escape(title)}</b>: {html.escape(caption)}</figcaption></figure>")
