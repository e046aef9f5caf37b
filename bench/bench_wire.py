#!/usr/bin/env python
"""Bytes on the wire per peer per round, up and down: SPES (fp32, bf16) vs the reference's scheme vs DiLoCo.

    .venv/bin/python bench/bench_wire.py           # configs/small.yaml measured + the paper's 1B from shapes
    .venv/bin/python bench/bench_wire.py --quick   # configs/tiny.yaml measured + the 1B from shapes

What each scheme moves per peer and round (payload bytes; the selection is the protocol's own
`trainable_names` / `download_names`):
  - SPES (ours): up = shared tensors + the peer's own expert block; down = shared tensors + the other
    peers' blocks, and its own block too on merge rounds (the warm-up changed it); fp32 or bf16.
  - DiLoCo (ours, `--dilico`): every tensor up and down; fp32 or bf16.
  - reference: the first implementation sent the whole fp32 state dict up and down every round.
The 1B figures come from the config's shapes; the small (or tiny) config is also measured through a real
parameter server on loopback (4 `SyncClient`s, one SPES non-merge round, one merge round, one DiLoCo round
per wire dtype) and must equal the analytic figures byte for byte. Framing is measured by serializing the
messages of one upload and reported as overhead: over gRPC (headers, offsets, checksums, ~1 MiB chunks) and over
the raw-TCP data plane (one `TensorHeader` frame and an 8-byte checksum per tensor).
An amortized figure weights merge rounds by how often they occur in the config's run (merge every 500
steps while alpha > 0, alpha decaying to 0 at step 10000: the paper's launch settings).
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from common import MIB, REPO_ROOT, format_table, machine_info, manifest_of, parser, write_results
from spes.config import TrainConfig, load_config
from spes.model import Transformer
from spes.sync.client import SyncClient
from spes.sync.merge import MergeConfig, Mode, download_names, round_alpha, trainable_names
from spes.sync.plane_tcp import framing_bytes, tensor_header
from spes.sync.proto import spes_pb2 as pb
from spes.sync.server import ServerConfig, start_server
from spes.sync.wire import encode_tensors, payload_bytes

PAPER_1B = REPO_ROOT / "configs" / "spes_1b" / "node_0.yaml"
PAPER_MERGE = MergeConfig(interval=500, alpha_start=0.05, decay_steps=10000, topk=4)
GRPC_PREFIX = 5  # gRPC length-prefixed message: 1 flag byte + 4 length bytes
SCHEMES = ("spes_fp32", "spes_bf16", "diloco_fp32", "diloco_bf16", "reference_fp32")


def configs(path: Path) -> dict[Mode, TrainConfig]:
    return {"spes": load_config(path)[0], "diloco": load_config(path, ["--using_dilico=true"])[0]}


def round_bytes(
    manifest: Mapping[str, tuple[int, ...]], mode: Mode, wire: str, peer: int, merged: bool
) -> tuple[int, int]:
    """(up, down) payload bytes of one peer in one round."""
    names = list(manifest)
    up = sum(payload_bytes(manifest[n], wire) for n in trainable_names(names, peer, mode))
    down = sum(payload_bytes(manifest[n], wire) for n in download_names(names, peer, mode, merged))
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
    total_fp32 = sum(payload_bytes(s, "fp32") for s in full_manifest.values())
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
    """Real rounds through a real server on loopback: 4 peers, per mode and wire dtype; the clients' byte counters."""
    cfgs = configs(path)
    merge = MergeConfig(interval=2, alpha_start=0.05, decay_steps=1000)
    measured: dict[str, Any] = {}
    for mode, cfg in cfgs.items():
        with torch.device("meta"):
            model = Transformer.for_run(cfg)
        model.to_empty(device="cpu")
        model.init_weights(cfg.seed)
        state = {n: p.detach() for n, p in model.named_parameters()}
        manifest = {n: tuple(t.shape) for n, t in state.items()}
        peers = cfg.spes_config.num_peers
        for wire in ("fp32", "bf16"):
            server = start_server(
                ServerConfig(
                    num_peers=peers,
                    experts_per_peer=cfg.experts_per_peer,
                    host="127.0.0.1",
                    port=0,
                    mode=mode,
                    merge=merge,
                )
            )
            clients = [
                SyncClient(
                    f"127.0.0.1:{server.port}",
                    peer_id=p,
                    num_peers=peers,
                    experts_per_peer=cfg.experts_per_peer,
                    mode=mode,
                    wire_dtype=wire,
                )
                for p in range(peers)
            ]
            try:
                for p, client in enumerate(clients):
                    client.join(manifest, trainable_names(list(manifest), p, mode))
                for step in (1, 2) if mode == "spes" else (1,):  # step 2 is a merge round (interval 2)
                    stats = _round(clients, step, state, mode)
                    measured[f"{mode}_{wire}_{'merge' if step == 2 else 'plain'}"] = [
                        {"peer": p, "up": s.bytes_up, "down": s.bytes_down, "merged": s.merged, "seconds": s.seconds}
                        for p, s in enumerate(stats)
                    ]
                status = clients[0].status()
                measured[f"{mode}_{wire}_server_counters"] = {
                    "bytes_in": status.bytes_in,
                    "bytes_out": status.bytes_out,
                }
            finally:
                for client in clients:
                    client.close()
                server.stop(grace_s=0.5)
    return measured


