#!/usr/bin/env bash
# The test suite: installs what it needs, then runs pytest (extra args pass through, e.g. -k merge).
set -euo pipefail
cd "$(dirname "$0")/.."
bash run_scripts/setup.sh
exec .venv/bin/python -m pytest -q "$@"
