"""The generation audit's reports: JSON (a versioned machine contract), Markdown, HTML and JUnit XML.

They read a ``GenerationAuditResult`` through its :meth:`to_dict` (or that dict itself, or a
``report.json`` read back), never the audit: plain values only (docs/report-schema.md,
"Generation audits").  Every number says what it rests on:

* the verdict line names the deciding test, its Holm-adjusted p-value, alpha, the tokens scored,
  and how the audit decided: one-sample (the engine's tokens against the scorer's law),
  two-sample (against the reference generator, because the reference itself differs from the
  scorer: the numerics floor) or greedy (token for token against the reference); an INCONCLUSIVE
  gives the minimum detectable TV reached against the one requested;
* the tests: the whole Holm family, each test with its role (deciding, decisive check, reported)
  and its outcome in words that follow it (``rejected``, ``not rejected``, ``FINDING``, ``held``);
* the strata: per stratum and PIT order, tokens, p, adjusted p, minimum detectable TV and the bins
  outside the 99% acceptance band (the HTML draws the histograms with their bands);
* the held-out lower bounds on the mean per-token TV, the engine's beside the reference's (the
  numerics floor, with the zero-mass logit tolerance used); the greedy divergences, each with its position,
  both tokens, the logit margin and the two continuations side by side from the divergence on,
  labelled "numerics (near-tie)" where the margin is within the tolerance; the zero-mass tokens,
  the continuations that went on after the end-of-sequence token, repeated requests' agreement,
  acceptance counters, wall times and failed jobs.

:func:`write_generation_report` renders every format first, then writes each file atomically
(a temporary file, then a rename): a failure leaves the previous files whole.

One module per part, every public name re-exported here: ``generation_reading`` (the result's
plain values, the tests' roles and outcomes, the verdict's sentences), ``generation_sections``
(the sections' rows and sentences the text formats share), ``generation_markdown``,
``generation_html`` and ``generation_junit`` (one format each).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Sequence

from spectr_audit import __version__
from spectr_audit._files import write_text_atomic
from spectr_audit.errors import InvalidArgument
from spectr_audit.reports.generation_html import render_generation_html
from spectr_audit.reports.generation_junit import render_generation_junit
from spectr_audit.reports.generation_markdown import render_generation_markdown
from spectr_audit.reports.generation_reading import KIND, SCHEMA_VERSION, generation_dict

__all__ = [
    "FORMATS",
    "KIND",
    "SCHEMA_VERSION",
    "generation_dict",
    "generation_json",
    "render_generation_html",
    "render_generation_json",
    "render_generation_junit",
    "render_generation_markdown",
    "write_generation_report",
]

#: The formats :func:`write_generation_report` writes, and their file names.
FORMATS = {"json": "report.json", "md": "report.md", "html": "report.html", "junit": "junit.xml"}


# ---------------------------------------------------------------------------------------------
# JSON
# ---------------------------------------------------------------------------------------------


def generation_json(result: Any) -> dict:
    """The machine contract: ``{"kind": "generation-audit", "schema_version": 1, "spectr_audit_version": ...,
    ...the result's dict}``."""
    return {"kind": KIND, "schema_version": SCHEMA_VERSION, "spectr_audit_version": __version__,
            **generation_dict(result)}


def render_generation_json(result: Any) -> str:
    """:func:`generation_json` as indented JSON text (strict: no NaN or infinity)."""
    return json.dumps(generation_json(result), indent=2, allow_nan=False) + "\n"


# ---------------------------------------------------------------------------------------------
# Writing
# ---------------------------------------------------------------------------------------------


def write_generation_report(result: Any, out_dir: Any, formats: Sequence[str] = ("json", "md", "html", "junit"),
                            *, figures: bool = True) -> dict:
    """Write the generation audit's reports into ``out_dir``: report.json, report.md, report.html, junit.xml.

    Every format is rendered before any file is written, and each file is written atomically
    (a temporary file in ``out_dir``, then a rename), so a failure leaves the previous reports whole.

    Parameters
    ----------
    result : GenerationAuditResult or its ``to_dict()`` dict
    out_dir : str or Path
        Created when missing.
    formats : sequence of str
        Some of :data:`FORMATS` (``"json"``, ``"md"``, ``"html"``, ``"junit"``).
    figures : bool
        Draw the HTML report's figures.

    Returns
    -------
    dict
        ``{format: path written}``.
    """
    if isinstance(formats, str):
        formats = (formats,)
    formats = tuple(formats)
    unknown = [f for f in formats if f not in FORMATS]
    if not formats or unknown:
        raise InvalidArgument(f"formats: expected some of {sorted(FORMATS)}, got {list(formats)!r}")
    data = generation_dict(result)
    renderers = {"json": render_generation_json, "md": render_generation_markdown,
                 "html": lambda r: render_generation_html(r, figures=figures), "junit": render_generation_junit}
    texts = {f: renderers[f](data) for f in dict.fromkeys(formats)}
    out_dir = Path(out_dir)
    return {f: write_text_atomic(out_dir / FORMATS[f], text) for f, text in texts.items()}
