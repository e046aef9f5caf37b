"""Tests of spes.shards: the sidecar format and how `data.paths` entries resolve to shard files."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from data_fixtures import write_token_shard
from fuzz_helpers import memory_cap
from spes.shards import (
    SHARD_FORMAT_VERSION,
    RangeTokenArray,
    find_shard_info,
    glob_files,
    open_token_array,
    read_shard_info,
    resolve_paths,
    sidecar_path,
    write_shard_info,
)

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture
def shards(tmp_path: Path) -> list[Path]:
    return [write_token_shard(tmp_path / f"part_{i:05d}.npy", np.arange(10, dtype=np.uint16)) for i in range(3)]


def test_a_sidecar_is_read_back_as_written_and_its_absence_is_none_or_named(shards: list[Path], tmp_path: Path) -> None:
    info = read_shard_info(shards[0])
    assert (info.dtype, info.num_tokens, info.source_files, info.format_version) == (
        "uint16",
        10,
        ("synthetic",),
        SHARD_FORMAT_VERSION,
    )
    assert sidecar_path(shards[0]).read_text().startswith('{\n  "tokenizer_fingerprint": ')  # a person reads it too
    bare = write_token_shard(tmp_path / "bare.npy", np.arange(4, dtype=np.uint16), with_sidecar=False)
    assert find_shard_info(bare) is None and sidecar_path(bare).name == "bare.npy.json"
    with pytest.raises(ValueError, match=f"token shard {bare} has no sidecar bare.npy.json.*tokenize_data.py"):
        read_shard_info(bare)


@pytest.mark.parametrize(
    "sidecar",
    [b"{not json", b"[1, 2]", b'{"dtype": "uint16"}', b'{"source_files": [], "nonsense": 1}', b"\xff\xfe\x00"],
    ids=["not JSON", "a list", "keys missing", "keys missing beside an unknown one", "not UTF-8"],
)
def test_a_malformed_sidecar_is_refused_naming_it(shards: list[Path], sidecar: bytes) -> None:
    sidecar_path(shards[0]).write_bytes(sidecar)
    with pytest.raises(ValueError, match=f"^sidecar {sidecar_path(shards[0])} is malformed .*; rerun tokenize_data"):
        find_shard_info(shards[0])


@pytest.mark.parametrize("end", [[3], [1, 2, 3], 7], ids=["one number", "three numbers", "a number"])
def test_an_input_end_that_is_not_a_pair_is_malformed(shards: list[Path], end: object) -> None:
    path = sidecar_path(shards[0])
    path.write_text(json.dumps({**json.loads(path.read_text()), "input_end": end}))
    with pytest.raises(ValueError, match=f"^sidecar {path} is malformed .*; rerun tokenize_data"):
        find_shard_info(shards[0])


def test_the_input_position_reads_back_and_unknown_keys_are_passed_over(shards: list[Path]) -> None:
    """tokenize_data.py's sidecars record where each shard ends in the input (for --resume); a reader refused any key
    it did not know as malformed, so a sidecar with a field added later failed to train."""
    path = sidecar_path(shards[0])
    assert "input_end" not in path.read_text()  # None fields are left out: such sidecars read as before
    settings = {"input_files": "ab12", "batch_size": 3, "text_field": "text", "max_shard_bytes": 20}
    recorded = {**json.loads(path.read_text()), "input_end": [4, 17], "input_settings": settings, "later": {"x": 1}}
    path.write_text(json.dumps(recorded))
    info = read_shard_info(shards[0])
    assert (info.input_end, info.input_settings, info.num_tokens) == ((4, 17), settings, 10)
    write_shard_info(shards[1], info)
    assert read_shard_info(shards[1]) == info


def test_a_sidecar_of_another_format_version_is_refused(shards: list[Path]) -> None:
    path = sidecar_path(shards[0])
    path.write_text(path.read_text().replace(f'"format_version": {SHARD_FORMAT_VERSION}', '"format_version": 7'))
    with pytest.raises(ValueError, match=f"has format_version 7; this spes reads version {SHARD_FORMAT_VERSION}$"):
        find_shard_info(shards[0])


def test_a_headerless_file_is_read_as_memmap_dtype_and_refused_when_it_cannot_be(tmp_path: Path) -> None:
    real = open_token_array(write_token_shard(tmp_path / "real.npy", np.arange(5, dtype=np.uint32)))
    assert isinstance(real, np.memmap) and not real.flags.writeable and real.dtype == np.uint32  # mapped, not read
    flat = tmp_path / "flat.npy"
    np.arange(6, dtype=np.uint32).tofile(flat)
    tokens = open_token_array(flat, "uint32")
    assert tokens.dtype == np.uint32 and tokens.tolist() == list(range(6)) and not tokens.flags.writeable
    assert open_token_array(flat).dtype == np.uint16 and len(open_token_array(flat)) == 12  # OLMo's default
    with pytest.raises(ValueError, match=r"data.memmap_dtype='float32' is not a token dtype; use one of \['uint8'"):
        open_token_array(flat, "float32")
    np.arange(3, dtype=np.uint8).tofile(flat)
    with pytest.raises(ValueError, match=f"{flat} has 3 bytes, not a multiple of 2 \\(data.memmap_dtype=uint16\\)"):
        open_token_array(flat)
    flat.write_bytes(b"")
    assert open_token_array(flat, "uint32").shape == (0,) and open_token_array(flat, "uint32").dtype == np.uint32


def test_uint32_ids_read_as_the_default_uint16_are_refused(tmp_path: Path) -> None:
    """OLMo writes uint32 files for its larger vocabularies; read as uint16, every second token would be a 0."""
    flat = tmp_path / "flat.npy"
    (np.arange(32, dtype=np.uint32) + 60000).tofile(flat)
    with pytest.raises(ValueError) as err:
        open_token_array(flat)
    assert str(err.value) == (
        f"headerless token file {flat} holds uint32 token ids by the look of its first 128 bytes (every second "
        "16-bit half is below 4) but is read as uint16 (data.memmap_dtype unset); set data.memmap_dtype=uint32"
    )
    assert open_token_array(flat, "uint32").tolist() == list(range(60000, 60032))
    (np.arange(31, dtype=np.uint32) + 1).tofile(flat)  # too few ids to tell
    assert len(open_token_array(flat)) == 62
    np.zeros(32, dtype=np.uint32).tofile(flat)  # nothing but zeros: nothing to tell by
    assert len(open_token_array(flat)) == 64
    tokens = np.arange(64, dtype=np.uint16) + 1
    tokens[-1] = 0  # uint16 ids whose odd halves are not all 0
    tokens.tofile(flat)
    assert open_token_array(flat).tolist() == tokens.tolist()
    lone = np.zeros(32, dtype=np.uint32)
    lone[1] = 7  # one id in the first 32 not 0: still uint32's every second half 0
    lone.tofile(flat)
    with pytest.raises(ValueError, match="holds uint32 token ids by the look of its first 128 bytes"):
        open_token_array(flat)
    np.append(np.zeros(64, dtype=np.uint16), np.uint16(5)).tofile(flat)  # 32 zero ids and half of one more
    assert len(open_token_array(flat)) == 65  # the odd half is no uint32 of its own: nothing to tell by
    wide = np.concatenate([np.arange(1024, dtype=np.uint32) + 1, np.full(1024, 2**17 + 1, dtype=np.uint32)])
    wide.tofile(flat)  # judged by its first 4 KiB: what follows is not read for it
    with pytest.raises(ValueError, match="holds uint32 token ids by the look of its first 4,096 bytes"):
        open_token_array(flat)


def test_uint32_ids_above_65535_or_read_as_a_named_uint16_are_refused_too(tmp_path: Path) -> None:
    """Qwen's ids from 65,536 up (a high half of 1 or 2: most CJK text) passed the test for 0, and a named uint16
    (configs/tiny.yaml names it; a user's copy pointed at the first implementation's files) skipped it: both read
    the first implementation's uint32 files as twice as many garbage tokens, all within the vocabulary."""
    flat = tmp_path / "flat.npy"
    (np.arange(64, dtype=np.uint32) * 2300 + 5000).tofile(flat)  # 5,000 .. 149,900: the high halves 0, 1, 2
    for named in (None, "uint16"):
        with pytest.raises(ValueError) as err:
            open_token_array(flat, named)
        assert str(err.value) == (
            f"headerless token file {flat} holds uint32 token ids by the look of its first 256 bytes (every second "
            f"16-bit half is below 4) but is read as uint16 (data.memmap_dtype{'=uint16' if named else ' unset'}); "
            "set data.memmap_dtype=uint32"
        )
    assert open_token_array(flat, "uint32").tolist() == list(range(5000, 5000 + 64 * 2300, 2300))
    np.tile(np.arange(4, dtype=np.uint16), 32).tofile(flat)  # uint16 ids of a 4-token vocabulary: no uint32 look
    assert len(open_token_array(flat, "uint16")) == 128


