#!/usr/bin/env python
"""Bytes on the wire per peer per round, up and down: SPES (fp32, bf16, int8) vs the reference's scheme vs DiLoCo.

    .venv/bin/python bench/bench_wire.py           # configs/small.yaml measured + the paper's 1B, int8 measured too
    .venv/bin/python bench/bench_wire.py --quick   # configs/tiny.yaml measured + the 1B from shapes

What each scheme moves per peer and round (payload bytes; the selection is the protocol's own
`trainable_names` / `download_names`):
  - SPES (ours): up = shared tensors + the peer's own expert block; down = shared tensors + the other
    peers' blocks, and its own block too on merge rounds (the warm-up changed it); fp32, bf16, or int8 deltas
    (`spes.sync.deltas`: n int8 values + ceil(n / 256) fp32 scales per tensor, after a first round of full fp32
    values that every run pays once).
  - DiLoCo (ours, `--dilico`): every tensor up and down; fp32 or bf16.
  - reference: the first implementation sent the whole fp32 state dict up and down every round.
The 1B figures come from the config's shapes; the small (or tiny) config is also measured through a real
parameter server on loopback (4 `SyncClient`s, one SPES non-merge round, one merge round, one DiLoCo round
per wire dtype; int8 after its first, full round) and must equal the analytic figures byte for byte. The full
run also measures int8 on the paper's 1B manifest through real servers: in slices (each layer's tensors with the
run's 4 peers; embedding, LM head and final norm, which every peer uploads and downloads alike, with one peer),
since a whole 1B round does not fit this machine's memory; the slices' bytes sum to the 1B round's. Framing is
measured by serializing the messages of one upload and reported as overhead: over gRPC (headers, offsets, checksums,
~1 MiB chunks) and over the raw-TCP data plane (one `TensorHeader` frame and an 8-byte checksum per tensor).
An amortized figure weights merge rounds by how often they occur in the config's run (merge every 500
steps while alpha > 0, alpha decaying to 0 at step 10000: the paper's launch settings).
"""

from __future__ import annotations

import math
import multiprocessing
import resource
import sys
import tempfile
import threading
from collections.abc import Iterator, Mapping
from concurrent.futures import ProcessPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

import common
from common import MIB, REPO_ROOT, format_table, machine_info, manifest_of, parser, write_results
from spes.config import TrainConfig, load_config
from spes.model import Transformer
from spes.sync import compress
from spes.sync.client import SyncClient
from spes.sync.merge import MergeConfig, Mode, download_names, round_alpha, trainable_names
from spes.sync.plane_tcp import framing_bytes
from spes.sync.proto import spes_pb2 as pb
from spes.sync.server import ServerConfig, start_server
from spes.sync.wire import encode_tensors, header_for, payload_bytes

PAPER_1B = REPO_ROOT / "configs" / "spes_1b" / "node_0.yaml"
PAPER_MERGE = MergeConfig(interval=500, alpha_start=0.05, decay_steps=10000, topk=4)
GRPC_PREFIX = 5  # gRPC length-prefixed message: 1 flag byte + 4 length bytes
SCHEMES = ("spes_fp32", "spes_bf16", "spes_int8", "diloco_fp32", "diloco_bf16", "reference_fp32")
INT8_TARGET = 0.16
"""Issue 16.3: SPES with int8 deltas moves at most this share of the reference's bytes per peer and round."""


def configs(path: Path) -> dict[Mode, TrainConfig]:
    return {"spes": load_config(path)[0], "diloco": load_config(path, ["--using_dilico=true"])[0]}


def tensor_bytes(shape: tuple[int, ...], wire: str) -> int:
    """Payload bytes of one tensor on `wire` (int8: a delta in blocks of `compress.DEFAULT_BLOCK`)."""
    if wire == "int8":
        return compress.payload_bytes(math.prod(shape), compress.DEFAULT_BLOCK)
    return payload_bytes(shape, wire)


def round_bytes(
    manifest: Mapping[str, tuple[int, ...]], mode: Mode, wire: str, peer: int, merged: bool, first: bool = False
) -> tuple[int, int]:
    """(up, down) payload bytes of one peer in one round; `first`: an int8 wire's first round, full fp32 values
    both ways (every tensor down)."""
    names = list(manifest)
    if first and wire == "int8":
        return round_bytes(manifest, mode, "fp32", peer, merged=True)
    up = sum(tensor_bytes(manifest[n], wire) for n in trainable_names(names, peer, mode))
    down = sum(tensor_bytes(manifest[n], wire) for n in download_names(names, peer, mode, merged))
    return up, down


