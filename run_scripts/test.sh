#!/usr/bin/env bash
# The test suite: installs what it needs, then runs pytest on PYTEST_WORKERS processes (pytest-xdist, default 2;
# 0 runs in this process) with extra args passed through (e.g. -k merge), and lists the 15 slowest tests, so a
# suite that grows past its time budget shows where. `--dist worksteal`: a worker that runs out of tests takes half of
# what the other still has queued, instead of stopping while the other runs its queue out alone.
set -euo pipefail
cd "$(dirname "$0")/.."
bash run_scripts/setup.sh
exec .venv/bin/python -m pytest -q -n "${PYTEST_WORKERS:-2}" --dist worksteal --durations=15 "$@"
