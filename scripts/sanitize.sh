#!/usr/bin/env bash
# The C++-heavy tests against an AddressSanitizer + UndefinedBehaviorSanitizer build of
# rlx_torch._C. The build goes to build/sanitize/ (the in-place build is left alone; ninja keeps
# its objects, so a second run rebuilds only what changed); the tests import a copy of the
# package that holds it, with the sanitizer runtimes preloaded (Python itself is not
# instrumented). Leak checking is off: CPython and torch keep memory at exit.
#
# Bounded for CI (2 cores): MAX_JOBS=2 by default, the kernel tests without the ones that
# compile graphs (torch.compile's generated code is not instrumented) or time their loops, and
# the whole test run under RLX_SANITIZE_TIMEOUT seconds (default 1200). Any sanitizer report
# fails the run, also one from a process that did not abort: the runtimes write their reports
# to build/sanitize/reports/, which must stay empty.
# Usage: bash scripts/sanitize.sh [extra pytest args]
# lint-scripts: linux-only
set -euo pipefail
if [ "$(uname)" != Linux ]; then
  echo "sanitize.sh: Linux only (it preloads GCC's sanitizer runtimes)" >&2
  exit 1
fi
cd "$(dirname "$0")/.."
PY="${PYTHON:-.venv/bin/python}"
case "$PY" in /*) ;; */*) PY="$PWD/$PY" ;; esac  # the tests run from another directory
CXX_BIN="${CXX:-c++}"
ROOT="$PWD"
OUT=build/sanitize
REPORTS="$PWD/$OUT/reports"
start=$(date +%s)
MAX_JOBS="${MAX_JOBS:-2}" RLX_SANITIZE=1 "$PY" setup.py -q build_ext \
  --build-temp "$OUT/temp" --build-lib "$OUT/lib"
built=$(date +%s)
rm -rf "$OUT/pkg" "$REPORTS" && mkdir -p "$OUT/pkg" "$REPORTS"
cp -r rlx_torch "$OUT/pkg/"
find "$OUT/pkg/rlx_torch" -name '*.so' -delete
cp "$OUT"/lib/rlx_torch/_C*.so "$OUT/pkg/rlx_torch/"
PRELOAD="$("$CXX_BIN" -print-file-name=libasan.so) $("$CXX_BIN" -print-file-name=libubsan.so)"
export LD_PRELOAD="$PRELOAD"
export ASAN_OPTIONS="detect_leaks=0:abort_on_error=1:strict_init_order=1:log_path=$REPORTS/asan"
export UBSAN_OPTIONS="print_stacktrace=1:halt_on_error=1:log_path=$REPORTS/ubsan"
# The tests run from the copy's directory, so that its rlx_torch is the one imported (first
# on sys.path); the tree's root, which tests import helpers from, is appended after it.
PKG="$ROOT/$OUT/pkg"
(cd "$PKG" && "$PY" -c "import rlx_torch, sys; f = rlx_torch._C.__file__; sys.exit(None if
  f.startswith('$PKG') else 'the sanitizer build is not the one imported: ' + f)")
status=0
(cd "$PKG" && timeout "${RLX_SANITIZE_TIMEOUT:-1200}" "$PY" -m pytest -q -p no:cacheprovider \
  --rootdir="$ROOT" -c "$ROOT/pyproject.toml" --import-mode=append -o pythonpath= \
  --override-ini="addopts=-ra" \
  "$ROOT/tests/test_gated_delta.py" "$ROOT/tests/test_gated_delta_contract.py" \
  "$ROOT/tests/test_gated_delta_properties.py" "$ROOT/tests/test_codebook.py" \
  "$ROOT/tests/test_codebook_16bit.py" "$ROOT/tests/test_codebook_packed.py" \
  "$ROOT/tests/test_codebook_properties.py" "$ROOT/tests/test_codebook_one_row.py" \
  "$ROOT/tests/test_symmetric_matmul.py" "$ROOT/tests/test_newton_schulz_amx.py" \
  -k "not compile and not dynamic" "$@") || status=$?
unset LD_PRELOAD
if [ -n "$(ls -A "$REPORTS")" ]; then
  for f in "$REPORTS"/*; do echo "== $f"; cat "$f"; done
  echo "sanitize.sh: the sanitizers reported errors (above)" >&2
  status=1
fi
[ "$status" = 124 ] && echo "sanitize.sh: the tests ran past RLX_SANITIZE_TIMEOUT" >&2
echo "sanitize.sh: build $((built - start)) s, tests $(($(date +%s) - built)) s, status $status"
exit "$status"
