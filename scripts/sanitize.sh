#!/usr/bin/env bash
# The C++-heavy test modules against an AddressSanitizer + UndefinedBehaviorSanitizer build of
# rlx_torch._C. The build goes to build/sanitize/ (the in-place build is left alone); the tests
# import a copy of the package that holds it, with the sanitizer runtimes preloaded (Python
# itself is not instrumented). Leak checking is off: CPython and torch keep memory at exit.
# Usage: bash scripts/sanitize.sh [extra pytest args]
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-.venv/bin/python}"
CXX_BIN="${CXX:-c++}"
OUT=build/sanitize
RLX_SANITIZE=1 "$PY" setup.py -q build_ext \
  --build-temp "$OUT/temp" --build-lib "$OUT/lib"
rm -rf "$OUT/pkg" && mkdir -p "$OUT/pkg"
cp -r rlx_torch "$OUT/pkg/"
find "$OUT/pkg/rlx_torch" -name '*.so' -delete
cp "$OUT"/lib/rlx_torch/_C*.so "$OUT/pkg/rlx_torch/"
PRELOAD="$("$CXX_BIN" -print-file-name=libasan.so) $("$CXX_BIN" -print-file-name=libubsan.so)"
export LD_PRELOAD="$PRELOAD"
export ASAN_OPTIONS="detect_leaks=0:abort_on_error=1:strict_init_order=1"
export UBSAN_OPTIONS="print_stacktrace=1:halt_on_error=1"
# The copy comes first on sys.path (-o pythonpath; the tree's own in-place build after it).
export PYTHONPATH="$OUT/pkg"
"$PY" -c "import rlx_torch, sys; f = rlx_torch._C.__file__; sys.exit(None if '$OUT/pkg' in f
  else 'the sanitizer build is not the one imported: ' + f)"
"$PY" -m pytest -q -p no:cacheprovider -o pythonpath="$OUT/pkg" \
  --override-ini="addopts=-ra" \
  tests/test_gated_delta.py tests/test_gated_delta_contract.py \
  tests/test_gated_delta_properties.py tests/test_codebook.py tests/test_symmetric_matmul.py \
  -k "not compile" "$@"
