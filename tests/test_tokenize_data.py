"""Tests of spes.corpus (data_process_scripts/tokenize_data.py) and list_processed_files.sh on real files."""

from __future__ import annotations

import ctypes
import errno
import gc
import gzip
import io
import json
import os
import signal
import struct
import subprocess
import sys
import time
import warnings
from collections.abc import Callable, Iterator
from contextlib import closing, contextmanager
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np
import psutil
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import zstandard

from conftest import usage_error, wait_until
from data_fixtures import (
    INPUT_FORMATS,
    REPO_ROOT,
    SAMPLE_TEXTS,
    SCRIPTS_DIR,
    split_documents,
    write_documents,
    write_lines,
)
from disk_helpers import cap_file_size, run_child
from dist_helpers import child_env
from spes import corpus
from spes.data import TokenSequenceDataset
from spes.shards import ShardInfo, read_shard_info, resolve_paths, sidecar_path
from spes.tokenizer import LoadedTokenizer, train_byte_level_bpe


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
    assert info.tokenizer_fingerprint == tokenizer.fingerprint and info.dtype == "uint16"
    assert (info.vocab_size, info.eos_token_id) == (tokenizer.vocab_size, tokenizer.eos_token_id)
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
    reasons = [m.split(": ", 1)[1] for m in summary.malformed_examples]
    assert reasons[0].startswith("bad JSON (") and reasons[5].startswith("bad JSON (")
    assert reasons[1:4] == ["missing field 'text'", "field 'text' is int, not a string", "not a JSON object but list"]
    assert reasons[4].startswith("text cannot be tokenized, invalid Unicode? (")
    docs = split_documents(_all_tokens(summary.shards), tokenizer.eos_token_id)
    assert [tokenizer.decode(d) for d in docs] == ["good one", "good two"]


