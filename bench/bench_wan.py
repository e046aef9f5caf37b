#!/usr/bin/env python
"""Sync over emulated internet links: round time against the link's ideal, per link speed, wire dtype and plane.

    .venv/bin/python bench/bench_wan.py              # 1000, 100 and 20 Mbit/s, RTT 50 ms, 4 peers (~15 min)
    .venv/bin/python bench/bench_wan.py --quick      # 100 Mbit/s, a 1/768 model, bf16 over the data plane, one round

Each peer reaches `python -m spes.server` through bench/link_relay.py: its own link of the speed measured
(`--speeds`) each way plus the server's link, shared by all peers, of the same speed (`--server_factor` scales it),
and a one-way delay of RTT/2 (`--rtt_ms`). The round is the real one (bench/bench_sync.py's peer processes:
`SyncClient.sync` with the paper's tensor names and shapes). The ideal round is what the link allows for the bytes
the peers reported moving: `max(max_i up_i / peer_rate, sum_i up_i / server_rate) + RTT` for the uploads, the same
for the downloads, so `bytes / bandwidth + 2 RTT`; efficiency = ideal / measured. A raw socket moving the same byte
counts through the same relay, in the same run, shows what the emulated link itself delivers.

Models: the paper's 1B layout (16 experts, 4 peers x 4) scaled down so a round takes seconds, with the
ratios between embeddings, attention and experts kept: one layer and the vocabulary / 12 is 1/12 of the 1B
model; halving d_model and the expert width and the vocabulary again gives 1/48, 1/192, 1/768. bf16 uses 1/12
(1 Gbit/s), 1/192 (100 Mbit/s) and 1/768 (20 Mbit/s); a wire that moves fewer bytes runs on the smallest model
whose ideal round is at least as long as bf16's there, so that round trips weigh as little in its efficiency as in
bf16's and as on the 1B model, among the models whose first round (a held-model codec's full fp32 values, the whole
model down) the link carries within `FIRST_ROUND_S` (`scale_for`).

From the measured efficiency the benchmark predicts the full 1B model's round at each speed (its bytes per
peer from its manifest, divided by the ideal rate, over the efficiency measured at that speed) and the
fraction of a node's wall time spent not training per `sync_steps`, from the measured seconds of one
optimizer step of that config: `--measure_step N --device cuda` times N real steps of node 0
(bench/bench_train.py's node) at the config's own batch, micro-batch and amp_bf16 on one GPU; on the CPU
(fp32) it times one-sequence steps and scales the median to the config's 256 sequences per step (the
optimizer step is then counted once per sequence, which overstates it slightly); `--step_s` takes a figure
measured elsewhere, and `--from_json` the links measured by an earlier run, as they were measured (the flags that
shape a measurement are refused with it).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from bench_sync import bench_raw, bench_spes, expect_line, fastest, node_run, round_bytes, spawn
from bench_train import build_variant, timed_step
from bench_wire import round_bytes as peer_round_bytes
from common import (
    PAPER_1B,
    REPO_ROOT,
    RESULTS_DIR,
    format_table,
    idle_share,
    machine_info,
    manifest_bytes,
    manifest_of,
    parser,
    vocabulary,
    write_results,
)
from spes.config import load_config
from spes.sync.codecs.registry import REGISTRY

RELAY = Path(__file__).resolve().parent / "link_relay.py"
# scale -> overrides of the 1B config keeping its ratios (see the module docstring)
SCALES = {
    12: ["--model.n_layers=1", *vocabulary(12639)],
    48: [
        "--model.n_layers=1",
        "--model.d_model=384",
        "--model.n_heads=6",
        "--model.mlp_hidden_size=2048",
        *vocabulary(6320),
    ],
    192: [
        "--model.n_layers=1",
        "--model.d_model=192",
        "--model.n_heads=3",
        "--model.mlp_hidden_size=1024",
        *vocabulary(3160),
    ],
    768: [
        "--model.n_layers=1",
        "--model.d_model=96",
        "--model.n_heads=3",
        "--model.mlp_hidden_size=512",
        *vocabulary(1580),
    ],
}
SPEEDS = {1000.0: 12, 100.0: 192, 20.0: 768}  # Mbit/s -> bf16's model scale
FIRST_ROUND_S = 240.0
"""The longest ideal first round a wire is measured with (bench_sync's rounds time out at 900 s; the data plane's
stall guard wants a transfer moving)."""
SYNC_STEPS = (25, 50, 100, 200)
FRAGMENTS = (1, 5)
"""`spes_config.overlap_fragments` of the overlapped predictions."""
WIRES = ("bf16", "fp32")
PLANES = ("tcp", "grpc")
RTT_MS = 50.0
SERVER_FACTOR = 1.0
MEASURING = ("rtt_ms", "server_factor", "speeds", "rounds", "warmup", "wires", "planes")
"""The flags that shape a link measurement: with --from_json the record's links are taken as they were measured."""


