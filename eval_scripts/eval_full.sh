#!/usr/bin/env bash
# Evaluate a Hugging Face model directory with lm-evaluation-harness, offline.
#
#   eval_scripts/eval_full.sh <HF_DIR> [OUT_DIR]        (OUT_DIR defaults to <HF_DIR>/eval)
#
# 1. The local suite, always: eval_scripts/tasks/ (tag spes_local) over held-out text of the default
#    corpus -- spes_next_text (which of 4 continuations is the real one; acc, acc_norm) and
#    spes_heldout_ppl (rolling log-likelihood; word/byte perplexity, bits per byte). Its data is built
#    deterministically by eval_scripts/build_local_tasks.py into $EVAL_DATA (skipped when up to date).
# 2. The paper's reference suite -- sciq, piqa, winogrande, arc_easy, social_iqa, openbookqa, boolq
#    0-shot; arc_challenge 25-shot; hellaswag 10-shot -- for the tasks whose data sets are already in the
#    local Hugging Face datasets cache. Nothing is downloaded; missing ones are named and skipped.
# 3. OUT_DIR/results.json and OUT_DIR/results.md (a markdown table); raw lm_eval output in OUT_DIR/raw.
#
# Env (defaults): PYTHON (.venv/bin/python of this repo, else python3), EVAL_SOURCE (data/default: a
# corpus with valid/ shards and tokenizer/), EVAL_DATA (data/eval_tasks), BUILD_ARGS (extra flags of
# build_local_tasks.py, e.g. "--num_choice_items 100"), LIMIT (lm_eval --limit: examples per task),
# BATCH_SIZE (8), DEVICE (lm_eval's default), DTYPE (auto: the dtype in config.json), REFERENCE (1; 0 skips
# the reference suite).
set -euo pipefail

if [ "$#" -lt 1 ] || [ "$#" -gt 2 ]; then
  echo "usage: $0 <HF_DIR> [OUT_DIR]" >&2
  exit 2
fi
REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
if [ ! -f "$1/config.json" ]; then
  echo "error: $1 is not a Hugging Face model directory (no config.json); make one with eval_scripts/convert_to_hf.sh" >&2
  exit 2
fi
HF_DIR=$(cd "$1" && pwd)
OUT_DIR=${2:-$HF_DIR/eval}
mkdir -p "$OUT_DIR"
OUT_DIR=$(cd "$OUT_DIR" && pwd)
PYTHON=${PYTHON:-$REPO/.venv/bin/python}
[ -x "$PYTHON" ] || PYTHON=python3
EVAL_SOURCE=${EVAL_SOURCE:-$REPO/data/default}
EVAL_DATA=${EVAL_DATA:-$REPO/data/eval_tasks}
BATCH_SIZE=${BATCH_SIZE:-8}
DTYPE=${DTYPE:-auto}
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TRANSFORMERS_OFFLINE=1
export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}"

# shellcheck disable=SC2086  # BUILD_ARGS is a list of flags
"$PYTHON" "$REPO/eval_scripts/build_local_tasks.py" --source "$EVAL_SOURCE" --out "$EVAL_DATA" ${BUILD_ARGS:-}
EVAL_DATA=$(cd "$EVAL_DATA" && pwd)

run_lm_eval() {  # <run name> <tasks> <shots>
  local extra=()
  [ -n "${LIMIT:-}" ] && extra+=(--limit "$LIMIT")
  [ -n "${DEVICE:-}" ] && extra+=(--device "$DEVICE")
  echo "== lm_eval: $2 ($3-shot)"
  # NOTE: run inside the task data directory: the local task YAMLs name their data files relative to it.
  (cd "$EVAL_DATA" && "$PYTHON" -m lm_eval --model hf --model_args "pretrained=$HF_DIR,dtype=$DTYPE" \
    --tasks "$2" --num_fewshot "$3" --include_path "$REPO/eval_scripts/tasks" --batch_size "$BATCH_SIZE" \
    --output_path "$OUT_DIR/raw/$1" "${extra[@]}")
}

rm -rf "$OUT_DIR/raw" "$OUT_DIR/reference_status.json"
run_lm_eval local spes_local 0
if [ "${REFERENCE:-1}" != 0 ]; then
  REFERENCE_RUNS=$("$PYTHON" "$REPO/eval_scripts/eval_tools.py" available --status "$OUT_DIR/reference_status.json")
  while read -r shots tasks; do
    if [ -n "$tasks" ]; then run_lm_eval "reference_${shots}shot" "$tasks" "$shots"; fi
  done <<< "$REFERENCE_RUNS"
fi
"$PYTHON" "$REPO/eval_scripts/eval_tools.py" summarize "$OUT_DIR"
echo "results: $OUT_DIR/results.md $OUT_DIR/results.json"
