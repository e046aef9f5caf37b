"""Token shards on disk: flat 1-D `.npy` token arrays, each with a JSON sidecar `<shard>.npy.json`.

`data_process_scripts/tokenize_data.py` writes a shard, then its sidecar (atomically, last), so a shard
without a sidecar is incomplete and is refused. This module is the format and the path resolution of
`data.paths`; it imports no torch, so tokenization workers start light (the dataset lives in `spes.data`).
"""

from __future__ import annotations

import glob
import json
import os
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

from spes.atomic import write_atomic

SIDECAR_SUFFIX = ".json"
SHARD_FORMAT_VERSION = 1
_GLOB_CHARS = frozenset("*?[")


@dataclass(frozen=True)
class ShardInfo:
    """What a shard's sidecar records about it; its presence marks the shard as complete."""

    tokenizer_fingerprint: str
    """sha256 of the tokenizer.json the tokens came from."""
    vocab_size: int
    eos_token_id: int
    dtype: str
    num_tokens: int
    num_documents: int
    """Documents whose EOS lies in this shard (a document may start in the previous shard)."""
    source_files: tuple[str, ...]
    format_version: int = SHARD_FORMAT_VERSION


def sidecar_path(shard: str | os.PathLike[str]) -> Path:
    """`<shard>.npy.json`: the sidecar that marks `shard` as complete."""
    shard = Path(shard)
    return shard.with_name(shard.name + SIDECAR_SUFFIX)


def write_shard_info(shard: Path, info: ShardInfo) -> None:
    """Write the sidecar of a finished shard atomically (temp file in the same dir + rename)."""
    write_atomic(sidecar_path(shard), json.dumps(asdict(info), indent=2) + "\n")


def read_shard_info(shard: str | os.PathLike[str]) -> ShardInfo:
    """The sidecar of `shard`; ValueError naming the file when it is missing or malformed."""
    path = sidecar_path(shard)
    if not path.is_file():
        raise ValueError(
            f"token shard {shard} has no sidecar {path.name}: it is incomplete (tokenization interrupted?). "
            f"Delete it and rerun data_process_scripts/tokenize_data.py, or list only complete shards with "
            f"data_process_scripts/list_processed_files.sh"
        )
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
        raw["source_files"] = tuple(raw["source_files"])
        info = ShardInfo(**raw)
    except (json.JSONDecodeError, KeyError, TypeError) as err:
        raise ValueError(f"sidecar {path} is malformed ({err}); rerun tokenize_data.py for this shard") from err
    if info.format_version != SHARD_FORMAT_VERSION:
        raise ValueError(f"sidecar {path} has format_version {info.format_version}; this spes reads "
                         f"version {SHARD_FORMAT_VERSION}")
    return info


def resolve_paths(
    paths: str | os.PathLike[str] | Sequence[str | os.PathLike[str]], base_dir: Path | None = None
) -> list[Path]:
    """Expand `data.paths` entries into shard files, in order.

    An entry is a file, a glob (sorted matches, `**` allowed), a directory (its `*.npy`, sorted) or
    a `.txt` list file with one path or glob per line (relative lines are relative to the list
    file; what list_processed_files.sh writes). Relative entries are relative to `base_dir`
    (default: the working directory). Repeats are kept, so listing a shard twice upsamples it.
    """
    entries = [paths] if isinstance(paths, (str, os.PathLike)) else list(paths)
    if not entries:
        raise ValueError("data.paths is empty: give token shard files, globs, directories or .txt list files")
    resolved: list[Path] = []
    for entry in entries:
        resolved.extend(_resolve_entry(str(entry), base_dir))
    return resolved


def _resolve_entry(entry: str, base_dir: Path | None, list_file: Path | None = None) -> list[Path]:
    path = Path(entry).expanduser()
    if not path.is_absolute() and base_dir is not None:
        path = base_dir / path
    where = f" (listed in {list_file})" if list_file else ""
    if _GLOB_CHARS & set(entry):
        matches = [Path(m) for m in sorted(glob.glob(str(path), recursive=True)) if os.path.isfile(m)]
        if not matches:
            raise FileNotFoundError(f"data path pattern {entry!r}{where} matches no file")
        return matches
    if path.is_dir():
        matches = sorted(path.glob("*.npy"))
        if not matches:
            raise FileNotFoundError(f"data directory {entry!r}{where} holds no .npy token shards")
        return matches
    if not path.is_file():
        raise FileNotFoundError(f"data path {entry!r}{where} does not exist")
    if path.suffix == ".txt" and list_file is None:
        lines = [ln.strip() for ln in path.read_text(encoding="utf-8").splitlines()]
        listed = [p for ln in lines if ln and not ln.startswith("#") for p in _resolve_entry(ln, path.parent, path)]
        if not listed:
            raise ValueError(f"data list file {path} names no shards")
        return listed
    return [path]
