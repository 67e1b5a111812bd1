"""The words of reports and checks follow what was measured.

Every check's detail is printed beside its verdict (the CLI, the findings tables, the pytest
plugin's failure messages), so it must say the outcome: a check that failed never reads "not
rejected" or "within the tolerance", one that passed never reads "REJECTED".  Real audits of
exact, broken and black-box verifiers (exact laws by enumeration; statistical audits with fixed
seeds at alpha = 1e-3, where the broken black box is far beyond the minimum detectable TV) give
checks of every kind with both outcomes; the gate's message, the figures' labels, legends and
captions, and the HTML layout at a 1280 px window are checked against their outcomes too (the
layout in headless chromium: slow, skipped where chromium is not installed).
"""

from __future__ import annotations

import re
import shutil
import subprocess

import pytest

from spectr_audit.contract.verifier import FunctionVerifier
from spectr_audit.registry import load_verifier
from spectr_audit.reports.figures import (
    acceptance_caption,
    acceptance_figure,
    deviation_points,
    law_caption,
    law_figure,
    real_lm_figures,
)
from spectr_audit.reports.html import render_html
from spectr_audit.results import AuditReport, AuditResult, Check
from spectr_audit.run.gate import evaluate_gate, parse_threshold
from spectr_audit.run.runner import AuditOptions, audit_case
from spectr_audit.run.suite import parse_suite

#: Words that say a check held, and words that say it failed (each detail in runner.py says one side).
HELD = ("not rejected", "within the tolerance", "<= alpha*", "kept", "reaches the", "certified:", "<= the block LP",
        "<= the best", "leave their inputs", "agree")
FAILED = ("REJECTED", "above the tolerance", "above alpha*", "broken", "below the optimal", "refuted:",
          "above the block LP", "above the best", "does not follow", "in place", "returned different")


def _cases():
    return {c.name: c for c in parse_suite({"suite": {"name": "texts"}, "case": [
        {"name": "token", "draft": [0.6, 0.4], "target": [0.3, 0.7], "num_drafts": 2},
        {"name": "token-k1", "draft": {"dirichlet": {"vocab_size": 4, "seed": 11}},
         "target": {"dirichlet": {"vocab_size": 4, "seed": 12}}, "num_drafts": 1},
        {"name": "sequence", "draft": {"dirichlet": {"vocab_size": 3, "seed": 51}},
         "target": {"dirichlet": {"vocab_size": 3, "seed": 52}}, "num_drafts": 1, "draft_len": 2},
    ]}).cases}


def _black_box(name: str, inner: str):
    """``inner``'s verify without its exact law: audited from samples."""
    verifier = load_verifier(inner)
    return FunctionVerifier(lambda *args: verifier.verify(*args), name=name, max_drafts=verifier.max_drafts,
                            max_draft_len=verifier.max_draft_len)


@pytest.fixture(scope="module")
def audited() -> list:
    """Results whose checks, together, pass and fail every kind of check the runner makes."""
    cases = _cases()
    runs = [
        ("kseq", "token", AuditOptions()),
        ("broken:kseq-low-rho", "token", AuditOptions()),
        ("broken:inflated-ratio", "token-k1", AuditOptions()),
        ("broken:bonus-from-draft", "sequence", AuditOptions()),
        ("block", "sequence", AuditOptions()),
        ("greedy-block", "sequence", AuditOptions()),
        ("greedy-block-repaired", "sequence", AuditOptions()),
        ("rrs", "token", AuditOptions(certify_tv=0.01)),
        ("broken:kseq-low-rho", "token", AuditOptions(certify_tv=1e-6)),
    ]
    results = [audit_case(load_verifier(name), cases[case], options) for name, case, options in runs]
    # black boxes: a good one planned for TV 0.3 (few samples, full power), one cut short by a
    # budget (INCONCLUSIVE), and a broken one (always accepts: far beyond the detectable TV)
    good, bad = _black_box("good-box", "speculative"), _black_box("bad-box", "broken:always-accept")
    results.append(audit_case(good, cases["token-k1"], AuditOptions(min_detectable_tv=0.3)))
    results.append(audit_case(good, cases["token-k1"], AuditOptions(max_samples=300)))
    results.append(audit_case(bad, cases["token-k1"], AuditOptions(max_samples=4000)))
    return results


