#!/usr/bin/env bash
# Turn a spes checkpoint into a Hugging Face model directory (OLMoE, Qwen3-MoE or Mixtral, whichever
# computes exactly what the run's model computes; see spes/hf.py).
#
#   eval_scripts/convert_to_hf.sh <RUN_DIR> <SAVE_STEP> <MODEL_SIZE> [export flags...]
#     RUN_DIR     a save folder, e.g. output/spes_1b/node0
#     SAVE_STEP   a step number or its step<N> directory's name, or "latest"
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
# NOTE: step<N> is the checkpoint's folder name, as a refusal lists the available ones
if [[ $SAVE_STEP =~ ^step([0-9]+)$ ]]; then SAVE_STEP=${BASH_REMATCH[1]}; fi
MODEL_SIZE=$3
shift 3
REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
PYTHON=${PYTHON:-$REPO/.venv/bin/python}
[ -x "$PYTHON" ] || PYTHON=python3
HF_ROOT=${HF_ROOT:-$RUN_DIR/hf}

# NOTE: the checkpoint's directory name, from spes's own lookup (a folder that is no save folder is named for what
# it is: a run's output folder, the server's state, a checkpoint itself), before the export reads any weights
STEP_NAME=$(PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}" "$PYTHON" -c 'import sys
from spes.save_folder import resolve_step
try:
    print(resolve_step(sys.argv[1], sys.argv[2]).name.removesuffix("-sharded"))
except (FileNotFoundError, ValueError) as e:
    sys.exit(f"error: {e}")' "$RUN_DIR" "$SAVE_STEP") || exit 2

export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
exec env PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}" "$PYTHON" -m spes.hf export --run_dir "$RUN_DIR" \
  --step "$SAVE_STEP" --out "$HF_ROOT/$MODEL_SIZE-$STEP_NAME" "$@"
