"""Text corpora: reading them, tokenizing them into the flat token shards spes trains on, training a tokenizer.

The library behind data_process_scripts/ (thin scripts over `tokenize_main` and `train_tokenizer_main`),
`spes.default_corpus` and bench/bench_data.py; it imports no torch (each tokenizer process would pay for it).

    python data_process_scripts/tokenize_data.py --file_glob 'raw/*.jsonl.zst' \\
        --tokenizer_name_or_path data/default/tokenizer --output_prefix tokens/part --processes 2
    python data_process_scripts/train_tokenizer.py --input 'corpus/*.jsonl.gz' 'notes/**/*.md' \\
        --output_dir my_tokenizer --vocab_size 4096

Reads `.jsonl`, `.jsonl.gz`, `.jsonl.zst` (one JSON object per line, text in `--text_field`) and
`.parquet` (a string column `--text_field`). Every document gets EOS appended and all of them are
concatenated into shards `<output_prefix>_00000.npy`, ... (1-D numpy arrays of at most
`--max_shard_bytes` bytes; a document may continue in the next shard). Each shard appears under
its final name only once complete and described (it is written as `<shard>.partial`, which spes refuses,
then its JSON sidecar `<shard>.npy.json`, recording the tokenizer and where the shard ends in the input, then it is
renamed). Malformed lines are reported as `file:line: reason`, counted and skipped; the output is the same for any
`--processes`. `--resume` continues an interrupted run after its last complete shard, to the same shards, reading the
input from where that shard ends (the files before it unopened).

A tokenizer is trained on the same formats (one text per record; any other file is read whole as one UTF-8
text) and saved as a Hugging Face tokenizer directory that works with `spes.tokenizer.load_tokenizer`,
tokenization and `transformers.AutoTokenizer.from_pretrained`, offline; EOS is `<|endoftext|>` (id 0) and pad
is `<|padding|>` (id 1).
"""

from __future__ import annotations

import argparse
import ctypes
import gzip
import hashlib
import io
import itertools
import json
import multiprocessing
import os
import signal
import sys
import tempfile
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from concurrent.futures import Future, ProcessPoolExecutor
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow.parquet as pq
import zstandard
from tqdm import tqdm

from spes.atomic import leftover_temps, room_for
from spes.cli import ArgumentParser, DefaultsHelpFormatter
from spes.interrupt import Interruptible
from spes.schema import number_flag
from spes.shards import PARTIAL_SUFFIX, ShardInfo, glob_files, read_shard_info, sidecar_path, write_shard_info
from spes.tokenizer import LoadedTokenizer, check_bpe_vocab_size, load_tokenizer, train_byte_level_bpe

SUPPORTED_SUFFIXES = (".jsonl", ".jsonl.gz", ".jsonl.zst", ".parquet")
DEFAULT_MAX_SHARD_BYTES = 512 * 2**20
MAX_REPORTED_ERRORS = 100
Record = bytes | str | None
"""A raw JSON line (bytes) or, for parquet and in-memory documents, the text itself."""


@dataclass(frozen=True)
class InputPosition:
    """Where a chunk starts in the input files: file number `file` (from 0, in --file_glob's order), after byte
    `offset` of its text (decompressed) and `line` lines before it (rows, for parquet, where `offset` stays 0). A
    sidecar records the one of the chunk its shard ends in, so --resume reads on from there."""

    file: int = 0
    offset: int = 0
    line: int = 0


@dataclass(frozen=True)
class TextChunk:
    """A batch of documents from one source, the unit of work of the tokenizer processes."""

    source: str
    records: list[tuple[int, Record]]
    """(line or row number, record) pairs; line numbers are 1-based."""
    json_lines: bool
    """Whether records are raw JSON lines still to be parsed (else texts)."""
    errors: tuple[str, ...] = ()
    """Problems met while reading the source (e.g. a truncated compressed file)."""
    position: InputPosition | None = None
    """Where the chunk starts in the input files; None for documents not read from files."""


@dataclass
class EncodedChunk:
    """A tokenized TextChunk: documents concatenated, each followed by EOS."""

    source: str
    tokens: np.ndarray
    doc_lengths: np.ndarray
    """Token count of each document, its EOS included."""
    errors: list[str]
    """`source:line: reason` of each record that was skipped."""
    position: InputPosition | None = None
    """The TextChunk's."""


@dataclass
class TokenizeSummary:
    """What one tokenization run produced."""

    shards: list[Path] = field(default_factory=list)
    num_documents: int = 0
    num_tokens: int = 0
    num_malformed: int = 0
    malformed_examples: list[str] = field(default_factory=list)
    """The first MAX_REPORTED_ERRORS malformed-record messages."""
    seconds: float = 0.0
    resumed_shards: int = 0
    """Shards of an interrupted run that --resume kept (first in `shards`); the counts above are of the rest."""

    def progress(self) -> dict[str, str]:
        """The counts the progress bar shows, written out: tqdm shows a round number such as 1000000 as `1e+6`."""
        return {"tokens": f"{self.num_tokens:,}", "malformed": f"{self.num_malformed:,}"}


def choose_dtype(vocab_size: int, requested: str | None = None) -> np.dtype:
    """The shard dtype: `requested` if it can hold every token id, else the smallest unsigned that can."""
    if requested is None:
        return np.dtype(np.uint16) if vocab_size <= 2**16 else np.dtype(np.uint32)
    dtype = np.dtype(requested)
    if dtype.kind != "u":
        raise ValueError(f"--dtype {requested} must be an unsigned integer type (uint16 or uint32)")
    if vocab_size - 1 > np.iinfo(dtype).max:
        raise ValueError(
            f"--dtype {requested} cannot hold token ids up to {vocab_size - 1} (vocab size "
            f"{vocab_size}); use uint32 or leave --dtype unset"
        )
    return dtype


