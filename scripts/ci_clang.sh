#!/usr/bin/env bash
# Apple's compiler is clang: builds rlx_torch._C with clang under -Wall -Wextra -Werror into
# build/clang/ (the in-place build is left alone), in the C++ standard this torch asks for.
# (scripts/ci_arm64.sh compiles the sources with clang for arm64 against torch 2.9, as C++17.)
#   bash scripts/ci_clang.sh                  (scripts/test.sh calls it)
# On Linux that library runs our kernels in LLVM's libomp beside torch's libgomp, so it is a
# check only, never loaded: Linux builds use GCC (setup.py refuses clang with OpenMP there
# unless RLX_CLANG_OPENMP=1, which this sets).
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-.venv/bin/python}"
OUT="$PWD/build/clang"
mkdir -p "$OUT"
if [ "$(uname -s)" = Darwin ]; then
  echo "ci_clang.sh: SKIP: on macOS the normal build is already the clang build" >&2
  exit 0
fi
# clang++ and an OpenMP runtime for it (libomp-dev), from apt when we can
probe() { printf 'int main() { return 0; }\n' | clang++ -fopenmp -x c++ - -o "$OUT/omp_probe"; }
if ! command -v clang++ >/dev/null 2>&1 || ! probe >/dev/null 2>&1; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq clang libomp-dev >/dev/null
  else
    echo "ci_clang.sh: SKIP: needs clang++ with OpenMP (apt-get install -y clang libomp-dev)" >&2
    exit 0
  fi
fi
clang++ --version | head -n 1
start=$SECONDS
CC=clang CXX=clang++ LDSHARED="clang++ -shared" CFLAGS="-Werror" \
  RLX_CLANG_OPENMP=1 MAX_JOBS="${MAX_JOBS:-2}" \
  "$PY" setup.py -q build_ext --build-temp "$OUT/temp" --build-lib "$OUT/lib" 2>&1 \
  | tee "$OUT/build.log"
# -Werror stops the build at the first warning; this also catches warnings in the link
if grep -q "warning:" "$OUT/build.log"; then
  echo "ci_clang.sh: FAIL: clang warned (see $OUT/build.log)" >&2
  exit 1
fi
ls "$OUT"/lib/rlx_torch/_C*.so >/dev/null
echo "clang build: no warnings ($((SECONDS - start)) s)"
