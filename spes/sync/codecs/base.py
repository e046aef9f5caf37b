"""What a coded tensor is on the wire: a `Payload` and the `Format` that reads it, and a lossy `Quantizer`.

A coded tensor travels as a `Payload` (its packed bytes and a few integer parameters in its header), which the
receiver rebuilds with the codec's `Format` after checking the header, before a byte is read. Floors: this module
imports only the protocol's vocabulary, so the wire (`spes.sync.wire`) can take a `Format` without importing any
codec; what a whole codec is (its ends, what a round serves) is `spes.sync.codecs.interface`, above the wire.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Protocol

import torch

from spes.sync.protocol import Shape

NO_BASE = -1
"""The base round of a peer or payload that refers to no held model (full values)."""


@dataclass(frozen=True)
class Scattered:
    """A delta that is zero except at `positions` of the flattened tensor, where it is `values`: what a sparse
    codec's payload adds, so that applying it touches only the entries it sent (no dense copy of its zeros)."""

    positions: torch.Tensor
    """int64, strictly increasing."""
    values: torch.Tensor
    """float32, one per position."""


Delta = torch.Tensor | Scattered
"""What a payload adds to a held tensor: dense fp32 of its shape, or `Scattered`."""


class Payload(Protocol):
    """One tensor coded for the wire: its packed bytes and the integer parameters its header carries."""

    name: str
    shape: Shape

    @property
    def codec(self) -> str:
        """The name of the codec that made it (carried in its header)."""
        ...

    @property
    def num_bytes(self) -> int:
        """Bytes on the wire (framing aside)."""
        ...

    def params(self) -> dict[str, int]:
        """The header's parameters: what a receiver needs to size and read the bytes (e.g. int8's block)."""
        ...

    def pack(self) -> torch.Tensor:
        """The wire bytes, a flat uint8 CPU tensor of `num_bytes`."""
        ...


class Format(Protocol):
    """How a receiver reads one codec's payloads; it refuses what it was not configured for."""

    name: str
    """The codec's name, carried in every header of its payloads."""

    def payload_bytes(self, shape: Shape, params: Mapping[str, int]) -> int:
        """Byte count of a payload of `shape` with the header's `params`; ValueError when they are not this
        codec's (checked before any byte is read)."""
        ...

    def unpack(self, name: str, shape: Shape, params: Mapping[str, int], data: torch.Tensor) -> Payload:
        """The payload of received bytes (`payload_bytes` of them, uint8); ValueError when malformed."""
        ...


class Quantizer(Format, Protocol):
    """The lossy part of a held-model codec: a tensor of deltas to a payload and back, deterministically. It reads
    the payloads of both directions; `encode` makes a peer's, `down.encode` the server's."""

    @property
    def down(self) -> Quantizer:
        """The quantizer of the server's deltas (this one, or a wider format of it)."""
        ...

    def encode(self, name: str, x: torch.Tensor) -> Payload:
        """`x` (a float tensor) as a payload; ValueError naming `name` when it holds NaN or Inf."""
        ...

    def decode(self, payload: Payload) -> torch.Tensor:
        """The dense fp32 tensor a payload stands for (of `payload.shape`)."""
        ...

    def delta(self, payload: Payload) -> Delta:
        """What `payload` adds to a held tensor: `decode(payload)`, or only its nonzero entries (`Scattered`)."""
        ...

    def round_bytes(self, numel: int) -> int:
        """Bytes of a payload of `numel` values (for estimates: preflight, benchmarks)."""
        ...
