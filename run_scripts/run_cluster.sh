#!/usr/bin/env bash
#SBATCH --job-name=spes
#SBATCH --ntasks-per-node=1
#SBATCH --signal=TERM@420
# A whole SPES run over several machines: each node an independent DDP/FSDP trainer over its own GPUs, the
# parameter server on node 0. Two ways to start it, from the repository root:
#
#   sbatch --nodes=4 --ntasks-per-node=1 --gpus-per-node=8 run_scripts/run_cluster.sh [--section.key=value ...]
#   RANK=<node id> MASTER_ADDR=<node 0's host> [NPROC_PER_NODE=8] run_scripts/run_cluster.sh [--section.key=value ...]
#
# Under SLURM, the batch step (which SLURM runs on the allocation's first node) starts the parameter server there,
# waits until it listens, then `srun`s this script once per task; each task is node <SLURM_PROCID> of the run.
# When every node is done the server is stopped.
# Outside SLURM (the first implementation's contract: any scheduler that sets RANK, MASTER_ADDR and NPROC_PER_NODE,
# or none: run it on every machine by hand; RANK set wins inside a SLURM job too, as when a wrapper `srun`s this
# script with each node's RANK), this script runs once per node: node <RANK>; node 0 also starts the
# server, reached by the others at MASTER_ADDR:PORT, and stops it SERVER_LINGER seconds after its own trainer is
# done (the others' last download). RANK, MASTER_ADDR, MASTER_PORT and WORLD_SIZE are cleared before the trainer
# starts, so a node's DDP/FSDP process group stays on the node.
# Either way each node runs run_scripts/run_single_node.sh <id> (`torchrun --standalone` over its own GPUs), so
# nodes meet only at the server.
#
# Env (defaults in brackets):
#   CONFIG_DIR [configs/spes_1b]  CONFIG [$CONFIG_DIR/node_<id>.yaml]: each node's config
#   NPROC_PER_NODE [SLURM_GPUS_ON_NODE, else every GPU the node's $PYTHON sees, else 1]: processes per node
#   PORT [50051]: server port on node 0 (a fixed one); SERVER_HOST [first host of SLURM_JOB_NODELIST, or
#     MASTER_ADDR, which every node but 0 needs outside SLURM]
#   The server's run settings (peers, experts per block, mode, the `server:` section) come from node 0's config
#   with the same overrides, so they cannot disagree with the nodes'.
#   SPES_ROOT [SLURM_SUBMIT_DIR, or this repository]; PYTHON [.venv/bin/python, else python3]
#   It runs in SPES_ROOT: relative paths of the configs, CONFIG_DIR and the overrides are read from there; a relative
#   LOG_DIR or STATE_DIR is from the folder it is started in, and so is a relative CONFIG when it is there.
#   LOG_DIR [output/slurm-<job id>, or output/cluster]: where the server log goes
#   STATE_DIR [the parent of node 0's save_folder, /server_state]: the server's rounds, kept across jobs
#   SERVER_LINGER [120]: outside SLURM, seconds node 0 keeps the server up after its own trainer is done
#   SERVER_ARGS []: flags for the parameter server only, split into words as a shell splits them (quote a path with
#     spaces), e.g. "--tls_cert server.crt --tls_key '/etc/spes certs/server.key'" (the extra arguments also reach
#     every trainer, which takes only --section.key=value overrides);
#     with TLS the nodes need --spes_config.tls_ca=ca.crt as an extra argument, and SERVER_HOST must be a name
#     the server's certificate holds. SPES_TOKEN, when set, is the run's token for the server and every node.
# Per node: --spes_config.peer_id=<id> and its data.seed (run_single_node.sh: a node file's own, or with CONFIG, the
# run's + 1000 * id), --spes_config.server_addr=<host>:<port>, --resume=auto; extra arguments are passed to every
# node's trainer (and, but --resume, to the server) after these and win over them.
# A requeued (or resubmitted) job continues where it stopped: the server restores its last round from
# STATE_DIR and every node resumes from its save_folder's latest checkpoint (or starts fresh if it has none).
# Stopping: 420 s before the time limit (#SBATCH --signal) SLURM sends SIGTERM to the nodes' step: each node saves
# at its next step and stops, within spes.torchrun's shutdown timeout (300 s; a longer one, set with
# TORCH_ELASTIC_SHUTDOWN_TIMEOUT, needs a longer --signal lead), and the job ends with the server's state persisted.
# `scancel --signal=TERM <job>` does the same now; a plain scancel gives the nodes only the cluster's KillWait.
set -euo pipefail
[[ "${1:-}" =~ ^(-h|--help)$ ]] && { sed -n '2,/^[^#]/{/^#SBATCH/d;s/^# \{0,1\}//p;}' "$0"; exit 0; }  # the header above is the help