def resolve_input_files(patterns: Sequence[str]) -> list[Path]:
    """Files matching `patterns` (each sorted, duplicates dropped); errors name the empty pattern."""
    files: dict[Path, None] = {}
    for pattern in patterns:
        matches = glob_files(pattern)
        if not matches:
            raise FileNotFoundError(f"--file_glob {pattern!r} matches no file")
        for path in matches:
            if not path.name.endswith(SUPPORTED_SUFFIXES):
                raise ValueError(f"{path}: unsupported input format; expected one of {', '.join(SUPPORTED_SUFFIXES)}")
            files.setdefault(path, None)
    return list(files)


def iter_input_chunks(
    files: Sequence[Path], text_field: str, batch_size: int, start: InputPosition = InputPosition()
) -> Iterator[TextChunk]:
    """The chunks of `files` in order, from the chunk that starts at `start` on: the files before it are not opened
    and its own is read from there (what lets --resume skip the input its shards hold)."""
    for number in range(start.file, len(files)):
        first = start if number == start.file else InputPosition(number)
        yield from iter_file_chunks(files[number], text_field, batch_size, first)


def iter_file_chunks(
    path: Path, text_field: str, batch_size: int, start: InputPosition = InputPosition()
) -> Iterator[TextChunk]:
    """Chunks of at most `batch_size` records of one input file, in file order, from the chunk at `start` on (one
    that a chunk of this file started at; `start.file` only labels the chunks).

    A file that breaks off (truncated or corrupt compression) ends with a chunk carrying the
    error, so the run reports it and goes on with the next file.
    """
    if path.name.endswith(".parquet"):
        yield from _iter_parquet_chunks(path, text_field, batch_size, start)
        return
    records: list[tuple[int, Record]] = []
    offset, line_number = start.offset, start.line
    chunk_start = start
    try:
        with _open_binary(path) as stream:
            _skip(stream, offset)
            for line in stream:
                offset, line_number = offset + len(line), line_number + 1
                if not line.strip():
                    continue  # blank lines separate nothing in JSON lines; not a record
                records.append((line_number, line))
                if len(records) == batch_size:
                    yield TextChunk(str(path), records, json_lines=True, position=chunk_start)
                    records, chunk_start = [], InputPosition(start.file, offset, line_number)
    except (OSError, EOFError, zstandard.ZstdError) as err:
        error = f"{path}:{line_number + 1}: file unreadable from here on ({type(err).__name__}: {err})"
        yield TextChunk(str(path), records, json_lines=True, errors=(error,), position=chunk_start)
        return
    if records:
        yield TextChunk(str(path), records, json_lines=True, position=chunk_start)


_SKIP_BLOCK = 2**20
"""Bytes read at a time where a stream that cannot seek is read up to a resumed run's offset."""


def _skip(stream: io.BufferedIOBase, offset: int) -> None:
    """Move `stream` to byte `offset` of its text: a seek, which a compressed stream does by decompressing up to it
    (gzip's), or by reading up to it where it cannot seek (zstd's)."""
    if stream.seekable():
        stream.seek(offset)
        return
    while offset > 0:
        skipped = len(stream.read(min(offset, _SKIP_BLOCK)))
        if not skipped:
            return
        offset -= skipped


def _open_binary(path: Path) -> io.BufferedIOBase:
    if path.name.endswith(".gz"):
        return gzip.open(path, "rb")
    if path.name.endswith(".zst"):
        # NOTE: BufferedReader gives line iteration over the zstd stream; read_across_frames handles
        # files written as several concatenated frames.
        raw = zstandard.ZstdDecompressor().stream_reader(open(path, "rb"), read_across_frames=True, closefd=True)
        return io.BufferedReader(raw)
    return open(path, "rb")


def _open_parquet(path: Path, text_field: str) -> pq.ParquetFile:
    """The parquet file, after checking it has the text column."""
    parquet = pq.ParquetFile(path)
    if text_field not in parquet.schema_arrow.names:
        raise ValueError(
            f"{path}: parquet file has no column {text_field!r} (columns: "
            f"{parquet.schema_arrow.names}); pass the right --text_field"
        )
    return parquet


def _iter_parquet_chunks(path: Path, text_field: str, batch_size: int, start: InputPosition) -> Iterator[TextChunk]:
    """Chunks of `batch_size` rows (the last one fewer) from row `start.line` on, reading from its row group on."""
    parquet = _open_parquet(path, text_field)
    group, row = 0, 0
    while group < parquet.num_row_groups and row + parquet.metadata.row_group(group).num_rows <= start.line:
        row += parquet.metadata.row_group(group).num_rows
        group += 1
    groups = range(group, parquet.num_row_groups)
    batches = parquet.iter_batches(batch_size=batch_size, row_groups=groups, columns=[text_field])
    texts = itertools.islice(
        itertools.chain.from_iterable(batch.column(0).to_pylist() for batch in batches), start.line - row, None
    )
    row = start.line
    while chunk := list(itertools.islice(texts, batch_size)):
        position = InputPosition(start.file, 0, row)
        yield TextChunk(str(path), list(enumerate(chunk, start=row + 1)), json_lines=False, position=position)
        row += len(chunk)


def record_text(record: Record, json_line: bool, text_field: str) -> tuple[str, str | None]:
    """(text, None) for a good record, ("", reason) for a malformed one."""
    if json_line:
        try:
            obj = json.loads(record)  # type: ignore[arg-type]
        except ValueError as err:  # JSONDecodeError and UnicodeDecodeError
            return "", f"bad JSON ({err})"
        if not isinstance(obj, dict):
            return "", f"not a JSON object but {type(obj).__name__}"
        if text_field not in obj:
            return "", f"missing field {text_field!r}"
        record = obj[text_field]
    if not isinstance(record, str):
        return "", f"field {text_field!r} is {type(record).__name__}, not a string"
    return record, None


