"""SIGKILL the server process mid-round and restart it with the same --state_dir: the run ends bit-exact."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack, contextmanager
from pathlib import Path

import pytest
from fault_helpers import assert_exact, fault_free, free_port, spec_overrides, start_server_process
from tcp_proxy import TcpProxy

from spes.config import ServerSection
from spes.sync.client import SyncClient
from spes.sync.protocol import Mode
from spes.sync.spec import RunSpec
from sync_helpers import make_client, peer_upload, sync_all, tiny_spec

SPEC = {
    "spes": tiny_spec(
        d=128,
        f=64,
        server=ServerSection(merge_interval=2, merge_alpha_start=0.5, merge_decay_steps=100, merge_topk=2),
    ),
    "diloco": tiny_spec(mode="diloco", d=128, f=64, server=ServerSection(outer_optimizer="nesterov")),
}


@contextmanager
def peers(addr: str, spec: RunSpec) -> Iterator[list[SyncClient]]:
    with ExitStack() as stack:
        clients = [
            stack.enter_context(make_client(addr, spec, p, rpc_timeout_s=10, round_timeout_s=90, max_retries=10))
            for p in range(2)
        ]
        for client in clients:
            client.join()
        yield clients


@pytest.mark.slow
@pytest.mark.timeout(120)
@pytest.mark.parametrize("mode, moment", [("spes", "mid_upload"), ("diloco", "after_an_upload")])
def test_server_killed_mid_round_resumes_from_state_dir_and_the_run_is_exact(
    tmp_path: Path, mode: Mode, moment: str
) -> None:
    spec = SPEC[mode]
    args = [*spec_overrides(spec), "--state_dir", str(tmp_path / "state")]
    uploads = {step: {p: peer_upload(spec, p, seed=step) for p in range(2)} for step in (1, 2, 3)}
    port = free_port()
    servers = [start_server_process(tmp_path / "server.log", args, port=port)]
    try:
        with TcpProxy(("127.0.0.1", port)) as proxy, peers(f"127.0.0.1:{proxy.port}", spec) as clients:
            sync_all(clients, 1, uploads[1])
            killed = threading.Event()
            if moment == "mid_upload":
                mark = proxy.bytes["up"]

                def kill_mid_upload(direction: str, total: int) -> None:
                    if direction == "up" and total - mark > 200_000 and not killed.is_set():
                        killed.set()
                        servers[0].kill()

                proxy.watchers.append(kill_mid_upload)
            with ThreadPoolExecutor(2) as pool:
                first = pool.submit(clients[0].sync, 2, uploads[2][0])
                if moment == "after_an_upload":
                    while clients[1].status().peers_uploaded != (0,):
                        time.sleep(0.02)
                    servers[0].kill()
                    killed.set()
                assert killed.wait(timeout=30)
                servers.append(start_server_process(tmp_path / "server.log", args, port=port))
                second = pool.submit(clients[1].sync, 2, uploads[2][1])
                round_2 = {0: first.result(timeout=90), 1: second.result(timeout=90)}
            final = sync_all(clients, 3, uploads[3])
    finally:
        for server in servers:
            server.kill()
    log = servers[-1].log_text()
    assert "resumed from" in log and "round 1 complete (peers [0, 1])" in log
    want_2 = fault_free({s: uploads[s] for s in (1, 2)}, spec)
    for peer in range(2):
        assert_exact(round_2[peer][0], want_2)
        assert_exact(final[peer][0], fault_free(uploads, spec))
