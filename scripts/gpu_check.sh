#!/usr/bin/env bash
# The GPU check, in one command on a machine with one NVIDIA GPU, in at most 8 minutes:
#   1. finds the GPU (on a machine without one: says so and exits 2);
#   2. installs the project (torch: the installed one if it sees CUDA, else `pip install torch` from the
#      package index, which is the CUDA build on Linux), unless --no-install;
#   3. runs the CUDA cases of tests/integration/test_device.py (every built-in: sampler against its exact
#      law, contract checks and exact audit, statistical audit, each compared with the CPU; no host sync);
#   4. runs tests/verifiers/test_triton_kernels.py on CUDA (the Triton kernels against their eager twins);
#   5. runs benchmarks/bench_verifiers.py --device cuda (absolute times, ratios to a memory pass on the
#      same GPU, the Triton kernels on and off);
#   6. prints one summary table (scripts/gpu_summary.py), also written to OUT/summary.md.
#
# Usage: scripts/gpu_check.sh [--no-install] [--detect-only] [--quick] [--out DIR]
#   --no-install   use the Python environment as it is
#   --detect-only  stop after finding the GPU (exit 0 with one, 2 without)
#   --quick        the benchmark's --quick sizes (2^22 probabilities instead of 2^26)
#   --out DIR      logs, JUnit reports, the benchmark's JSON and the summary (default: $OUT, else gpu_check_out)
# Environment: PYTHON (default python3), GPU_CHECK_SECONDS (the overall budget, default 480),
# GPU_CHECK_ASSUME_GPU=1 (skip step 1: to test the script's later gates on a machine without a GPU).
# Exit status: 0 every check held; 1 a check failed; 2 no GPU found; 3 no CUDA torch; 4 install failed;
# 64 bad usage.
set -uo pipefail
cd "$(dirname "$0")/.."

usage() { sed -n '2,21p' "$0" | sed 's/^# \{0,1\}//'; }
install=1 detect_only=0 quick=() out="${OUT:-gpu_check_out}"
while [ $# -gt 0 ]; do
  case "$1" in
    --no-install) install=0 ;;
    --detect-only) detect_only=1 ;;
    --quick) quick=(--quick) ;;
    --out) [ $# -ge 2 ] || { echo "gpu_check: --out needs a directory" >&2; exit 64; }; out="$2"; shift ;;
    -h|--help) usage; exit 0 ;;
    *) echo "gpu_check: unknown argument: $1" >&2; usage >&2; exit 64 ;;
  esac
  shift
done
PY="${PYTHON:-python3}"
budget="${GPU_CHECK_SECONDS:-480}"
start=$(date +%s)
say() { printf 'gpu_check [%3ds] %s\n' "$(( $(date +%s) - start ))" "$*"; }
left() { echo $(( budget - ($(date +%s) - start) )); }
# a step's time limit: its own share, or what is left of the budget minus a reserve for the summary
limit() { local want=$1 rest; rest=$(( $(left) - 15 )); [ "$rest" -lt "$want" ] && want=$rest; [ "$want" -lt 1 ] && want=1; echo "$want"; }

# -- 1. the GPU -------------------------------------------------------------------------------------------
gpu=""
if [ "${GPU_CHECK_ASSUME_GPU:-0}" = 1 ]; then
  gpu="assumed (GPU_CHECK_ASSUME_GPU=1)"
elif command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L 2>/dev/null | grep -q '^GPU '; then
  gpu="$(nvidia-smi -L 2>/dev/null | head -n 1)"
elif ls /dev/nvidia[0-9]* >/dev/null 2>&1; then
  gpu="$(ls /dev/nvidia[0-9]* | head -n 1) (no nvidia-smi)"
fi
if [ -z "$gpu" ]; then
  echo "gpu_check: no GPU found on this machine (nvidia-smi lists none, no /dev/nvidia*): nothing to check on CUDA" >&2
  exit 2
fi
say "GPU: $gpu"
[ "$detect_only" -eq 1 ] && exit 0
mkdir -p "$out"