die() { echo "run_cluster.sh: error: $*" >&2; exit 2; }
CALLER=$PWD
ROOT=${SPES_ROOT:-${SLURM_SUBMIT_DIR:-$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)}}
# NOTE: sbatch runs a copy of this script, so the repository is where sbatch was run: from another folder the run
# failed with a traceback (no spes there) or a config "not found" that was there all along
[ -f "$ROOT/run_scripts/run_single_node.sh" ] || die "$ROOT ($( [ -n "${SPES_ROOT:-}" ] && echo SPES_ROOT \
  || echo "SLURM_SUBMIT_DIR, where sbatch was run" )) is not the spes repository: submit from the repository's root \
(cd <repository> && sbatch ... run_scripts/run_cluster.sh) or set SPES_ROOT=<repository>"
cd "$ROOT"
# NOTE: started by hand from another folder, LOG_DIR=logs went into the repository's logs, named as logs, and
# CONFIG=run.yaml beside the user was "not found"
if ! [ "$PWD" -ef "$CALLER" ]; then
  for var in LOG_DIR STATE_DIR; do
    if [ -n "${!var:-}" ] && [[ ${!var} != /* ]]; then printf -v "$var" '%s' "$CALLER/${!var}"; fi
  done
  if [ -n "${CONFIG:-}" ] && [[ $CONFIG != /* ]] && [ -f "$CALLER/$CONFIG" ]; then CONFIG=$CALLER/$CONFIG; fi
fi
PYTHON=${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}
CONFIG_DIR=${CONFIG_DIR:-configs/spes_1b}
PORT=${PORT:-50051}

config_of() { echo "${CONFIG:-$CONFIG_DIR/node_$1.yaml}"; }
[[ "$PORT" =~ ^[1-9][0-9]*$ ]] && [ "$PORT" -le 65535 ] || die "PORT=$PORT must be a fixed port in [1, 65535]: the nodes \
are told it before the server starts (only DATA_PORT may be 0, chosen by the OS)"
[ -n "${SLURM_JOB_ID:-}" ] || [ -n "${RANK:-}" ] || die "not inside a SLURM job and RANK is not set; submit with: \
sbatch --nodes=N run_scripts/run_cluster.sh, or run it on every node with RANK=<node id> MASTER_ADDR=<node 0's host>"

run_node() {  # <node id> [args...]: this machine's node of the run
  local id=$1; shift
  export CONFIG_DIR PYTHON
  [ -z "${CONFIG:-}" ] || export CONFIG
  NPROC_PER_NODE=${NPROC_PER_NODE:-${SLURM_GPUS_ON_NODE:-}} bash run_scripts/run_single_node.sh "$id" \
    --spes_config.server_addr="$SERVER_ADDR" --resume=auto "$@"
}

if [ "${SPES_CLUSTER_ROLE:-batch}" = node ]; then
  # ---- under SLURM: one task per node ----
  NODE_ID=${SLURM_PROCID:?SLURM_PROCID is not set: this part runs under srun}
  echo "node $NODE_ID on $(hostname), server $SERVER_ADDR"
  # NOTE: SLURM's signal reaches this shell too: killed by it, it ended the task and SLURM killed the node mid-save;
  # trapped, it waits for the node. A node stopped by it exits 0, or srun's --kill-on-bad-exit signalled the nodes
  # still saving again (a second signal aborts a save).
  trap 'SIGNALLED=1' TERM INT
  STATUS=0
  run_node "$NODE_ID" "$@" || STATUS=$?
  if [ -n "${SIGNALLED:-}" ] && { [ "$STATUS" = 130 ] || [ "$STATUS" = 143 ]; }; then
    exit 0
  fi
  exit "$STATUS"
fi

CFG0=$(config_of 0)
[ -f "$CFG0" ] || die "config $CFG0 not found (set CONFIG or CONFIG_DIR)"
# The server reads its run settings from node 0's config with the nodes' overrides (all but --resume); here only
# the node count and the default state directory are read from it.
OVERRIDES=()
for arg in "$@"; do [[ "$arg" == --resume* ]] || OVERRIDES+=("$arg"); done
SETTINGS=$("$PYTHON" - "$CFG0" "${OVERRIDES[@]}" 2>&1 <<'PY'
import sys
from pathlib import Path
from spes.config import load_config
try:
    cfg, _ = load_config(sys.argv[1], sys.argv[2:])
except (ValueError, FileNotFoundError) as e:
    sys.exit(f"error: {e}")
print(cfg.num_peers, Path(cfg.save_folder).parent / "server_state")
PY
) || die "${SETTINGS#error: }"
read -r CFG_PEERS CFG_STATE_DIR <<< "$(tail -n1 <<< "$SETTINGS")"
STATE_DIR=${STATE_DIR:-$CFG_STATE_DIR}

start_server() {  # the parameter server in the background, on this machine; returns once it listens
  mkdir -p "$LOG_DIR"
  echo "parameter server on $SERVER_HOST:$PORT (log $LOG_DIR/server.log, state $STATE_DIR)"
  # NOTE: --insecure: the nodes reach the server over the cluster network; set SPES_TOKEN and give TLS files in
  # SERVER_ARGS to protect it.
  # NOTE: split at spaces, --tls_cert '/etc/spes certs/server.crt' reached the server as two paths
  local server_args=() words
  words=$("$PYTHON" - "${SERVER_ARGS:-}" 2>&1 <<'PY'
import shlex, sys
try:
    print("\n".join(shlex.split(sys.argv[1])))
except ValueError as e:
    sys.exit(f"SERVER_ARGS={sys.argv[1]} cannot be split into words ({e}): quote each path as in a shell")
PY
) || die "$words"
  [ -z "$words" ] || mapfile -t server_args <<< "$words"
  PYTHON=$PYTHON PORT=$PORT bash run_scripts/run_parameter_server.sh "$CFG0" "${OVERRIDES[@]}" --state_dir "$STATE_DIR" \
    --insecure "${server_args[@]}" > "$LOG_DIR/server.log" 2>&1 &
  SERVER_PID=$!
  trap 'kill "$SERVER_PID" 2>/dev/null || true; wait "$SERVER_PID" 2>/dev/null || true' EXIT
  for _ in $(seq 1 120); do
    grep -q "listening" "$LOG_DIR/server.log" 2>/dev/null && return 0
    kill -0 "$SERVER_PID" 2>/dev/null || die "the parameter server exited: $(tail -n1 "$LOG_DIR/server.log")"
    sleep 0.5
  done
  die "the parameter server did not start within 60 s"
}

if [ -n "${RANK:-}" ]; then
  # ---- RANK given: this machine is node RANK ----
  # NOTE: before the SLURM branch: under a wrapper that `srun`s this with RANK per node, every task took it as the
  # batch step, started a server and `srun`ed the whole run again inside its own step (which waits for CPUs forever)
  NODE_ID=$RANK
  [[ "$NODE_ID" =~ ^[0-9]+$ ]] && [ "$NODE_ID" -lt "$CFG_PEERS" ] || die "RANK=$NODE_ID must be a node id in \
[0, $CFG_PEERS) (the config's spes_config.num_peers)"
  # NOTE: node 0 runs the server itself; any other node on its loopback found no server and retried for minutes
  [ "$NODE_ID" = 0 ] || [ -n "${SERVER_HOST:-}${MASTER_ADDR:-}" ] || die "RANK=$NODE_ID but MASTER_ADDR is not set: \
set MASTER_ADDR=<node 0's host> (or SERVER_HOST), where node 0 runs the parameter server"
  SERVER_HOST=${SERVER_HOST:-${MASTER_ADDR:-127.0.0.1}}
  SERVER_ADDR="$SERVER_HOST:$PORT"
  LOG_DIR=${LOG_DIR:-output/cluster}
  unset RANK WORLD_SIZE LOCAL_RANK MASTER_ADDR MASTER_PORT  # NOTE: the run's; the node's torchrun makes its own
  echo "node $NODE_ID of $CFG_PEERS on $(hostname), server $SERVER_ADDR"
  if [ "$NODE_ID" != 0 ]; then
    run_node "$NODE_ID" "$@"
    exit
  fi
  start_server
  STATUS=0
  run_node 0 "$@" || STATUS=$?
  echo "node 0 done (exit $STATUS); stopping the parameter server in ${SERVER_LINGER:-120} s"
  sleep "${SERVER_LINGER:-120}"
  exit "$STATUS"
fi

# ---- under SLURM: the batch step, on the first node ----
NUM_NODES=${SLURM_NTASKS:-${SLURM_JOB_NUM_NODES:-1}}
FIRST_HOST=$(scontrol show hostnames "${SLURM_JOB_NODELIST:?}" | head -n1)
SERVER_HOST=${SERVER_HOST:-$FIRST_HOST}
[ "$CFG_PEERS" -eq "$NUM_NODES" ] || die "the config has spes_config.num_peers=$CFG_PEERS but the job runs \
$NUM_NODES task(s); submit with --nodes=$CFG_PEERS --ntasks-per-node=1 (or override --spes_config.num_peers)"
LOG_DIR=${LOG_DIR:-output/slurm-$SLURM_JOB_ID}
echo "job $SLURM_JOB_ID: $NUM_NODES node(s)"
start_server

export SPES_CLUSTER_ROLE=node SERVER_ADDR="$SERVER_HOST:$PORT"
# NOTE: srun gives a task one CPU unless told otherwise; a node's trainer wants all of its node's CPUs.
CPUS_PER_TASK=${SLURM_CPUS_PER_TASK:-$(( ${SLURM_CPUS_ON_NODE:-1} / ${SLURM_NTASKS_PER_NODE:-1} ))}
srun --kill-on-bad-exit=1 --label --ntasks="$NUM_NODES" --cpus-per-task="$(( CPUS_PER_TASK > 0 ? CPUS_PER_TASK : 1 ))" \
  bash "$ROOT/run_scripts/run_cluster.sh" "$@"
