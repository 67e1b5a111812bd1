#!/usr/bin/env bash
# Render an HTML report in a real headless browser and save a screenshot.
#
# Usage: scripts/render_report.sh REPORT.html [SCREENSHOT.png] [WIDTH,HEIGHT]
#
# Needs Debian's chromium package (apt-get install -y chromium).  The browser runs with a
# throw-away profile, no network services and no GPU, so it sees exactly what a reader who
# opens the file would see; the report must render from the file alone (figures are
# embedded).  Look at the screenshot: the summary table, the findings table and the figures
# (acceptance against K, block efficiency against L, output law against target) should be there.
set -euo pipefail
report=${1:?usage: render_report.sh REPORT.html [SCREENSHOT.png] [WIDTH,HEIGHT]}
shot=${2:-${report%.html}.png}
size=${3:-1280,2400}
browser=$(command -v chromium || command -v chromium-browser || command -v google-chrome || true)
if [ -z "$browser" ]; then
  echo "render_report.sh: no chromium found; install it with: apt-get update && apt-get install -y chromium" >&2
  exit 2
fi
profile=$(mktemp -d)
trap 'rm -rf "$profile"' EXIT
url="file://$(cd "$(dirname "$report")" && pwd)/$(basename "$report")"
timeout 120 "$browser" --headless --no-sandbox --disable-gpu --disable-background-networking \
  --disable-component-update --disable-sync --no-first-run --hide-scrollbars \
  --user-data-dir="$profile" --screenshot="$shot" --window-size="$size" "$url" >/dev/null 2>&1
test -s "$shot"
echo "$shot"
