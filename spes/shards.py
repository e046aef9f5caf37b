"""Token shards on disk: flat 1-D token arrays named `.npy`, with or without a JSON sidecar `<shard>.npy.json`.

Two formats are read:
- spes's own (`data_process_scripts/tokenize_data.py`): a real `.npy` (numpy header) written as
  `<shard>.npy.partial` and renamed once complete and once its sidecar is written, which records the tokenizer
  fingerprint, vocabulary and dtype so data and tokenizer cannot be mixed up. A half-written shard
  keeps its `.partial` name and is never matched as a shard.
- OLMo's / Dolma's (and the first SPES implementation's `tokenize_data.py`): a headerless flat memmap
  named `.npy`, read with `data.memmap_dtype` (uint16 when unset, OLMo's default). Nothing about its
  tokenizer can be checked.
A sidecar, when present, is always checked. A shard is a local `Path`, or the `str` of an http(s) URL read by
byte ranges (`data.url_reads: range`: `RangeTokenArray`). This module is the format and the path resolution of
`data.paths`; it imports no torch, so tokenization workers start light (the dataset lives in `spes.data`).
"""

from __future__ import annotations

import glob
import io
import json
import math
import os
import threading
import tokenize
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, fields
from pathlib import Path, PurePosixPath

import numpy as np

from spes.atomic import write_atomic
from spes.remote_files import fetched, is_url
from spes.remote_ranges import RemoteFile, checked_url, fetch_optional

SIDECAR_SUFFIX = ".json"
PARTIAL_SUFFIX = ".partial"
NPY_MAGIC = b"\x93NUMPY"
DEFAULT_MEMMAP_DTYPE = "uint16"
"""What OLMo reads a headerless token file as when `data.memmap_dtype` is unset."""
MEMMAP_DTYPES = ("uint8", "uint16", "uint32", "uint64", "int32", "int64")
SHARD_FORMAT_VERSION = 1
_GLOB_CHARS = frozenset("*?[")
_NPY_HEAD = 4096
"""Bytes read first from a shard at a URL: its `.npy` header, if it has one (numpy writes them of 128 bytes)."""

_NPY_HEADER_LOCK = threading.Lock()
"""numpy reads a `.npy` header with `ast.literal_eval`, and CPython 3.11's AST constructor fails when two threads
run it at once ("AST constructor recursion depth mismatch", python/cpython#106905): shards open on a thread pool."""

Shard = Path | str
"""A token shard: a local file, or the URL of one read by byte ranges."""


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
    input_end: tuple[int, int] | None = None
    """(chunk, token): the shard ends before token `token` of input chunk `chunk` (chunks of --batch_size records,
    counted from 0 over all input files), where `tokenize_data.py --resume` continues; None when not from files."""
    input_position: dict[str, int] | None = None
    """Where chunk `input_end[0]` starts (`spes.corpus.InputPosition`: the index of its input file, the byte of that
    file's text and the lines or rows before it): --resume reads on from there, not from the start."""
    input_settings: dict[str, str | int] | None = None
    """What decides the token stream besides the tokenizer and dtype (the input files' digest, --text_field,
    --batch_size, --max_shard_bytes): --resume continues only a run of the same settings."""


_SHARD_INFO_KEYS = frozenset(f.name for f in fields(ShardInfo))
"""The keys a sidecar is read by: others (a later spes's optional fields) are passed over."""


def sidecar_path(shard: str | os.PathLike[str]) -> Path:
    """`<shard>.npy.json`: the sidecar that marks `shard` as complete."""
    shard = Path(shard)
    return shard.with_name(shard.name + SIDECAR_SUFFIX)


def write_shard_info(shard: Path, info: ShardInfo) -> None:
    """Write the sidecar of a finished shard atomically (temp file in the same dir + rename); fields that are None
    are left out (a sidecar not written from files reads as before they existed)."""
    recorded = {key: value for key, value in asdict(info).items() if value is not None}
    write_atomic(sidecar_path(shard), json.dumps(recorded, indent=2) + "\n")


def read_shard_info(shard: Shard) -> ShardInfo:
    """The sidecar of `shard`; ValueError naming the file when it is missing or malformed."""
    info = find_shard_info(shard)
    if info is None:
        raise ValueError(
            f"token shard {shard} has no sidecar {sidecar_path(shard).name}, so its tokenizer is unknown; "
            f"tokenize the text with data_process_scripts/tokenize_data.py to get one"
        )
    return info


