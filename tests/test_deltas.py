"""Int8 deltas on the wire (spes.sync.deltas): real servers and clients on loopback, both planes.

After every round every peer's held model (what it loads) must equal the server's held model bit for bit, merge
rounds included; a peer holding no model, or another one, gets full values; bad int8 payloads are refused naming
the tensor; a node and a server that disagree on int8 are refused at join.
"""

from __future__ import annotations

import contextlib
import math
from pathlib import Path

import grpc
import pytest
import torch

from spes.sync import compress, plane_tcp
from spes.sync.client import SyncClient, SyncError
from spes.sync.merge import MergeConfig, Mode, build_global, download_names, trainable_names
from spes.sync.proto import spes_pb2 as pb
from spes.sync.protocol import Reason
from spes.sync.server import ParameterServer
from spes.sync.wire import DIGEST, Delta, checksum, header_for, pack
from sync_helpers import running_server, sync_all, tiny_manifest
from test_client import NO_MERGE, joined_clients

MANIFEST = tiny_manifest(d=16, f=32)  # expert blocks of 2 x 16 x 32 = 1024 values: 4 int8 blocks of 256
MERGE = MergeConfig(interval=30, alpha_start=0.5, decay_steps=1000, topk=1)  # step 30 is a merge round


def held_of(server: ParameterServer) -> dict[str, torch.Tensor]:
    held = server.service.state.held
    assert held is not None
    return held.tensors


def trained(model: dict[str, torch.Tensor], peer: int, step: int, mode: Mode = "spes") -> dict[str, torch.Tensor]:
    """What `peer` trained from `model` by round `step`: its tensors moved by small steps (as in training)."""
    gen = torch.Generator().manual_seed(step * 10 + peer)
    return {
        n: model[n] + 1e-2 * torch.randn(model[n].shape, generator=gen)
        for n in trainable_names(list(model), peer, mode)
    }


