"""The codec registry (spes.sync.codecs.registry): a codec by name with its settings, what it builds and what a
round of it moves, and the refusals of a name or a setting it does not take."""

from __future__ import annotations

import pytest

from spes.config import CODECS
from spes.sync.codecs import int8, sparse
from spes.sync.codecs.held import HeldPeer, HeldServer
from spes.sync.codecs.raw import RawPeer, RawServer
from spes.sync.codecs.registry import REGISTRY, build_codec


@pytest.mark.parametrize(("name", "size"), [("fp32", 4), ("bf16", 2)])
def test_a_raw_codec_moves_its_dtype_every_way_and_takes_no_settings(name: str, size: int) -> None:
    codec = build_codec(name)
    assert (codec.name, codec.settings) == (name, {})
    assert (codec.round_bytes(10), codec.down_bytes(10), codec.full_bytes(10)) == (10 * size,) * 3
    peer, server = codec.peer(), codec.server()
    assert isinstance(peer, RawPeer) and isinstance(server, RawServer)
    assert peer is not codec.peer()  # a fresh end each time


def test_int8_fills_its_defaults_and_moves_blockwise_deltas_and_full_fp32_values() -> None:
    codec = build_codec("int8")
    assert codec.settings == {"block": int8.DEFAULT_BLOCK}
    assert codec.round_bytes(1000) == codec.down_bytes(1000) == int8.payload_bytes(1000, int8.DEFAULT_BLOCK)
    assert codec.full_bytes(1000) == 4000  # a held-model codec's first round: fp32 values
    peer, server = codec.peer(), codec.server()
    assert isinstance(peer, HeldPeer) and isinstance(server, HeldServer) and codec.name == "int8"
    assert peer.quantizer == server.quantizer == int8.Int8()  # both ends in the run's format
    assert build_codec("int8", {"block": 512}).round_bytes(1000) == int8.payload_bytes(1000, 512)


def test_sparse_sends_up_in_its_format_and_down_in_the_servers() -> None:
    codec = build_codec("sparse", {"topk": 32})
    defaults = sparse.Sparse()
    assert codec.name == "sparse" and codec.peer().quantizer == codec.server().quantizer == sparse.Sparse(topk=32)
    assert codec.settings == {
        "chunk": defaults.chunk,
        "topk": 32,
        "bits": defaults.bits,
        "down_topk": defaults.down_topk,
        "down_bits": defaults.down_bits,
    }
    n = 3 * defaults.chunk + 5
    assert codec.round_bytes(n) == sparse.payload_bytes(n, defaults.chunk, 32, defaults.bits)
    assert codec.down_bytes(n) == sparse.payload_bytes(n, defaults.chunk, defaults.down_topk, defaults.down_bits)


def test_the_registry_is_the_four_codecs_a_config_accepts() -> None:
    assert sorted(REGISTRY) == ["bf16", "fp32", "int8", "sparse"]
    assert list(REGISTRY) == list(CODECS)  # spes.config's names, which refuse another codec as a config loads


@pytest.mark.parametrize(
    ("name", "settings", "message"),
    [
        (
            "zip",
            None,
            "config key 'spes_config.codec' = 'zip' is not a codec: use one of ['bf16', 'fp32', 'int8', 'sparse']",
        ),
        ("sparse", {"topkk": 8}, "unknown config key 'spes_config.codec_settings.topkk'; did you mean 'topk'?"),
        ("int8", {"zzz": 8}, "unknown config key 'spes_config.codec_settings.zzz'; the int8 codec takes ['block']"),
        ("bf16", {"block": 8}, "unknown config key 'spes_config.codec_settings.block'; the bf16 codec takes none"),
        ("int8", {"block": 8.0}, "config key 'spes_config.codec_settings.block' = 8.0 must be an integer"),
        ("int8", {"block": True}, "config key 'spes_config.codec_settings.block' = True must be an integer"),
    ],
)
def test_a_codec_or_setting_it_does_not_take_is_refused_naming_the_key(
    name: str, settings: dict | None, message: str
) -> None:
    with pytest.raises(ValueError) as err:
        build_codec(name, settings)
    assert str(err.value) == message
