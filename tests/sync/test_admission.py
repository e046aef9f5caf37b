"""The server's guards on their own: stream slots, the idle-stream watchdog, pending connection slots, and which
process is a peer id."""

from __future__ import annotations

import threading

import grpc
import pytest

from spes.sync.admission import PendingSlots, Sessions, StreamGuard, require_joined
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


def test_why_the_watchdog_ends_a_stream() -> None:
    """Past its handshake deadline; idle (unless waiting on its round); or moving bytes under the rate floor once
    the idle timeout has passed since its first byte (min_rate x the time past that)."""
    guard = StreamGuard(idle_timeout_s=10, max_streams=4, max_per_peer=4, min_rate=100.0)
    try:
        ticket = guard.admit(None)
        start = ticket.last_active
        assert ticket.too_slow(start + 10) == ""  # idle exactly the timeout: not yet
        assert ticket.too_slow(start + 10.5) == "no message for --stream_idle_timeout=10 s"
        ticket.wait_for_round(True)
        assert ticket.too_slow(ticket.last_active + 1000) == ""
        ticket.wait_for_round(False)
        ticket.moved(300)
        moving = ticket.moving_since
        assert moving is not None and ticket.last_active == moving
        ticket.moved(200)
        assert ticket.moved_bytes == 500 and ticket.last_active >= moving
        ticket.moved(0)
        assert ticket.moving_since == moving  # held to the floor from the first byte on
        ticket.last_active = moving + 1000  # never idle from here on
        assert ticket.too_slow(moving + 10) == ""  # the first idle timeout is free
        assert ticket.too_slow(moving + 15) == ""  # 500 bytes >= 100 x 5
        assert ticket.too_slow(moving + 15.5) == "it moved 500 bytes in 16 s, under --min_stream_rate"
        overdue = guard.admit(None, deadline_s=5)
        assert overdue.deadline is not None and overdue.deadline <= overdue.last_active + 5
        assert overdue.too_slow(overdue.deadline) == ""
        assert overdue.too_slow(overdue.deadline + 0.01) == "its handshake did not complete in time"
        assert guard.admit(None).deadline is None
    finally:
        guard.stop()


def test_a_call_before_join_is_refused_to_join_first() -> None:
    require_joined({0, 2}, 2)
    with pytest.raises(Refused) as err:
        require_joined({0, 2}, 1)
    assert err.value.code == grpc.StatusCode.FAILED_PRECONDITION and err.value.reason == "not_joined"
    assert str(err.value) == "peer 1 has not joined this server: call Join first"


def test_presence_streams_say_which_process_is_a_peer() -> None:
    sessions = Sessions(liveness_s=60)
    sessions.present(3, "a", "ipv4:10.0.0.1:1")  # not joined yet: a presence registers it
    sessions.present(3, "b", "ipv4:10.0.0.2:2")  # another process while "a" is live: ignored
    sessions.absent(3, "b")  # nor does its end count
    [(peer, since, present)] = sessions.presence()
    assert (peer, present) == (3, True) and 0 <= since < 1
    sessions.absent(3, "a")
    assert sessions.presence()[0][2] is False
    sessions.present(3, "b", "ipv4:10.0.0.2:2")  # "a" watched and has no stream open: "b" takes over
    with pytest.raises(Refused) as err:
        sessions.heard(3, "a")
    assert str(err.value) == (
        "peer_id 3 has been taken over by another process at ipv4:10.0.0.2:2: this process stops; give every node "
        "its own spes_config.peer_id"
    )
    sessions.heard(3, "")  # a call without a session (an older client) is not checked
    sessions.forget()
    assert sessions.presence() == []