@dataclass(frozen=True)
class LinkSpec:
    peer_mbit: float
    server_mbit: float
    rtt_ms: float

    def relay(self, ports: list[int], peers: int) -> tuple[subprocess.Popen, list[str]]:
        proc = spawn(
            [
                str(RELAY),
                "--ports",
                *map(str, ports),
                "--peers",
                str(peers),
                "--peer_mbit",
                str(self.peer_mbit),
                "--server_mbit",
                str(self.server_mbit),
                "--rtt_ms",
                str(self.rtt_ms),
            ]
        )
        if expect_line(proc, "RELAYING") != "RELAYING":
            raise RuntimeError("the link relay did not start")
        return proc, [f"127.0.0.{10 + i}" for i in range(peers)]

    def ideal_seconds(self, up: list[int], down: list[int]) -> float:
        """What the link allows: each phase is limited by the slowest peer link or the shared server link."""
        peer, server = self.peer_mbit * 1e6 / 8, self.server_mbit * 1e6 / 8

        def phase(sizes: list[int]) -> float:
            return max(max(sizes) / peer, sum(sizes) / server) + self.rtt_ms / 1000

        return phase(up) + phase(down)


def measure(
    link: LinkSpec, scale: int, wires: list[str], planes: list[str], warmup: int, rounds: int, workdir: Path
) -> list[dict[str, Any]]:
    overrides = SCALES[scale]
    cfg = load_config(PAPER_1B, overrides)[0]
    peers = cfg.spes_config.num_peers
    manifest = manifest_of(cfg)
    out = []
    for wire in wires:
        up, down = round_bytes(node_run(PAPER_1B, overrides, wire)[1])  # what the raw baseline sends
        raw = bench_raw(up, down, warmup, rounds, relay=lambda ports: link.relay(ports, peers))
        best_raw = fastest(raw)
        for plane in planes:
            spes, _, _ = bench_spes(
                PAPER_1B,
                overrides,
                wire,
                plane,
                warmup,
                rounds,
                workdir,
                False,
                relay=lambda ports: link.relay(ports, peers),
            )
            best = fastest(spes)
            ideal = link.ideal_seconds(best["up_per_peer"], best["down_per_peer"])
            raw_ideal = link.ideal_seconds(best_raw["up_per_peer"], best_raw["down_per_peer"])
            out.append(
                {
                    "peer_mbit": link.peer_mbit,
                    "server_mbit": link.server_mbit,
                    "rtt_ms": link.rtt_ms,
                    "scale": scale,
                    "wire": wire,
                    "plane": plane,
                    "model_bytes_fp32": manifest_bytes(manifest),
                    "spes_rounds": spes,
                    "raw_rounds": raw,
                    "ideal_s": ideal,
                    "raw_ideal_s": raw_ideal,
                    "spes_s": best["seconds"],
                    "raw_s": best_raw["seconds"],
                    "efficiency": ideal / best["seconds"],
                    "raw_efficiency": raw_ideal / best_raw["seconds"],
                    "bytes_per_peer": [u + d for u, d in zip(best["up_per_peer"], best["down_per_peer"])],
                }
            )
    return out


def scale_for(wire: str, link: LinkSpec) -> int:
    """The model scale `wire` is measured at on `link`: the smallest model of `SCALES` whose ideal round is at
    least bf16's at the speed's own scale (`SPEEDS`), else the largest; among those whose ideal first round fits
    `FIRST_ROUND_S`.

    A round also costs round trips and connections, which the 1B model's round hardly notices; a codec that moves
    a twentieth of bf16's bytes, measured on bf16's model, would be mostly those, and its efficiency would not
    carry over to the 1B model. On a model with as long an ideal round they weigh as little as for bf16.
    """
    floor = link.ideal_seconds(*scaled_round_bytes(SPEEDS[link.peer_mbit], "bf16"))
    fits = [
        s
        for s in sorted(SCALES, reverse=True)
        if link.ideal_seconds(*scaled_round_bytes(s, wire, True)) <= FIRST_ROUND_S
    ]
    if not fits:
        raise SystemExit(f"error: no model of {sorted(SCALES)} moves a first {wire} round within {FIRST_ROUND_S:g} s")
    return next((s for s in fits if link.ideal_seconds(*scaled_round_bytes(s, wire)) >= floor), fits[-1])


