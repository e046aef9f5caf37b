"""How a client retries: exponential backoff with jitter for transient failures, repairs for the rest, deadlines.

A call is retried when sending the same request again may succeed (`SyncError.retryable`: an unreachable or stopping
server, a deadline, damaged bytes, a busy server); a `recover` hook may repair the cause of another failure (join again,
upload again) and have the call tried at once. Every wait respects the round's deadline.
"""

from __future__ import annotations

import logging
import math
import random
import time
from collections.abc import Callable
from typing import TypeVar

import grpc

from spes.sync.plane_grpc import failure_of
from spes.sync.protocol import Reason, SyncError

log = logging.getLogger("spes.client")
T = TypeVar("T")

BACKOFF_BASE_S = 0.5
BACKOFF_CAP_S = 30.0
MAX_RECOVERIES = 4
DUPLICATE_WAIT_S = 15.0
"""How long a join refused because a live process holds its peer id is retried: a dead process's claim ends as soon
as its connection closes (or after the server's --peer_liveness, 10 s, for a client without a presence stream); a
live one's never does, and the node then stops at once with the server's line."""


def backoff_s(attempt: int) -> float:
    """Exponential backoff with jitter: uniform in [d/2, d] with d = min(cap, base * 2**attempt)."""
    delay = min(BACKOFF_CAP_S, BACKOFF_BASE_S * 2**attempt)
    return random.uniform(delay / 2, delay)


def time_left(deadline: float, round_timeout_s: float) -> float:
    """Seconds until `deadline` (time.monotonic()); SyncError DEADLINE_EXCEEDED once it has passed."""
    left = deadline - time.monotonic()
    if left <= 0:
        raise SyncError(
            f"the round did not finish within round_timeout_s={round_timeout_s}", grpc.StatusCode.DEADLINE_EXCEEDED
        )
    return left


def retrying(
    what: str,
    attempt: Callable[[float], T],
    *,
    max_retries: int,
    per_attempt_s: float | None = None,
    deadline: tuple[float, float] | None = None,
    recover: Callable[[SyncError], bool] | None = None,
    refusal: Callable[[], str | None] | None = None,
    closed: Callable[[], bool] | None = None,
) -> T:
    """Run `attempt(timeout)`; retry transient failures up to `max_retries` times with backoff before `deadline`
    (time.monotonic(), and the round timeout it stands for, for the message).

    `recover(failure)` may repair the cause of a non-transient failure and return True to try again at once (at
    most MAX_RECOVERIES times). A gRPC error becomes a `SyncError` naming `what` (`failure_of`, with `refusal`:
    what a server that hung up meant, when it refused the client's certificate; `closed`: whether the client closed
    its channel, so that a call cancelled then is not retried).
    """
    failures = recoveries = 0
    duplicate_since: float | None = None
    while True:
        timeout = per_attempt_s if per_attempt_s is not None else math.inf
        if deadline is not None:
            timeout = min(timeout, time_left(*deadline))
        try:
            return attempt(timeout)
        except grpc.RpcError as err:
            failure = failure_of(what, err, refusal, closed)
        except SyncError as err:
            failure = err
        if recover is not None and recoveries < MAX_RECOVERIES and recover(failure):
            recoveries += 1
            continue
        if failure.reason == Reason.DUPLICATE_PEER:
            duplicate_since = duplicate_since or time.monotonic()
            if time.monotonic() - duplicate_since > DUPLICATE_WAIT_S:
                raise failure
        if not failure.retryable or failures >= max_retries:
            raise failure
        delay = backoff_s(failures)
        if deadline is not None:
            delay = min(delay, max(0.0, deadline[0] - time.monotonic()))
        failures += 1
        log.warning("%s; retry %d/%d in %.1f s", failure, failures, max_retries, delay)
        time.sleep(delay)
