#!/usr/bin/env bash
# Builds a wheel and proves it installs into a fresh virtual env and imports there.
set -euo pipefail
cd "$(dirname "$0")/.."
rm -rf dist /tmp/rlx_wheel_venv
.venv/bin/pip wheel -q --disable-pip-version-check --no-build-isolation --no-deps -w dist .
python3 -m venv /tmp/rlx_wheel_venv
TORCH_VERSION=$(.venv/bin/python -c "import torch; print(torch.__version__.split('+')[0])")
/tmp/rlx_wheel_venv/bin/pip install -q --disable-pip-version-check "torch==$TORCH_VERSION" numpy
/tmp/rlx_wheel_venv/bin/pip install -q --disable-pip-version-check --no-deps dist/rlx_torch-*.whl
cd /tmp && /tmp/rlx_wheel_venv/bin/python -c "
import torch, rlx_torch
print('wheel ok: rlx_torch', rlx_torch.__version__, 'ops:', sorted(torch.ops.rlx.__dir__())[:8])
"
