#!/usr/bin/env bash
# Creates .venv (if missing) with torch and the project's tools, then builds rlx_torch._C.
# Idempotent: a second run only rebuilds what changed. Source it or call it.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON_BIN="${PYTHON_BIN:-python3}"
TORCH_SPEC="${RLX_TORCH_SPEC:-torch==2.13.0}"
if [ ! -x .venv/bin/python ]; then
  "$PYTHON_BIN" -m venv .venv
fi
# Install torch first and on its own, so that no later step can pull another (CUDA) build.
if ! .venv/bin/python -c "import torch" 2>/dev/null; then
  .venv/bin/python -m pip install -q --disable-pip-version-check "$TORCH_SPEC"
fi
.venv/bin/python -m pip install -q --disable-pip-version-check \
  "setuptools>=77" wheel ninja pybind11 numpy pytest pytest-xdist==3.8.0 expecttest hypothesis ruff \
  tqdm matplotlib
# transformers (rlx_torch.integrations, their tests, benchmarks/bench_transformers.py),
# safetensors and aqlm (AQLM checkpoints; aqlm's CPU layer, with numba, is the tests' second
# reference) and einops (fla's naive references, read from the fla-core wheel by
# tests/test_compat_fla.py). aqlm needs torch: the one installed above satisfies it, and the
# others do not depend on torch, so no other torch build can come in.
.venv/bin/python -m pip install -q --disable-pip-version-check transformers==5.24.0 \
  safetensors==0.8.0 "aqlm[cpu]==1.1.7" einops==0.8.2
# In-place build (incremental); scripts/check_wheel.sh covers `pip install`/wheels.
PYTHON=.venv/bin/python bash scripts/build_dev.sh
# Put the source tree on the venv's path so benchmarks and examples import the in-place build.
SITE=$(.venv/bin/python -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
pwd > "$SITE/rlx_torch_dev.pth"
.venv/bin/python -m pip download -q --disable-pip-version-check --no-deps fla-core==0.6.0 -d .cache/fla-core \
  || echo "fla-core wheel not available: tests/test_compat_fla.py will skip its comparisons with fla"
