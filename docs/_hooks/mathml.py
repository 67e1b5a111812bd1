"""Render the site's mathematics to MathML at build time (a mkdocs hook).

pymdownx.arithmatex (generic mode) leaves each formula as ``\\( ... \\)`` or ``\\[ ... \\]`` inside
a ``<span class="arithmatex">`` or ``<div class="arithmatex">``.  This hook replaces every one with
the MathML that latex2mathml writes, so that a page shows its mathematics without a script and
without a network: browsers render MathML natively.  A formula latex2mathml cannot convert, or
one with a command it would leave as text, fails the build with the page and the formula named.
"""

from __future__ import annotations

import html
import re

from latex2mathml.converter import convert

_FORMULA = re.compile(r'<(span|div) class="arithmatex">(.*?)</\1>', re.S)
_DELIMITERS = {"span": ("\\(", "\\)"), "div": ("\\[", "\\]")}
# latex2mathml writes a command it does not know as text (``<mi>\foo</mi>``): a page would show TeX
_UNCONVERTED = re.compile(r">(\\[A-Za-z]+)<")


class MathError(ValueError):
    """A formula of the site that cannot be rendered."""


def render_formula(tag: str, body: str, where: str = "") -> str:
    """The MathML of one arithmatex element's ``body`` (HTML-escaped, delimiters included)."""
    tex = html.unescape(body).strip()
    opening, closing = _DELIMITERS[tag]
    if not (tex.startswith(opening) and tex.endswith(closing)):
        raise MathError(f"{where}: formula {tex[:80]!r} is not delimited by {opening} ... {closing}")
    tex = tex[len(opening):-len(closing)].strip()
    try:
        mathml = convert(tex, display="block" if tag == "div" else "inline")
    except Exception as error:  # latex2mathml raises a family of its own exceptions
        raise MathError(f"{where}: cannot render {tex[:80]!r}: {error}") from error
    left = _UNCONVERTED.search(mathml)
    if left:
        raise MathError(f"{where}: cannot render {tex[:80]!r}: {left.group(1)} is not a command latex2mathml knows")
    mathml = mathml.replace("<math ", '<math class="arithmatex" ', 1)
    return f'<div class="arithmatex">{mathml}</div>' if tag == "div" else mathml


def render_page(text: str, where: str = "") -> str:
    """``text`` (a page's HTML) with every arithmatex formula rendered to MathML."""
    return _FORMULA.sub(lambda m: render_formula(m.group(1), m.group(2), where), text)


def on_page_content(html_text, page, config, files):  # mkdocs hook
    return render_page(html_text, page.file.src_uri)
