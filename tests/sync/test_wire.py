"""Tests for spes.sync.wire: round trips, byte layout, and every way a stream can be wrong."""

from __future__ import annotations

import itertools
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
from spes.sync.codecs import int8
from spes.sync.codecs.base import Payload
from spes.sync.codecs.lazy import Lazy
from spes.sync.codecs.sparse import Sparse
from spes.sync.proto import spes_pb2 as pb
from spes.sync.wire import (
    DIGEST,
    Checksum,
    Coded,
    CorruptChunk,
    EncodedModel,
    TensorDecoder,
    VerifiedChecksums,
    byte_view,
    checksum,
    decode_tensors,
    encode_tensor,
    encode_tensors,
    encode_whole,
    finite,
    payload_bytes,
    upload_digest,
    write_raw,
)

REPO = Path(__file__).resolve().parents[2]

# NOTE: each test here takes a second at most; a framing bug that loops forever (a regrouping that never moves past a
# piece, its buffer growing by the piece each turn) fails in 30 s instead of running until mutmut's deadline, which
# counted it a timeout, or pytest's default 120 s with gigabytes held
pytestmark = pytest.mark.timeout(30)

INT8 = int8.Int8(block=128)
"""The int8 format of the tests' payloads."""


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


def test_payload_is_raw_little_endian_with_checksums() -> None:
    t = torch.arange(6, dtype=torch.float32).reshape(2, 3)
    chunks = list(encode_tensor("t", t, "fp32", chunk_bytes=10))
    payload = b"".join(c.data for c in chunks)
    assert payload == np.arange(6, dtype="<f4").tobytes()
    header = chunks[0].header
    assert (header.name, header.dtype, list(header.shape), header.num_bytes) == ("t", "fp32", [2, 3], 24)
    assert header.checksum == checksum(payload)
    assert [c.offset for c in chunks] == [0, 10, 20] and not chunks[1].HasField("header")
    assert all(c.checksum == checksum(c.data) for c in chunks)
    assert payload_bytes((2, 3), "bf16") == 12


def test_checksum_is_xxh3_64_and_streams() -> None:
    assert checksum(b"") == 0x2D06800538D394C2  # XXH3_64bits of the empty input, seed 0 (xxHash's test vector)
    streamed = Checksum()
    for piece in (b"1234", b"", b"56789"):
        streamed.update(piece)
    assert streamed.intdigest() == checksum(b"123456789")
    assert checksum(b"123456789") != checksum(b"123456788")


def test_finite_is_exact_even_when_the_fast_sum_overflows() -> None:
    big = torch.full((4,), 3e38)  # finite values whose sum overflows to +inf: the exact check must pass them
    assert not torch.isfinite(big.sum()) and finite(big) and finite(big.bfloat16()) and finite(torch.empty(0))
    for bad in (float("nan"), float("inf"), -float("inf")):
        assert not finite(torch.tensor([1.0, bad, -1.0]))
    assert not finite(torch.tensor([float("inf"), -float("inf")]))  # NaN sum; min/max show the infinities


@pytest.mark.parametrize("wire_dtype", ["fp32", "bf16"])
def test_precomputed_encoding_gives_the_same_chunks(wire_dtype: str) -> None:
    tensors = sample()
    encoded = EncodedModel(tensors, wire_dtype)
    assert list(encode_tensors(tensors, wire_dtype, chunk_bytes=100, encoded=encoded)) == list(
        encode_tensors(tensors, wire_dtype, chunk_bytes=100)
    )
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
def test_non_finite_refuses_nan_and_inf_wherever_they_are_with_its_reason(bad: float, wire_dtype: str) -> None:
    t = torch.randn(1000, 7)
    t[999, 6] = bad  # the very last element, in a chunk that splits elements
    for reason in (None, "the reason"):
        decoder = TensorDecoder({"w": (1000, 7)}, wire_dtype, non_finite=reason)
        feed = lambda d=decoder: [d.feed(c) for c in encode_tensor("w", t, wire_dtype, chunk_bytes=333)]  # noqa: E731
        if reason is None:
            feed()
            continue
        with pytest.raises(ValueError, match="'w' holds NaN or Inf values: the reason$"):
            feed()


