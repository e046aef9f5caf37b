#!/usr/bin/env bash
# Write the sorted list of complete token shards under a directory, one absolute path a line.
#
#   data_process_scripts/list_processed_files.sh <dir> <file_list.txt>
#
# A shard is complete when its sidecar <shard>.npy.json exists (tokenize_data.py writes it last);
# incomplete shards are skipped and counted on stderr. The list is written atomically and is
# what data.paths accepts as a .txt list file.
set -euo pipefail

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

tmp=$(mktemp "$(dirname "$out")/.$(basename "$out").XXXXXX")
trap 'rm -f "$tmp"' EXIT
complete=0
incomplete=0
while IFS= read -r -d '' shard; do
  if [[ -f "$shard.json" ]]; then
    printf '%s\n' "$shard" >>"$tmp"
    complete=$((complete + 1))
  else
    echo "skipping incomplete shard (no sidecar): $shard" >&2
    incomplete=$((incomplete + 1))
  fi
done < <(find "$(realpath "$dir")" -type f -name '*.npy' -print0 | LC_ALL=C sort -z)

if [[ $complete -eq 0 ]]; then
  echo "error: no complete .npy shard under $dir" >&2
  exit 1
fi
chmod 644 "$tmp"
mv -f "$tmp" "$out"
trap - EXIT
echo "listed $complete shard(s) in $out (skipped $incomplete incomplete)" >&2
