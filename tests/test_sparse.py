"""The sparse codec's math alone: what is sent is rebuilt exactly, chunk edges, levels, bit streams, sizes and
refusals (error feedback over rounds and the held model on real servers: tests/test_held.py)."""

from __future__ import annotations

import math

import pytest
import torch

from spes.sync.codecs.held import encode_delta
from spes.sync.codecs.sparse import Sparse, dequantize, pack_bits, payload_bytes, quantize, unpack_bits


@pytest.mark.parametrize("width", [1, 2, 3, 7, 12, 20])
def test_bit_streams_round_trip_at_every_width(width: int) -> None:
    values = torch.randint(0, 1 << width, (37,))
    packed = pack_bits(values, width)
    assert packed.dtype == torch.uint8 and packed.numel() == math.ceil(37 * width / 8)
    assert torch.equal(unpack_bits(packed, 37, width), values)


def test_the_bit_stream_is_little_endian_entry_by_entry() -> None:
    # entry i at bits [3i, 3i + 3), bit j of a byte its j-th: 5 = 101, 3 = 011 -> bits 1,0,1,1,1,0 -> 0b011101
    assert pack_bits(torch.tensor([5, 3]), 3).tolist() == [0b011101]


@pytest.mark.parametrize("numel", [1, 5, 63, 64, 100, 4096, 4096 * 2 + 17])
def test_each_chunk_sends_its_topk_largest_and_the_rest_is_zero(numel: int) -> None:
    torch.manual_seed(numel)
    x = torch.randn(numel)
    payload = quantize("w", x, chunk=64, topk=8, bits=8)
    got = dequantize(payload)
    for start in range(0, numel, 64):
        part, sent = x[start : start + 64], got[start : start + 64]
        k = min(8, part.numel())
        largest = set(part.abs().topk(k).indices.tolist())
        assert set(sent.nonzero().flatten().tolist()) == largest  # NOTE: no level stands for zero
    assert payload.num_bytes == payload_bytes(numel, 64, 8, 8) == payload.pack().numel()


def test_levels_are_evenly_spaced_over_the_chunks_largest_magnitude_and_never_zero() -> None:
    x = torch.tensor([3.0, -3.0, 1.2, -0.9, 0.1, 0.0])
    got = dequantize(quantize("w", x, chunk=6, topk=4, bits=2))
    # levels of 2 bits over [-3, 3]: -3, -1, 1, 3; 0.1 and 0.0 are not among the top 4
    assert got.tolist() == [3.0, -3.0, 1.0, -1.0, 0.0, 0.0]
    sign = dequantize(quantize("w", torch.tensor([2.0, -4.0, 0.5]), chunk=3, topk=2, bits=1))
    assert sign.tolist() == [3.0, -3.0, 0.0]  # 1 bit: the sign times the mean magnitude sent


def test_what_was_sent_is_rebuilt_exactly_from_the_wire_bytes() -> None:
    codec = Sparse(chunk=256, topk=16, bits=3)
    x = torch.randn(1000, 3)
    payload = codec.encode("w", x)
    again = codec.unpack("w", (1000, 3), payload.params(), payload.pack())
    assert torch.equal(codec.decode(again), codec.decode(payload))
    assert again.params() == {"chunk": 256, "topk": 16, "bits": 3}


def test_error_feedback_carries_exactly_what_the_payload_missed() -> None:
    codec = Sparse(chunk=128, topk=4, bits=2)
    base, value, carried = torch.randn(500), torch.randn(500), torch.randn(500) * 0.01
    sent = encode_delta(codec, "w", value, base, carried)
    target = value - base + carried
    assert torch.equal(sent.error, target - codec.decode(sent.payload))
    assert torch.equal(sent.reconstruction, base + codec.decode(sent.payload))


def test_the_server_sends_in_its_own_format_and_both_formats_are_read() -> None:
    codec = Sparse(chunk=64, topk=4, bits=2, down_topk=16, down_bits=8)
    assert (codec.down.topk, codec.down.bits, codec.down.chunk) == (16, 8, 64)
    x = torch.randn(300)
    for payload in (codec.encode("w", x), codec.down.encode("w", x)):
        assert codec.payload_bytes((300,), payload.params()) == payload.num_bytes
        assert torch.equal(
            codec.decode(codec.unpack("w", (300,), payload.params(), payload.pack())), dequantize(payload)
        )
    assert codec.down.round_bytes(300) > codec.round_bytes(300)


def test_bad_settings_headers_and_payloads_are_refused_naming_them() -> None:
    with pytest.raises(ValueError, match=r"codec_settings.topk = 0 must be in \[1, chunk=64\]"):
        Sparse(chunk=64, topk=0)
    with pytest.raises(ValueError, match=r"codec_settings.down_bits = 9 must be in \[1, 8\]"):
        Sparse(down_bits=9)
    codec = Sparse(chunk=64, topk=4, bits=2)
    with pytest.raises(ValueError, match=r"sparse parameters \{'chunk': 64, 'topk': 5, 'bits': 2\}"):
        codec.payload_bytes((100,), {"chunk": 64, "topk": 5, "bits": 2})
    with pytest.raises(ValueError, match=r"tensor 'w' holds NaN or Inf"):
        codec.encode("w", torch.tensor([1.0, float("nan")]))
    payload = codec.encode("w", torch.randn(100))
    data = payload.pack().clone()
    data[4 * 2 : 4 * 2 + 1] = 0xFF  # the first index byte: entries out of order within their chunk
    with pytest.raises(ValueError, match=r"tensor 'w': sparse payload has an index outside its chunk or out of order"):
        codec.unpack("w", (100,), payload.params(), data)
    data = payload.pack().clone()
    data[:4] = torch.tensor([0, 0, 0xC0, 0xFF], dtype=torch.uint8)  # a NaN scale
    with pytest.raises(ValueError, match=r"sparse payload has a negative, NaN or Inf scale"):
        codec.unpack("w", (100,), payload.params(), data)
