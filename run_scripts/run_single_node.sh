#!/usr/bin/env bash
# Launch one SPES node: torchrun over this machine's devices with configs/.../node_<id>.yaml.
#   run_scripts/run_single_node.sh <node_id> [--resume[=auto]] [--section.key=value ...]
# Env: CONFIG_DIR (default configs/spes_1b), CONFIG (default $CONFIG_DIR/node_<id>.yaml),
#      NPROC_PER_NODE (default: number of GPUs, or 1 on a CPU machine), DATA_SEED (default 6198 + 1000 * id).
# Extra arguments are passed through as overrides and win over the defaults set here. spes.torchrun is torchrun
# that ends a failed run with the failing node's one-line error instead of a ChildFailedError traceback.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ $# -lt 1 ] || ! [[ "$1" =~ ^[0-9]+$ ]]; then
  echo "usage: $0 <node_id> [--resume] [--section.key=value ...]" >&2
  exit 2
fi
NODE_ID=$1; shift
CONFIG_DIR=${CONFIG_DIR:-configs/spes_1b}
CONFIG=${CONFIG:-$CONFIG_DIR/node_${NODE_ID}.yaml}
if [ -z "${NPROC_PER_NODE:-}" ]; then
  NPROC_PER_NODE=$(python3 -c "import torch; print(max(torch.cuda.device_count(), 1))" 2>/dev/null || echo 1)
fi
DATA_SEED=${DATA_SEED:-$((6198 + 1000 * NODE_ID))}
PYTHON=${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}
[ -f "$CONFIG" ] || { echo "error: config $CONFIG not found (set CONFIG or CONFIG_DIR)" >&2; exit 2; }
echo "node $NODE_ID: $NPROC_PER_NODE process(es), config $CONFIG, data seed $DATA_SEED"
exec "$PYTHON" -m spes.torchrun --standalone --nproc_per_node="$NPROC_PER_NODE" -m spes.train "$CONFIG" \
  --spes_config.peer_id="$NODE_ID" --data.seed="$DATA_SEED" "$@"
