"""How a client retries (`spes.sync.retry`), on its own: backoff, which failures are retried and how often, repairs
tried at once, the round's deadline (which time the process did not run does not use up), and a peer id held by
another process."""

from __future__ import annotations

import math
from collections.abc import Callable

import grpc
import pytest

from spes.sync import retry
from spes.sync.protocol import Reason, SyncError, classify
from spes.sync.retry import MAX_RECOVERIES, Deadline, backoff_s, retrying
from spes.sync.stalls import TICK_S, Stalls

UNAVAILABLE = classify("upload of round 3", grpc.StatusCode.UNAVAILABLE, "connection refused", "")
REFUSED = classify("upload of round 3", grpc.StatusCode.FAILED_PRECONDITION, "round 3 is closed", "")


class Clock:
    """The retry module's `time` (its module only: other threads keep the real one), a clock that only moves when
    the loop sleeps."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.now, self.slept = 100.0, []
        monkeypatch.setattr(retry, "time", self)

    def monotonic(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.slept.append(seconds)
        self.now += seconds


def failing(failures: list[SyncError | grpc.RpcError], result: str = "done") -> Callable[[float], str]:
    """An attempt that raises `failures` in turn, then returns `result`; it records each call's timeout."""

    def attempt(timeout: float) -> str:
        attempt.timeouts.append(timeout)  # type: ignore[attr-defined]
        if failures:
            raise failures.pop(0)
        return result

    attempt.timeouts = []  # type: ignore[attr-defined]
    return attempt


def test_backoff_is_exponential_with_jitter() -> None:
    for attempt in range(8):
        cap = min(30.0, 0.5 * 2**attempt)
        assert cap / 2 <= backoff_s(attempt) <= cap


def test_transient_failures_are_retried_with_backoff_up_to_max_retries(monkeypatch: pytest.MonkeyPatch) -> None:
    clock = Clock(monkeypatch)
    assert retrying("upload", failing([UNAVAILABLE] * 3), max_retries=3) == "done"
    assert len(clock.slept) == 3 and all(0.5 * 2**i / 2 <= s <= 0.5 * 2**i for i, s in enumerate(clock.slept))
    with pytest.raises(SyncError) as err:
        retrying("upload", failing([UNAVAILABLE] * 4), max_retries=3)
    assert err.value is UNAVAILABLE


def test_a_refusal_no_retry_can_change_ends_at_once(monkeypatch: pytest.MonkeyPatch) -> None:
    clock = Clock(monkeypatch)
    with pytest.raises(SyncError) as err:
        retrying("upload", failing([REFUSED]), max_retries=8)
    assert err.value is REFUSED and clock.slept == []


def test_a_repair_is_tried_at_once_and_at_most_max_recoveries_times(monkeypatch: pytest.MonkeyPatch) -> None:
    clock = Clock(monkeypatch)
    repairs: list[SyncError] = []

    def recover(failure: SyncError) -> bool:
        repairs.append(failure)
        return failure is REFUSED

    assert retrying("upload", failing([REFUSED] * MAX_RECOVERIES), max_retries=0, recover=recover) == "done"
    assert len(repairs) == MAX_RECOVERIES and clock.slept == []
    with pytest.raises(SyncError) as err:
        retrying("upload", failing([REFUSED] * (MAX_RECOVERIES + 1)), max_retries=0, recover=recover)
    assert err.value is REFUSED


def test_every_attempt_and_wait_keeps_to_the_rounds_deadline(monkeypatch: pytest.MonkeyPatch) -> None:
    clock = Clock(monkeypatch)
    attempt = failing([UNAVAILABLE] * 10)
    with pytest.raises(SyncError, match="did not finish within round_timeout_s=3") as err:
        retrying("download", attempt, max_retries=10, per_attempt_s=10, deadline=Deadline(3, RUNNING))
    assert err.value.code == grpc.StatusCode.DEADLINE_EXCEEDED
    assert attempt.timeouts[0] == 3 and all(t <= 3 for t in attempt.timeouts)  # type: ignore[attr-defined]
    assert sum(clock.slept) == pytest.approx(3)  # the last wait ends at the deadline, not past it
    deadline = Deadline(60, RUNNING)
    clock.now += 60
    assert deadline.remaining() == 0
    with pytest.raises(SyncError, match="round_timeout_s=60"):
        deadline.left()