def find_shard_info(shard: Shard) -> ShardInfo | None:
    """The sidecar of `shard`, or None when it has none (an OLMo-format file); ValueError when malformed."""
    if isinstance(shard, str) and is_url(shard):
        url = shard + SIDECAR_SUFFIX
        path: Shard = url
        text = fetch_optional(url)
    else:
        path = sidecar_path(shard)
        text = path.read_bytes() if path.is_file() else None
    if text is None:
        return None
    try:
        raw = json.loads(text.decode("utf-8"))
        raw["source_files"] = tuple(raw["source_files"])
        if raw.get("input_end") is not None:
            chunk, token = raw["input_end"]  # NOTE: ValueError or TypeError unless a pair
            raw["input_end"] = (chunk, token)
        info = _typed(ShardInfo(**{key: value for key, value in raw.items() if key in _SHARD_INFO_KEYS}))
    # NOTE: ValueError: JSONDecodeError and UnicodeDecodeError too; RecursionError: JSON nested too deep
    except (ValueError, KeyError, TypeError, RecursionError) as err:
        raise ValueError(f"sidecar {path} is malformed ({err}); rerun tokenize_data.py for this shard") from err
    if info.format_version != SHARD_FORMAT_VERSION:
        raise ValueError(
            f"sidecar {path} has format_version {info.format_version}; this spes reads version {SHARD_FORMAT_VERSION}"
        )
    return info


_COUNTS = ("vocab_size", "eos_token_id", "num_tokens", "num_documents", "format_version")


def _typed(info: ShardInfo) -> ShardInfo:
    """`info` when each field holds what its type says (JSON may hold any value anywhere), else TypeError naming it:
    a sidecar's dtype or count reaches numpy, whose own errors name neither the field nor the file."""
    for key in ("tokenizer_fingerprint", "dtype"):
        if not isinstance(getattr(info, key), str):
            raise TypeError(f"{key} {getattr(info, key)!r} is not a string")
    counts = {key: getattr(info, key) for key in _COUNTS}
    counts.update({f"input_end[{i}]": value for i, value in enumerate(info.input_end or ())})
    if not isinstance(info.input_position, (dict, type(None))):
        raise TypeError(f"input_position {info.input_position!r} is not a mapping")
    counts.update({f"input_position[{k!r}]": value for k, value in (info.input_position or {}).items()})
    for key, value in counts.items():
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise TypeError(f"{key} {value!r} is not a count")
    if info.dtype not in MEMMAP_DTYPES:
        raise TypeError(f"dtype {info.dtype!r} is not a token dtype ({', '.join(MEMMAP_DTYPES)})")
    if not all(isinstance(name, str) for name in info.source_files):
        raise TypeError(f"source_files {list(info.source_files)!r} are not file names")
    if not isinstance(info.input_settings, (dict, type(None))):
        raise TypeError(f"input_settings {info.input_settings!r} is not a mapping")
    return info


def open_token_array(shard: Shard, memmap_dtype: str | None = None) -> np.ndarray | RangeTokenArray:
    """A read-only 1-D view of a shard's tokens: a real `.npy` as stored, a headerless file as a flat array of
    `memmap_dtype` (uint16 when None); a memory map of a local file, a `RangeTokenArray` of a URL."""
    if isinstance(shard, str) and is_url(shard):
        return RangeTokenArray.open(shard, memmap_dtype)
    head = _file_head(shard, _NPY_HEAD)
    if head.startswith(NPY_MAGIC):
        _npy_layout(shard, head, os.path.getsize(shard), lambda n: _file_head(shard, n))
        with _NPY_HEADER_LOCK:
            return np.load(shard, mmap_mode="r", allow_pickle=False)
    dtype = _headerless_dtype(shard, memmap_dtype, os.path.getsize(shard), head)
    if not head:  # numpy maps no empty file
        return np.zeros(0, dtype=dtype)
    return np.memmap(shard, dtype=dtype, mode="r")


def _file_head(path: str | os.PathLike[str], size: int) -> bytes:
    """The first `size` bytes of a local file (fewer when it is shorter)."""
    with open(path, "rb") as f:
        return f.read(size)


def _headerless_dtype(shard: Shard, memmap_dtype: str | None, size: int, head: bytes) -> np.dtype:
    """The dtype a headerless token file of `size` bytes starting with `head` is read as; ValueError unless it
    divides the file, or when uint16 (the default, or named: configs/tiny.yaml names it) would read uint32 ids
    (`_looks_uint32`), or uint32 would read uint16 ones (`_looks_uint16`)."""
    dtype = np.dtype(memmap_dtype or DEFAULT_MEMMAP_DTYPE)
    if dtype.name not in MEMMAP_DTYPES:
        raise ValueError(f"data.memmap_dtype={memmap_dtype!r} is not a token dtype; use one of {list(MEMMAP_DTYPES)}")
    if size % dtype.itemsize:
        raise ValueError(
            f"headerless token file {shard} has {size} bytes, not a multiple of {dtype.itemsize} "
            f"(data.memmap_dtype={dtype.name}); set data.memmap_dtype to the dtype it was written with"
        )
    if dtype == np.uint16 and _looks_uint32(head):
        named = " unset" if memmap_dtype is None else f"={memmap_dtype}"
        raise ValueError(
            f"headerless token file {shard} holds uint32 token ids by the look of its first {len(head):,} bytes "
            f"(every second 16-bit half is below {_UINT32_HIGH_HALF}) but is read as uint16 (data.memmap_dtype"
            f"{named}); set data.memmap_dtype=uint32"
        )
    if dtype == np.uint32 and _looks_uint16(head):
        raise ValueError(
            f"headerless token file {shard} holds uint16 token ids by the look of its first {len(head):,} bytes "
            f"(read as uint32, most of its ids pass {NO_VOCABULARY:,}) but data.memmap_dtype is uint32; set "
            f"data.memmap_dtype=uint16"
        )
    return dtype


