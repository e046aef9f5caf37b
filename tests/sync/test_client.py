"""End-to-end tests of SyncClient against a real in-process gRPC server on loopback."""

from __future__ import annotations

import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict
from pathlib import Path

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc

from conftest import wait_until
from spes.config import ServerSection
from spes.sync import channel, plane_tcp, retry
from spes.sync.admission import PEER_KEY, RUN_KEY, SESSION_KEY
from spes.sync.client import SyncError
from spes.sync.merge import build_global, mean_over_peers, outer_nesterov_step
from spes.sync.proto import spes_pb2 as pb
from spes.sync.server import ParameterServer, start_server
from spes.sync.settings import DeployConfig, ServerConfig
from spes.sync.spec import RunSpec
from sync_helpers import (
    NO_MERGE,
    TOKEN,
    check_round,
    joined_clients,
    make_client,
    peer_upload,
    running_server,
    sync_all,
    tiny_spec,
    write_pki,
)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("mode", ["spes", "diloco"])
def test_two_peers_three_rounds(mode: str) -> None:
    spec = tiny_spec(mode=mode, server=NO_MERGE, sync_steps=10)  # type: ignore[arg-type]
    with running_server(spec) as (_, addr), joined_clients(addr, spec) as clients:
        for step in (10, 20, 30):
            uploads = {p: peer_upload(spec, p, seed=step) for p in range(2)}
            results = sync_all(clients, step, uploads)
            check_round(results, uploads, spec, step=step)
            assert not any(stats.merged for _, stats in results.values())
            assert all(stats.bytes_up > 0 and stats.bytes_down > 0 for _, stats in results.values())
            for _, stats in results.values():  # where the seconds went: three phases, one after the other
                assert stats.phases is not None and min(asdict(stats.phases).values()) >= 0
                assert sum(asdict(stats.phases).values()) <= stats.seconds
        status = clients[0].status()
        assert status.current_round == 30 and status.open_round == -1 and status.peers_joined == (0, 1)


@pytest.mark.timeout(60)
def test_diloco_outer_nesterov_over_rounds() -> None:
    outer = ServerSection(outer_optimizer="nesterov", outer_lr=0.7, outer_momentum=0.9)
    spec, plain = tiny_spec(mode="diloco", server=outer), tiny_spec(mode="diloco")
    with running_server(spec) as (_, addr), joined_clients(addr, spec) as clients:
        global_model: dict[str, torch.Tensor] = {}
        momentum: dict[str, torch.Tensor] = {}
        for step in (1, 2, 3):
            uploads = {p: peer_upload(spec, p, seed=step) for p in range(2)}
            mean = build_global(uploads, spec=plain, step=step).tensors
            if global_model:  # the first round's mean is the starting point
                global_model, momentum = outer_nesterov_step(global_model, mean, momentum, lr=0.7, momentum=0.9)
            else:
                global_model = mean
            got, _ = sync_all(clients, step, uploads)[1]
            for name, tensor in got.items():
                torch.testing.assert_close(tensor, global_model[name], rtol=0, atol=0)


@pytest.mark.timeout(60)
def test_merge_round_returns_owners_changed_experts() -> None:
    merge = ServerSection(merge_interval=100, merge_alpha_start=0.5, merge_decay_steps=1000, merge_topk=2)
    spec = tiny_spec(server=merge, sync_steps=50)
    with running_server(spec) as (_, addr), joined_clients(addr, spec) as clients:
        for step in (50, 100, 150):
            uploads = {p: peer_upload(spec, p, seed=step) for p in range(2)}
            results = sync_all(clients, step, uploads)
            check_round(results, uploads, spec, step=step)
            got, stats = results[1]
            own = "blocks.0.ffn.experts.w1.1"
            if step == 100:
                assert stats.merged and stats.alpha == pytest.approx(0.45)
                assert not torch.equal(got[own], uploads[1][own])  # the owner gets its merged experts back
            else:
                assert not stats.merged and own not in got


