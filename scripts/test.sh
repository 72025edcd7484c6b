#!/usr/bin/env bash
# The whole test suite: set-up, lint, the pytest suite, the clang and arm64 builds and tests,
# then the wheel check (from the sdist).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
# The Objective-C++ (Metal host code) compile check needs clang; install it when we can.
if ! command -v clang++ >/dev/null 2>&1; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq clang >/dev/null
  else
    echo "warning: clang++ not found; the Metal host-code compile check will not run" >&2
  fi
fi
# The Metal host code on the mock runtime (tests/test_metal_host_mock.py) also needs GNU's
# Objective-C runtime and the blocks runtime.
if ! { [ -e /usr/include/Block.h ] && [ -n "$(gcc -print-file-name=libobjc.so | grep /)" ]; }; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
      "libobjc-$(gcc -dumpversion | cut -d. -f1)-dev" libblocksruntime-dev >/dev/null
  else
    echo "warning: libobjc or libBlocksRuntime missing; the mock-runtime host tests will not run" >&2
  fi
fi
.venv/bin/ruff check .
# Two test processes (CI has two cores; RLX_TEST_WORKERS=0 runs them in this process), a module
# per process so that each module-scoped build (emulators, compile checks) is made once.
.venv/bin/python -m pytest -q -n "${RLX_TEST_WORKERS:-2}" --dist loadfile "$@"
# clang (Apple's compiler) with -Werror.
bash scripts/ci_clang.sh
# The CPU kernels for arm64 (the Mac's CPU), cross-built and tested under qemu (Linux x86-64;
# elsewhere it says why it cannot run). RLX_ARM64_TESTS=0 leaves it out.
if [ "${RLX_ARM64_TESTS:-1}" = 1 ]; then
  bash scripts/ci_arm64.sh
fi
# The C++-heavy modules again against an ASan + UBSan build (build/sanitize/, its own objects;
# Linux with GCC's sanitizer runtimes): docs/troubleshooting.md. RLX_SANITIZE_TESTS=0 leaves it out.
if [ "${RLX_SANITIZE_TESTS:-1}" = 1 ] && [ "$(uname)" = Linux ]; then
  bash scripts/sanitize.sh
fi
bash scripts/check_wheel.sh
