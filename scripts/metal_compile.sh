#!/usr/bin/env bash
# Compiles every csrc/mps/kernels/*.metal with Apple's Metal compiler (macOS only):
#   bash scripts/metal_compile.sh [OUT_DIR]       (default build/air)
# Exit status: 0 all compiled, 1 a kernel failed to compile, 3 Apple's Metal toolchain is not
# installed here (then it says how to get it). Used by scripts/verify_macos.sh and the workflow.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${1:-build/air}"
mkdir -p "$OUT"
HOW="install Xcode (the Command Line Tools alone have no Metal compiler), then, from Xcode 26 on, \
the Metal toolchain, a separate download: xcodebuild -downloadComponent MetalToolchain"
if [ "$(uname -s)" != Darwin ]; then
  echo "metal_compile.sh: Apple's Metal compiler exists only on macOS" >&2
  exit 3
fi
# A one-line kernel tells a missing toolchain (no compiler to run) from a broken kernel.
printf '#include <metal_stdlib>\nkernel void rlx_probe() {}\n' > "$OUT/probe.metal"
if ! probe=$(xcrun -sdk macosx metal -c "$OUT/probe.metal" -o "$OUT/probe.air" 2>&1); then
  echo "$probe" >&2
  echo "metal_compile.sh: Apple's Metal toolchain is not available here: $HOW" >&2
  exit 3
fi
status=0
PY="${PYTHON:-python3}"
for f in csrc/mps/kernels/*.metal; do
  # the text the host code compiles at run time: its shared params header inlined
  src="$OUT/$(basename "$f")"
  "$PY" tools/embed_metal.py --expand "$f" > "$src" || { status=1; continue; }
  echo "xcrun metal $f"
  xcrun -sdk macosx metal -std=metal3.1 -Werror -c "$src" -o "$src.air" || status=1
done
exit $status
