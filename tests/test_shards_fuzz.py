"""Fuzz of token shards and their sidecars (`spes.shards`, and `spes.data.TokenSequenceDataset` that opens them): a
shard and sidecar as tokenize_data.py writes them open back; a damaged `.npy` header, a cut or padded file and a
sidecar with hostile fields open or are refused with a ValueError naming the file, never another exception (nor a
memory map of a size the header made up)."""

from __future__ import annotations

import json
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from fuzz_helpers import FEW, FUZZ, memory_cap, mutated, mutated_json, refused_only
from spes.data import TokenSequenceDataset
from spes.shards import ShardInfo, find_shard_info, open_token_array, sidecar_path, write_shard_info

pytestmark = pytest.mark.timeout(120)

TOKENS = np.arange(300, dtype=np.uint16) % 97


def _info(tokens: np.ndarray) -> ShardInfo:
    return ShardInfo(
        tokenizer_fingerprint="ab" * 32,
        vocab_size=97,
        eos_token_id=0,
        dtype=tokens.dtype.name,
        num_tokens=len(tokens),
        num_documents=4,
        source_files=("a.txt",),
        input_end=(1, 5),
        input_settings={"text_field": "text"},
    )


@contextmanager
def _shard(tokens: np.ndarray = TOKENS) -> Iterator[Path]:
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "part-0.npy"
        np.save(path, tokens)
        write_shard_info(path, _info(tokens))
        yield path


@FUZZ
@given(st.lists(st.integers(0, 2**16 - 1), max_size=200), st.sampled_from([np.uint16, np.uint32]))
def test_shards_round_trip(tokens: list[int], dtype: type) -> None:
    array = np.array(tokens, dtype=dtype)
    with _shard(array) as path:
        assert np.array_equal(np.asarray(open_token_array(path)), array)
        assert find_shard_info(path) == _info(array)


@FUZZ
@given(st.data())
def test_damaged_sidecars_are_refused(data: st.DataObject) -> None:
    with _shard() as path:
        sidecar = sidecar_path(path)
        if data.draw(st.booleans()):
            sidecar.write_text(json.dumps(data.draw(mutated_json(json.loads(sidecar.read_text())))))
        else:
            sidecar.write_bytes(data.draw(mutated(sidecar.read_bytes())))
        info = refused_only(lambda: find_shard_info(path), ValueError)
        if info is not None:
            refused_only(lambda: TokenSequenceDataset([path], 16), ValueError)


@FUZZ
@given(st.data())
def test_damaged_npy_files_are_refused(data: st.DataObject) -> None:
    with _shard() as path:
        raw = path.read_bytes()
        header = data.draw(st.booleans())  # damage the header (its first 128 bytes), or anywhere
        damaged = data.draw(mutated(raw[:128])) + raw[128:] if header else data.draw(mutated(raw))
        path.write_bytes(damaged)
        with memory_cap():
            array = refused_only(lambda: open_token_array(path), ValueError)
            if array is not None:
                refused_only(lambda: TokenSequenceDataset([path], 16), ValueError)


@pytest.mark.filterwarnings("error::RuntimeWarning")  # numpy's overflow warning: a size that wrapped around
@FEW
@given(
    st.sampled_from(["<u2", "<u4", "<i8", "|O", "<f4", ">u2", "V4", "<U3", "S7", "<M8[s]"]),
    st.one_of(
        st.tuples(st.integers(0, 2**63)),
        st.lists(st.integers(-1, 2**40), max_size=3).map(tuple),
        st.sampled_from([(), (150, 2), (-1,), (2**62, 2**62)]),
    ),
    st.sampled_from([False, True]),
)
def test_hostile_npy_headers_are_refused(descr: str, shape: tuple[int, ...], fortran: bool) -> None:
    """A `.npy` header naming any dtype and shape over the 600 data bytes of `TOKENS`."""
    with _shard() as path:
        raw = path.read_bytes()
        header = repr({"descr": descr, "fortran_order": fortran, "shape": shape}).encode()
        header = header + b" " * (-(len(header) + 11) % 64) + b"\n"
        path.write_bytes(b"\x93NUMPY\x01\x00" + len(header).to_bytes(2, "little") + header + raw[128:])
        with memory_cap():
            array = refused_only(lambda: open_token_array(path), ValueError)
            if array is not None:
                refused_only(lambda: TokenSequenceDataset([path], 16), ValueError)


