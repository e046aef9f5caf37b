"""What a codec is: the interfaces the client and the coordinator see, and nothing of any one codec.

A codec decides how a round's tensors travel. `spes.sync.codecs.registry` names them; each codec is one module:
`raw` (fp32 or bf16 values), and the held-model codecs (`held`) over a quantizer (`int8`, `sparse`). The client,
the coordinator and both planes move what a codec makes without asking which one made it:

- a peer's `PeerCodec` turns what it trained into the items it uploads, reads a download and keeps its state
  between rounds (a held model and an error-feedback buffer, say), which a node checkpoint carries;
- the server's `ServerCodec` turns a verified upload into values the round math aggregates (`spes.sync.merge`),
  and a completed round's global model into what every peer downloads (`Served`), and persists its state;
- a coded tensor travels as a `spes.sync.codecs.base.Payload`, read by the codec's `Format`.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass, field
from typing import Protocol

import torch

from spes.sync.codecs.base import NO_BASE, Payload
from spes.sync.proto import spes_pb2 as pb
from spes.sync.protocol import Shape, Tensors
from spes.sync.wire import Item, TensorDecoder


@dataclass(frozen=True)
class Served:
    """What the peers download after a completed round, as a codec made it.

    `tensors`: every tensor a download of full values may send (a raw codec: the global model; a held-model codec:
    the held model every up-to-date peer reconstructs). `deltas`: what a peer holding the served model of round
    `base` downloads instead, per tensor the round changed: a coded payload, or full values for a tensor that model
    did not hold yet (a fragment's first round). Empty, `base` None: every peer gets `tensors`.
    """

    round: int
    tensors: Mapping[str, torch.Tensor]
    deltas: Mapping[str, Item] = field(default_factory=dict)
    base: int | None = None
    deferred: Deferred | None = None
    """Items the codec makes when first read (a download's, or `complete`'s), so the round is published before it
    has made them and their work overlaps the downloads; None when every item is made."""

    def holds(self) -> list[torch.Tensor]:
        """The tensors this round keeps alive, without making any item: those made, and what the rest are made of."""
        if self.deferred is None:
            return list(self.tensors.values())
        later = self.deferred.names
        return [*(self.tensors[n] for n in self.tensors if n not in later), *self.deferred.holds()]

    def complete(self) -> None:
        """Make every deferred item (the closing thread, once the round is published)."""
        if self.deferred is not None:
            self.deferred.complete()


class Deferred(Protocol):
    """What a codec left to make when `Served` items are first read."""

    @property
    def names(self) -> Collection[str]:
        """The tensors whose items are deferred."""
        ...

    def holds(self) -> list[torch.Tensor]:
        """The deferred tensors' made values, and the tensors the others will be made of."""
        ...

    def complete(self) -> None:
        """Make every deferred item."""
        ...


@dataclass(frozen=True)
class Selection:
    """What one download sends: `items` by name (a view of `Served`), the key of its shared encoded form, and
    whether it is every tensor of the model (`whole`) rather than the round's download names."""

    items: Mapping[str, Item]
    key: str
    whole: bool
    base_round: int = NO_BASE


@dataclass(frozen=True)
class UploadBase:
    """What the payloads of one upload apply to: the latest completed round's `served` model (None: no round has
    completed, every payload is refused), its full-precision `global_model`, and the names taken `verbatim` from
    this peer (its own blocks: what it reconstructs is what the round takes)."""

    served: Served | None
    global_model: Mapping[str, torch.Tensor]
    verbatim: Collection[str]


class PeerCodec(Protocol):
    """A peer's end of a codec. `upload` prepares a round (nothing committed: a retry prepares the same bytes);
    `receive` commits it once its download has arrived."""

    raw_dtype: str
    """The dtype raw values travel in ("fp32" or "bf16")."""

    @property
    def base_round(self) -> int:
        """The round of the model this peer holds that deltas apply to (`NO_BASE`: none)."""
        ...

    def upload(self, trained: Mapping[str, torch.Tensor], own: Collection[str]) -> Mapping[str, Item]:
        """The items to send for `trained`, in its order (a codec may make each when it is first read); `own`:
        names this peer does not download outside merge rounds."""
        ...

    def digest(self, trained: Mapping[str, torch.Tensor]) -> int:
        """What tells a retry of the upload of `trained` from another (equal for equal values), known before the
        upload is made, and cheap: the server compares it with the one it committed."""
        ...

    def decoder(self, expected: Mapping[str, Shape], into: dict[str, torch.Tensor] | None) -> TensorDecoder:
        """The decoder of a download of `expected` (`into`: buffers kept across rounds, where the codec allows)."""
        ...

    def whole(self, info: pb.RoundInfo) -> bool:
        """Whether the announced download carries every tensor (full values of a held model); ValueError when it
        announces deltas against a model this peer does not hold."""
        ...

    def receive(
        self, info: pb.RoundInfo, decoder: TensorDecoder, *, caught_up: bool, serves: Collection[str] | None = None
    ) -> Tensors:
        """Commit the round from its finished download; what the node loads: the tensors the round served (a
        held-model codec: their held values, and this peer's own uploaded blocks as reconstructed; with full values
        every tensor, but only `serves` when this peer took part in the round with a held model). `serves`: the
        tensors a download of this peer's round carries (None: every tensor downloaded, a catch-up)."""
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
        self, expected: Mapping[str, Shape], into: dict[str, torch.Tensor], base: UploadBase
    ) -> TensorDecoder:
        """The decoder of one upload into kept buffers, turning each payload into values as it arrives."""
        ...

    def upload_values(
        self, decoder: TensorDecoder, raw: Tensors, base: UploadBase
    ) -> tuple[Tensors, dict[str, Payload]]:
        """What the round math counts as the finished upload (`raw` values plus its applied payloads), and the
        payloads of the names taken verbatim, which downloads may relay unchanged."""
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
