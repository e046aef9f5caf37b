"""The server's guards on their own: stream slots, the idle-stream watchdog, pending connection slots, and which
process is a peer id."""

from __future__ import annotations

import contextlib
import logging
import re
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from conftest import wait_until
from spes.sync.admission import (
    PEER_KEY,
    RUN_KEY,
    SESSION_KEY,
    GuardedHealth,
    PendingSlots,
    Session,
    Sessions,
    StreamGuard,
    require_joined,
)
from spes.sync.proto import spes_pb2_grpc as pb_grpc
from spes.sync.protocol import Reason, Refused
from spes.sync.stalls import Stalls
from sync_helpers import join_request, running_server


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
        assert err.value.reason == "busy"
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
    three = PendingSlots(12)  # 3 per address
    assert [three.take("a") for _ in range(4)] == [True, True, True, False]
    three.release("a")  # 2 held: one more, not two
    assert [three.take("a") for _ in range(2)] == [True, False]
    one = PendingSlots(2)
    assert one.take("b") and not one.take("b") and one.take("c")  # a new address starts at none held


def test_watchdog_ends_idle_streams_but_not_waiting_or_closed_ones(caplog: pytest.LogCaptureFixture) -> None:
    guard = StreamGuard(idle_timeout_s=0.3, max_streams=4, max_per_peer=4)
    assert guard.min_rate == 0.0  # no rate floor unless asked for
    ended = threading.Event()
    closed: list[str] = []
    try:
        idle = guard.admit(lambda details: ended.set())
        idle.claim(5)
        waiting = guard.admit(None)
        waiting.wait_for_round(True)
        guard.admit(closed.append).close()  # closed before its idle timeout: no longer watched
        assert ended.wait(5)
        assert idle.expired and not waiting.expired and closed == []
        with pytest.raises(TimeoutError, match="--stream_idle_timeout=0.3"):
            idle.check()
        assert caplog.messages == ["stream of peer 5 closed: no message for --stream_idle_timeout=0.3 s"]
        watchdogs = [t for t in threading.enumerate() if t.name == "spes-stream-watchdog"]
        assert watchdogs and all(t.daemon for t in watchdogs)  # never keeps a stopping process alive
    finally:
        guard.stop()


def test_a_peers_slots_come_back_one_by_one() -> None:
    guard = StreamGuard(idle_timeout_s=60, max_streams=8, max_per_peer=3)
    try:
        tickets = [guard.admit(None) for _ in range(5)]
        for ticket in tickets[:3]:
            ticket.claim(2)
        tickets[0].close()  # two left: one more, not two
        tickets[3].claim(2)
        with pytest.raises(Refused):
            tickets[4].claim(2)
        single = StreamGuard(idle_timeout_s=60, max_streams=1, max_per_peer=1)
        try:
            single.admit(None).claim(9)  # a peer's first stream is within a limit of one
        finally:
            single.stop()
    finally:
        guard.stop()


