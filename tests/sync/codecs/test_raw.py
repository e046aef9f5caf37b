"""Tests for spes.sync.codecs.raw: the stateless fp32/bf16 codecs' ends."""

from __future__ import annotations

import pytest
import torch

from spes.sync import wire
from spes.sync.codecs.raw import RawPeer, RawServer


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
