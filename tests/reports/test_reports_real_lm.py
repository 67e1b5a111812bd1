"""The real-LM suite's tables in the HTML and Markdown reports.

A synthetic ``meta["real_lm"]`` is built with the suite's own dataclasses
(:class:`RealLMTables` and its rows; no model is loaded) in the shape a ``--suite real-lm``
run gives: block efficiency for a (method, K, L) grid with one missing cell and one row
without a confidence interval, acceptance for K = 1..8 with K-SEQ measured only at some K,
and fidelity rows, one of them of a verifier declared inexact (not judged) and one whose
sample detects nothing.  The checks read the rendered tables cell by cell, the power line,
the header and the figure titles, decode the two embedded figures, survive a JSON round trip
(NaN becomes null), and confirm that a report without the tables renders exactly as before
(the section is purely additive).
"""

from __future__ import annotations

import base64
import math
import re
from html.parser import HTMLParser

import pytest

from spectr_audit.lm.tables import AcceptanceRow, BlockEfficiencyRow, FidelityRow, RealLMTables
from spectr_audit.reports.figures import (
    real_lm_acceptance_figure,
    real_lm_block_efficiency_figure,
    real_lm_block_grid,
    real_lm_figures,
    real_lm_power,
    real_lm_power_summary,
    report_figures,
)
from spectr_audit.reports.html import _REAL_LM_CSS, render_html
from spectr_audit.reports.markdown import render_markdown, render_real_lm_markdown
from spectr_audit.results import AuditReport, AuditResult, Check, jsonable

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
NAN = math.nan
SECTION = "Real language model (SmolLM2-135M)"
KSEQ_MEASURED_AT = (1, 2, 4, 8)


def _alpha_star(K: int) -> float:
    return 1.0 - 0.25 * 0.72 ** (K - 1)  # 0.75 at K = 1, rising towards 1


def synthetic_tables() -> RealLMTables:
    """Plausible real-LM tables, with the gaps a real run has."""
    grid = [("token-by-token", "speculative", 1), ("block verification", "block", 1),
            ("SpecTr tree", "spectr-tree", 2), ("SpecTr tree", "spectr-tree", 4), ("SpecTr tree", "spectr-tree", 8),
            ("SpecTr-GBV (published)", "spectr-gbv-published", 2)]
    block = []
    for method, verifier, K in grid:
        for L in (2, 4, 8):
            if verifier == "spectr-gbv-published" and L == 8:
                continue  # a cell the grid lacks: shown as a dash
            value = 1.0 + 0.45 * L ** 0.8 * (1 + 0.08 * math.log2(K)) + (0.05 if verifier == "block" else 0.0)
            low, high = (NAN, NAN) if (verifier, L) == ("speculative", 8) else (value - 0.11, value + 0.13)
            block.append(BlockEfficiencyRow(method, verifier, K, L, value, low, high, 96, 24, 12.5))
    acceptance = []
    for K in range(1, 9):
        a = _alpha_star(K)
        bound = (1 - (1 - 1 / K) ** K) * a
        measured = K in KSEQ_MEASURED_AT
        acceptance.append(AcceptanceRow(
            num_drafts=K, optimal=a, spectr_bound=bound, e_bound=(1 - math.exp(-1)) * a, single_draft=0.75,
            kseq_closed_form=a - 0.3 * (a - bound), kseq_measured=(a - 0.32 * (a - bound)) if measured else NAN,
            kseq_measured_half_width=0.021 if measured else NAN,
            kseq_optimal_same_contexts=a - 0.004 if measured else NAN,
            rrs_measured=a - 0.25 * (a - bound), rrs_measured_half_width=0.012, num_contexts=96))
    fidelity = [
        FidelityRow("kseq", "token", 2, 1, 48, 0.62, 0.21, 0.44, 0.0123, 3.4e-5, 1.1e-5, 8, 2.5e-4),
        FidelityRow("rrs", "token", 4, 1, 192, 4.2e-7, 0.11, 0.08, 0.0051, 1.2e-6, 8.0e-7, 8, 3.3e-4),
        FidelityRow("spectr-tree", "sequence", 2, 4, 96, 0.31, 0.17, NAN, NAN, NAN, NAN, 8, 1e-3),
        FidelityRow("block", "sequence", 1, 2, 4, 0.9, 1.3, NAN, NAN, NAN, NAN, 2, 1e-3),  # detects nothing
        FidelityRow("spectr-gbv-published", "sequence", 2, 2, 96, 0.02, 0.4, NAN, NAN, NAN, NAN, 8, 1e-3,
                    judged=False),
    ]
    return RealLMTables(block_efficiency=tuple(block), acceptance=tuple(acceptance), fidelity=tuple(fidelity),
                        partition="8 cells per context: tokens sorted by target/draft probability ratio",
                        setup="SmolLM2-135M-Instruct Q4_1 (torch.float32), V = 49152, 24 prompts",
                        alpha=1e-3, power=0.99)