def file_texts(path: Path, text_field: str) -> Iterator[str]:
    """The texts of one file: its good records, or the whole file when it is not a record format."""
    if not path.name.endswith(SUPPORTED_SUFFIXES):
        yield path.read_text(encoding="utf-8", errors="replace")
        return
    for chunk in iter_file_chunks(path, text_field, batch_size=1000):
        for _, record in chunk.records:
            text, reason = record_text(record, chunk.json_lines, text_field)
            if reason is None:
                yield text


def iter_texts(files: Sequence[Path], text_field: str, max_bytes: int | None) -> Iterator[str]:
    """Texts of `files` in order, stopping once `max_bytes` of UTF-8 text were given; bad records skipped."""
    seen = 0
    for path in files:
        for text in file_texts(path, text_field):
            if max_bytes is not None and seen >= max_bytes:
                return
            seen += len(text.encode("utf-8"))
            yield text


class Encoder:
    """Turns TextChunks into EncodedChunks; one per tokenizer process."""

    def __init__(self, tokenizer: LoadedTokenizer, text_field: str, dtype: np.dtype):
        self.tokenizer = tokenizer
        self.text_field = text_field
        self.dtype = dtype

    def __call__(self, chunk: TextChunk) -> EncodedChunk:
        good: list[tuple[int, str]] = []
        errors: list[tuple[int, str]] = []
        for line, record in chunk.records:
            text, reason = record_text(record, chunk.json_lines, self.text_field)
            if reason is None:
                good.append((line, text))
            else:
                errors.append((line, reason))
        ids = self._encode(good, errors)
        messages = [f"{chunk.source}:{line}: {reason}" for line, reason in sorted(errors)] + list(chunk.errors)
        doc_lengths = np.fromiter((len(x) + 1 for x in ids), dtype=np.int64, count=len(ids))
        tokens = np.full(int(doc_lengths.sum()), self.tokenizer.eos_token_id, dtype=self.dtype)
        start = 0
        for doc, length in zip(ids, doc_lengths):
            tokens[start : start + length - 1] = doc
            start += int(length)
        return EncodedChunk(chunk.source, tokens, doc_lengths, messages, chunk.position)

    def _encode(self, good: list[tuple[int, str]], errors: list[tuple[int, str]]) -> list[list[int]]:
        """Token ids of each (line, text); texts the tokenizer rejects go to `errors` and are left out."""
        try:
            return self.tokenizer.encode_batch([text for _, text in good])
        except Exception:  # noqa: BLE001  # tokenizers raises bare Exceptions: find the culprit one by one
            pass
        ids: list[list[int]] = []
        for line, text in good:
            try:
                ids.extend(self.tokenizer.encode_batch([text]))
            except Exception as err:  # noqa: BLE001  # e.g. a lone surrogate from a JSON \ud800 escape
                errors.append((line, f"text cannot be tokenized, invalid Unicode? ({err})"))
        return ids


_WORKER_ENCODER: Encoder | None = None
_PR_SET_PDEATHSIG = 1
"""prctl(2)'s option: the signal this process gets when its parent dies."""


def _exit_with_parent() -> None:
    """Have the kernel kill this tokenizer process when the process that made it dies (Linux's PR_SET_PDEATHSIG):
    a SIGKILLed tokenize_data.py ran no shutdown, and its workers waited for work forever. Elsewhere, or when
    prctl is refused, nothing is done: such workers outlive their parent as before."""
    parent = multiprocessing.parent_process()
    if parent is None or not sys.platform.startswith("linux"):  # NOTE: None: called in the main process (a test)
        return
    if ctypes.CDLL(None).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL) != 0:  # NOTE: the kernel reads no other argument
        return
    if not parent.is_alive():  # NOTE: it died before prctl: no signal will come
        os._exit(1)


def _init_worker(tokenizer_path: str, fingerprint: str, text_field: str, dtype: str) -> None:
    global _WORKER_ENCODER
    # NOTE: one single-threaded tokenizer per process; --processes sets the parallelism.
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    # NOTE: a terminal's Ctrl-C reaches the whole process group; the main process stops the pool (a worker's own
    # KeyboardInterrupt printed a traceback each and broke the pool under it)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _exit_with_parent()
    tokenizer = load_tokenizer(tokenizer_path)
    if tokenizer.fingerprint != fingerprint:
        raise ValueError(f"{tokenizer_path} changed while tokenizing; rerun with a tokenizer nobody is rewriting")
    _WORKER_ENCODER = Encoder(tokenizer, text_field, np.dtype(dtype))


def _encode_in_worker(chunk: TextChunk) -> EncodedChunk:
    assert _WORKER_ENCODER is not None, "worker used before _init_worker"
    return _WORKER_ENCODER(chunk)


def _encode_all(chunks: Iterable[TextChunk], encoder: Encoder, processes: int) -> Iterator[EncodedChunk]:
    """Encoded chunks in input order; with processes > 1, at most 2 chunks per process in flight."""
    if processes == 1:
        yield from map(encoder, chunks)
        return
    init_args = (str(encoder.tokenizer.path), encoder.tokenizer.fingerprint, encoder.text_field, encoder.dtype.str)
    pool = ProcessPoolExecutor(max_workers=processes, initializer=_init_worker, initargs=init_args)
    pending: deque[Future[EncodedChunk]] = deque()
    try:
        for chunk in chunks:
            pending.append(pool.submit(_encode_in_worker, chunk))
            if len(pending) >= 2 * processes:
                yield pending.popleft().result()
        while pending:
            yield pending.popleft().result()
    except BaseException:  # NOTE: GeneratorExit too: the run stopped taking chunks on an error of its own
        _kill_workers(pool)
        raise
    finally:
        pool.shutdown(wait=True, cancel_futures=True)


