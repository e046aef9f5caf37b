"""Delayed, dropped and corrupted traffic through a loopback proxy: every round completes, bit-exact."""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager

import pytest
from fault_helpers import assert_exact, fault_free
from tcp_proxy import TcpProxy

from spes.config import ServerSection
from spes.sync.client import SyncClient
from sync_helpers import make_client, peer_upload, running_server, sync_all, tiny_spec

SPEC = tiny_spec(  # ~0.6 MB up per peer and round
    d=128, f=64, server=ServerSection(merge_interval=2, merge_alpha_start=0.5, merge_decay_steps=100, merge_topk=2)
)


@contextmanager
def peers_through(proxy: TcpProxy) -> Iterator[list[SyncClient]]:
    with ExitStack() as stack:
        clients = [
            stack.enter_context(
                make_client(f"127.0.0.1:{proxy.port}", SPEC, p, rpc_timeout_s=10, round_timeout_s=45, max_retries=6)
            )
            for p in range(2)
        ]
        for client in clients:
            client.join()
        yield clients


def arm(proxy: TcpProxy, fault: str) -> threading.Event:
    """Prepare `fault` for the next round; the event is set once it has struck."""
    struck = threading.Event()
    if fault.startswith("corrupt"):
        direction = fault.split("_")[1]
        proxy.corrupt_once(direction, 300_000)
        proxy.watchers.append(lambda d, _total: struck.set() if proxy.corrupted[direction] else None)
    elif fault.startswith("cut"):
        direction = {"cut_upload": "up", "cut_download": "down"}[fault]
        mark = proxy.bytes[direction]

        def cut(d: str, total: int) -> None:
            if d == direction and total - mark > 300_000 and not struck.is_set():
                struck.set()
                proxy.cut()

        proxy.watchers.append(cut)
    else:
        struck.set()
    return struck


@pytest.mark.slow
@pytest.mark.timeout(60)
@pytest.mark.parametrize("fault", ["delay", "cut_upload", "cut_download", "corrupt_up", "corrupt_down"])
def test_network_faults_are_recovered_and_the_run_is_exact(fault: str, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="spes")
    uploads = {step: {p: peer_upload(SPEC, p, seed=step) for p in range(2)} for step in (1, 2, 3)}
    delay = 0.02 if fault == "delay" else 0.0
    with (
        running_server(SPEC) as (_, addr),
        TcpProxy(("127.0.0.1", int(addr.split(":")[1])), delay_s=delay) as proxy,
    ):
        with peers_through(proxy) as clients:
            results = {1: sync_all(clients, 1, uploads[1])}
            struck = arm(proxy, fault)
            results[2] = sync_all(clients, 2, uploads[2])
            assert struck.is_set()
            results[3] = sync_all(clients, 3, uploads[3])
    for step in (1, 2, 3):
        want = fault_free({s: uploads[s] for s in range(1, step + 1)}, SPEC)
        for peer in range(2):
            assert_exact(results[step][peer][0], want)
    if fault != "delay":
        assert "retry 1/6" in caplog.text, caplog.text
