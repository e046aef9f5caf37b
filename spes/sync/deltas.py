"""Int8 deltas in a round (`spes_config.wire_dtype: int8`): what the server and each peer hold, send and keep.

Both ends hold H, the *held model*: the global model as every up-to-date peer has it, bit for bit, tagged with
the round it is of. The server keeps its global model G in full precision beside it. A round (the math is
`spes.sync.compress`; docs/sync_next.md has the design and the byte figures):

1. A peer sends what it trains as int8 deltas against its H, with error feedback (`PeerDeltas.upload`), each
   tagged with H's round; a peer holding no H (joined late, caught up, restarted) sends full values (fp32).
2. The server refuses a delta against another base (`spes.sync.wire.BaseMismatch`, reason `base_mismatch`: the
   peer then sends full values) and turns the others into values (`compress.upload_values`: the peer's own
   blocks `H + delta`, averaged tensors `G + delta`), which aggregate as on any wire.
3. After the round the server makes the new held model and the deltas every up-to-date peer downloads
   (`next_held`): verbatim blocks relayed as uploaded, everything else `G_new - H` quantized.
4. A peer holding the H those deltas apply to reconstructs the new one (`PeerDeltas.receive`: what it downloads
   `apply_delta(H, delta)`, its own blocks outside merge rounds its own upload's reconstruction); any other peer
   gets full values of the new H. Either way every peer then holds the server's H, and loads it.

Nothing of it is in a node's checkpoint: a resumed node holds no H and gets full values once.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass

import torch

from spes.sync.compress import DEFAULT_BLOCK, Int8Payload, apply_delta, download_payloads, encode_deltas
from spes.sync.proto import spes_pb2 as pb
from spes.sync.protocol import Shape, Tensors
from spes.sync.wire import Delta, Item, TensorDecoder

NO_BASE = -1
"""The base round of a peer that holds no model (it gets full values)."""


@dataclass(frozen=True)
class HeldRound:
    """The server's held model after round `round`, and the deltas that take the peers there."""

    round: int
    tensors: Tensors
    """H: the model every up-to-date peer holds after this round, bit for bit (fp32)."""
    deltas: dict[str, Delta]
    """Per tensor, what a peer holding the held model of round `base` downloads (empty when `base` is None)."""
    base: int | None
    """The round of the held model the deltas apply to; None: every peer gets full values of `tensors`."""


def next_held(
    step: int,
    new_global: Tensors,
    previous: HeldRound | None,
    relayed: Mapping[str, Int8Payload],
    block: int = DEFAULT_BLOCK,
) -> HeldRound:
    """The held model of round `step` from its global model (`compress.download_payloads` against `previous`).

    `relayed`: the uploaded payloads of blocks taken verbatim in this round (none on merge rounds). Without a
    previous held model (the first round, or a restarted server that persisted none) the held model is the
    global model itself, and every peer gets it as full values.
    """
    if previous is None:
        return HeldRound(step, dict(new_global), {}, None)
    payloads, held = download_payloads(new_global, previous.tensors, relayed, block)
    return HeldRound(step, held, {n: Delta(p, previous.round) for n, p in payloads.items()}, previous.round)


class PeerDeltas:
    """A peer's side: its held model, that model's round, the carried upload error, and the upload in flight.

    `upload` prepares a round's upload (nothing is committed: a retry prepares the very same bytes); `receive`
    commits the round once its download has arrived. The held tensors are the peer's own: the caller loads them
    into its parameters and must not change them.
    """

    def __init__(self, block: int = DEFAULT_BLOCK) -> None:
        self.block = block
        self.held: Tensors = {}
        self.round: int | None = None
        self.carried: Tensors = {}
        """Per trained tensor, what quantization left out of the last upload (added to the next delta)."""
        self._pending: tuple[Tensors, Tensors] = ({}, {})
        """The upload in flight: its carried error, and the reconstructions of the tensors it may not download."""

    @property
    def base_round(self) -> int:
        """The round of the held model (`NO_BASE` when none)."""
        return NO_BASE if self.round is None else self.round

    def upload(self, trained: Mapping[str, torch.Tensor], own: Collection[str]) -> dict[str, Item]:
        """What to send for `trained`: int8 deltas against the held model, or full values when there is none.

        `own`: the names this peer does not download outside merge rounds (its expert blocks), whose new held
        values are its own reconstructions.
        """
        if self.round is None:
            self._pending = ({}, {})
            return dict(trained)
        sent = encode_deltas(trained, self.held, self.carried, self.block)
        self._pending = ({n: s.error for n, s in sent.items()}, {n: sent[n].reconstruction for n in own})
        return {n: Delta(s.payload, self.round) for n, s in sent.items()}

    def forget(self) -> None:
        """Drop the held model and the carried error (the server holds another base): the next upload is full."""
        self.held, self.round, self.carried = {}, None, {}

    def decoder(self, expected: Mapping[str, Shape]) -> TensorDecoder:
        """The decoder of a download: deltas against the held model, or full values (into fresh tensors, which
        become the held model)."""
        return TensorDecoder(expected, "fp32", delta_base=self.base_round)

    def receive(self, info: pb.RoundInfo, values: Tensors, deltas: Mapping[str, Delta], *, caught_up: bool) -> Tensors:
        """Commit round `info.round` from its download (full `values`, or `deltas` against the held model): the
        new held model, every tensor of it. A peer that caught up drops its carried error (its upload was not
        taken); otherwise the upload's becomes the carried one."""
        if info.base_round == NO_BASE:
            held = dict(values)
        else:
            own = self._pending[1]
            missing = sorted(set(self.held) - set(deltas) - set(own))
            if info.base_round != self.round or missing:
                raise ValueError(
                    f"round {info.round}: deltas against round {info.base_round} for a peer holding round "
                    f"{self.base_round}, or without tensors {missing[:5]}"
                )
            held = {n: apply_delta(base, deltas[n].payload) if n in deltas else own[n] for n, base in self.held.items()}
        self.held, self.round = held, info.round
        self.carried = {} if caught_up else self._pending[0]
        self._pending = ({}, {})
        return held
