#!/usr/bin/env python
"""Sync throughput: one SPES round of a >1 GB model through a real server, against a raw TCP socket.

    .venv/bin/python bench/bench_sync.py                       # 1.24 GB fp32 model, 2 peers, codecs fp32 and bf16
    .venv/bin/python bench/bench_sync.py --profile             # also py-spy profiles of the server and peer 0
    .venv/bin/python bench/bench_sync.py --quick               # configs/tiny.yaml's model, one round

The model is named and shaped like the real one (the paper's 1B widths with 3 layers and a 50k vocabulary,
16 experts in 2 ownership blocks, so 2 peers of 8 experts): each peer uploads the shared tensors and its
block and downloads the shared tensors and the other block. Everything is a separate process on loopback:
`python -m spes.server` and one process per peer (`SyncClient.sync`), once with tensor payloads over gRPC and
once over the raw-TCP data plane (`--data_port`, spes.sync.plane_tcp). The baseline, in the same run, is a
raw TCP server process and one client process per peer moving exactly the same byte counts: each client
sends its upload bytes, the server waits until every upload is in (the round barrier) and sends each client
its download bytes. Peers build their tensors and connect first, then all start on one signal; a round's
time runs from the first start to the last finish. The first `--warmup` rounds of either side run untimed:
the server receives into buffers freed by earlier rounds (spes.sync.buffers), so its first two rounds touch
fresh memory, as the raw baseline's first round does. Throughput = all bytes moved (every peer's up + down)
/ round time. `--profile` needs py-spy (`pip install py-spy`; not a project dependency) and writes the
hottest lines of the server and of peer 0 into the results.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any, Literal, TypedDict

import torch

from common import (
    PAPER_1B,
    REPO_ROOT,
    RESULTS_DIR,
    format_table,
    manifest_bytes,
    manifest_of,
    model_record,
    parser,
    vocabulary,
    write_results,
)
from spes.config import TrainConfig, load_config
from spes.launch import free_port
from spes.sync.client import SyncClient
from spes.sync.codecs.registry import REGISTRY
from spes.sync.spec import RunSpec, run_spec

FULL_MODEL = [
    "--model.n_layers=3",
    *vocabulary(50304),
    "--spes_config.num_peers=2",
    "--spes_config.num_train_experts_per_node=8",
]
QUICK_MODEL = ["--spes_config.num_peers=2", "--spes_config.num_train_experts_per_node=4"]
QUICK_CONFIG = REPO_ROOT / "configs" / "tiny.yaml"
EVERY_STEP = ["--spes_config.sync_steps=1"]
"""The peers sync rounds 1, 2, ... back to back: a round at every step (the server admits only the next one)."""
# Starts a relay in front of the given server ports; returns it and each peer's host to connect to.
Relay = Callable[[list[int]], tuple[subprocess.Popen, list[str]]]
HEADER = struct.Struct("<QQ")  # raw protocol: upload bytes, download bytes; then the payloads
SCRIPT = Path(__file__).resolve()


# -- the processes ---------------------------------------------------------------------------------------------
def wait_for_go() -> None:
    print("READY", flush=True)
    if sys.stdin.readline().strip() != "GO":
        raise SystemExit("orchestrator went away")


def node_run(config: Path, overrides: list[str], codec: str) -> tuple[TrainConfig, RunSpec]:
    """A node's config of the measured run on `codec`, and its run spec (what the server builds from the same)."""
    cfg = load_config(config, [*overrides, f"--spes_config.codec={codec}"])[0]
    return cfg, run_spec(cfg, manifest_of(cfg))


