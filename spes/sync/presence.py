"""A joined client's presence: one health Watch stream carrying its session, held open while it lives.

The server takes the stream for proof that this process still acts as its peer id: a second process claiming the
id is refused while it is open (`spes.sync.admission.Sessions`), and admitted once it ends (at once when this
process dies, its kernel closing the socket; within the keepalive time when its host or network goes away).
"""

from __future__ import annotations

import logging
import threading

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

log = logging.getLogger("spes.client")

RETRY_S = 1.0
"""A broken presence stream is reopened this soon."""
REFUSED_RETRY_MAX_S = 30.0
"""A refused one (the server holds another run) is reopened ever later, the wait doubling up to this: a process
left over from an earlier run knocks on the new run's server seldom, yet still finds its own run's server back."""
SEEN_WAIT_S = 5.0
"""How long a join waits for the server to have seen the stream (then a close is seen as one)."""
SERVICE = "spes.v1.ParameterServer"


def retry_wait(refusals: int) -> float:
    """Seconds before a stream is reopened after `refusals` refusals in a row (0: it broke):
    min(RETRY_S * 2^(refusals - 1), REFUSED_RETRY_MAX_S)."""
    return min(RETRY_S * 2.0 ** min(max(refusals - 1, 0), 16), REFUSED_RETRY_MAX_S)


class Presence:
    """The presence stream of peer `peer_id` on `channel`, reopened whenever it breaks until `close`."""

    def __init__(self, channel: grpc.Channel, metadata: tuple[tuple[str, str], ...], peer_id: int) -> None:
        self._health, self._metadata, self.peer_id = health_pb2_grpc.HealthStub(channel), metadata, peer_id
        self._closed, self._seen = threading.Event(), threading.Event()
        self._call: grpc.Future | None = None
        self._refused: str | None = None
        """The last refusal said (each is said once)."""
        self._thread = threading.Thread(target=self._keep, name=f"spes-presence-{peer_id}", daemon=True)

    def start(self, wait_s: float) -> None:
        """Open the stream and wait (at most `wait_s`) until the server has seen it: until then it holds the id for
        --peer_liveness after a close."""
        self._thread.start()
        self._seen.wait(min(wait_s, SEEN_WAIT_S))

    def close(self, timeout_s: float) -> None:
        self._closed.set()
        if self._call is not None:
            self._call.cancel()
        if self._thread.is_alive():
            self._thread.join(timeout=timeout_s)

    def _keep(self) -> None:
        refusals = 0
        while not self._closed.is_set():
            call = self._health.Watch(health_pb2.HealthCheckRequest(service=SERVICE), metadata=self._metadata)
            self._call = call
            if self._closed.is_set():
                call.cancel()
            refused = False
            try:
                for _ in call:
                    self._seen.set()
            except grpc.RpcError as err:
                refused = self._ended(err)
            refusals = refusals + 1 if refused else 0
            self._closed.wait(retry_wait(refusals))

    def _ended(self, err: grpc.RpcError) -> bool:
        """Whether the server refused the stream. A broken stream is normal (a restart, the network); a refused one
        (the server now holds another run) is said once, with the server's words, since this process's next call
        will be refused too."""
        if err.code() != grpc.StatusCode.FAILED_PRECONDITION:
            log.debug("presence stream of peer %d ended: %s", self.peer_id, err.code())
            return False
        if err.details() != self._refused:
            self._refused = err.details()
            log.warning("the server refused peer %d's presence stream: %s", self.peer_id, err.details())
        return True