def test_a_live_peer_id_is_refused_and_a_dead_one_taken_over() -> None:
    sessions = Sessions(liveness_s=60)
    assert sessions.join(0, "a", "ipv4:10.0.0.1:5000") == ""
    assert sessions.join(0, "a", "ipv4:10.0.0.1:5001") == ""  # the same process joining again
    with pytest.raises(Refused) as err:  # heard from just now, no presence stream yet: live
        sessions.join(0, "b", "ipv4:10.0.0.2:6000")
    assert err.value.code == grpc.StatusCode.ALREADY_EXISTS and err.value.reason == "duplicate_peer"
    assert str(err.value) == (
        "peer_id 0 is already joined by a live process at ipv4:10.0.0.1:5001; this join came from ipv4:10.0.0.2:6000: "
        "give every node its own spes_config.peer_id (a restarted node is admitted as soon as its old process's "
        "connection is gone)"
    )
    sessions.present(0, "a", "ipv4:10.0.0.1:5001")
    with pytest.raises(Refused):  # its presence stream is open: live
        sessions.join(0, "b", "ipv4:10.0.0.2:6000")
    sessions.absent(0, "a")  # its connection is gone (process killed): the restart takes over at once
    assert "10.0.0.1:5001" in sessions.join(0, "b", "ipv4:10.0.0.2:6000")
    with pytest.raises(Refused, match="already joined by a live process at ipv4:10.0.0.2:6000; this join came from"):
        sessions.join(0, "c", "ipv4:10.0.0.3:7000")  # the new process, just heard from, is now the live one
    with pytest.raises(Refused) as err:
        sessions.heard(0, "a")  # the old process, if it was only cut off, learns it was replaced
    assert err.value.reason == "superseded"
    assert err.value.code == grpc.StatusCode.ALREADY_EXISTS
    sessions.heard(0, "b")
    sessions.heard(1, "x")  # not joined: nothing to check
    [(peer, since, present)] = sessions.presence()
    assert (peer, present) == (0, False) and 0 <= since < 1


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
        assert overdue.deadline is not None and overdue.last_active + 4.9 < overdue.deadline <= overdue.last_active + 5
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
    sessions.present(3, "b", "ipv4:10.0.0.2:2")  # two streams of one process: it stays present until both end
    sessions.absent(3, "b")
    assert sessions.presence()[0][2] is True
    sessions._by_peer[3].last_seen -= 63  # heard by no call for a minute: its open stream is what it is heard by
    assert sessions.presence() == [(3, 0.0, True)]
    sessions.absent(3, "b")  # its last stream ends: heard from then on, counting from now
    [(_, since, present)] = sessions.presence()
    assert not present and 0 <= since < 1
    sessions._by_peer[3].last_seen -= 63  # and with no stream open, its silence counts
    [(_, since, present)] = sessions.presence()
    assert not present and 63 <= since < 64
    sessions.present(3, "b", "ipv4:10.0.0.2:2")
    stale = Sessions(liveness_s=0)  # a joined process never watched, not heard from within liveness_s: replaced
    stale.join(4, "a", "ipv4:10.0.0.1:1")
    stale.present(4, "b", "ipv4:10.0.0.2:2")
    with pytest.raises(Refused, match="taken over by another process at ipv4:10.0.0.2:2"):
        stale.heard(4, "a")
    sessions.forget()
    assert sessions.presence() == []


# ---------------------------------------------------------------------------------------------------------------
# On a real gRPC server on loopback: the health Watch that is a peer's presence, and a stream the watchdog ends.

SERVICE = "spes.test.Guarded"
RUN = "this-run"


@contextlib.contextmanager
def guarded_server(guard: StreamGuard, presence: list) -> Iterator[str]:
    """A gRPC server with `GuardedHealth` (presences recorded in `presence`) and a stream method that holds a
    `grpc_ticket` until the watchdog ends it; its address."""

    def on_presence(peer: int, session: str, run: str, address: str, _cn: object) -> Callable[[], None]:
        if run != RUN:
            raise Refused(grpc.StatusCode.FAILED_PRECONDITION, f"run {run!r} is not this one", Reason.OTHER_RUN)
        presence.append(("present", peer, session, address))
        return lambda: presence.append(("absent", peer, session))

    def held(_request: bytes, context: grpc.ServicerContext) -> Iterator[bytes]:
        with guard.grpc_ticket(context) as ticket:
            while not ticket.expired:
                time.sleep(0.02)
            yield b"never sent: the call was ended"

    server = grpc.server(ThreadPoolExecutor(8))
    health = GuardedHealth(guard, on_presence, lambda _: None)
    health.set("", health_pb2.HealthCheckResponse.SERVING)
    health_pb2_grpc.add_HealthServicer_to_server(health, server)
    handler = grpc.unary_stream_rpc_method_handler(held)
    server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler(SERVICE, {"Held": handler})])
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        yield f"127.0.0.1:{port}"
    finally:
        server.stop(grace=None)
        guard.stop()


