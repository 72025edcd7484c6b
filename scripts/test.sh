#!/usr/bin/env bash
# The whole test suite: set-up, lint, the pytest suite, then the wheel check.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
.venv/bin/ruff check .
.venv/bin/python -m pytest -q "$@"
bash scripts/check_wheel.sh