def _checks(results, name=None):
    return [c for r in results for c in r.checks if name is None or c.name == name]


def test_the_panel_has_every_outcome(audited):
    """The panel is able to catch a fixed text: it holds passed and failed checks of the main kinds."""
    kinds = {(c.name, c.passed, c.inconclusive) for c in _checks(audited)}
    for needed in [("exact", True, False), ("exact", False, False), ("prefix-cap", False, False),
                   ("acceptance<=optimal", True, False), ("acceptance<=optimal", False, False),
                   ("statistical", True, False), ("statistical", True, True), ("statistical", False, False),
                   ("certified-tv", True, False), ("certified-tv", False, False),
                   ("exact-multi-iteration", True, False)]:
        assert needed in kinds, needed


def test_every_check_detail_says_its_own_outcome(audited):
    for result in audited:
        for check in result.checks:
            if check.name == "ran":
                continue
            words = HELD if check.passed else FAILED
            contrary = FAILED if check.passed else HELD
            where = f"{result.verifier} on {result.case}: {check.name} (passed={check.passed}): {check.detail}"
            assert any(w in check.detail for w in words), where
            assert not any(w in check.detail for w in contrary), where


def test_statistical_detail_names_the_outcome_and_the_numbers(audited):
    for check in _checks(audited, "statistical"):
        if not check.passed:
            assert "exactness REJECTED" in check.detail and f"<= alpha = {check.threshold:g}" in check.detail
        elif check.inconclusive:
            assert check.detail.split(": ", 2)[1] == "INCONCLUSIVE"
            assert "above the 0.005 planned" in check.detail
        else:
            assert "exactness not rejected" in check.detail and "INCONCLUSIVE" not in check.detail
        assert re.search(r"\d+ samples, stopped: ", check.detail)


def test_declared_verdicts_of_the_panel_are_as_declared(audited):
    # the broken verifiers' declarations ("inexact") hold: a FINDING of theirs is as declared
    for result in audited:
        if result.expected is False:
            assert not result.passed and result.as_expected, result.verifier


# ---------------------------------------------------------------------------------------------
# The gate
# ---------------------------------------------------------------------------------------------


def test_a_gate_that_measured_nothing_says_so():
    declared = AuditResult("lossy", "c", (Check("exact", False, 0.1, 1e-12),), metrics={"tv_distance": 0.1},
                           expected=False)
    outcome = evaluate_gate([declared], [parse_threshold("tv_distance<=1e-9")])
    assert not outcome.passed
    message = outcome.message()
    assert "nothing was measured" in message and "0 violation" not in message
    assert "lossy on c: declared inexact" in message


def test_a_threshold_no_result_measured_is_named():
    exact = AuditResult("kseq", "c", (Check("exact", True, 0.0, 1e-12),), metrics={"tv_distance": 0.0})
    message = evaluate_gate([exact], [parse_threshold("pvalue>=0.01")]).message()
    assert message.startswith("gate failed: nothing was measured for pvalue >= 0.01")
    assert "0 violation" not in message


def test_a_gate_with_violations_counts_them():
    bad = AuditResult("kseq", "c", metrics={"tv_distance": 0.2})
    message = evaluate_gate([bad], [parse_threshold("tv_distance<=1e-9")]).message()
    assert message.startswith("gate failed: 1 violation(s)") and "nothing was measured" not in message


# ---------------------------------------------------------------------------------------------
# Figures: what the legends, labels and captions say is what is drawn
# ---------------------------------------------------------------------------------------------


def _marked(line) -> bool:
    return line.get_marker() not in (None, "None", "", " ")


def _visible(artist) -> bool:
    """Whether a legend entry's artist shows on the axes: a marker, a line through two distinct points, a
    horizontal line across the axes, or a style proxy (no data) whose marker some drawn point has."""
    if hasattr(artist, "get_xdata"):
        xs = list(artist.get_xdata())
        if not xs:  # a proxy: the style of points drawn without labels
            return any(_marked(line) and line.get_marker() == artist.get_marker() and len(line.get_xdata())
                       for line in artist.axes.get_lines())
        return (_marked(artist) or len(set(xs)) > 1
                or artist.get_transform() is not artist.axes.transData)  # axhline: spans the axes
    return True  # containers (error bars) and patches


