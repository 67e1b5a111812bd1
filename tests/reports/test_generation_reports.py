"""The generation audit's reports (spectr_audit.reports.generation): JSON, Markdown, HTML, JUnit, writing.

Every result comes from actually running the audit on the toy library (a few hundred tokens each,
well under a second): a correct engine (INCONCLUSIVE at the default requested TV, PASS at a lax
one), the shared-stream slip (FINDING, one-sample), a greedy slip with a logits scorer against
its reference (divergences reported as near-ties under a wide tolerance, a FINDING under the
default one), an engine and reference sampling at another temperature than the scorer (decided
two-sample: the numerics floor), an end-of-sequence slip (after-eos listed) and a generator whose
every call breaks the contract (ERROR).
"""

from __future__ import annotations

import base64
import json
import os
import re
import subprocess
import sys
import xml.etree.ElementTree as ET

import pytest

from spectr_audit.contract.sampling import SamplingParams
from spectr_audit.errors import InvalidArgument
from spectr_audit.generation import audit_generation
from spectr_audit.generation.library import ToyPair, correct_engine, slip_engine
from spectr_audit.reports.figures import generation_figures, outside_band
from spectr_audit.reports.generation import (
    generation_json,
    render_generation_html,
    render_generation_junit,
    render_generation_markdown,
    write_generation_report,
)

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
PROMPTS = [[1, 2, 3], [4, 5], [6], [7, 8]]
V = 16


def _broken(prompts, max_new_tokens, seed):
    return [[99] for _ in prompts]  # not a token id: every call breaks the contract


@pytest.fixture(scope="module")
def results():
    pair = ToyPair(V, seed=0)
    greedy = ToyPair(V, seed=0, params=SamplingParams(temperature=0.0))
    hot = ToyPair(V, seed=0, params=SamplingParams(temperature=0.7))
    eos = ToyPair(V, seed=0, eos_token_id=3)
    common = dict(vocab_size=V, progress=False)
    out = {
        "inconclusive": audit_generation(correct_engine(pair), pair.scorer(), PROMPTS, max_new_tokens=16, **common),
        "pass": audit_generation(correct_engine(pair), pair.scorer(), PROMPTS, max_new_tokens=16,
                                 min_detectable_tv=0.5, **common),
        "finding": audit_generation(slip_engine("shared-stream", pair), pair.scorer(), PROMPTS, max_new_tokens=16,
                                    **common),
        "greedy-numerics": audit_generation(slip_engine("positions-by-block", greedy), greedy.logits_scorer(),
                                            PROMPTS[:2], max_new_tokens=12, reference=greedy.reference(),
                                            logit_tol=100.0, **common),
        "greedy-finding": audit_generation(slip_engine("positions-by-block", greedy), greedy.logits_scorer(),
                                           PROMPTS[:2], max_new_tokens=12, reference=greedy.reference(), **common),
        "two-sample": audit_generation(correct_engine(hot), pair.scorer(), PROMPTS[:2], max_new_tokens=16,
                                       reference=hot.reference(), **common),
        "eos": audit_generation(slip_engine("eos-inside-block", eos), eos.scorer(), PROMPTS[:2], max_new_tokens=16,
                                eos_token_id=3, **common),
        "error": audit_generation(_broken, pair.scorer(), [[1, 2]], max_new_tokens=4, **common),
    }
    # what each case is there for
    assert out["inconclusive"].verdict == "INCONCLUSIVE" and out["pass"].verdict == "PASS"
    assert out["finding"].verdict == "FINDING" and out["finding"].decided_by == "one-sample"
    assert out["greedy-numerics"].verdict == "PASS" and out["greedy-numerics"].decided_by == "greedy"
    assert out["greedy-numerics"].divergences and all(d.numerics for d in out["greedy-numerics"].divergences)
    assert out["greedy-finding"].verdict == "FINDING"
    assert any(not d.numerics for d in out["greedy-finding"].divergences)
    assert out["two-sample"].decided_by == "two-sample" and out["two-sample"].numerics_floor
    assert out["eos"].verdict == "FINDING" and out["eos"].after_eos
    assert out["error"].verdict == "ERROR"
    return out


def _verdict_line(markdown: str) -> str:
    """The paragraph right after the bold verdict."""
    paragraphs = markdown.split("\n\n")
    index = next(i for i, p in enumerate(paragraphs) if p.startswith("**Verdict:"))
    return paragraphs[index + 1]


def _p(value: float) -> str:
    return f"{value:.2e}" if 0 < value < 1e-3 else f"{value:.3f}"


