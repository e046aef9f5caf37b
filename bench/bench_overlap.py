#!/usr/bin/env python
"""Overlapped rounds on an emulated link: training throughput of the same SPES run, blocking and overlapped.

    .venv/bin/python bench/bench_overlap.py              # 2 peers, 300 steps, a round every 10, RTT 50 ms (~6 min)
    .venv/bin/python bench/bench_overlap.py --repeats 2  # the two arms twice, in the order AB BA
    .venv/bin/python bench/bench_overlap.py --quick      # 4 steps, a round every 2, a fixed 200 Mbit/s link

Real runs, one after the other, each `python -m spes.server` plus one `python -m spes.train` per peer, every
peer reaching the server through bench/link_relay.py (its own link and the server's shared link, both at the
same rate, and a one-way delay of RTT/2):

  1. calibration (blocking, 3 rounds, a 1 Gbit/s link): the median step time while both peers train, the
     payload bytes of a round (the trainers' own counters) and what a round costs beyond its bytes (round
     trips, connections, aggregation); then the two arms:
  2. blocking: the run with the link rate set so that one round takes `sync_steps` calibrated step times;
  3. overlapped: the same run and link with `spes_config.overlap_sync=true` (each round applied `sync_steps`
     later, the default `overlap_steps`); with `--fragments F`, also `overlap_fragments=F`: a round over 1/F of
     the model every `sync_steps / F` steps, each applied that much later, and a whole round at the last step;
     `--overlap_steps D` applies each round D steps after its sync step instead.

Each arm also records the CPU seconds of its peers, the server and the relay (`cpu_s`): on a machine with fewer
cores than processes, what the server and the relay spend while the peers train (overlapped) slows the peers,
while a blocking run spends it while they wait.

Throughput = the tokens the trainers logged (`tokens` in metrics.jsonl, summed over the peers) / the run's
training wall time (the longest of the peers' `time` at their last logged step: from the trainer's start,
after start-up and join, to its last step, whatever it waited for). With R rounds each as long as `sync_steps`
steps, a blocking run takes 2R round-lengths and an overlapped one R + 1 (only the last round, applied at the
last step, is waited for), so the ideal ratio is 2R / (R + 1). With `--repeats N` the arms run N times in the
order AB BA AB..., so that a drift of the machine's load hits both alike, and the ratio is the median of the
pairs'. No record is written unless both arms of every pair logged the same tokens, steps and rounds with the
same payload bytes (with fragments: at least the blocking run's payload bytes, in more and smaller rounds), and
the relay carried at least those bytes for every peer.

`--codecs C...` runs one overlapped arm per codec (`fp32`, `int8`, `sparse:topk=256`, ...; default fp32) against
the one blocking arm on the fp32 wire, on the same link: what a node gains by moving from blocking fp32 rounds to
overlapped rounds on that codec (a codec's rounds also move fewer bytes, so they take fewer steps). The arms then
run in the order A B C.., C B A.., and each overlapped arm's ratio is the median of its pairs with the blocking
runs. `--shape mini_repro` trains the model and the 4 peers of bench/mini_repro.py (its widths, batch, learning
rate, merge warm-up and seed), so that the throughput and the loss of a schedule are measured on one model.

Every process gets one torch thread: the 2 peers train on 2 cores, and the server, the relay and the overlapped
peers' upload threads take what is left. Small model (configs/tiny.yaml widths, 64 sequences per step) so
that a step takes ~0.1-0.3 s and the run minutes; the link's rate follows from it.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench_sync import spawn, stop, wait_for_log
from bench_wan import LinkSpec
from common import (
    RESULTS_DIR,
    CodecChoice,
    check_corpus,
    codec_choice,
    corpus_args,
    format_table,
    machine_info,
    parser,
    write_results,
)
from mini_repro import FULL as MINI_REPRO
from spes.launch import free_port

CONFIG = "configs/tiny.yaml"
OVERLAP = ["--spes_config.overlap_sync=true"]
CALIBRATION_MBIT = 1000.0
"""The calibration's link: fast enough that its rounds cost little beyond their round trips and overhead."""


@dataclass(frozen=True)
class Shape:
    """The model and peers every arm trains (configs/tiny.yaml underneath), and the step's batch."""

    peers: int
    overrides: tuple[str, ...]


def tiny_shape(batch: int, n_layers: int | None) -> Shape:
    """configs/tiny.yaml's widths, 2 peers of 4 experts, `batch` sequences per step and peer."""
    layers = (f"--model.n_layers={n_layers}",) if n_layers else ()
    return Shape(
        2,
        (
            "--spes_config.num_peers=2",
            "--spes_config.num_train_experts_per_node=4",
            f"--global_train_batch_size={batch}",
            "--device_train_microbatch_size=16",
            *layers,
        ),
    )


