"""Fuzz of the codecs' decoders (`Format.payload_bytes` and `Format.unpack` of int8 and sparse, the server applying
a payload): a payload packed by its codec unpacks to itself; any bytes of the size a header announces unpack or are
refused with a ValueError, and what the server makes of a payload it accepts is finite or refused."""

from __future__ import annotations

import math
import re

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from fuzz_helpers import FUZZ, hostile_ints, memory_cap, refused_only
from spes.sync.codecs.held import HeldServer
from spes.sync.codecs.int8 import Int8
from spes.sync.codecs.interface import Served, UploadBase
from spes.sync.codecs.registry import build_codec
from spes.sync.codecs.sparse import Sparse

pytestmark = pytest.mark.timeout(120)

QUANTIZERS = [Int8(block=128), Sparse(chunk=8, topk=2, bits=2), Sparse(chunk=16, topk=3, bits=1, down_bits=8)]
shapes = st.lists(st.integers(0, 40), min_size=1, max_size=2).map(tuple)


def _formats(quantizer: Int8 | Sparse) -> list[Int8 | Sparse]:
    return [quantizer, quantizer.down]


def _params(fmt: Int8 | Sparse) -> dict[str, int]:
    """The header parameters of `fmt`'s payloads."""
    return fmt.params() if isinstance(fmt, Sparse) else {"block": fmt.block}


@FUZZ
@given(st.sampled_from(QUANTIZERS), shapes, st.data())
def test_payloads_round_trip(quantizer: Int8 | Sparse, shape: tuple[int, ...], data: st.DataObject) -> None:
    fmt = data.draw(st.sampled_from(_formats(quantizer)))
    values = data.draw(st.lists(st.floats(-1e3, 1e3), min_size=math.prod(shape), max_size=math.prod(shape)))
    payload = fmt.encode("t", torch.tensor(values, dtype=torch.float32).reshape(shape))
    packed = payload.pack()
    assert packed.numel() == quantizer.payload_bytes(shape, payload.params())
    again = quantizer.unpack("t", shape, payload.params(), packed)
    assert torch.equal(quantizer.decode(again), fmt.decode(payload))


@FUZZ
@given(
    st.sampled_from(QUANTIZERS),
    shapes,
    st.dictionaries(st.sampled_from(["block", "chunk", "topk", "bits"]), hostile_ints()),
)
def test_hostile_params_are_refused(quantizer: Int8 | Sparse, shape: tuple[int, ...], params: dict[str, int]) -> None:
    size = refused_only(lambda: quantizer.payload_bytes(shape, params), ValueError)
    assert size is None or 0 <= size <= 8 * math.prod(shape) + 64


@FUZZ
@given(st.sampled_from(QUANTIZERS), shapes, st.data())
def test_any_bytes_of_the_announced_size_unpack_or_are_refused(
    quantizer: Int8 | Sparse, shape: tuple[int, ...], data: st.DataObject
) -> None:
    params = _params(data.draw(st.sampled_from(_formats(quantizer))))
    size = quantizer.payload_bytes(shape, params)
    raw = data.draw(st.binary(min_size=size, max_size=size))
    payload = refused_only(
        lambda: quantizer.unpack("t", shape, params, torch.frombuffer(bytearray(raw), dtype=torch.uint8)), ValueError
    )
    if payload is not None:
        assert tuple(quantizer.decode(payload).shape) == shape  # type: ignore[arg-type]


@FUZZ
@given(st.sampled_from(QUANTIZERS), st.data())
def test_the_server_refuses_what_a_payload_makes_not_finite(quantizer: Int8 | Sparse, data: st.DataObject) -> None:
    """Scales up to fp32's largest value pass `unpack`; the server applying them to a finite model must refuse an
    Inf (a ValueError), never keep it."""
    shape = (256,)
    params = _params(quantizer)
    size = quantizer.payload_bytes(shape, params)
    raw = bytearray(data.draw(st.binary(min_size=size, max_size=size)))
    scale_bytes = torch.tensor([3.4e38], dtype=torch.float32).view(torch.uint8).tolist()
    start = 256 if isinstance(quantizer, Int8) else 0
    raw[start : start + 4] = bytes(scale_bytes)
    payload = refused_only(
        lambda: quantizer.unpack("w", shape, params, torch.frombuffer(raw, dtype=torch.uint8)), ValueError
    )
    if payload is None:
        return
    model = {"w": torch.zeros(shape)}
    base = UploadBase(served=Served(3, model), global_model=model, verbatim=frozenset())
    with memory_cap():
        value = refused_only(lambda: HeldServer(quantizer)._applied(base, {}, payload), ValueError)  # type: ignore[arg-type]
    if value is not None:
        assert bool(torch.isfinite(value).all())


@FUZZ
@given(
    st.sampled_from(["int8", "sparse"]),
    st.dictionaries(st.sampled_from(["codec", "round"]), st.sampled_from(["int8", "sparse", "x", "", "-7", "3"])),
)
def test_a_damaged_codec_state_is_refused_with_a_value_error(codec: str, metadata: dict[str, str]) -> None:
    """`HeldPeer.load_state_dict` reads `codec_state.st`'s header metadata, which a damaged checkpoint holds;
    `PeerSync.resume` takes only OSError and ValueError (a state without its round raised KeyError, a negative round
    was taken as the held model's)."""
    peer = build_codec(codec).peer()
    refused_only(lambda: peer.load_state_dict(metadata, {"held/w": torch.ones(2)}), ValueError)
    assert peer.base_round >= -1


def test_a_codec_state_without_its_round_is_refused() -> None:
    peer = build_codec("int8").peer()
    want = (
        "codec state: held round None is not a round number: the checkpoint is damaged; load an older one with "
        "--load_path=<save_folder>/step<N>"
    )
    with pytest.raises(ValueError, match=f"^{re.escape(want)}$"):
        peer.load_state_dict({"codec": "int8"}, {"held/w": torch.ones(2)})
