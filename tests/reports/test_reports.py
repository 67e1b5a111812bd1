"""Report writers: JUnit XML, the self-contained HTML report and its figures.

Hand-built results check each writer's contract (what is a failure, what is escaped, what is
embedded); one real audit (K-SEQ and a K-SEQ with rho 10% below rho*, which is inexact) checks
that the HTML names the findings and draws every figure.  The browser check renders that HTML
in headless chromium (slow; skipped where chromium is not installed).
"""

from __future__ import annotations

import base64
import re
import shutil
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from spectr_audit.run.gate import evaluate_gate, parse_threshold
from spectr_audit.reports.figures import (
    acceptance_figure,
    block_efficiency_figure,
    case_shape,
    law_figure,
    law_with_ci,
    report_figures,
)
from spectr_audit.reports.html import render_html, write_html
from spectr_audit.reports.junit import render_junit, write_junit
from spectr_audit.results import AuditReport, AuditResult, Check

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
ROOT = Path(__file__).resolve().parents[2]


def _result(verifier, case, passed=True, expected=None, error=None, details=None, **metrics):
    checks = (Check("exact", passed, 0.0 if passed else 0.02, 1e-12, "max |F(w) - q(w)|"),)
    return AuditResult(verifier, case, checks=checks, metrics=metrics, expected=expected, error=error,
                       details=details or {})


@pytest.fixture
def hand_report():
    worst = [{"string": [1, 0], "implied": 0.25, "target": 0.2}, {"string": [0, 0], "implied": 0.1, "target": 0.12}]
    return AuditReport(
        results=(
            _result("good", "seed/K=1", tv_distance=1e-17, acceptance=0.7, optimal_acceptance=0.7,
                    acceptance_ratio=1.0, seconds=0.5,
                    details={"first_token_law": [0.3, 0.7], "target_first_token_law": [0.3, 0.7]}),
            _result("good", "seed/K=2", tv_distance=1e-17, acceptance=0.85, optimal_acceptance=0.94,
                    spectr_bound=0.705, acceptance_ratio=0.904, seconds=0.25),
            _result("bad <script>", "seed/K=2", passed=False, tv_distance=0.02, acceptance=0.88,
                    optimal_acceptance=0.94, details={"worst_strings": worst}),
            _result("lossy", "seed/K=2", passed=False, expected=False, tv_distance=0.05),
            _result("crashy", "seed/K=2", error="VerifierError: crashy: verify raised IndexError: boom",
                    details={"traceback": "Traceback ..."}),
            _result("blackbox", "seed/K=2", pvalue=0.42, num_samples=20000, acceptance=0.86,
                    details={"first_token_counts": [6000, 14000], "target_first_token_law": [0.3, 0.7]}),
        ),
        suite="hand",
        meta={"seed": 0},
    )


# ---------------------------------------------------------------------------------------------
# JUnit
# ---------------------------------------------------------------------------------------------


def test_junit_one_testcase_per_result_with_failures_errors_and_properties(hand_report):
    root = ET.fromstring(render_junit(hand_report))
    (suite,) = root.findall("testsuite")
    cases = suite.findall("testcase")
    assert [(c.get("classname"), c.get("name")) for c in cases] == [
        (f"spectr_audit.{r.verifier}", r.case) for r in hand_report.results]
    assert (suite.get("tests"), suite.get("failures"), suite.get("errors")) == ("6", "1", "1")
    by_name = {c.get("classname").split(".", 1)[1]: c for c in reversed(cases)}  # first of each verifier
    failure = by_name["bad <script>"].find("failure")
    assert failure.get("type") == "Finding" and "check exact failed" in failure.get("message")
    assert "string [1, 0]: implied 0.25, target 0.2" in failure.text
    # Declared inexact and measured inexact: as expected, so not a failure.
    assert by_name["lossy"].find("failure") is None
    assert "boom" in by_name["crashy"].find("error").get("message")
    props = {p.get("name"): p.get("value") for p in by_name["good"].findall("properties/property")}
    assert props["tv_distance"] == repr(1e-17) and float(props["acceptance_ratio"]) == 1.0
    assert props["passed"] == "true"
    assert by_name["good"].get("time") == "0.500000"


