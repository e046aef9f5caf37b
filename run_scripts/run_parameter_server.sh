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
# server section's keys); a line on stderr names the variables taken, so that a refusal of one is traced to it.
set -euo pipefail

# NOTE: no cd to the repository: the YAML, --token_file and --state_dir are paths from where it is started
ROOT=$(cd "$(dirname "$0")/.." && pwd)
PYTHON=${PYTHON:-$( [ -x "$ROOT/.venv/bin/python" ] && echo "$ROOT/.venv/bin/python" || echo python3 )}
ARGS=()
if [ $# -gt 0 ] && [[ "$1" != -* ]]; then ARGS+=("$1"); shift; fi
TAKEN=""
from_env() {  # VAR FLAG [DEFAULT]: FLAG=$VAR when VAR is set (noted for the line below), else FLAG=DEFAULT if given
  local value=${!1:-}
  if [ -n "$value" ]; then
    ARGS+=("$2=$value")
    TAKEN+="${TAKEN:+; }$1=$value as $2=$value"
  elif [ $# -gt 2 ]; then
    ARGS+=("$2=$3")
  fi
}
from_env TOTAL_PEERS --total_peers
from_env NUM_TRAIN_EXPERTS_PER_NODE --num_train_experts_per_node
from_env MERGE_INTERVAL --server.merge_interval
from_env MERGE_ALPHA_START --server.merge_alpha_start
from_env MERGE_DECAY_STEPS --server.merge_decay_steps
from_env MERGE_TOPK --server.merge_topk
from_env PORT --port 50051
from_env DATA_PORT --data_port 0
# NOTE: a refusal of one of these names its flag; this line names the variable the user set
if [ -n "$TAKEN" ]; then echo "run_parameter_server.sh: from the environment: $TAKEN" >&2; fi

exec "$PYTHON" -m spes.server "${ARGS[@]}" "$@"
