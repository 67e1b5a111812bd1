"""A griffe extension for the API reference: the installed layout, read from the source tree.

``verifiers/``, ``reports/`` and ``suites/`` are installed inside ``spectr_audit`` (setuptools
``package-dir``), which static analysis of the source tree cannot see: this extension mounts
them as ``spectr_audit.verifiers``, ``spectr_audit.reports`` and ``spectr_audit.suites`` when
griffe loads ``spectr_audit``.  It also turns the reST roles of the docstrings
(``:func:`name```) into inline code, since the numpydoc docstrings are rendered as Markdown.
"""

from __future__ import annotations

import re
from pathlib import Path

import griffe

#: The repository root (this file is docs/_griffe/package_dir.py).
ROOT = Path(__file__).resolve().parents[2]

#: Subpackage name -> folder of the repository, as in pyproject.toml's [tool.setuptools.package-dir].
MOUNTS = {"verifiers": "verifiers", "reports": "reports", "suites": "suites"}

_ROLE = re.compile(r":(?:py:)?(?:func|class|mod|meth|attr|data|exc|obj|const):`(~?)([^`]+)`")


def _code(match: re.Match) -> str:
    """``:func:`~a.b.c``` -> ```c``` (the reST ``~`` keeps the last component); else the whole target."""
    target = match.group(2)
    return f"``{target.rsplit('.', 1)[-1] if match.group(1) else target}``"


class PackageDir(griffe.Extension):
    """Mount the package-dir subpackages; rewrite reST roles as inline code."""

    def on_package(self, *, pkg: griffe.Module, loader: griffe.GriffeLoader, **kwargs) -> None:
        if pkg.name != "spectr_audit":
            return
        for name, folder in MOUNTS.items():
            if name in pkg.members:
                continue
            sub = loader.load(str(ROOT / folder))
            if sub.name in loader.modules_collection.members:
                loader.modules_collection.del_member(sub.name)
            pkg.set_member(name, sub)

    def on_instance(self, *, obj: griffe.Object, **kwargs) -> None:
        if obj.docstring is not None:
            obj.docstring.value = _markdown(obj.docstring.value)


#: Inline code spans (double or single backticks): left untouched.
_CODE = re.compile(r"(``.+?``|`[^`\n]+`)")
#: *emphasis*: a star after a space or the start, closed by a star before a space or punctuation.
_EMPHASIS = re.compile(r"(?<![\w*\\])\*[^\s*][^*\n]*?(?<=[^\s*])\*(?![\w*])|(?<![\w*\\])\*\w\*(?![\w*])")
#: A star glued to the end of a word (alpha*, rho*): a superscript star, not emphasis.
_TRAILING_STAR = re.compile(r"(?<=[\w)\]])\*")


def _markdown(text: str) -> str:
    """reST roles as inline code, and trailing stars (``alpha*``) escaped outside code and emphasis."""
    text = _ROLE.sub(_code, text)
    parts = _CODE.split(text)
    for i in range(0, len(parts), 2):  # even parts are outside code spans
        kept: list[str] = []

        def keep(match: re.Match) -> str:
            kept.append(match.group(0))
            return f"\x00{len(kept) - 1}\x00"

        plain = _EMPHASIS.sub(keep, parts[i])
        plain = _TRAILING_STAR.sub(r"\\*", plain)
        parts[i] = re.sub("\x00(\\d+)\x00", lambda m: kept[int(m.group(1))], plain)
    return "".join(parts)