def test_uint16_ids_read_as_uint32_are_refused_at_open(tmp_path: Path) -> None:
    """OLMo's default files are uint16; told uint32, each pair of ids read as one would fail only mid-run, blamed on
    another tokenizer."""
    flat = tmp_path / "flat.npy"
    tokens = np.arange(64, dtype=np.uint16) + 300
    tokens.tofile(flat)
    with pytest.raises(ValueError) as err:
        open_token_array(flat, "uint32")
    assert str(err.value) == (
        f"headerless token file {flat} holds uint16 token ids by the look of its first 128 bytes (read as uint32, "
        "most of its ids pass 16,777,216) but data.memmap_dtype is uint32; set data.memmap_dtype=uint16"
    )
    assert open_token_array(flat).tolist() == tokens.tolist()
    (np.arange(64, dtype=np.uint32) + 200_000).tofile(flat)  # uint32 ids of a large vocabulary: taken
    assert open_token_array(flat, "uint32").tolist() == list(range(200_000, 200_064))
    (np.arange(64, dtype=np.uint16) % 200).tofile(flat)  # ids below 256 pair into small values: nothing to tell by
    assert len(open_token_array(flat, "uint32")) == 32


def test_the_dtype_checks_draw_their_lines_where_their_docstrings_say(tmp_path: Path) -> None:
    """Read as uint32, a file is uint16 ids when more than half of its values reach NO_VOCABULARY (2**24); read as
    uint16, it is uint32 ids when every high half is below 4 and some low half reaches 4."""
    flat = tmp_path / "flat.npy"
    small = [5] * 15
    np.array([2**24] * 17 + small, dtype=np.uint32).tofile(flat)  # 17 of 32 reach it: more than half
    with pytest.raises(ValueError, match="holds uint16 token ids"):
        open_token_array(flat, "uint32")
    np.array([2**24] * 16 + small + [5], dtype=np.uint32).tofile(flat)  # half exactly: taken as uint32
    assert len(open_token_array(flat, "uint32")) == 32
    np.tile(np.arange(5, dtype=np.uint32), 7)[:32].tofile(flat)  # ids 0..4: high halves 0, a low half of 4
    with pytest.raises(ValueError, match="holds uint32 token ids"):
        open_token_array(flat)
    (np.arange(32, dtype=np.uint32) + 4 * 65536).tofile(flat)  # every high half 4: no longer below it
    assert len(open_token_array(flat)) == 64


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