def _kill_workers(pool: ProcessPoolExecutor) -> None:
    """Kill the pool's tokenizer processes at once: after a stop (Ctrl-C, SIGTERM) or an error their chunks in flight
    are thrown away, and shutdown waited for each of them (tens of seconds for large --batch_size chunks, long past a
    scheduler's grace before its SIGKILL). SIGKILL, as SIGTERM runs the handler they inherit only once the chunk in
    hand is encoded. The pool's own copy of its result pipe's writing end is closed too: a worker killed while
    sending a chunk back left a message cut short that the pool's result thread waited for forever, and shutdown
    with it; once closed, that wait ends (end of file) and the pool gives up as on any worker's death."""
    for process in list((pool._processes or {}).values()):  # NOTE: Python 3.14's kill_workers() is this loop
        process.kill()
    pool._result_queue._writer.close()  # type: ignore[attr-defined]


@dataclass(frozen=True)
class ResumePoint:
    """Where a run starts writing: after the complete shards `shards` a run before it kept, at token `token` of input
    chunk `chunk` (counted from 0 over the whole input), which starts at `position`."""

    shards: tuple[Path, ...] = ()
    chunk: int = 0
    token: int = 0
    position: InputPosition = InputPosition()


FRESH_START = ResumePoint()


def _drop_written(encoded: Iterator[EncodedChunk], start: ResumePoint) -> Iterator[EncodedChunk]:
    """`encoded` (the chunks from `start.chunk` on) without the first `start.token` tokens, which earlier shards hold,
    nor the documents that end among them."""
    first = next(encoded, None)
    if first is not None:
        ends = np.cumsum(first.doc_lengths)
        kept = ends > start.token
        lengths = ends[kept] - np.maximum(ends[kept] - first.doc_lengths[kept], start.token)
        yield EncodedChunk(first.source, first.tokens[start.token :], lengths, first.errors, first.position)
    yield from encoded


class ShardWriter:
    """Cuts a token stream into shards of `max_shard_bytes`, each written atomically with its sidecar.

    A shard is buffered in memory (at most `max_shard_bytes`) and written to `<shard>.partial`; its sidecar
    is written next, and only then is the shard renamed to `<shard>`, so a shard never appears without it.
    """

    def __init__(
        self,
        output_prefix: Path,
        *,
        dtype: np.dtype,
        max_shard_bytes: int,
        tokenizer: LoadedTokenizer,
        input_settings: Mapping[str, str | int] | None = None,
        start: ResumePoint = FRESH_START,
    ):
        self.capacity = max_shard_bytes // dtype.itemsize
        if self.capacity < 1:
            raise ValueError(f"--max_shard_bytes {max_shard_bytes} cannot hold one {dtype} token")
        self.output_prefix = output_prefix
        self.dtype = dtype
        self.tokenizer = tokenizer
        self.input_settings = None if input_settings is None else dict(input_settings)
        """Recorded in each sidecar with where its shard ends in the input, when given (see ShardInfo.input_end)."""
        self.shards: list[Path] = list(start.shards)
        self._buffer = np.empty(min(self.capacity, 2**20), dtype=dtype)
        self._filled = 0
        self._documents = 0
        self._sources: dict[str, None] = {}
        self._chunk, self._first_token = start.chunk, start.token
        """The input chunk the next write() gets, and which of its tokens it starts at (a resumed run's first)."""
        self._end: tuple[int, int, InputPosition | None] = (start.chunk, start.token, start.position)
        """Where the tokens buffered end: (chunk, token) and where that chunk starts; set by each write()."""

    def write(self, chunk: EncodedChunk) -> None:
        """Append a chunk's tokens, starting new shards as they fill up."""
        doc_ends = np.cumsum(chunk.doc_lengths)
        start = 0
        while start < len(chunk.tokens):
            take = min(self.capacity - self._filled, len(chunk.tokens) - start)
            self._reserve(self._filled + take)
            self._buffer[self._filled : self._filled + take] = chunk.tokens[start : start + take]
            self._documents += int(
                np.searchsorted(doc_ends, start + take, side="right") - np.searchsorted(doc_ends, start, side="right")
            )
            self._sources.setdefault(chunk.source, None)
            self._filled += take
            start += take
            self._end = (self._chunk, self._first_token + start, chunk.position)
            if self._filled == self.capacity:
                self._flush()
        self._chunk, self._first_token = self._chunk + 1, 0

    def _reserve(self, size: int) -> None:
        """Grow the buffer (by doubling, up to one shard) so it holds `size` tokens."""
        if size > len(self._buffer):
            grown = np.empty(min(self.capacity, max(size, 2 * len(self._buffer))), dtype=self.dtype)
            grown[: self._filled] = self._buffer[: self._filled]
            self._buffer = grown

    def close(self) -> list[Path]:
        """Write the last, partly filled shard; the list of all shards written."""
        self._flush()
        return self.shards

    def _input_record(self) -> dict[str, Any]:
        """The sidecar's fields that --resume reads (where the shard ends in the input, and the settings), when the
        writer was given input settings."""
        if self.input_settings is None:
            return {}
        chunk, token, position = self._end
        return {
            "input_end": (chunk, token),
            "input_position": None if position is None else asdict(position),
            "input_settings": self.input_settings,
        }

    def _flush(self) -> None:
        if self._filled == 0:
            return
        path = Path(f"{self.output_prefix}_{len(self.shards):05d}.npy")
        tmp = path.with_name(path.name + PARTIAL_SUFFIX)
        kept = f"the {len(self.shards)} complete shard(s) before it are kept" if self.shards else "no shard is complete"
        try:
            with room_for(
                f"--output_prefix {self.output_prefix}: cannot write {path.name}",
                f"{kept}; free space there, then rerun the same command with --resume to continue",
            ):
                self._write(path, tmp)
        except BaseException:
            if not path.exists():  # NOTE: stopped before the rename (Ctrl-C): no shard for its sidecar to describe
                sidecar_path(path).unlink(missing_ok=True)
            raise
        finally:
            tmp.unlink(missing_ok=True)
        self.shards.append(path)
        self._filled, self._documents, self._sources = 0, 0, {}

    def _write(self, path: Path, tmp: Path) -> None:
        """The buffered tokens as shard `path`, by way of `tmp`: the shard, its sidecar, the rename."""
        tokens = self._buffer[: self._filled]
        with open(tmp, "wb") as f:
            # NOTE: written, not memmapped (a full disk kills a process writing a memmap with SIGBUS), nor `tofile`d
            # (its OSError carries no errno); the header is the one np.save and open_memmap write
            np.lib.format.write_array_header_1_0(f, np.lib.format.header_data_from_array_1_0(tokens))
            f.write(tokens.data)
        info = ShardInfo(
            tokenizer_fingerprint=self.tokenizer.fingerprint,
            vocab_size=self.tokenizer.vocab_size,
            eos_token_id=self.tokenizer.eos_token_id,
            dtype=self.dtype.name,
            num_tokens=self._filled,
            num_documents=self._documents,
            source_files=tuple(self._sources),
            **self._input_record(),
        )
        write_shard_info(path, info)  # first: a run killed between the two leaves no shard without its sidecar
        os.replace(tmp, path)