def synthetic_report(real_lm: bool = True) -> AuditReport:
    """A small real-lm-shaped report; ``real_lm=False`` drops only ``meta["real_lm"]``."""
    ok = (Check("first-token-sampled", True, 0.4, 1e-3),)
    results = (
        AuditResult("kseq", "real-lm/token/K=2", checks=ok, expected=True,
                    metrics={"acceptance": 0.86, "optimal_acceptance": 0.93, "spectr_bound": 0.70}),
        AuditResult("spectr-tree", "real-lm/seq/K=2/L=4", checks=ok, expected=True,
                    metrics={"num_drafts": 2, "draft_len": 4, "block_efficiency": 2.7, "acceptance": 0.9}),
        AuditResult("spectr-tree", "real-lm/seq/K=4/L=4", checks=ok, expected=True,
                    metrics={"num_drafts": 4, "draft_len": 4, "block_efficiency": 2.9, "acceptance": 0.93}),
    )
    meta = {"seed": 0, "dtype": "torch.float32", "load_seconds": 5.028155263999906}
    if real_lm:
        meta["real_lm"] = synthetic_tables().to_dict()
    return AuditReport(results=results, suite="real-lm", meta=meta)


class _Tables(HTMLParser):
    """Text of every cell of every table with an id: {id: [[cell, ...], ...]} (header rows included)."""

    def __init__(self):
        super().__init__(convert_charrefs=True)
        self.tables: dict = {}
        self._table = self._row = self._cell = None

    def handle_starttag(self, tag, attrs):
        if tag == "table":
            self._table = self.tables.setdefault(dict(attrs).get("id") or f"table{len(self.tables)}", [])
        elif tag == "tr" and self._table is not None:
            self._row = []
            self._table.append(self._row)
        elif tag in ("td", "th") and self._row is not None:
            self._cell = []
        elif tag == "br" and self._cell is not None:
            self._cell.append(" ")

    def handle_endtag(self, tag):
        if tag in ("td", "th") and self._cell is not None:
            self._row.append(re.sub(r"\s+", " ", "".join(self._cell)).strip())
            self._cell = None
        elif tag == "table":
            self._table = self._row = None

    def handle_data(self, data):
        if self._cell is not None:
            self._cell.append(data)


def _tables(text: str) -> dict:
    parser = _Tables()
    parser.feed(text)
    return parser.tables


def _section(text: str) -> str:
    start = text.index('<h2 id="real-lm">')
    end = text.find("<h2 ", start + 1)
    return text[start:] if end < 0 else text[start:end]


@pytest.fixture(scope="module")
def report():
    return synthetic_report()


@pytest.fixture(scope="module")
def page(report):
    return render_html(report)


# ---------------------------------------------------------------------------------------------
# HTML
# ---------------------------------------------------------------------------------------------


def test_html_has_the_section_after_the_findings_and_a_nav_link(page):
    assert f'<h2 id="real-lm">{SECTION}</h2>' in page
    assert page.index('id="findings"') < page.index('id="real-lm"') < page.index('<h2 id="figures"')
    assert '<a href="#real-lm">' in page
    assert "24 prompts" in _section(page)  # the setup line


def test_html_block_efficiency_table_in_spectr_shape(page):
    table = _tables(_section(page))["real-lm-block-efficiency-table"]
    assert table[1] == ["L = 2", "L = 4", "L = 8"]
    body = table[2:]
    assert [row[:2] for row in body] == [["token-by-token", "1"], ["block verification", "1"], ["SpecTr tree", "2"],
                                         ["SpecTr tree", "4"], ["SpecTr tree", "8"], ["SpecTr-GBV (published)", "2"]]
    expected = {(r.method, r.num_drafts, r.draft_len): r for r in synthetic_tables().block_efficiency}
    for row in body:
        for L, cell in zip((2, 4, 8), row[2:]):
            r = expected.get((row[0], int(row[1]), L))
            if r is None:
                assert cell == "–"
            elif math.isnan(r.ci_low):
                assert cell == f"{r.block_efficiency:.2f}"
            else:
                assert cell == f"{r.block_efficiency:.2f} [{r.ci_low:.2f}, {r.ci_high:.2f}]"
    assert body[2][3] == "2.47 [2.36, 2.60]"  # SpecTr tree, K = 2, L = 4: 1 + 0.45 * 4^0.8 * 1.08 = 2.473


