"""Tests of spes.corpus (data_process_scripts/tokenize_data.py) and list_processed_files.sh on real files."""

from __future__ import annotations

import gzip
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from data_fixtures import (
    INPUT_FORMATS,
    REPO_ROOT,
    SAMPLE_TEXTS,
    SCRIPTS_DIR,
    split_documents,
    write_documents,
    write_lines,
)
from spes import corpus
from spes.data import TokenSequenceDataset
from spes.shards import read_shard_info, resolve_paths, sidecar_path
from spes.tokenizer import LoadedTokenizer


def _tokenize(files: list[Path], tokenizer: LoadedTokenizer, prefix: Path, **kwargs: object):
    return corpus.tokenize_files(files, tokenizer=tokenizer, output_prefix=prefix, progress=False, **kwargs)


def _all_tokens(shards: list[Path]) -> np.ndarray:
    return np.concatenate([np.load(p) for p in shards])


@pytest.mark.parametrize("fmt", INPUT_FORMATS)
def test_text_round_trips_through_shards(fmt: str, tokenizer: LoadedTokenizer, tmp_path: Path) -> None:
    path = write_documents(tmp_path / f"docs.{fmt}", SAMPLE_TEXTS)
    summary = _tokenize([path], tokenizer, tmp_path / "out" / "part", batch_size=3)
    assert summary.num_documents == len(SAMPLE_TEXTS) and summary.num_malformed == 0
    tokens = _all_tokens(summary.shards)
    assert tokens.dtype == np.uint16 and tokens[-1] == tokenizer.eos_token_id
    decoded = [tokenizer.decode(ids) for ids in split_documents(tokens, tokenizer.eos_token_id)]
    assert decoded == SAMPLE_TEXTS
    info = read_shard_info(summary.shards[0])
    assert info.tokenizer_fingerprint == tokenizer.fingerprint
    assert (info.num_tokens, info.num_documents, info.source_files) == (len(tokens), len(SAMPLE_TEXTS), (str(path),))


def test_shards_respect_max_shard_bytes_and_documents_continue_across_them(
    tokenizer: LoadedTokenizer, tmp_path: Path
) -> None:
    path = write_documents(tmp_path / "docs.jsonl", SAMPLE_TEXTS * 3)
    whole = _tokenize([path], tokenizer, tmp_path / "whole" / "part")
    cut = _tokenize([path], tokenizer, tmp_path / "cut" / "part", max_shard_bytes=101)
    assert len(whole.shards) == 1 and len(cut.shards) > 5
    sizes = [np.load(p, mmap_mode="r").nbytes for p in cut.shards]
    assert max(sizes) <= 101 and all(s == 100 for s in sizes[:-1])
    assert [p.name for p in cut.shards[:2]] == ["part_00000.npy", "part_00001.npy"]
    np.testing.assert_array_equal(_all_tokens(cut.shards), _all_tokens(whole.shards))
    assert sum(read_shard_info(p).num_documents for p in cut.shards) == whole.num_documents


def test_several_processes_write_the_same_shards(tokenizer: LoadedTokenizer, tmp_path: Path) -> None:
    files = [write_documents(tmp_path / f"docs{i}.jsonl", SAMPLE_TEXTS[i:] + ["{bad"]) for i in range(3)]
    one = _tokenize(files, tokenizer, tmp_path / "one" / "part", batch_size=2, max_shard_bytes=200)
    two = _tokenize(files, tokenizer, tmp_path / "two" / "part", batch_size=2, max_shard_bytes=200, processes=2)
    assert (one.num_documents, one.num_tokens, one.num_malformed) == (
        two.num_documents,
        two.num_tokens,
        two.num_malformed,
    )
    for a, b in zip(one.shards, two.shards, strict=True):
        np.testing.assert_array_equal(np.load(a), np.load(b))
        assert read_shard_info(a) == read_shard_info(b)


def test_malformed_lines_are_reported_with_file_and_line_and_counted(
    tokenizer: LoadedTokenizer, tmp_path: Path
) -> None:
    lines = [
        b'{"text": "good one"}',
        b"{not json",
        b'{"other": "x"}',
        b'{"text": 42}',
        b"[1, 2]",
        b"",
        b'{"text": "\\ud800 lone surrogate"}',
        b'\xff\xfe{"text": "bad utf-8"}',
        b'{"text": "good two"}',
    ]
    path = write_lines(tmp_path / "mixed.jsonl.gz", b"\n".join(lines) + b"\n")
    summary = _tokenize([path], tokenizer, tmp_path / "out" / "part")
    assert summary.num_documents == 2 and summary.num_malformed == 6
    assert [m.split(": ")[0] for m in summary.malformed_examples] == [f"{path}:{n}" for n in (2, 3, 4, 5, 7, 8)]
    assert "missing field 'text'" in summary.malformed_examples[1]
    assert "int, not a string" in summary.malformed_examples[2]
    docs = split_documents(_all_tokens(summary.shards), tokenizer.eos_token_id)
    assert [tokenizer.decode(d) for d in docs] == ["good one", "good two"]