def mini_repro_shape() -> Shape:
    """bench/mini_repro.py's model, 4 peers of 2 experts, batch, learning rate, merge warm-up and seed."""
    m = MINI_REPRO
    return Shape(
        4,
        (
            f"--model.d_model={m.d_model}",
            f"--model.n_layers={m.n_layers}",
            f"--model.n_heads={m.n_heads}",
            f"--model.mlp_hidden_size={m.mlp_hidden_size}",
            f"--model.max_sequence_length={m.seq_len}",
            f"--global_train_batch_size={m.peer_batch}",
            f"--device_train_microbatch_size={m.peer_batch}",
            f"--optimizer.learning_rate={m.learning_rate}",
            f"--scheduler.t_warmup={m.warmup}",
            *m.merge_overrides(),
        ),
    )


def run_overrides(steps: int, sync_steps: int, shape: Shape, args: argparse.Namespace) -> list[str]:
    """The run every arm shares: the shape's model and peers, no evaluation or checkpoints."""
    return [
        f"--tokenizer.identifier={args.tokenizer}",
        f"--data.paths=[{args.train}]",
        "--data.validation_paths=[]",
        f"--spes_config.sync_steps={sync_steps}",
        f"--max_duration={steps}st",
        "--eval_interval=null",
        "--save_interval=null",
        "--log_interval=1",
        "--spes_config.data_plane=tcp",
        "--spes_config.rpc_timeout_s=120",
        "--spes_config.round_timeout_s=600",
        *shape.overrides,
    ]


def run_arm(
    name: str, overrides: list[str], peers: int, link: LinkSpec, workdir: Path, timeout_s: float
) -> dict[str, Any]:
    """One real run of `peers` nodes through the relay; what its trainers logged and what the relay carried."""
    out = workdir / name
    out.mkdir(parents=True, exist_ok=True)
    port, data_port = free_port(), free_port()
    log = out / "server.log"
    server = spawn(
        ["-m", "spes.server", CONFIG, *overrides, "--host", "127.0.0.1", "--port", str(port)]
        + ["--data_port", str(data_port)],
        log,
    )
    procs: list[subprocess.Popen] = [server]
    started, children = time.monotonic(), resource.getrusage(resource.RUSAGE_CHILDREN)
    try:
        wait_for_log(log, "listening", server)
        relay, hosts = link.relay([port, data_port], peers)
        procs.append(relay)
        nodes = []
        for p in range(peers):
            (out / f"node{p}" / "metrics.jsonl").unlink(missing_ok=True)
            peer = [f"--spes_config.peer_id={p}", f"--spes_config.server_addr={hosts[p]}:{port}"]
            nodes.append(
                spawn(
                    ["-m", "spes.train", CONFIG, *overrides, *peer, f"--save_folder={out / f'node{p}'}"],
                    out / f"peer{p}.log",
                )
            )
        procs += nodes
        deadline = started + timeout_s
        while any(p.poll() is None for p in nodes):
            failed = [i for i, p in enumerate(nodes) if p.returncode not in (None, 0)]
            if failed or time.monotonic() > deadline:
                what = f"peer {failed[0]} failed" if failed else f"the run did not finish in {timeout_s:.0f} s"
                raise SystemExit(f"error: {name}: {what}; see {out}/peer{failed[0] if failed else 0}.log")
            time.sleep(0.2)
        if any(p.returncode != 0 for p in nodes):
            raise SystemExit(f"error: {name}: a peer failed; see the logs in {out}")
        process_wall = time.monotonic() - started
        reaped = resource.getrusage(resource.RUSAGE_CHILDREN)  # the peers, reaped by poll(): not the server nor relay
        cpu = {
            "peers": reaped.ru_utime + reaped.ru_stime - children.ru_utime - children.ru_stime,
            "server": cpu_seconds(server.pid),
            "relay": cpu_seconds(relay.pid),
        }
        relay.terminate()
        carried, _ = relay.communicate(timeout=30)
    finally:
        stop(procs)
    relayed = json.loads(carried.strip().splitlines()[-1])
    return {**summarize(out, overrides, peers), "process_wall_s": process_wall, "relay_bytes": relayed, "cpu_s": cpu}


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of a live process so far (Linux: fields 14 and 15 of /proc/PID/stat)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def summarize(out: Path, overrides: list[str], count: int) -> dict[str, Any]:
    """The run of `count` peers as its trainers logged it: tokens, training wall time, step times, rounds and their
    bytes."""
    peers = [
        [json.loads(line) for line in (out / f"node{p}" / "metrics.jsonl").read_text().splitlines()]
        for p in range(count)
    ]
    sync_steps = int(next(o for o in overrides if o.startswith("--spes_config.sync_steps=")).split("=")[1])
    step_s = []
    for records in peers:
        for prev, rec in zip(records, records[1:]):  # NOTE: log_interval=1, so consecutive records are steps
            quiet = "sync_s" not in rec and rec["step"] % sync_steps != 0 and rec["step"] == prev["step"] + 1
            if quiet:
                step_s.append(rec["time"] - prev["time"])
    if not step_s:
        raise SystemExit(f"error: {out}: no step without a round to time; raise --steps or --sync_steps")
    syncs = [[r for r in records if "sync_s" in r] for records in peers]
    # NOTE: a peer that reaches a round first also waits for the other one; the later one's time is the round's
    by_step: dict[int, list[float]] = {}
    for r in (r for s in syncs for r in s):
        by_step.setdefault(r["step"], []).append(r["sync_s"] / r.get("sync_rounds", 1))
    return {
        "tokens_per_peer": [records[-1]["tokens"] for records in peers],
        "tokens": sum(records[-1]["tokens"] for records in peers),
        "steps": [records[-1]["step"] for records in peers],
        "train_wall_s": max(records[-1]["time"] for records in peers),
        "median_step_s": statistics.median(step_s),
        "rounds": [sum(r.get("sync_rounds", 1) for r in s) for s in syncs],
        "bytes_up": [sum(r["sync_mb_up"] * 2**20 for r in s) for s in syncs],
        "bytes_up_per_round": [s[0]["sync_mb_up"] * 2**20 / s[0].get("sync_rounds", 1) for s in syncs],
        "bytes_down_per_round": [s[0]["sync_mb_down"] * 2**20 / s[0].get("sync_rounds", 1) for s in syncs],
        "round_s": statistics.median(min(seconds) for seconds in by_step.values()),
        "waited_s": [sum(r.get("sync_wait_s", r["sync_s"]) for r in s) for s in syncs],
    }