def grpc_peer(
    config: Path, overrides: list[str], peer: int, addr: str, codec: str, rounds: int, plane: Literal["grpc", "tcp"]
) -> None:
    """A SPES peer: real SyncClient, random fp32 tensors for what it trains; one JSON line per round."""
    cfg, spec = node_run(config, overrides, codec)
    assert spec.manifest is not None
    gen = torch.Generator().manual_seed(peer)
    tensors = {n: torch.randn(spec.manifest[n], generator=gen) for n in spec.trainable(peer)}
    settings = dataclasses.replace(
        cfg.spes_config, server_addr=addr, rpc_timeout_s=600, round_timeout_s=900, data_plane=plane
    )
    with SyncClient(spec, peer, settings, reuse_buffers=True) as client:  # as spes.sync.peer.PeerSync
        client.join()
        for r in range(1, rounds + 1):
            wait_for_go()
            start = time.time()
            _, stats = client.sync(r, tensors)
            print(
                json.dumps(
                    {
                        "start": start,
                        "end": time.time(),
                        "up": stats.bytes_up,
                        "down": stats.bytes_down,
                        "phases": None if stats.phases is None else dataclasses.asdict(stats.phases),
                    }
                ),
                flush=True,
            )


def _recv_into(conn: socket.socket, view: memoryview) -> None:
    while view:
        n = conn.recv_into(view)
        if n == 0:
            raise ConnectionError("peer closed the connection mid-transfer")
        view = view[n:]


def raw_server(port: int, peers: int, rounds: int, max_bytes: int) -> None:
    """The baseline server: per round, receive every client's upload, then (barrier) send each its download."""
    listener = socket.create_server(("127.0.0.1", port))
    print("LISTENING", flush=True)
    conns = [listener.accept()[0] for _ in range(peers)]
    barrier = threading.Barrier(peers)

    outbox = bytearray(max_bytes)  # read-only, shared by every connection

    def serve(conn: socket.socket) -> None:
        inbox = bytearray(max_bytes)
        header = bytearray(HEADER.size)
        for _ in range(rounds):
            _recv_into(conn, memoryview(header))
            up, down = HEADER.unpack(header)
            _recv_into(conn, memoryview(inbox)[:up])
            barrier.wait()
            conn.sendall(memoryview(outbox)[:down])

    threads = [threading.Thread(target=serve, args=(c,)) for c in conns]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


def raw_peer(host: str, port: int, up: int, down: int, rounds: int) -> None:
    """The baseline client: the same byte counts as a SPES peer, straight through a socket."""
    outbox = torch.empty(up, dtype=torch.uint8).random_().numpy().data
    inbox = bytearray(down)
    conn = socket.create_connection((host, port))
    for _ in range(rounds):
        wait_for_go()
        start = time.time()
        conn.sendall(HEADER.pack(len(outbox), down))
        conn.sendall(outbox)
        _recv_into(conn, memoryview(inbox))
        print(json.dumps({"start": start, "end": time.time(), "up": len(outbox), "down": down}), flush=True)
    conn.close()


# -- the orchestrator ------------------------------------------------------------------------------------------
def spawn(args: list[str], log: Path | None = None) -> subprocess.Popen:
    out: IO[Any] | int = open(log, "w") if log is not None else subprocess.PIPE
    return subprocess.Popen(
        [sys.executable, *args],
        stdin=subprocess.PIPE,
        stdout=out,
        stderr=subprocess.PIPE if log is None else subprocess.STDOUT,
        text=True,
        cwd=REPO_ROOT,
        env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"},
    )


def expect_line(proc: subprocess.Popen, what: str) -> str:
    assert proc.stdout is not None
    line = proc.stdout.readline()
    if not line:
        err = proc.stderr.read() if proc.stderr is not None else ""
        raise RuntimeError(f"a benchmark process exited before {what}: {err[-2000:]}")
    return line.strip()


class RoundRecord(TypedDict):
    """One measured round: its wall time, the payload bytes each peer sent and received, and where each SPES peer's
    seconds went (`spes.sync.client.RoundPhases`; None for the raw baseline's peers)."""

    round: int
    seconds: float
    bytes: int
    gb_s: float
    up_per_peer: list[int]
    down_per_peer: list[int]
    phases_per_peer: list[dict[str, float] | None]