RUNNING = Stalls(lambda: 0.0)
"""A process that never stops."""


def test_a_deadline_does_not_count_time_the_process_did_not_run(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Frozen 6 s into a 4 s deadline after 1 s of it, the process wakes with the 3 s it had left; time it runs (its
    looks every TICK_S) counts, and then the deadline passes."""
    clock = Clock(monkeypatch)
    deadline = Deadline(4, Stalls(clock.monotonic))
    clock.now += 1
    deadline.stalls.note()
    clock.now += 6
    with caplog.at_level("WARNING", logger="spes.sync"):
        assert deadline.left() == pytest.approx(3)
    assert "did not run for 6.0 s" in caplog.text
    while clock.now < 110:
        clock.now += TICK_S
        deadline.stalls.note()
    assert deadline.remaining() == 0
    with pytest.raises(SyncError, match="did not finish within round_timeout_s=4"):
        deadline.left()


def test_a_round_frozen_past_its_deadline_is_tried_again_on_waking(monkeypatch: pytest.MonkeyPatch) -> None:
    """An attempt (a download waiting for the round) frozen past the round's deadline fails as timed out when the
    process wakes: it is tried again with the time the round had left, where the server says where the run is."""
    clock = Clock(monkeypatch)
    frozen = classify("download of round 3", grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded", "")

    def attempt(timeout: float) -> str:
        attempt.timeouts.append(timeout)  # type: ignore[attr-defined]
        if len(attempt.timeouts) == 1:  # type: ignore[attr-defined]
            clock.now += 10
            raise frozen
        return "caught up"

    attempt.timeouts = []  # type: ignore[attr-defined]
    monkeypatch.setattr(retry, "backoff_s", lambda attempt: 0.5)
    deadline = Deadline(4, Stalls(clock.monotonic))
    assert retrying("sync", attempt, max_retries=3, deadline=deadline) == "caught up"
    assert attempt.timeouts == [4, 3.5] and clock.slept == [0.5]  # type: ignore[attr-defined]


def test_a_peer_id_held_by_another_process_is_retried_for_a_while_only(monkeypatch: pytest.MonkeyPatch) -> None:
    clock = Clock(monkeypatch)
    held = classify("join", grpc.StatusCode.ALREADY_EXISTS, "peer 0 is live at ...", Reason.DUPLICATE_PEER)
    assert held.retryable
    with pytest.raises(SyncError) as err:
        retrying("join", failing([held] * 100), max_retries=100)
    assert err.value is held and retry.DUPLICATE_WAIT_S < sum(clock.slept) < retry.DUPLICATE_WAIT_S + 2 * 30


def test_a_grpc_error_is_named_and_classified(monkeypatch: pytest.MonkeyPatch) -> None:
    Clock(monkeypatch)

    class Unavailable(grpc.RpcError):
        def code(self) -> grpc.StatusCode:
            return grpc.StatusCode.UNAVAILABLE

        def trailing_metadata(self) -> tuple:
            return ()

        def details(self) -> str:
            return "Socket closed"

    with pytest.raises(SyncError) as err:
        retrying("status", failing([Unavailable()] * 2), max_retries=1)
    assert str(err.value) == "status failed (UNAVAILABLE): Socket closed" and err.value.retryable
    asked = []

    def refusal() -> str:
        asked.append("refusal")
        return "the server refused this client's certificate"

    with pytest.raises(SyncError) as err:  # the server hung up: what that meant is asked, and it ends at once
        retrying("join", failing([Unavailable()] * 2), max_retries=1, refusal=refusal)
    assert (
        str(err.value) == ("join failed (UNAVAILABLE): the server refused this client's certificate (Socket closed)")
        and not err.value.retryable
    )
    assert asked == ["refusal"]


class Cancelled(grpc.RpcError):
    """A call that ended CANCELLED (gRPC's text for a server that cancelled it)."""

    def code(self) -> grpc.StatusCode:
        return grpc.StatusCode.CANCELLED

    def trailing_metadata(self) -> tuple:
        return ()

    def details(self) -> str:
        return "CANCELLED"


def test_a_call_the_server_cancelled_is_retried_and_one_the_client_cancelled_is_not(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """gRPC's core cancels a call that reaches a server as it stops: the node rides that out within its retries.
    A client that closed its channel (the node stopping) cancelled its calls itself: that ends at once."""
    clock = Clock(monkeypatch)
    attempt = failing([Cancelled(), Cancelled()])
    assert retrying("upload of round 40", attempt, max_retries=2, closed=lambda: False) == "done"
    assert len(clock.slept) == 2
    with pytest.raises(SyncError) as err:
        retrying("upload of round 40", failing([Cancelled()] * 4), max_retries=2)
    assert err.value.code == grpc.StatusCode.CANCELLED and err.value.retryable
    assert str(err.value).startswith("upload of round 40 failed (CANCELLED): the server ended the call (CANCELLED)")
    clock.slept.clear()
    with pytest.raises(SyncError) as err:
        retrying("upload of round 40", failing([Cancelled()]), max_retries=2, closed=lambda: True)
    assert str(err.value) == "upload of round 40 failed (CANCELLED): CANCELLED" and not err.value.retryable
    assert clock.slept == []


def test_each_attempt_gets_the_per_attempt_timeout_or_none(monkeypatch: pytest.MonkeyPatch) -> None:
    Clock(monkeypatch)
    bounded = failing([UNAVAILABLE])
    assert retrying("join", bounded, max_retries=1, per_attempt_s=7.5) == "done"
    assert bounded.timeouts == [7.5, 7.5]  # type: ignore[attr-defined]
    unbounded = failing([])
    assert retrying("status", unbounded, max_retries=0) == "done"
    assert unbounded.timeouts == [math.inf]  # type: ignore[attr-defined]


def test_a_held_peer_id_is_retried_until_exactly_its_wait_has_passed(monkeypatch: pytest.MonkeyPatch) -> None:
    """Retried while at most DUPLICATE_WAIT_S have passed since the first refusal, refused once more have."""
    clock = Clock(monkeypatch)
    held = classify("join", grpc.StatusCode.ALREADY_EXISTS, "peer 0 is live at ...", Reason.DUPLICATE_PEER)
    monkeypatch.setattr(retry, "backoff_s", lambda attempt: retry.DUPLICATE_WAIT_S / 3)
    assert retrying("join", failing([held] * 4), max_retries=10) == "done"  # the 4th refusal comes at exactly the wait
    assert sum(clock.slept) == retry.DUPLICATE_WAIT_S + retry.DUPLICATE_WAIT_S / 3
    with pytest.raises(SyncError) as err:
        retrying("join", failing([held] * 5), max_retries=10)
    assert err.value is held


def test_each_retry_is_logged_with_the_failure_and_the_wait(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    Clock(monkeypatch)
    monkeypatch.setattr(retry, "backoff_s", lambda attempt: 1.25)
    with caplog.at_level("WARNING", logger="spes.sync"):
        retrying("upload", failing([UNAVAILABLE]), max_retries=3)
    assert caplog.messages == [f"{UNAVAILABLE}; retry 1/3 in 1.2 s"]


def test_a_deadline_counts_only_the_stalls_after_it_was_set_and_runs_to_its_last_instant(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A stall before the deadline was set gives it no time; it expires at 0 left, not a second before; without
    stalls of its own it takes this process's (`STALLS`, whose thread it starts)."""
    clock = Clock(monkeypatch)
    stalls = Stalls(clock.monotonic)
    clock.now += 6
    stalls.note()  # a stall of 6 s, before the round began
    deadline = Deadline(4, stalls)
    assert deadline.remaining() == pytest.approx(4)
    for _ in range(7):  # running: its thread looks every TICK_S
        clock.now += 0.5
        stalls.note()
    assert deadline.left() == pytest.approx(0.5)
    assert Deadline(4).stalls is retry.STALLS