_UINT32_HIGH_HALF = 4
"""uint32 token ids below 4 * 65,536 (any tokenizer's: Qwen's 151,665) have a high 16-bit half below this."""
NO_VOCABULARY = 2**24
"""A token id no tokenizer reaches: a uint16 file read as uint32 pairs its ids into values past it."""


def _looks_uint16(head: bytes) -> bool:
    """Whether `head`, read as little-endian uint32 ids, is two uint16 ids at a time (OLMo's default files, read with
    data.memmap_dtype=uint32): most of its values, over at least 32, pass NO_VOCABULARY (their high half, an id,
    is 256 or more)."""
    ids = np.frombuffer(head[: len(head) // 4 * 4], dtype="<u4")
    return len(ids) >= 32 and int((ids >= NO_VOCABULARY).sum()) * 2 > len(ids)


def _looks_uint32(head: bytes) -> bool:
    """Whether `head` holds little-endian uint32 token ids (OLMo's and the first implementation's uint32 files): every
    odd 16-bit half below `_UINT32_HIGH_HALF`, some even one not, over at least 32 ids (as uint16 such a file reads
    an id's low half, its high half 0..3, ...). Qwen's ids from 65,536 up (most CJK text) have a high half of 1 or 2:
    a test for 0 alone read them as uint16."""
    halves = np.frombuffer(head[: len(head) // 4 * 4], dtype="<u2")
    return len(halves) >= 64 and int(halves[1::2].max()) < _UINT32_HIGH_HALF <= int(halves[0::2].max())


class RangeTokenArray:
    """The tokens of a shard at a URL, as far as the dataset reads them: `dtype`, `shape`, `ndim`, `len` at hand,
    and `array[a:b]` read by one HTTP range request (`spes.remote_ranges`). Pickles without a connection."""

    def __init__(self, file: RemoteFile, dtype: np.dtype, shape: tuple[int, ...], offset: int) -> None:
        self.file, self.dtype, self.shape, self.offset = file, dtype, shape, offset
        self.ndim = len(shape)

    @classmethod
    def open(cls, url: str, memmap_dtype: str | None) -> RangeTokenArray:
        """The shard at `url`: its `.npy` header read (safely: no pickle) if it has one, else a headerless file."""
        file, head = RemoteFile.open(url, _NPY_HEAD)
        if not head.startswith(NPY_MAGIC):
            dtype = _headerless_dtype(url, memmap_dtype, file.size, head)
            return cls(file, dtype, (file.size // dtype.itemsize,), 0)
        dtype, shape, offset = _npy_layout(url, head, file.size, lambda n: file.read(0, n))
        return cls(file, dtype, shape, offset)

    def __len__(self) -> int:
        return self.shape[0]

    def __getitem__(self, key: slice) -> np.ndarray:
        start, stop, step = key.indices(len(self))
        if step != 1:
            raise IndexError("a token shard at a URL is read by contiguous slices")
        if stop <= start:
            return np.zeros(0, dtype=self.dtype)
        size = self.dtype.itemsize
        return np.frombuffer(self.file.read(self.offset + start * size, (stop - start) * size), dtype=self.dtype)


def _npy_layout(
    shard: Shard, head: bytes, size: int, read_head: Callable[[int], bytes]
) -> tuple[np.dtype, tuple[int, ...], int]:
    """Dtype, shape and data offset of the `.npy` shard of `size` bytes that starts with `head` (`read_head(n)`: its
    first n bytes); ValueError naming it when it is cut short (a copy or download that stopped early): numpy's own
    error names neither the file nor the fix."""
    needed = _npy_header_bytes(head, shard)
    if needed > size:
        raise ValueError(_cut_short(shard, f"its .npy header of {needed:,} bytes in {size:,}"))
    if len(head) < needed:
        head = read_head(needed)
    stream = io.BytesIO(head)
    read_header = {(1, 0): np.lib.format.read_array_header_1_0, (2, 0): np.lib.format.read_array_header_2_0}
    try:
        with _NPY_HEADER_LOCK:
            shape, _, dtype = read_header[np.lib.format.read_magic(stream)](stream)
    except (ValueError, tokenize.TokenError) as err:  # NOTE: numpy lets the tokenizer's error of a damaged header out
        raise ValueError(_cut_short(shard, f"an unreadable .npy header: {err}")) from None
    if dtype.hasobject or needed + math.prod(shape) * dtype.itemsize > size:  # NOTE: np.prod wraps past 2^63
        raise ValueError(_cut_short(shard, f"{dtype} {shape} in {size:,} bytes"))
    return dtype, tuple(shape), needed


def _npy_header_bytes(head: bytes, shard: Shard) -> int:
    """Magic, version, header length field and header of a `.npy` file: where its data starts."""
    prefix = {b"\x01\x00": 10, b"\x02\x00": 12}.get(head[6:8])
    if prefix is None:
        raise ValueError(f"token shard {shard} has a .npy header of a version spes does not read (1.0 and 2.0 only)")
    if len(head) < prefix:
        raise ValueError(_cut_short(shard, f"{len(head)} bytes"))
    return prefix + int.from_bytes(head[8:prefix], "little")


def _cut_short(shard: Shard, what: str) -> str:
    return f"token shard {shard} is not a whole array of token ids ({what}); rerun tokenize_data.py for it"


def check_shard_name(path: Shard) -> None:
    """ValueError unless `path` names a finished `.npy` token shard (not tokenize_data.py's half-written file)."""
    if PurePosixPath(path).name.endswith(PARTIAL_SUFFIX):
        raise ValueError(
            f"token shard {path} is half-written (tokenize_data.py was interrupted): delete it "
            f"and rerun tokenize_data.py, or leave it out of data.paths"
        )
    if PurePosixPath(path).suffix != ".npy":
        raise ValueError(f"token shard {path} is not a .npy file (tokenize_data.py writes .npy shards)")


def resolve_paths(
    paths: str | os.PathLike[str] | Sequence[str | os.PathLike[str]],
    base_dir: Path | None = None,
    *,
    ranged: bool = False,
) -> list[Shard]:
    """Expand `data.paths` entries into shard files, in order.

    An entry is a file, a glob (sorted matches, `**` allowed), a directory (its `*.npy`, sorted), an
    http(s) URL of a file (kept as the URL, read by byte ranges, when `ranged`; else downloaded once into a local
    cache: `spes.remote_files`) or a `.txt` list file with one path, glob or URL per line (relative lines are
    relative to the list file; what list_processed_files.sh writes). Relative entries are relative to `base_dir`
    (default: the working directory). Repeats are kept, so listing a shard twice upsamples it.
    """
    entries = [paths] if isinstance(paths, (str, os.PathLike)) else list(paths)
    if not entries:
        raise ValueError("data.paths is empty: give token shard files, globs, directories or .txt list files")
    resolved: list[Shard] = []
    for entry in entries:
        resolved.extend(_resolve_entry(str(entry), base_dir, ranged=ranged))
    return resolved


def glob_files(pattern: str) -> list[Path]:
    """The files the glob `pattern` matches, sorted ('**' recurses, '~' expands). Its leading folders that exist are
    taken as written: a run kept under `runs [v2]/` matched nothing, `[v2]` read as a set of characters."""
    path = Path(os.path.expanduser(pattern))
    literal = 0
    while literal < len(path.parts) - 1 and Path(*path.parts[: literal + 1]).is_dir():
        literal += 1
    if literal:
        pattern = os.path.join(glob.escape(str(Path(*path.parts[:literal]))), *path.parts[literal:])
    return sorted(Path(m) for m in glob.glob(pattern if literal else str(path), recursive=True) if os.path.isfile(m))


def _resolve_entry(entry: str, base_dir: Path | None, list_file: Path | None = None, *, ranged: bool) -> list[Shard]:
    if is_url(entry):  # NOTE: named before a byte is fetched: a download mode read a refused file whole first
        check_shard_name(checked_url(entry))
        return [entry if ranged else fetched(entry)]
    path = Path(entry).expanduser()
    if not path.is_absolute() and base_dir is not None:
        path = base_dir / path
    where = f" (listed in {list_file})" if list_file else ""
    if not where and not path.is_absolute():  # NOTE: started elsewhere, "not found" said not where it looked
        where = f" (from the working directory {Path.cwd()})"
    if _GLOB_CHARS & set(entry) and not path.exists():  # NOTE: a path that is there is as written: "run [v2]/"
        matches: list[Shard] = list(glob_files(str(path)))
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
        listed = [
            p
            for ln in lines
            if ln and not ln.startswith("#")
            for p in _resolve_entry(ln, path.parent, path, ranged=ranged)
        ]
        if not listed:
            raise ValueError(f"data list file {path} names no shards")
        return listed
    return [path]