@functools.cache
def scaled_round_bytes(scale: int, wire: str, first: bool = False) -> tuple[list[int], list[int]]:
    """Each peer's (up, down) bytes in a round of the 1B layout at `scale` on `wire` (`bench_wire.round_bytes`): a
    plain steady-state round, or with `first` the run's first round (full values on a held-model codec)."""
    spec = node_run(PAPER_1B, SCALES[scale], wire)[1]
    both = [peer_round_bytes(spec, q, merged=False, first=first) for q in range(spec.num_peers)]
    return [up for up, _ in both], [down for _, down in both]


def predict_1b(measured: list[dict[str, Any]], step_s: float | None, rtt_ms: float) -> list[dict[str, Any]]:
    """The full 1B model's round at each measured speed (its steady-state bytes at the ideal rate over the
    efficiency measured there) and, given a step time, the share of wall time a node is not training per
    `sync_steps`: blocking, and overlapped with 1 and 5 fragments (`idle_share`)."""
    rows = []
    for m in measured:
        up, down = round_bytes(node_run(PAPER_1B, [], m["wire"])[1])
        link = LinkSpec(m["peer_mbit"], m["server_mbit"], rtt_ms)
        round_s = link.ideal_seconds(up, down) / m["efficiency"]
        rtt_s = 2 * rtt_ms / 1000 / m["efficiency"]
        idle, overlapped = None, None
        if step_s is not None:
            idle = {s: idle_share(round_s, step_s, s) for s in SYNC_STEPS}
            overlapped = {f: {s: idle_share(round_s, step_s, s, f, rtt_s) for s in SYNC_STEPS} for f in FRAGMENTS}
        rows.append(
            {
                "peer_mbit": m["peer_mbit"],
                "wire": m["wire"],
                "plane": m["plane"],
                "bytes_per_peer": up[0] + down[0],
                "round_s": round_s,
                "idle_fraction": idle,
                "idle_fraction_overlapped": overlapped,
            }
        )
    return rows


def measure_step_1b(steps: int, device: torch.device, overrides: list[str]) -> dict[str, Any]:
    """Seconds of one optimizer step of the 1B SPES node (peer 0), with the config `overrides` (--key=value).

    On a GPU: whole steps of the config's own global batch, micro-batches and precision (amp_bf16). On the CPU,
    where one such step would take hours: steps of one sequence in fp32, scaled to the global batch.
    """
    cfg = load_config(PAPER_1B, overrides)[0]
    gpu = device.type == "cuda"
    one = [] if gpu else ["--global_train_batch_size=1", "--device_train_microbatch_size=1", "--precision=fp32"]
    torch.set_num_threads(os.cpu_count() or 1)
    with tempfile.TemporaryDirectory(prefix="bench_wan_") as tmp:
        variant = build_variant(PAPER_1B, cfg.model.moe_backend, "spes", device, tmp, [*overrides, *one])
        sequences = variant.cfg.global_train_batch_size
        batch = torch.randint(
            0,
            cfg.model.vocab_size,
            (sequences, cfg.model.max_sequence_length + 1),
            generator=torch.Generator().manual_seed(0),
        )
        timed_step(variant, batch)  # warm-up: first-call allocations, AdamW state
        seconds = [timed_step(variant, batch) for _ in range(steps)]
        peak = torch.cuda.max_memory_allocated(device) if gpu else None
    per_sequence = statistics.median(seconds) / sequences
    return {
        "device": torch.cuda.get_device_name(device) if gpu else "cpu",
        "precision": variant.cfg.precision,
        "torch_threads": torch.get_num_threads(),
        "sequences_per_timed_step": sequences,
        "timed_step_seconds": seconds,
        "sequences_per_step": cfg.global_train_batch_size,
        "microbatch": variant.cfg.device_train_microbatch_size,
        "moe_backend": variant.cfg.model.moe_backend,
        "overrides": overrides,
        "peak_memory_bytes": peak,
        "step_s": per_sequence * cfg.global_train_batch_size,
    }