def test_truncated_compressed_file_is_reported_and_the_run_goes_on(tokenizer: LoadedTokenizer, tmp_path: Path) -> None:
    whole = gzip.compress(b"".join(b'{"text": "doc %d"}\n' % i for i in range(2000)))
    broken = tmp_path / "a_broken.jsonl.gz"
    broken.write_bytes(whole[: len(whole) // 2])
    good = write_documents(tmp_path / "b_good.jsonl", ["after the broken file"])
    summary = _tokenize([broken, good], tokenizer, tmp_path / "out" / "part")
    assert summary.num_malformed == 1 and "file unreadable" in summary.malformed_examples[0]
    chunks = list(corpus.iter_file_chunks(broken, "text", 500))
    read = sum(len(chunk.records) for chunk in chunks)  # the lines before the break, each a record
    assert 0 < read < 2000 and all(chunk.source == str(broken) for chunk in chunks)
    assert summary.malformed_examples[0].startswith(f"{broken}:{read + 1}: file unreadable from here on (EOFError: ")
    assert read_shard_info(summary.shards[0]).source_files == (str(broken), str(good))
    junk = tmp_path / "c_junk.jsonl.gz"
    junk.write_bytes(b"not gzip at all")  # unreadable from its first line
    (chunk,) = corpus.iter_file_chunks(junk, "text", 10)
    assert chunk.records == [] and chunk.errors[0].startswith(f"{junk}:1: file unreadable from here on (BadGzipFile: ")
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
    assert corpus.choose_dtype(65536) == np.uint16 and corpus.choose_dtype(65536, "uint16") == np.uint16
    assert corpus.choose_dtype(65537) == np.uint32
    assert corpus.choose_dtype(151665) == np.uint32
    assert corpus.choose_dtype(4096, "uint32") == np.uint32
    with pytest.raises(ValueError, match="cannot hold token ids up to 151664"):
        corpus.choose_dtype(151665, "uint16")
    with pytest.raises(ValueError, match="cannot hold token ids up to 65536"):
        corpus.choose_dtype(65537, "uint16")
    with pytest.raises(ValueError) as refused:
        corpus.choose_dtype(4096, "int32")
    assert str(refused.value) == "--dtype int32 must be an unsigned integer type (uint16 or uint32)"


def test_existing_output_is_never_overwritten(tokenizer: LoadedTokenizer, tmp_path: Path) -> None:
    path = write_documents(tmp_path / "docs.jsonl", SAMPLE_TEXTS)
    _tokenize([path], tokenizer, tmp_path / "out" / "part")
    with pytest.raises(FileExistsError) as refused:
        _tokenize([path], tokenizer, tmp_path / "out" / "part")
    assert str(refused.value) == (
        f"{tmp_path / 'out' / 'part_00000.npy'} (and 1 more) already exist for --output_prefix "
        f"{tmp_path / 'out' / 'part'}; add --resume to continue the run that wrote them, delete them or choose "
        "another prefix"
    )
    chunks = corpus.iter_file_chunks(path, "text", 1000)
    with pytest.raises(FileExistsError):  # documents not read from files: never resumed either
        corpus.tokenize_chunks(chunks, tokenizer=tokenizer, output_prefix=tmp_path / "out" / "part", progress=False)
    (tmp_path / "out" / "part_00000.npy.json").unlink()  # one left: it was "(and 0 more) already exist ... them"
    with pytest.raises(FileExistsError) as refused:
        _tokenize([path], tokenizer, tmp_path / "out" / "part")
    assert str(refused.value) == (
        f"{tmp_path / 'out' / 'part_00000.npy'} already exists for --output_prefix {tmp_path / 'out' / 'part'}; "
        "add --resume to continue the run that wrote it, delete it or choose another prefix"
    )


def test_a_directory_given_as_the_output_prefix_is_refused(tokenizer: LoadedTokenizer, tmp_path: Path) -> None:
    """`--output_prefix tokens/` wrote tokens_00000.npy beside tokens/ and said it wrote tokens/_*.npy."""
    path = write_documents(tmp_path / "docs.jsonl", SAMPLE_TEXTS)
    (tmp_path / "made").mkdir()
    for given in (f"{tmp_path / 'tokens'}/", str(tmp_path / "made")):
        name = Path(given).name
        with pytest.raises(ValueError) as refused:
            _tokenize([path], tokenizer, given)  # type: ignore[arg-type]
        assert str(refused.value) == (
            f"--output_prefix {given} names a directory, not a file-name prefix (the shards would be {name}_00000.npy, "
            f"... beside it); give a prefix inside it, e.g. {tmp_path / name / 'part'}"
        )
    assert sorted(p.name for p in tmp_path.iterdir()) == ["docs.jsonl", "made"]


def test_an_output_prefix_whose_folder_cannot_be_made_is_named_with_the_fix(
    tokenizer: LoadedTokenizer, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The CLI printed errno's bare `[Errno 2] No such file or directory: '/proc/x'`, naming neither flag nor fix."""
    path = write_documents(tmp_path / "docs.jsonl", SAMPLE_TEXTS)
    (tmp_path / "file").touch()
    args = ["--file_glob", str(path), "--tokenizer_name_or_path", str(tokenizer.path.parent), "--output_prefix"]
    for folder, why in ((Path("/proc/x"), "No such file or directory"), (tmp_path / "file" / "sub", "Not a directory")):
        assert corpus.tokenize_main([*args, str(folder / "part")]) == 2
        assert capsys.readouterr().err == (
            f"error: --output_prefix {folder / 'part'}: its folder {folder} cannot be created ({why}); give a prefix "
            "in a folder you can write to\n"
        )
    assert corpus.tokenize_main([*args, "/proc/part"]) == 2  # there, but no file can be made in it (root's too)
    assert capsys.readouterr().err.startswith(
        "error: --output_prefix /proc/part: its folder /proc cannot be written to ("
    )

    def refused(dir: Path) -> None:  # NOTE: a folder root cannot write to; errno's own words, not its [Errno 13]
        raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(dir))

    monkeypatch.setattr(corpus.tempfile, "TemporaryFile", refused)
    folder = tmp_path / "read-only"
    assert corpus.tokenize_main([*args, str(folder / "part")]) == 2
    assert capsys.readouterr().err == (
        f"error: --output_prefix {folder / 'part'}: its folder {folder} cannot be written to (Permission denied); "
        "give a prefix in a folder you can write to\n"
    )


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
    infos = [read_shard_info(p) for p in shards]  # chunks not from files: no place in them is recorded
    assert {(i.input_end, i.input_position, i.input_settings) for i in infos} == {(None, None, None)}


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
    _resumed_as_whole(tokenizer, tmp_path, ["--max_shard_bytes", "4000", "--batch_size", "50"])


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


def test_cli_help_names_each_flag_with_its_meaning_and_default(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("COLUMNS", "300")
    shown = " ".join(corpus.tokenize_parser().format_help().split())
    assert (
        "--file_glob FILE_GLOB [FILE_GLOB ...] --tokenizer_name_or_path TOKENIZER_NAME_OR_PATH --output_prefix "
        "OUTPUT_PREFIX [--text_field TEXT_FIELD]" in shown
    )
    assert (
        "Tokenize .jsonl / .jsonl.gz / .jsonl.zst / .parquet text into flat .npy token shards (EOS after each "
        "document) with JSON sidecars, for spes training." in shown
    )
    for flag, meaning in {
        "--file_glob FILE_GLOB [FILE_GLOB ...]": "input files: one or more globs (quote them; '**' recurses), each "
        "sorted",
        "--tokenizer_name_or_path TOKENIZER_NAME_OR_PATH": "tokenizer directory (with tokenizer.json), tokenizer.json "
        "file or Hugging Face Hub id such as Qwen/Qwen2.5-0.5B (the local Hub cache first; or train one with "
        "data_process_scripts/train_tokenizer.py)",
        "--output_prefix OUTPUT_PREFIX": "shards are written as <output_prefix>_00000.npy, ... plus <shard>.json "
        "sidecars",
        "--text_field TEXT_FIELD": "JSON field / parquet column holding each document (default: text)",
        "--processes PROCESSES": "tokenizer processes (1 = in this process, using the tokenizer's own threads) "
        "(default: 1)",
        "--files_per_process FILES_PER_PROCESS": "the first implementation's flag, accepted and ignored: documents, "
        "not files, are spread over --processes here, and the shards are the same for any split",
        "--batch_size BATCH_SIZE": "documents per unit of work (default: 1000)",
        "--max_shard_bytes MAX_SHARD_BYTES": "maximum bytes of token data per shard (a shard is buffered in memory) "
        f"(default: {512 * 2**20})",
        "--dtype {uint16,uint32}": "token dtype (default: uint16 if the vocabulary fits, else uint32)",
        "--resume": "continue an interrupted run of the same flags after its last complete shard (the shards end the "
        "same as an uninterrupted run's); with no shard written yet, start",
    }.items():
        assert f"{flag} {meaning}" in shown, flag
    assert "(default: None)" not in shown  # after a required flag, or one whose help says what unset means
    argv = ["--file_glob", "x", "--tokenizer_name_or_path", "t", "--output_prefix", "p", "--files_per_process=all"]
    assert usage_error(capsys, lambda: corpus.tokenize_main(argv)).endswith(
        "error: argument --files_per_process: invalid int value: 'all'"
    )


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
    script = str(REPO_ROOT / "data_process_scripts" / "list_processed_files.sh")
    nowhere = tmp_path / "nodir" / "files.txt"
    result = subprocess.run(["bash", script, str(tmp_path / "out"), str(nowhere)], capture_output=True, text=True)
    assert result.returncode == 2 and result.stderr == (
        f"error: {nowhere.parent} (the folder of {nowhere}) does not exist; create it or choose another list file\n"
    )


def test_globs_recurse_expand_home_match_files_only_and_drop_repeats(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    top, deep = tmp_path / "in" / "a.jsonl", tmp_path / "in" / "sub" / "deeper" / "b.jsonl"
    deep.parent.mkdir(parents=True)
    for path in (top, deep):
        write_documents(path, ["a document"])
    (tmp_path / "in" / "folder.jsonl").mkdir()  # matched by the glob, and not a file
    assert corpus.resolve_input_files([str(tmp_path / "in" / "**" / "*.jsonl")]) == [top, deep]
    monkeypatch.setenv("HOME", str(tmp_path))
    assert corpus.resolve_input_files(["~/in/*.jsonl", str(top)]) == [top]
    kept = tmp_path / "raw [v2]" / "c.jsonl"  # NOTE: a folder a glob reads as a set of characters matched nothing
    kept.parent.mkdir()
    write_documents(kept, ["a document"])
    assert corpus.resolve_input_files([f"{kept.parent}/*.jsonl"]) == [kept]
    notes = tmp_path / "in" / "notes.txt"
    notes.write_text("not a record format")
    with pytest.raises(ValueError) as refused:
        corpus.resolve_input_files([str(tmp_path / "in" / "*")])
    assert (
        str(refused.value)
        == f"{notes}: unsupported input format; expected one of .jsonl, .jsonl.gz, .jsonl.zst, .parquet"
    )


def test_a_plain_jsonl_line_that_is_not_utf8_is_reported_and_the_rest_read(
    tokenizer: LoadedTokenizer, tmp_path: Path
) -> None:
    path = write_lines(tmp_path / "docs.jsonl", b'{"text": "caf\xe9"}\n{"text": "fine"}\n')
    summary = _tokenize([path], tokenizer, tmp_path / "out" / "part")
    assert summary.num_documents == 1 and summary.malformed_examples[0].startswith(f"{path}:1: bad JSON (")


def test_a_zstd_file_of_several_frames_is_read_whole_and_closed(tokenizer: LoadedTokenizer, tmp_path: Path) -> None:
    frames = [zstandard.ZstdCompressor().compress(b'{"text": "%s"}\n' % word) for word in (b"one", b"two")]
    path = tmp_path / "docs.jsonl.zst"
    path.write_bytes(b"".join(frames))  # as `zstdcat a b | ...` or a parallel compressor writes
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        chunks = list(corpus.iter_file_chunks(path, "text", 10))
        gc.collect()
    assert [record for chunk in chunks for _, record in chunk.records] == [b'{"text": "one"}\n', b'{"text": "two"}\n']
    assert not [w for w in seen if issubclass(w.category, ResourceWarning)]


def test_parquet_is_read_by_its_column_in_batches_numbering_rows_across_them(tmp_path: Path) -> None:
    path = tmp_path / "docs.parquet"
    pq.write_table(pa.table({"id": ["i1", "i2", "i3", "i4", "i5"], "body": ["a", "b", "c", None, "e"]}), path)
    chunks = list(corpus.iter_file_chunks(path, "body", 2))
    assert [chunk.records for chunk in chunks] == [[(1, "a"), (2, "b")], [(3, "c"), (4, None)], [(5, "e")]]
    assert not any(chunk.json_lines for chunk in chunks)


@pytest.mark.parametrize("line", [0, 2, 3, 4, 7, 9, 10])
def test_parquet_read_from_a_row_skips_the_row_groups_before_it(tmp_path: Path, line: int) -> None:
    """A resume of a parquet file starts at row `line`: the row groups before it are not read (10 rows in groups of 3:
    a start on a group's edge, inside one, in the last one and at the very end), and each chunk says where it starts
    (its rows; the offset stays 0)."""
    path = tmp_path / "docs.parquet"
    texts = [f"t{i}" for i in range(10)]
    pq.write_table(pa.table({"text": texts}), path, row_group_size=3)
    assert pq.ParquetFile(path).num_row_groups == 4
    read: list[list[int]] = []
    real = pq.ParquetFile.iter_batches

    def recorded(self: pq.ParquetFile, *args: Any, row_groups: Any = None, **kwargs: Any) -> Any:
        read.append(list(row_groups))
        return real(self, *args, row_groups=row_groups, **kwargs)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(pq.ParquetFile, "iter_batches", recorded)
        chunks = list(corpus.iter_file_chunks(path, "text", 2, corpus.InputPosition(5, 0, line)))
    assert [record for chunk in chunks for record in chunk.records] == list(enumerate(texts, start=1))[line:]
    assert [chunk.position for chunk in chunks] == [corpus.InputPosition(5, 0, row) for row in range(line, 10, 2)]
    assert read == [list(range(min(line // 3, 3) if line < 10 else 4, 4))]


def test_an_encoded_chunk_holds_the_shard_dtype(tokenizer: LoadedTokenizer) -> None:
    """What worker processes send back: tokens already in the shard's dtype, not int64 (four times the bytes)."""
    chunk = corpus.TextChunk("s", [(1, "one"), (2, "two")], json_lines=False)
    encoded = corpus.Encoder(tokenizer, "text", np.dtype(np.uint16))(chunk)
    assert encoded.tokens.dtype == np.uint16
    assert split_documents(encoded.tokens, tokenizer.eos_token_id) == tokenizer.encode_batch(["one", "two"])


def test_a_worker_loads_the_tokenizer_single_threaded_and_refuses_one_rewritten_since(
    tokenizer: LoadedTokenizer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What each tokenizer process does first, here in this process (mutmut traces no other)."""
    monkeypatch.setattr(corpus, "_WORKER_ENCODER", None)
    monkeypatch.setenv("TOKENIZERS_PARALLELISM", "true")
    handlers: list[tuple[int, object]] = []  # NOTE: not this process's: a SIGINT ignored here is the test runs' too
    monkeypatch.setattr(corpus.signal, "signal", lambda sig, handler: handlers.append((sig, handler)))
    chunk = corpus.TextChunk("s", [(1, b'{"body": "one"}')], json_lines=True)
    with pytest.raises(AssertionError) as unset:
        corpus._encode_in_worker(chunk)
    assert str(unset.value) == "worker used before _init_worker"
    corpus._init_worker(str(tokenizer.path), tokenizer.fingerprint, "body", np.dtype(np.uint16).str)
    assert os.environ["TOKENIZERS_PARALLELISM"].lower() == "false"  # as tokenizers reads it
    assert handlers == [(signal.SIGINT, signal.SIG_IGN)]  # a terminal's Ctrl-C is the main process's to handle
    encoded = corpus._encode_in_worker(chunk)
    assert encoded.tokens.dtype == np.uint16 and encoded.tokens.tolist() == [*tokenizer.encode_batch(["one"])[0], 0]
    with pytest.raises(ValueError) as refused:
        corpus._init_worker(str(tokenizer.path), "0" * 64, "body", "<u2")
    assert str(refused.value) == (
        f"{tokenizer.path} changed while tokenizing; rerun with a tokenizer nobody is rewriting"
    )


def test_processes_are_as_many_as_asked_with_two_chunks_each_in_flight(tokenizer: LoadedTokenizer) -> None:
    pulled: list[int] = []

    def chunks() -> Iterator[corpus.TextChunk]:
        for i in range(20):
            pulled.append(i)
            yield corpus.TextChunk("s", [(i, f"document {i}")], json_lines=False)

    before = set(psutil.Process().children())
    encoder = corpus.Encoder(tokenizer, "text", np.dtype(np.uint16))
    with closing(corpus._encode_all(chunks(), encoder, processes=3)) as encoded:  # no worker left if a check fails
        first = next(encoded)
        workers = set(psutil.Process().children()) - before
        assert len(pulled) == 6 and len(workers) == 3
        assert [first.doc_lengths.tolist(), *(e.doc_lengths.tolist() for e in encoded)] == [
            [len(ids) + 1] for ids in tokenizer.encode_batch([f"document {i}" for i in range(20)])
        ]
    assert not any(w.is_running() for w in workers)  # gone once the last chunk is back


def test_a_run_stopped_early_leaves_no_tokenizer_process(tokenizer: LoadedTokenizer) -> None:
    chunks = (corpus.TextChunk("s", [(i, f"document {i}")], json_lines=False) for i in range(20))
    before = set(psutil.Process().children())
    encoded = corpus._encode_all(chunks, corpus.Encoder(tokenizer, "text", np.dtype(np.uint16)), processes=2)
    next(encoded)
    workers = set(psutil.Process().children()) - before
    encoded.close()  # as a KeyboardInterrupt in the writer, or a consumer that stops
    assert len(workers) == 2 and not any(w.is_running() for w in workers)


def test_malformed_records_are_printed_on_stderr_up_to_a_hundred_and_every_one_counted(
    tokenizer: LoadedTokenizer, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    lines = [b"{bad %d" % i for i in range(corpus.MAX_REPORTED_ERRORS + 3)] + [b'{"text": "good"}']
    path = write_lines(tmp_path / "docs.jsonl", b"\n".join(lines) + b"\n")
    summary = _tokenize([path], tokenizer, tmp_path / "out" / "part", batch_size=7)
    assert (summary.num_malformed, summary.num_documents) == (corpus.MAX_REPORTED_ERRORS + 3, 1)
    assert len(summary.malformed_examples) == corpus.MAX_REPORTED_ERRORS
    printed = capsys.readouterr()
    shown = [line for line in printed.err.splitlines() if line.startswith("malformed: ")]
    assert shown[:-1] == [f"malformed: {m}" for m in summary.malformed_examples] and printed.out == ""
    assert shown[-1] == "malformed: further malformed records are counted but not printed"  # once, not per record


def test_the_summary_counts_every_chunks_tokens_and_the_time_it_took(
    tokenizer: LoadedTokenizer, tmp_path: Path
) -> None:
    path = write_documents(tmp_path / "docs.jsonl", SAMPLE_TEXTS)
    started = time.perf_counter()
    summary = _tokenize([path], tokenizer, tmp_path / "out" / "part", batch_size=3)
    took = time.perf_counter() - started
    assert summary.num_tokens == len(_all_tokens(summary.shards)) and 0 < summary.seconds <= took


def test_the_library_shows_progress_unless_told_not_to_and_checks_its_numbers(
    tokenizer: LoadedTokenizer, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = write_documents(tmp_path / "docs.jsonl", SAMPLE_TEXTS + [42])
    shown = corpus.tokenize_files([path], tokenizer=tokenizer, output_prefix=tmp_path / "shown" / "part")
    bar = capsys.readouterr().err.splitlines()[-1]  # tqdm's last line: records read, tokens, malformed
    assert f"{len(SAMPLE_TEXTS) + 1}doc" in bar and f"tokens={shown.num_tokens:,}, malformed=1]" in bar
    chunks = corpus.iter_file_chunks(path, "text", 1000)
    corpus.tokenize_chunks(chunks, tokenizer=tokenizer, output_prefix=tmp_path / "chunks" / "part")
    assert f"{len(SAMPLE_TEXTS) + 1}doc" in capsys.readouterr().err
    one_by_one = _tokenize([path], tokenizer, tmp_path / "quiet" / "part", batch_size=1)
    assert one_by_one.num_documents == len(SAMPLE_TEXTS) and "doc/s" not in capsys.readouterr().err
    for flag, value in (("batch_size", 0), ("processes", 0)):
        with pytest.raises(ValueError) as refused:
            _tokenize([path], tokenizer, tmp_path / "refused" / "part", **{flag: value})
        assert str(refused.value) == f"--{flag} must be >= 1, got 0"


def test_each_drawing_of_the_progress_bar_counts_the_tokens_of_the_documents_it_counts(
    tokenizer: LoadedTokenizer, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The token count was set after the bar was drawn: each drawing showed the tokens of one chunk less."""

    class EveryUpdate(corpus.tqdm):  # type: ignore[misc,name-defined]
        def __init__(self, *args: object, **kwargs: object) -> None:
            super().__init__(*args, mininterval=0, miniters=1, **kwargs)

    monkeypatch.setattr(corpus, "tqdm", EveryUpdate)
    texts = ["one", "two words", "three more words"]
    chunks = (corpus.TextChunk("s", [(i, t)], json_lines=False) for i, t in enumerate(texts))
    corpus.tokenize_chunks(chunks, tokenizer=tokenizer, output_prefix=tmp_path / "out" / "part")
    totals = np.cumsum([len(ids) + 1 for ids in tokenizer.encode_batch(texts)]).tolist()
    frames = capsys.readouterr().err.split("\r")
    drawn = [frame for frame in frames if "doc [" in frame and not frame.startswith("0doc")]
    assert len(drawn) >= len(texts)
    for frame in drawn:
        docs = int(frame.split("doc [")[0])
        assert frame.rstrip().endswith(f"tokens={totals[docs - 1]:,}, malformed=0]"), frame


def test_a_text_field_is_read_from_every_format_and_a_missing_column_refused_before_any_work(
    tokenizer: LoadedTokenizer, tmp_path: Path
) -> None:
    jsonl = write_documents(tmp_path / "a.jsonl", SAMPLE_TEXTS, text_field="body")
    summary = _tokenize([jsonl], tokenizer, tmp_path / "out" / "part", text_field="body")
    assert summary.num_documents == len(SAMPLE_TEXTS) and summary.num_malformed == 0
    parquet = write_documents(tmp_path / "b.parquet", SAMPLE_TEXTS)  # column "text"
    with pytest.raises(ValueError, match="no column 'body'"):
        _tokenize([jsonl, parquet], tokenizer, tmp_path / "none" / "part", text_field="body", max_shard_bytes=100)
    assert not (tmp_path / "none").exists()


def test_the_summary_counts_with_separators_and_a_rate() -> None:
    summary = corpus.TokenizeSummary(
        shards=[Path("a"), Path("b")], num_documents=1234, num_tokens=5000, num_malformed=1001, seconds=2.0
    )
    assert corpus.format_summary(summary) == (
        "documents: 1,234  tokens: 5,000  shards: 2  (2.0 s, 2,500 tokens/s)\nmalformed records skipped: 1,001"
    )
    assert "(0.0 s, 0 tokens/s)" in corpus.format_summary(corpus.TokenizeSummary(num_tokens=5))


def test_the_progress_bar_writes_its_counts_out(
    tokenizer: LoadedTokenizer, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """tqdm shows a number as the shorter of it and its `.3g` form (10000 as `1e+4`): the bar gets the counts
    written out with separators, as the summary line writes them."""
    path = write_documents(tmp_path / "docs.jsonl", SAMPLE_TEXTS * 40)
    summary = corpus.tokenize_files([path], tokenizer=tokenizer, output_prefix=tmp_path / "out" / "part", progress=True)
    assert summary.num_tokens >= 1000
    assert f"tokens={summary.num_tokens:,}, malformed=0" in capsys.readouterr().err
    assert corpus.TokenizeSummary(num_tokens=10_000, num_malformed=1000).progress() == {
        "tokens": "10,000",
        "malformed": "1,000",
    }


def test_the_cli_passes_its_flags_on_says_what_it_wrote_and_fails_when_no_document_was_read(
    tokenizer: LoadedTokenizer, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = write_documents(tmp_path / "docs.jsonl", ["only one document"], text_field="body")
    prefix = tmp_path / "out" / "part"
    common = ["--file_glob", str(path), "--tokenizer_name_or_path", str(tokenizer.path.parent), "--output_prefix"]
    assert corpus.tokenize_main([*common, str(prefix), "--text_field", "body", "--max_shard_bytes", "2"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == f"tokenized 1 file(s) into {prefix}_*.npy" and out[1].startswith("documents: 1  tokens: ")
    assert out[2] == "malformed records skipped: 0" and len(list(prefix.parent.glob("*.npy"))) > 1  # 1 token a shard
    assert corpus.tokenize_main([*common, str(tmp_path / "none" / "part")]) == 1
    assert capsys.readouterr().err.endswith("error: no document could be tokenized; check --text_field 'text'\n")
    for flag in ("--processes", "--batch_size"):
        assert corpus.tokenize_main([*common, str(tmp_path / "refused" / "part"), flag, "0"]) == 2
        assert capsys.readouterr().err == f"error: {flag} must be >= 1, got 0\n"


def test_a_shard_is_buffered_in_its_dtype_growing_by_doubling_from_a_small_start(
    tokenizer: LoadedTokenizer, tmp_path: Path
) -> None:
    """The memory --max_shard_bytes bounds: a buffer of the shard's dtype, at first 2**20 tokens however large a shard
    may be (a small corpus does not take 512 MB), doubled as tokens come, never past one shard."""
    writer = corpus.ShardWriter(
        tmp_path / "part", dtype=np.dtype(np.uint16), max_shard_bytes=2**23, tokenizer=tokenizer
    )  # a shard of 2**22 tokens
    tokens = np.arange(2**22 + 7, dtype=np.uint16)  # ids wrap around: the writer reads no id
    lengths = []
    for start, end in ((0, 10), (10, 2**20), (2**20, 2**20 + 1), (2**20 + 1, 2**22 + 7)):
        writer.write(corpus.EncodedChunk("s", tokens[start:end], np.array([end - start]), []))
        lengths.append(len(writer._buffer))
        assert writer._buffer.dtype == np.uint16
    assert lengths == [2**20, 2**20, 2**21, 2**22]
    shards = writer.close()
    assert [len(np.load(p)) for p in shards] == [2**22, 7]
    np.testing.assert_array_equal(_all_tokens(shards), tokens)
    assert [read_shard_info(p).num_documents for p in shards] == [3, 1]  # the fourth document ends in the second


def test_a_shard_holds_at_least_one_token(tokenizer: LoadedTokenizer, tmp_path: Path) -> None:
    with pytest.raises(ValueError) as refused:
        corpus.ShardWriter(tmp_path / "part", dtype=np.dtype(np.uint32), max_shard_bytes=3, tokenizer=tokenizer)
    assert str(refused.value) == "--max_shard_bytes 3 cannot hold one uint32 token"
    writer = corpus.ShardWriter(tmp_path / "part", dtype=np.dtype(np.uint32), max_shard_bytes=4, tokenizer=tokenizer)
    writer.write(corpus.EncodedChunk("s", np.array([5, 0, 6, 0], dtype=np.uint32), np.array([2, 2]), []))
    shards = writer.close()
    assert [np.load(p).tolist() for p in shards] == [[5], [0], [6], [0]]
    assert [read_shard_info(p).num_documents for p in shards] == [0, 1, 0, 1]


UNDER_WAY_FLAGS = ["--max_shard_bytes", "4000", "--batch_size", "50", "--processes", "2"]


def _resumed_as_whole(tokenizer: LoadedTokenizer, tmp_path: Path, flags: list[str]) -> None:
    """tokenize_data.py `flags` --resume into tmp_path/out ends with what an uninterrupted run writes."""
    common = ["--file_glob", str(tmp_path / "*.jsonl"), "--tokenizer_name_or_path", str(tokenizer.path.parent), *flags]
    assert corpus.tokenize_main([*common, "--output_prefix", str(tmp_path / "out" / "part"), "--resume"]) == 0
    assert corpus.tokenize_main([*common, "--output_prefix", str(tmp_path / "whole" / "part")]) == 0
    assert _outputs(tmp_path / "out") == _outputs(tmp_path / "whole")


@contextmanager
def _cli_run_under_way(tokenizer: LoadedTokenizer, tmp_path: Path) -> Iterator[tuple[subprocess.Popen[str], list]]:
    """tokenize_data.py --processes 2 on a large input into tmp_path/out, once its first shard is written (its
    tokenizer processes at work): the run and its tokenizer processes, killed when the block ends."""
    write_documents(tmp_path / "docs.jsonl", SAMPLE_TEXTS * 4000)
    out = tmp_path / "out"
    proc = subprocess.Popen(
        [sys.executable, str(SCRIPTS_DIR / "tokenize_data.py"), "--file_glob", str(tmp_path / "*.jsonl")]
        + ["--tokenizer_name_or_path", str(tokenizer.path.parent), "--output_prefix", str(out / "part")]
        + UNDER_WAY_FLAGS,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    workers: list[psutil.Process] = []
    try:
        deadline = time.monotonic() + 120  # NOTE: the imports alone can take 30 s on a loaded 2-core host
        while not list(out.glob("*.npy")) and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.01)
        workers = psutil.Process(proc.pid).children()
        yield proc, workers
    finally:
        proc.kill()
        for worker in _running(workers):
            worker.kill()


def _running(processes: list[psutil.Process]) -> list[psutil.Process]:
    """Those of `processes` still running (a zombie waiting for its reaper is not)."""
    running = []
    for process in processes:
        try:
            if process.is_running() and process.status() != psutil.STATUS_ZOMBIE:
                running.append(process)
        except psutil.NoSuchProcess:
            pass
    return running


@pytest.mark.slow
@pytest.mark.timeout(200)
@pytest.mark.parametrize("sig, group", [(signal.SIGTERM, False), (signal.SIGINT, True)], ids=["kill", "ctrl-c"])
def test_a_stopped_cli_run_says_what_it_kept_and_leaves_no_tokenizer_process(
    sig: signal.Signals, group: bool, tokenizer: LoadedTokenizer, tmp_path: Path
) -> None:
    """SIGTERM to the script alone (`kill`, `timeout`) left its tokenizer processes running forever; Ctrl-C (SIGINT to
    the whole group) ended in a traceback from every process."""
    with _cli_run_under_way(tokenizer, tmp_path) as (proc, workers):
        (os.killpg if group else os.kill)(proc.pid, sig)
        _, err = proc.communicate(timeout=60)
    assert len(workers) == 2 and proc.returncode == 130, err
    out = tmp_path / "out"
    kept = sorted(out.glob("*.npy"))
    assert err.splitlines()[-1] == (
        f"interrupted: {len(kept)} complete shard(s) (part_00000.npy{f' .. {kept[-1].name}' if len(kept) > 1 else ''})"
        " hold the start of the input only; rerun the same command with --resume to continue after them"
    )
    assert "Traceback" not in err
    assert not _running(workers)
    _resumed_as_whole(tokenizer, tmp_path, UNDER_WAY_FLAGS)


@pytest.mark.slow
@pytest.mark.timeout(200)
def test_a_run_killed_outright_leaves_no_tokenizer_process(tokenizer: LoadedTokenizer, tmp_path: Path) -> None:
    """SIGKILL (`kill -9`, the OOM killer) runs no shutdown: its tokenizer processes waited for work forever."""
    with _cli_run_under_way(tokenizer, tmp_path) as (proc, workers):
        proc.kill()
        proc.wait(timeout=60)  # NOTE: not communicate(): its stderr stays open while a tokenizer process holds it
        deadline = time.monotonic() + 10
        while _running(workers) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert len(workers) == 2 and not _running(workers)


STUCK_AFTER_LINE = """
import os, sys, time
from pathlib import Path
from spes import corpus

busy, last_line = Path(sys.argv[1]), int(sys.argv[2])
encode = corpus.Encoder.__call__


def stuck(encoder, chunk):
    if chunk.records[0][0] > last_line:  # NOTE: a chunk as long as a huge --batch_size one, on any machine
        (busy / str(os.getpid())).touch()
        time.sleep(600)
    return encode(encoder, chunk)


corpus.Encoder.__call__ = stuck
sys.exit(corpus.tokenize_main(sys.argv[3:]))
"""
"""tokenize_data.py whose tokenizer processes encode the lines up to argv[2], then each stays 600 s on its next chunk
(once it has touched its pid in folder argv[1]); its flags follow."""
STOP_S = 15
"""How soon a stopped run must have exited: the old wait for the chunks in flight was their 600 s here."""
STUCK_FLAGS = ["--batch_size", "10", "--max_shard_bytes", "400", "--processes", "2"]


@pytest.mark.slow
@pytest.mark.timeout(200)
@pytest.mark.parametrize("sig, group", [(signal.SIGTERM, False), (signal.SIGINT, True)], ids=["kill", "ctrl-c"])
def test_a_stopped_cli_run_does_not_wait_for_its_chunks_in_flight(
    sig: signal.Signals, group: bool, tokenizer: LoadedTokenizer, tmp_path: Path
) -> None:
    """A stop waited for the chunks the tokenizer processes held, tens of seconds with large chunks (past a
    scheduler's grace before its SIGKILL): they are killed at once, and only complete shards are left."""
    write_documents(tmp_path / "docs.jsonl", SAMPLE_TEXTS * 40)
    busy, out = tmp_path / "busy", tmp_path / "out"
    busy.mkdir()
    flags = ["--file_glob", str(tmp_path / "*.jsonl"), "--tokenizer_name_or_path", str(tokenizer.path.parent)]
    proc = subprocess.Popen(
        [sys.executable, "-c", STUCK_AFTER_LINE, str(busy), "100", *flags, "--output_prefix", str(out / "part")]
        + STUCK_FLAGS,
        env=child_env(),
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    workers: list[psutil.Process] = []
    try:
        wait_until(lambda: len(list(busy.iterdir())) == 2 or proc.poll() is not None, "both processes stuck", 120)
        assert proc.poll() is None, proc.communicate()[1]
        workers = psutil.Process(proc.pid).children()
        (os.killpg if group else os.kill)(proc.pid, sig)
        try:
            _, err = proc.communicate(timeout=STOP_S)
        except subprocess.TimeoutExpired:
            pytest.fail(f"tokenize_data.py still ran {STOP_S} s after {sig.name}")
    finally:
        proc.kill()
        for worker in _running(workers):
            worker.kill()
    assert len(workers) == 2 and not _running(workers)
    assert proc.returncode == 130 and "Traceback" not in err, err
    kept = sorted(out.glob("*.npy"))
    assert err.splitlines()[-1].startswith(f"interrupted: {len(kept)} complete shard(s) (part_00000.npy .. ")
    assert sorted(out.iterdir()) == sorted([*kept, *map(sidecar_path, kept)])  # no .partial, no lone sidecar
    assert all(read_shard_info(shard).num_tokens == len(np.load(shard)) for shard in kept)
    _resumed_as_whole(tokenizer, tmp_path, STUCK_FLAGS)


@pytest.mark.parametrize(
    "stopped_after, left",
    [("write_shard_info", []), ("replace", ["part_00000.npy", "part_00000.npy.json"])],
    ids=["sidecar", "rename"],
)
def test_a_stop_while_a_shard_is_written_leaves_it_whole_or_nothing_of_it(
    stopped_after: str, left: list[str], tokenizer: LoadedTokenizer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A stop between a shard's sidecar and its rename left the sidecar of a shard never written beside the complete
    ones; one just after the rename must keep both."""
    owner = corpus if stopped_after == "write_shard_info" else corpus.os
    call = getattr(owner, stopped_after)

    def called_then_stopped(first: Path, second: Any) -> None:
        call(first, second)
        if str(second).endswith(".npy") or isinstance(second, ShardInfo):
            raise KeyboardInterrupt  # as Ctrl-C does

    monkeypatch.setattr(owner, stopped_after, called_then_stopped)
    path = write_documents(tmp_path / "docs.jsonl", SAMPLE_TEXTS)
    with pytest.raises(KeyboardInterrupt):
        _tokenize([path], tokenizer, tmp_path / "out" / "part")
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == left


def _half_sent(chunk: corpus.TextChunk) -> None:
    """A tokenizer process killed while sending its chunk back: the start of a message, never its end (the message
    is told in `chunk.source`, once sent)."""
    results = sys._getframe(1).f_locals["result_queue"]  # NOTE: concurrent.futures' worker loop's
    os.write(results._writer.fileno(), struct.pack("!i", 2**20) + b"cut short")
    Path(chunk.source).touch()
    time.sleep(600)


@pytest.mark.timeout(60)
def test_a_stop_ends_though_a_tokenizer_process_sent_half_a_chunk_back(
    tokenizer: LoadedTokenizer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Killing the tokenizer processes, one of them in the midst of sending its chunk back, left the pool's reader
    waiting for the rest of that message, and the stop with it, forever."""
    monkeypatch.setattr(corpus, "_encode_in_worker", _half_sent)
    sent = tmp_path / "sent"

    def stopped() -> Iterator[corpus.TextChunk]:
        yield corpus.TextChunk(str(sent), [(1, "text")], json_lines=False)
        wait_until(sent.exists, "half a chunk sent back")
        raise KeyboardInterrupt  # as Ctrl-C does

    encoder = corpus.Encoder(tokenizer, "text", np.dtype(np.uint16))
    with pytest.raises(KeyboardInterrupt):
        list(corpus._encode_all(stopped(), encoder, processes=2))


def test_an_interrupted_cli_run_says_what_it_kept_or_that_it_wrote_nothing(
    tokenizer: LoadedTokenizer, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    path = write_documents(tmp_path / "docs.jsonl", SAMPLE_TEXTS)
    prefix = tmp_path / "out" / "part"
    args = ["--file_glob", str(path), "--tokenizer_name_or_path", str(tokenizer.path.parent), "--output_prefix"]

    def interrupted(*args: object, **kwargs: object) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(corpus, "tokenize_files", interrupted)
    assert corpus.tokenize_main([*args, str(prefix)]) == 130
    assert capsys.readouterr().err == "interrupted before the first shard was complete: nothing written\n"
    prefix.parent.mkdir()
    for number in (0, 1):
        for name in (f"part_0000{number}.npy", f"part_0000{number}.npy.json"):
            (prefix.parent / name).touch()
        assert corpus.tokenize_main([*args, str(prefix)]) == 130
        names = "part_00000.npy" + (" .. part_00001.npy" if number else "")
        assert capsys.readouterr().err.startswith(f"interrupted: {number + 1} complete shard(s) ({names}) ")


def test_an_input_without_any_record_is_told_as_such_not_as_a_wrong_text_field(
    tokenizer: LoadedTokenizer, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    empty = tmp_path / "empty.jsonl"
    empty.write_bytes(b"\n\n")
    args = ["--file_glob", str(empty), "--tokenizer_name_or_path", str(tokenizer.path.parent), "--output_prefix"]
    assert corpus.tokenize_main([*args, str(tmp_path / "out" / "part")]) == 1
    assert capsys.readouterr().err.endswith("error: no document could be tokenized; the input files hold no record\n")


def _outputs(folder: Path) -> dict[str, bytes]:
    """Every file in `folder` by name: shards and sidecars, byte for byte."""
    return {path.name: path.read_bytes() for path in sorted(folder.iterdir())}


@contextmanager
def _stopped_after(shards: int, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """A run raises KeyboardInterrupt (as Ctrl-C does) once shard number `shards` (from 1) is complete, in the midst
    of writing a chunk."""
    flush = corpus.ShardWriter._flush

    def flush_then_stop(writer: corpus.ShardWriter) -> None:
        flush(writer)
        if len(writer.shards) == shards:
            raise KeyboardInterrupt

    with monkeypatch.context() as patched:
        patched.setattr(corpus.ShardWriter, "_flush", flush_then_stop)
        yield


def _two_files(tmp_path: Path) -> list[Path]:
    return [
        write_documents(tmp_path / "a.jsonl", SAMPLE_TEXTS * 3 + ["{bad"]),
        write_documents(tmp_path / "b.jsonl.gz", SAMPLE_TEXTS[::-1] * 2),
    ]


RESUMABLE = {"batch_size": 3, "max_shard_bytes": 20}
"""Chunks of 3 documents (48 to 122 tokens), shards of 10 uint16 tokens: several shards end inside one chunk, and
inside documents."""


@pytest.mark.parametrize("processes", [1, 2])
@pytest.mark.parametrize("stop", [7, 30])
def test_an_interrupted_run_resumed_writes_what_an_uninterrupted_run_writes(
    processes: int, stop: int, tokenizer: LoadedTokenizer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An interrupted run could not be continued: a rerun was refused while its shards existed."""
    files = _two_files(tmp_path)
    whole = _tokenize(files, tokenizer, tmp_path / "whole" / "part", processes=processes, **RESUMABLE)
    prefix = tmp_path / "out" / "part"
    with _stopped_after(stop, monkeypatch), pytest.raises(KeyboardInterrupt):
        _tokenize(files, tokenizer, prefix, processes=processes, **RESUMABLE)
    kept = sorted(prefix.parent.glob("*.npy"))
    end = read_shard_info(kept[-1]).input_end
    assert kept and end is not None and end[1] > 0  # the resumed run starts inside a chunk
    assert np.load(kept[-1])[-1] != tokenizer.eos_token_id  # ... and inside a document
    with _stopped_after(stop + 20, monkeypatch), pytest.raises(KeyboardInterrupt):  # the resumed run stopped too
        _tokenize(files, tokenizer, prefix, processes=processes, resume=True, **RESUMABLE)
    kept = sorted(prefix.parent.glob("*.npy"))
    resumed = _tokenize(files, tokenizer, prefix, processes=processes, resume=True, **RESUMABLE)
    assert _outputs(prefix.parent) == _outputs(whole.shards[0].parent)
    assert resumed.shards == [prefix.parent / p.name for p in whole.shards] and resumed.resumed_shards == len(kept)
    new = [read_shard_info(p) for p in resumed.shards[len(kept) :]]
    assert (resumed.num_tokens, resumed.num_documents) == (
        sum(info.num_tokens for info in new),
        sum(info.num_documents for info in new),
    )


def test_a_resumed_runs_first_chunk_loses_the_tokens_written_and_the_documents_ending_in_them() -> None:
    chunk = corpus.EncodedChunk("s", np.arange(9, dtype=np.uint16), np.array([3, 2, 4]), ["s:1: bad JSON"])
    for token, lengths in ((0, [3, 2, 4]), (4, [1, 4]), (5, [4]), (9, [])):
        start = corpus.ResumePoint((), 0, token)
        (first, later) = corpus._drop_written(iter([chunk, chunk]), start)
        assert first.doc_lengths.tolist() == lengths and first.tokens.tolist() == list(range(token, 9))
        assert first.errors == chunk.errors and later is chunk


def test_resuming_a_finished_run_changes_nothing_and_one_that_wrote_nothing_starts(
    tokenizer: LoadedTokenizer, tmp_path: Path
) -> None:
    files = _two_files(tmp_path)
    prefix = tmp_path / "out" / "part"
    nothing = _tokenize(files, tokenizer, tmp_path / "nothing" / "part", resume=True, **RESUMABLE)
    assert nothing.resumed_shards == 0 and len(nothing.shards) > 100
    prefix.parent.mkdir()
    # what a run killed outright may leave: a shard and its sidecar written (renamed into place) or being written
    for name in ("part_00000.npy.partial", "part_00000.npy.json", ".part_00001.npy.json.k1ll3d.tmp"):
        (prefix.parent / name).write_bytes(b"half")
    first = _tokenize(files, tokenizer, prefix, resume=True, **RESUMABLE)
    done = _outputs(prefix.parent)
    assert done == _outputs(tmp_path / "nothing")  # the leftovers gone
    again = _tokenize(files, tokenizer, prefix, resume=True, **RESUMABLE)
    assert _outputs(prefix.parent) == done and again.shards == first.shards
    assert (again.num_tokens, again.resumed_shards) == (0, len(first.shards))


INPUT_CHANGED = (
    "the input files (--file_glob: their paths, order, sizes and modification times) changed since the run that wrote "
    "{shard}"
)


@pytest.mark.parametrize(
    "change, refusal",
    [
        ({"batch_size": 4}, "--batch_size changed since the run that wrote {shard} (3 then, 4 now)"),
        ({"max_shard_bytes": 22}, "--max_shard_bytes changed since the run that wrote {shard} (20 then, 22 now)"),
        ({"dtype": "uint32"}, "--dtype changed since the run that wrote {shard} (uint16 then, uint32 now)"),
        ({"text_field": "body"}, "--text_field changed since the run that wrote {shard} (text then, body now)"),
        (
            {"tokenizer": "other"},
            "the tokenizer (--tokenizer_name_or_path: its tokenizer.json) changed since the run that wrote {shard}",
        ),
        ({"files": "grown"}, INPUT_CHANGED),
        ({"files": "rewritten"}, INPUT_CHANGED),
    ],
    ids=["batch_size", "max_shard_bytes", "dtype", "text_field", "tokenizer", "files grown", "files rewritten"],
)
def test_resuming_with_a_changed_setting_is_refused_naming_it(
    change: dict[str, object], refusal: str, tokenizer: LoadedTokenizer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    files = _two_files(tmp_path)
    prefix = tmp_path / "out" / "part"
    with _stopped_after(4, monkeypatch), pytest.raises(KeyboardInterrupt):
        _tokenize(files, tokenizer, prefix, **RESUMABLE)
    before = _outputs(prefix.parent)
    change = dict(change)  # NOTE: the parameter itself is shared by every run of this test in the process
    files_change = change.pop("files", None)
    if files_change == "grown":
        with files[0].open("a") as f:
            f.write('{"text": "one more"}\n')
    elif files_change == "rewritten":  # only paths and sizes were compared: it resumed over other data
        stat = files[0].stat()
        files[0].write_bytes(files[0].read_bytes().replace(b"quick", b"QUICK"))
        os.utime(files[0], ns=(stat.st_atime_ns, stat.st_mtime_ns + 1))  # NOTE: a test edits within a clock tick
    if change.pop("tokenizer", None):
        tokenizer = train_byte_level_bpe(SAMPLE_TEXTS, vocab_size=300, output_dir=tmp_path / "other")
    with pytest.raises(ValueError) as refused:
        _tokenize(files, tokenizer, prefix, resume=True, **{**RESUMABLE, **change})
    shard = sorted(prefix.parent.glob("*.npy"))[0]  # each shard's sidecar is checked, the first first
    assert str(refused.value) == (
        f"--resume: {refusal.format(shard=shard)}; rerun with the same, or without --resume into another "
        "--output_prefix"
    )
    assert _outputs(prefix.parent) == before


def test_resuming_shards_without_their_input_position_or_with_one_missing_is_refused(
    tokenizer: LoadedTokenizer, tmp_path: Path
) -> None:
    files = _two_files(tmp_path)
    prefix = tmp_path / "out" / "part"
    shards = _tokenize(files, tokenizer, prefix, **RESUMABLE).shards
    last = sidecar_path(shards[-1])
    old = {k: v for k, v in json.loads(last.read_text()).items() if k not in ("input_end", "input_settings")}
    last.write_text(json.dumps(old))  # what spes wrote before --resume existed
    with pytest.raises(ValueError) as refused:
        _tokenize(files, tokenizer, prefix, resume=True, **RESUMABLE)
    assert str(refused.value) == (
        f"--resume: {shards[-1]} does not record where it ends in the input (it was written by an earlier spes, or "
        f"not from files); delete {prefix}_* and rerun without --resume"
    )
    shards[1].unlink()
    with pytest.raises(ValueError) as refused:
        _tokenize(files, tokenizer, prefix, resume=True, **RESUMABLE)
    assert str(refused.value) == (
        f"--resume: {shards[1]} is missing, so the shards of --output_prefix {prefix} are not one interrupted run's; "
        f"delete {prefix}_* and rerun without --resume"
    )


def test_the_cli_resumes_a_stopped_run_as_its_interrupted_line_says(
    tokenizer: LoadedTokenizer, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    files = _two_files(tmp_path)
    args = ["--file_glob", str(tmp_path / "*.jsonl*"), "--tokenizer_name_or_path", str(tokenizer.path.parent)]
    args += ["--batch_size", "3", "--max_shard_bytes", "20", "--output_prefix"]
    assert corpus.tokenize_main([*args, str(tmp_path / "whole" / "part")]) == 0
    prefix = tmp_path / "out" / "part"
    with _stopped_after(5, monkeypatch):
        assert corpus.tokenize_main([*args, str(prefix)]) == 130
    kept = sorted(prefix.parent.glob("*.npy"))
    assert capsys.readouterr().err.splitlines()[-1] == (
        f"interrupted: {len(kept)} complete shard(s) (part_00000.npy .. {kept[-1].name}) hold the start of the input "
        "only; rerun the same command with --resume to continue after them"
    )
    assert corpus.tokenize_main([*args, str(prefix), "--resume"]) == 0
    assert capsys.readouterr().out.splitlines()[-1] == (
        f"resumed: the first {len(kept)} shard(s) were kept from the interrupted run; the counts above are of the rest"
    )
    assert _outputs(prefix.parent) == _outputs(tmp_path / "whole") and files


def _stop_inside(shards: list[Path], file: int) -> int:
    """The number (from 1) of the first of `shards` that ends in input file `file` after its first chunk."""
    for number, shard in enumerate(shards, start=1):
        position = read_shard_info(shard).input_position
        if position is not None and position["file"] == file and position["line"] > 0:
            return number
    raise AssertionError(f"no shard ends inside input file {file}")


def _garbled(path: Path, end: int) -> None:
    """Bytes before `end` of `path` overwritten, its size and modification time kept: input a run must not read."""
    stat = path.stat()
    with path.open("r+b") as f:
        f.write(b"\xff" * end)
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))


@pytest.mark.parametrize("fmt", INPUT_FORMATS)
def test_a_resumed_run_reads_no_input_before_where_its_last_shard_ends(
    fmt: str, tokenizer: LoadedTokenizer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A resume read the whole input up to where its shards end (hours of a large input): the files before are not
    opened now, and a plain file is read from the byte its chunk starts at, so garbling those changes nothing."""
    files = [
        write_documents(tmp_path / "a.jsonl.gz", SAMPLE_TEXTS * 2),
        write_documents(tmp_path / f"b.{fmt}", SAMPLE_TEXTS[::-1] * 3 + [None] + SAMPLE_TEXTS),
    ]
    whole = _tokenize(files, tokenizer, tmp_path / "whole" / "part", **RESUMABLE)
    prefix = tmp_path / "out" / "part"
    with _stopped_after(_stop_inside(whole.shards, 1), monkeypatch), pytest.raises(KeyboardInterrupt):
        _tokenize(files, tokenizer, prefix, **RESUMABLE)
    position = read_shard_info(sorted(prefix.parent.glob("*.npy"))[-1]).input_position
    assert position is not None and position["line"] > 0
    _garbled(files[0], files[0].stat().st_size)
    if fmt == "jsonl":
        _garbled(files[1], position["offset"])
    resumed = _tokenize(files, tokenizer, prefix, resume=True, **RESUMABLE)
    assert _outputs(prefix.parent) == _outputs(tmp_path / "whole")
    assert (
        resumed.malformed_examples
        == whole.malformed_examples
        == [f"{files[1]}:{3 * len(SAMPLE_TEXTS) + 1}: field 'text' is NoneType, not a string"]
    )


def test_a_stream_that_cannot_seek_is_read_up_to_the_offset_a_block_at_a_time(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(corpus, "_SKIP_BLOCK", 4)
    for offset, then in ((0, b"\x00"), (9, b"\x09"), (12, b""), (40, b"")):  # the last ones: at and past the end
        stream = io.BufferedReader(io.BytesIO(bytes(range(12))))
        monkeypatch.setattr(stream, "seekable", lambda: False)
        corpus._skip(stream, offset)
        assert stream.read(1) == then, offset


def test_a_folder_holding_shards_of_two_runs_is_refused_naming_the_first_of_the_other(
    tokenizer: LoadedTokenizer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Only the last shard's sidecar was checked: a run resumed after shards another run had written."""
    ours = _two_files(tmp_path)
    theirs = [write_documents(tmp_path / "theirs.jsonl", SAMPLE_TEXTS[::-1])]
    for files, folder, stop in ((ours, "out", 6), (theirs, "theirs", 3)):
        with _stopped_after(stop, monkeypatch), pytest.raises(KeyboardInterrupt):
            _tokenize(files, tokenizer, tmp_path / folder / "part", **RESUMABLE)
    for path in (tmp_path / "theirs").iterdir():
        path.replace(tmp_path / "out" / path.name)
    with pytest.raises(ValueError) as refused:
        _tokenize(ours, tokenizer, tmp_path / "out" / "part", resume=True, **RESUMABLE)
    assert str(refused.value) == (
        f"--resume: {INPUT_CHANGED.format(shard=tmp_path / 'out' / 'part_00000.npy')}; rerun with the same, or "
        "without --resume into another --output_prefix"
    )


NOT_RECORDED = (
    "{shard} does not record where it ends in the input (it was written by an earlier spes, or not from files); "
    "delete {prefix}_* and rerun without --resume"
)


def _without(key: str) -> Callable[[dict[str, Any]], object]:
    return lambda recorded: recorded.pop(key)


@pytest.mark.parametrize(
    "damage, refusal",
    [
        (_without("input_end"), NOT_RECORDED),
        (_without("input_position"), NOT_RECORDED),
        (_without("input_settings"), NOT_RECORDED),
        (
            lambda recorded: recorded["input_position"].pop("offset"),
            "the sidecar of {shard} records a malformed input_position (KeyError('offset')); delete {prefix}_* and "
            "rerun without --resume",
        ),
        (
            lambda recorded: recorded["input_settings"].update(later_flag=7),
            "later_flag changed since the run that wrote {shard} (7 then, None now); rerun with the same, or without "
            "--resume into another --output_prefix",
        ),
        (
            lambda recorded: None,
            "{sidecar} is missing, so the shards of --output_prefix {prefix} are not one interrupted run's; delete "
            "{prefix}_* and rerun without --resume",
        ),
    ],
    ids=["input_end", "input_position", "input_settings", "malformed position", "unknown setting", "no sidecar"],
)
def test_a_shard_whose_sidecar_cannot_say_where_to_resume_is_refused_naming_it(
    damage: Callable[[dict[str, Any]], object], refusal: str, tokenizer: LoadedTokenizer, tmp_path: Path
) -> None:
    """Each shard's sidecar is read, not the last one's alone; a setting a later spes records is named by its key."""
    files = _two_files(tmp_path)
    prefix = tmp_path / "out" / "part"
    shards = _tokenize(files, tokenizer, prefix, **RESUMABLE).shards
    sidecar = sidecar_path(shards[1])
    recorded = json.loads(sidecar.read_text())
    damage(recorded)
    sidecar.write_text(json.dumps(recorded))
    if refusal.startswith("{sidecar}"):
        sidecar.unlink()
    with pytest.raises(ValueError) as refused:
        _tokenize(files, tokenizer, prefix, resume=True, **RESUMABLE)
    assert str(refused.value) == "--resume: " + refusal.format(shard=shards[1], sidecar=sidecar, prefix=prefix)


class _Parent:
    """multiprocessing.parent_process() of a tokenizer process, as it reads it."""

    def __init__(self, alive: bool) -> None:
        self.alive = alive

    def is_alive(self) -> bool:
        return self.alive


@pytest.mark.parametrize("alive", [True, False], ids=["parent alive", "parent gone"])
def test_a_tokenizer_process_has_the_kernel_kill_it_with_its_parent_and_exits_if_it_is_gone_already(
    alive: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What each tokenizer process asks first (a SIGKILLed run left them waiting for work forever), here in this
    process with a stand-in parent (mutmut traces no other): PR_GET_PDEATHSIG reads what the kernel was told."""
    libc = ctypes.CDLL(None)

    def death_signal() -> int:
        got = ctypes.c_int(-1)
        assert libc.prctl(2, ctypes.byref(got)) == 0  # PR_GET_PDEATHSIG
        return got.value

    before, exits = death_signal(), []
    monkeypatch.setattr(corpus.os, "_exit", exits.append)
    monkeypatch.setattr(corpus.multiprocessing, "parent_process", lambda: None)
    corpus._exit_with_parent()  # the main process: nothing to ask
    assert (death_signal(), exits) == (before, [])
    monkeypatch.setattr(corpus.multiprocessing, "parent_process", lambda: _Parent(alive))
    try:
        corpus._exit_with_parent()
        told = death_signal()
    finally:
        libc.prctl(corpus._PR_SET_PDEATHSIG, before)  # NOTE: this test process's own: as it was
    assert told == signal.SIGKILL and exits == ([] if alive else [1])


def test_a_chunk_cut_short_by_a_broken_file_starts_where_its_records_do(tmp_path: Path) -> None:
    """The chunk that carries a file's break carries its position too, as every other chunk does: a shard ending in
    it records where --resume reads on from."""
    lines = [b'{"text": "doc %d"}\n' % i for i in range(2000)]
    whole = gzip.compress(b"".join(lines))
    broken = tmp_path / "broken.jsonl.gz"
    broken.write_bytes(whole[: len(whole) // 2])
    *whole_chunks, cut = corpus.iter_file_chunks(broken, "text", 300, corpus.InputPosition(3))
    before = 300 * len(whole_chunks)
    assert cut.errors and 0 < len(cut.records) < 300
    assert cut.position == corpus.InputPosition(3, len(b"".join(lines[:before])), before)
    junk = tmp_path / "junk.jsonl.gz"
    junk.write_bytes(b"not gzip at all")
    (chunk,) = corpus.iter_file_chunks(junk, "text", 10, corpus.InputPosition(1))
    assert chunk.errors and chunk.position == corpus.InputPosition(1)


def test_chunks_are_tokenized_into_the_dtype_asked_for(tokenizer: LoadedTokenizer, tmp_path: Path) -> None:
    """A vocabulary that fits uint16 is written as uint16 unless uint32 is asked for."""
    for dtype, want in ((None, np.uint16), ("uint32", np.uint32)):
        chunks = [corpus.TextChunk("s", [(1, "some words")], json_lines=False)]
        prefix = tmp_path / str(dtype) / "part"
        summary = corpus.tokenize_chunks(chunks, tokenizer=tokenizer, output_prefix=prefix, dtype=dtype, progress=False)
        assert _all_tokens(summary.shards).dtype == want


def test_each_sidecar_names_the_input_chunk_and_token_its_shard_ends_before(
    tokenizer: LoadedTokenizer, tmp_path: Path
) -> None:
    """input_end counts the chunks written, one by one: a shard of three tokens over chunks of two."""
    writer = corpus.ShardWriter(
        tmp_path / "part", dtype=np.dtype(np.uint32), max_shard_bytes=12, tokenizer=tokenizer, input_settings={"x": 1}
    )
    positions = [corpus.InputPosition(0, 10 * n, 2 * n) for n in range(4)]
    for n, position in enumerate(positions):
        writer.write(corpus.EncodedChunk("s", np.array([n + 5, 0], dtype=np.uint32), np.array([2]), [], position))
    infos = [read_shard_info(path) for path in writer.close()]
    assert [info.input_end for info in infos] == [(1, 1), (2, 2), (3, 2)]
    assert [info.input_position for info in infos] == [asdict(position) for position in positions[1:]]


def _tokenize_past_a_size_limit(argv: list[str]) -> None:
    """Child of the test below: tokenize_data.py whose files cannot grow past 256 bytes (a shard here has 400)."""
    cap_file_size(256)
    sys.exit(corpus.tokenize_main(argv))


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_shard_that_finds_no_room_fails_in_one_line_and_a_resume_with_room_completes_the_run(
    tokenizer: LoadedTokenizer, tmp_path: Path
) -> None:
    """A full disk (here a file-size limit, EFBIG) is named with --output_prefix, the shard, what is kept and the fix,
    no partial shard is left, and --resume once there is room writes what an uninterrupted run writes. Shards used to
    be written through a memmap, which a really full disk answers with SIGBUS: the process died without a word."""
    _two_files(tmp_path)
    args = ["--file_glob", str(tmp_path / "*.jsonl*"), "--tokenizer_name_or_path", str(tokenizer.path.parent)]
    args += ["--batch_size", "3", "--max_shard_bytes", "400", "--output_prefix"]
    assert corpus.tokenize_main([*args, str(tmp_path / "whole" / "part")]) == 0
    prefix = tmp_path / "out" / "part"
    proc, _ = run_child(
        f"import test_tokenize_data; test_tokenize_data._tokenize_past_a_size_limit({[*args, str(prefix)]!r})"
    )
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.splitlines()[-1] == (
        f"error: --output_prefix {prefix}: cannot write part_00000.npy: file too large; no shard is complete; free "
        "space there, then rerun the same command with --resume to continue"
    )
    assert list(prefix.parent.iterdir()) == []
    assert corpus.tokenize_main([*args, str(prefix), "--resume"]) == 0
    assert _outputs(prefix.parent) == _outputs(tmp_path / "whole")
    for shard in prefix.parent.glob("*.npy"):  # written, not memmapped: still the bytes np.save writes
        saved = io.BytesIO()
        np.save(saved, np.load(shard))
        assert shard.read_bytes() == saved.getvalue()
