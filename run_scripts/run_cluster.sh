#!/usr/bin/env bash
#SBATCH --job-name=spes
#SBATCH --ntasks-per-node=1
# A whole SPES run under SLURM: one task per node, each node an independent DDP/FSDP trainer, and the
# parameter server on the first node. Submit from the repository root:
#
#   sbatch --nodes=4 --ntasks-per-node=1 --gpus-per-node=8 run_scripts/run_cluster.sh [--section.key=value ...]
#
# The batch step (which SLURM runs on the allocation's first node) starts the parameter server there,
# waits until it listens, then `srun`s this script once per task; each task is node <SLURM_PROCID> of
# the run and starts `torchrun --standalone` over its own GPUs, so a node's DDP/FSDP process group never
# leaves the node and nodes meet only at the server. When every node is done the server is stopped.
#
# Env (defaults in brackets):
#   CONFIG_DIR [configs/spes_1b]  CONFIG [$CONFIG_DIR/node_<id>.yaml]: each node's config
#   NPROC_PER_NODE [SLURM_GPUS_ON_NODE, else every GPU the node's $PYTHON sees, else 1]: processes per node
#   PORT [50051]: server port on the first node; SERVER_HOST [first host of SLURM_JOB_NODELIST]
#   The server's run settings (peers, experts per block, mode, the `server:` section) come from node 0's config
#   with the same overrides, so they cannot disagree with the nodes'.
#   SPES_ROOT [SLURM_SUBMIT_DIR]: the repository; PYTHON [.venv/bin/python, else python3]
#   LOG_DIR [output/slurm-<job id>]: where the server log goes (node output: the job's output, by task)
#   STATE_DIR [the parent of node 0's save_folder, /server_state]: the server's rounds, kept across jobs
# Per node: --spes_config.peer_id=<id> (node p reads the data in the order of data.seed + 1000 * p),
# --spes_config.server_addr=<host>:<port>, --resume=auto; extra arguments are passed to every node's trainer
# (and, but --resume, to the server) after these and win over them.
# A requeued (or resubmitted) job continues where it stopped: the server restores its last round from
# STATE_DIR and every node resumes from its save_folder's latest checkpoint (or starts fresh if it has none).
set -euo pipefail

ROOT=${SPES_ROOT:-${SLURM_SUBMIT_DIR:-$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)}}
cd "$ROOT"
PYTHON=${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}
CONFIG_DIR=${CONFIG_DIR:-configs/spes_1b}
PORT=${PORT:-50051}

die() { echo "run_cluster.sh: error: $*" >&2; exit 2; }
[ -n "${SLURM_JOB_ID:-}" ] || die "not inside a SLURM job; submit with: sbatch --nodes=N run_scripts/run_cluster.sh"
config_of() { echo "${CONFIG:-$CONFIG_DIR/node_$1.yaml}"; }

if [ "${SPES_CLUSTER_ROLE:-batch}" = node ]; then
  # ---- one task per node ----
  NODE_ID=${SLURM_PROCID:?SLURM_PROCID is not set: this part runs under srun}
  CFG=$(config_of "$NODE_ID")
  [ -f "$CFG" ] || die "config $CFG not found (set CONFIG or CONFIG_DIR)"
  DEVICES=$(NPROC_PER_NODE=${NPROC_PER_NODE:-${SLURM_GPUS_ON_NODE:-}} "$PYTHON" -m spes.preflight --devices) ||
    die "$PYTHON could not count the devices of $(hostname): run run_scripts/setup.sh there, or set NPROC_PER_NODE"
  NPROC=${DEVICES%% *}
  echo "node $NODE_ID on $(hostname): $NPROC process(es) on ${DEVICES#* }, config $CFG, server $SERVER_ADDR"
  # NOTE: spes.torchrun is torchrun ending a failed node with its one-line error, not a ChildFailedError block
  exec "$PYTHON" -m spes.torchrun --standalone --nproc_per_node="$NPROC" -m spes.train "$CFG" \
    --spes_config.peer_id="$NODE_ID" --spes_config.server_addr="$SERVER_ADDR" --resume=auto "$@"
