#!/usr/bin/env bash
# Check the import layering (pyproject.toml [tool.importlinter]) on the installed layout.
# verifiers/, reports/ and suites/ are installed inside spectr_audit (setuptools package-dir), which
# import-linter cannot follow in a source tree, so the check runs on a copy laid out as installed.
set -euo pipefail
cd "$(dirname "$0")/.."
stage=$(mktemp -d)
trap 'rm -rf "$stage"' EXIT
cp -r spectr_audit "$stage/spectr_audit"
for sub in verifiers reports suites; do
  cp -r "$sub" "$stage/spectr_audit/$sub"
done
find "$stage" -name __pycache__ -prune -exec rm -rf {} +
config="$PWD/pyproject.toml"
# lint-imports puts the working directory first on the import path: run it from the copy.
cd "$stage"
PYTHONPATH="$stage" lint-imports "$config" --no-cache
