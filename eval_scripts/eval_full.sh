#!/usr/bin/env bash
# Evaluate a Hugging Face model directory with lm-evaluation-harness, offline if need be.
#
#   eval_scripts/eval_full.sh <MODEL_PATH> [MODEL_NAME]
#
# The first implementation's argument order: MODEL_PATH is a model directory (eval_scripts/convert_to_hf.sh makes
# one) or a Hub id (the local Hub cache, else a download); results go to eval_output/<MODEL_NAME> as there (OUT_DIR
# overrides; without a MODEL_NAME: <MODEL_PATH>-eval beside the model, or output/eval/<org>--<name> for a Hub id).
# Never inside the model folder: a re-export (spes.hf export --overwrite) replaces that folder whole. An OUT_DIR
# that holds earlier results is refused unless OVERWRITE=1; the run writes to <OUT_DIR>.partial and replaces
# OUT_DIR only once it finishes, so an interrupted run loses nothing (a re-run starts over). A run into an OUT_DIR
# another run is writing is refused.
#
# 1. The local suite, when its corpus is here (EVAL_SOURCE, default data/default; skipped with a note when that
#    default is absent): eval_scripts/tasks/ (tag spes_local) over held-out text -- spes_next_text (which of 4
#    continuations is the real one; acc, acc_norm) and spes_heldout_ppl (rolling log-likelihood; word/byte
#    perplexity, bits per byte). Its data is built deterministically by eval_scripts/build_local_tasks.py into
#    $EVAL_DATA (skipped when up to date), cut to fit the model's context length (config.json
#    max_position_embeddings); a task the window is too short for is skipped with a one-line reason.
# 2. The first implementation's reference suite -- sciq, piqa, winogrande, arc_easy, social_iqa, openbookqa,
#    boolq 0-shot; arc_challenge 25-shot; hellaswag 10-shot; ceval-valid, cmmlu, mmlu with lm-eval's default shots
#    -- from the local Hugging Face datasets cache, else downloaded when the Hub is reachable and HF_HUB_OFFLINE is
#    not 1; the others are named with the reason and skipped (eval_scripts/eval_tools.py available). A task lm_eval
#    cannot run is skipped with a one-line reason (its log stays in OUT_DIR/raw). No local corpus is needed.
# 3. OUT_DIR/results.json and OUT_DIR/results.md (a markdown table); raw lm_eval output in OUT_DIR/raw.
#
# Env (defaults): PYTHON (.venv/bin/python of this repo, else python3), OUT_DIR (above), EVAL_SOURCE (data/default:
# a corpus with valid/ shards and tokenizer/), EVAL_DATA (data/eval_tasks/ctx<context length>), BUILD_ARGS (extra
# flags of build_local_tasks.py, e.g. "--num_choice_items 100"), LIMIT (lm_eval --limit: examples per task),
# BATCH_SIZE (8; auto as the first implementation), DEVICE (lm_eval's default), DTYPE (auto: the dtype in
# config.json), REFERENCE (1; 0 skips the reference suite), OVERWRITE (0; 1 replaces earlier results), NPROC (the
# GPUs $PYTHON sees, else 1) and ACCELERATE (1 when NPROC > 1): run lm_eval as `accelerate launch --num_processes
# NPROC --main_process_port PORT -m lm_eval`, data-parallel over NPROC GPUs as the first implementation did (PORT:
# 20503).
set -euo pipefail
[[ "${1:-}" =~ ^(-h|--help)$ ]] && { sed -n '2,/^[^#]/{/^#SBATCH/d;s/^# \{0,1\}//p;}' "$0"; exit 0; }  # the header above is the help

# NOTE: flags first: `--limit 5` made three arguments, and the usage line did not say where a setting goes
for arg in "$@"; do
  if [[ $arg == -* ]]; then
    echo "error: $0 takes no flags (got $arg): its settings are environment variables, e.g. LIMIT=10 $0" \
      "<MODEL_PATH>; --help lists them" >&2
    exit 2
  fi
done
if [ "$#" -lt 1 ] || [ "$#" -gt 2 ]; then
  echo "usage: $0 <MODEL_PATH> [MODEL_NAME]   (results in OUT_DIR, else eval_output/<MODEL_NAME>, else" \
    "<MODEL_PATH>-eval; --help for more)" >&2
  exit 2
