"""The server's guards on their own: stream slots, the idle-stream watchdog, pending connection slots, and which
process is a peer id."""

from __future__ import annotations

import threading

import grpc
import pytest

from spes.sync.admission import PendingSlots, Sessions, StreamGuard
from spes.sync.protocol import Refused


def test_stream_slots_total_and_per_peer() -> None:
    guard = StreamGuard(idle_timeout_s=60, max_streams=3, max_per_peer=2)
    try:
        tickets = [guard.admit(None) for _ in range(3)]
        with pytest.raises(Refused, match="--max_streams=3") as err:
            guard.admit(None)
        assert err.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED and err.value.reason == "busy"
        tickets[0].claim(7)
        tickets[1].claim(7)
        with pytest.raises(Refused, match="peer 7 already has --max_streams_per_peer=2") as err:
            tickets[2].claim(7)
        assert err.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
        tickets[0].close()
        tickets[2].claim(7)  # a slot of peer 7 came free
        outside = guard.admit(None, total=False)  # the data plane: counted per peer only
        with pytest.raises(Refused):
            outside.claim(7)
        assert guard.open_streams == 2
        for ticket in tickets:
            ticket.close()
        assert guard.open_streams == 0
    finally:
        guard.stop()


def test_pending_slots_in_all_and_per_address() -> None:
    slots = PendingSlots(8)
    assert slots.per_address == 2
    assert [slots.take("10.0.0.1") for _ in range(3)] == [True, True, False]
    assert all(slots.take(f"10.0.0.{i}") for i in (2, 2, 3, 3, 4, 4))
    assert not slots.take("10.0.0.5")  # all 8 held
    slots.release("10.0.0.1")
    assert not slots.take("10.0.0.2") and slots.take("10.0.0.1")
    slots.release("10.0.0.3")
    assert slots.take("10.0.0.5")
    assert PendingSlots(2).per_address == 1 and PendingSlots(8, per_address=8).per_address == 8


def test_watchdog_ends_idle_streams_but_not_waiting_ones() -> None:
    guard = StreamGuard(idle_timeout_s=0.3, max_streams=4, max_per_peer=4)
    ended = threading.Event()
    try:
        idle = guard.admit(lambda details: ended.set())
        waiting = guard.admit(None)
        waiting.wait_for_round(True)
        assert ended.wait(5)
        assert idle.expired and not waiting.expired
        with pytest.raises(TimeoutError, match="--stream_idle_timeout=0.3"):
            idle.check()
    finally:
        guard.stop()


def test_a_live_peer_id_is_refused_and_a_dead_one_taken_over() -> None:
    sessions = Sessions(liveness_s=60)
    assert sessions.join(0, "a", "ipv4:10.0.0.1:5000") == ""
    assert sessions.join(0, "a", "ipv4:10.0.0.1:5001") == ""  # the same process joining again
    with pytest.raises(Refused) as err:  # heard from just now, no presence stream yet: live
        sessions.join(0, "b", "ipv4:10.0.0.2:6000")
    assert err.value.code == grpc.StatusCode.ALREADY_EXISTS and err.value.reason == "duplicate_peer"
    assert "10.0.0.1:5001" in str(err.value) and "10.0.0.2:6000" in str(err.value)
    sessions.present(0, "a", "ipv4:10.0.0.1:5001")
    with pytest.raises(Refused):  # its presence stream is open: live
        sessions.join(0, "b", "ipv4:10.0.0.2:6000")
    sessions.absent(0, "a")  # its connection is gone (process killed): the restart takes over at once
    assert "10.0.0.1:5001" in sessions.join(0, "b", "ipv4:10.0.0.2:6000")
    with pytest.raises(Refused) as err:
        sessions.heard(0, "a")  # the old process, if it was only cut off, learns it was replaced
    assert err.value.reason == "superseded"
    sessions.heard(0, "b")
    sessions.heard(1, "x")  # not joined: nothing to check
