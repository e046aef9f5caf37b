"""The codec registry: how tensors travel in a round (`spes_config.codec` and `spes_config.codec_settings`).

A codec is chosen run-wide in the run spec (`spes.sync.spec`); the client, the coordinator and both planes use it
through the interfaces of `spes.sync.codecs.base` and never branch on which one it is. Adding a codec is its own
module, its tests, one line in `REGISTRY` below and its name in `spes.config.CodecName` (what a config accepts, checked
as it loads without importing torch):

- `fp32`, `bf16`: raw values (`spes.sync.codecs.raw`);
- `int8`: blockwise int8 deltas against the held model with error feedback (`int8` over `held`);
- `sparse`: per chunk, the top-k of the delta plus error feedback, in a few bits, indices packed (`sparse` over
  `held`), at most about 1 bit per parameter and round.
"""

from __future__ import annotations

import dataclasses
import difflib
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from functools import partial

from spes.sync.codecs import int8, sparse
from spes.sync.codecs.base import Quantizer
from spes.sync.codecs.held import VALUES_DTYPE, HeldPeer, HeldServer
from spes.sync.codecs.interface import PeerCodec, ServerCodec
from spes.sync.codecs.raw import RawPeer, RawServer
from spes.sync.wire import RAW_DTYPES


@dataclass(frozen=True)
class Codec:
    """One run's codec with its settings: it builds each end and says what a round moves."""

    name: str
    settings: dict[str, int]
    """Every setting, defaults filled in (what the run spec carries and a join compares)."""
    peer: Callable[[], PeerCodec]
    server: Callable[[], ServerCodec]
    round_bytes: Callable[[int], int]
    """Bytes a tensor of n values moves up in a round once both ends hold a model (the steady state); as much down
    for a block relayed from its owner."""
    down_bytes: Callable[[int], int]
    """Bytes of the server's delta of a tensor of n values it re-encodes (averaged tensors, merged blocks)."""
    full_bytes: Callable[[int], int]
    """Bytes of a tensor of n values sent as full values (a held-model codec's first round, a catch-up)."""


def raw_codec(dtype: str, settings: dict[str, int]) -> Codec:
    """Values as `dtype` every way (a raw codec takes no `settings`): n values are n * itemsize bytes up, down and in
    full."""
    count = RAW_DTYPES[dtype].itemsize.__mul__
    return Codec(dtype, {}, lambda: RawPeer(dtype), lambda: RawServer(dtype), count, count, count)


def held_codec(make: type, settings: dict[str, int]) -> Codec:
    """Deltas against the held model in the format of quantizer `make(**settings)`: up in its format, down in its
    `down` format, full values as fp32 (`VALUES_DTYPE`)."""
    quantizer: Quantizer = make(**settings)
    filled = {f.name: getattr(quantizer, f.name) for f in dataclasses.fields(quantizer) if f.name != "name"}  # type: ignore[arg-type]
    return Codec(
        quantizer.name,
        filled,
        lambda: HeldPeer(quantizer),
        lambda: HeldServer(quantizer),
        quantizer.round_bytes,
        quantizer.down.round_bytes,
        RAW_DTYPES[VALUES_DTYPE].itemsize.__mul__,
    )


REGISTRY: dict[str, tuple[type | None, Callable[[dict[str, int]], Codec]]] = {
    "fp32": (None, partial(raw_codec, "fp32")),
    "bf16": (None, partial(raw_codec, "bf16")),
    "int8": (int8.Int8, partial(held_codec, int8.Int8)),
    "sparse": (sparse.Sparse, partial(held_codec, sparse.Sparse)),
}
"""name -> (the settings dataclass, None for a codec without settings; the builder)."""


def build_codec(name: str, settings: Mapping[str, int] | None = None) -> Codec:
    """The codec `name` with `settings` (missing ones take the codec's defaults); ValueError naming the key
    (`spes_config.codec` or `spes_config.codec_settings.<key>`) and what is allowed."""
    if name not in REGISTRY:
        raise ValueError(f"config key 'spes_config.codec' = {name!r} is not a codec: use one of {sorted(REGISTRY)}")
    kind, build = REGISTRY[name]
    valid = [] if kind is None else [f.name for f in dataclasses.fields(kind) if f.name != "name"]
    for key, value in (settings or {}).items():
        if key not in valid:
            close = difflib.get_close_matches(key, valid, n=1)
            hint = f"; did you mean '{close[0]}'?" if close else f"; the {name} codec takes {valid or 'none'}"
            raise ValueError(f"unknown config key 'spes_config.codec_settings.{key}'{hint}")
        if not isinstance(value, int) or isinstance(value, bool):
            raise ValueError(f"config key 'spes_config.codec_settings.{key}' = {value!r} must be an integer")
    return build(dict(settings or {}))
