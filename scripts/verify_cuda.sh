#!/usr/bin/env bash
# One command for a Linux machine with an NVIDIA GPU: builds rlx_torch with its CUDA kernels,
# runs the CUDA tests, compares the gated delta rule with fla's Triton kernels where fla
# imports, runs the CUDA benchmarks, and prints a summary to paste into an issue.
#   bash scripts/verify_cuda.sh          (PYTHON: a Python whose torch has CUDA; default python3)
# Where the compiler wrapper links its own libstdc++ into extensions (then every C++ error
# message that formats a number crashes), build with the system compiler:
#   CXX=/usr/bin/g++ bash scripts/verify_cuda.sh
# fla's comparisons run one test per process and without pytest-xdist: under xdist they stall.
# The first of them compiles fla's Triton kernels, which takes minutes on a fresh machine.
# The benchmarks run each gate in its own process, so that a fault in one of fla's kernels
# (fla-core 0.4.2's chunk_kda backward makes an illegal memory access on Hopper) leaves the
# other's figures. On Hopper with Triton < 3.7.1, fla-core 0.5.2 refuses the per-head gate's
# backward (its comparisons then skip, after holding ours to fla's tolerances against float64)
# and 0.4.2 faults in the per-channel one: run the script once with each on PYTHONPATH.
# Every step runs even when an earlier one fails; the summary lists PASS/FAIL/SKIP for each.
set -uo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
# the tree first, then whatever the caller put on PYTHONPATH (fla or pytest-xdist installed
# with pip --target, say)
TREE_PATH=".${PYTHONPATH:+:$PYTHONPATH}"
LOG_DIR="${RLX_VERIFY_DIR:-build/verify_cuda}"
mkdir -p "$LOG_DIR"
declare -a SUMMARY=()
status=0

step() {  # step NAME COMMAND...: runs it, logs to $LOG_DIR/NAME.log, records pass or fail
  local name=$1 rc=0
  shift
  echo "== $name"
  "$@" >"$LOG_DIR/$name.log" 2>&1 || rc=$?
  if [ "$rc" = 0 ]; then
    SUMMARY+=("PASS  $name")
  else
    SUMMARY+=("FAIL  $name (see $LOG_DIR/$name.log)")
    status=1
  fi
  tail -n 3 "$LOG_DIR/$name.log"
}

"$PY" - <<'PY' || { echo "torch has no usable CUDA device here" >&2; exit 2; }
import torch
assert torch.cuda.is_available()
PY

step build "$PY" setup.py -q build_ext --inplace
parallel=()
if "$PY" -c "import xdist" >/dev/null 2>&1; then
  parallel=(-n 8)
fi
# No -x: one failure must not hide the others.
step cuda_tests env PYTHONPATH="$TREE_PATH" "$PY" -m pytest -q -ra ${parallel[@]+"${parallel[@]}"} \
  tests/test_codebook_cuda.py tests/test_gated_delta_cuda.py \
  tests/test_gated_delta_cuda_chunked.py -k "not matches_fla"
if "$PY" -c "import fla.ops.gated_delta_rule" >/dev/null 2>&1; then
  for case in False-False False-True True-False True-True; do
    step "fla_$case" env PYTHONPATH="$TREE_PATH" "$PY" -m pytest -q -ra -s -p no:xdist \
      "tests/test_gated_delta_cuda.py::test_matches_fla[$case]"
  done
else
  SUMMARY+=("SKIP  fla comparisons: fla does not import here (pip install fla-core)")
fi
step bench_codebook env PYTHONPATH="$TREE_PATH" "$PY" benchmarks/bench_codebook.py --device cuda
for gate in head channel; do
  step "bench_gdn_$gate" env PYTHONPATH="$TREE_PATH" "$PY" benchmarks/bench_gdn.py --device cuda \
    --gate "$gate"
done

echo
echo "---- rlx_torch verify_cuda summary (paste into an issue) ----"
"$PY" -c "import torch; print('torch', torch.__version__, torch.cuda.get_device_name())"
git rev-parse --short HEAD 2>/dev/null
printf '%s\n' "${SUMMARY[@]}"
grep -hE "passed|failed" "$LOG_DIR"/cuda_tests.log "$LOG_DIR"/fla_*.log 2>/dev/null | grep -vE "^(E|FAILED) "
grep -hE '^\{"bench"' "$LOG_DIR"/bench_*.log 2>/dev/null
exit $status
