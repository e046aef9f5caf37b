#!/usr/bin/env bash
# The test suite: installs what it needs, then runs pytest on PYTEST_WORKERS processes (pytest-xdist, default 2;
# 0 runs in this process) with extra args passed through (e.g. -k merge), and lists the 15 slowest tests, so a
# suite that grows past its time budget shows where.
set -euo pipefail
cd "$(dirname "$0")/.."
bash run_scripts/setup.sh
exec .venv/bin/python -m pytest -q -n "${PYTEST_WORKERS:-2}" --durations=15 "$@"