@pytest.mark.timeout(60)
def test_bf16_codec_halves_traffic_and_rounds_to_bf16() -> None:
    spec = tiny_spec(codec="bf16", server=NO_MERGE, sync_steps=5)
    with running_server(spec) as (_, addr):
        with joined_clients(addr, spec) as clients:
            uploads = {p: peer_upload(spec, p, seed=1) for p in range(2)}
            results = sync_all(clients, 5, uploads)
    wire = {p: {n: t.bfloat16() for n, t in up.items()} for p, up in uploads.items()}
    want = build_global(wire, spec=spec, step=5).tensors
    got, stats = results[0]
    assert stats.bytes_up == sum(t.numel() * 2 for t in uploads[0].values())
    for name, tensor in got.items():
        assert tensor.dtype == torch.bfloat16  # as sent: the trainer's copy_ widens it
        torch.testing.assert_close(tensor, want[name].bfloat16(), rtol=0, atol=0)


@pytest.mark.timeout(60)
def test_wrong_or_missing_token_is_unauthenticated() -> None:
    spec = tiny_spec()
    with running_server(spec, token=TOKEN) as (server, addr):
        for token in (None, "wrong-token"):
            with make_client(addr, spec, 0, token=token, rpc_timeout_s=5) as client:
                with pytest.raises(SyncError) as err:
                    client.join()
                assert err.value.code == grpc.StatusCode.UNAUTHENTICATED
                with pytest.raises(SyncError) as err:
                    client.status()
                assert err.value.code == grpc.StatusCode.UNAUTHENTICATED
        assert server.service.state.snapshot().completed_round is None and not server.service.joined
        with joined_clients(addr, spec, token=TOKEN) as clients:
            uploads = {p: peer_upload(spec, p, seed=2) for p in range(2)}
            assert sync_all(clients, 1, uploads)[0][1].round == 1


@pytest.mark.timeout(60)
def test_tls_and_mutual_tls(tmp_path: Path) -> None:
    pki = write_pki(tmp_path)
    spec = tiny_spec()
    uploads = {p: peer_upload(spec, p, seed=3) for p in range(2)}
    tls = pki.server
    with running_server(spec, **tls) as (_, addr), joined_clients(addr, spec, tls_ca=pki.ca) as clients:
        assert sync_all(clients, 1, uploads)[1][1].round == 1
    with running_server(spec, **tls, tls_client_ca=pki.ca) as (_, addr):
        with joined_clients(addr, spec, tls_ca=pki.ca, **pki.client) as clients:
            assert sync_all(clients, 1, uploads)[0][1].round == 1
        with make_client(addr, spec, 0, tls_ca=pki.ca, rpc_timeout_s=3, max_retries=0) as anonymous:
            with pytest.raises(SyncError) as err:  # no client certificate: the handshake fails, and says so
                anonymous.status()
            assert err.value.code == grpc.StatusCode.UNAVAILABLE and not err.value.retryable
            assert "the server requires a client certificate (mutual TLS)" in str(err.value)


@pytest.mark.timeout(90)
@pytest.mark.parametrize("plane", ["grpc", "tcp"])
def test_tls_peer_ids_bind_each_peer_to_its_certificate(tmp_path: Path, plane: str) -> None:
    """With --tls_peer_ids a node holding the token and a valid certificate still cannot act as another peer."""
    pki = write_pki(tmp_path)
    certs = {p: pki.issue(f"peer-{p}") for p in range(2)}
    spec = tiny_spec(server=NO_MERGE)
    uploads = {p: peer_upload(spec, p, seed=5) for p in range(2)}
    tls = {**pki.server, "tls_client_ca": pki.ca, "tls_peer_ids": True, "data_port": 0, "token": TOKEN}
    with running_server(spec, **tls) as (server, addr):
        with joined_clients(
            addr, spec, tls_ca=pki.ca, token=TOKEN, data_plane=plane, per_peer=certs.__getitem__
        ) as clients:
            check_round(sync_all(clients, 1, uploads), uploads, spec, step=1)
        impostor_settings = {"tls_ca": pki.ca, "rpc_timeout_s": 5, "max_retries": 0, **certs[0]}
        with make_client(addr, spec, 1, token=TOKEN, **impostor_settings) as impostor:
            with pytest.raises(SyncError) as err:
                impostor.join()
            assert err.value.code == grpc.StatusCode.PERMISSION_DENIED and "'peer-1'" in str(err.value)
        context = channel.client_tls(pki.ca, **{k.removeprefix("tls_"): v for k, v in certs[0].items()})
        with plane_tcp.connect("127.0.0.1", server.data_port, context, 5) as sock:  # the data plane checks too
            plane_tcp.send_hello(sock, pb.DataHello(op=pb.DATA_OP_UPLOAD, peer_id=1, step=2, token=TOKEN))
            assert plane_tcp.recv_reply(sock).error.code == "PERMISSION_DENIED"
        assert server.service.state.snapshot().open_round is None
    with pytest.raises(ValueError, match="--tls_peer_ids .* needs mutual TLS"):
        DeployConfig(tls_peer_ids=True)


