#!/usr/bin/env bash
# Start the SPES parameter server for a run. Its run settings come from the run's YAML (any node's file): peers,
# experts per block, mode, and the `server:` section (merge warm-up, DiLoCo outer optimizer, dead peers).
#
#   run_scripts/run_parameter_server.sh configs/spes_1b/node_0.yaml [--section.key=value ...] [server flags]
#
# Extra arguments go to `python -m spes.server` (`--help` lists them): overrides of the run's config, the same
# ones the nodes get (e.g. --server.merge_interval=200), and deployment flags (--token_file, --tls_cert,
# --tls_key, --state_dir, --host ...). The shared secret is read from SPES_TOKEN (or --token_file); it is never
# logged. Env: PORT [50051]: the gRPC port; DATA_PORT [0]: the raw-TCP data plane for tensor payloads (0:
# OS-chosen, advertised to the peers at Join; set a fixed port when a firewall sits between them; -1: disabled,
# everything over gRPC); PYTHON [the repository's .venv/bin/python, else python3].
# The environment of earlier versions still works (TOTAL_PEERS and NUM_TRAIN_EXPERTS_PER_NODE, checked against the
# YAML or, without one, the run's layout; MERGE_INTERVAL, MERGE_ALPHA_START, MERGE_DECAY_STEPS, MERGE_TOPK: the
# server section's keys).
set -euo pipefail

PORT=${PORT:-50051}
DATA_PORT=${DATA_PORT:-0}
# NOTE: no cd to the repository: the YAML, --token_file and --state_dir are paths from where it is started
ROOT=$(cd "$(dirname "$0")/.." && pwd)
PYTHON=${PYTHON:-$( [ -x "$ROOT/.venv/bin/python" ] && echo "$ROOT/.venv/bin/python" || echo python3 )}
ARGS=()
if [ $# -gt 0 ] && [[ "$1" != -* ]]; then ARGS+=("$1"); shift; fi
[ -n "${TOTAL_PEERS:-}" ] && ARGS+=(--total_peers "$TOTAL_PEERS")
[ -n "${NUM_TRAIN_EXPERTS_PER_NODE:-}" ] && ARGS+=(--num_train_experts_per_node "$NUM_TRAIN_EXPERTS_PER_NODE")
[ -n "${MERGE_INTERVAL:-}" ] && ARGS+=(--server.merge_interval="$MERGE_INTERVAL")
[ -n "${MERGE_ALPHA_START:-}" ] && ARGS+=(--server.merge_alpha_start="$MERGE_ALPHA_START")
[ -n "${MERGE_DECAY_STEPS:-}" ] && ARGS+=(--server.merge_decay_steps="$MERGE_DECAY_STEPS")
[ -n "${MERGE_TOPK:-}" ] && ARGS+=(--server.merge_topk="$MERGE_TOPK")

exec "$PYTHON" -m spes.server "${ARGS[@]}" --port "$PORT" --data_port "$DATA_PORT" "$@"
