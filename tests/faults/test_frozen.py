"""A peer frozen (SIGSTOP) past the server's deadlines, then continued (SIGCONT): a laptop lid closed, a VM paused, a
swap storm. Its sockets stay open but it answers nothing; when it wakes it believes no time passed. The run stays
exact, the others do not wait for it, and the woken peer carries on where the run is now, on the plane it used."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack, contextmanager
from pathlib import Path

import grpc
import psutil
import pytest
import torch
from fault_helpers import REPO, assert_exact, fault_free, server_process, spec_overrides
from safetensors.torch import load_file

from conftest import wait_until
from spes.config import ServerSection
from spes.sync import plane_tcp
from spes.sync.admission import SESSION_KEY
from spes.sync.client import SyncClient
from spes.sync.merge import build_global
from spes.sync.proto import spes_pb2 as pb
from spes.sync.spec import RunSpec
from spes.sync.wire import DIGEST, checksum, encode_tensors, upload_digest
from sync_helpers import TOKEN, join_request, make_client, peer_upload, stub_for, tiny_spec

FELL_BACK = "payloads go over gRPC until the next join finds it again"
QUORUM = ServerSection(dead_peer_policy="quorum", round_timeout_s=1.0, min_peers=1)


def _peer(addr: str, peer: int, steps: list[int], out: Path, width: int, *extra: str) -> subprocess.Popen[bytes]:
    """tests/faults/peer_process.py as peer `peer` of a run of two, logging to `out`/log (`extra`: its options)."""
    out.mkdir(parents=True, exist_ok=True)
    command = [sys.executable, str(REPO / "tests/faults/peer_process.py"), "--addr", addr, "--peer", str(peer)]
    command += ["--width", str(width), "--steps", *map(str, steps), "--out", str(out), *extra]
    with open(out / "log", "wb") as log:
        return subprocess.Popen(
            command, cwd=REPO, env={**os.environ, "SPES_TOKEN": TOKEN}, stdout=log, stderr=subprocess.STDOUT
        )


def _download_waiting(victim: subprocess.Popen[bytes], grpc_port: int, steady_s: float = 1.0) -> None:
    """Return once `victim` has waited `steady_s` on one data-plane connection (one not to `grpc_port`) with its main
    thread blocked in poll(2): its download is asked for and waits. Frozen earlier (under load, its upload's reply
    still in flight, or its download's hello not yet sent), the server closed the handshake, not the download."""
    poll = 7  # NOTE: x86-64's poll(2), where a socket's timed receive waits

    def waiting() -> bool:
        try:
            data = [
                c for c in psutil.Process(victim.pid).net_connections("tcp") if c.raddr and c.status == "ESTABLISHED"
            ]
            syscall = Path(f"/proc/{victim.pid}/task/{victim.pid}/syscall").read_text().split()[0]
        except (psutil.Error, OSError):
            return False
        return len([c for c in data if c.raddr.port != grpc_port]) == 1 and syscall == str(poll)

    since = [time.monotonic()]

    def steady() -> bool:
        if not waiting():
            since[0] = time.monotonic()
        return time.monotonic() - since[0] >= steady_s

    wait_until(steady, "peer 1's download of round 2 to wait on the data plane")


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


def _client(addr: str, peer: int, spec: RunSpec) -> SyncClient:
    return make_client(addr, spec, peer, token=TOKEN, rpc_timeout_s=10, round_timeout_s=60, max_retries=8)


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
            _download_waiting(victim, int(server.addr.rsplit(":", 1)[1]))
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


def _quorum_rounds(
    uploads: dict[int, dict[int, dict[str, torch.Tensor]]], spec: RunSpec
) -> dict[int, dict[str, torch.Tensor]]:
    """Each round's global model when round `s` took the uploads `uploads[s]` (peer -> tensors): a missing owner's
    experts kept from the round before, as a quorum round keeps them."""
    names, models = sorted(spec.manifest or {}), {}
    model: dict[str, torch.Tensor] = {}
    momentum: dict[str, torch.Tensor] = {}
    for step in sorted(uploads):
        built = build_global(uploads[step], spec=spec, step=step, names=names, previous=model, momentum=momentum)
        models[step], model, momentum = built.tensors, built.tensors, built.momentum
    return models


@pytest.mark.slow
@pytest.mark.timeout(90)
def test_a_peer_frozen_past_the_round_timeout_catches_up_and_the_rounds_are_exact(tmp_path: Path) -> None:
    """Peer 1 is frozen waiting for round 1; peer 0 goes on alone, rounds 2 and 3 closing without peer 1 at
    server.round_timeout_s (quorum). Woken, peer 1 takes round 1 and uploads round 2 as if no time had passed: that
    upload is refused as old and peer 1 loads the latest global model (round 3), as a node after a crash would; its
    round 3 is refused the same way, and round 4 is built by both. Every round any peer got is the exact one."""
    spec = tiny_spec(server=QUORUM)
    taken = {1: (0, 1), 2: (0,), 3: (0,), 4: (0, 1)}
    uploads = {s: {p: peer_upload(spec, p, seed=s) for p in peers} for s, peers in taken.items()}
    want = _quorum_rounds(uploads, spec)
    got: dict[int, dict[str, torch.Tensor]] = {}
    with (
        server_process(tmp_path / "server.log", spec_overrides(spec), env={"SPES_TOKEN": TOKEN}) as server,
        _client(server.addr, 0, spec) as peer0,
    ):
        peer0.join()
        victim = _peer(server.addr, 1, [1, 2, 3, 4], tmp_path / "victim", 8)
        log = tmp_path / "victim/log"
        with _frozen_later(victim), ThreadPoolExecutor(1) as pool:
            wait_until(lambda: peer0.status().peers_uploaded == (1,), "peer 1's upload of round 1", timeout_s=30)
            victim.send_signal(signal.SIGSTOP)
            for step in (1, 2, 3):
                got[step], stats = peer0.sync(step, uploads[step][0])
                assert stats.peers == taken[step]
            victim.send_signal(signal.SIGCONT)
            wait_until(lambda: "(it was at step 3)" in log.read_text(), "peer 1 to catch up twice")
            waiting = pool.submit(peer0.sync, 4, uploads[4][0])
            assert victim.wait(timeout=60) == 0, log.read_text()
            got[4], stats = waiting.result(timeout=30)
            assert stats.peers == (0, 1)
    text = log.read_text()
    assert "round 2 is old: round 3 has already completed" in text and "Traceback" not in text, text
    assert server.log_text().count("(quorum, missing [1])") == 2
    for step, model in got.items():
        assert_exact(model, want[step])
    # what peer 1 saved for its steps 2 and 3 is round 3's whole global model; for step 4, round 4's download
    for step, round_ in ((1, 1), (2, 3), (3, 3), (4, 4)):
        assert_exact(load_file(str(tmp_path / f"victim/round-{step}.safetensors")), want[round_])


@pytest.mark.slow
@pytest.mark.timeout(90)
def test_a_server_frozen_mid_round_does_not_count_its_stall_against_the_peers(tmp_path: Path) -> None:
    """Round 2 is open with peer 0's upload when the server is frozen for longer than server.round_timeout_s; peers
    1 and 2 upload meanwhile. Woken, the server judged the round timed out before their uploads arrived: fewer than
    server.min_peers were in, and peer 0's wait failed (round_timeout), ending that node. Now the time it did not
    run is not counted (one line says so): the round waits and is built by all three, exact."""
    spec = tiny_spec(num_peers=3, server=ServerSection(dead_peer_policy="quorum", round_timeout_s=3.0, min_peers=2))
    uploads = {s: {p: peer_upload(spec, p, seed=s) for p in range(3)} for s in (1, 2)}
    with (
        server_process(tmp_path / "server.log", spec_overrides(spec), env={"SPES_TOKEN": TOKEN}) as server,
        ExitStack() as stack,
        ThreadPoolExecutor(3) as pool,
    ):
        peers = [stack.enter_context(_client(server.addr, p, spec)) for p in range(3)]
        for peer in peers:
            peer.join()
        first = [pool.submit(peer.sync, 1, uploads[1][p]) for p, peer in enumerate(peers)]
        for future in first:
            future.result(timeout=30)
        waiting = [pool.submit(peers[0].sync, 2, uploads[2][0])]
        wait_until(lambda: peers[1].status().peers_uploaded == (0,), "peer 0's upload of round 2")
        try:
            server.proc.send_signal(signal.SIGSTOP)
            waiting += [pool.submit(peer.sync, 2, uploads[2][p]) for p, peer in enumerate(peers) if p]
            time.sleep(5)
        finally:
            server.proc.send_signal(signal.SIGCONT)
        results = [future.result(timeout=30) for future in waiting]
        log = server.log_text()
    assert "this process did not run for" in log and "peers' silence, do not count that time" in log, log
    want = fault_free(uploads, spec)
    for got, stats in results:
        assert stats.peers == (0, 1, 2) and not stats.caught_up
        assert_exact(got, want)


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_a_peer_frozen_past_its_own_round_timeout_catches_up_instead_of_ending(tmp_path: Path) -> None:
    """Peer 1 (spes_config.round_timeout_s=4) has uploaded round 1 and waits for it when it is frozen for 6 s (a
    laptop lid closed mid-sync); peer 0 goes on, round 2 closing without peer 1 (quorum). Woken, peer 1 found its
    own deadline expired and ended ("the round did not finish within round_timeout_s=4.0"). The time it did not run
    is not a round that timed out: it tries round 1 again, is told it is old, loads round 3, as a peer frozen
    mid-training does, and round 4 is built by both."""
    spec = tiny_spec(server=QUORUM)
    taken = {1: (0, 1), 2: (0,), 3: (0,), 4: (0, 1)}
    uploads = {s: {p: peer_upload(spec, p, seed=s) for p in peers} for s, peers in taken.items()}
    want = _quorum_rounds(uploads, spec)
    with (
        server_process(tmp_path / "server.log", spec_overrides(spec), env={"SPES_TOKEN": TOKEN}) as server,
        _client(server.addr, 0, spec) as peer0,
    ):
        peer0.join()
        victim = _peer(server.addr, 1, [1, 2, 3, 4], tmp_path / "victim", 8, "--round_timeout_s", "4")
        log = tmp_path / "victim/log"
        with _frozen_later(victim), ThreadPoolExecutor(1) as pool:
            wait_until(lambda: peer0.status().peers_uploaded == (1,), "peer 1's upload of round 1", timeout_s=30)
            victim.send_signal(signal.SIGSTOP)
            frozen = time.monotonic()
            for step in (1, 2, 3):
                assert peer0.sync(step, uploads[step][0])[1].peers == taken[step]
            time.sleep(max(0.0, frozen + 6 - time.monotonic()))
            victim.send_signal(signal.SIGCONT)
            wait_until(lambda: "(it was at step 3)" in log.read_text() or victim.poll() is not None, "peer 1 to go on")
            waiting = pool.submit(peer0.sync, 4, uploads[4][0])
            assert victim.wait(timeout=30) == 0, log.read_text()
            assert waiting.result(timeout=30)[1].peers == (0, 1)
    text = log.read_text()
    assert "did not run for" in text and "(it was at step 1)" in text and "Traceback" not in text, text
    for step, round_ in ((1, 3), (2, 3), (3, 3), (4, 4)):  # woken, its round 1 was old: it loaded round 3
        assert_exact(load_file(str(tmp_path / f"victim/round-{step}.safetensors")), want[round_])


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_a_server_frozen_past_its_idle_and_liveness_timeouts_ends_no_stream_and_keeps_every_peer(
    tmp_path: Path,
) -> None:
    """Peer 1 (a raw client without a presence stream) has sent its upload's first chunk and peer 0 waits for the
    round when the server is frozen for 4 s, past --stream_idle_timeout=2 and --peer_liveness=3. Woken, the server
    ended peer 1's upload as idle and judged peer 1 gone: another process took its peer id, and Status said it was
    silent for the whole freeze. Now only the time the server ran counts: the upload goes on and the round is built
    by both, exact, and the other process is refused until peer 1 has been silent for 3 s of the server's time."""
    spec = tiny_spec()
    uploads = {1: {p: peer_upload(spec, p, seed=1) for p in range(2)}}
    chunks = list(encode_tensors(uploads[1][1], "fp32"))
    resumed = threading.Event()

    def trickle() -> Iterator[pb.UploadMessage]:
        """Peer 1's upload: its first chunk, then the rest once the server is awake again."""
        yield pb.UploadMessage(meta=pb.UploadMeta(peer_id=1, round=1))
        yield pb.UploadMessage(chunk=chunks[0])
        resumed.wait(30)
        yield from (pb.UploadMessage(chunk=chunk) for chunk in chunks[1:])

    def as_(session: str) -> tuple[tuple[str, str], ...]:
        return (("authorization", f"Bearer {TOKEN}"), (SESSION_KEY, session))

    args = [*spec_overrides(spec), "--stream_idle_timeout", "2", "--peer_liveness", "3"]
    with ExitStack() as stack:  # on the way out: peer 1's upload let go, the calls closed, then the threads joined
        pool = stack.enter_context(ThreadPoolExecutor(2))
        server = stack.enter_context(server_process(tmp_path / "server.log", args, env={"SPES_TOKEN": TOKEN}))
        peer0 = stack.enter_context(_client(server.addr, 0, spec))
        stub = stack.enter_context(stub_for(server.addr))
        stack.callback(resumed.set)
        peer0.join()
        stub.Join(join_request(1, spec), metadata=as_("old"), timeout=10)
        waiting = pool.submit(peer0.sync, 1, uploads[1][0])
        sent = pool.submit(stub.Upload, trickle(), metadata=as_("old"), timeout=30)
        wait_until(lambda: peer0.status().peers_uploaded == (0,), "peer 0's upload of round 1")
        time.sleep(0.3)  # peer 1's first chunk in
        try:
            server.proc.send_signal(signal.SIGSTOP)
            time.sleep(4)
        finally:
            server.proc.send_signal(signal.SIGCONT)
        [(peer, silent)] = [(p.peer, p.last_seen_s) for p in peer0.status_reply().presence if not p.connected]
        assert peer == 1 and silent < 3
        with pytest.raises(grpc.RpcError) as err:
            stub.Join(join_request(1, spec), metadata=as_("new"), timeout=10)
        assert err.value.code() == grpc.StatusCode.ALREADY_EXISTS
        resumed.set()
        assert sorted(sent.result(timeout=30).uploaded_peers) == [0, 1]
        got, stats = waiting.result(timeout=30)
        assert stats.peers == (0, 1)
        assert_exact(got, fault_free(uploads, spec))

        def taken_over() -> bool:  # peer 1's process is silent from here on: gone once the server ran 3 s
            try:
                stub.Join(join_request(1, spec, run_id=run), metadata=as_("new"), timeout=10)
            except grpc.RpcError as exc:
                assert exc.code() == grpc.StatusCode.ALREADY_EXISTS, exc
                return False
            return True

        run = peer0.status_reply().run_id

        wait_until(taken_over, "peer 1's silence to pass --peer_liveness", timeout_s=10)
        log = server.log_text()
    assert "this process did not run for" in log and "stream of peer" not in log, log
    assert "peer 1 joined from" in log and "(replaces the process at" in log, log


def _data_plane(port: int, op: pb.DataOp, peer: int, step: int, **extra: int) -> socket.socket:
    """A hand-driven data-plane connection of `peer` (no session: any process of it), its hello sent."""
    sock = plane_tcp.connect("127.0.0.1", port, None, timeout_s=30)
    plane_tcp.send_hello(sock, pb.DataHello(op=op, peer_id=peer, step=step, token=TOKEN, **extra))
    return sock


def _read_download(sock: socket.socket, names: list[str]) -> dict[str, torch.Tensor]:
    """The tensors of a data-plane download whose `RoundInfo` was read, each checked against its trailing XXH3."""
    got = {}
    for name in names:
        header = plane_tcp.recv_frame(sock, pb.TensorHeader)
        payload = bytearray(header.num_bytes + DIGEST.size)
        plane_tcp.recv_exactly(sock, memoryview(payload))
        assert header.name == name and DIGEST.unpack_from(payload, header.num_bytes)[0] == checksum(payload[:-8])
        got[name] = torch.frombuffer(payload[:-8], dtype=torch.float32).reshape(tuple(header.shape))
    return got


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_a_server_frozen_past_its_data_planes_timeouts_ends_none_of_its_connections(tmp_path: Path) -> None:
    """The server is sending peer 1 a download (a 12 MiB tensor, more than the sockets hold), has peer 0's upload
    of round 2 half in, and a connection in its handshake, when it is frozen for 4 s, past --stream_idle_timeout=2
    and --handshake_timeout=2. Woken, it blamed each peer for its own stall: "peer 1 stopped reading its download"
    (sendall's timeout bounds the whole tensor), the upload broke off as silent though its bytes came right after
    the wake, the handshake was shut. Now only the time the server ran counts: all three go on, and round 2 is
    built from the upload, exact."""
    spec = tiny_spec(d=1024, f=64)
    uploads = {s: {p: peer_upload(spec, p, seed=s) for p in range(2)} for s in (1, 2)}
    args = [*spec_overrides(spec), "--data_port", "0", "--stream_idle_timeout", "2", "--handshake_timeout", "2"]
    with (
        server_process(tmp_path / "server.log", args, env={"SPES_TOKEN": TOKEN}) as server,
        ExitStack() as stack,
        ThreadPoolExecutor(2) as pool,
    ):
        peers = [stack.enter_context(_client(server.addr, p, spec)) for p in range(2)]
        for peer in peers:
            peer.join()
        for future in [pool.submit(peer.sync, 1, uploads[1][p]) for p, peer in enumerate(peers)]:
            future.result(timeout=30)
        port = peers[0].plane.port  # type: ignore[attr-defined]
        download = stack.enter_context(_data_plane(port, pb.DATA_OP_DOWNLOAD, 1, 1, full=True))
        names = list(plane_tcp.recv_reply(download).round.names)
        upload = stack.enter_context(
            _data_plane(port, pb.DATA_OP_UPLOAD, 0, 2, digest=upload_digest(uploads[2][0], "fp32"))
        )
        assert plane_tcp.recv_reply(upload).send
        first, *rest = uploads[2][0].items()
        plane_tcp.send_tensor(upload, *first, "fp32")
        handshake = stack.enter_context(socket.create_connection(("127.0.0.1", port), timeout=30))
        time.sleep(0.3)  # the download's send blocked on full buffers, the upload's first tensor in
        try:
            server.proc.send_signal(signal.SIGSTOP)
            received = pool.submit(_read_download, download, names)  # peer 1 reads what the sockets hold meanwhile
            time.sleep(4)
        finally:
            server.proc.send_signal(signal.SIGCONT)
        for name, tensor in rest:
            plane_tcp.send_tensor(upload, name, tensor, "fp32")
        plane_tcp.send_hello(handshake, pb.DataHello(op=pb.DATA_OP_PING, peer_id=1, step=-1, token=TOKEN))
        assert plane_tcp.recv_reply(handshake).ok
        assert plane_tcp.recv_reply(upload).HasField("uploaded")
        got = received.result(timeout=30)
        round2, stats = peers[1].sync(2, uploads[2][1])
        log = server.log_text()
    assert "this process did not run for" in log and "peers' silence, do not count that time" in log, log
    assert "dropped" not in log and "broke off" not in log and "idle" not in log, log
    want = fault_free({1: uploads[1]}, spec)
    assert sorted(got) == sorted(want)
    assert_exact(got, want)
    assert stats.peers == (0, 1)
    assert_exact(round2, {n: t for n, t in fault_free(uploads, spec).items() if n in round2})
