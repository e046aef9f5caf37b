#!/usr/bin/env python
"""Peak memory of the parameter server process against model size and number of peers.

    .venv/bin/python bench/bench_server_memory.py            # 256 MB and 1 GB models, 2 and 4 peers, 3 rounds
    .venv/bin/python bench/bench_server_memory.py --quick    # a 16 MB model, 2 peers, 2 rounds (seconds)

Each case starts a real `python -m spes.server` (SPES mode, persisting every round under a temporary
--state_dir) and runs its peers as threads of this process with `SyncClient`. The synthetic model is named
like the real one (shared attention/embedding tensors and `blocks.{l}.ffn.experts.{w1,v1,w2}.{b}` ownership
blocks, one per peer), half shared and half experts by bytes, so each peer uploads half the model plus its
block. The server's peak RSS (`VmHWM` from /proc) is read after the last round and compared with its RSS
when idle, with the model size M and with the design bound: the previous global model plus every staged
upload of a round (M + sum of uploads; the new global model replaces the uploads as they are consumed).
Prints a table and writes bench/results/bench_server_memory.json.
"""

from __future__ import annotations

import shutil
import signal
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

from common import MIB, format_table, machine_info, manifest_bytes, parser, spec_overrides, start_server, write_results
from spes.config import ServerSection, SpesConfig
from spes.sync.client import SyncClient
from spes.sync.spec import RunSpec

LAYERS, WIDTH = 4, 1024


def synthetic_manifest(model_mb: int, peers: int) -> dict[str, tuple[int, ...]]:
    """About `model_mb` MiB of fp32 tensors: half shared (qkv-like), half expert blocks (one expert per peer)."""
    per_layer = model_mb * MIB // 4 // LAYERS // 2  # elements per layer for each half
    rows = max(1, per_layer // WIDTH)
    ffn = max(1, per_layer // (3 * peers * WIDTH))
    manifest: dict[str, tuple[int, ...]] = {}
    for layer in range(LAYERS):
        manifest[f"blocks.{layer}.attn.qkv.weight"] = (rows, WIDTH)
        manifest[f"blocks.{layer}.ffn.router.weight"] = (peers, WIDTH)
        for block in range(peers):
            manifest[f"blocks.{layer}.ffn.experts.w1.{block}"] = (1, WIDTH, ffn)
            manifest[f"blocks.{layer}.ffn.experts.v1.{block}"] = (1, WIDTH, ffn)
            manifest[f"blocks.{layer}.ffn.experts.w2.{block}"] = (1, ffn, WIDTH)
    return manifest


def synthetic_run(model_mb: int, peers: int) -> RunSpec:
    """The run of `synthetic_manifest`: one expert per block, peer b owning block b, no merge warm-up."""
    return RunSpec(
        mode="spes",
        num_peers=peers,
        experts_per_block=1,
        block_owners=tuple(range(peers)),
        sync_steps=1,
        manifest=synthetic_manifest(model_mb, peers),
        server=ServerSection(merge_interval=0),
    )


def proc_memory(pid: int) -> dict[str, int]:
    """Current and peak resident bytes of a live process (VmRSS, VmHWM)."""
    fields = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines() if ":" in line)
    return {"rss": int(fields["VmRSS"].split()[0]) * 1024, "peak": int(fields["VmHWM"].split()[0]) * 1024}


def bench_case(model_mb: int, peers: int, rounds: int, workdir: Path) -> dict[str, Any]:
    spec = synthetic_run(model_mb, peers)
    manifest = spec.manifest or {}
    trainable = {p: spec.trainable(p) for p in range(peers)}
    gen = torch.Generator().manual_seed(0)
    values = {n: torch.randn(s, generator=gen) for n, s in manifest.items()}  # NOTE: peers share shared tensors
    proc, port = start_server(
        [*spec_overrides(spec), "--state_dir", str(workdir / f"state-{model_mb}-{peers}")],
        workdir / f"server-{model_mb}-{peers}.log",
    )
    try:
        time.sleep(1.0)
        idle = proc_memory(proc.pid)["rss"]
        settings = SpesConfig(server_addr=f"127.0.0.1:{port}", rpc_timeout_s=60, round_timeout_s=600)
        clients = [SyncClient(spec, p, settings) for p in range(peers)]
        for client in clients:
            client.join()
        seconds = []
        with ThreadPoolExecutor(peers) as pool:
            for step in range(1, rounds + 1):
                start = time.perf_counter()
                futures = [
                    pool.submit(c.sync, step, {n: values[n] for n in trainable[p]}) for p, c in enumerate(clients)
                ]
                for future in futures:
                    future.result(timeout=600)
                del futures
                seconds.append(time.perf_counter() - start)
        after = proc_memory(proc.pid)
        for client in clients:
            client.close()
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)
    model = manifest_bytes(manifest)
    uploads = sum(manifest_bytes(manifest, trainable[p]) for p in range(peers))
    grown = after["peak"] - idle
    return {
        "model_mb": model / MIB,
        "peers": peers,
        "upload_mb_per_peer": uploads / peers / MIB,
        "staged_mb": uploads / MIB,
        "idle_rss_mb": idle / MIB,
        "peak_rss_mb": after["peak"] / MIB,
        "end_rss_mb": after["rss"] / MIB,
        "peak_over_idle_mb": grown / MIB,
        "peak_over_idle_per_model": grown / model,
        "bound_mb": (model + uploads) / MIB,
        "peak_over_idle_per_bound": grown / (model + uploads),
        "seconds_per_round": seconds,
    }


def main(argv: list[str] | None = None) -> int:
    p = parser("bench_server_memory", __doc__)
    p.add_argument("--sizes_mb", type=int, nargs="+", help="model sizes, MiB of fp32 (default 256 1024; quick 16)")
    p.add_argument("--peers", type=int, nargs="+", help="peer counts (default 2 4; quick 2)")
    p.add_argument(
        "--rounds", type=int, help="rounds per case, the first without a previous global model (default 3; quick 2)"
    )
    args = p.parse_args(argv)
    args.sizes_mb = args.sizes_mb or ([16] if args.quick else [256, 1024])
    args.peers = args.peers or ([2] if args.quick else [2, 4])
    args.rounds = args.rounds or (2 if args.quick else 3)
    workdir = Path(tempfile.mkdtemp(prefix="bench_server_memory-"))
    try:
        cases = [bench_case(size, peers, args.rounds, workdir) for size in args.sizes_mb for peers in args.peers]
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    headers = [
        "model MB",
        "peers",
        "staged MB",
        "idle RSS",
        "peak RSS",
        "peak-idle",
        "/ model",
        "bound MB",
        "/ bound",
        "s/round",
    ]
    rows = [
        [
            c["model_mb"],
            c["peers"],
            c["staged_mb"],
            c["idle_rss_mb"],
            c["peak_rss_mb"],
            c["peak_over_idle_mb"],
            c["peak_over_idle_per_model"],
            c["bound_mb"],
            c["peak_over_idle_per_bound"],
            sum(c["seconds_per_round"]) / len(c["seconds_per_round"]),
        ]
        for c in cases
    ]
    print("parameter server peak memory (bound = previous global model + every staged upload of a round)")
    print(format_table(headers, rows))
    record = {"mode": "quick" if args.quick else "full", "machine": machine_info(), "rounds": args.rounds}
    write_results(args.out, {**record, "cases": cases})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
