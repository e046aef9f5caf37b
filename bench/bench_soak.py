#!/usr/bin/env python
"""A soak under churn: 4 peers sync round after round while a fifth process attacks the parameter server.

    OMP_NUM_THREADS=1 .venv/bin/python bench/bench_soak.py            # 200 rounds (~2 min on 2 shared cores)
    OMP_NUM_THREADS=1 .venv/bin/python bench/bench_soak.py --quick    # 20 rounds (CI: tests/faults/test_soak.py)

A real `python -m spes.server` (data plane on, --stream_idle_timeout 2) serves 4 peers, threads of this process
with `SyncClient`, on a small model named like the real one. The fifth process (`--chaos`, started by this
script) loops without pause over: idle gRPC Upload streams and idle data-plane connections held for a moment,
uploads killed mid-tensor on both planes (claiming a real peer id and the open round, socket reset),
garbage on both ports, and a fresh channel per cycle. Every round, every peer's download must equal the
fault-free global model of that round bit for bit (`build_global` of the uploads, the merge warm-up on).
The server's RSS, threads and file descriptors are sampled every 10 rounds; after the warm-up (first 20%)
their growth is reported. Prints a table and writes bench/results/bench_soak.json.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from statistics import fmean
from typing import Any

import grpc
import torch

from common import (
    MIB,
    REPO_ROOT,
    format_table,
    machine_info,
    manifest_bytes,
    parser,
    spec_overrides,
    start_server,
    write_results,
)
from spes.config import ServerSection, SpesConfig
from spes.sync.client import SyncClient
from spes.sync.merge import build_global
from spes.sync.plane_tcp import TcpPlane
from spes.sync.proto import spes_pb2 as pb
from spes.sync.proto import spes_pb2_grpc as pb_grpc
from spes.sync.protocol import PROTOCOL_VERSION
from spes.sync.spec import RunSpec
from spes.sync.throttle import left_out

PEERS, K, LAYERS, D = 4, 2, 2, 64
MERGE = ServerSection(merge_interval=5, merge_alpha_start=0.5, merge_decay_steps=10_000, merge_topk=2)
UPLOAD = "/spes.v1.ParameterServer/Upload"
REFUSALS = frozenset(code.name for code in grpc.StatusCode)
"""The kinds of the server's throttled "refused (CODE): ..." warnings."""