def _round(clients: list[SyncClient], step: int, state: dict[str, torch.Tensor], mode: Mode) -> list[Any]:
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
        data_plane += payload_bytes(manifest[name], wire) + framing_bytes(tensor_header(name, manifest[name], wire))
    return {"payload": payload, "serialized": serialized, "data_plane": data_plane}


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
        mode, wire, _ = key.split("_")
        for m in per_peer:
            up, down = round_bytes(manifests[mode], mode, wire, m["peer"], merged=m["merged"])  # type: ignore[arg-type,index]
            checks.append(
                {
                    "round": key,
                    "peer": m["peer"],
                    "up": m["up"],
                    "down": m["down"],
                    "analytic_up": up,
                    "analytic_down": down,
                    "equal": (m["up"], m["down"]) == (up, down),
                }
            )
    rows = [
        [c["round"], c["peer"], f"{c['up'] / MIB:.2f}", f"{c['down'] / MIB:.2f}", "yes" if c["equal"] else "NO"]
        for c in checks
    ]
    print(f"\nmeasured through a real server on loopback ({config.relative_to(REPO_ROOT)}, 4 peers):")
    print(format_table(["round", "peer", "up MiB", "down MiB", "= analytic"], rows))
    framing = {wire: framing_overhead(config, wire) for wire in ("fp32", "bf16")}
    for wire, f in framing.items():
        for plane, key in (("gRPC", "serialized"), ("data plane", "data_plane")):
            print(
                f"framing of one {wire} upload over {plane}: {f[key] - f['payload']:,} bytes over {f['payload']:,} "
                f"({100 * (f[key] - f['payload']) / f['payload']:.4f}%)"
            )

    s = paper["schemes"]
    targets = {
        "spes_bf16_over_reference": s["spes_bf16"]["up_plus_down"] / s["reference_fp32"]["up_plus_down"],
        "spes_bf16_saving_vs_diloco_bf16": 1 - s["spes_bf16"]["up_plus_down"] / s["diloco_bf16"]["up_plus_down"],
        "spes_fp32_saving_vs_diloco_fp32": 1 - s["spes_fp32"]["up_plus_down"] / s["diloco_fp32"]["up_plus_down"],
        "spes_bf16_saving_vs_diloco_fp32": 1 - s["spes_bf16"]["up_plus_down"] / s["diloco_fp32"]["up_plus_down"],
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
            "checks": checks,
            "framing": framing,
            "targets": targets,
        },
    )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