# ---------------------------------------------------------------------------------------------
# JSON
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["inconclusive", "finding", "greedy-numerics", "two-sample", "eos", "error"])
def test_json_is_a_versioned_contract_that_round_trips(results, name):
    result = results[name]
    report = generation_json(result)
    assert report["kind"] == "generation-audit" and report["schema_version"] == 1
    text = json.dumps(report, allow_nan=False)  # strict JSON: no NaN, no infinity
    loaded = json.loads(text)
    assert loaded["spectr_audit_version"]
    body = {k: v for k, v in loaded.items() if k not in ("kind", "schema_version", "spectr_audit_version")}
    assert body == json.loads(json.dumps(result.to_dict(), allow_nan=False))
    assert loaded["verdict"] == result.verdict and loaded["test"] == result.test
    # a report.json read back is a valid input: the same contract, the same texts
    assert generation_json(loaded) == loaded
    assert generation_json(result.to_dict()) == loaded
    assert render_generation_markdown(loaded) == render_generation_markdown(result)
    assert render_generation_junit(loaded) == render_generation_junit(result)


def test_json_refuses_another_kind_or_version(results):
    report = generation_json(results["inconclusive"])
    with pytest.raises(InvalidArgument, match="schema version"):
        generation_json({**report, "schema_version": 2})
    with pytest.raises(InvalidArgument, match="generation-audit"):
        render_generation_markdown({**report, "kind": "audit-report"})
    with pytest.raises(InvalidArgument, match="GenerationAuditResult"):
        generation_json([1, 2])


# ---------------------------------------------------------------------------------------------
# Markdown and HTML: the verdict and what it rests on
# ---------------------------------------------------------------------------------------------


def test_finding_verdict_line_names_the_test_p_alpha_tokens_and_mode(results):
    result = results["finding"]
    line = _verdict_line(render_generation_markdown(result))
    assert line.startswith("FINDING: the deciding test")
    assert f"`{result.test}`" in line and result.test == "independence / within a batch"
    assert f"Holm-adjusted p = {_p(result.pvalue)}" in line and f"alpha {result.alpha:g}" in line
    assert f"{result.num_tokens} tokens scored" in line and "decided one-sample" in line
    assert "passed" not in line.lower() and "PASS" not in line


def test_inconclusive_says_the_detectable_tv_reached_and_requested(results):
    result = results["inconclusive"]
    line = _verdict_line(render_generation_markdown(result))
    assert line.startswith("INCONCLUSIVE: nothing was rejected")
    assert f"{result.min_detectable_tv:.3f}" in line and f"the {result.requested_tv:.3f} requested" in line
    assert "this is not a PASS" in line
    assert f"`{result.test}`" in line and _p(result.pvalue) in line and f"alpha {result.alpha:g}" in line
    assert f"of {result.num_tokens} tokens scored" in line and "decided one-sample" in line


def test_pass_states_the_power_reached_within_the_requested(results):
    result = results["pass"]
    line = _verdict_line(render_generation_markdown(result))
    assert line.startswith("PASS: nothing was rejected")
    assert f"{result.min_detectable_tv:.3f}" in line and f"within the {result.requested_tv:.3f} requested" in line


def test_markdown_strata_table_lists_every_stratum_row(results):
    result = results["inconclusive"]
    text = render_generation_markdown(result)
    assert "| stratum | order | tokens | p | adjusted p | min detectable TV | outside 99% band | outcome |" in text
    for row in result.strata:
        cells = (f"| {row.stratum} | {row.ordering} | {row.num_tokens} | {_p(row.pvalue)} | "
                 f"{_p(row.pvalue_adjusted)} | {row.min_detectable_tv:.3f} | ")
        assert cells in text, cells
    # every test of the family is in the tests table, with its outcome in words
    for test in result.subtests:
        assert f"| {test.name} | " in text
    assert "not rejected (adjusted p" in text


def test_checks_text_follows_their_outcome(results):
    finding = render_generation_markdown(results["greedy-finding"])
    support = next(line for line in finding.splitlines() if line.startswith("| support |"))
    assert "FINDING:" in support and "held" not in support
    held = render_generation_markdown(results["inconclusive"])
    support = next(line for line in held.splitlines() if line.startswith("| support |"))
    assert "held: no emitted token of zero target mass" in support and "FINDING" not in support
    for name in ("finding", "greedy-finding", "eos", "error"):
        assert "passed" not in render_generation_markdown(results[name]).lower()