@pytest.mark.parametrize(
    ("entry", "kind", "why"),
    [
        ("nothing_*.npy", "data path pattern", "matches no file"),
        ("missing.npy", "data path", "does not exist"),
        ("empty_dir", "data directory", "holds no .npy token shards"),
    ],
)
def test_resolve_paths_names_the_entry_that_matches_nothing(entry: str, kind: str, why: str, tmp_path: Path) -> None:
    (tmp_path / "empty_dir").mkdir()
    with pytest.raises(FileNotFoundError, match=f"^{re.escape(f'{kind} {entry!r} {why}')}$"):
        resolve_paths([entry], base_dir=tmp_path)
    listing = tmp_path / "files.txt"  # the same entry in a list file: named with the list
    listing.write_text(f"{entry}\n")
    with pytest.raises(FileNotFoundError, match=f"^{re.escape(f'{kind} {entry!r} (listed in {listing}) {why}')}$"):
        resolve_paths([listing])


def test_a_path_with_glob_characters_that_is_there_is_taken_as_written(tmp_path: Path) -> None:
    """A folder "run [v2]" (a glob's character class) matched nothing in any form, the list file
    list_processed_files.sh writes there included."""
    run = tmp_path / "my run [v2] ü"
    run.mkdir()
    shard = write_token_shard(run / "part.npy", np.arange(4, dtype=np.uint16))
    (run / "files.txt").write_text(f"{shard}\n")
    for entry in (shard, run, run / "files.txt", run / "*.npy"):  # NOTE: the pattern's folder is taken as written too
        assert resolve_paths([str(entry)]) == [shard], entry
    assert glob_files(f"{tmp_path}/my*/*.npy") == [shard]