def link_rate(calibration: dict[str, Any], link: LinkSpec, sync_steps: int) -> float:
    """Mbit/s per link (each peer's and the server's) at which a round takes `sync_steps` calibrated steps: its
    bytes over the shared server link, plus what the calibration's round cost beyond its bytes."""
    moved = sum(calibration["bytes_up_per_round"]) + sum(calibration["bytes_down_per_round"])
    overhead = calibration["round_s"] - moved / (link.server_mbit * 1e6 / 8)
    budget = sync_steps * calibration["median_step_s"] - overhead
    if budget <= 0:
        raise SystemExit(
            f"error: a round's overhead ({overhead:.2f} s at RTT {link.rtt_ms:g} ms) exceeds {sync_steps} steps "
            f"({sync_steps * calibration['median_step_s']:.2f} s): raise --sync_steps or lower --rtt_ms"
        )
    return moved * 8 / budget / 1e6


def check_premises(
    blocking: dict[str, Any], overlapped: dict[str, Any], fragments: int = 1, codec: str = "fp32"
) -> list[str]:
    """What must hold for the ratio to mean anything; an empty list when all does. With fragments the rounds
    differ in number and size, and the overlapped run must move at least the blocking run's payload; on another
    codec than fp32 the payloads differ by design, and only equal tokens and steps are asked."""
    problems = []
    same = ["tokens_per_peer", "steps"]
    if fragments == 1 and codec == "fp32":
        same += ["rounds", "bytes_up_per_round", "bytes_down_per_round"]
    for key in same:
        if blocking[key] != overlapped[key]:
            problems.append(f"{key} differ: blocking {blocking[key]}, overlapped {overlapped[key]}")
    if codec == "fp32" and any(o < b for o, b in zip(overlapped["bytes_up"], blocking["bytes_up"])):
        problems.append(f"the overlapped run uploaded less: {overlapped['bytes_up']} against {blocking['bytes_up']}")
    for name, arm in (("blocking", blocking), ("overlapped", overlapped)):
        for p, (carried, sent) in enumerate(zip(arm["relay_bytes"]["bytes_up"], arm["bytes_up"])):
            if carried < sent:
                problems.append(f"{name}: the relay carried less than peer {p}'s payload up: did it bypass the link?")
    return problems


def arm_name(codec: CodecChoice) -> str:
    """`overlapped` on the fp32 wire (the name of the records before codecs), `overlapped_<codec>` otherwise."""
    return "overlapped" if codec.label == "fp32" else f"overlapped_{codec.label}"


