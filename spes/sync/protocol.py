"""The SPES protocol's vocabulary, shared by the server, both planes and the client.

Everything both ends must agree on, and nothing that moves bytes: the protocol version, the machine-readable
reasons a refusal carries (trailing metadata `spes-reason` over gRPC, the error frame's `reason` over the raw-TCP
data plane), the errors on either side, and the type aliases of the sync wing. It imports nothing of the sync
wing (nor the generated messages), so every other module may import it. protos/spes.proto describes the messages.
"""

from __future__ import annotations

import enum
import sys
from typing import TYPE_CHECKING, Literal

import grpc

if TYPE_CHECKING:
    import torch

PROTOCOL_VERSION = 6
"""6: a run spec in every Join (`spes.sync.spec`) and codecs on the wire (`spes.sync.codecs`); 5: rounds over
fragments of the model (`spes.sync.fragments`); 4: the data plane's control frames are protobuf messages of
protos/spes.proto; 3: XXH3-64 checksums (data-plane frames JSON); 2: CRC-32C; before it (unversioned): zlib CRC-32."""
REASON_KEY = "spes-reason"
"""The gRPC trailing-metadata key that carries a refusal's `Reason`."""
PROBE_MAX_BYTES = 256 << 20
"""Most bytes a link test (`python -m spes.preflight`, either plane) moves each way."""
PROBE_CHUNK_BYTES = 1 << 20

Mode = Literal["spes", "diloco"]
"""The run modes that meet a parameter server (`spes.config.RunMode` less `centralized`)."""
Shape = tuple[int, ...]
Tensors = dict[str, "torch.Tensor"]  # NOTE: a name, not torch itself: spes.status imports this module, not torch
"""Tensors by parameter name (an upload, a download, a global model)."""
Manifest = dict[str, Shape]
"""Every tensor of the model: name -> shape."""


if sys.version_info >= (3, 11):
    from enum import StrEnum
else:  # Python 3.10 (requires-python) has no enum.StrEnum

    class StrEnum(str, enum.Enum):
        """`enum.StrEnum` for Python 3.10: members are strings whose str() and format() are their values."""

        def __str__(self) -> str:
            return str(self.value)


class Reason(StrEnum):
    """Why the server refused a request, when the client can react to it on its own (see protos/spes.proto).

    NONE: the details say what a person must do; the client only reports them.
    """

    NONE = ""
    NOT_JOINED = "not_joined"
    """The server does not know this peer (e.g. it restarted): join again, then retry."""
    UNKNOWN_ROUND = "unknown_round"
    """A download of a round the server holds no upload of this peer for (lost in a restart): upload again."""
    STALE_ROUND = "stale_round"
    """The run has moved past this round: load the latest global model (a full download)."""
    FUTURE_ROUND = "future_round"
    """An upload for a round ahead of the open one (peers disagree on sync_steps)."""
    CORRUPT = "corrupt"
    """A chunk failed its checksum (damaged in transit): send it again."""
    ROUND_TIMEOUT = "round_timeout"
    """The round did not complete within --round_timeout (the details name the missing peers)."""
    BUSY = "busy"
    """The server is at a limit for now (a round aggregating, its stream slots full): retry shortly."""
    DUPLICATE_PEER = "duplicate_peer"
    """Another live process holds this peer id: retried, admitted once that one has been silent long enough."""
    SUPERSEDED = "superseded"
    """A newer process joined with this peer id: this one must stop."""
    UNAUTHENTICATED = "unauthenticated"
    """The data plane's handshake carried no or a wrong token."""
    OLD_SERVER = "old_server"
    """The server predates preflight and took a dry join as a real one."""
    WRONG_PROTOCOL = "wrong_protocol"
    """The peer speaks another protocol version (`version_refusal`): run the same spes version everywhere."""
    BASE_MISMATCH = "base_mismatch"
    """A coded payload against a held model other than the receiver's: send full values instead."""
    OTHER_RUN = "other_run"
    """The node belongs to another run than the server holds, or starts fresh against one in progress."""
    SHUTTING_DOWN = "shutting_down"
    """The server is stopping (UNAVAILABLE): wait for it to come back (then join again); no reason to leave a plane."""


RETRY_REASONS = frozenset({Reason.CORRUPT, Reason.BUSY, Reason.DUPLICATE_PEER})
"""Refusals worth the same request again later: damaged bytes, a server at its limits, and a peer id still held
by a process that may have died (admitted once it has been silent for --peer_liveness)."""
RETRYABLE_CODES = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED})


class Refused(Exception):
    """A request the server turns down: the gRPC status, a message saying what to do, and a `Reason`."""

    def __init__(self, code: grpc.StatusCode, message: str, reason: Reason = Reason.NONE) -> None:
        super().__init__(message)
        self.code, self.reason = code, Reason(reason)


def shutting_down() -> Refused:
    """The refusal of an Upload or Download (either plane) by a server that has begun to stop: retried with backoff
    until the server is back, its restarted self then asks for a new Join."""
    return Refused(
        grpc.StatusCode.UNAVAILABLE,
        "the parameter server is shutting down: nodes retry until it is back",
        Reason.SHUTTING_DOWN,
    )


def version_refusal(who: str, version: int) -> Refused:
    """The refusal of a peer that speaks protocol `version` (on either plane), naming both versions."""
    return Refused(
        grpc.StatusCode.FAILED_PRECONDITION,
        f"{who} speaks wire protocol v{version} but this server speaks v{PROTOCOL_VERSION}: "
        "run the same spes version on the server and every node",
        Reason.WRONG_PROTOCOL,
    )


class SyncError(RuntimeError):
    """A synchronization call failed on the client; `code` is the gRPC status (None for client-side checks).

    `reason` is the server's `Reason` (NONE if it gave none); `retryable` says whether sending the same request
    again may succeed.
    """

    def __init__(
        self,
        message: str,
        code: grpc.StatusCode | None = None,
        *,
        reason: Reason | str = Reason.NONE,
        retryable: bool = False,
    ) -> None:
        super().__init__(message)
        self.code, self.retryable = code, retryable
        self.reason = reason_of(str(reason))


def reason_of(text: str) -> Reason:
    """A reason received from the other end; one this version does not know counts as NONE."""
    try:
        return Reason(text)
    except ValueError:
        return Reason.NONE


def classify(what: str, code: grpc.StatusCode, details: str, reason: str) -> SyncError:
    """A refusal from either plane as a SyncError: transient codes and the `RETRY_REASONS` are retryable."""
    known = reason_of(reason)
    retryable = (code in RETRYABLE_CODES and known != Reason.ROUND_TIMEOUT) or known in RETRY_REASONS
    return SyncError(f"{what} failed ({code.name}): {details}", code, reason=known, retryable=retryable)