@pytest.mark.timeout(60)
def test_tls_peer_ids_bind_a_presence_stream_to_its_certificate(tmp_path: Path) -> None:
    """A presence stream holds its peer id: one opened with peer 1's certificate for peer 0 kept peer 0 out
    (ALREADY_EXISTS, "already joined by a live process") though --tls_peer_ids promises a node cannot act as
    another."""
    pki = write_pki(tmp_path)
    certs = {p: pki.issue(f"peer-{p}") for p in range(2)}
    spec = tiny_spec(server=NO_MERGE)
    tls = {**pki.server, "tls_client_ca": pki.ca, "tls_peer_ids": True, "token": TOKEN}
    with running_server(spec, **tls) as (server, addr):
        files = [Path(f).read_bytes() for f in (pki.ca, certs[1]["tls_key"], certs[1]["tls_cert"])]
        with grpc.secure_channel(addr, grpc.ssl_channel_credentials(*files)) as channel:
            metadata = (
                ("authorization", f"Bearer {TOKEN}"),
                (PEER_KEY, "0"),
                (SESSION_KEY, "impostor"),
                (RUN_KEY, server.service.run_id),
            )
            watch = health_pb2_grpc.HealthStub(channel).Watch(health_pb2.HealthCheckRequest(), metadata=metadata)
            with pytest.raises(grpc.RpcError) as err:
                next(watch)
            assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED
            assert "a call for peer 0 came with a certificate for 'peer-1'" in (err.value.details() or "")
        assert server.service.sessions.presence() == []
        with make_client(addr, spec, 0, tls_ca=pki.ca, token=TOKEN, rpc_timeout_s=5, max_retries=0, **certs[0]) as c:
            c.join()


@pytest.mark.timeout(60)
def test_download_honours_round_deadline_when_a_peer_never_comes() -> None:
    """The sync ends at its round_timeout_s, not at the rpc_timeout_s of an attempt (made 30 s here, far enough
    past the round's deadline for a slow machine not to blur the two)."""
    spec = tiny_spec()
    with running_server(spec) as (_, addr):
        with make_client(addr, spec, 0, rpc_timeout_s=30, round_timeout_s=1.5, max_retries=1) as client:
            client.join()
            start = time.monotonic()
            with pytest.raises(SyncError) as err:
                client.sync(1, peer_upload(spec, 0, seed=4))
            assert err.value.code == grpc.StatusCode.DEADLINE_EXCEEDED
            assert time.monotonic() - start < 15  # half the rpc timeout


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.mark.timeout(60)
def test_client_retries_until_the_server_comes_up(caplog: pytest.LogCaptureFixture) -> None:
    """... and its first retry line says what it tries and the setting that names the server."""
    port = free_port()
    spec = tiny_spec()
    started: list = []

    def start_later() -> None:
        time.sleep(1.0)
        started.append(start_server(ServerConfig(spec, DeployConfig(host="127.0.0.1", port=port))))

    thread = threading.Thread(target=start_later)
    thread.start()
    try:
        with (
            caplog.at_level("WARNING", logger="spes.client"),
            make_client(f"127.0.0.1:{port}", spec, 0, rpc_timeout_s=2, max_retries=6) as client,
        ):
            assert client.join() == -1
    finally:
        thread.join()
        for server in started:
            server.stop(grace_s=0)
    first = caplog.messages[0]
    assert first.startswith(f"join of the parameter server at spes_config.server_addr=127.0.0.1:{port} failed ("), first
    assert "; retry 1/6 in " in first, first