def merge_round_share(cfg: TrainConfig, merge: MergeConfig) -> tuple[int, int]:
    """(merge rounds, all rounds) over the config's run."""
    steps = range(cfg.spes_config.sync_steps, cfg.max_steps + 1, cfg.spes_config.sync_steps)
    merges = sum(round_alpha(s, "spes", merge) > 0 for s in steps)
    return merges, len(steps)


def analytic_table(path: Path, merge: MergeConfig) -> dict[str, Any]:
    """Per-peer bytes of every scheme for peer 0 (every peer's block has the same size when P*k == E)."""
    cfgs = configs(path)
    spes_manifest, full_manifest = manifest_of(cfgs["spes"]), manifest_of(cfgs["diloco"])
    merges, rounds = merge_round_share(cfgs["spes"], merge)
    total_fp32 = sum(tensor_bytes(s, "fp32") for s in full_manifest.values())
    out: dict[str, Any] = {
        "rounds_in_run": rounds,
        "merge_rounds_in_run": merges,
        "model_bytes_fp32": total_fp32,
        "schemes": {},
    }
    for scheme in SCHEMES:
        kind, wire = scheme.split("_")
        if kind == "reference":
            up = down = down_merge = total_fp32
        elif kind == "spes":
            up, down = round_bytes(spes_manifest, "spes", wire, 0, merged=False)
            down_merge = round_bytes(spes_manifest, "spes", wire, 0, merged=True)[1]
        else:
            up, down = round_bytes(full_manifest, "diloco", wire, 0, merged=False)
            down_merge = down
        amortized_down = (merges * down_merge + (rounds - merges) * down) / rounds
        out["schemes"][scheme] = {
            "up": up,
            "down": down,
            "down_merge_round": down_merge,
            "up_plus_down": up + down,
            "amortized_up_plus_down": up + amortized_down,
        }
    return out


def measure_rounds(path: Path) -> dict[str, Any]:
    """Real rounds through a real server on loopback: 4 peers, per mode and wire dtype; the clients' byte counters.

    Keys `<mode>_<wire>_<round>`: `plain`, `merge` (step 2, merge interval 2), and on an int8 wire `first` (its
    full round; the plain round is then step 3).
    """
    cfgs = configs(path)
    measured: dict[str, Any] = {}
    for mode, cfg in cfgs.items():
        with torch.device("meta"):
            model = Transformer.for_run(cfg)
        model.to_empty(device="cpu")
        model.init_weights(cfg.seed)
        state = {n: p.detach() for n, p in model.named_parameters()}
        for wire in ("fp32", "bf16", "int8") if mode == "spes" else ("fp32", "bf16"):
            steps = {1: "plain", 2: "merge"} if mode == "spes" else {1: "plain"}
            if wire == "int8":
                steps = {1: "first", 2: "merge", 3: "plain"}
            with real_run(state, cfg.spes_config.num_peers, cfg.experts_per_peer, mode, wire) as clients:
                for step, kind in steps.items():
                    measured[f"{mode}_{wire}_{kind}"] = [
                        {"peer": p, "up": s.bytes_up, "down": s.bytes_down, "merged": s.merged, "seconds": s.seconds}
                        for p, s in enumerate(run_round(clients, step, state, mode))
                    ]
                status = clients[0].status()
                measured[f"{mode}_{wire}_server_counters"] = {
                    "bytes_in": status.bytes_in,
                    "bytes_out": status.bytes_out,
                }
    return measured


MERGE = MergeConfig(interval=2, alpha_start=0.05, decay_steps=1000)
"""The measured runs' merge warm-up: step 2 is a merge round."""


@contextmanager
def real_run(
    state: dict[str, torch.Tensor], peers: int, experts_per_peer: int, mode: Mode, wire: str
) -> Iterator[list[SyncClient]]:
    """A real server on loopback (merging on even steps) and its `peers` clients, joined with `state`'s manifest."""
    server = start_server(
        ServerConfig(
            num_peers=peers,
            experts_per_peer=experts_per_peer,
            host="127.0.0.1",
            port=0,
            mode=mode,
            merge=MERGE,
            wire_dtype="int8" if wire == "int8" else "fp32",
        )
    )
    try:
        with joined(f"127.0.0.1:{server.port}", state, peers, experts_per_peer, mode, wire) as clients:
            yield clients
    finally:
        server.stop(grace_s=0.5)


