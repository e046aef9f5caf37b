"""Shared helpers for the data-pipeline tests: a tiny tokenizer, input files, synthetic shards.

Import what you need (`from data_fixtures import write_documents, ...`); the shared `tokenizer`
fixture lives in conftest.py.
"""

from __future__ import annotations

import gzip
import json
import sysconfig
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import zstandard

from spes.shards import ShardInfo, write_shard_info

REPO_ROOT = Path(__file__).resolve().parents[1]
SCRIPTS_DIR = REPO_ROOT / "data_process_scripts"
INPUT_FORMATS = ("jsonl", "jsonl.gz", "jsonl.zst", "parquet")

SAMPLE_TEXTS = [
    "The quick brown fox jumps over the lazy dog.",
    "def add(a, b):\n    return a + b\n",
    "Grüße aus Köln — naïve café, 東京, Привет, 😀 emoji and tabs\tand\r\nCRLF",
    "   leading and trailing spaces   ",
    "a literal <|endoftext|> inside a document stays text",
    "",
    "x" * 3000,
    "Numbers 0123456789 and punctuation !@#$%^&*()[]{};:'\",.<>/?\\|`~",
]


def tokenizer_training_texts() -> list[str]:
    """SAMPLE_TEXTS plus a few standard-library sources: enough for a few hundred merges."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    sources = [(stdlib / name).read_text(encoding="utf-8") for name in ("abc.py", "bisect.py", "textwrap.py")]
    return SAMPLE_TEXTS + sources


def write_documents(path: Path, texts: Sequence[object], text_field: str = "text") -> Path:
    """Write `texts` (strings, or anything for malformed records) in the format named by `path`'s suffix."""
    if path.name.endswith(".parquet"):
        pq.write_table(pa.table({text_field: list(texts)}), path)
        return path
    payload = "".join(json.dumps({text_field: t}) + "\n" for t in texts).encode("utf-8")
    return write_lines(path, payload)


def write_lines(path: Path, payload: bytes) -> Path:
    """Write raw JSON-lines bytes, compressed as `path`'s suffix says."""
    if path.name.endswith(".gz"):
        payload = gzip.compress(payload)
    elif path.name.endswith(".zst"):
        payload = zstandard.ZstdCompressor().compress(payload)
    path.write_bytes(payload)
    return path


def write_token_shard(
    path: Path,
    tokens: np.ndarray,
    *,
    fingerprint: str = "0" * 64,
    with_sidecar: bool = True,
    vocab_size: int | None = None,
    eos_token_id: int = 0,
) -> Path:
    """A shard holding exactly `tokens` (dtype kept), with a sidecar unless told otherwise (recording the dtype's
    range as its vocabulary unless given)."""
    array = np.lib.format.open_memmap(path, mode="w+", dtype=tokens.dtype, shape=tokens.shape)
    array[:] = tokens
    array.flush()
    del array
    if with_sidecar:
        info = ShardInfo(
            tokenizer_fingerprint=fingerprint,
            vocab_size=vocab_size or int(np.iinfo(tokens.dtype).max) + 1,
            eos_token_id=eos_token_id,
            dtype=tokens.dtype.name,
            num_tokens=len(tokens),
            num_documents=1,
            source_files=("synthetic",),
        )
        write_shard_info(path, info)
    return path


def split_documents(tokens: np.ndarray, eos_token_id: int) -> list[list[int]]:
    """Token ids of each document of a flat EOS-terminated stream (the EOS left out)."""
    ends = np.flatnonzero(tokens == eos_token_id)
    starts = np.concatenate([[0], ends[:-1] + 1])
    return [tokens[s:e].tolist() for s, e in zip(starts, ends)]