def _legend_entries(fig):
    legends = list(fig.legends) + [ax.get_legend() for ax in fig.axes if ax.get_legend() is not None]
    return [text.get_text() for legend in legends for text in legend.get_texts()]


def _drawn_labels(fig):
    """Labels of the artists that are visible on the figure's axes."""
    labels = []
    for ax in fig.axes:
        handles, names = ax.get_legend_handles_labels()
        labels += [name for handle, name in zip(handles, names) if _visible(handle)]
    return labels


def _acceptance_result(verifier, k, acceptance, optimum, ci=None, **extra):
    metrics = {"num_drafts": k, "draft_len": 1, "acceptance": acceptance, "optimal_acceptance": optimum,
               "spectr_bound": (1 - (1 - 1 / k) ** k) * optimum, **extra}
    if ci is not None:
        metrics["acceptance_ci"] = list(ci)
    return AuditResult(verifier, f"seed/K={k}/L=1", (Check("exact", True, 0.0, 1e-12),), metrics=metrics)


@pytest.mark.parametrize("ks", [(2,), (1,), (1, 2, 3)])
def test_acceptance_figure_legend_names_only_what_is_drawn(ks):
    results = [_acceptance_result(name, k, 0.5 + 0.05 * k, 0.6 + 0.05 * k)
               for name in ("kseq", "rrs") for k in ks]
    fig = acceptance_figure(results, "seed", png=False)
    entries = _legend_entries(fig)
    assert entries and sorted(entries) == sorted(set(_drawn_labels(fig))), (entries, _drawn_labels(fig))
    assert sum(e.startswith("alpha*") for e in entries) == 1
    # SpecTr's bound is a line of its own only where it differs from alpha* (K >= 2)
    assert any("SpecTr" in e and "guarantee" in e for e in entries) == any(k > 1 for k in ks)
    if len(ks) == 1:  # one K: the verifiers side by side at that K, not one dot on a K axis
        (ax,) = fig.axes
        assert [t.get_text() for t in ax.get_xticklabels()] == ["kseq", "rrs"]
        assert f"K = {ks[0]}" in ax.get_title()


@pytest.mark.parametrize("ks, sampled_label", [((2,), "acceptance sampled, 95% interval"),
                                                ((1, 2), "box (sampled, 95% CI)")])
def test_a_sampled_acceptance_above_alpha_star_is_drawn_with_its_interval_and_a_true_caption(ks, sampled_label):
    # the plugin's black-box line: acc/alpha* 1.01, sampled (at the last K)
    exact = [_acceptance_result("kseq", k, 0.90 - 0.1 * (2 - k), 0.94 - 0.1 * (2 - k)) for k in ks]
    sampled = _acceptance_result("box", 2, 0.9494, 0.94, ci=(0.938, 0.961))
    fig = acceptance_figure([*exact, sampled], "seed", png=False)
    (ax,) = fig.axes
    # error bars with data (the legend's style proxy has none)
    bars = [c for c in ax.containers if c.has_yerr and len(c.lines[2][0].get_segments())]
    assert len(bars) == 1
    (low, high) = sorted(bars[0].lines[2][0].get_segments()[0][:, 1])
    assert (low, high) == pytest.approx((0.938, 0.961))
    assert sampled_label in _legend_entries(fig)
    caption = acceptance_caption([*exact, sampled])
    assert "sampling error" in caption and "95% interval" in caption
    assert "no exact verifier can lie above" not in caption
    assert "sampling" not in acceptance_caption(exact)  # nothing sampled: nothing said of samples


def test_real_lm_acceptance_caption_allows_for_sampling_error():
    rows = [{"num_drafts": k, "optimal": 0.5, "kseq_measured": 0.53, "kseq_measured_half_width": 0.04,
             "rrs_measured": 0.49, "rrs_measured_half_width": 0.03} for k in (1, 2)]
    (figure,) = real_lm_figures({"acceptance": rows})
    assert "sampling error" in figure.caption and "no exact verifier can lie above" not in figure.caption


