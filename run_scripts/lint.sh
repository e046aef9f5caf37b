#!/usr/bin/env bash
# Lint, import order, format, type and architecture (import-linter) checks, exactly as CI runs them (.ci/run, before the tests):
#   bash run_scripts/lint.sh          # check only; non-zero exit on any finding
#   bash run_scripts/lint.sh --fix    # first format the tree and apply ruff's safe fixes, then check
# Settings (line length, rules, mypy strictness, excluded files) live in pyproject.toml.
set -euo pipefail
[[ "${1:-}" =~ ^(-h|--help)$ ]] && { sed -n '2,/^[^#]/{/^#SBATCH/d;s/^# \{0,1\}//p;}' "$0"; exit 0; }  # the header above is the help
cd "$(dirname "$0")/.."
case "${1:-}" in
  "" | --fix) ;;
  *) echo "usage: bash run_scripts/lint.sh [--fix]" >&2; exit 2 ;;
esac
bash run_scripts/setup.sh
if [ "${1:-}" = "--fix" ]; then
  .venv/bin/ruff format . && .venv/bin/ruff check --fix --exit-zero .
fi
status=0
.venv/bin/ruff check . || status=1
.venv/bin/ruff format --check . || status=1
.venv/bin/mypy || status=1
.venv/bin/lint-imports --no-cache || status=1
exit "$status"
