"""The presence stream on a real gRPC server on loopback: reopened ever later while refused, the refusal said once."""

from __future__ import annotations

import logging
import socket
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
from grpc_health.v1 import health_pb2_grpc

from conftest import wait_until
from spes.sync import presence as presence_module
from spes.sync.admission import PEER_KEY, RUN_KEY, SESSION_KEY, GuardedHealth, StreamGuard
from spes.sync.presence import REFUSED_RETRY_MAX_S, RETRY_S, Presence, retry_wait
from spes.sync.protocol import Reason, Refused


@pytest.mark.timeout(60)
def test_a_refused_presence_stream_is_reopened_ever_later_and_its_refusal_said_once(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A server that holds another run refuses the stream each time it is reopened; the process says so once (its
    next call will be refused with the same words), not once a second, and knocks ever more seldom (the wait
    doubling up to its cap), so a process left over from an earlier run costs the new run's server little."""
    monkeypatch.setattr(presence_module, "RETRY_S", 0.05)
    monkeypatch.setattr(presence_module, "REFUSED_RETRY_MAX_S", 0.2)
    knocks: list[str] = []
    times: list[float] = []

    def refuse(peer: int, session: str, run: str, address: str, _cn: object) -> None:
        knocks.append(run)
        times.append(time.monotonic())
        raise Refused(grpc.StatusCode.FAILED_PRECONDITION, f"peer {peer} belongs to run {run}", Reason.OTHER_RUN)

    guard = StreamGuard(idle_timeout_s=5, max_streams=4, max_per_peer=4)
    server = grpc.server(ThreadPoolExecutor(8))
    health_pb2_grpc.add_HealthServicer_to_server(GuardedHealth(guard, refuse, lambda _: None), server)  # type: ignore[arg-type]
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    presence = None
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            metadata = ((SESSION_KEY, "s"), (PEER_KEY, "2"), (RUN_KEY, "old"))
            presence = Presence(channel, metadata, peer_id=2)
            with caplog.at_level(logging.DEBUG, logger="spes.client"):
                presence.start(wait_s=0.1)
                wait_until(lambda: len(knocks) >= 6, "the stream to be reopened after each refusal", 20)
                presence.close(timeout_s=5)
        gaps = [later - earlier for earlier, later in zip(times, times[1:])]
        # NOTE: lower bounds only: a wait never ends early, a loaded machine may only make it longer
        assert all(gap >= least for gap, least in zip(gaps, (0.05, 0.1, 0.2, 0.2, 0.2))), gaps
        said = [r for r in caplog.records if r.levelno == logging.WARNING]
        assert [r.getMessage() for r in said] == [
            "the server refused peer 2's presence stream: peer 2 belongs to run old"
        ]
        assert set(knocks) == {"old"}
    finally:
        if presence is not None:
            presence.close(timeout_s=5)
        server.stop(grace=None)
        guard.stop()


def test_a_refused_stream_waits_doubling_to_its_cap_and_a_broken_one_the_retry_time() -> None:
    assert [retry_wait(n) for n in range(4)] == [RETRY_S, RETRY_S, 2 * RETRY_S, 4 * RETRY_S]
    assert retry_wait(10**6) == REFUSED_RETRY_MAX_S == max(retry_wait(n) for n in range(100))


def serve_health(hook: object) -> tuple[grpc.Server, StreamGuard, int]:
    """A real health service on loopback whose streams `hook(peer, session, run, address, common_name)` admits or
    refuses."""
    guard = StreamGuard(idle_timeout_s=30, max_streams=4, max_per_peer=4)
    server = grpc.server(ThreadPoolExecutor(8))
    health_pb2_grpc.add_HealthServicer_to_server(GuardedHealth(guard, hook, lambda _: None), server)  # type: ignore[arg-type]
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    return server, guard, port


@pytest.mark.timeout(60)
def test_a_held_stream_is_seen_and_close_cancels_it_at_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """The server keeps an admitted stream open: start returns once it is seen, and close cancels it, so the thread
    ends at once instead of waiting out the stream. Each may wait 30 s here (start's cap raised to it): far enough
    past the prompt outcome for a slow machine not to blur the two."""
    waits: list[int] = []
    monkeypatch.setattr(presence_module, "retry_wait", lambda refusals: waits.append(refusals) or 0.01)
    monkeypatch.setattr(presence_module, "SEEN_WAIT_S", 30.0)
    server, guard, port = serve_health(lambda *args: None)
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            presence = Presence(channel, ((SESSION_KEY, "s"), (PEER_KEY, "3"), (RUN_KEY, "r")), peer_id=3)
            assert presence._thread.name == "spes-presence-3" and presence._thread.daemon
            Presence(channel, (), peer_id=4).close(timeout_s=1)  # never started: nothing to cancel or join
            started = time.monotonic()
            presence.start(wait_s=30)
            assert presence._seen.is_set() and time.monotonic() - started < 15  # half its wait
            closing = time.monotonic()
            presence.close(timeout_s=30)
            assert not presence._thread.is_alive() and time.monotonic() - closing < 15  # half its timeout
        assert waits in ([], [0])  # a cancelled stream is no refusal
    finally:
        server.stop(grace=None)
        guard.stop()


@pytest.mark.timeout(60)
def test_refusals_are_counted_in_a_row_and_a_broken_stream_is_logged_as_such(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    waits: list[int] = []
    monkeypatch.setattr(presence_module, "retry_wait", lambda refusals: waits.append(refusals) or 0.01)

    def refuse(peer: int, session: str, run: str, address: str, _cn: object) -> None:
        raise Refused(grpc.StatusCode.FAILED_PRECONDITION, "another run", Reason.OTHER_RUN)

    server, guard, port = serve_health(refuse)
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            presence = Presence(channel, ((SESSION_KEY, "s"), (PEER_KEY, "1"), (RUN_KEY, "r")), peer_id=1)
            presence.start(wait_s=0.1)
            wait_until(lambda: len(waits) >= 4, "four refusals", 20)
            presence.close(timeout_s=5)
        assert waits[:4] == [1, 2, 3, 4]
    finally:
        server.stop(grace=None)
        guard.stop()
    waits.clear()
    caplog.clear()
    with socket.socket() as unused:  # nothing listens: each stream breaks (UNAVAILABLE), no refusal
        unused.bind(("127.0.0.1", 0))
        with grpc.insecure_channel(f"127.0.0.1:{unused.getsockname()[1]}") as channel:
            presence = Presence(channel, (), peer_id=5)
            with caplog.at_level(logging.DEBUG, logger="spes.client"):
                presence.start(wait_s=0.1)
                wait_until(lambda: len(waits) >= 2, "two broken streams", 20)
                presence.close(timeout_s=5)
    assert waits[:2] == [0, 0]
    assert "presence stream of peer 5 ended: StatusCode.UNAVAILABLE" in caplog.messages
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
