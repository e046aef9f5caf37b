#!/usr/bin/env bash
# Start the SPES parameter server. Settings come from environment variables (defaults below);
# any extra arguments are passed through, e.g. `--mode diloco --token_file secret.txt --tls_cert ...`.
#
#   TOTAL_PEERS=4 NUM_TRAIN_EXPERTS_PER_NODE=4 PORT=50051 run_scripts/run_parameter_server.sh
#
# The shared secret is read from SPES_TOKEN (or pass --token_file); it is never logged.
# Tensor payloads go over a raw-TCP data plane on DATA_PORT (0: OS-chosen, advertised to the peers at
# Join; set a fixed port when a firewall sits between them; -1: disabled, everything over gRPC).
set -euo pipefail

TOTAL_PEERS=${TOTAL_PEERS:-4}
NUM_TRAIN_EXPERTS_PER_NODE=${NUM_TRAIN_EXPERTS_PER_NODE:-4}
PORT=${PORT:-50051}
DATA_PORT=${DATA_PORT:-0}
MERGE_INTERVAL=${MERGE_INTERVAL:-500}
MERGE_ALPHA_START=${MERGE_ALPHA_START:-0.01}
MERGE_DECAY_STEPS=${MERGE_DECAY_STEPS:-10000}
MERGE_TOPK=${MERGE_TOPK:-4}
PYTHON=${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}

exec "$PYTHON" -m spes.server \
  --total_peers "$TOTAL_PEERS" \
  --num_train_experts_per_node "$NUM_TRAIN_EXPERTS_PER_NODE" \
  --port "$PORT" \
  --data_port "$DATA_PORT" \
  --merge_interval "$MERGE_INTERVAL" \
  --merge_alpha_start "$MERGE_ALPHA_START" \
  --merge_decay_steps "$MERGE_DECAY_STEPS" \
  --merge_topk "$MERGE_TOPK" \
  "$@"
