#!/usr/bin/env bash
# Incremental in-place build of rlx_torch._C for development (ninja reuses objects).
# Serialized with flock so that several shells building at once never collide.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-.venv/bin/python}"
exec flock /tmp/rlx_torch_build.lock "$PY" setup.py -q build_ext --inplace
