"""A peer SIGKILLed mid-upload, a wrong token, duplicate and out-of-order uploads: the run stays intact and exact."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import pytest
from fault_helpers import REPO, assert_exact, fault_free, server_process, spec_overrides
from safetensors.torch import load_file
from tcp_proxy import TcpProxy

from conftest import wait_until
from spes.config import ServerSection
from spes.sync.client import SyncClient, SyncError
from spes.sync.spec import RunSpec
from spes.sync.wire import payload_bytes
from sync_helpers import TOKEN, make_client, peer_upload, running_server, sync_all, tiny_spec

WIDTH = 128
MERGE = ServerSection(merge_interval=2, merge_alpha_start=0.5, merge_decay_steps=100, merge_topk=2)
SPEC = tiny_spec(d=WIDTH, f=WIDTH // 2, server=MERGE)
MANIFEST = SPEC.manifest or {}


def peer_command(addr: str, peer: int, steps: list[int], out: Path, run_id: str | None = None) -> list[str]:
    return [
        sys.executable,
        str(REPO / "tests/faults/peer_process.py"),
        "--addr",
        addr,
        "--peer",
        str(peer),
        "--width",
        str(WIDTH),
        "--steps",
        *map(str, steps),
        "--out",
        str(out),
        *(["--run_id", run_id] if run_id else []),
    ]


def client(addr: str, peer: int, token: str | None = TOKEN, spec: RunSpec = SPEC) -> SyncClient:
    return make_client(addr, spec, peer, token=token, rpc_timeout_s=10, round_timeout_s=60, max_retries=8)


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_peer_killed_mid_upload_restarts_and_the_round_is_exact(tmp_path: Path) -> None:
    uploads = {s: {p: peer_upload(SPEC, p, seed=s) for p in range(2)} for s in (1, 2)}
    upload_bytes = sum(payload_bytes(MANIFEST[n], "fp32") for n in SPEC.trainable(1))
    env = {"SPES_TOKEN": TOKEN}
    with (
        server_process(tmp_path / "server.log", [*spec_overrides(SPEC), "--log_level", "DEBUG"], env=env) as server,
        client(server.addr, 0) as peer0,
    ):
        peer0.join()
        with TcpProxy(("127.0.0.1", server.port), delay_s=0.005) as proxy, ThreadPoolExecutor(1) as pool:
            victim = subprocess.Popen(
                peer_command(f"127.0.0.1:{proxy.port}", 1, [1, 2], tmp_path / "first"),
                cwd=REPO,
                env={**os.environ, **env},
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
            )
            try:
                # NOTE: once the second upload (round 2) is ~200 KB in (the first was `upload_bytes` long), the proxy
                # holds the rest back (the watcher runs in its upload pump) until the server has begun receiving it;
                # then the victim is killed and the connection cut with it: what the victim had already written into
                # its socket (on a loaded machine, its whole upload) would otherwise still reach the server, and the
                # round would complete. Cut before the server began, the upload would be dropped before any handler
                # saw it, and the path where a begun upload breaks off would go untested.
                def kill(direction: str, total: int) -> None:
                    if direction != "up" or total <= upload_bytes + 200_000 or victim.poll() is not None:
                        return
                    wait_until(
                        lambda: "receiving the upload of peer 1 for round 2" in server.log_text(),
                        "the server to receive",
                    )
                    victim.kill()
                    proxy.cut()

                proxy.watchers.append(kill)
                round_1 = peer0.sync(1, uploads[1][0])
                waiting = pool.submit(peer0.sync, 2, uploads[2][0])
                assert victim.wait(timeout=60) == -9
            finally:
                victim.kill()
                victim.wait()
            status = peer0.status()
            assert (status.current_round, status.open_round, status.peers_uploaded) == (1, 2, (0,))
            restarted = subprocess.run(
                peer_command(server.addr, 1, [2], tmp_path / "again", run_id=peer0.run_id),
                cwd=REPO,
                env={**os.environ, **env},
                capture_output=True,
                text=True,
                timeout=60,
            )
            assert restarted.returncode == 0, restarted.stdout + restarted.stderr
            round_2 = waiting.result(timeout=60)
        assert "broke off after" in server.log_text()
        before = peer0.status()
        with client(server.addr, 1, token="not-the-token") as intruder:
            with pytest.raises(SyncError) as err:
                intruder.join()
            assert err.value.code == grpc.StatusCode.UNAUTHENTICATED
        assert peer0.status() == before
        log = server.log_text()
    assert TOKEN not in log and "not-the-token" not in log and "missing or wrong token" in log
    assert_exact(round_1[0], fault_free({1: uploads[1]}, SPEC))
    want = fault_free(uploads, SPEC)
    assert_exact(round_2[0], want)
    assert_exact(load_file(str(tmp_path / "again" / "round-2.safetensors")), want)


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_duplicate_and_out_of_order_uploads_leave_the_run_exact() -> None:
    spec = tiny_spec(server=MERGE)
    uploads = {s: {p: peer_upload(spec, p, seed=s) for p in range(2)} for s in (1, 2)}
    with (
        running_server(spec) as (_, addr),
        client(addr, 0, None, spec) as peer0,
        client(addr, 1, None, spec) as peer1,
    ):
        for c in (peer0, peer1):
            c.join()
        first = sync_all([peer0, peer1], 1, uploads[1])
        with ThreadPoolExecutor(1) as pool:
            waiting = pool.submit(peer0.sync, 2, uploads[2][0])
            while peer1.status().peers_uploaded != (0,):
                time.sleep(0.02)
            with pytest.raises(
                SyncError,
                match="round 3 is ahead of the open round 2, which still waits for peers "
                r"\[1\]: do all peers use the same sync_steps\?",
            ) as err:
                peer1.sync(3, uploads[2][1])
            assert err.value.reason == "future_round"
            again, stats = peer1.sync(1, uploads[1][1])  # a repeated round is a no-op that returns it again
            assert stats.round == 1 and not stats.caught_up
            assert_exact(again, first[1][0])
            got_1, _ = peer1.sync(2, uploads[2][1])
            got_0, _ = waiting.result(timeout=30)
        dup, stats = peer0.sync(2, uploads[2][0])
        assert_exact(dup, got_0)
        behind, stats = peer0.sync(1, uploads[1][0])  # the run has moved past round 1: catch up to round 2
        assert stats.caught_up and stats.round == 2 and sorted(behind) == sorted(spec.manifest or {})
    want = fault_free(uploads, spec)
    for got in (got_0, got_1, behind):
        assert_exact(got, want)