def _law_results():
    """One case of L = 1: an exact verifier, a broken one whose finding lies in 2-token strings."""
    first = [0.3, 0.7]
    good = AuditResult("kseq", "seed/K=2/L=1", (Check("exact", True, 0.0, 1e-12),),
                       details={"first_token_law": first, "target_first_token_law": first,
                                "worst_strings": [{"string": [0, 1], "implied": 0.21, "target": 0.21}]})
    worst = [{"string": [1, 0], "implied": 0.25, "target": 0.2}, {"string": [0, 0], "implied": 0.1, "target": 0.12}]
    bad = AuditResult("broken", "seed/K=2/L=1", (Check("exact", False, 0.05, 1e-12),), expected=False,
                      details={"first_token_law": first, "target_first_token_law": first, "worst_strings": worst})
    return good, bad


def test_law_figure_labels_the_method_and_the_verdict_and_shows_the_worst_strings():
    good, bad = _law_results()
    fig = law_figure([good, bad], "seed", png=False)
    entries = _legend_entries(fig)
    assert not any(e.endswith("(exact)") for e in entries)  # "exact" alone reads as a verdict
    assert "kseq: its law, computed exactly [exact]" in entries
    assert "broken: its law, computed exactly [FINDING]" in entries
    assert "target law q" in entries
    ax_law, ax_dev = fig.axes
    assert "first token only" in ax_law.get_title()
    # the first token's law is the target's for both: the finding shows on the right, where the strings are
    strings = [t.get_text() for t in ax_dev.get_yticklabels()]
    assert strings == ["1 0", "0 0"]  # largest |F(w) - q(w)| first, only the verifier with a finding
    (points,) = [line for line in ax_dev.get_lines() if line.get_marker() == "o"]
    assert sorted(points.get_xdata()) == pytest.approx(sorted([0.05, -0.02]))


def test_law_figure_of_a_statistical_finding_shows_its_cells_with_intervals():
    cells = [{"cell": "1 1", "observed": 600.0, "expected": 490.0}, {"cell": "0 0", "observed": 60.0, "expected": 90.0}]
    box = AuditResult("box", "seed/K=1/L=1", (Check("statistical", False, 1e-30, 1e-3),),
                      details={"worst_cells": cells, "worst_cells_num_samples": 1000})
    points = deviation_points(box)
    assert [p["string"] for p in points] == ["1 1", "0 0"]
    assert points[0]["deviation"] == pytest.approx(0.11) and points[0]["low"] < 0.11 < points[0]["high"]
    fig = law_figure([box], "seed", png=False)
    assert any("box: observed - target (sampled, 95% CI)" == e for e in _legend_entries(fig))
    assert law_caption([box]) == "findings: box"


def test_law_caption_says_declared_and_never_every_verifier_exact_of_an_inconclusive_case():
    good, bad = _law_results()
    assert law_caption([good, bad]) == "findings: broken (declared inexact)"
    short = AuditResult("box", "c", (Check("statistical", True, 0.5, 1e-3, inconclusive=True),))
    caption = law_caption([good, short])
    assert caption.startswith("no finding") and "INCONCLUSIVE" in caption and "box" in caption


# ---------------------------------------------------------------------------------------------
# HTML: the findings table fits a 1280 px window; sampled ratios carry their interval
# ---------------------------------------------------------------------------------------------


def _findings_report() -> AuditReport:
    worst = [{"string": [1, 2, 0], "implied": 0.066936, "target": 0.047232}] * 5
    long_detail = ("max |F(w) - q(w)| over strings of length L + 1 above the tolerance: the implied law is not the "
                   "target's (single iteration, unmodified continuation; the worst strings are listed)")
    results = tuple(
        AuditResult(f"verifier-with-a-long-name-{i}", f"family/with/a/long/case-name/K={i}/L=2",
                    (Check("exact", False, 0.0197, 1e-12, long_detail), Check("prefix-cap", False, 0.0085, 1e-12,
                                                                              long_detail)),
                    metrics={"tv_distance": 0.1, "acceptance": 0.5}, expected=False, details={"worst_strings": worst})
        for i in range(1, 4))
    return AuditReport(results=results, suite="wide")


def test_findings_table_wraps_inside_a_scroll_container_and_shows_what_each_check_found():
    text = render_html(_findings_report(), figures=False)
    assert '<div class="scroll"><table class="findings">' in text
    assert re.search(r"table\.findings td\.text, table\.findings th \{ white-space: normal; \}", text)
    assert "the implied law is not the target&#x27;s" in text  # the check's detail, not only its name