def test_greedy_divergences_side_by_side_with_margins_and_labels(results):
    result = results["greedy-numerics"]
    text = render_generation_markdown(result)
    assert "## Greedy divergences" in text and "decided greedy" in _verdict_line(text)
    for d in result.divergences:
        row = (f"| {d.arm} | {d.job} | {d.row} | {d.prompt} | {d.position} | {d.engine_token} | {d.reference_token} | "
               f"{d.margin:.4g} | numerics (near-tie) | `{' '.join(map(str, d.engine_tail))}` | "
               f"`{' '.join(map(str, d.reference_tail))}` |")
        assert row in text, row
    page = render_generation_html(result, figures=False)
    assert page.count("numerics (near-tie)") >= len(result.divergences)
    assert page.count('<table class="tails">') == len(result.divergences)
    assert 'class="differs"' in page  # the tokens where the two continuations differ are marked
    finding = render_generation_markdown(results["greedy-finding"])
    assert "divergence (finding)" in finding and "violation (finding)" in finding  # and the zero-mass tokens


def test_numerics_floor_section_states_the_reference_bound_and_tolerance(results):
    result = results["two-sample"]
    text = render_generation_markdown(result)
    assert "decided two-sample" in _verdict_line(text) and "numerics floor" in _verdict_line(text)
    floor = text.split("## Numerics floor", 1)[1].split("\n## ", 1)[0]
    best = max(result.numerics_floor, key=lambda h: h.lower)
    assert f">= {best.lower:.3f}" in floor and f"confidence {best.confidence:g}" in floor
    assert f"Logit tolerance: {result.logit_tolerance:g} logits" in floor
    assert "reference's own one-sample tests rejected" in floor
    assert "reference lower bound (numerics floor)" in text  # beside the engine's in the held-out table
    page = render_generation_html(result, figures=False)
    assert 'id="numerics-floor"' in page and f"Logit tolerance: {result.logit_tolerance:g} logits" in page
    # without a reference there is no floor to state
    assert "## Numerics floor" not in render_generation_markdown(results["finding"])


def test_zero_mass_and_after_eos_are_listed(results):
    eos = results["eos"]
    text = render_generation_markdown(eos)
    assert "`end-of-sequence`" in _verdict_line(text) and "p = 0 (decisive)" in _verdict_line(text)
    for row in eos.after_eos:
        assert f"| {row['job']} | {row['row']} | {row['position']} |" in text
    assert "Not checked: the audit was given no end-of-sequence token." in render_generation_markdown(
        results["finding"])
    greedy = results["greedy-finding"]
    text = render_generation_markdown(greedy)
    for z in greedy.zero_mass:
        assert f"| {z.arm} | {z.job} | {z.row} | {z.prompt} | {z.position} | {z.token} | {z.margin:.4g} |" in text
    assert "None: every emitted token has positive mass" in render_generation_markdown(results["inconclusive"])


def test_html_has_verdict_tests_strata_and_embedded_figures(results):
    result = results["two-sample"]
    page = render_generation_html(result, figures=True)
    assert page.startswith("<!DOCTYPE html>") and page.rstrip().endswith("</body></html>")
    assert f'id="verdict">{result.verdict}</span>' in page
    verdict_line = re.search(r'<p id="verdict-line">(.*?)</p>', page).group(1)
    assert f"“{result.test}”" in verdict_line and _p(result.pvalue) in verdict_line
    assert "decided two-sample" in verdict_line and f"{result.min_detectable_tv:.3f}" in verdict_line
    assert 'id="strata"' in page and "<th>min detectable TV</th>" in page
    for row in result.strata:
        assert f'<td class="text">{row.stratum}</td><td class="text">{row.ordering}</td><td>{row.num_tokens}</td>' \
               in page
    images = re.findall(r'src="data:image/png;base64,([A-Za-z0-9+/=]+)"', page)
    orders = {row.ordering for row in result.strata}
    assert len(images) == len(orders) + 1  # the PIT histograms per order and the held-out TV chart
    assert all(base64.b64decode(data).startswith(PNG_MAGIC) for data in images)
    assert "http://" not in page and "https://" not in page  # self-contained
    bare = render_generation_html(result, figures=False)
    assert "data:image/png" not in bare and 'id="strata"' in bare


def test_figures_draw_bands_per_stratum(results):
    result = results["two-sample"]
    figures = generation_figures(result)
    kinds = [f.kind for f in figures]
    assert kinds.count("pit") == len({row.ordering for row in result.strata}) and kinds[-1] == "held-out-tv"
    assert all(f.png.startswith(PNG_MAGIC) for f in figures)
    assert "99%" in figures[0].caption and "Binomial(n, 1/bins)" in figures[0].caption
    assert f"{len(result.strata) // 2} strata" in figures[0].caption
    assert "numerics floor" in figures[-1].caption
    for row in result.to_dict()["strata"]:
        low, high = row["band"]
        assert outside_band(row) == sum(c < low or c > high for c in row["histogram"])


# ---------------------------------------------------------------------------------------------
# JUnit
# ---------------------------------------------------------------------------------------------


