#!/usr/bin/env bash
# The CPU kernels on arm64 (the Mac's CPU architecture), checked from Linux x86-64:
#  1. cross-builds rlx_torch._C with Debian's g++-aarch64-linux-gnu against PyPI's aarch64 CPU
#     torch (tools/cross_build.py, with setup.py's flags for aarch64);
#  2. unpacks an aarch64 Python 3.11 and its libraries from Debian's arm64 packages into a
#     sysroot (dpkg -x; no chroot, no change to this machine's apt or dpkg state);
#  3. runs the CPU test modules (codebook, gated delta rule, Muon, layers) under
#     qemu-aarch64-static with QEMU_CPU=neoverse-n1 (ARMv8.2 without SVE or BF16, close to M1).
#   bash scripts/ci_arm64.sh [pytest args]        (scripts/test.sh calls it)
# Needs Linux x86-64 and either the tools (aarch64-linux-gnu-g++, qemu-aarch64-static, dpkg,
# apt-get) or root with apt-get to install them; elsewhere it says why and exits 0.
# Downloads are kept in build/arm64/ (this checkout only) and reused by the next run.
# lint-scripts: linux-only (exits below unless on Linux x86-64)
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-.venv/bin/python}"
ARM_TORCH="${RLX_ARM64_TORCH:-2.9.1}"  # PyPI's newest CPU-only aarch64 torch
WORK="$PWD/build/arm64"

skip() { echo "ci_arm64.sh: SKIP: $*" >&2; exit 0; }

if [ "$(uname -s)" != Linux ] || [ "$(uname -m)" != x86_64 ]; then
  skip "needs Linux x86-64 (found $(uname -s) $(uname -m)); on an arm64 machine run pytest natively"
fi
need=()
command -v aarch64-linux-gnu-g++ >/dev/null 2>&1 || need+=(g++-aarch64-linux-gnu)
command -v qemu-aarch64-static >/dev/null 2>&1 || need+=(qemu-user-static)
if [ "${#need[@]}" -gt 0 ]; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    echo "== installing ${need[*]}"
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need[@]}" >/dev/null
  else
    skip "needs ${need[*]} (apt-get install -y ${need[*]}, as root)"
  fi
fi
command -v apt-get >/dev/null 2>&1 && command -v dpkg >/dev/null 2>&1 \
  || skip "needs apt-get and dpkg (Debian or Ubuntu) to fetch the arm64 Python"