def build_parser() -> argparse.ArgumentParser:
    """The command line as a parser, not parsed, so that main can refuse a bad --device or --speeds with its usage."""
    p = parser("bench_wan", __doc__)
    p.add_argument("--rtt_ms", type=float, default=None, help=f"round-trip time of every link (default {RTT_MS:g})")
    p.add_argument(
        "--server_factor",
        type=float,
        default=None,
        help=f"server link speed / peer link speed (default {SERVER_FACTOR:g}: the server's link as fast as a peer's)",
    )
    p.add_argument(
        "--speeds",
        type=float,
        nargs="+",
        default=None,
        help=f"peer link speeds, Mbit/s, each one of the default {' '.join(str(int(s)) for s in SPEEDS)} (quick 100)",
    )
    p.add_argument("--rounds", type=int, default=None, help="timed rounds per measurement (default 2, quick 1)")
    p.add_argument("--warmup", type=int, default=None, help="untimed rounds first (default 1, quick 0)")
    add_prediction_options(p)
    p.add_argument(
        "--wires",
        "--codecs",
        dest="wires",
        nargs="+",
        choices=sorted(REGISTRY),
        default=None,
        help=f"the codecs measured, each with its default settings (default {' '.join(WIRES)}; quick bf16); "
        "--codecs, as the other benchmarks name it, is the same option",
    )
    p.add_argument(
        "--planes",
        nargs="+",
        choices=PLANES,
        default=None,
        help=f"where tensor payloads travel (default {' '.join(PLANES)}; quick tcp)",
    )
    p.add_argument(
        "--step_override",
        action="append",
        default=[],
        metavar="--KEY=VALUE",
        help="with --measure_step: a config override of the timed node (repeatable), e.g. "
        "--step_override=--model.moe_backend=grouped_mm",
    )
    return p


def add_prediction_options(p: argparse.ArgumentParser) -> None:
    """Where the 1B prediction's step time and links come from, when not from this run's own measurements."""
    p.add_argument(
        "--step_s",
        type=float,
        default=None,
        help="seconds of one optimizer step of the 1B config measured elsewhere (for the idle fraction)",
    )
    p.add_argument(
        "--from_json",
        type=Path,
        default=None,
        help="take the link measurements from this earlier record instead of measuring them, as they were measured "
        f"({', '.join(f'--{k}' for k in MEASURING)}: refused with it)",
    )
    p.add_argument(
        "--measure_step",
        type=int,
        default=0,
        metavar="N",
        help="time N steps of the 1B SPES node here instead (CPU: one-sequence steps, ~16 GB of memory; default 0: "
        "none)",
    )
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu", help="where --measure_step trains (default cpu)")


def step_line(step: dict[str, Any]) -> str:
    """What `measure_step_1b` measured, printed as soon as it is known: the links take many minutes more."""
    peak = step["peak_memory_bytes"]
    return (
        f"1B SPES node on {step['device']} ({step['precision']}): median of {len(step['timed_step_seconds'])} "
        f"steps of {step['sequences_per_timed_step']} sequences, so {step['step_s']:.1f} s per step of "
        f"{step['sequences_per_step']} sequences (micro-batch {step['microbatch']}, {step['moe_backend']}); "
        f"peak memory {'n/a' if peak is None else f'{peak / 2**30:.1f} GiB'}"
    )


def earlier_links(path: Path) -> dict[str, Any]:
    """An earlier run's record (--from_json) as this run's: links measured earlier (e.g. here) meet a step time
    measured now (e.g. on a GPU)."""
    run = json.loads(path.read_text())
    # NOTE: this run's command, commit and machine are its own (write_results); the links' stay with them
    links = {key: run.pop(key, None) for key in ("command", "commit", "machine")}
    run.update(machine=machine_info(), links_from={"record": str(path), **links})
    return run


def measure_links(args: argparse.Namespace, speeds: list[float], workdir: Path) -> dict[str, Any]:
    """A new record: the machine first (its load as the measurements start), then each speed's link per wire, each
    wire on its own model scale (`scale_for`)."""
    wires = args.wires or (["bf16"] if args.quick else list(WIRES))
    planes = args.planes or (["tcp"] if args.quick else list(PLANES))
    rounds = args.rounds or (1 if args.quick else 2)
    warmup = args.warmup if args.warmup is not None else (0 if args.quick else 1)
    rtt_ms = RTT_MS if args.rtt_ms is None else args.rtt_ms
    factor = SERVER_FACTOR if args.server_factor is None else args.server_factor
    measured: list[dict[str, Any]] = []
    run = {
        "mode": "quick" if args.quick else "full",
        "machine": machine_info(),
        "config": str(PAPER_1B.relative_to(REPO_ROOT)),
        "rtt_ms": rtt_ms,
        "server_factor": factor,
        "warmup_rounds": warmup,
        "rounds": rounds,
        "measurements": measured,
    }
    for speed in speeds:
        link = LinkSpec(speed, speed * factor, rtt_ms)
        for wire in wires:
            scale = 768 if args.quick else scale_for(wire, link)
            print(
                f"link: {speed:g} Mbit/s per peer, server {link.server_mbit:g} Mbit/s shared, RTT "
                f"{rtt_ms:g} ms; {wire} on a model 1/{scale} of the 1B",
                flush=True,
            )
            measured += measure(link, scale, [wire], planes, warmup, rounds, workdir)
    return run