def _suite(result):
    root = ET.fromstring(render_generation_junit(result))
    (suite,) = root.findall("testsuite")
    cases = {case.get("name"): case for case in suite.findall("testcase")}
    return suite, cases


def test_junit_finding_is_a_failure(results):
    result = results["finding"]
    suite, cases = _suite(result)
    assert int(suite.get("failures")) >= 1 and suite.get("errors") == "0" and suite.get("skipped") == "0"
    assert int(suite.get("tests")) == len(cases)
    failure = cases[result.test].find("failure")
    assert failure is not None and failure.get("type") == "Finding"
    assert failure.get("message").startswith(f"FINDING: {result.test}: rejected")
    # one test case per deciding test and decisive check, nothing else
    assert set(cases) == set(result.deciding) | {"support"}
    props = {p.get("name"): p.get("value") for p in suite.find("properties")}
    assert props["verdict"] == "FINDING" and props["test"] == result.test and props["decided_by"] == "one-sample"
    # the decisive checks that found something fail too
    _, greedy = _suite(results["greedy-finding"])
    assert greedy["support"].find("failure") is not None and greedy["greedy"].find("failure") is not None
    _, eos = _suite(results["eos"])
    assert eos["end-of-sequence"].find("failure") is not None


def test_junit_inconclusive_is_skipped_and_pass_is_clean(results):
    suite, cases = _suite(results["inconclusive"])
    assert suite.get("failures") == "0" and int(suite.get("skipped")) >= 1
    skipped = cases["minimum detectable TV"].find("skipped")
    assert skipped is not None and skipped.get("message").startswith("INCONCLUSIVE: the minimum detectable TV reached")
    assert cases["pit probability / all"].find("skipped") is not None
    assert cases["support"].find("skipped") is None and cases["support"].find("failure") is None
    suite, cases = _suite(results["pass"])
    assert suite.get("failures") == "0" and suite.get("skipped") == "0" and suite.get("errors") == "0"
    assert "within the" in cases["minimum detectable TV"].find("system-out").text
    suite, cases = _suite(results["error"])
    assert suite.get("errors") == "1" and cases["generation audit"].find("error") is not None


# ---------------------------------------------------------------------------------------------
# Writing
# ---------------------------------------------------------------------------------------------


def test_write_report_writes_the_four_files(results, tmp_path):
    result = results["greedy-finding"]  # few tokens: small figures
    paths = write_generation_report(result, tmp_path / "out")
    assert {p.name for p in paths.values()} == {"report.json", "report.md", "report.html", "junit.xml"}
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["junit.xml", "report.html", "report.json",
                                                                    "report.md"]
    assert json.loads(paths["json"].read_text())["kind"] == "generation-audit"
    assert paths["md"].read_text() == render_generation_markdown(result)
    ET.parse(paths["junit"])
    assert "data:image/png;base64," in paths["html"].read_text()
    only = write_generation_report(result, tmp_path / "md-only", formats=("md",))
    assert list(only) == ["md"] and [p.name for p in (tmp_path / "md-only").iterdir()] == ["report.md"]
    with pytest.raises(InvalidArgument, match="formats"):
        write_generation_report(result, tmp_path / "bad", formats=("pdf",))


def test_write_report_is_atomic(results, tmp_path, monkeypatch):
    import spectr_audit._files as files
    import spectr_audit.reports.generation as generation

    out = tmp_path / "out"
    write_generation_report(results["inconclusive"], out, figures=False)
    before = {p.name: p.read_bytes() for p in out.iterdir()}

    # a render that fails writes nothing: every format is rendered before any file is touched
    def broken(*args, **kwargs):
        raise RuntimeError("render failed")

    with monkeypatch.context() as patch:
        patch.setattr(generation, "render_generation_junit", broken)
        with pytest.raises(RuntimeError, match="render failed"):
            write_generation_report(results["finding"], out, figures=False)
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before

    # a write that fails at the rename leaves the previous file whole and no temporary behind
    def no_replace(src, dst):
        raise OSError("disk full")

    with monkeypatch.context() as patch:
        patch.setattr(files.os, "replace", no_replace)
        with pytest.raises(OSError, match="disk full"):
            write_generation_report(results["finding"], out, figures=False)
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    write_generation_report(results["finding"], out, figures=False)
    assert json.loads((out / "report.json").read_text())["verdict"] == "FINDING"
    assert sorted(os.listdir(out)) == ["junit.xml", "report.html", "report.json", "report.md"]


def test_reports_import_nothing_of_the_audit():
    code = ("import sys, spectr_audit.reports.generation, spectr_audit.reports.figures.generation; "
            "print([m for m in ('torch', 'cvxpy', 'spectr_audit.generation', 'matplotlib') if m in sys.modules])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120)
    assert out.stdout.strip() == "[]"
