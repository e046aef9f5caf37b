#!/usr/bin/env bash
# The main job: install, build the default corpus + tokenizer if missing, then a real SPES run on the CPU:
# one parameter server and 4 peers (8 experts, 2 per peer) on loopback, several sync rounds including
# merge warm-up rounds, and a summary table. Extra args go to every peer as overrides (--key=value).
# A run lives in OUT (default output/quickstart): a second start with the same OUT is refused unless RESUME=1
# continues it (the server from its state, every peer from its latest checkpoint); pick another OUT for a new run.
set -euo pipefail
cd "$(dirname "$0")/.."
bash run_scripts/setup.sh
.venv/bin/python data_process_scripts/build_default_corpus.py --output_dir data/default
exec .venv/bin/python -m spes.launch configs/tiny.yaml --out "${OUT:-output/quickstart}" \
  $( [ -n "${RESUME:-}" ] && echo --resume ) -- \
  --server.merge_interval="${MERGE_INTERVAL:-20}" --server.merge_alpha_start="${MERGE_ALPHA_START:-0.05}" \
  --server.merge_decay_steps="${MERGE_DECAY_STEPS:-200}" \
  --max_duration="${STEPS:-400}st" --eval_interval=20 --log_interval=10 "$@"
