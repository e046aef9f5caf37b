#!/usr/bin/env bash
# Evaluate a Hugging Face model directory with lm-evaluation-harness, offline.
#
#   eval_scripts/eval_full.sh <HF_DIR> [OUT_DIR]        (OUT_DIR defaults to <HF_DIR>/eval)
#   eval_scripts/eval_full.sh <org/name> [OUT_DIR]      a Hub id: the local Hub cache, else a download
#                                                        (OUT_DIR defaults to output/eval/<org>--<name>)
#
# 1. The local suite, always: eval_scripts/tasks/ (tag spes_local) over held-out text of the default
#    corpus -- spes_next_text (which of 4 continuations is the real one; acc, acc_norm) and
#    spes_heldout_ppl (rolling log-likelihood; word/byte perplexity, bits per byte). Its data is built
#    deterministically by eval_scripts/build_local_tasks.py into $EVAL_DATA (skipped when up to date),
#    cut to fit the model's context length (config.json max_position_embeddings); a task the window is
#    too short for is skipped with a one-line reason.
# 2. The paper's reference suite -- sciq, piqa, winogrande, arc_easy, social_iqa, openbookqa, boolq
#    0-shot; arc_challenge 25-shot; hellaswag 10-shot -- from the local Hugging Face datasets cache, else
#    downloaded when the Hub is reachable and HF_HUB_OFFLINE is not 1; the others are named and skipped.
#    A task lm_eval cannot run is skipped with a one-line reason (its log stays in OUT_DIR/raw).
# 3. OUT_DIR/results.json and OUT_DIR/results.md (a markdown table); raw lm_eval output in OUT_DIR/raw.
#
# Env (defaults): PYTHON (.venv/bin/python of this repo, else python3), EVAL_SOURCE (data/default: a
# corpus with valid/ shards and tokenizer/), EVAL_DATA (data/eval_tasks/ctx<context length>), BUILD_ARGS (extra flags of
# build_local_tasks.py, e.g. "--num_choice_items 100"), LIMIT (lm_eval --limit: examples per task),
# BATCH_SIZE (8), DEVICE (lm_eval's default), DTYPE (auto: the dtype in config.json), REFERENCE (1; 0 skips
# the reference suite).
set -euo pipefail

if [ "$#" -lt 1 ] || [ "$#" -gt 2 ]; then
  echo "usage: $0 <HF_DIR> [OUT_DIR]" >&2
  exit 2
fi
REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
PYTHON=${PYTHON:-$REPO/.venv/bin/python}
[ -x "$PYTHON" ] || PYTHON=python3
MODEL=$1
DEFAULT_OUT=$1/eval
if [ ! -e "$1" ]; then  # a Hub id: the local Hub cache first, then a download (spes.hub)
  MODEL=$(PYTHONPATH="$REPO" "$PYTHON" -c 'import sys
from spes.hub import resolve
try:
    print(resolve(sys.argv[1], what="model"))
except FileNotFoundError as err:
    sys.exit(f"error: {err}")' "$1") || exit 2
  DEFAULT_OUT=$REPO/output/eval/${1//\//--}
fi
if [ ! -f "$MODEL/config.json" ]; then
  echo "error: $1 is not a Hugging Face model directory (no config.json); make one with eval_scripts/convert_to_hf.sh" >&2
  exit 2
fi
HF_DIR=$(cd "$MODEL" && pwd)
OUT_DIR=${2:-$DEFAULT_OUT}
mkdir -p "$OUT_DIR"
OUT_DIR=$(cd "$OUT_DIR" && pwd)
EVAL_SOURCE=${EVAL_SOURCE:-$REPO/data/default}
BATCH_SIZE=${BATCH_SIZE:-8}
DTYPE=${DTYPE:-auto}
export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}"
# NOTE: without a reachable Hub, offline mode turns minutes of retries inside datasets/lm_eval into cache reads.
if ! "$PYTHON" -c 'import sys; from spes.hub import hub_offline, hub_reachable
sys.exit(0 if not hub_offline() and hub_reachable() else 1)'; then
  export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TRANSFORMERS_OFFLINE=1
fi
CONTEXT=$("$PYTHON" -c 'import json, sys; print(json.load(open(sys.argv[1])).get("max_position_embeddings") or 0)' \
  "$HF_DIR/config.json")
EVAL_DATA=${EVAL_DATA:-$REPO/data/eval_tasks/ctx$CONTEXT}

# shellcheck disable=SC2086  # BUILD_ARGS is a list of flags
"$PYTHON" "$REPO/eval_scripts/build_local_tasks.py" --source "$EVAL_SOURCE" --out "$EVAL_DATA" \
  --max_tokens "$CONTEXT" --window_tokenizer "$HF_DIR" ${BUILD_ARGS:-}
EVAL_DATA=$(cd "$EVAL_DATA" && pwd)
LOCAL_TASKS=$("$PYTHON" -c 'import json, sys; print(",".join(json.load(open(sys.argv[1]))["tasks"]))' \
  "$EVAL_DATA/manifest.json")
FAILED=0

run_lm_eval() {  # <run name> <tasks> <shots> [required: a failure fails the script]
  local extra=() log="$OUT_DIR/raw/$1.log"
  [ -n "${LIMIT:-}" ] && extra+=(--limit "$LIMIT")
  [ -n "${DEVICE:-}" ] && extra+=(--device "$DEVICE")
  echo "== lm_eval: $2 ($3-shot)"
  mkdir -p "$OUT_DIR/raw"
  # NOTE: run inside the task data directory: the local task YAMLs name their data files relative to it.
  if ! (cd "$EVAL_DATA" && "$PYTHON" -m lm_eval --model hf --model_args "pretrained=$HF_DIR,dtype=$DTYPE" \
      --tasks "$2" --num_fewshot "$3" --include_path "$REPO/eval_scripts/tasks" --batch_size "$BATCH_SIZE" \
      --output_path "$OUT_DIR/raw/$1" "${extra[@]}") > "$log" 2>&1; then
    echo "skipped $2: lm_eval failed: $(grep -v '^\s*$' "$log" | tail -n 1) (log: $log)" >&2
    if [ -n "${4:-}" ]; then FAILED=1; fi
  else
    grep -A 100 '^|' "$log" || true
  fi
}

rm -rf "$OUT_DIR/raw" "$OUT_DIR/reference_status.json"
if [ -n "$LOCAL_TASKS" ]; then run_lm_eval local "$LOCAL_TASKS" 0 required; fi
if [ "${REFERENCE:-1}" != 0 ]; then
  REFERENCE_RUNS=$("$PYTHON" "$REPO/eval_scripts/eval_tools.py" available --status "$OUT_DIR/reference_status.json")
  while read -r shots tasks; do
    if [ -n "$tasks" ]; then run_lm_eval "reference_${shots}shot" "$tasks" "$shots"; fi
  done <<< "$REFERENCE_RUNS"
fi
"$PYTHON" "$REPO/eval_scripts/eval_tools.py" summarize "$OUT_DIR"
echo "results: $OUT_DIR/results.md $OUT_DIR/results.json"
exit "$FAILED"