def existing_outputs(output_prefix: Path) -> list[Path]:
    """Files a previous run with this prefix left (shards, sidecars, partial shards)."""
    return sorted(output_prefix.parent.glob(f"{output_prefix.name}_[0-9][0-9][0-9][0-9][0-9].npy*"))


def _make_output_folder(prefix: Path) -> None:
    """The folder of `prefix`, made now and written to once (a read-only or foreign folder would otherwise fail at
    the first shard, after minutes of work); OSError naming --output_prefix when it cannot be (errno's own message
    named only the path)."""
    try:
        prefix.parent.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise OSError(
            f"--output_prefix {prefix}: its folder {prefix.parent} cannot be created ({err.strerror or err}); "
            "give a prefix in a folder you can write to"
        ) from None
    try:
        tempfile.TemporaryFile(dir=prefix.parent).close()
    except OSError as err:
        raise OSError(
            f"--output_prefix {prefix}: its folder {prefix.parent} cannot be written to ({err.strerror or err}); "
            "give a prefix in a folder you can write to"
        ) from None


ChunksFrom = Callable[[InputPosition], Iterable[TextChunk]]
"""The input's chunks from the one that starts at a position on (`iter_input_chunks` of some files)."""


def tokenize_chunks(
    chunks: Iterable[TextChunk],
    *,
    tokenizer: LoadedTokenizer,
    output_prefix: str | os.PathLike[str],
    text_field: str = "text",
    dtype: str | None = None,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
    processes: int = 1,
    progress: bool = True,
) -> TokenizeSummary:
    """Tokenize `chunks` into shards `<output_prefix>_NNNNN.npy` (what tokenize_data.py does with files, which
    `tokenize_files` can resume; these cannot be, as no sidecar records where in `chunks` its shard ends)."""
    return _tokenize(
        lambda _: chunks,
        tokenizer=tokenizer,
        output_prefix=output_prefix,
        text_field=text_field,
        dtype=dtype,
        max_shard_bytes=max_shard_bytes,
        processes=processes,
        progress=progress,
    )


def _tokenize(
    chunks_from: ChunksFrom,
    *,
    tokenizer: LoadedTokenizer,
    output_prefix: str | os.PathLike[str],
    text_field: str,
    dtype: str | None,
    max_shard_bytes: int,
    processes: int,
    progress: bool,
    input_settings: Mapping[str, str | int] | None = None,
    resume: bool = False,
) -> TokenizeSummary:
    """tokenize_chunks of `chunks_from`'s chunks. `input_settings` (what, beside the arguments here, decides the chunks:
    tokenize_files' files and --batch_size) makes each sidecar record it and where its shard ends in the input;
    `resume` then continues after the last complete shard of a run with the same settings, reading the input from
    where that shard ends (see `_resume_point`)."""
    if processes < 1:
        raise ValueError(f"--processes must be >= 1, got {processes}")
    prefix = _checked_prefix(output_prefix)
    shard_dtype = choose_dtype(tokenizer.vocab_size, dtype)
    settings = None
    if input_settings is not None:
        settings = {**input_settings, "text_field": text_field, "max_shard_bytes": max_shard_bytes}
    start = _resume_point(prefix, tokenizer, shard_dtype, settings) if resume else _fresh_start(prefix)
    _make_output_folder(prefix)
    for stale in leftover_temps(prefix.parent, f"{prefix.name}_[0-9][0-9][0-9][0-9][0-9].npy.json"):
        stale.unlink(missing_ok=True)  # NOTE: a sidecar being written when a run was killed outright
    writer = ShardWriter(
        prefix,
        dtype=shard_dtype,
        max_shard_bytes=max_shard_bytes,
        tokenizer=tokenizer,
        input_settings=settings,
        start=start,
    )
    encoder = Encoder(tokenizer, text_field, shard_dtype)
    encoded_chunks = _drop_written(_encode_all(chunks_from(start.position), encoder, processes), start)
    summary = TokenizeSummary(resumed_shards=len(start.shards))
    started = time.perf_counter()
    with tqdm(unit="doc", disable=not progress, file=sys.stderr) as bar:
        for encoded in encoded_chunks:
            _report_malformed(summary, encoded.errors)
            writer.write(encoded)
            summary.num_documents += len(encoded.doc_lengths)
            summary.num_tokens += len(encoded.tokens)
            bar.set_postfix(summary.progress(), refresh=False)
            bar.update(len(encoded.doc_lengths) + len(encoded.errors))  # NOTE: after: update draws the postfix
    summary.shards = writer.close()
    summary.seconds = time.perf_counter() - started
    return summary