@pytest.mark.timeout(60)
def test_a_presence_watch_holds_a_slot_of_its_peer_until_it_ends() -> None:
    guard = StreamGuard(idle_timeout_s=0.2, max_streams=4, max_per_peer=1)
    presence: list = []
    request = health_pb2.HealthCheckRequest(service="")
    with guarded_server(guard, presence) as addr, grpc.insecure_channel(addr) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        other_run = stub.Watch(request, metadata=((PEER_KEY, "3"), (SESSION_KEY, "s0"), (RUN_KEY, "old")), timeout=30)
        with pytest.raises(grpc.RpcError) as err:
            next(other_run)
        assert (err.value.code(), err.value.details()) == (
            grpc.StatusCode.FAILED_PRECONDITION,
            "run 'old' is not this one",
        )
        assert presence == [] and guard.open_streams == 0  # refused: its slot came back at once
        watch = stub.Watch(request, metadata=((PEER_KEY, "3"), (SESSION_KEY, "s1"), (RUN_KEY, RUN)), timeout=30)
        assert next(watch).status == health_pb2.HealthCheckResponse.SERVING
        assert [p[:3] for p in presence] == [("present", 3, "s1")] and presence[0][3].startswith("ipv4:127.0.0.1:")
        time.sleep(0.5)  # past the idle timeout: a watch waits on the server, it is never idle
        assert guard.open_streams == 1
        second = stub.Watch(request, metadata=((PEER_KEY, "3"), (SESSION_KEY, "s2")), timeout=30)
        with pytest.raises(grpc.RpcError) as err:
            next(second)
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert err.value.details() == "peer 3 already has --max_streams_per_peer=1 streams open: retry shortly"
        anonymous = stub.Watch(request, timeout=30)  # no peer: watched and counted, no presence
        no_session = stub.Watch(request, metadata=((PEER_KEY, "4"),), timeout=30)
        no_peer = stub.Watch(request, metadata=((SESSION_KEY, "s3"),), timeout=30)
        for other in (anonymous, no_session, no_peer):
            assert next(other).status == health_pb2.HealthCheckResponse.SERVING
        assert guard.open_streams == 4 and len(presence) == 1
        for ended in (watch, anonymous, no_session, no_peer):
            ended.cancel()
        wait_until(lambda: guard.open_streams == 0, "the ended watches to give their slots back", 10)
        assert presence[1:] == [("absent", 3, "s1")]


@pytest.mark.timeout(60)
def test_the_watchdog_ends_an_idle_grpc_stream_with_deadline_exceeded_saying_why(
    caplog: pytest.LogCaptureFixture,
) -> None:
    guard = StreamGuard(idle_timeout_s=0.2, max_streams=4, max_per_peer=4)
    with guarded_server(guard, []) as addr, grpc.insecure_channel(addr) as channel:
        with pytest.raises(grpc.RpcError) as err:
            list(channel.unary_stream(f"/{SERVICE}/Held")(b"", timeout=30))
    assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    why = "no message for --stream_idle_timeout=0.2 s"
    assert err.value.details() == f"stream closed ({why}): nothing it sent was kept"
    assert caplog.messages == [f"stream of peer unknown closed: {why}"]


def test_a_process_is_live_while_a_presence_stream_is_open_or_else_for_liveness_s_after_it_was_heard() -> None:
    heard = Session("s", "ipv4:10.0.0.1:1", last_seen=100.0)
    assert heard.live(104.9, liveness_s=5) and not heard.live(105.0, liveness_s=5)
    watched = Session("s", "ipv4:10.0.0.1:1", last_seen=100.0, watched=True)
    assert not watched.live(100.0, liveness_s=5)  # its stream ended: gone at once
    watched.presence = 1
    assert watched.live(10_000.0, liveness_s=5)


