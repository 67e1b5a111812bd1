"""Check built documentation pages in headless Chromium, offline: the mathematics renders.

    mkdocs build --strict -d site && python scripts/check_site_offline.py site

For each page (default: every built page that holds mathematics) a copy with a probe script is
opened in headless Chromium with every network request sent to a closed port.  The probe counts
the page's MathML elements, how many Chromium lays out as MathML (computed display "math" or
"block math") with a non-empty box, whether any TeX source (``\\(`` or ``\\[``) is left in the
text, and which resources the page asked for over a network.  A page fails when a formula is not
laid out, TeX source shows, or a resource outside the site was requested.  Exit 0 when every
page passes, 1 otherwise, 2 when Chromium cannot be found.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

PROBE = """
<script>
window.addEventListener("load", () => {
  const maths = Array.from(document.querySelectorAll("math"));
  const laid = maths.filter((m) => {
    const box = m.getBoundingClientRect();
    const display = getComputedStyle(m).display;
    return display.includes("math") && box.width > 0 && box.height > 0;
  });
  const text = document.body.innerText;
  const remote = performance.getEntriesByType("resource").map((e) => e.name).filter((n) => !n.startsWith("file:"));
  const out = document.createElement("pre");
  out.id = "spectr-probe";
  out.textContent = JSON.stringify({maths: maths.length, laid_out: laid.length,
                                    tex_left: /\\\\[(\\[]/.test(text), remote: remote});
  document.body.appendChild(out);
});
</script>
"""

_PROBE_OUT = re.compile(r'<pre id="spectr-probe">(.*?)</pre>', re.S)


def find_chromium() -> str | None:
    for name in ("chromium", "chromium-browser", "google-chrome", "chrome"):
        path = shutil.which(name)
        if path:
            return path
    return None


def probe_page(chromium: str, page: Path, timeout: float = 60.0) -> dict:
    """Open a probed copy of ``page`` (beside it, so its relative links resolve) and return the probe."""
    text = page.read_text(encoding="utf-8")
    if "</body>" not in text:
        return {"error": "no </body> in the page"}
    copy = page.with_name(f".probe-{page.name}")
    copy.write_text(text.replace("</body>", PROBE + "</body>", 1), encoding="utf-8")
    profile = tempfile.mkdtemp(prefix="spectr-chromium-")
    try:
        run = subprocess.run(
            [chromium, "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run", f"--user-data-dir={profile}",
             "--proxy-server=127.0.0.1:9", "--proxy-bypass-list=<-loopback>", "--virtual-time-budget=10000",
             "--dump-dom", copy.as_uri()],
            capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"error": f"chromium did not finish within {timeout:g} s"}
    finally:
        copy.unlink(missing_ok=True)
        shutil.rmtree(profile, ignore_errors=True)
    found = _PROBE_OUT.search(run.stdout)
    if found is None:
        return {"error": f"no probe output (chromium exit {run.returncode}): {run.stderr.strip()[-300:]}"}
    import html

    return json.loads(html.unescape(found.group(1)))


def verdict(result: dict) -> list:
    """The problems of one probed page (empty: it passes)."""
    if "error" in result:
        return [result["error"]]
    problems = []
    if result["laid_out"] < result["maths"]:
        problems.append(f"{result['maths'] - result['laid_out']} of {result['maths']} formulas not laid out as MathML")
    if result["tex_left"]:
        problems.append("TeX source shows in the text")
    if result["remote"]:
        problems.append(f"requested over a network: {', '.join(result['remote'][:5])}")
    return problems


def pages_with_math(site: Path) -> list:
    return sorted(p for p in site.rglob("*.html") if "<math" in p.read_text(encoding="utf-8", errors="replace"))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("site", type=Path, help="the built site's folder")
    parser.add_argument("pages", nargs="*", help="pages relative to the site (default: every page with mathematics)")
    args = parser.parse_args(argv)
    if not args.site.is_dir():
        parser.error(f"site: {args.site} is not a folder")
    chromium = os.environ.get("CHROMIUM") or find_chromium()
    if chromium is None:
        print("check_site_offline: no chromium found (set CHROMIUM or install chromium)", file=sys.stderr)
        return 2
    pages = [args.site / p for p in args.pages] if args.pages else pages_with_math(args.site)
    if not pages:
        print("check_site_offline: no page holds mathematics", file=sys.stderr)
        return 1
    failed = 0
    for page in pages:
        if not page.is_file():
            print(f"FAIL {page}: no such page")
            failed += 1
            continue
        result = probe_page(chromium, page)
        problems = verdict(result)
        name = page.relative_to(args.site)
        if problems:
            failed += 1
            print(f"FAIL {name}: {'; '.join(problems)}")
        else:
            print(f"ok   {name}: {result['laid_out']} formulas laid out as MathML, nothing requested over a network")
    print(f"{len(pages) - failed} of {len(pages)} pages pass")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