def test_html_acceptance_table_for_k_1_to_8(page):
    table = _tables(_section(page))["real-lm-acceptance-table"]
    head, body = table[0], table[1:]
    assert head[:3] == ["K", "alpha*", "SpecTr bound (1-(1-1/K)K) alpha*"]
    assert [row[0] for row in body] == [str(K) for K in range(1, 9)]
    for row, r in zip(body, synthetic_tables().acceptance):
        assert row[1:6] == [f"{v:.3f}" for v in (r.optimal, r.spectr_bound, r.e_bound, r.single_draft,
                                                    r.kseq_closed_form)]
        if r.num_drafts in KSEQ_MEASURED_AT:
            assert row[6] == f"{r.kseq_measured:.3f} ± {r.kseq_measured_half_width:.3f}"
            assert row[7] == f"{r.kseq_optimal_same_contexts:.3f}"
        else:
            assert row[6] == row[7] == "–"
        assert row[8] == f"{r.rrs_measured:.3f} ± 0.012"
        assert row[9] == "96"
    assert body[1][1:3] == ["0.820", "0.615"]  # K = 2: alpha* = 1 - 0.25 * 0.72, bound = 3/4 of it


def test_html_fidelity_table(page):
    table = _tables(_section(page))["real-lm-fidelity-table"]
    assert table[0][5] == "cells"
    assert table[1] == ["kseq", "token", "2", "1", "48", "8", "0.620", "0.210", "0.440", "0.0123",
                        "3.40e-05 ± 1.1e-05"]
    assert table[2][6] == "4.20e-07"  # a small p-value is not rounded to 0.000
    assert table[3][8:] == ["–", "–", "–"]
    assert table[4][7] == "≥ 1 (none)"  # a TV never exceeds 1: that sample detects nothing
    assert table[5][0] == "spectr-gbv-published (declared inexact, not judged)"
    tables = synthetic_tables().to_dict()
    tables["fidelity"][0]["sampled_min_detectable_tv"] = math.inf  # no test: every cell pooled into one
    page = render_html(AuditReport(results=(), suite="real-lm", meta={"real_lm": tables}), figures=False)
    assert _tables(_section(page))["real-lm-fidelity-table"][1][7] == "none"
    assert "| kseq | token | 2 | 1 | 48 | 8 | 0.620 | none |" in render_real_lm_markdown(tables)


def test_html_embeds_the_two_real_lm_figures_as_png(page):
    images = re.findall(r'<figure class="real-lm-figure"><img alt="([^"]*)" src="data:image/png;base64,([^"]+)"',
                        _section(page))
    assert [alt.split(":")[0] for alt, _ in images] == ["real-lm-acceptance", "real-lm-block-efficiency"]
    for _, data in images:
        assert base64.b64decode(data)[:8] == PNG_MAGIC
    assert "real-lm-figure" not in render_html(synthetic_report(), figures=False)


def test_html_tables_survive_a_json_round_trip(report, page):
    """After JSON (NaN -> null) the tables read the same."""
    round_trip = AuditReport(results=report.results, suite=report.suite, meta=jsonable(report.meta))
    assert round_trip.meta["real_lm"]["acceptance"][2]["kseq_measured"] is None
    assert _tables(_section(render_html(round_trip, figures=False))) == _tables(_section(page))


def test_html_escapes_method_names():
    tables = synthetic_tables().to_dict()
    tables["block_efficiency"][0]["method"] = "<b>bold</b>"
    text = render_html(AuditReport(results=(), suite="x", meta={"real_lm": tables}), figures=False)
    assert "&lt;b&gt;bold&lt;/b&gt;" in text and "<b>bold</b>" not in text


def test_report_without_real_lm_is_unchanged(page):
    """The section, its nav link and its CSS are the only difference; without real_lm nothing shows."""
    plain = render_html(synthetic_report(real_lm=False))
    assert SECTION not in plain and 'id="real-lm' not in plain and "table.real-lm" not in plain
    assert "real-lm-figure" not in plain and 'href="#real-lm"' not in plain
    stripped = page.replace(_section(page), "").replace('<a href="#real-lm">Real language model</a>', "")
    stripped = stripped.replace(_REAL_LM_CSS, "", 1)
    assert stripped == plain
    markdown = render_markdown(synthetic_report(real_lm=False))
    assert SECTION not in markdown
    assert render_markdown(synthetic_report()).startswith(markdown)


