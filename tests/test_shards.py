"""Tests of spes.shards: the sidecar format and how `data.paths` entries resolve to shard files."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from data_fixtures import write_token_shard
from spes.shards import resolve_paths

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture
def shards(tmp_path: Path) -> list[Path]:
    return [write_token_shard(tmp_path / f"part_{i:05d}.npy", np.arange(10, dtype=np.uint16)) for i in range(3)]


def test_resolve_paths_expands_files_globs_directories_and_list_files(shards: list[Path], tmp_path: Path) -> None:
    listing = tmp_path / "lists" / "files.txt"
    listing.parent.mkdir()
    listing.write_text(f"# complete shards\n{shards[2]}\n\n../part_00000.npy\n")
    assert resolve_paths(str(shards[1])) == [shards[1]]
    assert resolve_paths(str(tmp_path / "part_*.npy")) == shards
    assert resolve_paths([tmp_path]) == shards
    assert resolve_paths(["lists/files.txt", "part_0000[1].npy"], base_dir=tmp_path) == [
        shards[2],
        tmp_path / "lists" / ".." / "part_00000.npy",
        shards[1],
    ]


@pytest.mark.parametrize("entry", ["nothing_*.npy", "missing.npy", "empty_dir"])
def test_resolve_paths_names_the_entry_that_matches_nothing(entry: str, tmp_path: Path) -> None:
    (tmp_path / "empty_dir").mkdir()
    with pytest.raises(FileNotFoundError, match=re.escape(entry)):
        resolve_paths([entry], base_dir=tmp_path)


def test_resolve_paths_refuses_an_empty_list() -> None:
    with pytest.raises(ValueError, match="data.paths is empty"):
        resolve_paths([])


def test_tokenization_imports_no_torch() -> None:
    """Each tokenize_data worker process would otherwise pay torch's import time and ~300 MB of memory."""
    code = "import sys, spes.corpus, spes.default_corpus; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.strip() == "False", out.stderr