def test_a_relative_path_not_found_says_from_which_working_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Started in another folder, configs/tiny.yaml's data/default/train/*.npy "matches no file", not saying where."""
    elsewhere = tmp_path / "else where ü"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    for entry, kind, why in (
        ("data/*.npy", "data path pattern", "matches no file"),
        ("a.npy", "data path", "does not exist"),
    ):
        with pytest.raises(FileNotFoundError) as err:
            resolve_paths([entry])
        assert str(err.value) == f"{kind} {entry!r} (from the working directory {elsewhere}) {why}"


def test_a_glob_reaches_into_subdirectories_with_two_stars(tmp_path: Path) -> None:
    for d in ("a", "b/c"):
        (tmp_path / d).mkdir(parents=True)
    nested = [write_token_shard(tmp_path / d / "part.npy", np.arange(4, dtype=np.uint16)) for d in ("a", "b/c")]
    (tmp_path / "b" / "dir.npy").mkdir()  # a directory the pattern matches is no shard
    assert resolve_paths(str(tmp_path / "**" / "*.npy")) == nested


def test_resolve_paths_refuses_an_empty_list_and_a_list_file_naming_nothing(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="^data.paths is empty: give token shard files, globs, directories or .txt"):
        resolve_paths([])
    listing = tmp_path / "files.txt"
    listing.write_text("# nothing yet\n\n")
    with pytest.raises(ValueError, match=f"^data list file {re.escape(str(listing))} names no shards$"):
        resolve_paths(str(listing))


def test_a_list_file_inside_a_list_file_is_taken_as_a_path_not_expanded(shards: list[Path], tmp_path: Path) -> None:
    inner = tmp_path / "inner.txt"
    inner.write_text(f"{shards[0]}\n")
    outer = tmp_path / "outer.txt"
    outer.write_text("inner.txt\n")
    assert resolve_paths(str(outer)) == [inner]  # the dataset then refuses it as no .npy shard


def test_tokenization_imports_no_torch() -> None:
    """Each tokenize_data worker process would otherwise pay torch's import time and ~300 MB of memory."""
    code = "import sys, spes.corpus, spes.default_corpus; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.strip() == "False", out.stderr


def test_a_relative_entry_is_relative_to_the_working_directory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    shard = write_token_shard(tmp_path / "rel.npy", np.arange(4, dtype=np.uint16))
    monkeypatch.chdir(tmp_path)
    assert resolve_paths(["rel.npy"]) == [Path("rel.npy")] and Path("rel.npy").resolve() == shard
    assert resolve_paths([str(shard)], base_dir=tmp_path / "elsewhere") == [shard]  # an absolute entry as it is


