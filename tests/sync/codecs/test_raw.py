"""Tests for spes.sync.codecs.raw: the stateless fp32/bf16 codecs' ends."""

from __future__ import annotations

import pytest
import torch

from spes.sync import wire
from spes.sync.codecs.base import NO_BASE
from spes.sync.codecs.interface import UploadBase
from spes.sync.codecs.raw import RawPeer, RawServer
from spes.sync.proto import spes_pb2 as pb


def trained() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return {"a": torch.randn(300, 7, generator=gen), "b": torch.randn(5, generator=gen)}


def test_a_digest_is_of_the_values_whatever_the_wire_dtype() -> None:
    """bf16 and fp32 peers digest the same values alike; a change below bf16's precision, which leaves the wire
    bytes alike, still changes the digest (a retry holds the same values, not merely the same rounded ones)."""
    values = trained()
    assert RawPeer("bf16").digest(values) == RawPeer("fp32").digest(values)
    nudged = {**values, "b": values["b"].clone()}
    nudged["b"][0] = torch.nextafter(nudged["b"][0], torch.tensor(1e9))
    assert torch.equal(nudged["b"].bfloat16(), values["b"].bfloat16())
    assert RawPeer("bf16").digest(nudged) != RawPeer("bf16").digest(values)


def test_a_bf16_digest_converts_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    """The digest reads the fp32 values as they are: converting the upload to bf16 for it cost a bf16 round of
    bench_sync's model a quarter of its time, before its first byte could go."""
    seen: list[torch.dtype] = []
    pieces = wire._wire_pieces

    def spy(tensor: torch.Tensor, wire_dtype: str, *args: int) -> object:
        seen.append(wire.RAW_DTYPES[wire_dtype])
        return pieces(tensor, wire_dtype, *args)

    monkeypatch.setattr(wire, "_wire_pieces", spy)
    RawPeer("bf16").digest(trained())
    assert seen == [torch.float32, torch.float32]


@pytest.mark.parametrize("end", [RawPeer, RawServer])
def test_an_unknown_dtype_is_refused_naming_the_choices(end: type) -> None:
    with pytest.raises(ValueError, match=r"raw codec dtype 'int4': use one of \['bf16', 'fp32'\]"):
        end("int4")


def test_a_raw_peer_keeps_no_state_and_refuses_another_codecs() -> None:
    peer = RawPeer("bf16")
    assert peer.state_dict() == ({}, {})
    peer.load_state_dict({}, {})
    with pytest.raises(ValueError, match="codec state of 'int8', this run's codec is 'bf16'"):
        peer.load_state_dict({"codec": "int8"}, {})


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_a_round_travels_as_the_values_in_the_wire_dtype_both_ways(dtype: str) -> None:
    """A peer uploads what it trained as it is; the server decodes it into its own buffers (refusing non-finite
    values), serves its global model as it is, whole or not as asked, and a peer decodes the download."""
    peer, server = RawPeer(dtype), RawServer(dtype)
    values = trained()
    upload = peer.upload(values, own=["a"])
    assert upload == values and upload is not values
    shapes = {name: tuple(t.shape) for name, t in values.items()}
    buffers = {name: torch.empty(shape, dtype=wire.RAW_DTYPES[dtype]) for name, shape in shapes.items()}
    no_round_yet = UploadBase(None, {}, frozenset())
    decoder = server.upload_decoder(shapes, buffers, no_round_yet)
    for chunk in wire.encode_tensors(upload, dtype):
        decoder.feed(chunk)
    received, payloads = server.upload_values(decoder, decoder.finish(), no_round_yet)
    assert payloads == {} and all(received[n] is buffers[n] for n in values)
    for name in values:
        torch.testing.assert_close(received[name].float(), values[name].to(wire.RAW_DTYPES[dtype]).float())
    nan = server.upload_decoder(shapes, {}, no_round_yet)
    with pytest.raises(ValueError, match="'b'"):
        for chunk in wire.encode_tensors({**values, "b": torch.full((5,), float("nan"))}, dtype):
            nan.feed(chunk)
        nan.finish()

    served = server.serve(7, received, None, list(values), {})
    assert (served.round, served.tensors, served.deltas, served.base) == (7, received, {}, None)
    assert server.persisted(served) == {}
    restored = server.restore(7, received, {})
    assert (restored.round, restored.tensors) == (7, received)
    for full in (True, False):
        selection = server.select(served, full=full, base_round=3)
        assert (selection.items, selection.key, selection.whole) == (received, "raw", full)

    info = pb.RoundInfo()
    assert not peer.whole(info) and not peer.forget() and peer.base_round == NO_BASE
    into = {name: torch.empty(shape, dtype=wire.RAW_DTYPES[dtype]) for name, shape in shapes.items()}
    download = peer.decoder(shapes, into)  # into a peer's own buffers
    for chunk in wire.encode_tensors(selection.items, dtype):
        download.feed(chunk)
    got = peer.receive(info, download, caught_up=True)
    assert got.keys() == values.keys() and all(got[n] is into[n] and torch.equal(got[n], received[n]) for n in values)


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_a_download_that_is_not_finite_is_refused_naming_the_server_address(dtype: str) -> None:
    """A spes server publishes only finite rounds: NaN or Inf in a download comes from a damaged or hostile server,
    and would end the node's training in NaN."""
    values = {**trained(), "b": torch.tensor([1.0, float("inf")])}
    download = RawPeer(dtype).decoder({name: tuple(t.shape) for name, t in values.items()}, None)
    with pytest.raises(ValueError, match="'b' holds NaN or Inf values: .*spes_config.server_addr"):
        for chunk in wire.encode_tensors(values, dtype):
            download.feed(chunk)
