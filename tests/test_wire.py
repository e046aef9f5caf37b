"""Tests for spes.sync.wire: round trips, byte layout, and every way a stream can be wrong."""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch

from spes.sync import wire
from spes.sync.proto import spes_pb2 as pb
from spes.sync.wire import (
    CorruptChunk,
    EncodedModel,
    TensorDecoder,
    checksum,
    decode_tensors,
    encode_tensor,
    encode_tensors,
    payload_bytes,
)

REPO = Path(__file__).resolve().parents[1]


def sample() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return {
        "blocks.0.ffn.experts.w1.0": torch.randn(2, 8, 4, generator=gen),
        "scalar": torch.tensor(3.5),
        "empty": torch.zeros(0, 5),
        "big": torch.randn(300, 700, generator=gen),
    }


def shapes(tensors: dict[str, torch.Tensor]) -> dict[str, tuple[int, ...]]:
    return {name: tuple(t.shape) for name, t in tensors.items()}


@pytest.mark.parametrize("wire_dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("chunk_bytes", [1 << 20, 1000, 7])
def test_round_trip(wire_dtype: str, chunk_bytes: int) -> None:
    tensors = sample()
    out = decode_tensors(encode_tensors(tensors, wire_dtype, chunk_bytes), shapes(tensors), wire_dtype)
    want_dtype = torch.float32 if wire_dtype == "fp32" else torch.bfloat16
    for name, t in tensors.items():
        assert out[name].dtype == want_dtype and out[name].shape == t.shape
        assert torch.equal(out[name], t.to(want_dtype))


def test_payload_is_raw_little_endian_with_crcs() -> None:
    t = torch.arange(6, dtype=torch.float32).reshape(2, 3)
    chunks = list(encode_tensor("t", t, "fp32", chunk_bytes=10))
    payload = b"".join(c.data for c in chunks)
    assert payload == np.arange(6, dtype="<f4").tobytes()
    header = chunks[0].header
    assert (header.name, header.dtype, list(header.shape), header.num_bytes) == ("t", "fp32", [2, 3], 24)
    assert header.crc32c == checksum(payload)
    assert [c.offset for c in chunks] == [0, 10, 20] and not chunks[1].HasField("header")
    assert all(c.crc32c == checksum(c.data) for c in chunks)
    assert payload_bytes((2, 3), "bf16") == 12


def test_checksum_is_crc32c() -> None:
    assert checksum(b"123456789") == 0xE3069283  # the CRC-32C check value (RFC 3720, Castagnoli)
    assert checksum(b"56789", checksum(b"1234")) == 0xE3069283


@pytest.mark.parametrize("wire_dtype", ["fp32", "bf16"])
def test_precomputed_encoding_gives_the_same_chunks(wire_dtype: str) -> None:
    tensors = sample()
    encoded = EncodedModel(tensors, wire_dtype)
    assert list(encode_tensors(tensors, wire_dtype, chunk_bytes=100, encoded=encoded)) == list(
        encode_tensors(tensors, wire_dtype, chunk_bytes=100))
    if wire_dtype == "fp32":  # an fp32 tensor is its own wire form: no copy
        assert all(encoded[n][0].data_ptr() == t.data_ptr() for n, t in tensors.items())


def test_decoder_receives_into_kept_buffers_across_rounds() -> None:
    tensors = sample()
    expected = {n: tuple(t.shape) for n, t in tensors.items()}
    kept: dict[str, torch.Tensor] = {"scalar": torch.empty(3)}  # a buffer of the wrong shape is replaced
    first = decode_tensors_into(tensors, expected, kept)
    pointers = {n: t.data_ptr() for n, t in first.items()}
    assert set(kept) == set(tensors) and kept["scalar"].shape == tensors["scalar"].shape
    doubled = {n: 2 * t for n, t in tensors.items()}
    second = decode_tensors_into(doubled, expected, kept)
    assert {n: t.data_ptr() for n, t in second.items()} == pointers  # no fresh memory in round 2
    assert all(torch.equal(second[n], doubled[n]) for n in tensors)


def decode_tensors_into(tensors: dict[str, torch.Tensor], expected: dict, kept: dict) -> dict[str, torch.Tensor]:
    decoder = TensorDecoder(expected, "fp32", into=kept)
    for chunk in encode_tensors(tensors, "fp32", chunk_bytes=64):
        decoder.feed(chunk)
    return decoder.finish()


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
@pytest.mark.parametrize("wire_dtype", ["fp32", "bf16"])
def test_require_finite_refuses_nan_and_inf_wherever_they_are(bad: float, wire_dtype: str) -> None:
    t = torch.randn(1000, 7)
    t[999, 6] = bad  # the very last element, in a chunk that splits elements
    for require in (False, True):
        decoder = TensorDecoder({"w": (1000, 7)}, wire_dtype, require_finite=require)
        feed = lambda: [decoder.feed(c) for c in encode_tensor("w", t, wire_dtype, chunk_bytes=333)]  # noqa: E731
        if not require:
            feed()
            continue
        with pytest.raises(ValueError, match="'w' holds NaN or Inf values"):
            feed()


def test_raw_stream_is_checked_piece_by_piece(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(wire, "PIECE_BYTES", 64)
    t = torch.randn(50, 3)
    data = memoryview(t.numpy().tobytes())
    header = next(encode_tensor("w", t, "fp32")).header

    def source(payload: memoryview) -> Callable[[memoryview], None]:
        offset = 0

        def read_into(buf: memoryview) -> None:
            nonlocal offset
            buf[:] = payload[offset : offset + len(buf)]
            offset += len(buf)
        return read_into

    decoder = TensorDecoder({"w": (50, 3)}, "fp32", require_finite=True)
    decoder.feed_raw(header, source(data))
    assert torch.equal(decoder.finish()["w"], t) and decoder.bytes_received == 600
    flipped = bytearray(data)
    flipped[300] ^= 1
    with pytest.raises(CorruptChunk, match="'w': payload CRC-32C"):
        TensorDecoder({"w": (50, 3)}, "fp32").feed_raw(header, source(memoryview(flipped)))
    t[40, 0] = float("nan")
    with pytest.raises(ValueError, match="'w' holds NaN or Inf"):
        nan_data = memoryview(t.numpy().tobytes())
        TensorDecoder({"w": (50, 3)}, "fp32", require_finite=True).feed_raw(header, source(nan_data))


def test_decoder_counts_bytes_and_accepts_subset_via_finish_names() -> None:
    tensors = sample()
    decoder = TensorDecoder(shapes(tensors), "fp32")
    for chunk in encode_tensors({"scalar": tensors["scalar"]}, "fp32"):
        decoder.feed(chunk)
    assert decoder.bytes_received == 4
    assert set(decoder.finish(["scalar"])) == {"scalar"}


def chunks_of(name: str, tensor: torch.Tensor, chunk_bytes: int = 64) -> list[pb.TensorChunk]:
    return list(encode_tensor(name, tensor, "fp32", chunk_bytes))


def expect_error(chunks: list[pb.TensorChunk], expected: dict[str, tuple[int, ...]], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        decode_tensors(chunks, expected, "fp32")


def test_rejects_unknown_name() -> None:
    expect_error(chunks_of("intruder", torch.zeros(4)), {"w": (4,)}, "'intruder' is not expected")


def test_rejects_wrong_shape() -> None:
    expect_error(
        chunks_of("w", torch.zeros(2, 3)), {"w": (3, 2)}, r"'w': shape \[2, 3\] on the wire, expected \[3, 2\]"
    )


def test_rejects_wrong_dtype() -> None:
    chunks = list(encode_tensor("w", torch.zeros(4), "bf16"))
    expect_error(chunks, {"w": (4,)}, "'w': dtype 'bf16' on the wire, expected 'fp32'")


def test_rejects_wrong_byte_length() -> None:
    chunks = chunks_of("w", torch.zeros(4))
    chunks[0].header.num_bytes = 12
    expect_error(chunks, {"w": (4,)}, "'w': header says 12 bytes")


def test_rejects_corrupted_chunk() -> None:
    chunks = chunks_of("w", torch.randn(100))
    chunks[2].data = b"\x00" + chunks[2].data[1:]
    expect_error(chunks, {"w": (100,)}, "'w': chunk at offset 128 fails its CRC-32C")


def test_rejects_payload_crc_mismatch() -> None:
    chunks = chunks_of("w", torch.randn(100))
    chunks[0].header.crc32c ^= 1
    expect_error(chunks, {"w": (100,)}, "'w': payload CRC-32C")


def test_rejects_truncated_tensor_and_missing_tensor() -> None:
    chunks = chunks_of("w", torch.randn(100)) + chunks_of("v", torch.randn(3))
    expect_error(chunks[:-2], {"w": (100,), "v": (3,)}, "'w' truncated: got 384 of 400 bytes")
    expect_error(chunks[:-1], {"w": (100,), "v": (3,)}, r"before 1 expected tensor\(s\) arrived: 'v'")


def test_rejects_duplicate_tensor() -> None:
    chunks = chunks_of("w", torch.randn(3))
    expect_error(chunks + chunks, {"w": (3,)}, "'w' sent twice")


def test_rejects_lost_reordered_or_headless_chunks() -> None:
    chunks = chunks_of("w", torch.randn(100))
    expect_error([chunks[0], chunks[2]], {"w": (100,)}, "offset 128, expected offset 64")
    expect_error(chunks[1:], {"w": (100,)}, "without a tensor header")
    overrun = pb.TensorChunk(offset=384, data=b"x" * 64, crc32c=checksum(b"x" * 64))
    expect_error(chunks[:-1] + [overrun], {"w": (100,)}, "overruns")


class _Exploit:
    """Unpickling this would create a file: proof that something was executed."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self) -> tuple[object, tuple[str, str]]:
        return (os.system, (f"touch {self.path}",))


def test_pickle_payload_is_never_deserialized(tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    evil = pickle.dumps(_Exploit(str(marker)))
    header = pb.TensorHeader(name="w", dtype="fp32", shape=[4], num_bytes=len(evil), crc32c=checksum(evil))
    chunk = pb.TensorChunk(header=header, offset=0, data=evil, crc32c=checksum(evil))
    expect_error([chunk], {"w": (4,)}, "'w': header says")
    chunk.header.shape[:] = [len(evil) // 4]
    expect_error([chunk], {"w": (4,)}, "'w': shape")
    assert not marker.exists()


def test_committed_stubs_are_up_to_date(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHON": sys.executable}
    subprocess.run(
        ["bash", str(REPO / "run_scripts/gen_protos.sh"), str(tmp_path)],
        check=True,
        env=env,
        capture_output=True,
        timeout=60,
    )
    committed = REPO / "spes/sync/proto"
    for name in ("spes_pb2.py", "spes_pb2.pyi", "spes_pb2_grpc.py"):
        assert (tmp_path / name).read_text() == (committed / name).read_text(), (
            f"spes/sync/proto/{name} is stale: run run_scripts/gen_protos.sh after editing protos/spes.proto"
        )