fi
REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
PYTHON=${PYTHON:-$REPO/.venv/bin/python}
[ -x "$PYTHON" ] || PYTHON=python3
fail() { echo "error: $*" >&2; exit 2; }
check_out_dir() {  # OUT_DIR made absolute; refused inside the model folder and over anything but earlier results
  OUT_DIR=$("$PYTHON" -c 'import os, sys; print(os.path.realpath(sys.argv[1]))' "$OUT_DIR")
  case $OUT_DIR/ in "$(cd "$HF_DIR" && pwd -P)"/*)
    fail "OUT_DIR $OUT_DIR is inside the model folder $HF_DIR, which a re-export (spes.hf export --overwrite)" \
      "replaces whole; choose a folder beside it, e.g. $HF_DIR-eval" ;;
  esac
  if [ -e "$OUT_DIR" ] && { [ ! -d "$OUT_DIR" ] || [ -n "$(ls -A "$OUT_DIR")" ]; }; then
    if [ ! -f "$OUT_DIR/results.json" ] && [ ! -d "$OUT_DIR/raw" ]; then
      fail "OUT_DIR $OUT_DIR is not an empty folder and holds no eval_full.sh results; choose a new or empty one"
    elif [ "${OVERWRITE:-0}" != 1 ]; then
      fail "$OUT_DIR holds the results of an earlier evaluation; set OVERWRITE=1 to replace them once this run" \
        "finishes, or choose another MODEL_NAME or OUT_DIR"
    fi
  fi
  if [ -f "$HF_DIR/eval/results.json" ]; then
    echo "note: $HF_DIR/eval holds an earlier evaluation inside the model folder; move it out before a" \
      "re-export (spes.hf export --overwrite) replaces that folder" >&2
  fi
}
MODEL=$1
DEFAULT_OUT=
if [ ! -e "$1" ]; then  # a Hub id: the local Hub cache first, then a download (spes.hub)
  MODEL=$(PYTHONPATH="$REPO" "$PYTHON" -c 'import sys
from spes.hub import resolve
try:
    print(resolve(sys.argv[1], what="model"))
except FileNotFoundError as err:
    sys.exit(f"error: {err}")' "$1") || exit 2
  DEFAULT_OUT=$REPO/output/eval/${1//\//--}
fi
[ -f "$MODEL/config.json" ] ||
  fail "$1 is not a Hugging Face model directory (no config.json); make one with eval_scripts/convert_to_hf.sh"
HF_DIR=$(cd "$MODEL" && pwd)
[ -f "$HF_DIR/tokenizer.json" ] || [ -f "$HF_DIR/tokenizer_config.json" ] || fail "$1 has no tokenizer" \
  "(tokenizer.json); export it again with eval_scripts/convert_to_hf.sh ... --overwrite --tokenizer <the run's tokenizer>"
case $HF_DIR in *,*) fail "$HF_DIR has a ',' in its path, which lm_eval's --model_args cannot carry; move it" ;; esac
if [ -z "${OUT_DIR:-}" ]; then
  OUT_DIR=${2:+eval_output/$2}
  OUT_DIR=${OUT_DIR:-${DEFAULT_OUT:-$HF_DIR-eval}}
fi
check_out_dir
STAGE=$OUT_DIR.partial  # NOTE: OUT_DIR is replaced only by a finished run: an interrupted one loses nothing
mkdir -p "$STAGE"
# NOTE: a second run into the same OUT_DIR would clear this one's results; the lock goes with the process.
if command -v flock > /dev/null; then
  exec 9> "$STAGE/.lock"
  flock -n 9 || fail "another eval_full.sh is evaluating into $OUT_DIR (it holds $STAGE/.lock); wait for it to" \
    "finish or choose another MODEL_NAME or OUT_DIR"
  trap 'rm -f "$STAGE/.lock"; rmdir "$STAGE" 2> /dev/null || true' EXIT
fi
BATCH_SIZE=${BATCH_SIZE:-8}
DTYPE=${DTYPE:-auto}
export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}"
NPROC=${NPROC:-$("$PYTHON" -c 'import torch; print(max(torch.cuda.device_count(), 1))')}
ACCELERATE=${ACCELERATE:-$([ "$NPROC" -gt 1 ] && echo 1 || echo 0)}
LM_EVAL=("$PYTHON" -m lm_eval)
if [ "$ACCELERATE" = 1 ]; then
  LM_EVAL=("$PYTHON" -m accelerate.commands.launch --num_processes "$NPROC" --main_process_port "${PORT:-20503}"
    -m lm_eval)
fi
echo "results: $OUT_DIR; lm_eval: ${LM_EVAL[*]}"
# NOTE: without a reachable Hub, offline mode turns minutes of retries inside datasets/lm_eval into cache reads.
HUB_OFF=$("$PYTHON" "$REPO/eval_scripts/eval_tools.py" hub_off)
if [ -n "$HUB_OFF" ]; then
  export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TRANSFORMERS_OFFLINE=1
fi
CONTEXT=$("$PYTHON" -c 'import json, sys; print(json.load(open(sys.argv[1])).get("max_position_embeddings") or 0)' \
  "$HF_DIR/config.json")
EVAL_DATA=${EVAL_DATA:-$REPO/data/eval_tasks/ctx$CONTEXT}
LOCAL_TASKS=
if [ -n "${EVAL_SOURCE:-}" ] || [ -d "$REPO/data/default" ]; then
  EVAL_SOURCE=${EVAL_SOURCE:-$REPO/data/default}
  # shellcheck disable=SC2086  # BUILD_ARGS is a list of flags
  "$PYTHON" "$REPO/eval_scripts/build_local_tasks.py" --source "$EVAL_SOURCE" --out "$EVAL_DATA" \
    --max_tokens "$CONTEXT" --window_tokenizer "$HF_DIR" ${BUILD_ARGS:-}
  EVAL_DATA=$(cd "$EVAL_DATA" && pwd)
  LOCAL_TASKS=$("$PYTHON" -c 'import json, sys; print(",".join(json.load(open(sys.argv[1]))["tasks"]))' \
    "$EVAL_DATA/manifest.json")
else
  echo "note: local suite skipped: no corpus at $REPO/data/default (build_default_corpus.py makes one; or set" \
    "EVAL_SOURCE)" >&2
  EVAL_DATA=$STAGE
fi
[ -n "$LOCAL_TASKS" ] || [ "${REFERENCE:-1}" != 0 ] || fail "nothing to evaluate: REFERENCE=0 and no local suite"
find "$STAGE" -mindepth 1 -maxdepth 1 ! -name .lock -exec rm -rf {} +  # an interrupted run's leftovers
FAILED=0

run_lm_eval() {  # <run name> <tasks> <shots, or "default": lm-eval's> [required: a failure fails the script]
  local extra=() log="$STAGE/raw/$1.log" started=$SECONDS
  [ -n "${LIMIT:-}" ] && extra+=(--limit "$LIMIT")
  [ -n "${DEVICE:-}" ] && extra+=(--device "$DEVICE")
  [ "$3" != default ] && extra+=(--num_fewshot "$3")
  echo "== lm_eval: $2 ($3-shot)"
  mkdir -p "$STAGE/raw"
  # NOTE: run inside the task data directory: the local task YAMLs name their data files relative to it.
  if ! (cd "$EVAL_DATA" && "${LM_EVAL[@]}" --model hf --model_args "pretrained=$HF_DIR,dtype=$DTYPE" \
      --tasks "$2" --include_path "$REPO/eval_scripts/tasks" --batch_size "$BATCH_SIZE" \
      --output_path "$STAGE/raw/$1" "${extra[@]}") > "$log" 2>&1; then
    echo "skipped $2: lm_eval failed after $((SECONDS - started)) s: $(grep -v '^\s*$' "$log" | tail -n 1) (log:" \
      "$OUT_DIR/raw/$1.log)" >&2
    if [ -n "${4:-}" ]; then FAILED=1; fi
  else
    grep -A 100 '^|' "$log" || true
    echo "== lm_eval: $2 took $((SECONDS - started)) s"
  fi
}

if [ -n "$LOCAL_TASKS" ]; then run_lm_eval local "$LOCAL_TASKS" 0 required; fi
if [ "${REFERENCE:-1}" != 0 ]; then
  REFERENCE_RUNS=$("$PYTHON" "$REPO/eval_scripts/eval_tools.py" available --status "$STAGE/reference_status.json" \
    --hub_off "$HUB_OFF")
  while read -r shots tasks; do
    if [ -n "$tasks" ]; then run_lm_eval "reference_${shots}shot" "$tasks" "$shots"; fi
  done <<< "$REFERENCE_RUNS"
fi
"$PYTHON" "$REPO/eval_scripts/eval_tools.py" summarize "$STAGE"
# Earlier results (OVERWRITE=1) go only once the new ones are complete.
rm -rf "$OUT_DIR.replaced"
if [ -e "$OUT_DIR" ]; then mv "$OUT_DIR" "$OUT_DIR.replaced"; fi
rm -f "$STAGE/.lock"
mv "$STAGE" "$OUT_DIR"
rm -rf "$OUT_DIR.replaced"
echo "results: $OUT_DIR/results.md $OUT_DIR/results.json ($SECONDS s in all)"
exit "$FAILED"