fi

# ---- the batch step, on the first node ----
NUM_NODES=${SLURM_NTASKS:-${SLURM_JOB_NUM_NODES:-1}}
FIRST_HOST=$(scontrol show hostnames "${SLURM_JOB_NODELIST:?}" | head -n1)
SERVER_HOST=${SERVER_HOST:-$FIRST_HOST}
CFG0=$(config_of 0)
[ -f "$CFG0" ] || die "config $CFG0 not found (set CONFIG or CONFIG_DIR)"
# The server reads its run settings from node 0's config with the nodes' overrides (all but --resume); here only
# the node count and the default state directory are read from it.
OVERRIDES=()
for arg in "$@"; do [[ "$arg" == --resume* ]] || OVERRIDES+=("$arg"); done
SETTINGS=$("$PYTHON" - "$CFG0" "${OVERRIDES[@]}" 2>&1 <<'EOF'
import sys
from pathlib import Path
from spes.config import load_config
try:
    cfg, _ = load_config(sys.argv[1], sys.argv[2:])
except (ValueError, FileNotFoundError) as e:
    sys.exit(f"error: {e}")
print(cfg.num_peers, Path(cfg.save_folder).parent / "server_state")
EOF
) || die "${SETTINGS#error: }"
read -r CFG_PEERS CFG_STATE_DIR <<< "$(tail -n1 <<< "$SETTINGS")"
[ "$CFG_PEERS" -eq "$NUM_NODES" ] || die "the config has spes_config.num_peers=$CFG_PEERS but the job runs \
$NUM_NODES task(s); submit with --nodes=$CFG_PEERS --ntasks-per-node=1 (or override --spes_config.num_peers)"
export PORT
LOG_DIR=${LOG_DIR:-output/slurm-$SLURM_JOB_ID}
STATE_DIR=${STATE_DIR:-$CFG_STATE_DIR}
mkdir -p "$LOG_DIR"
echo "job $SLURM_JOB_ID: $NUM_NODES node(s), parameter server on $SERVER_HOST:$PORT (log $LOG_DIR/server.log, \
state $STATE_DIR)"
# NOTE: --insecure: the job's nodes reach the server over the cluster network; set SPES_TOKEN and pass TLS files
# (run_parameter_server.sh arguments) to protect it.
PYTHON=$PYTHON bash run_scripts/run_parameter_server.sh "$CFG0" "${OVERRIDES[@]}" --state_dir "$STATE_DIR" \
  --insecure > "$LOG_DIR/server.log" 2>&1 &
SERVER_PID=$!
trap 'kill "$SERVER_PID" 2>/dev/null || true; wait "$SERVER_PID" 2>/dev/null || true' EXIT
for _ in $(seq 1 120); do
  grep -q "listening" "$LOG_DIR/server.log" 2>/dev/null && break
  kill -0 "$SERVER_PID" 2>/dev/null || die "the parameter server exited: $(tail -n1 "$LOG_DIR/server.log")"
  sleep 0.5
done
grep -q "listening" "$LOG_DIR/server.log" || die "the parameter server did not start within 60 s"

export SPES_CLUSTER_ROLE=node SERVER_ADDR="$SERVER_HOST:$PORT"
# NOTE: srun gives a task one CPU unless told otherwise; a node's trainer wants all of its node's CPUs.
CPUS_PER_TASK=${SLURM_CPUS_PER_TASK:-$(( ${SLURM_CPUS_ON_NODE:-1} / ${SLURM_NTASKS_PER_NODE:-1} ))}
srun --kill-on-bad-exit=1 --label --ntasks="$NUM_NODES" --cpus-per-task="$(( CPUS_PER_TASK > 0 ? CPUS_PER_TASK : 1 ))" \
  bash "$ROOT/run_scripts/run_cluster.sh" "$@"