def run_rounds(
    peers: list[subprocess.Popen],
    warmup: int,
    rounds: int,
    profile_pids: list[tuple[str, int]],
    profile_dir: Path | None,
) -> tuple[list[RoundRecord], dict[str, Any]]:
    """Release all peers at once for each round; per timed round: wall seconds and bytes moved (all peers).

    The first `warmup` rounds are not among the results. With `profile_dir`, the peers run one more round,
    under py-spy, whose time is not among them either.
    """
    results: list[RoundRecord] = []
    profiles: dict[str, Any] = {}
    for r in range(warmup + rounds + (profile_dir is not None)):
        for p in peers:
            if expect_line(p, "READY") != "READY":
                raise RuntimeError("peer did not report READY")
        profiled = r == warmup + rounds
        spies = start_profilers(profile_pids, profile_dir) if profiled and profile_dir is not None else []
        for p in peers:
            assert p.stdin is not None
            p.stdin.write("GO\n")
            p.stdin.flush()
        records = [json.loads(expect_line(p, "its round result")) for p in peers]
        if profiled:
            profiles = stop_profilers(spies)
            continue
        if r < warmup:
            continue
        wall = max(x["end"] for x in records) - min(x["start"] for x in records)
        moved = sum(x["up"] + x["down"] for x in records)
        results.append(
            {
                "round": r + 1 - warmup,
                "seconds": wall,
                "bytes": moved,
                "gb_s": moved / wall / 1e9,
                "up_per_peer": [x["up"] for x in records],
                "down_per_peer": [x["down"] for x in records],
                "phases_per_peer": [x.get("phases") for x in records],
            }
        )
    return results, profiles


def start_profilers(pids: list[tuple[str, int]], out: Path) -> list[tuple[str, subprocess.Popen, Path]]:
    spy = shutil.which("py-spy")
    if spy is None:
        raise SystemExit("error: --profile needs py-spy on PATH (pip install py-spy)")
    out.mkdir(parents=True, exist_ok=True)
    spies = []
    for name, pid in pids:
        path = out / f"{name}.txt"
        spies.append(
            (
                name,
                subprocess.Popen(
                    [
                        spy,
                        "record",
                        "--pid",
                        str(pid),
                        "--format",
                        "raw",
                        "--rate",
                        "250",
                        "--nonblocking",
                        "-o",
                        str(path),
                    ],
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.DEVNULL,
                ),
                path,
            )
        )
    time.sleep(2.0)  # let py-spy attach before the round starts
    return spies


def stop_profilers(spies: list[tuple[str, subprocess.Popen, Path]]) -> dict[str, Any]:
    """Stop py-spy (SIGINT writes its output) and summarize: the hottest source lines by own samples."""
    summary = {}
    for name, proc, path in spies:
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=60)
        summary[name] = hottest_lines(path)
    return summary


def hottest_lines(path: Path, top: int = 12) -> dict[str, Any]:
    """From py-spy's collapsed stacks: samples per leaf frame (own time) and per frame on the stack (inclusive)."""
    own: Counter[str] = Counter()
    inclusive: Counter[str] = Counter()
    total = 0
    for line in path.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        frames = [f.strip() for f in stack.split(";")][1:]  # drop the thread name
        if not frames:
            continue
        n = int(count)
        total += n
        own[frames[-1]] += n
        for frame in set(frames):
            inclusive[frame] += n
    return {
        "samples": total,
        "own": [[f, n / total] for f, n in own.most_common(top)],
        "inclusive": [[f, n / total] for f, n in inclusive.most_common(top * 2)],
    }


def wait_for_log(path: Path, needle: str, proc: subprocess.Popen, timeout: float = 120) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if path.is_file() and needle in path.read_text():
            return
        if proc.poll() is not None:
            raise RuntimeError(f"process exited ({proc.returncode}); see {path}")
        time.sleep(0.2)
    raise RuntimeError(f"{needle!r} did not appear in {path} within {timeout:.0f}s")


def peer_hosts(relay: Relay | None, ports: list[int], peers: int, procs: list[subprocess.Popen]) -> list[str]:
    """Where each peer finds the server: directly, or through `relay` (started here, stopped with `procs`)."""
    if relay is None:
        return ["127.0.0.1"] * peers
    proc, hosts = relay(ports)
    procs.append(proc)
    return hosts


