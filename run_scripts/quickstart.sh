#!/usr/bin/env bash
# The main job: install, build the default corpus + tokenizer if missing, then a real SPES run on the CPU:
# one parameter server and 4 peers (8 experts, 2 per peer) on loopback, several sync rounds including
# merge warm-up rounds, and a summary table. Extra args go to every peer as overrides (--key=value).
# A run lives in OUT (default output/quickstart in the repository; a relative OUT is from the folder the script is
# started in, the run's own relative paths and the overrides' from the repository): a second start with the same OUT
# is refused unless RESUME=1 continues it (the server from its state, every peer from its latest checkpoint); pick
# another OUT for a new run.
# RESUME=1 with an OUT that holds no run is refused too: unset it to start one.
# Each stage says what it does and how long it took on a fresh clone (bench/results/bench_quickstart.json,
# written by bench/bench_quickstart.py).
#
#   bash run_scripts/quickstart.sh [--section.key=value ...]
#   Env (defaults): OUT (output/quickstart), RESUME (unset; 1 continues OUT), STEPS (400), MERGE_INTERVAL (20),
#   MERGE_ALPHA_START (0.05), MERGE_DECAY_STEPS (200)
set -euo pipefail
[[ "${1:-}" =~ ^(-h|--help)$ ]] && { sed -n '2,/^[^#]/{/^#SBATCH/d;s/^# \{0,1\}//p;}' "$0"; exit 0; }  # the header above is the help
CALLER=$PWD
cd "$(dirname "$0")/.."
# NOTE: started from another folder, OUT=runs/a went into the repository's runs/a, named as runs/a
if [ -n "${OUT:-}" ] && [[ $OUT != /* ]] && ! [ "$PWD" -ef "$CALLER" ]; then OUT=$CALLER/$OUT; fi
OUT=${OUT:-output/quickstart} STEPS=${STEPS:-400}

stage() {  # stage NUMBER NAME WHAT [FOR]: one line, with the measured time (FOR: of what) when a record has it
  local took
  took=$(python3 - "$2" 2>/dev/null <<'PY' || true
import json, sys
record = json.load(open("bench/results/bench_quickstart.json"))
seconds = record["stages"][sys.argv[1]]
print(f"; on a fresh clone: {seconds:.0f} s" if seconds < 90 else f"; on a fresh clone: {seconds / 60:.0f} min")
PY
)
  echo "quickstart [$1/3] $2: $3$took${took:+${4:-}}"
}

stage 1 install "torch (CPU) and spes[dev] into .venv, the first time only"
bash run_scripts/setup.sh
stage 2 corpus "the local corpus and tokenizer in data/default, the first time only"
.venv/bin/python data_process_scripts/build_default_corpus.py --output_dir data/default
if [ -n "${RESUME:-}" ]; then
  run="the run in $OUT continued from its last checkpoint to step $STEPS"
else
  run="$STEPS steps into $OUT"
fi
timed=""  # NOTE: the record times a new run of the default length, not a longer one nor the rest of one
if [ -n "${RESUME:-}" ] || [ "$STEPS" != 400 ]; then timed=" for a new run of 400 steps"; fi
stage 3 train "a server and 4 peers on loopback, $run (progress below: peer 0's log)" "$timed"
exec .venv/bin/python -m spes.launch configs/tiny.yaml --out "$OUT" \
  $( [ -n "${RESUME:-}" ] && echo --resume ) -- \
  --server.merge_interval="${MERGE_INTERVAL:-20}" --server.merge_alpha_start="${MERGE_ALPHA_START:-0.05}" \
  --server.merge_decay_steps="${MERGE_DECAY_STEPS:-200}" \
  --max_duration="${STEPS}st" --eval_interval=20 --log_interval=10 "$@"
