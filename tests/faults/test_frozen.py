"""A peer frozen (SIGSTOP) past the server's deadlines, then continued (SIGCONT): a laptop lid closed, a VM paused, a
swap storm. Its sockets stay open but it answers nothing; when it wakes it believes no time passed. The run stays
exact, the others do not wait for it, and the woken peer carries on where the run is now, on the plane it used."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from fault_helpers import REPO, assert_exact, fault_free, server_process, spec_overrides
from safetensors.torch import load_file

from conftest import wait_until
from spes.config import ServerSection
from spes.sync.client import SyncClient
from sync_helpers import TOKEN, make_client, peer_upload, tiny_spec

FELL_BACK = "payloads go over gRPC until the next join finds it again"
QUORUM = ServerSection(dead_peer_policy="quorum", round_timeout_s=1.0, min_peers=1)


def _peer(addr: str, peer: int, steps: list[int], out: Path, width: int) -> subprocess.Popen[bytes]:
    """tests/faults/peer_process.py as peer `peer` of a run of two, logging to `out`/log."""
    out.mkdir(parents=True, exist_ok=True)
    command = [sys.executable, str(REPO / "tests/faults/peer_process.py"), "--addr", addr, "--peer", str(peer)]
    command += ["--width", str(width), "--steps", *map(str, steps), "--out", str(out)]
    with open(out / "log", "wb") as log:
        return subprocess.Popen(
            command, cwd=REPO, env={**os.environ, "SPES_TOKEN": TOKEN}, stdout=log, stderr=subprocess.STDOUT
        )


@contextmanager
def _frozen_later(victim: subprocess.Popen[bytes]) -> Iterator[None]:
    """Whatever the block does, the victim is continued and killed on the way out (a stopped child outlives a
    failed test otherwise)."""
    try:
        yield
    finally:
        victim.send_signal(signal.SIGCONT)
        victim.kill()
        victim.wait(timeout=10)


def _client(addr: str, peer: int, spec: object) -> SyncClient:
    return make_client(addr, spec, peer, token=TOKEN, rpc_timeout_s=10, round_timeout_s=60, max_retries=8)  # type: ignore[arg-type]


@pytest.mark.slow
@pytest.mark.timeout(90)
def test_a_peer_frozen_while_its_download_is_sent_goes_on_over_the_data_plane(tmp_path: Path) -> None:
    """Peer 1 waits for round 2 on the data plane and is frozen; peer 0 completes the round, and the server's send of
    peer 1's download (larger than the sockets' buffers) stalls until --stream_idle_timeout closes it. Woken, peer 1
    finds its connection gone while gRPC answers: it took that for a data plane down and sent every later payload
    over gRPC (and, before, read the server's idle error frame inside a tensor: "bad download", a checksum
    mismatch). Now it pings the data plane, which answers, and gets round 2 there again, exact."""
    width = 512
    spec = tiny_spec(d=width, f=width // 2)
    uploads = {s: {p: peer_upload(spec, p, seed=s) for p in range(2)} for s in (1, 2, 3)}
    args = [*spec_overrides(spec), "--data_port", "0", "--stream_idle_timeout", "2"]
    with (
        server_process(tmp_path / "server.log", args, env={"SPES_TOKEN": TOKEN}) as server,
        _client(server.addr, 0, spec) as peer0,
    ):
        peer0.join()
        victim = _peer(server.addr, 1, [1, 2, 3], tmp_path / "victim", width)
        with _frozen_later(victim):
            peer0.sync(1, uploads[1][0])
            wait_until(lambda: peer0.status().peers_uploaded == (1,), "peer 1's upload of round 2", timeout_s=30)
            victim.send_signal(signal.SIGSTOP)
            peer0.sync(2, uploads[2][0])
            wait_until(lambda: "idle" in server.log_text() or "dropped" in server.log_text(), "the send to stall")
            victim.send_signal(signal.SIGCONT)
            peer0.sync(3, uploads[3][0])
            assert victim.wait(timeout=60) == 0, (tmp_path / "victim/log").read_text()
    log = (tmp_path / "victim/log").read_text()
    assert "download of round 2 broke off" in log and "bad download" not in log, log  # no error frame mid-tensor
    assert FELL_BACK not in log and "Traceback" not in log, log
    assert "peer 1 stopped reading its download of round 2" in server.log_text()
    for step in (2, 3):
        want = fault_free({s: uploads[s] for s in uploads if s <= step}, spec)
        assert_exact(load_file(str(tmp_path / f"victim/round-{step}.safetensors")), want)