def test_truncated_compressed_file_is_reported_and_the_run_goes_on(tokenizer: LoadedTokenizer, tmp_path: Path) -> None:
    whole = gzip.compress(b"".join(b'{"text": "doc %d"}\n' % i for i in range(2000)))
    broken = tmp_path / "a_broken.jsonl.gz"
    broken.write_bytes(whole[: len(whole) // 2])
    good = write_documents(tmp_path / "b_good.jsonl", ["after the broken file"])
    summary = _tokenize([broken, good], tokenizer, tmp_path / "out" / "part")
    assert summary.num_malformed == 1 and "file unreadable" in summary.malformed_examples[0]
    assert summary.malformed_examples[0].startswith(f"{broken}:")
    docs = split_documents(_all_tokens(summary.shards), tokenizer.eos_token_id)
    assert tokenizer.decode(docs[-1]) == "after the broken file"


def test_parquet_null_rows_are_reported_and_missing_column_fails_early(
    tokenizer: LoadedTokenizer, tmp_path: Path
) -> None:
    path = write_documents(tmp_path / "docs.parquet", ["a", None, "b"])
    summary = _tokenize([path], tokenizer, tmp_path / "out" / "part")
    assert summary.num_documents == 2 and summary.malformed_examples == [
        f"{path}:2: field 'text' is NoneType, not a string"
    ]
    with pytest.raises(ValueError, match="no column 'body'"):
        _tokenize([path], tokenizer, tmp_path / "out2" / "part", text_field="body")


def test_dtype_defaults_to_smallest_and_too_small_is_an_error() -> None:
    assert corpus.choose_dtype(4096) == np.uint16
    assert corpus.choose_dtype(65536) == np.uint16
    assert corpus.choose_dtype(151665) == np.uint32
    assert corpus.choose_dtype(4096, "uint32") == np.uint32
    with pytest.raises(ValueError, match="cannot hold token ids up to 151664"):
        corpus.choose_dtype(151665, "uint16")


def test_existing_output_is_never_overwritten(tokenizer: LoadedTokenizer, tmp_path: Path) -> None:
    path = write_documents(tmp_path / "docs.jsonl", SAMPLE_TEXTS)
    _tokenize([path], tokenizer, tmp_path / "out" / "part")
    with pytest.raises(FileExistsError, match="part_00000.npy"):
        _tokenize([path], tokenizer, tmp_path / "out" / "part")


def test_interrupted_run_leaves_only_complete_shards(tokenizer: LoadedTokenizer, tmp_path: Path) -> None:
    files = [write_documents(tmp_path / "docs.jsonl", SAMPLE_TEXTS * 4)]

    def chunks_then_crash() -> Iterator:
        for i, chunk in enumerate(corpus.iter_file_chunks(files[0], "text", 4)):
            if i == 5:
                raise KeyboardInterrupt
            yield chunk

    prefix = tmp_path / "out" / "part"
    with pytest.raises(KeyboardInterrupt):
        corpus.tokenize_chunks(
            chunks_then_crash(), tokenizer=tokenizer, output_prefix=prefix, max_shard_bytes=1000, progress=False
        )
    written = sorted(prefix.parent.iterdir())
    shards = [p for p in written if p.suffix == ".npy"]
    assert shards and all(sidecar_path(p).is_file() for p in shards)
    assert not [p for p in written if p.name.endswith(".partial")]
    dataset = TokenSequenceDataset(shards, seq_len=8)
    assert dataset.num_tokens == 500 * len(shards)  # only full 1000-byte shards were completed


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_killed_cli_run_leaves_nothing_that_looks_complete(tokenizer: LoadedTokenizer, tmp_path: Path) -> None:
    write_documents(tmp_path / "docs.jsonl", SAMPLE_TEXTS * 4000)
    out = tmp_path / "out"
    proc = subprocess.Popen(
        [
            sys.executable,
            str(SCRIPTS_DIR / "tokenize_data.py"),
            "--file_glob",
            str(tmp_path / "*.jsonl"),
            "--tokenizer_name_or_path",
            str(tokenizer.path.parent),
            "--output_prefix",
            str(out / "part"),
            "--max_shard_bytes",
            "4000",
            "--batch_size",
            "50",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 120  # NOTE: the script's imports alone took over 30 s on a loaded 2-core CI host
        # NOTE: the first finished shard, not its sidecar: the sidecar is written before the shard is renamed into
        # place, so a kill as soon as a sidecar appears can leave no shard at all (CI at d038a10 saw exactly that)
        while not list(out.glob("*.npy")) and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.01)
        proc.send_signal(signal.SIGKILL)
    finally:
        proc.wait()
    shards = sorted(out.glob("*.npy"))
    assert shards, f"no shard written (exit status {proc.returncode}; -9: killed by this test at its deadline)"
    for shard in shards:  # every shard that appeared has its sidecar (written before the rename) and matches it
        assert sidecar_path(shard).is_file(), f"{shard.name} appeared without its sidecar"
        assert read_shard_info(shard).num_tokens == len(np.load(shard, mmap_mode="r"))


def test_cli_reports_malformed_lines_and_writes_shards(tokenizer: LoadedTokenizer, tmp_path: Path) -> None:
    write_lines(tmp_path / "a.jsonl.zst", b'{"text": "fine"}\n{broken\n')
    result = subprocess.run(
        [
            sys.executable,
            str(SCRIPTS_DIR / "tokenize_data.py"),
            "--file_glob",
            str(tmp_path / "*.jsonl.zst"),
            "--tokenizer_name_or_path",
            str(tokenizer.path.parent),
            "--output_prefix",
            str(tmp_path / "o" / "p"),
            "--processes",
            "1",
            "--batch_size",
            "10",
            "--max_shard_bytes",
            "1000",
            "--text_field",
            "text",
            "--dtype",
            "uint32",
        ],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    assert f"{tmp_path / 'a.jsonl.zst'}:2: bad JSON" in result.stderr
    assert "malformed records skipped: 1" in result.stdout
    assert np.load(tmp_path / "o" / "p_00000.npy").dtype == np.uint32


def test_cli_error_names_the_glob_that_matches_nothing(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code = corpus.tokenize_main(
        [
            "--file_glob",
            str(tmp_path / "*.jsonl"),
            "--tokenizer_name_or_path",
            "x",
            "--output_prefix",
            str(tmp_path / "p"),
        ]
    )
    assert code == 2 and f"{tmp_path / '*.jsonl'}" in capsys.readouterr().err


def test_cli_help_lists_every_flag() -> None:
    text = corpus.tokenize_parser().format_help()
    for flag in (
        "--file_glob",
        "--tokenizer_name_or_path",
        "--output_prefix",
        "--text_field",
        "--processes",
        "--batch_size",
        "--max_shard_bytes",
        "--dtype",
    ):
        assert flag in text


def test_the_first_implementations_command_runs_and_files_per_process_changes_nothing(
    tokenizer: LoadedTokenizer, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Its README's flags as written (Qwen's Hub id aside: a local tokenizer); --files_per_process is accepted and
    the shards are those of a run without it."""
    (tmp_path / "in").mkdir()
    for name in ("a", "b"):
        write_documents(tmp_path / "in" / f"{name}.jsonl", SAMPLE_TEXTS)
    common = [
        "--file_glob",
        str(tmp_path / "in" / "*.jsonl"),
        "--tokenizer_name_or_path",
        str(tokenizer.path.parent),
        "--text_field",
        "text",
        "--processes",
        "2",
        "--batch_size",
        "500",
        "--max_shard_bytes",
        "4294967296",
        "--dtype",
        "uint32",
    ]
    out = tmp_path / "out"
    assert corpus.tokenize_main([*common, "--output_prefix", str(out / "tokenized_"), "--files_per_process", "1"]) == 0
    assert "--files_per_process 1 changes nothing" in capsys.readouterr().err
    assert corpus.tokenize_main([*common, "--output_prefix", str(out / "plain_")]) == 0
    with_flag, without = sorted(out.glob("tokenized__*.npy")), sorted(out.glob("plain__*.npy"))
    assert len(with_flag) == len(without) >= 1
    assert np.array_equal(_all_tokens(with_flag), _all_tokens(without))
    assert _all_tokens(with_flag).dtype == np.uint32


def test_list_processed_files_lists_every_token_file_training_reads_sorted(
    tokenizer: LoadedTokenizer, tmp_path: Path
) -> None:
    """spes shards and the first implementation's headerless uint32 files (no sidecar) alike; a shard still being
    written (.npy.partial) is not listed."""
    path = write_documents(tmp_path / "docs.jsonl", SAMPLE_TEXTS)
    summary = _tokenize([path], tokenizer, tmp_path / "out" / "sub" / "part", max_shard_bytes=200)
    headerless = tmp_path / "out" / "olmo_000.npy"
    np.arange(100, dtype=np.uint32).tofile(headerless)
    (tmp_path / "out" / "writing_00000.npy.partial").write_bytes(b"")
    listing = tmp_path / "files.txt"
    result = subprocess.run(
        [
            "bash",
            str(REPO_ROOT / "data_process_scripts" / "list_processed_files.sh"),
            str(tmp_path / "out"),
            str(listing),
        ],
        capture_output=True,
        text=True,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    expected = [str(p.resolve()) for p in [*summary.shards, headerless]]
    assert listing.read_text().splitlines() == sorted(expected)
    assert f"listed {len(expected)} shard(s)" in result.stderr and "1 without a sidecar" in result.stderr
    assert resolve_paths([str(listing)]) == sorted(Path(p) for p in expected)
    assert not os.path.exists(str(listing) + ".tmp")
