#!/usr/bin/env bash
# Write the sorted list of token shards under a directory, one absolute path a line.
#
#   data_process_scripts/list_processed_files.sh <dir> <file_list.txt>
#
# Lists every .npy file training reads: spes shards (with their <shard>.npy.json sidecar) and token files without
# one, such as the first implementation's headerless uint32 files (read with data.memmap_dtype, their tokenizer
# unchecked; counted on stderr). A shard tokenize_data.py is still writing is named <shard>.npy.partial and is not
# listed. The list is written atomically and is what data.paths accepts as a .txt list file.
set -euo pipefail
[[ "${1:-}" =~ ^(-h|--help)$ ]] && { sed -n '2,/^[^#]/{/^#SBATCH/d;s/^# \{0,1\}//p;}' "$0"; exit 0; }  # the header above is the help

if [[ $# -ne 2 ]]; then
  echo "usage: $0 <dir> <file_list.txt>" >&2
  exit 2
fi
dir=$1
out=$2
if [[ ! -d "$dir" ]]; then
  echo "error: $dir is not a directory" >&2
  exit 2
fi
if [[ ! -d "$(dirname "$out")" ]]; then
  echo "error: $(dirname "$out") (the folder of $out) does not exist; create it or choose another list file" >&2
  exit 2
fi

tmp=$(mktemp "$(dirname "$out")/.$(basename "$out").XXXXXX")
trap 'rm -f "$tmp"' EXIT
listed=0
bare=0
while IFS= read -r -d '' shard; do
  printf '%s\n' "$shard" >>"$tmp"
  listed=$((listed + 1))
  [[ -f "$shard.json" ]] || bare=$((bare + 1))
done < <(find "$(realpath "$dir")" -type f -name '*.npy' -print0 | LC_ALL=C sort -z)

if [[ $listed -eq 0 ]]; then
  echo "error: no .npy token file under $dir" >&2
  exit 1
fi
chmod 644 "$tmp"
mv -f "$tmp" "$out"
trap - EXIT
echo "listed $listed shard(s) in $out ($bare without a sidecar: read as OLMo-format token files with" \
  "data.memmap_dtype, their tokenizer unchecked)" >&2