@pytest.mark.timeout(60)
def test_a_callers_address_is_named_decoded_in_the_log_and_in_refusals(caplog: pytest.LogCaptureFixture) -> None:
    """gRPC URL-encodes an IPv6 caller (`ipv6:%5B::1%5D:35836`): the join line, and a refusal naming the process
    whose presence stream holds the peer id, say `ipv6:[::1]:35836`."""
    caplog.set_level(logging.INFO, "spes.server")
    ipv6 = r"ipv6:\[::1\]:\d+"
    with running_server(host="[::1]") as (server, _), grpc.insecure_channel(f"[::1]:{server.port}") as channel:
        stub, health = pb_grpc.ParameterServerStub(channel), health_pb2_grpc.HealthStub(channel)
        held = ((PEER_KEY, "0"), (SESSION_KEY, "first"), (RUN_KEY, server.service.run_id))
        watch = health.Watch(health_pb2.HealthCheckRequest(service=""), metadata=held, timeout=30)
        assert next(watch).status == health_pb2.HealthCheckResponse.SERVING
        with pytest.raises(grpc.RpcError) as err:
            stub.Join(join_request(0), metadata=((SESSION_KEY, "second"),), timeout=10)
        assert re.search(f"live process at {ipv6}; this join came from {ipv6}:", err.value.details()), err.value
        stub.Join(join_request(1), timeout=10)
        watch.cancel()
    assert any(re.fullmatch(f"peer 1 joined from {ipv6} \\(codec fp32\\)", m) for m in caplog.messages), caplog.messages
    assert not [m for m in caplog.messages if "%5B" in m]


def test_a_streams_ages_leave_out_the_servers_own_stalls() -> None:
    """A server frozen for a minute (a fake `Stalls`) wakes with its streams as it left them: not idle, not overdue,
    not under the rate floor. From then on their time counts again, so a stream that is really idle, slow or overdue
    is still ended."""
    now = [0.0]
    guard = StreamGuard(idle_timeout_s=10, max_streams=4, max_per_peer=4, min_rate=100.0, stalls=Stalls(lambda: now[0]))

    def reasons_after(seconds: float) -> list[str]:
        """Run the server `seconds` more, looking every 0.25 s (no stall), the moving stream sending all along."""
        for _ in range(round(seconds / 0.25)):
            now[0] += 0.25
            moving.touch()
        return [t.too_slow(guard.clock()) for t in (idle, overdue, moving)]

    try:
        idle, overdue, moving = guard.admit(None), guard.admit(None, deadline_s=5), guard.admit(None)
        moving.moved(600)
        now[0] += 60
        assert [t.too_slow(guard.clock()) for t in (idle, overdue, moving)] == ["", "", ""]
        assert reasons_after(5) == ["", "", ""]
        assert reasons_after(0.25) == ["", "its handshake did not complete in time", ""]
        assert reasons_after(4.75)[0] == ""
        assert reasons_after(0.25)[0] == "no message for --stream_idle_timeout=10 s"
        assert reasons_after(5.75)[2] == ""  # 600 bytes in 16 s: 100/s past the first 10 s
        assert reasons_after(0.25)[2] == "it moved 600 bytes in 16 s, under --min_stream_rate"
    finally:
        guard.stop()


def test_a_peers_silence_leaves_out_the_servers_own_stalls() -> None:
    """A peer without a presence stream, heard from just before the server was frozen for a minute, is still live
    when the server wakes: its peer id is not given to another process, and its reported silence is the time the
    server ran. Once it stays silent for --peer_liveness of the server's running time, it is gone."""
    now = [0.0]
    stalls = Stalls(lambda: now[0])
    sessions = Sessions(liveness_s=5, stalls=stalls)
    sessions.join(0, "a", "ipv4:10.0.0.1:1")
    now[0] += 0.5
    sessions.heard(0, "a")
    now[0] += 60
    with pytest.raises(Refused, match="already joined by a live process at ipv4:10.0.0.1:1"):
        sessions.join(0, "b", "ipv4:10.0.0.2:2")
    sessions.present(0, "c", "ipv4:10.0.0.3:3")  # nor does a presence stream of another process take it over
    sessions.heard(0, "a")
    assert sessions.presence() == [(0, 0.0, False)]
    for _ in range(6):  # the server runs 4.5 s, its stalls' thread looking every 0.75 s
        now[0] += 0.75
        stalls.note()
    [(_, since, present)] = sessions.presence()
    assert since == pytest.approx(4.5) and not present
    with pytest.raises(Refused):
        sessions.join(0, "b", "ipv4:10.0.0.2:2")
    now[0] += 0.75
    assert "replaces the process at ipv4:10.0.0.1:1" in sessions.join(0, "b", "ipv4:10.0.0.2:2")