def manifest() -> dict[str, tuple[int, ...]]:
    """A small model (~0.6 MB fp32) named like the real one: shared tensors and one expert block per peer."""
    shapes: dict[str, tuple[int, ...]] = {"embed.weight": (256, D), "lm_head.weight": (256, D)}
    for layer in range(LAYERS):
        shapes[f"blocks.{layer}.attn.qkv.weight"] = (3 * D, D)
        shapes[f"blocks.{layer}.ffn.router.weight"] = (PEERS * K, D)
        for b in range(PEERS):
            shapes[f"blocks.{layer}.ffn.experts.w1.{b}"] = (K, D, D // 2)
            shapes[f"blocks.{layer}.ffn.experts.v1.{b}"] = (K, D, D // 2)
            shapes[f"blocks.{layer}.ffn.experts.w2.{b}"] = (K, D // 2, D)
    return shapes


def run() -> RunSpec:
    """The soak's run: `manifest()`'s model, peer b owning block b, a round every step, merging every 5."""
    return RunSpec(
        mode="spes",
        num_peers=PEERS,
        experts_per_block=K,
        block_owners=tuple(range(PEERS)),
        sync_steps=1,
        manifest=manifest(),
        server=MERGE,
    )


def usage(pid: int) -> dict[str, int]:
    fields = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines() if ":" in line)
    return {
        "rss": int(fields["VmRSS"].split()[0]) * 1024,
        "threads": int(fields["Threads"]),
        "fds": len(os.listdir(f"/proc/{pid}/fd")),
    }


# -- the fifth process ------------------------------------------------------------------------------------------
def hello(peer: int, step: int) -> bytes:
    body = pb.DataHello(op=pb.DATA_OP_UPLOAD, peer_id=peer, step=step).SerializeToString()
    return struct.pack("<4sH", b"SPES", PROTOCOL_VERSION) + struct.pack("<I", len(body)) + body


def reset(sock: socket.socket) -> None:
    """Close with a TCP reset, as a killed process's kernel would after unread data."""
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    sock.close()


def chaos(addr: str, data_port: int, counts_path: Path) -> int:
    """Attack until SIGTERM, writing what was done to `counts_path` (first once ready, then at the end).

    Each cycle, on a fresh channel: 4 idle gRPC streams and 4 idle data-plane connections held 2.5 s (past the
    server's 2 s --stream_idle_timeout), meanwhile 5 times: an upload of a real peer for the open (or next)
    round killed mid-tensor on each plane, and garbage sent to both ports.
    """
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    counts = {
        "idle_grpc_streams": 0,
        "idle_data_connections": 0,
        "killed_uploads_grpc": 0,
        "killed_uploads_data": 0,
        "garbage_frames": 0,
        "reconnects": 0,
    }
    host, _ = addr.rsplit(":", 1)
    peer = 0
    counts_path.write_text(json.dumps(counts))  # ready: the soak starts its rounds now
    while not stop.is_set():
        with grpc.insecure_channel(addr) as channel:
            counts["reconnects"] += 1
            hold = threading.Event()

            def idle(hold: threading.Event = hold) -> Iterator[Any]:  # a request iterator that never yields
                hold.wait(10)
                yield from ()

            calls = [channel.stream_unary(UPLOAD).future(idle(), timeout=10) for _ in range(4)]
            counts["idle_grpc_streams"] += len(calls)
            socks = [socket.create_connection((host, data_port), timeout=5) for _ in range(4)]
            counts["idle_data_connections"] += len(socks)
            peer = broken_uploads(channel, addr, data_port, peer, counts, stop)
            hold.set()
            for sock in socks:
                reset(sock)
            for call in calls:
                call.cancel()
    counts_path.write_text(json.dumps(counts))
    return 0


def broken_uploads(
    channel: grpc.Channel, addr: str, data_port: int, peer: int, counts: dict[str, int], stop: threading.Event
) -> int:
    """Up to 5 times, half a second apart: an upload killed mid-tensor on each plane, claiming the next peer and the
    open round, and garbage to both ports; returns the last peer claimed (the next cycle goes on from it)."""
    host, port = addr.rsplit(":", 1)
    for _ in range(5):
        try:
            status = pb_grpc.ParameterServerStub(channel).Status(pb.StatusRequest(), timeout=5)
        except grpc.RpcError:
            break
        peer, step = (peer + 1) % PEERS, max(status.open_round, status.current_round + 1)
        counts["killed_uploads_grpc"] += kill_grpc_upload(channel, peer, step)
        counts["killed_uploads_data"] += kill_data_upload(host, data_port, peer, step)
        for target in ((host, int(port)), (host, data_port)):
            try:
                with socket.create_connection(target, timeout=5) as sock:
                    sock.sendall(os.urandom(128))
                counts["garbage_frames"] += 1
            except OSError:
                pass
        if stop.wait(0.5):
            break
    return peer


TENSOR: dict[str, Any] = {"name": "embed.weight", "dtype": "fp32", "shape": [256, D], "num_bytes": 256 * D * 4}


def kill_grpc_upload(channel: grpc.Channel, peer: int, step: int) -> int:
    """Start an upload as `peer` for `step`, send 4 KiB of its first tensor, then cancel the call."""
    header = pb.TensorHeader(**TENSOR)
    messages = [
        pb.UploadMessage(meta=pb.UploadMeta(peer_id=peer, round=step)),
        pb.UploadMessage(chunk=pb.TensorChunk(header=header, offset=0, data=b"\1" * 4096)),
    ]
    stall = threading.Event()

    def partial() -> Iterator[pb.UploadMessage]:
        yield from messages
        stall.wait(5)

    call = channel.stream_unary(UPLOAD, request_serializer=pb.UploadMessage.SerializeToString).future(
        partial(), timeout=10
    )
    time.sleep(0.05)
    call.cancel()
    stall.set()
    return 1


def kill_data_upload(host: str, data_port: int, peer: int, step: int) -> int:
    """The same on the data plane, ended by a TCP reset."""
    try:
        sock = socket.create_connection((host, data_port), timeout=5)
        sock.sendall(hello(peer, step))
        sock.recv(256)
        body = pb.TensorHeader(**TENSOR).SerializeToString()
        sock.sendall(struct.pack("<I", len(body)) + body + b"\1" * 4096)
        reset(sock)
        return 1
    except OSError:
        return 0


# -- the soak ---------------------------------------------------------------------------------------------------
def soak(rounds: int, pause_s: float, workdir: Path, *, attack: bool = True) -> dict[str, Any]:
    """`rounds` rounds of 4 peers against a real server, the fifth process attacking it unless `attack` is off;
    the record of what was checked, injected and logged, and how the server's resources moved."""
    spec = run()
    server, port = start_server(
        [*spec_overrides(spec), "--data_port", "0", "--stream_idle_timeout", "2"], workdir / "server.log"
    )
    addr = f"127.0.0.1:{port}"
    chaos_proc = None
    try:
        settings = SpesConfig(server_addr=addr, rpc_timeout_s=20, round_timeout_s=120, max_retries=10)
        clients = [SyncClient(spec, p, settings) for p in range(PEERS)]
        for client in clients:
            client.join()
        data_plane = clients[0].plane
        if not isinstance(data_plane, TcpPlane):
            raise RuntimeError("the server offers a data plane (--data_port 0) but client 0 did not take it")
        chaos_proc = start_chaos(addr, data_plane.port, workdir / "chaos.json", attack)
        exact_rounds, seconds, samples = sync_rounds(spec, clients, rounds, pause_s, server.pid)
        for client in clients:
            client.close()
    finally:
        if chaos_proc is not None:
            chaos_proc.send_signal(signal.SIGTERM)
            chaos_proc.wait(timeout=60)
        server.send_signal(signal.SIGTERM)
        server.wait(timeout=60)
    log = (workdir / "server.log").read_text(errors="replace")
    unlogged = left_out(log)
    return {
        "rounds": rounds,
        "peers": PEERS,
        "model_mb": manifest_bytes(spec.manifest or {}) / MIB,
        "rounds_exact": exact_rounds,
        "chaos": json.loads((workdir / "chaos.json").read_text()),
        # NOTE: the server logs what a client can cause at a bounded rate and counts the rest (spes.sync.throttle)
        "server_refusals_logged": log.count("refused (") + sum(n for kind, n in unlogged.items() if kind in REFUSALS),
        "idle_closed_logged": log.count("idle for") + unlogged.get("idle connection", 0),
        "broken_uploads_logged": log.count("nothing was kept"),
        "samples": samples,
        "after_warmup": after_warmup(samples, rounds),
        "seconds_per_round_median": sorted(seconds)[len(seconds) // 2],
        "pause_s": pause_s,
    }


def start_chaos(addr: str, data_port: int, counts_path: Path, attack: bool) -> subprocess.Popen | None:
    """The fifth process (None with `attack` off), once it is ready: it writes `counts_path` when it starts."""
    if not attack:
        counts_path.write_text("{}")
        return None
    proc = subprocess.Popen(
        [sys.executable, __file__, "--chaos", addr, str(data_port), str(counts_path)], cwd=REPO_ROOT
    )
    while not counts_path.exists():
        if proc.poll() is not None:
            raise RuntimeError("the chaos process exited before it started")
        time.sleep(0.1)
    return proc


def sync_rounds(
    spec: RunSpec, clients: list[SyncClient], rounds: int, pause_s: float, server_pid: int
) -> tuple[int, list[float], list[dict[str, Any]]]:
    """The rounds, every peer at once: (rounds in which every download equalled the fault-free global model bit for
    bit, each round's seconds, the server's usage sampled at round 1 and every 10th)."""
    shapes = spec.manifest or {}
    trainable = {p: spec.trainable(p) for p in range(PEERS)}
    exact_rounds, seconds, samples = 0, [], []
    with ThreadPoolExecutor(PEERS) as pool:
        for step in range(1, rounds + 1):
            gen = torch.Generator().manual_seed(step)
            uploads = {p: {n: torch.randn(shapes[n], generator=gen) for n in trainable[p]} for p in range(PEERS)}
            want = build_global(uploads, spec=spec, step=step).tensors
            start = time.perf_counter()
            futures = [pool.submit(c.sync, step, uploads[p]) for p, c in enumerate(clients)]
            results = [f.result(timeout=300) for f in futures]
            seconds.append(time.perf_counter() - start)
            exact_rounds += all(torch.equal(t, want[n]) for got, _ in results for n, t in got.items())
            if step % 10 == 0 or step == 1:
                samples.append({"round": step, **usage(server_pid)})
            time.sleep(pause_s)  # the peers' local training between two rounds
    return exact_rounds, seconds, samples


def after_warmup(samples: list[dict[str, Any]], rounds: int) -> dict[str, Any]:
    """How the server's RSS, threads and descriptors moved after the warm-up (the first 20% of the rounds, at least
    10): growth there would be a leak. Under churn RSS jumps from one sample to the next by more than it drifts,
    so the difference of the last and first samples (`rss_growth_mb`) is mostly those jumps; `rss_trend_mb` compares the
    means of the first and last quarters of the samples."""
    warm = [s for s in samples if s["round"] >= max(10, rounds // 5)]
    first, last, quarter = warm[0], warm[-1], max(1, len(warm) // 4)
    return {
        "from_round": first["round"],
        "to_round": last["round"],
        "rss_growth_mb": (last["rss"] - first["rss"]) / MIB,
        "rss_trend_mb": (fmean(s["rss"] for s in warm[-quarter:]) - fmean(s["rss"] for s in warm[:quarter])) / MIB,
        "rss_min_max_mb": [min(s["rss"] for s in warm) / MIB, max(s["rss"] for s in warm) / MIB],
        "threads_min_max": [min(s["threads"] for s in warm), max(s["threads"] for s in warm)],
        "fds_min_max": [min(s["fds"] for s in warm), max(s["fds"] for s in warm)],
    }


def main(argv: list[str] | None = None) -> int:
    if argv is None and len(sys.argv) > 1 and sys.argv[1] == "--chaos":
        return chaos(sys.argv[2], int(sys.argv[3]), Path(sys.argv[4]))
    p = parser("bench_soak", __doc__)
    p.add_argument("--rounds", type=int, default=200, help="rounds to run (default 200; quick 20)")
    p.add_argument("--no_chaos", action="store_true", help="the same rounds without the fifth process (baseline)")
    p.add_argument(
        "--pause", type=float, default=0.2, help="seconds between rounds, the peers' local training (default 0.2)"
    )
    args = p.parse_args(argv)
    rounds = 20 if args.quick else args.rounds
    with tempfile.TemporaryDirectory(prefix="spes-soak-") as tmp:
        result = soak(rounds, args.pause, Path(tmp), attack=not args.no_chaos)
    a = result["after_warmup"]
    print(
        format_table(
            [
                "rounds",
                "exact",
                "RSS last-first MiB",
                "RSS trend MiB",
                "RSS min-max MiB",
                "threads min-max",
                "fds min-max",
            ],
            [
                [
                    result["rounds"],
                    result["rounds_exact"],
                    round(a["rss_growth_mb"], 2),
                    round(a["rss_trend_mb"], 2),
                    "-".join(f"{v:.0f}" for v in a["rss_min_max_mb"]),
                    "-".join(map(str, a["threads_min_max"])),
                    "-".join(map(str, a["fds_min_max"])),
                ]
            ],
        )
    )
    print("faults injected:", json.dumps(result["chaos"]))
    write_results(args.out, {"mode": "quick" if args.quick else "full", "machine": machine_info(), **result})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
