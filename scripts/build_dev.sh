#!/usr/bin/env bash
# Incremental in-place build of rlx_torch._C for development (ninja reuses objects).
# Serialized by a lock in this checkout's build/ (tools/with_lock.py, a portable flock), so
# that several shells building here at once never collide; other checkouts are not affected.
# Prints one progress line per C++ file instead of ninja's compiler command lines (compiler
# warnings and errors still show in full); RLX_BUILD_VERBOSE=1 shows the commands.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-.venv/bin/python}"
build=("$PY" tools/with_lock.py build/.build.lock "$PY" setup.py -q build_ext --inplace)
if [ "${RLX_BUILD_VERBOSE:-0}" = 1 ]; then
  exec "${build[@]}"
fi
echo "Building the C++ extension rlx_torch._C (only files that changed are compiled; the first" \
     "build compiles all of them, about 75 s on 2 idle cores)..."
start=$SECONDS
# ninja's "[i/n] c++ ... -c /path/csrc/x.cpp -o ..." -> "[i/n] csrc/x.cpp"
"${build[@]}" 2>&1 | awk -v start="$start" -v root="$PWD/" '
  /^\[[0-9]+\/[0-9]+\] / && / -c / {
    src = $0; sub(/.* -c /, "", src); sub(/ .*/, "", src); sub(root, "", src)
    printf "%s %s\n", $1, src; fflush(); next
  }
  /^\[[0-9]+\/[0-9]+\] / { printf "%s linking\n", $1; fflush(); next }
  { print; fflush() }'
status=${PIPESTATUS[0]}
if [ "$status" -eq 0 ]; then
  echo "rlx_torch._C is up to date ($((SECONDS - start)) s)."
fi
exit "$status"