def _report_malformed(summary: TokenizeSummary, messages: list[str]) -> None:
    """Count `messages` in `summary`, printing (and keeping) the first MAX_REPORTED_ERRORS of the run."""
    for message in messages:
        if summary.num_malformed < MAX_REPORTED_ERRORS:
            summary.malformed_examples.append(message)
            tqdm.write(f"malformed: {message}", file=sys.stderr)
        elif summary.num_malformed == MAX_REPORTED_ERRORS:
            tqdm.write("malformed: further malformed records are counted but not printed", file=sys.stderr)
        summary.num_malformed += 1


def _checked_prefix(output_prefix: str | os.PathLike[str]) -> Path:
    """`output_prefix` as a Path; ValueError when it names a directory."""
    prefix = Path(output_prefix)
    if str(output_prefix).endswith(("/", os.sep)) or prefix.is_dir():  # NOTE: Path drops a trailing separator
        raise ValueError(
            f"--output_prefix {output_prefix} names a directory, not a file-name prefix (the shards would be "
            f"{prefix.name}_00000.npy, ... beside it); give a prefix inside it, e.g. {prefix / 'part'}"
        )
    return prefix


def _fresh_start(prefix: Path) -> ResumePoint:
    """FRESH_START; FileExistsError when an earlier run with this prefix left files."""
    leftovers = existing_outputs(prefix)
    if leftovers:
        more = f" (and {len(leftovers) - 1} more) already exist" if len(leftovers) > 1 else " already exists"
        raise FileExistsError(
            f"{leftovers[0]}{more} for --output_prefix {prefix}; add --resume to continue the run that wrote "
            f"{'them' if len(leftovers) > 1 else 'it'}, delete {'them' if len(leftovers) > 1 else 'it'} or choose "
            "another prefix"
        )
    return FRESH_START


_RESUME_SETTINGS = {
    "input_files": "the input files (--file_glob: their paths, order, sizes and modification times)",
    "tokenizer_fingerprint": "the tokenizer (--tokenizer_name_or_path: its tokenizer.json)",
    "dtype": "--dtype",
    "text_field": "--text_field",
    "batch_size": "--batch_size",
    "max_shard_bytes": "--max_shard_bytes",
}
"""Each setting --resume checks, as its refusal names it."""


def _resume_point(
    prefix: Path, tokenizer: LoadedTokenizer, dtype: np.dtype, settings: Mapping[str, str | int] | None
) -> ResumePoint:
    """Where `--resume` continues: after the last complete shard of `prefix` (FRESH_START when there is none), at the
    input position its sidecar records, once every shard's sidecar shows the same tokenizer, dtype and `settings`;
    ValueError naming the shard and what differs, or why the shards cannot be continued, and the fix. A killed run's
    unfinished shard (`.partial`, perhaps its sidecar) is rewritten by the resumed run, as it holds tokens of the same
    stream."""
    wanted = {"tokenizer_fingerprint": tokenizer.fingerprint, "dtype": dtype.name, **(settings or {})}
    shards = _complete_shards(prefix)
    start = FRESH_START
    for shard in shards:  # NOTE: each one, not the last alone: a folder holding shards of two runs is refused
        info = read_shard_info(shard)
        if info.input_end is None or info.input_settings is None or info.input_position is None:
            raise ValueError(
                f"--resume: {shard} does not record where it ends in the input (it was written by an earlier spes, "
                f"or not from files); delete {prefix}_* and rerun without --resume"
            )
        recorded = {"tokenizer_fingerprint": info.tokenizer_fingerprint, "dtype": info.dtype, **info.input_settings}
        _check_same_settings(recorded, wanted, shard)
        start = ResumePoint(tuple(shards), *info.input_end, _recorded_position(info.input_position, shard, prefix))
    return start


def _recorded_position(recorded: Mapping[str, int], shard: Path, prefix: Path) -> InputPosition:
    """The InputPosition the sidecar of `shard` records; ValueError naming the shard when it is malformed."""
    try:
        return InputPosition(*(int(recorded[f.name]) for f in fields(InputPosition)))
    except (KeyError, TypeError, ValueError) as err:
        raise ValueError(
            f"--resume: the sidecar of {shard} records a malformed input_position ({err!r}); delete {prefix}_* and "
            "rerun without --resume"
        ) from None


def _check_same_settings(recorded: Mapping[str, object], wanted: Mapping[str, object], shard: Path) -> None:
    """ValueError naming the first setting of `wanted` that differs from what `shard`'s sidecar `recorded`."""
    for key in {**recorded, **wanted}:
        was, now = recorded.get(key), wanted.get(key)
        if was != now:
            shown = "" if key in ("input_files", "tokenizer_fingerprint") else f" ({was} then, {now} now)"
            raise ValueError(
                f"--resume: {_RESUME_SETTINGS.get(key, key)} changed since the run that wrote {shard}{shown}; rerun "
                "with the same, or without --resume into another --output_prefix"
            )


def _complete_shards(prefix: Path) -> list[Path]:
    """The complete shards of `prefix`, numbered from 0; ValueError when one is missing or has no sidecar."""
    shards = [path for path in existing_outputs(prefix) if path.suffix == ".npy"]
    for number, shard in enumerate(shards):
        expected = prefix.parent / f"{prefix.name}_{number:05d}.npy"
        if shard != expected or not sidecar_path(shard).is_file():
            missing = expected if shard != expected else sidecar_path(shard)
            raise ValueError(
                f"--resume: {missing} is missing, so the shards of --output_prefix {prefix} are not one interrupted "
                f"run's; delete {prefix}_* and rerun without --resume"
            )
    return shards