@contextmanager
def joined(
    addr: str, state: dict[str, torch.Tensor], peers: int, experts_per_peer: int, mode: Mode, wire: str
) -> Iterator[list[SyncClient]]:
    """`peers` clients of the server at `addr`, joined with `state`'s manifest."""
    clients = [
        SyncClient(addr, peer_id=p, num_peers=peers, experts_per_peer=experts_per_peer, mode=mode, wire_dtype=wire)
        for p in range(peers)
    ]
    manifest = {n: tuple(t.shape) for n, t in state.items()}
    try:
        for p, client in enumerate(clients):
            client.join(manifest, trainable_names(list(manifest), p, mode))
        yield clients
    finally:
        for client in clients:
            client.close()


def measure_paper_int8(path: Path) -> dict[str, Any]:
    """SPES int8 on the paper's 1B manifest through real servers, slice by slice (see the module docstring):
    per slice the first (full) round, a merge round (step 2) and a plain round (step 3); peer 0's bytes.

    Each slice runs in fresh processes (a server process, and one for its clients), so no slice's memory (a server's
    buffers, four clients' held models) is still held when the next starts; their peaks are recorded.
    """
    manifest = manifest_of(configs(path)["spes"])
    layers = sorted({int(n.split(".")[1]) for n in manifest if n.startswith("blocks.")})
    slices = {f"layer {layer}": [n for n in manifest if n.startswith(f"blocks.{layer}.")] for layer in layers}
    rest = [n for n in manifest if not n.startswith("blocks.")]
    slices.update({name: [name] for name in rest if math.prod(manifest[name]) > 1 << 20})
    slices["other shared"] = [n for n in rest if math.prod(manifest[n]) <= 1 << 20]
    per_slice: dict[str, Any] = {}
    spawn = multiprocessing.get_context("spawn")
    with tempfile.TemporaryDirectory() as logs:
        for label, names in slices.items():
            with ProcessPoolExecutor(1, mp_context=spawn) as pool:
                per_slice[label] = got = pool.submit(measure_slice, path, names, Path(logs)).result()
            print(
                f"  1B int8, {label}: {len(names)} tensors, {got['peers']} peer(s): plain round up "
                f"{got['plain']['up'] / MIB:,.1f} MiB, down {got['plain']['down'] / MIB:,.1f} MiB (peak memory: "
                f"clients {got['peak_rss_clients'] / 2**30:.2f} GiB, server {got['peak_rss_server'] / 2**30:.2f} GiB)",
                flush=True,
            )
    totals = {
        kind: {way: sum(v[kind][way] for v in per_slice.values()) for way in ("up", "down")}
        for kind in ("first", "merge", "plain")
    }
    return {"slices": per_slice, "totals": totals}


def measure_slice(path: Path, names: list[str], logs: Path) -> dict[str, Any]:
    """Three real int8 rounds over the tensors `names` of the config's model, served by a server process: peer 0's
    bytes per round and both processes' peak resident memory. The run's peers when the slice holds expert blocks,
    else one."""
    torch.set_num_threads(1)
    cfg = configs(path)["spes"]
    manifest = manifest_of(cfg)
    gen = torch.Generator().manual_seed(cfg.seed)
    state = {n: torch.randn(manifest[n], generator=gen) * 0.02 for n in names}
    experts = any(n not in trainable_names(names, 1, "spes") for n in names)  # another peer's blocks are here
    peers = cfg.spes_config.num_peers if experts else 1
    k = cfg.experts_per_peer
    layout = ["--total_peers", str(peers), "--num_train_experts_per_node", str(k), "--wire_dtype", "int8"]
    merge = ["--merge_interval", str(MERGE.interval), "--merge_alpha_start", str(MERGE.alpha_start)]
    merge += ["--merge_decay_steps", str(MERGE.decay_steps)]
    server, port = common.start_server([*layout, *merge, "--data_port", "0"], logs / "server.log")
    try:
        with joined(f"127.0.0.1:{port}", state, peers, k, "spes", "int8") as clients:
            steps = ((1, "first"), (2, "merge"), (3, "plain"))
            rounds = {kind: run_round(clients, step, state, "spes")[0] for step, kind in steps}
        server_peak = proc_peak_rss(server.pid)
    finally:
        server.terminate()
        server.wait(timeout=60)
    return {
        "tensors": len(names),
        "peers": peers,
        **{kind: {"up": s.bytes_up, "down": s.bytes_down} for kind, s in rounds.items()},
        "peak_rss_clients": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "peak_rss_server": server_peak,
    }


