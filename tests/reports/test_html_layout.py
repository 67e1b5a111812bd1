"""The HTML report as a browser lays it out: a long finding fits the page width (headless chromium).

Skipped where no chromium is installed (``apt-get install -y chromium``).  The page is the report
itself with one script appended that writes the right edges of the findings and verifier tables and
the page's width into the title, which ``--dump-dom`` prints.
"""

from __future__ import annotations

import re
import shutil
import subprocess

import pytest

from spectr_audit.reports.html import render_html
from spectr_audit.results import AuditReport, AuditResult, Check

BROWSER = next((shutil.which(name) for name in ("chromium", "chromium-browser", "google-chrome") if shutil.which(name)),
               None)

_PROBE = ("<script>var f = document.querySelector('table.findings').getBoundingClientRect();"
          "var v = document.querySelector('table.verifiers').getBoundingClientRect();"
          "document.title = 'edges ' + Math.ceil(f.right) + ' ' + Math.ceil(v.right) + ' '"
          " + document.documentElement.clientWidth;</script></body></html>")


def _long_report() -> AuditReport:
    long_error = ("VerifierError: my_verify: verify raised IndexError: index 3 is out of bounds for dimension 2 with "
                  "size 1 in /home/someone/projects/a-project-with-a-long-name/src/engine/speculative/"
                  + "verifier_module_with_a_very_long_name_" * 8 + ".py")
    detail = "max |F(w) - q(w)| over strings of length L + 1 above the tolerance: " + "the implied law differs " * 20
    return AuditReport(results=(
        AuditResult("my_verify", "seq-markov-v2/K=1/L=3", error=long_error, details={"traceback": "..."}),
        AuditResult("a-verifier-with-a-long-name-" * 3, "a-case-with-a-long-name/K=1/L=3" * 3,
                    (Check("exact", False, 0.07, 1e-12, detail),), {"tv_distance": 0.1, "acceptance": 0.7}),
        AuditResult("box", "seed/K=1", (Check("statistical", True, 0.5, 1e-3, "exactness not rejected"),),
                    {"acceptance": 0.7001, "acceptance_ci": [0.6987, 0.7015], "optimal_acceptance": 0.7,
                     "acceptance_ratio": 1.0001, "pvalue": 0.56}),
    ), suite="layout")


@pytest.mark.skipif(BROWSER is None, reason="no chromium (apt-get install -y chromium)")
@pytest.mark.parametrize("width", [1280, 1000])
def test_a_long_finding_fits_the_page_width_in_chromium(tmp_path, width):
    page = render_html(_long_report(), figures=False).replace("</body></html>", _PROBE)
    path = tmp_path / "report.html"
    path.write_text(page)
    done = subprocess.run([BROWSER, "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run",
                           f"--user-data-dir={tmp_path / 'profile'}", f"--window-size={width},2000", "--dump-dom",
                           path.as_uri()], capture_output=True, text=True, timeout=120)
    edges = re.search(r"<title>edges (\d+) (\d+) (\d+)</title>", done.stdout)
    assert edges, done.stderr[-2000:]
    findings, verifiers, page_width = map(int, edges.groups())
    assert findings <= page_width, f"the findings table ends at {findings} px, past the page's {page_width} px"
    if width >= 1280:
        assert verifiers <= page_width, f"the verifier table ends at {verifiers} px, past the page's {page_width} px"


def test_the_long_error_is_in_a_wrapping_cell_of_a_fixed_layout_table():
    page = render_html(_long_report(), figures=False)
    assert '<table class="findings"><colgroup>' in page and "table.findings { table-layout: fixed; }" in page
    assert '<code class="error">VerifierError: my_verify' in page
