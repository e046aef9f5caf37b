"""A bounded soak: 30 rounds with 3 peers against a real server process; its memory, threads and fds stay flat."""

from __future__ import annotations

import gc
import json
import os
import subprocess
import sys
import threading
import time
from contextlib import ExitStack
from pathlib import Path

import pytest
from fault_helpers import REPO, assert_exact, fault_free, proc_usage, server_process, spec_overrides

from spes.config import ServerSection
from sync_helpers import make_client, peer_upload, running_server, sync_all, tiny_spec

ROUNDS, WARMUP, PEERS = 30, 10, 3
MERGE = ServerSection(merge_interval=5, merge_alpha_start=0.5, merge_decay_steps=1000, merge_topk=2)
SPEC = tiny_spec(num_peers=PEERS, d=64, f=32, server=MERGE)
SMALL = tiny_spec()


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_soak_thirty_rounds_without_growth(tmp_path: Path) -> None:
    args = [*spec_overrides(SPEC), "--state_dir", str(tmp_path / "state")]
    usage = {}
    with server_process(tmp_path / "server.log", args) as server, ExitStack() as stack:
        clients = [
            stack.enter_context(make_client(server.addr, SPEC, p, rpc_timeout_s=10, round_timeout_s=30))
            for p in range(PEERS)
        ]
        for client in clients:
            client.join()
        for step in range(1, ROUNDS + 1):
            uploads = {p: peer_upload(SPEC, p, seed=step) for p in range(PEERS)}
            results = sync_all(clients, step, uploads)
            if step in (WARMUP, ROUNDS):
                usage[step] = proc_usage(server.proc.pid)
        status = clients[0].status()
    last = fault_free({ROUNDS: uploads}, SPEC)
    assert_exact(results[0][0], last)
    assert status.current_round == ROUNDS and status.persistent
    warm, end = usage[WARMUP], usage[ROUNDS]
    print(f"\nserver after {WARMUP} rounds: {warm}; after {ROUNDS}: {end}")
    assert end["rss"] - warm["rss"] < 8 * 2**20, (warm, end)
    assert end["threads"] <= warm["threads"] + 2 and end["fds"] <= warm["fds"], (warm, end)


def test_servers_and_clients_leave_no_threads_or_descriptors_behind() -> None:
    """In one process: start, use and stop servers and clients repeatedly; threads and fds return to baseline."""

    def cycle() -> None:
        with running_server(SMALL) as (_, addr), ExitStack() as stack:
            clients = [stack.enter_context(make_client(addr, SMALL, p)) for p in range(2)]
            for client in clients:
                client.join()
            for step in (1, 2):
                sync_all(clients, step, {p: peer_upload(SMALL, p, seed=step) for p in range(2)})

    def settled(threads: int | None = None) -> tuple[int, int]:
        """Threads and fds once the stopped servers' threads are gone (down to `threads`, waiting 5 s at most)."""
        deadline = time.monotonic() + 5
        while True:
            time.sleep(0.7)  # grpc's own cancel-after-grace thread lives for the 0.5 s grace
            gc.collect()  # NOTE: earlier tests' channels and sockets may still wait for the collector
            now = threading.active_count()
            if threads is None or now <= threads or time.monotonic() > deadline:
                return now, len(os.listdir("/proc/self/fd"))

    cycle()
    threads, fds = settled()
    for _ in range(4):
        cycle()
    now_threads, now_fds = settled(threads)
    assert now_threads <= threads and now_fds <= fds, f"threads {threads} -> {now_threads}, fds {fds} -> {now_fds}"


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_soak_under_churn_short(tmp_path: Path) -> None:
    """bench/bench_soak.py --quick: 4 peers x 20 rounds while a fifth process opens idle streams, kills uploads
    mid-tensor and sends garbage; every round exact, the server's threads and fds bounded."""
    out = tmp_path / "soak.json"
    proc = subprocess.run(
        [sys.executable, str(REPO / "bench" / "bench_soak.py"), "--quick", "--out", str(out)],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=280,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["rounds_exact"] == result["rounds"] == 20
    assert result["chaos"]["idle_grpc_streams"] > 0 and result["chaos"]["killed_uploads_data"] > 0
    after = result["after_warmup"]
    assert (
        after["rss_growth_mb"] < 16
        and after["rss_trend_mb"] < 16
        and after["threads_min_max"][1] <= 32
        and after["fds_min_max"][1] <= 64
    )