# 2. The aarch64 Python and the shared libraries it and torch need, from Debian's arm64
# packages of this machine's release, through a private apt state under build/arm64/apt.
PKGS="python3.11-minimal libpython3.11-minimal libpython3.11-stdlib libpython3.11
libpython3.11-dev libc6 libgcc-s1 libstdc++6 libgomp1 zlib1g libexpat1 libffi8 libssl3
libbz2-1.0 liblzma5 libsqlite3-0 libuuid1 libncursesw6 libtinfo6 libreadline8 libcrypt1 libnsl2
libtirpc3 libtirpc-common libdb5.3 libgdbm6 libgssapi-krb5-2 libk5crypto3 libkeyutils1
libkrb5-3 libkrb5support0 libcom-err2 media-types"
SYSROOT="$WORK/sysroot"
if [ "$(cat "$SYSROOT/.packages" 2>/dev/null)" != "$PKGS" ]; then
  echo "== arm64 sysroot (Debian packages, dpkg -x)"
  A="$WORK/apt"
  rm -rf "$A" "$SYSROOT"
  mkdir -p "$A/lists/partial" "$A/cache/archives/partial" "$A/parts" "$A/debs" "$SYSROOT"
  : > "$A/status"
  cp /etc/apt/sources.list.d/*.sources "$A/parts/" 2>/dev/null || true
  [ -f /etc/apt/sources.list ] && cp /etc/apt/sources.list "$A/parts/main.list"
  APT_OPTS=(-o "Dir::Etc::SourceParts=$A/parts" -o "Dir::Etc::SourceList=/dev/null"
    -o "Dir::State::Lists=$A/lists" -o "Dir::Cache=$A/cache" -o "Dir::State::status=$A/status"
    -o APT::Architecture=arm64 -o "APT::Architectures::=arm64" -o Debug::NoLocking=1
    -o APT::Sandbox::User=root)
  apt-get -qq "${APT_OPTS[@]}" update
  # shellcheck disable=SC2086  # PKGS is a list of names
  (cd "$A/debs" && apt-get -qq "${APT_OPTS[@]}" download $PKGS)
  for deb in "$A/debs"/*.deb; do dpkg -x "$deb" "$SYSROOT"; done
  printf '%s' "$PKGS" > "$SYSROOT/.packages"
fi
export QEMU_LD_PREFIX="$SYSROOT" QEMU_CPU="${QEMU_CPU:-neoverse-n1}"
# The interpreter as a host executable, so that sys.executable runs (tests and pytest-xdist
# start Python subprocesses; without binfmt_misc the kernel cannot exec an aarch64 binary).
# It lives beside the real one, so that Python finds its prefix in the sysroot.
APY="$SYSROOT/usr/bin/python3.11-qemu"
printf '#!/bin/sh\nexec qemu-aarch64-static -0 "$0" "%s" "$@"\n' "$SYSROOT/usr/bin/python3.11" > "$APY"
chmod +x "$APY"

# aarch64 wheels: torch (CPU-only) and the test tools, at this venv's versions where it has them.
SITE="$WORK/site-$ARM_TORCH"
pins=$("$PY" - <<'PY'
from importlib.metadata import PackageNotFoundError, version
names = ["numpy", "filelock", "fsspec", "jinja2", "markupsafe", "mpmath", "networkx", "sympy",
         "typing_extensions", "pytest", "iniconfig", "packaging", "pluggy", "pygments",
         "hypothesis", "sortedcontainers", "expecttest"]
pins = ["pytest-xdist==3.8.0", "execnet==2.1.2"]  # two test processes: CI has two cores
for name in names:
    try:
        pins.append(f"{name}=={version(name)}")
    except PackageNotFoundError:
        pins.append(name)
print(" ".join(pins))
PY
)
if [ "$(cat "$SITE/.complete" 2>/dev/null)" != "$pins" ]; then
  echo "== aarch64 wheels (torch $ARM_TORCH)"
  rm -rf "$SITE"
  # --no-deps: pip would evaluate torch's dependency markers for this x86-64 host
  # shellcheck disable=SC2086
  "$PY" -m pip install -q --disable-pip-version-check --no-deps --target "$SITE" \
    --only-binary=:all: --platform manylinux_2_28_aarch64 --platform manylinux2014_aarch64 \
    --python-version 3.11 --implementation cp "torch==$ARM_TORCH" $pins
  printf '%s' "$pins" > "$SITE/.complete"
fi

# 1. Cross-build into a copy of the package (the tree's own rlx_torch holds the x86-64 build).
TREE="$WORK/tree"
rm -rf "$TREE"
mkdir -p "$TREE"
cp -R rlx_torch tests examples pyproject.toml "$TREE/"  # (a test runs an example)
find "$TREE" \( -name '__pycache__' -o -name '*.so' -o -name '_build_info.py' \) -prune \
  -exec rm -rf {} +
printf 'TORCH_VERSION = "%s"\n' "$ARM_TORCH+cpu" > "$TREE/rlx_torch/_build_info.py"
echo "== cross-build (aarch64-linux-gnu-g++)"
start=$SECONDS
"$PY" tools/cross_build.py --cxx aarch64-linux-gnu-g++ --machine aarch64 --torch "$SITE/torch" \
  --python-include "$SYSROOT/usr/include/python3.11" \
  --python-include "$SYSROOT/usr/include" \
  --ext-suffix .cpython-311-aarch64-linux-gnu.so --out "$TREE/rlx_torch" \
  --build-dir "$WORK/obj" --jobs "${MAX_JOBS:-2}"
echo "cross-build: $((SECONDS - start)) s"

# Apple's compiler for arm64 against torch 2.9 (C++17): no warnings under -Wall -Wextra.
# Compile only (at -O0, for speed: clang's warnings come from its front end, and inline-asm
# constraints are still checked): on Linux clang's OpenMP runtime is not torch's.
if command -v clang++ >/dev/null 2>&1; then
  echo "== clang++ --target=aarch64-linux-gnu -Werror (compile only)"
  start=$SECONDS
  "$PY" tools/cross_build.py --cxx "clang++ --target=aarch64-linux-gnu" --machine aarch64 \
    --torch "$SITE/torch" --python-include "$SYSROOT/usr/include/python3.11" \
    --python-include "$SYSROOT/usr/include" --ext-suffix .so --out "$WORK/clang" \
    --build-dir "$WORK/clang-obj" --jobs "${MAX_JOBS:-2}" --compile-only --extra "-O0 -Werror"
  echo "clang arm64 compile: $((SECONDS - start)) s"
else
  echo "ci_arm64.sh: no clang++: the clang arm64 compile check does not run" >&2
fi

# 3. The CPU test modules under qemu.
echo "== pytest under qemu-aarch64-static (QEMU_CPU=$QEMU_CPU)"
start=$SECONDS
cd "$TREE"
status=0
export PYTHONPATH="$SITE:$TREE" PYTHONDONTWRITEBYTECODE=1
# Hypothesis' data generation is far slower under emulation than its health check allows.
export RLX_HYPOTHESIS_PROFILE=emulated
"$APY" -c "import platform, torch; print('python', platform.python_version(), platform.machine(), 'torch', torch.__version__)"
# Deselected: the layer tests that compile with inductor, whose C++ code generation would
# call the host's x86-64 compiler from the emulated process (the same tests run on x86-64 in
# the main pytest run; the op-level compile tests here use the eager and aot_eager backends).
"$APY" -m pytest -q -p no:cacheprovider -n "${RLX_ARM64_WORKERS:-2}" \
  tests/test_codebook.py tests/test_codebook_linear.py \
  tests/test_gated_delta.py tests/test_muon.py tests/test_newton_schulz.py \
  tests/test_muon_update.py tests/test_param_groups.py tests/test_symmetric_matmul.py \
  tests/test_layers_conv_norm.py tests/test_layers_gated_deltanet.py \
  --deselect tests/test_layers_conv_norm.py::test_short_conv_packed_compiled_gradients \
  --deselect tests/test_layers_gated_deltanet.py::test_torch_compile_fullgraph_with_packed_sequences \
  --deselect tests/test_layers_gated_deltanet.py::test_torch_compile_dynamic_shapes_with_packed_sequences \
  "$@" || status=$?
echo "pytest under qemu: $((SECONDS - start)) s"
exit $status