def test_junit_marks_gate_violations_and_unmeasured_thresholds(hand_report, tmp_path):
    gate = evaluate_gate(hand_report.results, [parse_threshold("acceptance_ratio>=0.95"),
                                               parse_threshold("block_lp_optimum>=1")])
    path = write_junit(hand_report, tmp_path / "sub" / "junit.xml", gate)
    suite = ET.parse(path).getroot().find("testsuite")
    violated = [c for c in suite.findall("testcase") if c.find("failure") is not None
                and c.find("failure").get("type") == "GateViolation"]
    assert [(c.get("classname"), c.get("name")) for c in violated] == [
        ("spectr_audit.good", "seed/K=2"), ("spectr_audit.run.gate", "block_lp_optimum >= 1")]
    assert "acceptance_ratio = 0.904 breaks acceptance_ratio >= 0.95" in violated[0].find("failure").text


# ---------------------------------------------------------------------------------------------
# Figures
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("case,metrics,expected", [
    ("seed/K=2", {}, ("seed", 2, None)),
    ("seq-markov-v2/K=3/L=2", {}, ("seq-markov-v2", 3, 2)),
    ("plain", {}, ("plain", None, None)),
    ("plain", {"num_drafts": 4, "draft_len": 2}, ("plain", 4, 2)),
    ("x/K=2", {"num_drafts": 5}, ("x", 5, None)),
])
def test_case_shape(case, metrics, expected):
    assert case_shape(AuditResult("v", case, metrics=metrics)) == expected


def test_law_with_ci_exact_sampled_and_absent(hand_report):
    exact = law_with_ci(hand_report.results[0])
    assert exact["kind"] == "exact" and exact["low"] == exact["law"] == exact["high"] == [0.3, 0.7]
    sampled = law_with_ci(hand_report.results[5])
    assert sampled["kind"] == "sampled" and sampled["law"] == [0.3, 0.7]
    for lo, phat, hi in zip(sampled["low"], sampled["law"], sampled["high"]):
        assert lo < phat < hi and hi - lo == pytest.approx(2 * 1.96 * (phat * (1 - phat) / 20000) ** 0.5, rel=0.01)
    assert law_with_ci(hand_report.results[1]) is None


def test_figures_are_png_and_degrade_to_none_without_data(hand_report):
    png = law_figure(hand_report.results, "seed")
    assert png[:8] == PNG_MAGIC
    assert law_figure([hand_report.results[1]], "no law") is None
    assert acceptance_figure(hand_report.results[:2], "seed")[:8] == PNG_MAGIC
    assert acceptance_figure([AuditResult("v", "no-k", metrics={"acceptance": 0.5})], "x") is None
    assert block_efficiency_figure(hand_report.results, "seed") is None
    seq = [AuditResult("v", f"s/K=1/L={n}", metrics={"block_efficiency": 1 + 0.6 * n, "block_lp_optimum": 1 + 0.7 * n,
                                                       "block_lp_repair_optimum": 1 + 0.75 * n}) for n in (1, 2, 3)]
    assert block_efficiency_figure(seq, "s")[:8] == PNG_MAGIC


def test_report_figures_group_by_case_family(hand_report):
    figures = report_figures(hand_report)
    kinds = [(f.kind, f.title) for f in figures]
    assert ("acceptance", "seed") in kinds
    # Law figures: one per case carrying a law; the case with findings comes first.
    assert [t for k, t in kinds if k == "law"] == ["seed/K=2", "seed/K=1"]
    assert all(f.png[:8] == PNG_MAGIC for f in figures)