def test_client_checks_its_own_inputs() -> None:
    spec = tiny_spec()
    with pytest.raises(ValueError, match="peer_id 2"):
        make_client("127.0.0.1:1", spec, 2)
    with pytest.raises(ValueError, match="config key 'spes_config.codec' = 'fp8' is not a codec"):
        tiny_spec(codec="fp8")
    with pytest.raises(ValueError, match="complete run spec"):
        make_client(
            "127.0.0.1:1",
            RunSpec(mode="spes", num_peers=2, experts_per_block=2, block_owners=(0, 1), sync_steps=None),
            0,
        )
    with make_client("127.0.0.1:1", spec, 0) as client:
        with pytest.raises(SyncError, match="join"):
            client.sync(1, {})
        client._joined = True
        with pytest.raises(ValueError, match="missing"):
            client.sync(1, {})


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_loopback_throughput() -> None:
    """~64 MiB per peer up and the same down through real gRPC; prints MiB/s (not a pass/fail threshold)."""
    num_mb = 64
    manifest = {"embed.weight": (num_mb * 2**18,)}  # shared: averaged, downloaded by both
    spec = RunSpec(mode="diloco", num_peers=2, experts_per_block=2, block_owners=(), sync_steps=1, manifest=manifest)
    with running_server(spec) as (_, addr), joined_clients(addr, spec) as clients:
        uploads = {p: {"embed.weight": torch.randn(manifest["embed.weight"])} for p in range(2)}
        start = time.perf_counter()
        results = sync_all(clients, 1, uploads)
        seconds = time.perf_counter() - start
    moved = sum(stats.bytes_up + stats.bytes_down for _, stats in results.values()) / 2**20
    print(f"\nloopback: {moved:.0f} MiB through upload+download in {seconds:.2f} s = {moved / seconds:.0f} MiB/s")
    torch.testing.assert_close(
        results[0][0]["embed.weight"], (uploads[0]["embed.weight"] + uploads[1]["embed.weight"]) / 2
    )


def oracle_quorum(uploads: dict, previous: dict, spec: RunSpec) -> dict[str, torch.Tensor]:
    """Shared tensors averaged over the peers that arrived; expert blocks from their owner, else `previous`."""
    want = {}
    for name in spec.manifest or {}:
        owner = spec.owner(name)
        if owner is None:
            want[name] = mean_over_peers([uploads[p][name] for p in sorted(uploads)])
        else:
            want[name] = uploads[owner][name] if owner in uploads else previous[name]
    return want


@pytest.mark.timeout(60)
def test_quorum_round_closes_without_a_dead_peer_which_then_catches_up() -> None:
    quorum = ServerSection(merge_interval=0, dead_peer_policy="quorum", round_timeout_s=1.0)
    spec = tiny_spec(num_peers=3, server=quorum, sync_steps=10)
    manifest = spec.manifest or {}
    with running_server(spec) as (_, addr), joined_clients(addr, spec) as clients:
        uploads_10 = {p: peer_upload(spec, p, seed=10) for p in range(3)}
        sync_all(clients, 10, uploads_10)
        previous = build_global(uploads_10, spec=spec, step=10).tensors
        uploads = {p: peer_upload(spec, p, seed=20) for p in range(2)}
        start = time.monotonic()
        results = sync_all(clients[:2], 20, uploads)  # peer 2 is "dead"
        assert 0.9 < time.monotonic() - start < 15  # closed by the server's 1 s timeout, not the clients' 30 s one
        want = oracle_quorum(uploads, previous, spec)
        for got, stats in results.values():
            assert stats.peers == (0, 1) and not stats.caught_up
            for name, tensor in got.items():
                assert torch.equal(tensor, want[name]), name
        assert clients[0].status().round_peers == (0, 1)
        late, stats = clients[2].sync(20, peer_upload(spec, 2, seed=20))
        assert stats.caught_up and stats.round == 20 and stats.bytes_up == 0
        assert sorted(late) == sorted(manifest)  # every tensor, its own stale experts included
        for name, tensor in late.items():
            assert torch.equal(tensor, want[name]), name
        assert torch.equal(late["blocks.0.ffn.experts.w1.2"], uploads_10[2]["blocks.0.ffn.experts.w1.2"])
        uploads = {p: peer_upload(spec, p, seed=30) for p in range(3)}
        assert all(s.peers == (0, 1, 2) for _, s in sync_all(clients, 30, uploads).values())


