#!/usr/bin/env bash
# Run HERE (a machine with the package registry), before `bash bench/run_gpu.sh` on the lent GPU machine.
#
#   bash bench/prepare_gpu.sh     Env: PYTHON (default .venv/bin/python), whose pip downloads the wheels
#
# The lent GPU machine (docs of the device tool: KINDS.md) reaches no network. Its image has python3 3.12 with a
# CUDA torch (2.11.0+cu130 when last seen), numpy, pyyaml, safetensors, tokenizers, grpcio, protobuf, psutil,
# pytest, pytest-timeout and pytest-xdist, but not omegaconf (spes.config), grpcio-health-checking (the sync
# wing that `python -m spes.preflight` imports), zstandard (the token-file tests) nor cryptography (the sync
# tests' certificates; with cffi and pycparser) nor liger-kernel (bench_gpu.py's liger variant), and its grpcio (1.84.0 when last seen) is older than the one
# spes/sync/proto was generated for. This downloads their wheels for CPython 3.12 on x86-64 (grpcio and
# protobuf at this machine's versions, which the generated code needs) into .whl/ (ignored by git), and writes
# .whl/COMMIT: the checked-out commit as every benchmark names it (bench/common.py `git_commit`: -dirty-<sha256 of
# the diff> when the tree differs), since the device gets the working tree without .git; bench/run_gpu.sh exports it
# as SPES_COMMIT, which every benchmark's record then names. Carry .whl with the run: carry [".whl"].
set -euo pipefail
[[ "${1:-}" =~ ^(-h|--help)$ ]] && { sed -n '2,/^[^#]/{/^#SBATCH/d;s/^# \{0,1\}//p;}' "$0"; exit 0; }  # the header above is the help
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
mkdir -p .whl
# liger-kernel (pure Python over the device's triton): bench_gpu.py's liger variant, against spes.head_loss's head
LIGER=liger-kernel==0.8.5
version() { "$PY" -c "import importlib.metadata as m; print(m.version('$1'))"; }
for spec in "omegaconf==$(version omegaconf)" "grpcio-health-checking==$(version grpcio-health-checking)" \
    "protobuf==$(version protobuf)" "grpcio==$(version grpcio)" "zstandard==$(version zstandard)" \
    "cryptography==$(version cryptography)" "cffi==$(version cffi)" "pycparser==$(version pycparser)" \
    "$LIGER"; do
  "$PY" -m pip download -q --disable-pip-version-check --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 -d .whl "$spec"
done
commit=$(env -u SPES_COMMIT "$PY" -c "import sys; sys.path.insert(0, 'bench'); from common import git_commit; print(git_commit())")
echo "$commit" > .whl/COMMIT
ls .whl
echo "prepared .whl for commit $commit; now run on the device: bash bench/run_gpu.sh (carry .whl)"