def proc_peak_rss(pid: int) -> int:
    """A live process's peak resident memory (VmHWM), in bytes."""
    status = Path(f"/proc/{pid}/status").read_text()
    return int(next(line for line in status.splitlines() if line.startswith("VmHWM:")).split()[1]) * 1024


def run_round(clients: list[SyncClient], step: int, state: dict[str, torch.Tensor], mode: Mode) -> list[Any]:
    """Every peer's `sync` at once (one thread each), as in a real round."""
    results: list[Any] = [None] * len(clients)
    errors: list[BaseException] = []

    def run(p: int) -> None:
        try:
            upload = {n: state[n] for n in trainable_names(list(state), p, mode)}
            results[p] = clients[p].sync(step, upload)[1]
        except BaseException as exc:  # surfaced below
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(p,)) for p in range(len(clients))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    if errors:
        raise errors[0]
    return results


def framing_overhead(path: Path, wire: str) -> dict[str, int]:
    """Serialized size of one SPES upload of peer 0 against its payload: over gRPC (protobuf messages + gRPC
    prefixes) and over the raw-TCP data plane (a `TensorHeader` frame and the 8-byte checksum per tensor)."""
    cfg = configs(path)["spes"]
    manifest = manifest_of(cfg)
    names = trainable_names(list(manifest), 0, "spes")
    payload = serialized = data_plane = 0
    for name in names:
        for chunk in encode_tensors({name: torch.zeros(manifest[name])}, wire):
            payload += len(chunk.data)
            serialized += pb.UploadMessage(chunk=chunk).ByteSize() + GRPC_PREFIX
        header = header_for(name, torch.empty(manifest[name], device="meta"), wire)
        data_plane += payload_bytes(manifest[name], wire) + framing_bytes(header)
    return {"payload": payload, "serialized": serialized, "data_plane": data_plane}


def check(label: str, peer: int, got: tuple[int, int], want: tuple[int, int]) -> dict[str, Any]:
    """One measured (up, down) against the analytic figure."""
    return {
        "round": label,
        "peer": peer,
        "up": got[0],
        "down": got[1],
        "analytic_up": want[0],
        "analytic_down": want[1],
        "equal": got == want,
    }


def rows_of(c: dict[str, Any]) -> list[Any]:
    return [c["round"], c["peer"], f"{c['up'] / MIB:,.2f}", f"{c['down'] / MIB:,.2f}", "yes" if c["equal"] else "NO"]


def print_scheme_table(title: str, table: dict[str, Any]) -> None:
    ref = table["schemes"]["reference_fp32"]["up_plus_down"]
    dil = table["schemes"]["diloco_fp32"]["up_plus_down"]
    rows = []
    for scheme, v in table["schemes"].items():
        rows.append(
            [
                scheme,
                f"{v['up'] / MIB:,.1f}",
                f"{v['down'] / MIB:,.1f}",
                f"{v['down_merge_round'] / MIB:,.1f}",
                f"{v['up_plus_down'] / MIB:,.1f}",
                f"{v['amortized_up_plus_down'] / MIB:,.1f}",
                f"{v['up_plus_down'] / ref:.3f}",
                f"{v['up_plus_down'] / dil:.3f}",
            ]
        )
    print(f"\n{title} (per peer per round; {table['merge_rounds_in_run']} merge rounds of {table['rounds_in_run']}):")
    print(
        format_table(
            [
                "scheme",
                "up MiB",
                "down MiB",
                "down (merge) MiB",
                "up+down MiB",
                "amortized MiB",
                "/ reference",
                "/ DiLoCo fp32",
            ],
            rows,
        )
    )