def test_raw_stream_is_checked_piece_by_piece(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(wire, "PIECE_BYTES", 64)
    t = torch.randn(50, 3)
    header = next(encode_tensor("w", t, "fp32")).header

    def raw(tensor: torch.Tensor) -> bytearray:
        stream, writes = bytearray(), []
        assert write_raw(tensor, "fp32", lambda data: writes.append(len(data)) or stream.extend(data)) == 600
        assert writes == [64] * 9 + [24, 8]  # each piece written right after it is hashed, then the checksum
        assert stream[600:] == DIGEST.pack(checksum(stream[:600]))  # the payload, then its checksum
        return stream

    def source(stream: bytearray) -> Callable[[memoryview], None]:
        offset = 0

        def read_into(buf: memoryview) -> None:
            nonlocal offset
            buf[:] = stream[offset : offset + len(buf)]
            offset += len(buf)

        return read_into

    decoder = TensorDecoder({"w": (50, 3)}, "fp32", non_finite="diverged")
    decoder.feed_raw(header, source(raw(t)))
    assert torch.equal(decoder.finish()["w"], t) and decoder.bytes_received == 600
    for flip in (300, 603):  # a bit flipped in the payload, or in the trailing checksum
        flipped = raw(t)
        flipped[flip] ^= 1
        with pytest.raises(CorruptChunk, match="'w': payload checksum"):
            TensorDecoder({"w": (50, 3)}, "fp32").feed_raw(header, source(flipped))
    t[40, 0] = float("nan")
    with pytest.raises(ValueError, match="'w' holds NaN or Inf"):
        TensorDecoder({"w": (50, 3)}, "fp32", non_finite="diverged").feed_raw(header, source(raw(t)))


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
    expect_error(chunks, {"w": (100,)}, "'w': chunk at offset 128 fails its checksum")


def test_rejects_payload_checksum_mismatch() -> None:
    chunks = chunks_of("w", torch.randn(100))
    chunks[0].header.checksum ^= 1
    expect_error(chunks, {"w": (100,)}, "'w': payload checksum")


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
    overrun = pb.TensorChunk(offset=384, data=b"x" * 64, checksum=checksum(b"x" * 64))
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
    header = pb.TensorHeader(name="w", dtype="fp32", shape=[4], num_bytes=len(evil), checksum=checksum(evil))
    chunk = pb.TensorChunk(header=header, offset=0, data=evil, checksum=checksum(evil))
    expect_error([chunk], {"w": (4,)}, "'w': header says")
    chunk.header.shape[:] = [len(evil) // 4]
    expect_error([chunk], {"w": (4,)}, "'w': shape")
    assert not marker.exists()


@pytest.mark.timeout(120)  # protoc in a child process, given 60 s
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


def test_verified_checksums_hold_only_while_the_very_tensor_is_unchanged() -> None:
    kept, averaged, other = torch.randn(8), torch.randn(8), torch.randn(8)
    verified = VerifiedChecksums()
    verified.record(
        {"kept": kept, "averaged": averaged, "gone": torch.randn(8)}, {"kept": 1, "averaged": 2, "gone": 3}, "fp32"
    )
    averaged.add_(1.0)  # written in place since it was received
    model = {"kept": kept, "averaged": averaged, "gone": torch.randn(8), "other": other}
    assert verified.known(model, "fp32") == {"kept": (kept, 1)}
    assert verified.known(model, "bf16") == {}  # recorded for another wire dtype


def test_an_encoded_model_reads_an_item_only_when_asked_and_sends_a_verified_one_as_it_is() -> None:
    """A download's items may be made when first read (`spes.sync.codecs.lazy`): making the shared encoded form reads
    none of them; the first download asking for one reads it, once, and a recorded unchanged buffer keeps its
    recorded checksum."""
    kept, read = torch.randn(8), []
    verified = VerifiedChecksums()
    verified.record({"kept": kept}, {"kept": 7}, "fp32")
    items = Lazy(["kept", "made"], lambda name: read.append(name) or (kept if name == "kept" else torch.ones(4)))
    encoded = EncodedModel(items, "fp32", verified)
    assert read == [] and list(encoded) == ["kept", "made"]
    assert encoded["kept"] == (kept, 7) and read == ["kept"]
    assert encoded["made"][1] == checksum(byte_view(torch.ones(4))) and encoded["made"] is encoded["made"]
    assert read == ["kept", "made"]


# ---------------------------------------------------------------------------------------------------------------
# What mutation testing (bench/mutation.py) found unpinned: the transport settings, int8 deltas through the framing,
# and the exact words of the refusals.


def test_an_unknown_wire_dtype_is_refused_naming_the_choices() -> None:
    with pytest.raises(ValueError, match=r"^unknown wire dtype 'fp16': use one of \['bf16', 'fp32'\]$"):
        wire.wire_torch_dtype("fp16")


def test_finite_of_empty_single_and_ordinary_tensors() -> None:
    assert wire.finite(torch.zeros(0)) and wire.finite(torch.ones(3)) and wire.finite(torch.tensor([2.0]))
    assert not wire.finite(torch.tensor([float("nan")])) and not wire.finite(torch.tensor([1.0, float("inf")]))


def test_an_int8_delta_travels_whole_through_the_framing() -> None:
    """Header, chunks and decoder of a coded payload: the receiver gets the very payload, its base round and
    checksum."""
    gen = torch.Generator().manual_seed(5)
    payload = int8.quantize("w", torch.randn(10, 30, generator=gen), block=128)
    item = Coded(payload, base_round=7)
    header = wire.header_for("w", item, "fp32")
    assert (header.name, list(header.shape), header.num_bytes) == ("w", [10, 30], 300 + 3 * 4)
    assert (header.codec, dict(header.params), header.base_round) == ("int8", {"block": 128}, 7)
    packed = payload.pack()
    assert packed.dtype == torch.uint8 and packed.numel() == payload.num_bytes
    again = INT8.unpack("w", (10, 30), {"block": 128}, packed)
    assert torch.equal(again.values, payload.values) and torch.equal(again.scales, payload.scales)
    decoder = TensorDecoder({"w": (10, 30), "x": (4,)}, "fp32", coded=INT8, base_round=7)
    for chunk in encode_tensors({"w": item, "x": torch.ones(4)}, "fp32", chunk_bytes=100):
        decoder.feed(chunk)
    assert sorted(decoder.finish()) == ["x"] and sorted(decoder.coded) == ["w"]
    got = decoder.coded["w"]
    assert got.base_round == 7 and (got.payload.name, got.payload.shape, got.payload.params()) == (
        "w",
        (10, 30),
        {"block": 128},
    )
    assert isinstance(got.payload, int8.Int8Payload)
    assert torch.equal(got.payload.values, payload.values) and torch.equal(got.payload.scales, payload.scales)
    assert decoder.checksums == {"x": checksum(wire.byte_view(torch.ones(4)))}  # of raw values only
    assert decoder.bytes_received == payload.num_bytes + 16  # every chunk counted, not only the last


def test_a_stream_is_complete_once_its_last_expected_tensor_arrived_whole() -> None:
    decoder = TensorDecoder({"a": (2,), "b": (300,)}, "fp32")
    assert not decoder.complete
    for chunk in encode_tensors({"a": torch.ones(2)}, "fp32"):
        decoder.feed(chunk)
    chunks = list(encode_tensors({"b": torch.ones(300)}, "fp32", chunk_bytes=400))
    for chunk in chunks[:-1]:
        decoder.feed(chunk)
    assert not decoder.complete  # the last tensor is still short
    decoder.feed(chunks[-1])
    assert decoder.complete  # before `finish` has closed it
    assert sorted(decoder.finish()) == ["a", "b"] and decoder.complete


def test_the_refusals_say_what_went_wrong() -> None:
    names = [f"t{i}" for i in range(8)]
    decoder = TensorDecoder(dict.fromkeys(names, (2,)), "fp32")
    for chunk in encode_tensors({"t0": torch.ones(2)}, "fp32"):
        decoder.feed(chunk)
    with pytest.raises(ValueError, match=r"^stream ended before 7 expected tensor\(s\) arrived: 't1', 't2', 't3', "):
        decoder.finish()
    with pytest.raises(ValueError, match=r": 't1', 't2', 't3', 't4', 't5' and 2 more$"):
        decoder.finish()
    with pytest.raises(ValueError, match=r"arrived: 't1', 't2', 't3', 't4', 't5'$"):
        decoder.finish(names[:6])
    chunks = list(encode_tensors({"t1": torch.ones(300)}, "fp32", chunk_bytes=400))
    decoder = TensorDecoder({"t1": (300,)}, "fp32")
    decoder.feed(chunks[0])
    with pytest.raises(ValueError, match=r"^tensor 't1': chunk at offset 800, expected offset 400 \(lost or reordered"):
        decoder.feed(chunks[2])
    empty = pb.TensorChunk(offset=400, data=b"", checksum=checksum(b""))
    with pytest.raises(ValueError, match=r"^tensor 't1': empty chunk at offset 400 \(only an empty tensor has one\)$"):
        decoder.feed(empty)
    raw = pb.TensorChunk(header=wire.header_for("t1", torch.ones(300), "fp32"), offset=0)
    raw.header.codec = "zip"
    with pytest.raises(ValueError, match=r"^tensor 't1': a 'zip' payload, but this stream carries fp32 values only$"):
        TensorDecoder({"t1": (300,)}, "fp32").feed(raw)


def test_pieces_are_regrouped_into_whole_chunks() -> None:
    """Each chunk read one at a time, at most one more than expected: a regrouping that never moved past a piece, or
    a chunk size of 0 let through, would otherwise loop forever instead of failing."""
    pieces = [b"ab", b"cdefghij", b"", b"k", b"lmnopqrstuvwxyz", b"0"]
    chunks = wire._rechunk([memoryview(p) for p in pieces], 4)  # noqa: SLF001 (the regrouping itself)
    assert list(itertools.islice(chunks, 8)) == [b"abcd", b"efgh", b"ijkl", b"mnop", b"qrst", b"uvwx", b"yz0"]
    for chunk_bytes in (1, 3):  # 1 byte is the smallest chunk; 0 is refused
        tensor = torch.arange(5.0)
        got = decode_tensors(encode_tensors({"t": tensor}, "fp32", chunk_bytes=chunk_bytes), {"t": (5,)}, "fp32")
        assert torch.equal(got["t"], tensor)
    with pytest.raises(ValueError, match=r"^chunk_bytes must be positive, got 0$"):
        next(encode_tensor("t", torch.ones(2), "fp32", chunk_bytes=0))


def test_an_int8_delta_travels_as_a_raw_stream_too() -> None:
    payload = int8.quantize("w", torch.randn(6, 50), block=128)
    sent = bytearray()
    assert write_raw(Coded(payload, 3), "fp32", sent.extend) == payload.num_bytes
    assert bytes(sent[-8:]) == DIGEST.pack(checksum(wire.byte_view(payload.pack())))
    stream = memoryview(bytes(sent))

    def read_into(buf: memoryview) -> None:
        nonlocal stream
        buf[:] = stream[: len(buf)]
        stream = stream[len(buf) :]

    decoder = TensorDecoder({"w": (6, 50)}, "fp32", coded=INT8, base_round=3)
    decoder.feed_raw(wire.header_for("w", Coded(payload, 3), "fp32"), read_into)
    got = decoder.coded["w"].payload
    assert isinstance(got, int8.Int8Payload)
    assert torch.equal(got.values, payload.values) and torch.equal(got.scales, payload.scales)


def test_a_bad_int8_delta_header_is_refused_before_its_bytes() -> None:
    payload = int8.quantize("w", torch.randn(4, 64), block=128)
    good = wire.header_for("w", Coded(payload, 3), "fp32")

    def refusal(base: int | None, **fields: object) -> str:
        header = pb.TensorHeader()
        header.CopyFrom(good)
        for key, value in fields.items():
            if key == "shape":
                del header.shape[:]
                header.shape.extend(value)  # type: ignore[arg-type]
            elif key == "params":
                header.params.clear()
                header.params.update(value)  # type: ignore[arg-type]
            else:
                setattr(header, key, value)
        coded = {} if base is None else {"coded": INT8, "base_round": base}
        with pytest.raises(ValueError) as err:
            TensorDecoder({"w": (4, 64)}, "fp32", **coded).feed(pb.TensorChunk(header=header))  # type: ignore[arg-type]
        return str(err.value)

    assert refusal(None) == "tensor 'w': a 'int8' payload, but this stream carries fp32 values only"
    assert (
        refusal(3, codec="sparse")
        == "tensor 'w': a 'sparse' payload, but this stream carries int8 payloads or fp32 values"
    )
    assert refusal(3, shape=[64, 4]) == "tensor 'w': int8 payload of shape [64, 4], expected [4, 64]"
    for block in (64, 1 << 17):
        assert refusal(3, params={"block": block}) == (
            f"tensor 'w': int8 parameters {{'block': {block}}}, this run's are {{'block': 128}}"
        )
    assert refusal(3, num_bytes=263) == (
        "tensor 'w': header says 263 bytes, a int8 payload of shape [4, 64] with {'block': 128} needs 264"
    )
    for base, held in ((-1, "none"), (2, "round 2")):
        assert refusal(base) == (
            f"tensor 'w': a int8 payload against the held model of round 3, but the receiver holds {held}: send full "
            "values"
        )


def test_values_are_not_checked_for_nan_unless_asked_and_the_host_must_be_little_endian(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    nan = torch.tensor([1.0, float("nan")])
    got = decode_tensors(encode_tensors({"t": nan}, "fp32"), {"t": (2,)}, "fp32")  # a server's own check decides
    assert torch.equal(got["t"].isnan(), nan.isnan())
    monkeypatch.setattr(sys, "byteorder", "big")
    with pytest.raises(RuntimeError, match=r"^spes.sync.wire needs a little-endian host \(x86-64/aarch64\); this one"):
        list(encode_tensors({"t": nan}, "fp32"))


def test_the_edges_of_a_stream_a_mutation_run_found() -> None:
    """An empty chunk carrying a non-empty tensor's header; NaN checks of a stream cut mid-element (into a kept
    buffer of NaN, where reading past what arrived would show); the largest block; a held round 0; six missing."""
    header = wire.header_for("t", torch.ones(3), "fp32")
    with pytest.raises(ValueError, match=r"^tensor 't': empty chunk at offset 0 \(only an empty tensor has one\)$"):
        TensorDecoder({"t": (3,)}, "fp32").feed(pb.TensorChunk(header=header, offset=0, checksum=checksum(b"")))
    kept = {"t": torch.full((5,), float("nan"))}
    decoder = TensorDecoder({"t": (5,)}, "fp32", into=kept, non_finite="diverged")
    for chunk in encode_tensors({"t": torch.arange(5.0)}, "fp32", chunk_bytes=7):
        decoder.feed(chunk)
    assert torch.equal(decoder.finish()["t"], torch.arange(5.0))
    widest = int8.Int8(block=int8.MAX_BLOCK)
    largest = widest.encode("w", torch.randn(300))
    decoder = TensorDecoder({"w": (300,)}, "fp32", coded=widest, base_round=0)
    for chunk in encode_tensors({"w": Coded(largest, 0)}, "fp32"):
        decoder.feed(chunk)
    assert decoder.finish() == {} and decoder.coded["w"].payload.params() == {"block": int8.MAX_BLOCK}
    with pytest.raises(ValueError, match=r"the receiver holds round 0: send full values$"):
        TensorDecoder({"w": (300,)}, "fp32", coded=widest, base_round=0).feed(
            next(encode_tensors({"w": Coded(largest, 1)}, "fp32"))
        )
    with pytest.raises(ValueError, match=r": 'a0', 'a1', 'a2', 'a3', 'a4' and 1 more$"):
        TensorDecoder({f"a{i}": (1,) for i in range(6)}, "fp32").finish()
    assert list(wire.EncodedModel({"b": torch.ones(1), "a": torch.ones(2)}, "fp32")) == ["b", "a"]


def test_a_sparse_delta_is_unpacked_by_its_headers_parameters_in_either_format() -> None:
    """The decoder hands the header's parameters to the codec: a sparse payload is read by them, in the peers'
    narrow format or the server's wider one (int8's carry only the block, which the run fixes)."""
    codec = Sparse(chunk=64, topk=4, bits=2, down_topk=16, down_bits=6)
    gen = torch.Generator().manual_seed(6)
    for fmt in (codec, codec.down):
        payload = fmt.encode("w", torch.randn(5, 40, generator=gen))
        decoder = TensorDecoder({"w": (5, 40)}, "fp32", coded=codec, base_round=2)
        for chunk in encode_tensors({"w": Coded(payload, 2)}, "fp32", chunk_bytes=16):
            decoder.feed(chunk)
        assert decoder.finish() == {}
        got = decoder.coded["w"].payload
        assert got.params() == fmt.params() and torch.equal(codec.decode(got), codec.decode(payload))


def test_each_payload_is_applied_as_soon_as_it_has_arrived_whole() -> None:
    """With `apply`, a payload is turned into values when its last byte is in (the next tensor's header, or the
    end), while the rest of the stream may still be on its way; raw values are not passed to it."""
    codec = Sparse(chunk=64, topk=4, bits=2)
    gen = torch.Generator().manual_seed(8)
    payloads = {n: codec.encode(n, torch.randn(3, 40, generator=gen)) for n in ("a", "b")}
    seen: list[str] = []

    def apply(payload: Payload) -> torch.Tensor:
        seen.append(payload.name)
        return torch.full(payload.shape, float(len(seen)))

    decoder = TensorDecoder({"a": (3, 40), "b": (3, 40), "c": (2,)}, "fp32", coded=codec, base_round=1, apply=apply)
    items = {"a": Coded(payloads["a"], 1), "b": Coded(payloads["b"], 1), "c": torch.ones(2)}
    chunks = list(encode_tensors(items, "fp32"))
    first_of_b = next(i for i, c in enumerate(chunks) if c.HasField("header") and c.header.name == "b")
    for chunk in chunks[: first_of_b + 1]:
        decoder.feed(chunk)
    assert seen == ["a"] and list(decoder.applied) == ["a"]  # a is applied while b's bytes arrive
    for chunk in chunks[first_of_b + 1 :]:
        decoder.feed(chunk)
    assert list(decoder.finish()) == ["c"] and seen == ["a", "b"]
    assert decoder.applied["b"].eq(2.0).all() and set(decoder.coded) == {"a", "b"}


def test_an_uploads_digest_is_xxh3_of_its_names_and_wire_bytes_in_order() -> None:
    """What tells a retry of a committed upload from a different one: one XXH3-64 over each name and its wire bytes
    (raw values in the wire dtype, a coded payload packed), in the upload's order."""
    gen = torch.Generator().manual_seed(7)
    raw = torch.randn(3, 5, generator=gen)
    payload = int8.quantize("d", torch.randn(300, generator=gen), block=128)
    items: dict[str, wire.Item] = {"w": raw, "d": Coded(payload, base_round=4)}
    packed = payload.pack().numpy().tobytes()
    for wire_dtype, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        values = raw.to(dtype).reshape(-1).view(torch.uint8).numpy().tobytes()
        assert upload_digest(items, wire_dtype) == checksum(b"w" + values + b"d" + packed), wire_dtype
    assert upload_digest(dict(reversed(items.items())), "fp32") != upload_digest(items, "fp32")


@pytest.mark.gpu
def test_a_cuda_tensor_is_sent_as_its_host_bytes() -> None:
    tensor = torch.arange(6.0, device="cuda")
    got = decode_tensors(encode_tensors({"t": tensor}, "bf16", chunk_bytes=4), {"t": (6,)}, "bf16")
    assert torch.equal(got["t"], tensor.cpu().bfloat16())
    sent = bytearray()
    write_raw(tensor, "fp32", sent.extend)
    assert bytes(sent[:-8]) == tensor.cpu().numpy().tobytes()
    assert wire.encode_whole(tensor, "fp32")[0].device.type == "cpu"


def test_a_converted_wire_form_is_the_casts_bytes_hashed_piece_by_piece_into_the_given_buffer() -> None:
    """fp32 -> bf16 piece by piece, each piece hashed as it is converted, into a kept buffer (old contents in it):
    the very bytes and checksum of one whole `.to(bf16)`, ties to even, subnormals and overflow included."""
    values = torch.randn(3 * wire.PIECE_BYTES // 2 + 123)  # three bf16 pieces and a part
    values[:6] = torch.tensor([1 + 2**-8, 1 + 3 * 2**-8, 2**-130, -3.4e38, 3.3895e38, -0.0])
    kept = torch.full((values.numel(),), 7.0, dtype=torch.bfloat16)
    asked: list[tuple] = []
    flat, digest = encode_whole(values, "bf16", lambda shape, dtype: asked.append((shape, dtype)) or kept)
    want = values.to(torch.bfloat16)
    assert asked == [((values.numel(),), torch.bfloat16)] and flat.data_ptr() == kept.data_ptr()
    assert torch.equal(flat.view(torch.int16), want.view(torch.int16))
    assert digest == checksum(byte_view(want))
    assert encode_whole(want, "bf16", lambda *_: pytest.fail("converted"))[0].data_ptr() == want.data_ptr()


@pytest.mark.parametrize("checksums", [None, VerifiedChecksums()], ids=["unverified", "verified"])
def test_an_encoded_models_conversions_land_in_the_buffers_its_empty_gives(checksums: VerifiedChecksums | None) -> None:
    """A server hands its encoded rounds its pool's kept buffers (`spes.sync.buffers`): a bf16 download's copy of an
    fp32 mean is converted into one of them (not into fresh memory), with checksums to consult or without."""
    mean = torch.arange(5.0) / 3
    kept = torch.full((5,), 7.0, dtype=torch.bfloat16)
    asked: list[tuple] = []
    encoded = EncodedModel({"a": mean}, "bf16", checksums, lambda shape, dtype: asked.append((shape, dtype)) or kept)
    data, digest = encoded["a"]
    assert asked == [((5,), torch.bfloat16)] and data.data_ptr() == kept.data_ptr()
    assert torch.equal(data, mean.bfloat16()) and digest == checksum(byte_view(mean.bfloat16()))


def test_a_conversion_is_hashed_piece_by_piece_of_piece_bytes(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each converted piece is hashed while it is still in the CPU's cache (`PIECE_BYTES`, sized for L2), never the
    whole tensor after its conversion."""
    hashed: list[int] = []
    xxh3 = wire.Checksum

    class Hashed:
        def __init__(self) -> None:
            self._hash = xxh3()

        def update(self, piece: memoryview) -> None:
            hashed.append(len(piece))
            self._hash.update(piece)

        def intdigest(self) -> int:
            return self._hash.intdigest()

    monkeypatch.setattr(wire, "PIECE_BYTES", 64)
    monkeypatch.setattr(wire, "Checksum", Hashed)
    values = torch.randn(100)
    flat, digest = encode_whole(values, "bf16")
    assert hashed == [64, 64, 64, 8] and digest == checksum(byte_view(values.bfloat16()))
    assert torch.equal(flat, values.bfloat16())
