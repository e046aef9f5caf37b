#!/usr/bin/env bash
# Regenerate the gRPC stubs of protos/spes.proto into spes/sync/proto/ (or into $1).
# Usage: run_scripts/gen_protos.sh [OUT_DIR]      (PYTHON=... picks the interpreter)
# The generated *_grpc.py is patched to import its sibling module package-relatively.
set -euo pipefail
[[ "${1:-}" =~ ^(-h|--help)$ ]] && { sed -n '2,/^[^#]/{/^#SBATCH/d;s/^# \{0,1\}//p;}' "$0"; exit 0; }  # the header above is the help

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
OUT_DIR="${1:-$ROOT/spes/sync/proto}"
PYTHON="${PYTHON:-python3}"

mkdir -p "$OUT_DIR"
"$PYTHON" -m grpc_tools.protoc \
  -I "$ROOT/protos" \
  --python_out="$OUT_DIR" \
  --pyi_out="$OUT_DIR" \
  --grpc_python_out="$OUT_DIR" \
  "$ROOT/protos/spes.proto"

# NOTE: protoc emits `import spes_pb2 as spes__pb2`, which only works with the output dir on sys.path.
sed -i 's/^import spes_pb2 as spes__pb2$/from . import spes_pb2 as spes__pb2/' "$OUT_DIR/spes_pb2_grpc.py"
echo "wrote stubs to $OUT_DIR"
