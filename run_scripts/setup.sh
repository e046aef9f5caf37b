#!/usr/bin/env bash
# Create .venv and install spes with its test extras. Idempotent: re-running with everything installed
# takes about a second (a stamp keyed on pyproject.toml). torch is installed first and pinned, so no other
# package can pull a multi-GB CUDA build on CPU machines.
#
#   bash run_scripts/setup.sh      Env (defaults): VENV (.venv), TORCH_VERSION (2.13.0), PYTHON (python3)
set -euo pipefail
[[ "${1:-}" =~ ^(-h|--help)$ ]] && { sed -n '2,/^[^#]/{/^#SBATCH/d;s/^# \{0,1\}//p;}' "$0"; exit 0; }  # the header above is the help
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
TORCH_VERSION=${TORCH_VERSION:-2.13.0}
PYTHON=${PYTHON:-python3}

[ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
stamp="$VENV/.spes-installed"
key="torch=$TORCH_VERSION $(sha256sum pyproject.toml | cut -c1-16)"
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$key" ] && "$VENV/bin/python" -c "import spes, torch" 2>/dev/null; then
  exit 0
fi
echo "setup: installing torch==$TORCH_VERSION and spes[dev] into $VENV (a few minutes the first time)"
pip_install() {  # pip's progress, a line per package it collects and one per install, without its notes
  "$VENV/bin/python" -m pip install --progress-bar off --disable-pip-version-check "$@" 2>&1 \
    | { grep --line-buffered -E "^(Collecting|Installing|Successfully|ERROR)" | sed -u 's/^/setup: /' || true; }
}
pip_install "torch==$TORCH_VERSION"
pip_install -e ".[dev]"
echo "$key" > "$stamp"