def assert_bit_identical(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert sorted(got) == sorted(want)
    for name, tensor in want.items():
        assert torch.equal(got[name].view(torch.int32), tensor.view(torch.int32)), name


def int8_bytes(names: list[str]) -> int:
    return sum(compress.payload_bytes(math.prod(MANIFEST[n]), compress.DEFAULT_BLOCK) for n in names)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("plane", ["grpc", "tcp"])
def test_every_peer_holds_the_servers_model_bit_for_bit_after_every_round(plane: str) -> None:
    """Two peers, four rounds (the third a merge round): the first moves full values, the others int8 deltas
    of exactly the analytic size; every peer's result is the server's held model, bit for bit."""
    gen = torch.Generator().manual_seed(0)
    init = {n: torch.randn(s, generator=gen) for n, s in MANIFEST.items()}
    with (
        running_server(merge=MERGE, wire_dtype="int8", data_port=0 if plane == "tcp" else -1) as (server, addr),
        joined_clients(addr, MANIFEST, wire_dtype="int8", data_plane=plane) as clients,
    ):
        models = [init, init]
        for step in (10, 20, 30, 40):
            results = sync_all(clients, step, {p: trained(models[p], p, step) for p in range(2)})
            models = [results[p][0] for p in range(2)]
            for p in range(2):
                assert_bit_identical(models[p], held_of(server))
            merged = step == 30
            for p, (_, stats) in results.items():
                up = trainable_names(list(MANIFEST), p, "spes")
                down = download_names(list(MANIFEST), p, "spes", merged)
                assert stats.merged == merged and clients[p].plane.name == plane
                if step == 10:  # nobody holds a model yet: full fp32 values both ways
                    assert (stats.bytes_up, stats.bytes_down) == (
                        4 * sum(math.prod(MANIFEST[n]) for n in up),
                        4 * sum(math.prod(s) for s in MANIFEST.values()),
                    )
                else:
                    assert (stats.bytes_up, stats.bytes_down) == (int8_bytes(up), int8_bytes(down))
        assert server.service.state.held.base == 30  # type: ignore[union-attr]


@pytest.mark.timeout(60)
def test_a_new_peer_and_a_peer_holding_another_model_get_full_values() -> None:
    """A restarted peer holds no model: it uploads and downloads full values once, then deltas again. A peer whose
    held model is of another round has its deltas refused (base_mismatch) and sends full values instead."""
    gen = torch.Generator().manual_seed(1)
    init = {n: torch.randn(s, generator=gen) for n, s in MANIFEST.items()}
    everything = 4 * sum(math.prod(s) for s in MANIFEST.values())
    with (
        running_server(merge=MERGE, wire_dtype="int8", data_port=0) as (server, addr),
        joined_clients(addr, MANIFEST, wire_dtype="int8") as clients,
    ):
        results = sync_all(clients, 10, {p: trained(init, p, 10) for p in range(2)})
        model = results[0][0]
        clients[1].close()
        with SyncClient(addr, peer_id=1, num_peers=2, experts_per_peer=2, mode="spes", wire_dtype="int8") as fresh:
            fresh.join(MANIFEST, trainable_names(list(MANIFEST), 1, "spes"))
            peers = [clients[0], fresh]
            results = sync_all(peers, 20, {p: trained(model, p, 20) for p in range(2)})
            assert results[1][1].bytes_down == everything and results[0][1].bytes_down < everything / 3
            for p in range(2):
                assert_bit_identical(results[p][0], held_of(server))
            deltas = clients[0]._deltas  # noqa: SLF001 (the held model of a peer)
            assert deltas is not None and deltas.round == 20
            deltas.round = 10  # a held model of another round than the server's
            results = sync_all(peers, 30, {p: trained(results[p][0], p, 30) for p in range(2)})
            assert results[0][1].bytes_down == everything and deltas.round == 30
            for p in range(2):
                assert_bit_identical(results[p][0], held_of(server))


def raw_delta_upload(server: ParameterServer, header: pb.TensorHeader, payload: bytes) -> pb.DataError:
    """Peer 0's upload of round 20 over the data plane: the hand-made int8 tensor `header` first, then zero deltas
    against round 10 for the rest of what it trains; the server's refusal."""
    with plane_tcp.connect("127.0.0.1", server.data_port, None, timeout_s=10) as sock:
        plane_tcp.send_hello(sock, pb.DataHello(op=pb.DATA_OP_UPLOAD, peer_id=0, step=20))
        assert plane_tcp.recv_reply(sock).send
        plane_tcp.send_frame(sock, header)
        sock.sendall(payload + DIGEST.pack(checksum(payload)))
        rest = [n for n in trainable_names(list(MANIFEST), 0, "spes") if n != header.name]
        with contextlib.suppress(OSError):  # refused at the first tensor: the server drains the rest
            for name in rest:
                zero = Delta(compress.quantize(name, torch.zeros(MANIFEST[name])), base_round=10)
                plane_tcp.send_tensor(sock, name, zero, "fp32")
        return plane_tcp.recv_reply(sock).error


@pytest.mark.timeout(60)
def test_malformed_int8_payloads_are_refused_naming_the_tensor() -> None:
    gen = torch.Generator().manual_seed(2)
    init = {n: torch.randn(s, generator=gen) for n, s in MANIFEST.items()}
    name = "blocks.0.ffn.experts.w1.0"
    numel = math.prod(MANIFEST[name])
    with (
        running_server(merge=MERGE, wire_dtype="int8", data_port=0) as (server, addr),
        joined_clients(addr, MANIFEST, wire_dtype="int8") as clients,
    ):
        sync_all(clients, 10, {p: trained(init, p, 10) for p in range(2)})
        good = Delta(compress.quantize(name, torch.ones(MANIFEST[name])), base_round=10)
        values = pack(good.payload)[:numel].numpy().tobytes()
        blocks = numel // compress.DEFAULT_BLOCK
        cases = []
        for scale in (-1.0, float("nan"), float("inf"), 3e38):  # 3e38 is finite, 127 x 3e38 is not
            scales = torch.full((blocks,), scale, dtype=torch.float32).numpy().tobytes()
            cases.append((header_for(name, good, "fp32"), values + scales))
        short = header_for(name, good, "fp32")
        short.num_bytes -= 4  # one scale too few
        cases.append((short, pack(good.payload).numpy().tobytes()[:-4]))
        tiny_block = header_for(name, Delta(compress.quantize(name, torch.ones(MANIFEST[name]), block=64), 10), "fp32")
        cases.append((tiny_block, b""))
        messages = []
        for header, payload in cases:
            error = raw_delta_upload(server, header, payload)
            assert error.code == "INVALID_ARGUMENT" and repr(name) in error.message, error
            messages.append(error.message)
        assert "negative, NaN or Inf scale" in messages[0] and "NaN or Inf scale" in messages[1]
        assert "holds NaN or Inf values once its int8 delta is applied" in messages[3]
        assert "needs 1040" in messages[4] and "int8 block of 64 values, expected 128 to 65536" in messages[5]
        wrong_base = header_for(name, Delta(good.payload, 9), "fp32")
        stale = raw_delta_upload(server, wrong_base, pack(good.payload).numpy().tobytes())
        assert (stale.code, stale.reason) == ("FAILED_PRECONDITION", Reason.BASE_MISMATCH), stale
        assert "against the held model of round 9, but the receiver holds round 10" in stale.message
        assert server.service.state.snapshot().open_round is None  # nothing was kept


@pytest.mark.timeout(60)
@pytest.mark.parametrize("server_wire, node_wire", [("int8", "fp32"), ("fp32", "int8"), ("bf16", "int8")])
def test_a_node_and_a_server_that_disagree_on_int8_are_refused_at_join(server_wire: str, node_wire: str) -> None:
    with running_server(wire_dtype=server_wire) as (_, addr):
        with pytest.raises(SyncError) as err:
            with joined_clients(addr, MANIFEST, wire_dtype=node_wire, max_retries=0):
                pass
    assert err.value.code == grpc.StatusCode.FAILED_PRECONDITION
    assert f"has wire_dtype='{node_wire}' but the server runs with wire_dtype='{server_wire}'" in str(err.value)


@pytest.mark.timeout(60)
def test_a_restarted_server_serves_its_persisted_held_model_as_full_values(tmp_path: Path) -> None:
    gen = torch.Generator().manual_seed(3)
    init = {n: torch.randn(s, generator=gen) for n, s in MANIFEST.items()}
    settings = {"merge": MERGE, "wire_dtype": "int8", "state_dir": str(tmp_path)}
    with running_server(**settings) as (server, addr), joined_clients(addr, MANIFEST, wire_dtype="int8") as clients:
        sync_all(clients, 10, {p: trained(init, p, 10) for p in range(2)})
        results = sync_all(clients, 20, {p: trained(init, p, 20) for p in range(2)})
        held = {n: t.clone() for n, t in held_of(server).items()}
    with running_server(**settings) as (server, addr), joined_clients(addr, MANIFEST, wire_dtype="int8") as clients:
        assert_bit_identical(held_of(server), held)
        assert server.service.state.held.base is None  # type: ignore[union-attr]
        for client, (model, _) in zip(clients, results.values(), strict=True):
            assert client._deltas is not None  # noqa: SLF001
            client._deltas.held, client._deltas.round = model, 20  # noqa: SLF001 (as before the restart)
        results = sync_all(clients, 30, {p: trained(results[p][0], p, 30) for p in range(2)})
        for p in range(2):  # the restored held model is the base of the next round's deltas, both ways
            assert_bit_identical(results[p][0], held_of(server))
            assert (results[p][1].bytes_up, results[p][1].bytes_down) == (
                int8_bytes(trainable_names(list(MANIFEST), p, "spes")),
                int8_bytes(download_names(list(MANIFEST), p, "spes", merged=True)),  # step 30 merges
            )


def drifting_deltas(names: list[str], peer: int, step: int) -> dict[str, torch.Tensor]:
    """One round's training progress of `peer`: a steady drift of 5e-4 per value (with a little noise), and one
    value of +-0.5 per int8 block, so each block's scale (0.5 / 127, a step of 3.9e-3) rounds the drift to zero.
    Only error feedback carries it to the model: without it the drift is never sent."""
    gen = torch.Generator().manual_seed(step * 10 + peer)
    deltas = {}
    for name in names:
        delta = 5e-4 + 1e-4 * torch.randn(MANIFEST[name], generator=gen)
        outliers = delta.view(-1)[:: compress.DEFAULT_BLOCK]
        outliers.copy_(torch.randint(0, 2, outliers.shape, generator=gen) - 0.5)
        deltas[name] = delta
    return deltas


@pytest.mark.timeout(90)
def test_error_feedback_keeps_thirty_int8_rounds_within_one_step_of_the_lossless_sum() -> None:
    """Two peers sync 30 rounds on an int8 wire, each training `drifting_deltas` from the model it holds. The
    lossless run (the round math on fp32 values) moves every drifting value by 30 x 5e-4 = 1.5e-2; the int8 run
    must end within one quantization step (3.9e-3: the carried error and the last download's rounding, each at
    most half a step) of it. A peer that dropped its carried error would fall behind by the whole drift."""
    gen = torch.Generator().manual_seed(4)
    init = {n: torch.randn(s, generator=gen) for n, s in MANIFEST.items()}
    names = {p: trainable_names(list(MANIFEST), p, "spes") for p in range(2)}
    lossless = init
    with (
        running_server(merge=NO_MERGE, wire_dtype="int8") as (server, addr),
        joined_clients(addr, MANIFEST, wire_dtype="int8") as clients,
    ):
        held = [init, init]
        for step in range(1, 31):
            deltas = {p: drifting_deltas(names[p], p, step) for p in range(2)}
            uploads = {p: {n: held[p][n] + d for n, d in deltas[p].items()} for p in range(2)}
            results = sync_all(clients, step, uploads)
            held = [results[p][0] for p in range(2)]
            fp32 = {p: {n: lossless[n] + d for n, d in deltas[p].items()} for p in range(2)}
            lossless = build_global(fp32, num_peers=2, experts_per_peer=2, mode="spes", step=step).tensors
            assert results[0][1].bytes_up < 4 * sum(t.numel() for t in uploads[0].values()) or step == 1
        assert_bit_identical(held[0], held_of(server))
    step_size = 0.5 / compress.QMAX
    for name, want in lossless.items():
        error = (held[0][name] - want).abs().max().item()
        assert error <= step_size * 1.05, (name, error, step_size)
        moved = (held[0][name] - init[name]).view(-1)
        block = compress.DEFAULT_BLOCK
        drift = torch.cat([moved[i + 1 : i + block] for i in range(0, moved.numel(), block)])
        assert drift.mean().item() > 30 * 5e-4 / 2, name  # the drifting values moved, not only the outliers
