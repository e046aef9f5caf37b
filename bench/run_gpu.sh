#!/usr/bin/env bash
# The one command a session with the lent GPU runs (issue 29), after `bash bench/prepare_gpu.sh` here:
#
#   device run: command "bash bench/run_gpu.sh", carry [".whl"], timeout_s 600
#   bash bench/run_gpu.sh [bench/bench_gpu.py flags]
#
# Arguments go on to bench/bench_gpu.py (a rerun of some variants: --only NAME,NAME --no-preflight).
# Time: the tests at most 60 s, variants started until 270 s, each in a process of its own stopped after 120 s,
# the preflight at most 90 s: under the 600 s a command may run; a run cut short still leaves the record of every
# variant finished (status "running").
#
# On the device (no network; python3 with CUDA torch, see bench/prepare_gpu.sh for what it lacks) it installs the
# carried wheels into /tmp/site, then
#   1. runs the GPU-marked tests: python -m pytest -m gpu (at most GPU_TESTS_S seconds; junit file in $OUT),
#   2. runs bench/bench_gpu.py on the 1B SPES node (variants until BUDGET_S seconds, each written to
#      $OUT/bench_gpu.json as it finishes), which also records the tests' outcome and `python -m spes.preflight
#      --gpu`'s output (the same measurement code),
# and leaves $OUT/bench_gpu.json (commit it as bench/results/bench_gpu.json), $OUT/gpu_tests.xml and the log
# $OUT/run_gpu.log. Off the device (no $OUT) it writes to bench/results/.
set -uo pipefail
[[ "${1:-}" =~ ^(-h|--help)$ ]] && { sed -n '2,/^[^#]/{/^#SBATCH/d;s/^# \{0,1\}//p;}' "$0"; exit 0; }  # the header above is the help
cd "$(dirname "$0")/.."
GPU_TESTS_S=${GPU_TESTS_S:-60}
BUDGET_S=${BUDGET_S:-270}
VARIANT_TIMEOUT_S=${VARIANT_TIMEOUT_S:-120}
exec > >(tee "${OUT:-bench/results}/run_gpu.log") 2>&1
source bench/device_env.sh
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
echo "=== pytest -m gpu (at most ${GPU_TESTS_S}s)"
timeout "$GPU_TESTS_S" "$PY" -m pytest -m gpu -q -p no:cacheprovider --continue-on-collection-errors --junitxml="$OUT/gpu_tests.xml" tests
echo "pytest -m gpu exit status $? (5: no test is marked gpu; 124: timed out)"
echo "=== bench_gpu (variants until ${BUDGET_S}s)"
"$PY" bench/bench_gpu.py --device cuda --budget_s "$BUDGET_S" --variant_timeout_s "$VARIANT_TIMEOUT_S" --pytest_junit "$OUT/gpu_tests.xml" --preflight \
  --out "$OUT/bench_gpu.json" "$@"