def _input_files_digest(files: Sequence[Path]) -> str:
    """sha256 of the absolute paths, sizes and modification times of `files`, in order: --resume's check that the
    input is the same (a file rewritten in place keeps its size, not its time), at the cost of a stat each."""
    listed = []
    for path in files:
        stat = path.stat()
        listed.append((os.path.abspath(path), stat.st_size, stat.st_mtime_ns))
    return hashlib.sha256(json.dumps(listed).encode()).hexdigest()


def tokenize_files(
    files: Sequence[Path],
    *,
    tokenizer: LoadedTokenizer,
    output_prefix: str | os.PathLike[str],
    text_field: str = "text",
    batch_size: int = 1000,
    dtype: str | None = None,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
    processes: int = 1,
    progress: bool = True,
    resume: bool = False,
) -> TokenizeSummary:
    """Tokenize input files (see SUPPORTED_SUFFIXES) into shards, in file order; `resume` continues an interrupted
    run of the same arguments, reading the input from where its last shard ends (`_tokenize`)."""
    if batch_size < 1:
        raise ValueError(f"--batch_size must be >= 1, got {batch_size}")
    for path in files:  # a wrong --text_field fails before any work, not hours in
        if path.name.endswith(".parquet"):
            _open_parquet(path, text_field)
    return _tokenize(
        lambda start: iter_input_chunks(files, text_field, batch_size, start),
        tokenizer=tokenizer,
        output_prefix=output_prefix,
        text_field=text_field,
        dtype=dtype,
        max_shard_bytes=max_shard_bytes,
        processes=processes,
        progress=progress,
        input_settings={"input_files": _input_files_digest(files), "batch_size": batch_size},
        resume=resume,
    )


def format_summary(summary: TokenizeSummary) -> str:
    """A few lines for the end of a run."""
    rate = summary.num_tokens / summary.seconds if summary.seconds else 0.0
    lines = [
        f"documents: {summary.num_documents:,}  tokens: {summary.num_tokens:,}  shards: {len(summary.shards)}  "
        f"({summary.seconds:.1f} s, {rate:,.0f} tokens/s)",
        f"malformed records skipped: {summary.num_malformed:,}",
    ]
    if summary.resumed_shards:
        lines.append(
            f"resumed: the first {summary.resumed_shards} shard(s) were kept from the interrupted run; the counts "
            "above are of the rest"
        )
    return "\n".join(lines)


def tokenize_parser() -> argparse.ArgumentParser:
    parser = ArgumentParser(
        description="Tokenize .jsonl / .jsonl.gz / .jsonl.zst / .parquet text into flat .npy token shards "
        "(EOS after each document) with JSON sidecars, for spes training.",
        formatter_class=DefaultsHelpFormatter,
    )
    parser.add_argument(
        "--file_glob",
        nargs="+",
        required=True,
        help="input files: one or more globs (quote them; '**' recurses), each sorted",
    )
    parser.add_argument(
        "--tokenizer_name_or_path",
        required=True,
        help="tokenizer directory (with tokenizer.json), tokenizer.json file or Hugging Face Hub id such as "
        "Qwen/Qwen2.5-0.5B (the local Hub cache first; or train one with data_process_scripts/train_tokenizer.py)",
    )
    parser.add_argument(
        "--output_prefix",
        required=True,
        help="shards are written as <output_prefix>_00000.npy, ... plus <shard>.json sidecars",
    )
    parser.add_argument("--text_field", default="text", help="JSON field / parquet column holding each document")
    parser.add_argument(
        "--processes",
        type=int,
        default=1,
        help="tokenizer processes (1 = in this process, using the tokenizer's own threads)",
    )
    parser.add_argument(
        "--files_per_process",
        type=int,
        default=None,
        help="the first implementation's flag, accepted and ignored: documents, not files, are spread over "
        "--processes here, and the shards are the same for any split",
    )
    parser.add_argument("--batch_size", type=int, default=1000, help="documents per unit of work")
    parser.add_argument(
        "--max_shard_bytes",
        type=int,
        default=DEFAULT_MAX_SHARD_BYTES,
        help="maximum bytes of token data per shard (a shard is buffered in memory)",
    )
    parser.add_argument(
        "--dtype",
        choices=["uint16", "uint32"],
        default=None,
        help="token dtype (default: uint16 if the vocabulary fits, else uint32)",
    )
    parser.add_argument(
        "--resume",
        action="store_true",
        help="continue an interrupted run of the same flags after its last complete shard (the shards end the same as "
        "an uninterrupted run's); with no shard written yet, start",
    )
    return parser


def interrupted_message(output_prefix: str) -> str:
    """What an interrupted run left and what to do: its complete shards hold only the start of the input."""
    kept = [p for p in existing_outputs(Path(output_prefix)) if p.suffix == ".npy"]
    if not kept:
        return "interrupted before the first shard was complete: nothing written"
    names = kept[0].name if len(kept) == 1 else f"{kept[0].name} .. {kept[-1].name}"
    return (
        f"interrupted: {len(kept)} complete shard(s) ({names}) hold the start of the input only; rerun the same "
        "command with --resume to continue after them"
    )


