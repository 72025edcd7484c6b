#!/usr/bin/env bash
# Builds an sdist, builds the wheel from that sdist alone (so the sdist must hold every source
# and header, see MANIFEST.in), and proves that the wheel installs into a fresh virtual env and
# imports there. Everything stays in this checkout's build/check_wheel/.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-.venv/bin/python}"
WORK="$PWD/build/check_wheel"
rm -rf "$WORK"
mkdir -p "$WORK/egg" "$WORK/sdist" "$WORK/dist"
start=$SECONDS
# egg_info outside the tree: a stale rlx_torch.egg-info/SOURCES.txt would stand in for MANIFEST.in
"$PY" setup.py -q egg_info --egg-base "$WORK/egg" sdist -d "$WORK/sdist" >/dev/null
SDIST=$(ls "$WORK"/sdist/*.tar.gz)
echo "sdist: $(basename "$SDIST") ($((SECONDS - start)) s)"
# pip unpacks the sdist into a temporary folder of its own and builds there, from scratch.
"$PY" -m pip wheel -q --disable-pip-version-check --no-build-isolation --no-deps \
  -w "$WORK/dist" "$SDIST"
echo "wheel from the sdist: $(basename "$WORK"/dist/*.whl) ($((SECONDS - start)) s)"
# The fresh venv comes from the same base Python as the build's.
BASE_PY=$("$PY" -c "import sys; print(getattr(sys, '_base_executable', sys.executable))")
"$BASE_PY" -m venv "$WORK/venv"
TORCH_VERSION=$("$PY" -c "import torch; print(torch.__version__.split('+')[0])")
"$WORK/venv/bin/python" -m pip install -q --disable-pip-version-check "torch==$TORCH_VERSION" numpy
"$WORK/venv/bin/python" -m pip install -q --disable-pip-version-check --no-deps "$WORK"/dist/*.whl
cd "$WORK/dist" && "$WORK/venv/bin/python" -c "
import os, sys, torch, rlx_torch
assert rlx_torch.__file__.startswith(sys.prefix), rlx_torch.__file__
ops = sorted(n for n in torch._C._dispatch_get_all_op_names() if n.startswith('rlx::'))
assert ops, 'the wheel registered no rlx ops'
print('wheel ok: rlx_torch', rlx_torch.__version__, 'from', rlx_torch.__file__, 'ops:', ops)
"