def link_row(m: dict[str, Any]) -> list[str]:
    """A measured link's line in the first table: its round against the ideal, SPES's and the raw socket's."""
    return [
        f"{m['peer_mbit']:g}",
        f"1/{m['scale']}",
        m["wire"],
        m["plane"],
        f"{m['bytes_per_peer'][0] / 1e6:.1f}",
        f"{m['ideal_s']:.2f}",
        f"{m['spes_s']:.2f}",
        f"{m['efficiency']:.1%}",
        f"{m['raw_s']:.2f}",
        f"{m['raw_efficiency']:.1%}",
    ]


def prediction_row(r: dict[str, Any]) -> list[str]:
    """A `predict_1b` row's line in the second table: the 1B round and the idle share per `SYNC_STEPS`."""
    return [
        f"{r['peer_mbit']:g}",
        r["wire"],
        r["plane"],
        f"{r['bytes_per_peer'] / 1e9:.2f}",
        f"{r['round_s']:.0f}",
        *(f"{r['idle_fraction'][n]:.1%}" if r["idle_fraction"] else "-" for n in SYNC_STEPS),
    ]


def print_tables(measured: list[dict[str, Any]], prediction: list[dict[str, Any]], step_s: float | None) -> None:
    """The links as measured, the 1B model's predicted rounds, and the efficiencies as one JSON line for scripts."""
    print(
        format_table(
            ["Mbit/s", "model", "wire", "plane", "MB/peer", "ideal s", "SPES s", "SPES/ideal", "raw s", "raw/ideal"],
            [link_row(m) for m in measured],
        )
    )
    step_note = (
        "no step time given (--step_s or --measure_step)" if step_s is None else f"one optimizer step = {step_s:g} s"
    )
    print(
        f"\nthe paper's 1B model at the measured efficiencies ({step_note}): round s and the share of wall "
        f"time not training at sync_steps {', '.join(map(str, SYNC_STEPS))}"
    )
    print(
        format_table(
            ["Mbit/s", "wire", "plane", "GB/peer", "round s", *map(str, SYNC_STEPS)],
            [prediction_row(r) for r in prediction],
        )
    )
    print(json.dumps({"efficiency": [round(m["efficiency"], 3) for m in measured]}))


def main(argv: list[str] | None = None) -> int:
    """One run: the 1B node's step time and the links, then the 1B prediction from both; the record before the
    tables."""
    p = build_parser()
    args = p.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda needs a CUDA GPU and a CUDA build of torch")
    speeds = args.speeds or ([100.0] if args.quick else list(SPEEDS))
    if unknown := [s for s in speeds if s not in SPEEDS]:  # NOTE: before the step's minutes, not after them
        p.error(f"--speeds {unknown}: each speed must be one of {list(SPEEDS)} (each has its model scale)")
    if args.from_json is not None and (given := [f"--{k}" for k in MEASURING if getattr(args, k) is not None]):
        p.error(
            f"{', '.join(given)}: a flag of a new link measurement, but --from_json takes the links of "
            f"{args.from_json} as they were measured; drop the flag, or drop --from_json to measure the links anew"
        )
    device = torch.device("cuda", 0) if args.device == "cuda" else torch.device("cpu")
    step = measure_step_1b(args.measure_step, device, args.step_override) if args.measure_step else None
    if step is not None:
        print(step_line(step), flush=True)
    step_s = args.step_s if step is None else step["step_s"]
    workdir = RESULTS_DIR / ("bench_wan_quick" if args.quick else "bench_wan")
    workdir.mkdir(parents=True, exist_ok=True)
    run = earlier_links(args.from_json) if args.from_json is not None else measure_links(args, speeds, workdir)
    prediction = predict_1b(run["measurements"], step_s, run["rtt_ms"])
    # NOTE: the record first: a reader that stops reading the tables (`| head`) must not cost the measurement
    write_results(args.out, {**run, "prediction_1b": prediction, "step_s_1b": step_s, "step_measurement_1b": step})
    print_tables(run["measurements"], prediction, step_s)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
