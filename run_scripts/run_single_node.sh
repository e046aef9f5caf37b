#!/usr/bin/env bash
# Launch one SPES node: torchrun over this machine's devices with configs/.../node_<id>.yaml.
#   run_scripts/run_single_node.sh <node_id> [--resume[=auto]] [--section.key=value ...]
#   run_scripts/run_single_node.sh <node_id> --preflight [--resume[=auto]] [--section.key=value ...]   # check the
#     node as that start would take it, train nothing
# Env: CONFIG_DIR (default configs/spes_1b), CONFIG (default $CONFIG_DIR/node_<id>.yaml),
#      NPROC_PER_NODE (default: every GPU, or 1 on a CPU machine, counted by $PYTHON), PYTHON (default
#      .venv/bin/python, else python3), DATA_SEED (see below).
# Data order: a node reads in the order of its data.seed. Node files (node_<id>.yaml) carry their own (6198, 7198,
# ... as the first implementation's), and so does a CONFIG whose spes_config.peer_id is <id> (the node's own file,
# by any path); any other CONFIG is one file for every node, and node <id> gets --data.seed=<the run's seed +
# 1000 * id> (the first implementation's launchers' rule; the run's seed is the file's data.seed - 1000 * its
# spes_config.peer_id). DATA_SEED, when set, wins.
# It runs in the repository: relative paths in the config and the overrides are read from there; a relative CONFIG is
# the file in the folder it is started in when there is one, else the repository's.
# Extra arguments are passed through as overrides and win over the defaults set here. spes.torchrun is torchrun
# that ends a failed run with the failing node's one-line error instead of a ChildFailedError traceback.
set -euo pipefail
[[ "${1:-}" =~ ^(-h|--help)$ ]] && { sed -n '2,/^[^#]/{/^#SBATCH/d;s/^# \{0,1\}//p;}' "$0"; exit 0; }  # the header above is the help
CALLER=$PWD
cd "$(dirname "$0")/.."
if [ $# -lt 1 ] || ! [[ "$1" =~ ^[0-9]+$ ]]; then
  echo "usage: $0 <node_id> [--resume | --preflight] [--section.key=value ...]" >&2
  exit 2
fi
NODE_ID=$1; shift
CONFIG_DIR=${CONFIG_DIR:-configs/spes_1b}
CONFIG=${CONFIG:-$CONFIG_DIR/node_${NODE_ID}.yaml}
PYTHON=${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}
ELSEWHERE=  # NOTE: started from another folder, a relative CONFIG there was "not found" and --save_folder=x went into
# the repository unsaid: the caller's file is taken, and the start line says where relative paths are read from
if ! [ "$PWD" -ef "$CALLER" ]; then
  ELSEWHERE="; relative paths in it and in the overrides are read from the repository, $PWD"
  if [[ $CONFIG != /* ]] && [ -f "$CALLER/$CONFIG" ]; then CONFIG=$CALLER/$CONFIG; fi
fi
[ -f "$CONFIG" ] || { echo "error: config $CONFIG not found${ELSEWHERE:+ in $CALLER nor in the repository $PWD}" \
  "(set CONFIG or CONFIG_DIR)" >&2; exit 2; }
if [ -n "${NPROC_PER_NODE:-}" ] && ! [[ "$NPROC_PER_NODE" =~ ^[1-9][0-9]*$ ]]; then  # else blamed on the interpreter
  echo "error: NPROC_PER_NODE='$NPROC_PER_NODE' must be a positive integer (processes on this node), or unset (every" \
    "GPU, else 1)" >&2
  exit 2
fi
# NOTE: the devices are counted by the interpreter that trains: another one (the system python3) may lack torch.
DEVICES=$(NPROC_PER_NODE=${NPROC_PER_NODE:-} "$PYTHON" -m spes.preflight --devices) || {
  echo "error: $PYTHON could not count this machine's devices (see above): run run_scripts/setup.sh, set PYTHON to" \
    "the project's interpreter, or set NPROC_PER_NODE" >&2; exit 2; }
NPROC_PER_NODE=${DEVICES%% *}
ARGS=(--spes_config.peer_id="$NODE_ID")
if [ -n "${DATA_SEED:-}" ]; then
  ARGS+=(--data.seed="$DATA_SEED")
elif [ "$CONFIG" != "$CONFIG_DIR/node_${NODE_ID}.yaml" ]; then
  # NOTE: a node's own file is told by its peer_id, not its path: ./configs/spes_1b/node_1.yaml gave node 1 node 2's
  # data order (7198 + 1000); another node's seed is the run's (node_1.yaml's 7198 - 1000) + 1000 * its id
  SEED=$("$PYTHON" -c 'import sys
from spes.config import load_config, run_data_seed
try:
    print(run_data_seed(load_config(sys.argv[1])[0], int(sys.argv[2])))
except (ValueError, FileNotFoundError) as e:
    sys.exit(f"error: {e}")' "$CONFIG" "$NODE_ID") || exit 2
  ARGS+=(--data.seed="$SEED")
fi
PREFLIGHT=0
for arg in "$@"; do
  if [ "$arg" = --preflight ]; then PREFLIGHT=1; else ARGS+=("$arg"); fi
done
echo "node $NODE_ID: $NPROC_PER_NODE process(es) on ${DEVICES#* }, config $CONFIG$ELSEWHERE"
if [ "$PREFLIGHT" = 1 ]; then  # NOTE: --resume too: a resumed node joins (and takes its save folder) as its run's
  exec "$PYTHON" -m spes.preflight "$CONFIG" --nproc "$NPROC_PER_NODE" "${ARGS[@]}"
fi
exec "$PYTHON" -m spes.torchrun --standalone --nproc_per_node="$NPROC_PER_NODE" -m spes.train "$CONFIG" \
  "${ARGS[@]}"
