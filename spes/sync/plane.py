"""The interface both transports implement on the client: how a peer's tensor payloads travel to the server.

`spes.sync.plane_grpc.GrpcPlane` (gRPC streams) and `spes.sync.plane_tcp.TcpPlane` (the raw-TCP data plane): same
rounds, same checks, same reasons, so the client's retry, re-join and catch-up logic treats both alike.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Protocol

from spes.sync.proto import spes_pb2 as pb
from spes.sync.protocol import Tensors
from spes.sync.wire import Item, TensorDecoder


class Plane(Protocol):
    """How a client's tensor payloads travel to and from the server: `spes.sync.plane_grpc.GrpcPlane` (gRPC
    streams) or `spes.sync.plane_tcp.TcpPlane` (the raw-TCP data plane). Same rounds, same checks, same reasons:
    every failure is a `SyncError`, retryable when sending the same request again may succeed."""

    name: str
    """"grpc" or "tcp"."""

    def upload(
        self, step: int, tensors: Mapping[str, Item], timeout: float, fragment: int = 0, *, digest: int
    ) -> tuple[int, bool]:
        """Send this peer's upload of round `step` (values, or coded payloads, each read once, in order) over
        `fragment` of the model (0: all of it, `spes.sync.fragments`): (payload bytes sent, whether the server
        already had it). `digest` tells a retry from another upload (the codec's `PeerCodec.digest`)."""
        ...

    def download(
        self,
        step: int,
        timeout: float,
        *,
        full: bool,
        base_round: int,
        decoder_for: Callable[[pb.RoundInfo], TensorDecoder],
    ) -> tuple[pb.RoundInfo, Tensors, int]:
        """Wait for round `step` and receive it: (its RoundInfo, the raw tensors, payload bytes received).

        `decoder_for(info)` checks the announced round and returns the decoder of the tensors that must follow (its
        manifest and buffers; coded payloads land in its `coded`); `base_round` is the round of the held model this
        peer holds (`spes.sync.codecs.base.NO_BASE`: none).
        """
        ...

    def probe(self, num_bytes: int) -> tuple[float, float]:
        """Link test: (seconds to send `num_bytes`, seconds to receive as many back); counted nowhere."""
        ...