def run_pairs(
    arms: dict[str, list[str]], codecs: dict[str, str], args: argparse.Namespace, run: Callable[..., dict[str, Any]]
) -> list[dict[str, Any]]:
    """`args.repeats` rounds of every arm, in the order A B C.. then C B A..; each overlapped arm's ratio to the
    blocking run of its round. Refuses (no record) when an overlapped arm is not comparable with the blocking one."""
    pairs: list[dict[str, Any]] = []
    for i in range(args.repeats):
        order = list(arms) if i % 2 == 0 else list(arms)[::-1]  # ABBA: load drifts cancel
        pair: dict[str, Any] = {}
        for arm in order:
            print(f"{arm} ({i + 1}/{args.repeats}): {args.steps} steps, a round every {args.sync_steps}", flush=True)
            pair[arm] = {**run(f"{arm}{i + 1}", arms[arm]), "machine": machine_info()}
        ratios = {}
        for arm, codec in codecs.items():
            if problems := check_premises(pair["blocking"], pair[arm], args.fragments, codec):
                raise SystemExit(f"error: {arm} is not comparable, no record written: " + "; ".join(problems))
            ratios[arm] = throughput(pair[arm]) / throughput(pair["blocking"])
        pairs.append({**pair, "ratios": ratios, "ratio": next(iter(ratios.values()))})
    return pairs


def print_pairs(pairs: list[dict[str, Any]], arms: list[str]) -> None:
    print(
        format_table(
            ["pair", "run", "tokens", "train s", "tokens/s", "step s", "round s", "waited s", "load avg"],
            [
                [
                    str(i + 1),
                    arm,
                    f"{pair[arm]['tokens']:,}",
                    f"{pair[arm]['train_wall_s']:.1f}",
                    f"{throughput(pair[arm]):,.0f}",
                    f"{pair[arm]['median_step_s']:.3f}",
                    f"{pair[arm]['round_s']:.2f}",
                    f"{max(pair[arm]['waited_s']):.1f}",
                    f"{pair[arm]['machine']['load_avg_1_5_15'][0]:.1f}",
                ]
                for i, pair in enumerate(pairs)
                for arm in arms
            ],
        )
    )