# -- 2. install -------------------------------------------------------------------------------------------
torch_has_cuda() { "$PY" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' >/dev/null 2>&1; }
if [ "$install" -eq 1 ]; then
  if torch_has_cuda; then
    say "torch: $("$PY" -c 'import torch; print(torch.__version__, "CUDA", torch.version.cuda)') (kept)"
  else
    if "$PY" -c 'import torch' >/dev/null 2>&1; then
      say "torch $("$PY" -c 'import torch; print(torch.__version__)') sees no CUDA: installing the CUDA build"
      timeout "$(limit 240)" "$PY" -m pip install -q --force-reinstall torch >"$out/pip_torch.log" 2>&1
    else
      say "no torch: installing it (the CUDA build on Linux)"
      timeout "$(limit 240)" "$PY" -m pip install -q torch >"$out/pip_torch.log" 2>&1
    fi || { echo "gpu_check: pip could not install torch (see $out/pip_torch.log)" >&2; exit 4; }
  fi
  # the project with its test extra; offline, the project alone on the dependencies already there
  if ! timeout "$(limit 150)" "$PY" -m pip install -q -e ".[test]" >"$out/pip_project.log" 2>&1; then
    say "pip install -e .[test] failed (offline?): installing the project alone"
    timeout "$(limit 60)" "$PY" -m pip install -q --no-deps --no-build-isolation -e . >>"$out/pip_project.log" 2>&1 \
      || { echo "gpu_check: the project did not install (see $out/pip_project.log)" >&2; exit 4; }
  fi
fi
if ! torch_has_cuda; then
  echo "gpu_check: torch ($("$PY" -c 'import torch; print(torch.__version__)' 2>/dev/null || echo 'not importable')) sees no CUDA device next to $gpu" >&2
  exit 3
fi
"$PY" -c 'import spectr_audit.verifiers.triton_kernels, pytest, hypothesis' 2>"$out/import.log" \
  || { echo "gpu_check: spectr_audit, pytest or hypothesis does not import (see $out/import.log)" >&2; exit 4; }
"$PY" - <<'EOF' | tee "$out/environment.txt"
import importlib.util, torch
triton = importlib.util.find_spec("triton")
version = __import__("triton").__version__ if triton else "not installed (the samplers run eagerly)"
print(f"torch {torch.__version__} (CUDA {torch.version.cuda}), {torch.cuda.get_device_name(0)}, triton {version}")
EOF

# -- 3.-5. the checks -------------------------------------------------------------------------------------
status=0
run_step() {  # name, seconds, command...
  local name=$1 seconds=$2 rc; shift 2
  say "$name (at most ${seconds}s): $*"
  timeout "$seconds" "$@" >"$out/$name.log" 2>&1; rc=$?
  tail -n 3 "$out/$name.log"
  if [ "$rc" -ne 0 ]; then
    status=1
    [ "$rc" -eq 124 ] && say "$name: stopped at its time limit" || say "$name: exit $rc (see $out/$name.log)"
  fi
}
run_step device-tests "$(limit 240)" "$PY" -m pytest -q -p no:cacheprovider -m "" -k cuda -rfE \
  tests/integration/test_device.py --junitxml="$out/device.xml"
run_step triton-tests "$(limit 90)" "$PY" -m pytest -q -p no:cacheprovider -rfE \
  tests/verifiers/test_triton_kernels.py --junitxml="$out/triton.xml"
run_step benchmark "$(limit 150)" "$PY" benchmarks/bench_verifiers.py --device cuda --parts verifiers,bounds \
  ${quick[@]+"${quick[@]}"} --json "$out/bench.json"

# -- 6. the table -----------------------------------------------------------------------------------------
echo
"$PY" scripts/gpu_summary.py --device-junit "$out/device.xml" --triton-junit "$out/triton.xml" \
  --bench "$out/bench.json" --out "$out/summary.md" || status=1
say "done: exit $status; logs, reports and the table in $out/"
exit "$status"