# ---------------------------------------------------------------------------------------------
# Markdown
# ---------------------------------------------------------------------------------------------


def test_markdown_appends_the_tables(report):
    text = render_markdown(report)
    section = text[text.index(f"## {SECTION}"):]
    assert "| method | K | L = 2 | L = 4 | L = 8 |" in section
    assert "| SpecTr tree | 2 | 1.85 [1.74, 1.98] | 2.47 [2.36, 2.60] | 3.57 [3.46, 3.70] |" in section
    assert "| SpecTr-GBV (published) | 2 | 1.85 [1.74, 1.98] | 2.47 [2.36, 2.60] | – |" in section  # no L = 8
    assert "| token-by-token | 1 | 1.78 [1.67, 1.91] | 2.36 [2.25, 2.49] | 3.38 |" in section  # no CI at L = 8
    assert "| 2 | 0.820 | 0.615 | 0.518 | 0.750 | 0.759 | 0.754 ± 0.021 (0.816) | 0.769 ± 0.012 |" in section
    assert "| 3 |" in section and "| – | 0." in section  # K = 3: K-SEQ not measured
    rows = [line for line in section.splitlines() if re.match(r"\| \d \| 0\.", line)]
    assert [int(line.split("|")[1]) for line in rows] == list(range(1, 9))
    assert "| rrs | token | 4 | 1 | 192 | 8 | 4.20e-07 | 0.110 |" in section
    assert "| block | sequence | 1 | 2 | 4 | 2 | 0.900 | ≥ 1 (none) |" in section
    assert "| spectr-gbv-published (declared inexact, not judged) | sequence | 2 | 2 | 96 | 8 | 0.020 |" in section
    # the section is the CLI's real-lm-tables.md, rendered by the same function
    assert section.rstrip("\n") == render_real_lm_markdown(synthetic_tables().to_dict()).rstrip("\n")


# ---------------------------------------------------------------------------------------------
# What the run could detect, the header, the figure titles
# ---------------------------------------------------------------------------------------------

POWER_LINE = ("minimum detectable TV reached at power 0.99 on the ratio cells: 0.110 to 0.210 at the token level "
              "(2 tests), 0.170 at the sequence level (1 test), 1 test too small to detect any deviation")


def test_power_summary_states_the_range_reached_by_the_judged_tests():
    tables = synthetic_tables().to_dict()
    assert real_lm_power_summary(tables) == POWER_LINE
    power = real_lm_power(tables)
    assert power["token"] == (0.11, 0.21, 2) and power["sequence"] == (0.17, 0.17, 1)  # gbv's 0.4 is not judged
    assert power["not_judged"] == ["spectr-gbv-published"] and power["not_detecting"] == 1
    assert real_lm_power_summary({}) is None and real_lm_power_summary(None) is None


def test_power_line_in_markdown_and_html(report, page):
    text = render_markdown(report)
    assert f"Power: {POWER_LINE} (false-alarm rate 0.001 per result)." in text
    assert "Declared inexact, measured and not judged: spectr-gbv-published" in text
    assert POWER_LINE in re.search(r'<p id="real-lm-power">(.*?)</p>', _section(page)).group(1)


def test_html_header_formats_numbers(page):
    header = re.search(r'<p class="meta">(.*?)</p>', page).group(1)
    assert "load_seconds 5.03" in header and "5.028155" not in header


def test_figure_titles_name_k_and_l_once(report):
    titles = [f.title for f in report_figures(report)]
    assert "real-lm/seq, L=4" in titles  # cases real-lm/seq/K=k/L=l: base name, then L once
    assert not any(re.search(r"L=\d+.*L=\d+|K=\d+.*K=\d+", t) for t in titles), titles


# ---------------------------------------------------------------------------------------------
# Figure helpers
# ---------------------------------------------------------------------------------------------


def test_figure_helpers_accept_rows_and_degrade_to_none():
    tables = synthetic_tables()
    assert real_lm_acceptance_figure(tables.acceptance)[:8] == PNG_MAGIC  # dataclass rows
    assert real_lm_acceptance_figure([]) is None
    assert real_lm_block_efficiency_figure([]) is None
    assert real_lm_block_efficiency_figure([{"method": "m", "num_drafts": 1, "draft_len": 2,
                                             "block_efficiency": None}]) is None
    assert real_lm_figures(None) == [] and real_lm_figures({}) == []
    lengths, series = real_lm_block_grid(tables.to_dict()["block_efficiency"])
    assert lengths == [2, 4, 8] and len(series) == 6 and sorted(series[-1][2]) == [2, 4]