def calibrate(args: argparse.Namespace, shape: Shape, workdir: Path, timeout: float) -> tuple[float, dict | None]:
    """The link's Mbit/s: `--mbit`, or the rate at which a blocking fp32 round takes `sync_steps` steps, from a
    short blocking run on a fast link (and that run)."""
    if args.mbit:
        return args.mbit, None
    fast = LinkSpec(CALIBRATION_MBIT, CALIBRATION_MBIT, args.rtt_ms)
    steps = 3 * args.sync_steps
    print(f"calibration: {shape.peers} peers, {steps} steps through a {fast.peer_mbit:g} Mbit/s link", flush=True)
    overrides = run_overrides(steps, args.sync_steps, shape, args)
    calibration = run_arm("calibration", overrides, shape.peers, fast, workdir, timeout)
    mbit = link_rate(calibration, fast, args.sync_steps)
    print(
        f"step {calibration['median_step_s']:.3f} s, round {calibration['round_s']:.2f} s at {fast.peer_mbit:g} "
        f"Mbit/s: so {mbit:.1f} Mbit/s",
        flush=True,
    )
    return mbit, calibration


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    check_corpus(args)
    shape = mini_repro_shape() if args.shape == "mini_repro" else tiny_shape(args.batch, args.n_layers)
    name = "bench_overlap_quick" if args.quick else "bench_overlap"
    if args.fragments > 1:
        name = name.replace("bench_overlap", f"bench_overlap_f{args.fragments}", 1)
    overlap = [*OVERLAP, f"--spes_config.overlap_fragments={args.fragments}"] if args.fragments > 1 else OVERLAP
    if args.overlap_steps is not None:
        name += f"_d{args.overlap_steps}"
        overlap = [*overlap, f"--spes_config.overlap_steps={args.overlap_steps}"]
    overrides = run_overrides(args.steps, args.sync_steps, shape, args)
    workdir = args.runs or RESULTS_DIR / name
    timeout = 300.0 if args.quick else 3600.0

    mbit, calibration = calibrate(args, shape, workdir, timeout)
    link = LinkSpec(mbit, mbit, args.rtt_ms)
    print(f"link: {mbit:.1f} Mbit/s per peer and for the server (shared), RTT {args.rtt_ms:g} ms", flush=True)
    arms = {"blocking": overrides, **{arm_name(c): [*overrides, *overlap, *c.overrides()] for c in args.codecs}}
    codecs = {arm_name(c): c.label for c in args.codecs}
    pairs = run_pairs(arms, codecs, args, lambda arm, flags: run_arm(arm, flags, shape.peers, link, workdir, timeout))
    print_pairs(pairs, list(arms))
    ratios = {arm: statistics.median(pair["ratios"][arm] for pair in pairs) for arm in codecs}
    rounds = pairs[0]["blocking"]["rounds"][0]
    ideal = 2 * rounds / (rounds + 1)
    for arm, ratio in ratios.items():
        print(
            f"{arm} / blocking tokens/s: {ratio:.3f}x (median of {len(pairs)} pair(s); ideal for {rounds} rounds "
            f"each as long as {args.sync_steps} steps: {ideal:.3f}x)"
        )
    write_results(
        args.out or RESULTS_DIR / f"{name}.json",
        {
            "mode": "quick" if args.quick else "full",
            "machine": machine_info(),
            "config": CONFIG,
            "shape": args.shape,
            "overrides": overrides,
            "overlap_flags": overlap,
            "codecs": codecs,
            "fragments": args.fragments,
            "peers": shape.peers,
            "link": {"mbit": mbit, "rtt_ms": args.rtt_ms, "server_mbit": mbit},
            "calibration": calibration,
            "pairs": pairs,
            "ratios": ratios,
            "ratio": next(iter(ratios.values())),
            "ideal_ratio": ideal,
            "target": 1.8,
        },
    )
    return 0


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """The command line, with the quick and full defaults filled in."""
    p = parser("bench_overlap", __doc__)
    p.add_argument("--steps", type=int, default=None, help="steps per run (default 300, quick 4)")
    p.add_argument("--sync_steps", type=int, default=None, help="steps between rounds (default 10, quick 2)")
    p.add_argument("--batch", type=int, default=None, help="sequences per step and peer (default 64, quick 16)")
    p.add_argument("--rtt_ms", type=float, default=50.0, help="round-trip time of every link")
    p.add_argument("--mbit", type=float, default=None, help="link rate, Mbit/s, instead of calibrating it (quick: 200)")
    p.add_argument("--repeats", type=int, default=1, help="rounds of the arms, in the order AB, BA, AB...: the median")
    p.add_argument(
        "--fragments", type=int, default=1, help="the overlapped arm's spes_config.overlap_fragments (default 1)"
    )
    p.add_argument(
        "--overlap_steps",
        type=int,
        default=None,
        metavar="D",
        help="the overlapped arms' spes_config.overlap_steps: steps from a sync step to the one that applies its "
        "round (default: the config's, sync_steps / fragments)",
    )
    p.add_argument(
        "--codecs",
        type=codec_choice,
        nargs="+",
        default=[CodecChoice.parse("fp32")],
        metavar="CODEC",
        help="one overlapped arm per codec (NAME or NAME:key=value,..), each against the blocking fp32 arm "
        "(default: fp32)",
    )
    p.add_argument(
        "--shape",
        choices=["tiny", "mini_repro"],
        default="tiny",
        help="the model and peers: configs/tiny.yaml's with 2 peers (default), or bench/mini_repro.py's 4 peers",
    )
    p.add_argument(
        "--n_layers",
        type=int,
        default=None,
        help="decoder blocks (default: configs/tiny.yaml's 2, each a fifth of its embedding: fragments of whole blocks "
        "balance from about 16)",
    )
    p.add_argument(
        "--runs", type=Path, default=None, help="run directory (default: bench/results/bench_overlap[_quick])"
    )
    corpus_args(p, valid=False)  # no evaluation: the arms are timed
    p.set_defaults(out=None)
    args = p.parse_args(argv)
    if args.shape == "mini_repro" and (args.batch or args.n_layers):
        p.error("--batch and --n_layers set the tiny shape; --shape mini_repro takes bench/mini_repro.py's")
    if len({c.label for c in args.codecs}) != len(args.codecs):
        p.error(f"--codecs {[c.label for c in args.codecs]}: each codec once")
    args.steps, args.sync_steps = args.steps or (4 if args.quick else 300), args.sync_steps or (2 if args.quick else 10)
    args.batch = args.batch or (16 if args.quick else 64)
    args.mbit = args.mbit or (200.0 if args.quick else None)
    return args


def throughput(arm: dict[str, Any]) -> float:
    """Tokens per second of training wall time, as the trainers logged them."""
    return arm["tokens"] / arm["train_wall_s"]


if __name__ == "__main__":
    raise SystemExit(main())
