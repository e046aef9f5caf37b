#!/usr/bin/env bash
# Turn a spes checkpoint into a Hugging Face model directory (OLMoE, Qwen3-MoE or Mixtral, whichever
# computes exactly what the run's model computes; see spes/hf.py).
#
#   eval_scripts/convert_to_hf.sh <RUN_DIR> <SAVE_STEP> <MODEL_SIZE> [export flags...]
#     RUN_DIR     a save folder, e.g. output/spes_1b/node0
#     SAVE_STEP   a step number (its step<N> directory) or "latest"
#     MODEL_SIZE  a label for the output directory name, e.g. 1B
#   writes $HF_ROOT/<MODEL_SIZE>-step<N> (HF_ROOT defaults to <RUN_DIR>/hf) and prints its path.
#   Extra flags go to `python -m spes.hf export`, e.g. --dtype bfloat16 --tokenizer <dir> --overwrite.
#
# Env: PYTHON (default .venv/bin/python of this repo, else python3), HF_ROOT.
set -euo pipefail
[[ "${1:-}" =~ ^(-h|--help)$ ]] && { sed -n '2,/^[^#]/{/^#SBATCH/d;s/^# \{0,1\}//p;}' "$0"; exit 0; }  # the header above is the help

if [ "$#" -lt 3 ]; then
  echo "usage: $0 <RUN_DIR> <SAVE_STEP|latest> <MODEL_SIZE> [spes.hf export flags...]" >&2
  exit 2
fi
for arg in "$1" "$2" "$3"; do
  if [[ $arg == -* ]]; then
    echo "error: flags go after <RUN_DIR> <SAVE_STEP|latest> <MODEL_SIZE> (got $arg among them); --help for more" >&2
    exit 2
  fi
done
RUN_DIR=$1
SAVE_STEP=$2
MODEL_SIZE=$3
shift 3
REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
PYTHON=${PYTHON:-$REPO/.venv/bin/python}
[ -x "$PYTHON" ] || PYTHON=python3
HF_ROOT=${HF_ROOT:-$RUN_DIR/hf}

not_a_save_folder() {  # <RUN_DIR>: what it is instead of a node's save folder, and what to pass; exits 2
  local why node step="<N>"
  node=$(compgen -G "$1/*/latest" | sort | head -n 1 || true)
  [[ $(basename "$1") =~ ^step([0-9]+) ]] && step=${BASH_REMATCH[1]}
  if [ ! -d "$1" ]; then
    why="does not exist (relative to $PWD)"
  elif [ -f "$1/meta.json" ]; then
    why="is a checkpoint, not a save folder: run $0 $(printf %q "$(dirname "$1")") $step $MODEL_SIZE"
  elif [ -f "$1/state.json" ]; then
    why="is the parameter server's state, which holds no checkpoint: convert a node's save folder, e.g."
    why+=" $(dirname "$1")/node0"
  elif [ -n "$node" ]; then
    why="holds the save folders of the nodes, not a checkpoint: pass one of them, e.g. $(dirname "$node")"
  else
    why="holds no checkpoint (no latest file, no step<N> directory): pass a node's save folder, e.g."
    why+=" output/quickstart/node0"
  fi
  echo "error: RUN_DIR $1 $why" >&2
  exit 2
}
if [ ! -f "$RUN_DIR/latest" ] && ! compgen -G "$RUN_DIR/step[0-9]*" > /dev/null; then
  not_a_save_folder "$RUN_DIR"
fi
if [ "$SAVE_STEP" = latest ]; then
  if [ ! -f "$RUN_DIR/latest" ]; then
    echo "error: $RUN_DIR has no latest file; name one of its steps instead of latest:" \
      "$(cd "$RUN_DIR" && compgen -G "step[0-9]*" | sed 's/^step//; s/-sharded$//' | sort -n | paste -sd ' ')" >&2
    exit 2
  fi
  STEP_NAME=$(tr -d '[:space:]' < "$RUN_DIR/latest")
else
  STEP_NAME=step$SAVE_STEP
fi

export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
exec env PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}" "$PYTHON" -m spes.hf export --run_dir "$RUN_DIR" \
  --step "$SAVE_STEP" --out "$HF_ROOT/$MODEL_SIZE-$STEP_NAME" "$@"
