"""Fuzz of the wire's tensor framing (`spes.sync.wire.TensorDecoder`, both its gRPC `feed` and its raw `feed_raw`):
valid streams round-trip; damaged chunks, reordered or repeated ones and hostile header fields are refused with a
ValueError (`CorruptChunk` and `BaseMismatch` are ValueErrors), before any buffer a header asks for is allocated."""

from __future__ import annotations

import io

import pytest
import torch
from google.protobuf.message import DecodeError
from hypothesis import given
from hypothesis import strategies as st

from fuzz_helpers import FEW, FUZZ, hostile_ints, memory_cap, mutated, refused_only
from spes.sync import wire
from spes.sync.codecs.int8 import Int8
from spes.sync.codecs.sparse import Sparse
from spes.sync.proto import spes_pb2 as pb

# NOTE: a test here takes seconds (the longest ten on a loaded 2-core machine); 60 s fails a framing bug that loops
# forever (its buffer growing each turn) before mutmut's deadline for the module's tests counts it a timeout. The
# thread method ends the process: the signal one fails the example once, and hypothesis then runs it again to shrink
# it, with no alarm left
pytestmark = pytest.mark.timeout(60, method="thread")

MANIFEST = {"a": (3, 5), "empty": (0, 4), "b": (7,), "c": (2, 2, 2)}
FORMATS = [None, Int8(block=128), Sparse(chunk=8, topk=2, bits=2)]


def _model(dtype: str = "fp32") -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return {n: torch.randn(s, generator=gen).to(wire.RAW_DTYPES[dtype]) for n, s in MANIFEST.items()}


def _chunk_bytes(dtype: str = "fp32", chunk: int = 16) -> list[bytes]:
    return [c.SerializeToString() for c in wire.encode_tensors(_model(dtype), dtype, chunk_bytes=chunk)]


shapes = st.lists(st.integers(0, 5), max_size=3).map(tuple)


@FUZZ
@given(
    st.dictionaries(st.text(min_size=1, max_size=6), shapes, min_size=1, max_size=4),
    st.sampled_from(["fp32", "bf16"]),
    st.integers(1, 64),
)
def test_valid_streams_round_trip(manifest: dict[str, tuple[int, ...]], dtype: str, chunk: int) -> None:
    tensors = {n: torch.arange(float(torch.Size(s).numel())).reshape(s) for n, s in manifest.items()}
    decoded = wire.decode_tensors(wire.encode_tensors(tensors, dtype, chunk_bytes=chunk), manifest, dtype)
    assert {n: t.tolist() for n, t in decoded.items()} == {
        n: t.to(wire.RAW_DTYPES[dtype]).tolist() for n, t in tensors.items()
    }


def _feed_all(frames: list[bytes], dtype: str, fmt: object | None = None) -> None:
    decoder = wire.TensorDecoder(MANIFEST, dtype, non_finite="diverged", coded=fmt, base_round=3)  # type: ignore[arg-type]
    for frame in frames:
        try:
            chunk = pb.TensorChunk.FromString(frame)
        except DecodeError:
            continue  # the transport refuses what is not a message at all
        decoder.feed(chunk)
    decoder.finish()


@FUZZ
@given(st.data(), st.sampled_from(["fp32", "bf16"]))
def test_damaged_chunks_are_refused(data: st.DataObject, dtype: str) -> None:
    frames = _chunk_bytes(dtype)
    at = data.draw(st.integers(0, len(frames) - 1))
    frames[at] = data.draw(mutated(frames[at]))
    with memory_cap():
        refused_only(lambda: _feed_all(frames, dtype), ValueError)


@FUZZ
@given(st.data())
def test_reordered_dropped_or_repeated_chunks_are_refused(data: st.DataObject) -> None:
    frames = _chunk_bytes()
    order = data.draw(st.lists(st.integers(0, len(frames) - 1), max_size=2 * len(frames)))
    refused_only(lambda: _feed_all([frames[i] for i in order], "fp32"), ValueError)


@st.composite
def hostile_headers(draw: st.DrawFn) -> pb.TensorHeader:
    """A header of one of the manifest's tensors (or another name) with hostile fields."""
    return pb.TensorHeader(
        name=draw(st.sampled_from([*MANIFEST, "other", ""])),
        dtype=draw(st.sampled_from(["fp32", "bf16", "int8", "", "fp64"])),
        shape=draw(st.lists(hostile_ints(), max_size=4)),
        num_bytes=draw(st.one_of(st.integers(0, 2**64 - 1), st.sampled_from([0, 60, 28, 32, 2**63]))),
        checksum=draw(st.integers(0, 2**64 - 1)),
        base_round=draw(st.sampled_from([-1, 0, 3, 2**63 - 1])),
        codec=draw(st.sampled_from(["", "int8", "sparse", "fp32", "?"])),
        params=draw(st.dictionaries(st.sampled_from(["block", "chunk", "topk", "bits", "x"]), hostile_ints())),
    )


class _Stream:
    """`read_into` over a byte string, as `plane_tcp.recv_exactly` over a socket: EOF is a ConnectionError."""

    def __init__(self, data: bytes) -> None:
        self._data = io.BytesIO(data)

    def read_into(self, buf: memoryview) -> None:
        got = self._data.readinto(buf)
        if got != len(buf):
            raise ConnectionError(f"stream ended after {got} of {len(buf)} bytes")


@FUZZ
@given(hostile_headers(), st.sampled_from(FORMATS), st.binary(max_size=256))
def test_hostile_headers_are_refused_before_allocating(header: pb.TensorHeader, fmt: object, rest: bytes) -> None:
    raw = wire.TensorDecoder(MANIFEST, "fp32", non_finite="diverged", coded=fmt, base_round=3)  # type: ignore[arg-type]
    chunked = wire.TensorDecoder(MANIFEST, "fp32", non_finite="diverged", coded=fmt, base_round=3)  # type: ignore[arg-type]
    chunk = pb.TensorChunk(header=header, offset=0, data=rest[:64], checksum=wire.checksum(rest[:64]))
    with memory_cap():
        refused_only(lambda: raw.feed_raw(header, _Stream(rest).read_into), ValueError, ConnectionError)
        refused_only(lambda: chunked.feed(chunk), ValueError)


@FEW
@given(st.data(), st.sampled_from(["fp32", "bf16"]))
def test_damaged_raw_streams_are_refused(data: st.DataObject, dtype: str) -> None:
    """A raw stream (`write_raw`'s payloads and trailers after their header frames) cut, flipped or padded."""
    headers, stream = [], bytearray()
    for name, tensor in _model(dtype).items():
        headers.append(wire.header_for(name, tensor, dtype))
        wire.write_raw(tensor, dtype, stream.extend)
    damaged = data.draw(mutated(bytes(stream)))
    decoder = wire.TensorDecoder(MANIFEST, dtype, non_finite="diverged")
    source = _Stream(damaged)

    def decode() -> None:
        for header in headers:
            decoder.feed_raw(header, source.read_into)
        decoder.finish()

    refused_only(decode, ValueError, ConnectionError)


def test_nan_in_a_raw_payload_is_refused() -> None:
    tensor = torch.tensor([1.0, float("nan")])
    stream = bytearray()
    wire.write_raw(tensor, "fp32", stream.extend)
    decoder = wire.TensorDecoder({"x": (2,)}, "fp32", non_finite="diverged")
    with pytest.raises(ValueError, match="NaN or Inf"):
        decoder.feed_raw(wire.header_for("x", tensor, "fp32"), _Stream(bytes(stream)).read_into)
