#!/usr/bin/env bash
# One command for an Apple-silicon Mac: builds rlx_torch with the Metal backend, compiles every
# .metal file with Apple's compiler, runs the MPS tests (every op on mps against CPU) and the
# CPU suite, runs the MPS benchmarks, and prints a summary to paste into an issue.
#   bash scripts/verify_macos.sh            (uses ./.venv, created by scripts/setup_env.sh)
# Nothing else in this repository has run the Metal code on an Apple GPU; this script is how.
# Needs Xcode for Apple's Metal compiler (from Xcode 26 on also its Metal toolchain:
# xcodebuild -downloadComponent MetalToolchain); without it that step reports SKIP and says so.
# Every step runs even when an earlier one fails; the summary lists PASS/FAIL/SKIP for each.
set -uo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-.venv/bin/python}"
# the tree first, then whatever the caller put on PYTHONPATH
TREE_PATH=".${PYTHONPATH:+:$PYTHONPATH}"
LOG_DIR="${RLX_VERIFY_DIR:-build/verify_macos}"
mkdir -p "$LOG_DIR"
declare -a SUMMARY=()
status=0

step() {  # step NAME COMMAND...: runs it, logs to $LOG_DIR/NAME.log, records pass/fail/skip
  local name=$1 rc=0
  shift
  echo "== $name"
  "$@" >"$LOG_DIR/$name.log" 2>&1 || rc=$?
  if [ "$rc" = 0 ]; then
    SUMMARY+=("PASS  $name")
  elif [ "$rc" = 3 ] && [ "$name" = metal_compile ]; then  # no Metal toolchain: not a failure
    SUMMARY+=("SKIP  $name: $(tail -n 1 "$LOG_DIR/$name.log")")
  else
    SUMMARY+=("FAIL  $name (see $LOG_DIR/$name.log)")
    status=1
  fi
  tail -n 3 "$LOG_DIR/$name.log"
}

if [ "$(uname -s)" != "Darwin" ] || [ "$(uname -m)" != "arm64" ]; then
  echo "verify_macos.sh is for Apple-silicon Macs (found $(uname -s) $(uname -m))" >&2
  exit 2
fi
[ -x "$PY" ] || bash scripts/setup_env.sh
"$PY" - <<'PY' || { echo "torch has no usable MPS device here" >&2; exit 2; }
import torch
assert torch.backends.mps.is_built() and torch.backends.mps.is_available()
PY

# Apple's Metal compiler on every kernel source: SKIP (with how to get it) without the toolchain
step metal_compile bash scripts/metal_compile.sh "$LOG_DIR/air"
step build "$PY" setup.py -q build_ext --inplace
step mps_tests env PYTHONPATH="$TREE_PATH" "$PY" -m pytest -q -ra tests/test_metal_mps_codebook.py \
  tests/test_metal_mps_gated_delta.py
# No -x: one failure must not hide the others.
step full_suite env PYTHONPATH="$TREE_PATH" "$PY" -m pytest -q tests
step bench env PYTHONPATH="$TREE_PATH" "$PY" benchmarks/bench_mps.py --device mps

echo
echo "---- rlx_torch verify_macos summary (paste into an issue) ----"
sw_vers 2>/dev/null | tr '\n' ' '
echo
sysctl -n machdep.cpu.brand_string 2>/dev/null
"$PY" -c "import torch, platform; print('torch', torch.__version__, 'python', platform.python_version())"
git rev-parse --short HEAD 2>/dev/null
printf '%s\n' "${SUMMARY[@]}"
grep -E "passed|failed|skipped" "$LOG_DIR/mps_tests.log" | tail -n 1
grep -E "^(codebook|gated delta)" "$LOG_DIR/bench.log"
grep -E '^\{"bench"' "$LOG_DIR/bench.log" | tail -n 1
exit $status
