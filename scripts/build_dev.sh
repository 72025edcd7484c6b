#!/usr/bin/env bash
# Incremental in-place build of rlx_torch._C for development (ninja reuses objects).
# Serialized by a lock in this checkout's build/ (tools/with_lock.py, a portable flock), so
# that several shells building here at once never collide; other checkouts are not affected.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-.venv/bin/python}"
exec "$PY" tools/with_lock.py build/.build.lock "$PY" setup.py -q build_ext --inplace