class Stalled:
    """This process's stalls (`spes.sync.retry.Stalls`) as a test sets them: `seconds` it did not run."""

    def __init__(self) -> None:
        self.seconds = 0.0

    def watch(self) -> Stalled:
        return self

    def total(self) -> float:
        return self.seconds


@pytest.mark.timeout(60)
def test_a_sync_whose_process_stalled_mid_upload_past_its_round_timeout_finishes_the_round(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Peer 0 (round_timeout_s=1) did not run for 1.5 s in the middle of its upload (a laptop suspended): woken past
    its deadline, it ended ("the round did not finish within round_timeout_s=1"). The time it did not run is not
    counted: it waits for the round, which both peers build."""
    spec = tiny_spec()
    stalled = Stalled()
    monkeypatch.setattr(retry, "STALLS", stalled)
    with (
        running_server(spec) as (_, addr),
        make_client(addr, spec, 0, rpc_timeout_s=30, round_timeout_s=1, max_retries=0) as sleeper,
        make_client(addr, spec, 1, rpc_timeout_s=30) as other,
    ):
        sleeper.join()
        other.join()
        upload = sleeper.plane.upload

        def suspended(*args: object, **kwargs: object) -> tuple[int, bool]:
            time.sleep(1.5)
            stalled.seconds += 1.5
            return upload(*args, **kwargs)  # type: ignore[arg-type]

        monkeypatch.setattr(sleeper.plane, "upload", suspended)
        uploads = {p: peer_upload(spec, p, seed=1) for p in range(2)}
        results = sync_all([sleeper, other], 1, uploads)
    assert all(stats.peers == (0, 1) and not stats.caught_up for _, stats in results.values())
    check_round(results, uploads, spec, step=1)


@pytest.mark.timeout(60)
def test_catch_up_at_start_loads_the_latest_round_only_when_the_run_is_past_the_step() -> None:
    spec = tiny_spec(sync_steps=10, server=ServerSection(merge_interval=0))
    with running_server(spec) as (_, addr), joined_clients(addr, spec) as clients:
        assert clients[0].catch_up(0) is None  # no round yet
        uploads = {p: peer_upload(spec, p, seed=10) for p in range(2)}
        served = sync_all(clients, 10, uploads)[0][0]
        assert clients[1].catch_up(10) is None and clients[1].catch_up(11) is None
        got = clients[1].catch_up(0)
        assert got is not None
        tensors, stats = got
        assert (stats.caught_up, stats.round, stats.bytes_up, stats.phases) == (True, 10, 0, None)
        assert sorted(tensors) == sorted(spec.manifest or {})  # every tensor, its own experts included
        for name, tensor in served.items():
            assert torch.equal(tensors[name], tensor), name


@pytest.mark.timeout(60)
def test_the_first_quorum_round_needs_every_expert_owner() -> None:
    spec = tiny_spec(server=ServerSection(dead_peer_policy="quorum", min_peers=1, round_timeout_s=0.5))
    with running_server(spec) as (_, addr):
        with joined_clients(addr, spec) as clients:
            with pytest.raises(SyncError, match="so this round needs every such owner") as err:
                clients[0].sync(1, peer_upload(spec, 0, seed=1))
            assert err.value.reason == "round_timeout" and err.value.code == grpc.StatusCode.DEADLINE_EXCEEDED


@pytest.mark.timeout(90)
def test_a_server_restart_mid_round_is_transparent_to_the_peers(tmp_path: Path) -> None:
    spec = tiny_spec(mode="diloco", server=ServerSection(outer_optimizer="nesterov"))
    plain = tiny_spec(mode="diloco")
    port = free_port()
    cfg = ServerConfig(spec, DeployConfig(host="127.0.0.1", port=port, state_dir=str(tmp_path)))
    server = start_server(cfg)
    try:
        with joined_clients(f"127.0.0.1:{port}", spec, max_retries=8) as clients:
            uploads = {step: {p: peer_upload(spec, p, seed=step) for p in range(2)} for step in (1, 2, 3)}
            sync_all(clients, 1, uploads[1])
            with ThreadPoolExecutor(1) as pool:
                waiting = pool.submit(clients[0].sync, 2, uploads[2][0])
                while clients[1].status().peers_uploaded != (0,):
                    time.sleep(0.05)
                server.stop(grace_s=0)
                server = start_server(cfg)  # same state_dir: resumes at round 1
                late = clients[1].sync(2, uploads[2][1])
                got = waiting.result(timeout=60)
            final = sync_all(clients, 3, uploads[3])
    finally:
        server.stop(grace_s=0)
    want: dict = {}
    momentum: dict = {}
    for step in (1, 2, 3):
        mean = build_global(uploads[step], spec=plain, step=step).tensors
        want, momentum = outer_nesterov_step(want, mean, momentum, lr=0.7, momentum=0.9) if want else (mean, {})
        if step == 2:
            for name in want:
                assert torch.equal(got[0][name], want[name]) and torch.equal(late[0][name], want[name])
    for name in want:
        assert torch.equal(final[0][0][name], want[name]), name


@pytest.mark.timeout(60)
def test_a_client_closed_right_after_joining_frees_its_peer_id() -> None:
    """A join returns once the server has seen the client's presence stream, so closing the client ends its claim
    on the peer id at once; otherwise the server would hold the id for --peer_liveness (10 s) and refuse the next
    process as a duplicate for longer than its retries last."""
    spec = tiny_spec()
    with running_server(spec) as (_, addr):
        for _ in range(3):
            with make_client(addr, spec, 0, rpc_timeout_s=10, max_retries=2) as client:
                client.join()


@pytest.mark.timeout(90)
def test_a_leftover_client_of_another_run_holds_no_peer_id_of_a_new_server_on_its_port(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A client whose server went away keeps reopening its presence stream to that address. A new run's server
    bound there refuses it (it names another run), so the new run's peer 0 joins at once; a server that resumed the
    same run (same --state_dir) takes it back as peer 0's presence, so a second process claiming 0 is refused."""
    spec = tiny_spec()
    port = free_port()

    def server(state_dir: Path) -> ParameterServer:
        return start_server(ServerConfig(spec, DeployConfig(host="127.0.0.1", port=port, state_dir=str(state_dir))))

    first = server(tmp_path / "a")
    with make_client(f"127.0.0.1:{port}", spec, 0, rpc_timeout_s=10, max_retries=0) as leftover:
        leftover.join()
        first.stop(grace_s=0)
        other_run = server(tmp_path / "b")
        try:

            def refusals() -> list[str]:
                return [r.getMessage() for r in caplog.records if "refused a presence stream" in r.getMessage()]

            wait_until(lambda: bool(refusals()), "the leftover's presence stream to knock and be refused", 30)
            assert [p.peer for p in other_run.service.status().presence] == []
            refusal = refusals()[0]
            assert f"peer 0 belongs to run {leftover.run_id} (its checkpoint or spes_config.run_id), but" in refusal
            with make_client(f"127.0.0.1:{port}", spec, 0, rpc_timeout_s=10, max_retries=0) as fresh:
                fresh.join()
        finally:
            other_run.stop(grace_s=0)
        same_run = server(tmp_path / "a")
        try:
            wait_until(lambda: [p.connected for p in same_run.service.status().presence] == [True], "presence", 10)
            with make_client(f"127.0.0.1:{port}", spec, 0, rpc_timeout_s=10, max_retries=0) as intruder:
                with pytest.raises(SyncError, match="already joined by a live process") as err:
                    intruder.join()
            assert err.value.code == grpc.StatusCode.ALREADY_EXISTS
        finally:
            same_run.stop(grace_s=0)