def tokenize_main(argv: Sequence[str] | None = None) -> int:
    """data_process_scripts/tokenize_data.py."""
    args = tokenize_parser().parse_args(argv)
    if args.files_per_process is not None:
        print(f"note: --files_per_process {args.files_per_process} changes nothing here (see --help)", file=sys.stderr)
    try:
        with Interruptible():  # SIGTERM (`kill`, a scheduler) too: the tokenizer processes are killed, the stop told
            files, summary = _tokenize_cli(args)
    except (ValueError, OSError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(interrupted_message(args.output_prefix), file=sys.stderr)
        return 130
    print(f"tokenized {len(files)} file(s) into {args.output_prefix}_*.npy")
    print(format_summary(summary))
    if not summary.shards:
        why = f"check --text_field {args.text_field!r}" if summary.num_malformed else "the input files hold no record"
        print(f"error: no document could be tokenized; {why}", file=sys.stderr)
        return 1
    return 0


def _tokenize_cli(args: argparse.Namespace) -> tuple[list[Path], TokenizeSummary]:
    """The input files and what tokenizing them with the CLI's flags produced."""
    files = resolve_input_files(args.file_glob)
    summary = tokenize_files(
        files,
        text_field=args.text_field,
        batch_size=args.batch_size,
        tokenizer=load_tokenizer(args.tokenizer_name_or_path),
        output_prefix=args.output_prefix,
        dtype=args.dtype,
        max_shard_bytes=args.max_shard_bytes,
        processes=args.processes,
        resume=args.resume,
    )
    return files, summary


def train_tokenizer_parser() -> argparse.ArgumentParser:
    parser = ArgumentParser(
        description="Train a byte-level BPE tokenizer on local text; writes a Hugging Face tokenizer directory.",
        formatter_class=DefaultsHelpFormatter,
    )
    parser.add_argument(
        "--input",
        nargs="+",
        required=True,
        help="input files: globs (quote them; '**' recurses); jsonl/parquet give one text per record",
    )
    parser.add_argument("--output_dir", required=True, help="directory to write tokenizer.json and its configs to")
    parser.add_argument("--vocab_size", type=int, default=4096, help="vocabulary size, EOS and pad included")
    parser.add_argument(
        "--min_frequency", type=number_flag(int, ge=1), default=2, help="minimum count of a pair to be merged"
    )
    parser.add_argument("--text_field", default="text", help="JSON field / parquet column of the text")
    parser.add_argument(
        "--max_mb",
        type=number_flag(gt=0),
        default=None,
        help="train on at most this many MB of text (default: all of it)",
    )
    return parser


def train_tokenizer_main(argv: Sequence[str] | None = None) -> int:
    """data_process_scripts/train_tokenizer.py."""
    args = train_tokenizer_parser().parse_args(argv)
    try:
        files = _tokenizer_inputs(args)
        tokenizer = _train_tokenizer_cli(args, files)
    except (ValueError, OSError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(
        f"trained a byte-level BPE of {tokenizer.vocab_size} tokens on {len(files)} file(s); saved to "
        f"{args.output_dir} (eos id {tokenizer.eos_token_id}, pad id {tokenizer.pad_token_id}, "
        f"fingerprint {tokenizer.fingerprint[:12]})"
    )
    if tokenizer.vocab_size < args.vocab_size:
        print(
            f"note: fewer tokens than --vocab_size {args.vocab_size}: the text has too few distinct pairs; "
            f"set model.vocab_size={tokenizer.vocab_size}"
        )
    return 0


def _tokenizer_inputs(args: argparse.Namespace) -> list[Path]:
    """The files of --input; refused when a pattern matches none or --output_dir already holds a tokenizer."""
    files: list[Path] = []
    for pattern in args.input:
        matches = glob_files(pattern)
        if not matches:
            raise FileNotFoundError(f"--input {pattern!r} matches no file")
        files.extend(matches)
    if (Path(args.output_dir) / "tokenizer.json").exists():  # NOTE: the shards written with it would not match
        raise FileExistsError(
            f"--output_dir {args.output_dir} already holds a tokenizer (tokenizer.json), which the shards "
            "tokenized with it need; choose another --output_dir, or delete it first"
        )
    return files


@dataclass
class _TextTally:
    """Texts and UTF-8 bytes that went by."""

    texts: int = 0
    bytes: int = 0

    def counted(self, texts: Iterable[str]) -> Iterator[str]:
        for text in texts:
            self.texts += 1
            self.bytes += len(text.encode("utf-8"))
            yield text


def _train_tokenizer_cli(args: argparse.Namespace, files: list[Path]) -> LoadedTokenizer:
    """The tokenizer trained on `files` with the CLI's flags. Training shows no progress of its own off a terminal
    (the library's bars draw only on one): a line at its start and one at its end, with sizes and seconds."""
    check_bpe_vocab_size(args.vocab_size)  # NOTE: before the start line, so a refusal is one line
    max_bytes = int(args.max_mb * 1e6) if args.max_mb is not None else None
    texts = iter_texts(files, args.text_field, max_bytes)
    first = next(texts, None)  # NOTE: no text at all trained a bytes-only tokenizer, told as too few distinct pairs
    if first is None:
        raise ValueError(f"--input {' '.join(args.input)} holds no text (check --text_field {args.text_field!r})")
    terminal, tally = sys.stderr.isatty(), _TextTally()
    if not terminal:
        size = sum(path.stat().st_size for path in files)
        limit = f", reading at most --max_mb {args.max_mb:g} MB of text" if max_bytes is not None else ""
        print(f"training on {len(files)} file(s) of {size:,} bytes{limit} ...", file=sys.stderr)
    started = time.perf_counter()
    tokenizer = train_byte_level_bpe(
        tally.counted(itertools.chain([first], texts)),
        vocab_size=args.vocab_size,
        output_dir=args.output_dir,
        min_frequency=args.min_frequency,
        progress=terminal,
    )
    if not terminal:
        print(
            f"trained on {tally.texts:,} texts of {tally.bytes:,} bytes in {time.perf_counter() - started:.1f} s",
            file=sys.stderr,
        )
    return tokenizer
