#!/usr/bin/env bash
# The main job: set-up, then the demo (arguments are passed through).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
exec .venv/bin/python -m rlx_torch.demo "$@"