@pytest.mark.parametrize("keep", [0.5, 60 / 148], ids=["data", "header"])
def test_a_local_npy_cut_short_is_refused_naming_it(keep: float, tmp_path: Path) -> None:
    """A copy or download that stopped early: numpy's own error ("mmap length is greater than file size") named
    neither the file nor the fix."""
    shard = write_token_shard(tmp_path / "part_00000.npy", np.arange(10, dtype=np.uint16), with_sidecar=False)
    whole = shard.read_bytes()
    shard.write_bytes(whole[: int(len(whole) * keep)])
    with pytest.raises(
        ValueError,
        match=rf"token shard {re.escape(str(shard))} is not a whole array of token ids .*"
        r"rerun tokenize_data.py for it",
    ):
        open_token_array(shard)


def test_a_local_npy_of_an_unreadable_header_is_refused_naming_it(tmp_path: Path) -> None:
    """Its magic and length intact, its header dict garbled: the line names the file, what is wrong and the fix."""
    shard = write_token_shard(tmp_path / "part_00000.npy", np.arange(10, dtype=np.uint16), with_sidecar=False)
    whole = bytearray(shard.read_bytes())
    whole[10:20] = b"#" * 10  # inside the header's dict
    shard.write_bytes(bytes(whole))
    with pytest.raises(ValueError) as refused:
        open_token_array(shard)
    assert str(refused.value).startswith(
        f"token shard {shard} is not a whole array of token ids (an unreadable .npy header: "
    ) and str(refused.value).endswith("); rerun tokenize_data.py for it")


def test_a_local_npy_whose_header_is_longer_than_the_first_read_is_read_whole(tmp_path: Path) -> None:
    """A version 2.0 header past the first 4 KiB read is read again in full before the array is checked, and only
    the header: a shard of 8 GiB (sparse, past its array) opens within an address space of 2 GiB more."""
    shard = tmp_path / "long.npy"
    tokens = np.arange(6, dtype=np.uint16)
    header = (repr({"descr": "<u2", "fortran_order": False, "shape": (6,)}) + " " * 5000 + "\n").encode("latin1")
    shard.write_bytes(b"\x93NUMPY\x02\x00" + len(header).to_bytes(4, "little") + header + tokens.tobytes())
    assert np.array_equal(np.asarray(open_token_array(shard)), tokens)
    shard.write_bytes(shard.read_bytes()[:-2])  # the last token cut off: found only with the whole header read
    with pytest.raises(ValueError, match=rf"token shard {re.escape(str(shard))} is not a whole array"):
        open_token_array(shard)
    with open(shard, "r+b") as f:
        f.truncate(8 << 30)
    with memory_cap():
        assert np.asarray(open_token_array(shard)).tolist() == [0, 1, 2, 3, 4, 0]  # the cut token's bytes zeros now


class _Served:
    """A stand-in for a RemoteFile: `read(start, size)` of `data`, each range asked for recorded."""

    def __init__(self, data: bytes) -> None:
        self.data, self.asked = data, []

    def read(self, start: int, size: int) -> bytes:
        self.asked.append((start, size))
        return self.data[start : start + size]


def test_a_shard_at_a_url_reads_each_slice_as_one_range_of_exactly_its_bytes() -> None:
    tokens = np.arange(100, dtype=np.uint32)
    file = _Served(b"h" * 16 + tokens.tobytes())
    array = RangeTokenArray(file, np.dtype(np.uint32), (100,), 16)  # type: ignore[arg-type]
    assert array[10:13].tolist() == [10, 11, 12] and file.asked == [(56, 12)]
    assert array[95:].tolist() == [95, 96, 97, 98, 99] and file.asked[-1] == (396, 20)
    assert array[7:7].tolist() == [] and len(file.asked) == 2
    with pytest.raises(IndexError, match="contiguous slices"):
        array[::2]