def test_drawing_leaves_pyplot_and_the_backend_alone():
    code = (
        "import sys\n"
        "import spectr_audit.reports.figures as f, spectr_audit.reports.html\n"
        "assert 'matplotlib' not in sys.modules, 'matplotlib imported at module load'\n"
        "from spectr_audit.results import AuditResult\n"
        "r = AuditResult('v', 'c/K=1', metrics={'acceptance': 0.5, 'optimal_acceptance': 0.6})\n"
        "assert f.acceptance_figure([r], 'c')[:4] == b'\\x89PNG'\n"
        "assert 'matplotlib.pyplot' not in sys.modules\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr


# ---------------------------------------------------------------------------------------------
# HTML
# ---------------------------------------------------------------------------------------------


def test_html_is_self_contained_and_escaped(hand_report):
    text = render_html(hand_report)
    assert text.startswith("<!DOCTYPE html>") and text.rstrip().endswith("</html>")
    # Nothing is fetched: every src is a data: URI, every href an in-page anchor.
    for attr, value in re.findall(r'\b(src|href)="([^"]*)"', text):
        assert value.startswith("data:image/png;base64,") if attr == "src" else value.startswith("#"), value
    assert "<link" not in text and "<script" not in text
    assert "bad &lt;script&gt;" in text
    images = re.findall(r'src="data:image/png;base64,([^"]+)"', text)
    assert images and all(base64.b64decode(data)[:8] == PNG_MAGIC for data in images)


def test_html_verdict_findings_and_gate(hand_report):
    gate = evaluate_gate(hand_report.results, [parse_threshold("acceptance_ratio>=0.95")])
    text = render_html(hand_report, gate, figures=False)
    assert '<span class="badge fail">FAIL</span>' in text
    assert "gate <span class=\"badge fail\">failed</span> (1 violations)" in text
    findings = text[text.index('id="findings"'):text.index('id="summary"')]
    assert "bad &lt;script&gt;" in findings and "<code>[1, 0]</code>: 0.250000 vs 0.200000" in findings
    assert "crashy: verify raised IndexError: boom" in findings
    assert "declared inexact" in findings  # the lossy verifier's row says why it does not fail the run
    assert "acceptance_ratio &gt;= 0.95" in findings
    assert "data:image/png" not in text


def test_html_pass_badge_when_every_result_is_as_expected():
    report = AuditReport(results=(_result("good", "c", tv_distance=0.0),), suite="ok")
    assert '<span class="badge pass">PASS</span>' in render_html(report, figures=False)


@pytest.fixture(scope="module")
def real_report():
    from spectr_audit.run.runner import run_suite
    from spectr_audit.run.suite import parse_suite
    from spectr_audit.verifiers.kseq import KSeq, KSeqRule

    class LowRho(KSeq):
        name = "kseq-low-rho"
        rule = KSeqRule(rho_scale=0.9)

    from spectr_audit.registry import load_verifier

    suite = parse_suite({"suite": {"name": "real"}, "case": [
        {"name": "seed", "draft": [0.6, 0.4], "target": [0.3, 0.7], "num_drafts": [1, 2, 3],
         "checks": ["exact", "optimality"]},
        {"name": "seq", "draft": [0.6, 0.4], "target": [0.3, 0.7], "num_drafts": 2, "draft_len": [2, 3],
         "checks": ["exact", "optimality"]},
    ]})
    return run_suite(suite, [load_verifier("kseq"), LowRho(), load_verifier("spectr-tree")])


def test_html_of_a_real_audit_names_the_finding_and_draws_every_kind_of_figure(real_report, tmp_path):
    assert not real_report.passed
    path = write_html(real_report, tmp_path / "report.html")
    text = path.read_text()
    findings = text[text.index('id="findings"'):text.index('id="figures"')]
    assert "kseq-low-rho" in findings and "seed/K=2" in findings and "exact" in findings
    assert "kseq</td>" not in findings
    for heading in ("Acceptance against K", "Block efficiency against L", "Output law against the target"):
        assert heading in text
    assert len(re.findall(r'src="data:image/png;base64,', text)) >= 5


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("chromium") is None, reason="needs chromium (apt-get install -y chromium)")
def test_html_renders_in_headless_chromium(real_report, tmp_path):
    from matplotlib.image import imread

    html_path = write_html(real_report, tmp_path / "report.html")
    shot = tmp_path / "shot.png"
    proc = subprocess.run(["bash", str(ROOT / "scripts" / "render_report.sh"), str(html_path), str(shot), "1280,4000"],
                          capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr
    pixels = imread(shot)
    assert pixels.shape[:2] == (4000, 1280)
    # Tables and figures, not a blank page: many distinct colours, and saturated pixels (the
    # figures' bars and lines; the tables use only greys and pale tints) over a large area.
    rgb = (pixels[..., :3] * 255).round().astype(int)
    assert len({tuple(p) for p in rgb.reshape(-1, 3)[::37]}) > 200
    saturated = (rgb.max(-1) - rgb.min(-1)) > 100
    assert saturated.sum() > 20_000
    assert saturated[:600].sum() < 0.05 * saturated.sum()  # the top: the verdict badge, links and tables


def test_statistical_findings_show_their_worst_cells():
    cells = [{"cell": "0 1", "observed": 1391.0, "expected": 1050.0, "residual": 10.5}]
    result = AuditResult("bb", "seed/K=1", checks=(Check("statistical", False, 1e-50, 2e-4),),
                         metrics={"pvalue": 1e-50, "num_samples": 5000}, details={"worst_cells": cells})
    report = AuditReport(results=(result,), suite="bb")
    assert "<code>0 1</code>: observed 1391.0 vs expected 1050.0" in render_html(report, figures=False)
    failure = ET.fromstring(render_junit(report)).find("testsuite/testcase/failure")
    assert "cell 0 1: observed 1391.0, expected 1050.0" in failure.text


@pytest.fixture
def sampled_report():
    """A budget-cut black box (INCONCLUSIVE), a certified one and an exact-law result, by hand."""
    sampled = dict(tv_estimate=0.012, tv_lower=0.0, tv_upper=0.031, tv_confidence=0.999, min_detectable_tv=0.04,
                   requested_tv=0.005, power_at_requested_tv=0.02, pvalue=0.4, acceptance=0.61,
                   acceptance_ci=[0.58, 0.64], optimal_acceptance=0.7, num_samples=5000)
    short = Check("statistical", True, 0.4, 1e-3, "pearson: min detectable TV 0.04 above the 0.005 planned",
                  inconclusive=True)
    certified = (Check("statistical", True, 0.3, 1e-3, "pearson"),
                 Check("certified-tv", True, 0.018, 0.02, "certified: upper bound 0.018 vs 0.02"))
    return AuditReport(results=(
        AuditResult("box", "seed/K=1", checks=(short,), metrics={**sampled, "num_drafts": 1}),
        AuditResult("box", "seed/K=2", checks=certified, metrics={**sampled, "num_drafts": 2, "tv_upper": 0.018,
                                                                    "acceptance": 0.66, "acceptance_ci": [0.65, 0.67]}),
        AuditResult("kseq", "seed/K=2", checks=(Check("exact", True, 0.0, 1e-12),),
                    metrics={"tv_distance": 1e-17, "acceptance": 0.69, "optimal_acceptance": 0.7, "num_drafts": 2}),
    ), suite="sampled")


def test_inconclusive_and_certified_verdicts_in_every_report(sampled_report):
    from spectr_audit.reports.markdown import render_markdown

    inconclusive, certified, exact = sampled_report.results
    assert (inconclusive.verdict, certified.verdict, exact.verdict) == ("INCONCLUSIVE", "CERTIFIED", "exact")
    assert sampled_report.passed and sampled_report.exit_status() == 0 and sampled_report.exit_status(True) == 3
    text = render_markdown(sampled_report)
    assert ("**Overall: INCONCLUSIVE** (3 results: 2 passed, 0 findings not as expected, 0 errors, 1 inconclusive)"
            in text)
    assert "| box | seed/K=1 | INCONCLUSIVE | >= 0.0000 (est. 0.0120, <= 0.0310) |" in text
    assert "| box | seed/K=2 | CERTIFIED |" in text and "0.6100 [0.5800, 0.6400]" in text
    assert "## Inconclusive" in text and "above the 0.005 planned" in text
    page = render_html(sampled_report, figures=False)
    assert '<span class="badge warn">INCONCLUSIVE</span>' in page and 'id="inconclusive"' in page
    assert "&ge; 0.0000 (0.0120, &le; 0.0310)" in page and ">CERTIFIED<" in page
    suite = ET.fromstring(render_junit(sampled_report)).find("testsuite")
    assert suite.get("skipped") == "1" and suite.get("failures") == "0"
    cases = {c.get("name") + c.get("classname"): c for c in suite.findall("testcase")}
    skipped = cases["seed/K=1spectr_audit.box"].find("skipped")
    assert skipped is not None and skipped.get("message").startswith("INCONCLUSIVE: ")
    verdicts = {c.get("name") + c.get("classname"): c.find("properties/property[@name='verdict']").get("value")
                for c in suite.findall("testcase")}
    assert verdicts == {"seed/K=1spectr_audit.box": "INCONCLUSIVE", "seed/K=2spectr_audit.box": "CERTIFIED",
                        "seed/K=2spectr_audit.kseq": "exact"}
    # JSON keeps the verdict, and a result read back is the same
    assert AuditResult.from_dict(inconclusive.to_dict()) == inconclusive


def test_acceptance_figures_draw_error_bars_for_sampled_acceptance(sampled_report, monkeypatch):
    from matplotlib.axes import Axes

    calls = []
    original = Axes.errorbar

    def record(self, x, y, *args, **kwargs):
        calls.append((list(x), list(y), kwargs.get("yerr")))
        return original(self, x, y, *args, **kwargs)

    monkeypatch.setattr(Axes, "errorbar", record)
    png = acceptance_figure(sampled_report.results, "seed")
    assert png.startswith(PNG_MAGIC)
    # the sampled points (K = 1, 2), with their intervals; the exact-law point has none
    (xs, ys, yerr), = calls
    assert xs == [1, 2] and ys == [0.61, 0.66]
    assert yerr[0] == pytest.approx([0.03, 0.01]) and yerr[1] == pytest.approx([0.03, 0.01])