def stop(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        if p.poll() is None:
            p.terminate()
    for p in procs:
        try:
            p.wait(timeout=30)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def server_args(config: Path, overrides: list[str], codec: str, plane: str, port: int, data_port: int) -> list[str]:
    """`python -m spes.server`'s command line as a user would write it, plus the benchmark's settings: no merge
    rounds, so that every timed round moves the same bytes."""
    run = [*overrides, f"--spes_config.codec={codec}", "--server.merge_interval=0", "--server.round_timeout_s=900"]
    return [
        "-m",
        "spes.server",
        str(config),
        *run,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--data_port",
        str(data_port) if plane == "tcp" else "-1",
    ]


def peer_args(
    config: Path, overrides: list[str], codec: str, plane: str, rounds: int, peer: int, host: str, port: int
) -> list[str]:
    """This script's command line as SPES peer `peer` (`--role grpc-peer`) for `rounds` rounds, its config and
    overrides the server's."""
    return [
        str(SCRIPT),
        "--role",
        "grpc-peer",
        "--config",
        str(config),
        "--peer-id",
        str(peer),
        "--host",
        host,
        "--port",
        str(port),
        "--codec",
        codec,
        "--plane",
        plane,
        "--rounds",
        str(rounds),
        *[f"--override={o}" for o in overrides],
    ]


def aggregation_seconds(log: str) -> list[float]:
    """The server's aggregation time of each round, from its log: work the raw baseline's server does not do."""
    return [float(line.split("aggregation ")[1].split(" s")[0]) for line in log.splitlines() if "aggregation " in line]


def bench_spes(
    config: Path,
    overrides: list[str],
    codec: str,
    plane: str,
    warmup: int,
    rounds: int,
    workdir: Path,
    profile: bool,
    relay: Relay | None = None,
) -> tuple[list[RoundRecord], dict[str, Any], list[float]]:
    """SPES rounds on `codec` with tensor payloads over gRPC (`plane` "grpc") or the raw-TCP data plane ("tcp").

    The server is started as a user would: `python -m spes.server CONFIG` with the nodes' overrides. With `relay`,
    it is started on the server's ports once the server listens, and peer `i` connects to the host `relay` gives it
    (bench/bench_wan.py: an emulated internet link).
    """
    overrides = [*overrides, *EVERY_STEP]
    cfg = load_config(config, overrides)[0]
    port, data_port = free_port(), free_port()
    log = workdir / f"server_{codec}_{plane}.log"
    server = spawn(server_args(config, overrides, codec, plane, port, data_port), log)
    procs = [server]
    try:
        wait_for_log(log, "listening", server)
        hosts = peer_hosts(relay, [port, data_port], cfg.spes_config.num_peers, procs)
        peers = [
            spawn(peer_args(config, overrides, codec, plane, warmup + rounds + profile, p, hosts[p], port))
            for p in range(cfg.spes_config.num_peers)
        ]
        procs += peers
        pids = [("server", server.pid), ("peer0", peers[0].pid)]
        profile_dir = workdir / f"profile_{codec}_{plane}" if profile else None
        results, profiles = run_rounds(peers, warmup, rounds, pids, profile_dir)
    finally:
        stop(procs)
    return results, profiles, aggregation_seconds(log.read_text())[warmup : warmup + rounds]


def bench_raw(
    up: list[int], down: list[int], warmup: int, rounds: int, relay: Relay | None = None
) -> list[RoundRecord]:
    """The baseline: a raw-socket server and peers moving the same bytes per round as SPES's, with nothing else."""
    port, total = free_port(), warmup + rounds
    server = spawn(
        [str(SCRIPT), "--role=raw-server", f"--port={port}", f"--peers={len(up)}", f"--rounds={total}"]
        + [f"--max-bytes={max(up + down)}"]
    )
    procs = [server]
    try:
        expect_line(server, "LISTENING")
        hosts = peer_hosts(relay, [port], len(up), procs)
        peers = [
            spawn(
                [str(SCRIPT), "--role=raw-peer", f"--host={host}", f"--port={port}", f"--up={u}", f"--down={d}"]
                + [f"--rounds={total}"]
            )
            for host, u, d in zip(hosts, up, down)
        ]
        procs += peers
        results, _ = run_rounds(peers, warmup, rounds, [], None)
    finally:
        stop(procs)
    return results


def round_bytes(spec: RunSpec) -> tuple[list[int], list[int]]:
    """Each peer's (up, down) payload bytes in a plain round of `spec` once every end holds a model (a held-model
    codec's steady state; `RunSpec.round_bytes`)."""
    both = [spec.round_bytes(q, merged=False) for q in range(spec.num_peers)]
    return [up for up, _ in both], [down for _, down in both]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """The command line, with the quick and full defaults filled in; the internal options are the spawned processes'
    (`--role`: this script run again as a peer or as the raw baseline)."""
    p = parser("bench_sync", __doc__)
    p.add_argument("--role", choices=["grpc-peer", "raw-server", "raw-peer"], default=None, help="(internal)")
    p.add_argument("--config", type=Path, default=None, help="(internal) model config of a peer")
    p.add_argument("--override", action="append", default=[], help="(internal) config override of a peer")
    p.add_argument("--peer-id", type=int, default=0, help="(internal)")
    p.add_argument("--host", default="127.0.0.1", help="(internal) the server's address as a peer sees it")
    p.add_argument("--port", type=int, default=0, help="(internal)")
    p.add_argument("--peers", type=int, default=2, help="(internal)")
    p.add_argument("--up", type=int, default=0, help="(internal)")
    p.add_argument("--down", type=int, default=0, help="(internal)")
    p.add_argument("--max-bytes", type=int, default=0, help="(internal)")
    p.add_argument("--codec", choices=sorted(REGISTRY), default="fp32", help="(internal) the run's codec")
    p.add_argument("--plane", choices=["grpc", "tcp"], default="grpc", help="(internal) where tensor payloads go")
    p.add_argument("--rounds", type=int, default=None, help="timed rounds per measurement (default 5, quick 1)")
    p.add_argument("--warmup", type=int, default=None, help="untimed rounds first (default 2, quick 0)")
    p.add_argument(
        "--profile",
        action="store_true",
        help="py-spy profiles of the server and peer 0 in one more, untimed, fp32 round",
    )
    args = p.parse_args(argv)
    args.rounds = args.rounds or (1 if args.quick else 5)
    args.warmup = args.warmup if args.warmup is not None else (0 if args.quick else 2)
    return args


def run_role(args: argparse.Namespace) -> None:
    """One of the processes the orchestrator spawns (`--role`): this script again, so every peer and the raw
    baseline's server run in processes of their own, as on separate machines."""
    if args.role == "grpc-peer":
        addr = f"{args.host}:{args.port}"
        grpc_peer(args.config, args.override, args.peer_id, addr, args.codec, args.rounds, args.plane)
    elif args.role == "raw-server":
        raw_server(args.port, args.peers, args.rounds, args.max_bytes)
    else:
        raw_peer(args.host, args.port, args.up, args.down, args.rounds)


def fastest(rounds: list[RoundRecord]) -> RoundRecord:
    """The least disturbed of the timed rounds: the one SPES and the raw baseline are compared by."""
    return min(rounds, key=lambda x: x["seconds"])


def comparison(
    spes: list[RoundRecord], raw: list[RoundRecord], aggregation: list[float], profiles: dict[str, Any]
) -> dict[str, Any]:
    """One codec and plane's record: SPES's throughput over the raw socket's, also without the server's aggregation
    (work the raw server does not do); refused unless every timed round of both moved the same bytes per peer."""
    moved = {(tuple(x["up_per_peer"]), tuple(x["down_per_peer"])) for x in [*spes, *raw]}
    if len(moved) != 1:
        raise SystemExit(
            f"error: SPES and the raw socket moved different bytes per peer (up, down) in their timed rounds: "
            f"{sorted(moved)}; no ratio written (a held-model codec's first round moves full values: raise --warmup)"
        )
    spes_s, raw_s = fastest(spes)["seconds"], fastest(raw)["seconds"]
    return {
        "spes_rounds": spes,
        "raw_rounds": raw,
        "server_aggregation_s": aggregation,
        "spes_over_raw_throughput": raw_s / spes_s,
        "spes_over_raw_excluding_aggregation": raw_s / max(spes_s - min(aggregation, default=0.0), 1e-9),
        "profiles": profiles,
    }


def measure_codecs(
    config: Path, overrides: list[str], codecs: list[str], warmup: int, rounds: int, workdir: Path, profile: bool
) -> dict[str, Any]:
    """Per codec the raw baseline once, moving the codec's round bytes, and SPES over each plane against it; keyed
    `<codec>_<plane>`. `profile` profiles the fp32 rounds."""
    measurements = {}
    for codec in codecs:
        up, down = round_bytes(node_run(config, overrides, codec)[1])
        raw = bench_raw(up, down, warmup, rounds)
        for plane in ("grpc", "tcp"):
            spes, profiles, aggregation = bench_spes(
                config, overrides, codec, plane, warmup, rounds, workdir, profile and codec == "fp32"
            )
            measurements[f"{codec}_{plane}"] = comparison(spes, raw, aggregation, profiles)
    return measurements


def table_row(key: str, m: dict[str, Any]) -> list[str]:
    """A `comparison`'s line in the printed table: its fastest rounds, SPES's and the raw socket's."""
    best, best_raw = fastest(m["spes_rounds"]), fastest(m["raw_rounds"])
    return [
        *key.rsplit("_", 1),
        f"{best['bytes'] / 1e9:.2f}",
        f"{best['seconds']:.2f}",
        f"{best['gb_s']:.2f}",
        f"{min(m['server_aggregation_s'], default=0.0):.2f}",
        f"{best_raw['seconds']:.2f}",
        f"{best_raw['gb_s']:.2f}",
        f"{m['spes_over_raw_throughput']:.1%}",
        f"{m['spes_over_raw_excluding_aggregation']:.1%}",
    ]


def print_tables(measurements: dict[str, Any]) -> None:
    """SPES against the raw socket per codec and plane, then the hottest lines of each profiled process."""
    print(
        format_table(
            [
                "codec",
                "payloads over",
                "GB moved",
                "SPES round s",
                "GB/s",
                "of which aggregation s",
                "raw TCP s",
                "raw GB/s",
                "SPES / raw",
                "excl. aggregation",
            ],
            [table_row(key, m) for key, m in measurements.items()],
        )
    )
    for key, m in measurements.items():
        for name, prof in m["profiles"].items():
            print(f"\nprofile of the {name} ({key} round, {prof['samples']} samples), hottest lines by own time:")
            for frame, share in prof["own"]:
                print(f"  {share:6.1%}  {frame}")


def main(argv: list[str] | None = None) -> int:
    """The orchestrator (or, with `--role`, one of its processes): every codec and plane measured, the tables
    printed, the record written."""
    args = parse_args(argv)
    if args.role is not None:
        run_role(args)
        return 0
    config, overrides = (QUICK_CONFIG, QUICK_MODEL) if args.quick else (PAPER_1B, FULL_MODEL)
    cfg = load_config(config, overrides)[0]
    manifest = manifest_of(cfg)
    workdir = RESULTS_DIR / ("bench_sync_quick" if args.quick else "bench_sync")
    workdir.mkdir(parents=True, exist_ok=True)
    print(
        f"model: {manifest_bytes(manifest) / 1e9:.2f} GB fp32, {len(manifest)} tensors, "
        f"{cfg.spes_config.num_peers} peers x {cfg.experts_per_block} experts; "
        f"{args.warmup} untimed + {args.rounds} timed round(s) each"
    )
    codecs = ["fp32"] if args.quick else ["fp32", "bf16"]
    measurements = measure_codecs(config, overrides, codecs, args.warmup, args.rounds, workdir, args.profile)
    print_tables(measurements)
    write_results(
        args.out,
        {
            **model_record(args.quick, config, overrides),
            "model_bytes_fp32": manifest_bytes(manifest),
            "warmup_rounds": args.warmup,
            "rounds": args.rounds,
            "measurements": measurements,
        },
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
