"""The documentation site's mathematics: rendered to MathML at build time, checked in a browser offline."""

from __future__ import annotations

import importlib.util
import re
import shutil
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

pytest.importorskip("latex2mathml")


def _load(name: str, path: Path):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


hook = _load("spectr_docs_mathml_hook", ROOT / "docs" / "_hooks" / "mathml.py")
check = _load("spectr_check_site_offline", ROOT / "scripts" / "check_site_offline.py")


def test_the_site_loads_no_script_or_font_from_a_network():
    config = (ROOT / "mkdocs.yml").read_text()
    assert "docs/_hooks/mathml.py" in config
    assert not re.search(r"^\s*-\s*https?://", config, re.M), "a script or stylesheet from a network in mkdocs.yml"
    assert re.search(r"^\s+font:\s*false", config, re.M), "the theme would load Google Fonts"


@pytest.mark.parametrize("tag, body, display", [
    ("span", r"\(p(x) \ge q(x)\)", "inline"),
    ("div", r"\[ c(y) = q(y)\Bigl[1 - \bigl(1 - \min(1, p(y)/q(y))\bigr)^K\Bigr] \]", "block"),
    ("span", r"\(\sum_x \max(0, p(x) - q(x))\)", "inline"),
])
def test_a_formula_becomes_mathml(tag, body, display):
    page = f'<p>before <{tag} class="arithmatex">{body}</{tag}> after</p>'
    out = hook.render_page(page, "page.md")
    assert "\\(" not in out and "\\[" not in out and "\\" not in out  # no TeX left
    assert f'display="{display}"' in out
    assert out.startswith("<p>before ") and out.endswith(" after</p>")
    assert out.count("<math") == 1 and "</math>" in out


def test_html_escapes_in_a_formula_are_read_as_tex():
    out = hook.render_page(r'<span class="arithmatex">\(a &lt; b\)</span>', "page.md")
    assert "&lt;" in out or "&#x0003C;" in out  # the less-than sign, as MathML text


def test_an_unrenderable_formula_names_the_page_and_the_formula():
    with pytest.raises(hook.MathError, match=r"rules/x\.md: cannot render 'x\^'"):
        hook.render_page(r'<span class="arithmatex">\(x^\)</span>', "rules/x.md")
    # a command latex2mathml does not know would show as TeX on the page
    with pytest.raises(hook.MathError, match=r"\\Bigl\\lceil|\\lceil is not a command"):
        hook.render_page(r'<div class="arithmatex">\[\Bigl\lceil x \Bigr\rceil\]</div>', "rules/x.md")
    with pytest.raises(hook.MathError, match=r"\\nosuchcommand is not a command"):
        hook.render_page(r'<span class="arithmatex">\(\nosuchcommand x\)</span>', "rules/x.md")
    with pytest.raises(hook.MathError, match="not delimited"):
        hook.render_page(r'<span class="arithmatex">x^2</span>', "rules/x.md")


def test_every_formula_of_the_documentation_sources_renders():
    # the arithmatex forms of the sources: \( ... \) inline and \[ ... \] on lines of their own
    formulas = 0
    for page in sorted((ROOT / "docs").rglob("*.md")):
        text = page.read_text(encoding="utf-8")
        text = re.sub(r"```.*?```", "", text, flags=re.S)  # code blocks hold no mathematics
        text = re.sub(r"`[^`\n]*`", "", text)
        for match in re.finditer(r"\\\((.+?)\\\)", text, re.S):
            hook.render_formula("span", f"\\({match.group(1)}\\)", str(page))
            formulas += 1
        for match in re.finditer(r"\\\[(.+?)\\\]", text, re.S):
            hook.render_formula("div", f"\\[{match.group(1)}\\]", str(page))
            formulas += 1
    assert formulas > 200  # the rules pages alone hold several hundred


chromium = check.find_chromium()
needs_chromium = pytest.mark.skipif(chromium is None, reason="chromium is not installed (.ci/run installs it)")


@needs_chromium
def test_the_browser_probe_fails_raw_tex_and_a_network_script(tmp_path):
    (tmp_path / "raw.html").write_text(
        '<html><head><script src="https://cdn.jsdelivr.net/npm/mathjax@3/es5/tex-mml-chtml.js"></script></head>'
        '<body><p>see <span class="arithmatex">\\(x^2\\)</span></p></body></html>')
    result = check.probe_page(chromium, tmp_path / "raw.html")
    problems = check.verdict(result)
    assert result["tex_left"] is True
    assert any("cdn.jsdelivr.net" in p for p in problems)
    assert check.main([str(tmp_path), "raw.html"]) == 1


@needs_chromium
def test_the_browser_lays_out_the_hooks_mathml(tmp_path):
    body = hook.render_page('<p><span class="arithmatex">\\(\\frac{a}{b} + x_1^2\\)</span></p>'
                            '<div class="arithmatex">\\[\\sum_{i=1}^n i\\]</div>', "page.md")
    (tmp_path / "page.html").write_text(f"<html><head></head><body>{body}</body></html>")
    result = check.probe_page(chromium, tmp_path / "page.html")
    assert result == {"maths": 2, "laid_out": 2, "tex_left": False, "remote": []}
    assert check.main([str(tmp_path)]) == 0
    assert not list(tmp_path.glob(".probe-*"))  # the probed copy is removed


def test_without_chromium_the_check_says_so(tmp_path, monkeypatch):
    monkeypatch.setattr(check, "find_chromium", lambda: None)
    monkeypatch.delenv("CHROMIUM", raising=False)
    assert check.main([str(tmp_path)]) == 2