@FUZZ
@given(st.binary(max_size=300), st.sampled_from([None, "uint16", "uint32", "uint8", "int64"]))
def test_headerless_files_open_or_are_refused(raw: bytes, memmap_dtype: str | None) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "olmo.npy"
        path.write_bytes(raw)
        array = refused_only(lambda: open_token_array(path, memmap_dtype), ValueError)
        if array is not None:
            refused_only(lambda: TokenSequenceDataset([path], 4, memmap_dtype), ValueError)


@pytest.mark.parametrize(
    ("field", "value", "why"),
    [
        ("tokenizer_fingerprint", 7, "tokenizer_fingerprint 7 is not a string"),
        ("dtype", None, "dtype None is not a string"),
        ("dtype", "float32", "dtype 'float32' is not a token dtype (uint8, uint16, uint32, uint64, int32, int64)"),
        ("num_tokens", "300", "num_tokens '300' is not a count"),
        ("num_documents", True, "num_documents True is not a count"),
        ("vocab_size", -1, "vocab_size -1 is not a count"),
        ("input_end", [1, None], "input_end[1] None is not a count"),
        ("input_position", [0, 0, 0], "input_position [0, 0, 0] is not a mapping"),
        ("input_position", {"file": 0, "byte": -1}, "input_position['byte'] -1 is not a count"),
        ("source_files", ["a.txt", 3], "source_files ['a.txt', 3] are not file names"),
        ("input_settings", ["text"], "input_settings ['text'] is not a mapping"),
    ],
)
def test_a_sidecar_field_of_another_type_is_refused_naming_it(field: str, value: object, why: str) -> None:
    """Each field's refusal names the field and what it holds (numpy's own errors name neither)."""
    with _shard() as path:
        record = json.loads(sidecar_path(path).read_text())
        record[field] = value
        sidecar_path(path).write_text(json.dumps(record))
        with pytest.raises(ValueError) as refused:
            find_shard_info(path)
        assert str(refused.value) == (
            f"sidecar {sidecar_path(path)} is malformed ({why}); rerun tokenize_data.py for this shard"
        )
        with pytest.raises(ValueError, match=f"sidecar {sidecar_path(path)} is malformed"):
            TokenSequenceDataset([path], 16)


def test_a_npy_header_the_tokenizer_cannot_read_is_refused() -> None:
    with _shard() as path:
        raw = bytearray(path.read_bytes())
        raw[10] = 0  # the header's opening brace
        path.write_bytes(bytes(raw))
        with pytest.raises(ValueError, match="unreadable .npy header"):
            open_token_array(path)


def test_a_npy_shape_whose_size_wraps_around_is_refused() -> None:
    """(2^62, 2^62) elements: numpy's int64 product wraps to 0, so the file looked large enough for it."""
    with _shard() as path:
        header = repr({"descr": "<u2", "fortran_order": False, "shape": (2**62, 2**62)}).encode()
        header = header + b" " * (-(len(header) + 11) % 64) + b"\n"
        path.write_bytes(b"\x93NUMPY\x01\x00" + len(header).to_bytes(2, "little") + header + bytes(600))
        with pytest.raises(ValueError, match="not a whole array"):
            open_token_array(path)


def test_a_sidecar_nested_too_deep_is_refused() -> None:
    with _shard() as path:
        sidecar_path(path).write_bytes(b"[" * 100_000)
        with pytest.raises(ValueError, match="is malformed"):
            find_shard_info(path)
