#!/usr/bin/env bash
# The sparse codec's emulated-link round on a machine with a core for every process of it (issue 27's 90% of the
# link's ideal): the lent device's 16 cores hold the 4 peers, the server and the relay, which on the 2-core
# development machine share two cores, so there the peers' encoding alone, one after another on two cores, bounds
# the 100 Mbit/s round (docs/benchmarks.md, the figure wan.sparse_host_round). After `bash bench/prepare_gpu.sh`
# here, and after bench/run_gpu.sh (the GPU's own benchmark goes first):
#
#   device run: command "bash bench/run_wan_cores.sh", carry [".whl"], timeout_s 420
#
# About 4 minutes (the first round sends the 1/12 model's full values down); arguments replace `--speeds 100`.
# Leaves $OUT/bench_wan_sparse_cores.json (commit it as bench/results/bench_wan_sparse_cores.json) and the log.
set -uo pipefail
[[ "${1:-}" =~ ^(-h|--help)$ ]] && { sed -n '2,/^[^#]/{/^#SBATCH/d;s/^# \{0,1\}//p;}' "$0"; exit 0; }  # the header above is the help
cd "$(dirname "$0")/.."
exec > >(tee "${OUT:-bench/results}/run_wan_cores.log") 2>&1
source bench/device_env.sh
echo "cores: $(nproc)"
args=("$@")
[ ${#args[@]} -eq 0 ] && args=(--speeds 100)
"$PY" bench/bench_wan.py --wires sparse --planes tcp --rounds 3 --out "$OUT/bench_wan_sparse_cores.json" "${args[@]}"
