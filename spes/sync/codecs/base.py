"""What a codec is: the interfaces the client, the coordinator and the wire see, and nothing of any one codec.

A codec decides how a round's tensors travel. `spes.sync.codecs` holds the registry; each codec is one module:
`raw` (fp32 or bf16 values), and the held-model codecs (`held`) over a quantizer (`int8`, `sparse`). The client,
the coordinator and both planes move what a codec makes without asking which one made it:

- a peer's `PeerCodec` turns what it trained into the items it uploads, reads a download and keeps its state
  between rounds (a held model and an error-feedback buffer, say), which a node checkpoint carries;
- the server's `ServerCodec` turns a verified upload into values the round math aggregates (`spes.sync.merge`),
  and a completed round's global model into what every peer downloads (`Served`), and persists its state;
- a coded tensor travels as a `Payload` (its packed bytes and a few integer parameters in its header), which the
  receiver rebuilds with the codec's `Format` after checking the header, before a byte is read.

Floors: this module imports only the protocol's vocabulary, so the wire (`spes.sync.wire`) can take a `Format`
without importing any codec.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

import torch

from spes.sync.protocol import Shape, Tensors

if TYPE_CHECKING:
    from spes.sync.proto import spes_pb2 as pb
    from spes.sync.wire import Item, TensorDecoder

NO_BASE = -1
"""The base round of a peer or payload that refers to no held model (full values)."""


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
    """The lossy part of a held-model codec: a tensor of deltas to a payload and back, deterministically."""

    def encode(self, name: str, x: torch.Tensor) -> Payload:
        """`x` (a float tensor) as a payload; ValueError naming `name` when it holds NaN or Inf."""
        ...

    def decode(self, payload: Payload) -> torch.Tensor:
        """The dense fp32 tensor a payload stands for (of `payload.shape`)."""
        ...

    def round_bytes(self, numel: int) -> int:
        """Bytes of a payload of `numel` values (for estimates: preflight, benchmarks)."""
        ...


@dataclass(frozen=True)
class Served:
    """What the peers download after a completed round, as a codec made it.

    `tensors`: every tensor a download of full values may send (a raw codec: the global model; a held-model codec:
    the held model every up-to-date peer reconstructs). `deltas`: what a peer holding the served model of round
    `base` downloads instead, per tensor the round changed: a coded payload, or full values for a tensor that model
    did not hold yet (a fragment's first round). Empty, `base` None: every peer gets `tensors`.
    """

    round: int
    tensors: Tensors
    deltas: dict[str, Item] = field(default_factory=dict)
    base: int | None = None


@dataclass(frozen=True)
class Selection:
    """What one download sends: `items` by name (a view of `Served`), the key of its shared encoded form, and
    whether it is every tensor of the model (`whole`) rather than the round's download names."""

    items: Mapping[str, Item]
    key: str
    whole: bool
    base_round: int = NO_BASE


class PeerCodec(Protocol):
    """A peer's end of a codec. `upload` prepares a round (nothing committed: a retry prepares the same bytes);
    `receive` commits it once its download has arrived."""

    raw_dtype: str
    """The dtype raw values travel in ("fp32" or "bf16")."""

    @property
    def base_round(self) -> int:
        """The round of the model this peer holds that deltas apply to (`NO_BASE`: none)."""
        ...

    def upload(self, trained: Mapping[str, torch.Tensor], own: Collection[str]) -> dict[str, Item]:
        """The items to send for `trained`; `own`: names this peer does not download outside merge rounds."""
        ...

    def decoder(self, expected: Mapping[str, Shape], into: dict[str, torch.Tensor] | None) -> TensorDecoder:
        """The decoder of a download of `expected` (`into`: buffers kept across rounds, where the codec allows)."""
        ...

    def whole(self, info: pb.RoundInfo) -> bool:
        """Whether the announced download carries every tensor (full values of a held model); ValueError when it
        announces deltas against a model this peer does not hold."""
        ...

    def receive(self, info: pb.RoundInfo, decoder: TensorDecoder, *, caught_up: bool) -> Tensors:
        """Commit the round from its finished download; what the node loads (a held-model codec: every tensor)."""
        ...

    def forget(self) -> bool:
        """Drop state the server no longer shares (it holds another base); False when there was none."""
        ...

    def state_dict(self) -> tuple[dict[str, str], Tensors]:
        """The state a checkpoint keeps (metadata, tensors); empty for a stateless codec."""
        ...

    def load_state_dict(self, metadata: Mapping[str, str], tensors: Tensors) -> None:
        """Restore `state_dict`'s output (ValueError naming what does not fit)."""
        ...


class ServerCodec(Protocol):
    """The server's end of a codec, called by the coordinator under the rules of `spes.sync.rounds`."""

    raw_dtype: str
    """The dtype raw uploads arrive in (their buffers' dtype)."""

    def upload_decoder(
        self, expected: Mapping[str, Shape], into: dict[str, torch.Tensor], served: Served | None
    ) -> TensorDecoder:
        """The decoder of one upload into kept buffers; `served`: the latest completed round's (deltas apply to it)."""
        ...

    def upload_values(
        self,
        decoder: TensorDecoder,
        raw: Tensors,
        verbatim: Collection[str],
        global_model: Mapping[str, torch.Tensor],
        served: Served | None,
    ) -> tuple[Tensors, dict[str, Payload]]:
        """What the round math counts as the upload (`raw` values plus decoded payloads), and the payloads of the
        names taken `verbatim` from this peer, which downloads may relay unchanged."""
        ...

    def serve(
        self,
        step: int,
        global_model: Tensors,
        previous: Served | None,
        names: Collection[str],
        relayed: Mapping[str, Payload],
    ) -> Served:
        """What round `step` serves: `names` are the tensors the round changed (others keep their served values)."""
        ...

    def select(self, served: Served, *, full: bool, base_round: int) -> Selection:
        """What a download by a peer holding the model of `base_round` gets (`full`: every tensor, a catch-up)."""
        ...

    def persisted(self, served: Served) -> Tensors:
        """The tensors of `served` a restarted server needs beyond the global model (empty for a raw codec)."""
        ...

    def restore(self, step: int, global_model: Tensors, persisted: Tensors) -> Served:
        """`Served` of a restored round from the global model and `persisted`."""
        ...
