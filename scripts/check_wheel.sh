#!/usr/bin/env bash
# Builds a wheel and proves it installs into a fresh virtual env and imports there.
set -euo pipefail
cd "$(dirname "$0")/.."
rm -rf dist /tmp/rlx_wheel_venv
flock /tmp/rlx_torch_build.lock .venv/bin/pip wheel -q --disable-pip-version-check --no-build-isolation --no-deps -w dist .
python3 -m venv /tmp/rlx_wheel_venv
TORCH_VERSION=$(.venv/bin/python -c "import torch; print(torch.__version__.split('+')[0])")
/tmp/rlx_wheel_venv/bin/pip install -q --disable-pip-version-check "torch==$TORCH_VERSION" numpy
/tmp/rlx_wheel_venv/bin/pip install -q --disable-pip-version-check --no-deps dist/rlx_torch-*.whl
cd /tmp && /tmp/rlx_wheel_venv/bin/python -c "
import torch, rlx_torch
ops = sorted(n for n in torch._C._dispatch_get_all_op_names() if n.startswith('rlx::'))
assert ops, 'the wheel registered no rlx ops'
print('wheel ok: rlx_torch', rlx_torch.__version__, 'from', rlx_torch.__file__, 'ops:', ops)
"