def test_html_smallest_ratio_of_a_sampled_acceptance_carries_its_interval():
    sampled = AuditResult("box", "c/K=2", (Check("statistical", True, 0.5, 1e-3),),
                          metrics={"acceptance": 0.9494, "acceptance_ci": [0.938, 0.961], "optimal_acceptance": 0.94,
                                   "acceptance_ratio": 0.9494 / 0.94})
    text = render_html(AuditReport(results=(sampled,)), figures=False)
    assert "1.0100 [0.9979, 1.0223]" in text


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("chromium") is None, reason="needs headless chromium")
def test_findings_table_fits_a_1280px_window_in_chromium(tmp_path):
    """Rendered by a browser at 1280 px: the findings table's right edge is inside the window."""
    probe = ('<script>window.addEventListener("load", () => { const t = document.querySelector("table.findings");'
             ' const box = t.getBoundingClientRect(); document.body.setAttribute("data-fit", '
             'String(box.right <= document.documentElement.clientWidth)); });</script></body>')
    page = tmp_path / "report.html"
    page.write_text(render_html(_findings_report(), figures=False).replace("</body>", probe))
    dom = subprocess.run(["chromium", "--headless", "--no-sandbox", "--disable-gpu", "--window-size=1280,2000",
                          "--virtual-time-budget=2000", "--dump-dom", page.as_uri()],
                         capture_output=True, text=True, timeout=120).stdout
    assert 'data-fit="true"' in dom


def test_html_verifier_table_does_not_count_an_inconclusive_result_as_exact():
    short = AuditResult("box", "c/K=1", (Check("statistical", True, 0.5, 1e-3, "INCONCLUSIVE: ...", inconclusive=True),))
    held = AuditResult("box", "c/K=2", (Check("statistical", True, 0.5, 1e-3, "exactness not rejected: ..."),))
    text = render_html(AuditReport(results=(short, held)), figures=False)
    table = text[text.index('<table class="verifiers">'):].split("</table>", 1)[0]
    head = re.findall(r"<th[^>]*>([^<]+)</th>", table)
    row = re.findall(r"<td[^>]*>([^<]*)</td>", table.split("<tbody>", 1)[1])
    counts = dict(zip(head, row))
    assert (counts["cases"], counts["passed"], counts["inconclusive"], counts["findings"]) == ("2", "1", "1", "0")


def test_a_sampled_pass_is_labelled_sampled_not_exact():
    from spectr_audit.reports.markdown import render_markdown

    sampled = AuditResult("box", "c/K=1", (Check("statistical", True, 0.5, 1e-3, "exactness not rejected"),))
    exact = AuditResult("kseq", "c/K=1", (Check("exact", True, 0.0, 1e-12),))
    assert sampled.verdict == "exact" and sampled.verdict_label == "PASS (sampled)" and sampled.to_dict()["sampled"]
    assert exact.verdict_label == "exact" and "sampled" not in exact.to_dict()
    report = AuditReport(results=(sampled, exact))
    page = render_html(report, figures=False)
    table = page[page.index('<table class="results">'):]
    assert re.search(r">box</td><td class=\"text\">c/K=1</td><td class=\"text\">PASS \(sampled\)</td>", table)
    assert re.search(r">kseq</td><td class=\"text\">c/K=1</td><td class=\"text\">exact</td>", table)
    text = render_markdown(report)
    assert "| box | c/K=1 | PASS (sampled) |" in text and "| kseq | c/K=1 | exact |" in text


def test_acceptance_against_k_is_drawn_only_where_there_is_something_to_compare():
    from spectr_audit.reports.figures import report_figures

    def result(verifier, case, k):
        return AuditResult(verifier, case, (Check("exact", True, 0.0, 1e-12),),
                           {"num_drafts": k, "draft_len": 1, "acceptance": 0.6, "optimal_acceptance": 0.7})

    one_k = AuditReport(results=(result("mine", "a/K=1", 1), result("mine", "b/K=1", 1)))
    assert [f for f in report_figures(one_k) if f.kind == "acceptance"] == []
    several_k = AuditReport(results=(result("mine", "a/K=1", 1), result("mine", "a/K=2", 2)))
    assert [f.title for f in report_figures(several_k) if f.kind == "acceptance"] == ["a, L=1"]
    side_by_side = AuditReport(results=(result("mine", "a/K=1", 1), result("kseq", "a/K=1", 1)))
    assert len([f for f in report_figures(side_by_side) if f.kind == "acceptance"]) == 1