def main(argv: list[str] | None = None) -> int:
    p = parser("bench_wire", __doc__)
    p.add_argument("--config", type=Path, default=None, help="config measured for real (default: small, quick: tiny)")
    args = p.parse_args(argv)
    config = args.config or REPO_ROOT / "configs" / ("tiny.yaml" if args.quick else "small.yaml")

    paper = analytic_table(PAPER_1B, PAPER_MERGE)
    small = analytic_table(config, PAPER_MERGE)
    print_scheme_table(f"paper 1B ({PAPER_1B.relative_to(REPO_ROOT)}), from shapes", paper)
    print_scheme_table(f"{config.relative_to(REPO_ROOT)}, from shapes", small)

    measured = measure_rounds(config)
    manifests = {mode: manifest_of(cfg) for mode, cfg in configs(config).items()}
    checks = []
    for key, per_peer in measured.items():
        if key.endswith("server_counters"):
            continue
        mode, wire, kind = key.split("_")
        for m in per_peer:
            up, down = round_bytes(manifests[mode], mode, wire, m["peer"], m["merged"], kind == "first")  # type: ignore[arg-type,index]
            checks.append(check(key, m["peer"], (m["up"], m["down"]), (up, down)))
    print(f"\nmeasured through a real server on loopback ({config.relative_to(REPO_ROOT)}, 4 peers):")
    print(format_table(["round", "peer", "up MiB", "down MiB", "= analytic"], [rows_of(c) for c in checks]))
    framing = {wire: framing_overhead(config, wire) for wire in ("fp32", "bf16")}
    for wire, f in framing.items():
        for plane, key in (("gRPC", "serialized"), ("data plane", "data_plane")):
            print(
                f"framing of one {wire} upload over {plane}: {f[key] - f['payload']:,} bytes over {f['payload']:,} "
                f"({100 * (f[key] - f['payload']) / f['payload']:.4f}%)"
            )

    paper_int8 = None if args.quick else measure_paper_int8(PAPER_1B)
    if paper_int8 is not None:
        paper_manifest = manifest_of(configs(PAPER_1B)["spes"])
        for kind, got in paper_int8["totals"].items():
            want = round_bytes(paper_manifest, "spes", "int8", 0, kind == "merge", kind == "first")
            checks.append(check(f"paper_1b_int8_{kind}", 0, (got["up"], got["down"]), want))
        print(format_table(["round", "peer", "up MiB", "down MiB", "= analytic"], [rows_of(c) for c in checks[-3:]]))

    s = paper["schemes"]
    targets = {
        "spes_bf16_over_reference": s["spes_bf16"]["up_plus_down"] / s["reference_fp32"]["up_plus_down"],
        "spes_bf16_saving_vs_diloco_bf16": 1 - s["spes_bf16"]["up_plus_down"] / s["diloco_bf16"]["up_plus_down"],
        "spes_fp32_saving_vs_diloco_fp32": 1 - s["spes_fp32"]["up_plus_down"] / s["diloco_fp32"]["up_plus_down"],
        "spes_bf16_saving_vs_diloco_fp32": 1 - s["spes_bf16"]["up_plus_down"] / s["diloco_fp32"]["up_plus_down"],
        "spes_int8_over_reference": s["spes_int8"]["up_plus_down"] / s["reference_fp32"]["up_plus_down"],
        "spes_int8_amortized_over_reference": s["spes_int8"]["amortized_up_plus_down"]
        / s["reference_fp32"]["up_plus_down"],
    }
    print(
        "\npaper 1B: SPES bf16 / reference = {:.3f} (target <= 0.5); SPES saves {:.1%} vs DiLoCo at the same wire "
        "dtype (target >= 33.3%), {:.1%} vs DiLoCo fp32".format(
            targets["spes_bf16_over_reference"],
            targets["spes_bf16_saving_vs_diloco_bf16"],
            targets["spes_bf16_saving_vs_diloco_fp32"],
        )
    )
    ok = all(c["equal"] for c in checks)
    if paper_int8 is not None:
        totals, reference = paper_int8["totals"], s["reference_fp32"]["up_plus_down"]
        merges, rounds = paper["merge_rounds_in_run"], paper["rounds_in_run"]
        down = (merges * totals["merge"]["down"] + (rounds - merges) * totals["plain"]["down"]) / rounds
        targets["measured_spes_int8_over_reference"] = (totals["plain"]["up"] + totals["plain"]["down"]) / reference
        targets["measured_spes_int8_amortized_over_reference"] = (totals["plain"]["up"] + down) / reference
        ok = ok and targets["measured_spes_int8_amortized_over_reference"] <= INT8_TARGET
        print(
            "paper 1B, SPES int8 measured through real servers: {:.4f} of the reference's fp32 bytes per peer and "
            "round ({:.4f} amortized over merge rounds; target <= {}); the first round moves full fp32 values".format(
                targets["measured_spes_int8_over_reference"],
                targets["measured_spes_int8_amortized_over_reference"],
                INT8_TARGET,
            )
        )
    print(f"measured = analytic for every peer and round: {'yes' if ok else 'NO'}")
    write_results(
        args.out,
        {
            "mode": "quick" if args.quick else "full",
            "machine": machine_info(),
            "config": str(config.relative_to(REPO_ROOT)),
            "paper_1b": paper,
            "measured_config": small,
            "measured": measured,
            "paper_1b_int8_measured": paper_int8,
            "checks": checks,
            "framing": framing,
            "targets": targets,
        },
    )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
