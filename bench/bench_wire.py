#!/usr/bin/env python
"""Bytes on the wire per peer per round, up and down: SPES on each codec vs the reference's scheme vs DiLoCo.

    .venv/bin/python bench/bench_wire.py           # configs/small.yaml measured + the paper's 1B, int8 measured too
    .venv/bin/python bench/bench_wire.py --quick   # configs/tiny.yaml measured + the 1B from shapes
    .venv/bin/python bench/bench_wire.py --codecs fp32 int8 sparse sparse:topk=32 --paper_codecs sparse

What each scheme moves per peer and round (payload bytes; the selection is the run spec's own
`RunSpec.trainable` / `RunSpec.downloads`):
  - SPES (ours): up = shared tensors + the peer's own expert block; down = shared tensors + the other
    peers' blocks, and its own block too on merge rounds (the warm-up changed it); in the bytes of the run's codec
    (`spes_config.codec`, `spes.sync.codecs`: any registered codec, by name, with `codec_settings` as
    `NAME:key=value,...`): fp32 or bf16 values, or a held-model codec's deltas (int8: n int8 values +
    ceil(n / 256) fp32 scales per tensor; sparse: per chunk a scale and the top-k entries' packed indices and
    levels), after a first round of full fp32 values, the whole model down, that every run pays once.
  - DiLoCo (ours, `--dilico`): every tensor up and down; fp32 or bf16.
  - reference: the first implementation sent the whole fp32 state dict up and down every round.
The 1B figures come from the config's shapes; the small (or tiny) config is also measured through a real
parameter server on loopback (the run spec the server builds from the config's YAML with the codec's overrides;
4 `SyncClient`s, one SPES non-merge round, one merge round, one DiLoCo round per raw codec; a held-model codec
after its first, full round) and must equal the analytic figures byte for byte. The full run also measures each of
`--paper_codecs` (default: int8) on the paper's 1B manifest through real servers: in slices (each layer's tensors
with the run's 4 peers; embedding, LM head and final norm, which every peer uploads and downloads alike, with one
peer), since a whole 1B round does not fit this machine's memory; the slices' bytes sum to the 1B round's. Framing
is measured by serializing the messages of one upload and reported as overhead: over gRPC (headers, offsets,
checksums, ~1 MiB chunks) and over the raw-TCP data plane (one `TensorHeader` frame and an 8-byte checksum per
tensor). An amortized figure weights merge rounds by how often they occur in the config's run (merge every 500
steps while alpha > 0, alpha decaying to 0 at step 10000: the paper's launch settings).
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import multiprocessing
import resource
import sys
import tempfile
import threading
from collections.abc import Iterator, Sequence
from concurrent.futures import ProcessPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

import common
from common import (
    MIB,
    PAPER_1B,
    REPO_ROOT,
    CodecChoice,
    codec_choice,
    config_file,
    format_table,
    machine_info,
    manifest_of,
    parser,
    repo_path,
    server_overrides,
    spec_overrides,
    write_results,
)
from spes.config import ServerSection, SpesConfig, TrainConfig, load_config
from spes.model import Transformer
from spes.sync.client import SyncClient, SyncStats
from spes.sync.codecs.held import HeldServer
from spes.sync.codecs.registry import Codec
from spes.sync.merge import round_alpha
from spes.sync.plane_tcp import framing_bytes
from spes.sync.proto import spes_pb2 as pb
from spes.sync.protocol import Mode
from spes.sync.server import spec_of_run, start_server
from spes.sync.settings import DeployConfig, ServerConfig
from spes.sync.spec import RunSpec, run_spec
from spes.sync.wire import encode_tensors, header_for, payload_bytes

PAPER_MERGE = ServerSection(merge_interval=500, merge_alpha_start=0.05, merge_decay_steps=10000, merge_topk=4)
"""The paper's launch settings of the merge warm-up (what the amortized figures weight merge rounds by)."""
MERGE = ServerSection(merge_interval=2, merge_alpha_start=0.05, merge_decay_steps=1000)
"""The measured runs' merge warm-up: step 2 is a merge round."""
EVERY_STEP = "--spes_config.sync_steps=1"
"""The measured runs have a round at every step (the server admits only the round the schedule expects next)."""
GRPC_PREFIX = 5  # gRPC length-prefixed message: 1 flag byte + 4 length bytes
CODECS = ("fp32", "bf16", "int8")
"""The codecs measured by default (`--codecs`)."""
DILOCO_CODECS = ("fp32", "bf16")
INT8_TARGET = 0.16
"""Issue 16.3: SPES with int8 deltas moves at most this share of the reference's bytes per peer and round."""


def holds_model(codec: Codec) -> bool:
    """Whether `codec` is a held-model codec: its first round moves full values, the whole model down."""
    return isinstance(codec.server(), HeldServer)


def run_specs(path: Path, codec: CodecChoice, *extra: str) -> dict[Mode, RunSpec]:
    """The run spec of the config at `path` on `codec`, SPES and DiLoCo, as the server builds it from the YAML."""
    overrides = [*codec.overrides(), *extra]
    return {
        "spes": spec_of_run(str(path), overrides),
        "diloco": spec_of_run(str(path), [*overrides, "--using_dilico=true"]),
    }


def round_bytes(spec: RunSpec, peer: int, merged: bool, first: bool = False) -> tuple[int, int]:
    """(up, down) payload bytes of one peer in one round of the run `spec` on its codec; `first`: a held-model
    codec's first round, full fp32 values both ways (every tensor down)."""
    manifest, codec = spec.manifest, spec.codec_impl
    assert manifest is not None

    def size(names: Sequence[str], per_tensor: Any) -> int:
        return sum(per_tensor(math.prod(manifest[n])) for n in names)

    if first and holds_model(codec):
        return size(spec.trainable(peer), codec.full_bytes), size(list(manifest), codec.full_bytes)
    return spec.round_bytes(peer, merged=merged)


def merge_round_share(cfg: TrainConfig, merge: ServerSection) -> tuple[int, int]:
    """(merge rounds, all rounds) over the config's run."""
    steps = range(cfg.spes_config.sync_steps, cfg.max_steps + 1, cfg.spes_config.sync_steps)
    merges = sum(round_alpha(s, "spes", merge) > 0 for s in steps)
    return merges, len(steps)


def analytic_table(path: Path, merge: ServerSection, codecs: Sequence[CodecChoice]) -> dict[str, Any]:
    """Per-peer bytes of every scheme for peer 0 (every peer's block has the same size when P*k == E)."""
    fp32 = run_specs(path, CodecChoice.parse("fp32"))
    merges, rounds = merge_round_share(load_config(path)[0], merge)
    total_fp32 = sum(4 * math.prod(s) for s in (fp32["diloco"].manifest or {}).values())
    out: dict[str, Any] = {
        "rounds_in_run": rounds,
        "merge_rounds_in_run": merges,
        "model_bytes_fp32": total_fp32,
        "schemes": {},
    }
    spes = {c.label: c for c in [*map(CodecChoice.parse, ("fp32", "bf16")), *codecs]}  # bf16 and fp32: the targets'
    schemes: list[tuple[Mode, CodecChoice]] = [("spes", c) for c in spes.values()]
    schemes += [("diloco", CodecChoice.parse(c)) for c in DILOCO_CODECS]
    for mode, codec in schemes:
        spec = dataclasses.replace(fp32[mode], codec=codec.name, codec_settings=tuple(sorted(codec.settings.items())))
        up, down = round_bytes(spec, 0, merged=False)
        out["schemes"][f"{mode}_{codec.label}"] = entry(up, down, round_bytes(spec, 0, merged=True)[1], merges, rounds)
    out["schemes"]["reference_fp32"] = entry(total_fp32, total_fp32, total_fp32, merges, rounds)
    return out


def entry(up: int, down: int, down_merge: int, merges: int, rounds: int) -> dict[str, Any]:
    amortized_down = (merges * down_merge + (rounds - merges) * down) / rounds
    return {
        "up": up,
        "down": down,
        "down_merge_round": down_merge,
        "up_plus_down": up + down,
        "amortized_up_plus_down": up + amortized_down,
    }


def measure_rounds(path: Path, codecs: Sequence[CodecChoice]) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """Real rounds through a real server on loopback: 4 peers, per mode and codec; the clients' byte counters, and
    their checks against the analytic figures.

    Keys `<mode>_<codec>_<round>`: `plain`, `merge` (step 2, merge interval 2), and on a held-model codec `first`
    (its full round; the plain round is then step 3).
    """
    runs: list[tuple[Mode, CodecChoice]] = [("spes", c) for c in codecs]
    runs += [("diloco", CodecChoice.parse(c)) for c in DILOCO_CODECS]
    merge = [*server_overrides(MERGE), EVERY_STEP]
    measured: dict[str, Any] = {}
    checks = []
    states: dict[Mode, dict[str, torch.Tensor]] = {}
    for mode, codec in runs:
        spec = run_specs(path, codec, *merge)[mode]
        state = states.get(mode) or states.setdefault(mode, initial_state(path, mode))
        steps = {1: "first", 2: "merge", 3: "plain"} if holds_model(spec.codec_impl) else {1: "plain", 2: "merge"}
        if mode == "diloco":
            steps = {1: "plain"}
        with real_run(spec) as clients:
            for step, kind in steps.items():
                key = f"{mode}_{codec.label}_{kind}"
                stats = run_round(clients, step, state)
                measured[key] = [
                    {"peer": p, "up": s.bytes_up, "down": s.bytes_down, "merged": s.merged, "seconds": s.seconds}
                    for p, s in enumerate(stats)
                ]
                for p, s in enumerate(stats):
                    want = round_bytes(spec, p, s.merged, kind == "first")
                    checks.append(check(key, p, (s.bytes_up, s.bytes_down), want))
            status = clients[0].status()
            measured[f"{mode}_{codec.label}_server_counters"] = {
                "bytes_in": status.bytes_in,
                "bytes_out": status.bytes_out,
            }
    return measured, checks


def initial_state(path: Path, mode: Mode) -> dict[str, torch.Tensor]:
    """The config's model as initialized, every tensor a peer of `mode` synchronizes."""
    cfg = load_config(path, ["--using_dilico=true"] if mode == "diloco" else [])[0]
    with torch.device("meta"):
        model = Transformer.for_run(cfg)
    model.to_empty(device="cpu")
    model.init_weights(cfg.seed)
    return {n: p.detach() for n, p in model.named_parameters()}


@contextmanager
def real_run(spec: RunSpec) -> Iterator[list[SyncClient]]:
    """A real server of the run `spec` on loopback and its `spec.num_peers` clients, joined."""
    server = start_server(ServerConfig(spec, DeployConfig(host="127.0.0.1", port=0)))
    try:
        with joined(f"127.0.0.1:{server.port}", spec) as clients:
            yield clients
    finally:
        server.stop(grace_s=0.5)


@contextmanager
def joined(addr: str, spec: RunSpec) -> Iterator[list[SyncClient]]:
    """The clients of every peer of `spec` at the server at `addr`, joined."""
    clients = [SyncClient(spec, p, SpesConfig(server_addr=addr)) for p in range(spec.num_peers)]
    try:
        for client in clients:
            client.join()
        yield clients
    finally:
        for client in clients:
            client.close()


def measure_paper(path: Path, codec: CodecChoice) -> dict[str, Any]:
    """SPES on `codec` on the paper's 1B manifest through real servers, slice by slice (see the module docstring):
    per slice the first round, a merge round (step 2) and a plain round (step 3); peer 0's bytes.

    Each slice runs in fresh processes (a server process, and one for its clients), so no slice's memory (a server's
    buffers, four clients' held models) is still held when the next starts; their peaks are recorded.
    """
    manifest = manifest_of(load_config(path)[0])
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
                per_slice[label] = got = pool.submit(measure_slice, path, codec, names, Path(logs)).result()
            print(
                f"  1B {codec.label}, {label}: {len(names)} tensors, {got['peers']} peer(s): plain round up "
                f"{got['plain']['up'] / MIB:,.1f} MiB, down {got['plain']['down'] / MIB:,.1f} MiB (peak memory: "
                f"clients {got['peak_rss_clients'] / 2**30:.2f} GiB, server {got['peak_rss_server'] / 2**30:.2f} GiB)",
                flush=True,
            )
    totals = {
        kind: {way: sum(v[kind][way] for v in per_slice.values()) for way in ("up", "down")}
        for kind in ("first", "merge", "plain")
    }
    return {"slices": per_slice, "totals": totals}


def slice_spec(path: Path, codec: CodecChoice, names: list[str]) -> RunSpec:
    """The run spec of the config's run on `codec` over the tensors `names` only (a round every step, merging on
    even steps): the run's peers when the slice holds expert blocks, else one."""
    cfg = load_config(path, [*codec.overrides(), EVERY_STEP])[0]
    full = run_spec(cfg, manifest_of(cfg))
    assert full.manifest is not None
    experts = set(full.trainable(1, names)) != set(names)  # another peer's blocks are here
    return dataclasses.replace(
        full,
        manifest={n: full.manifest[n] for n in names},
        num_peers=full.num_peers if experts else 1,
        block_owners=full.block_owners if experts else (),
        server=MERGE,
    )


def measure_slice(path: Path, codec: CodecChoice, names: list[str], logs: Path) -> dict[str, Any]:
    """Three real rounds on `codec` over the tensors `names` of the config's model, served by a server process
    started with the slice's run spec as overrides: peer 0's bytes per round and both processes' peak resident
    memory."""
    torch.set_num_threads(1)
    spec = slice_spec(path, codec, names)
    assert spec.manifest is not None
    gen = torch.Generator().manual_seed(load_config(path)[0].seed)
    state = {n: torch.randn(shape, generator=gen) * 0.02 for n, shape in spec.manifest.items()}
    server, port = common.start_server([*spec_overrides(spec), "--data_port", "0"], logs / "server.log")
    try:
        with joined(f"127.0.0.1:{port}", spec) as clients:
            steps = ((1, "first"), (2, "merge"), (3, "plain"))
            rounds = {kind: run_round(clients, step, state)[0] for step, kind in steps}
        server_peak = proc_peak_rss(server.pid)
    finally:
        server.terminate()
        server.wait(timeout=60)
    return {
        "tensors": len(names),
        "peers": spec.num_peers,
        **{kind: {"up": s.bytes_up, "down": s.bytes_down} for kind, s in rounds.items()},
        "peak_rss_clients": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "peak_rss_server": server_peak,
    }


def proc_peak_rss(pid: int) -> int:
    """A live process's peak resident memory (VmHWM), in bytes."""
    status = Path(f"/proc/{pid}/status").read_text()
    return int(next(line for line in status.splitlines() if line.startswith("VmHWM:")).split()[1]) * 1024


def run_round(clients: list[SyncClient], step: int, state: dict[str, torch.Tensor]) -> list[SyncStats]:
    """Every peer's `sync` at once (one thread each), as in a real round."""
    results: list[Any] = [None] * len(clients)
    errors: list[BaseException] = []

    def run(p: int) -> None:
        try:
            upload = {n: state[n] for n in clients[p].spec.trainable(p)}
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
    """Serialized size of one SPES upload of peer 0 on the raw codec `wire` against its payload: over gRPC
    (protobuf messages + gRPC prefixes) and over the raw-TCP data plane (a `TensorHeader` frame and the 8-byte
    checksum per tensor)."""
    spec = run_specs(path, CodecChoice.parse(wire))["spes"]
    manifest = spec.manifest or {}
    payload = serialized = data_plane = 0
    for name in spec.trainable(0):
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


def paper_targets(paper: dict[str, Any], codecs: Sequence[CodecChoice], measured: dict[str, Any]) -> dict[str, float]:
    """The paper 1B's ratios against the reference and DiLoCo, from shapes and as `measured` (printed)."""
    s = paper["schemes"]
    reference = s["reference_fp32"]["up_plus_down"]
    targets = {
        "spes_bf16_over_reference": s["spes_bf16"]["up_plus_down"] / reference,
        "spes_bf16_saving_vs_diloco_bf16": 1 - s["spes_bf16"]["up_plus_down"] / s["diloco_bf16"]["up_plus_down"],
        "spes_fp32_saving_vs_diloco_fp32": 1 - s["spes_fp32"]["up_plus_down"] / s["diloco_fp32"]["up_plus_down"],
        "spes_bf16_saving_vs_diloco_fp32": 1 - s["spes_bf16"]["up_plus_down"] / s["diloco_fp32"]["up_plus_down"],
    }
    for label in (c.label for c in codecs):
        targets[f"spes_{label}_over_reference"] = s[f"spes_{label}"]["up_plus_down"] / reference
        targets[f"spes_{label}_amortized_over_reference"] = s[f"spes_{label}"]["amortized_up_plus_down"] / reference
    print(
        "\npaper 1B: SPES bf16 / reference = {:.3f} (target <= 0.5); SPES saves {:.1%} vs DiLoCo at the same wire "
        "dtype (target >= 33.3%), {:.1%} vs DiLoCo fp32".format(
            targets["spes_bf16_over_reference"],
            targets["spes_bf16_saving_vs_diloco_bf16"],
            targets["spes_bf16_saving_vs_diloco_fp32"],
        )
    )
    merges, rounds = paper["merge_rounds_in_run"], paper["rounds_in_run"]
    for label, got in measured.items():
        totals = got["totals"]
        down = (merges * totals["merge"]["down"] + (rounds - merges) * totals["plain"]["down"]) / rounds
        plain = (totals["plain"]["up"] + totals["plain"]["down"]) / reference
        amortized = (totals["plain"]["up"] + down) / reference
        targets[f"measured_spes_{label}_over_reference"] = plain
        targets[f"measured_spes_{label}_amortized_over_reference"] = amortized
        print(
            f"paper 1B, SPES {label} measured through real servers: {plain:.4f} of the reference's fp32 bytes per "
            f"peer and round ({amortized:.4f} amortized over merge rounds"
            + (f"; target <= {INT8_TARGET}" if label == "int8" else "")
            + "); the first round moves full fp32 values"
        )
    return targets


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """The command line, with the quick and full defaults of --config and --paper_codecs filled in."""
    p = parser("bench_wire", __doc__)
    p.add_argument(
        "--config", type=config_file, default=None, help="config measured for real (default: small, quick: tiny)"
    )
    p.add_argument(
        "--codecs",
        nargs="+",
        type=codec_choice,
        default=[CodecChoice.parse(c) for c in CODECS],
        metavar="NAME[:key=value,...]",
        help=f"the SPES codecs measured (default: {' '.join(CODECS)}), with codec_settings: e.g. sparse:topk=32",
    )
    p.add_argument(
        "--paper_codecs",
        nargs="*",
        type=codec_choice,
        default=None,
        metavar="NAME[:key=value,...]",
        help="the codecs measured on the paper's 1B manifest through real servers (default: int8; --quick: none)",
    )
    args = p.parse_args(argv)
    args.config = args.config or REPO_ROOT / "configs" / ("tiny.yaml" if args.quick else "small.yaml")
    if args.paper_codecs is None:
        args.paper_codecs = [] if args.quick else [CodecChoice.parse("int8")]
    return args


def check_table(checks: list[dict[str, Any]]) -> str:
    """Measured rounds against the analytic figures, one line per peer and round."""
    return format_table(["round", "peer", "up MiB", "down MiB", "= analytic"], [rows_of(c) for c in checks])


def print_framing(framing: dict[str, dict[str, int]]) -> None:
    """What the messages add to the payload bytes, per raw codec and plane (the tables count payloads only)."""
    for wire, f in framing.items():
        for plane, key in (("gRPC", "serialized"), ("data plane", "data_plane")):
            print(
                f"framing of one {wire} upload over {plane}: {f[key] - f['payload']:,} bytes over {f['payload']:,} "
                f"({100 * (f[key] - f['payload']) / f['payload']:.4f}%)"
            )


def measure_paper_codecs(codecs: Sequence[CodecChoice]) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """Each of `codecs` on the paper's 1B through real servers (`measure_paper`), its round totals checked against
    the analytic figures; its checks printed as soon as it finishes (each is a long measurement, slice by slice)."""
    measured: dict[str, Any] = {}
    checks: list[dict[str, Any]] = []
    for codec in codecs:
        measured[codec.label] = got = measure_paper(PAPER_1B, codec)
        spec = run_specs(PAPER_1B, codec)["spes"]
        for kind, total in got["totals"].items():
            want = round_bytes(spec, 0, kind == "merge", kind == "first")
            checks.append(check(f"paper_1b_{codec.label}_{kind}", 0, (total["up"], total["down"]), want))
        print(check_table(checks[-3:]))
    return measured, checks


def main(argv: list[str] | None = None) -> int:
    """The analytic tables, the measured rounds and their checks, then the targets; exit status 1 when a check or
    the int8 target fails."""
    args = parse_args(argv)
    paper = analytic_table(PAPER_1B, PAPER_MERGE, args.codecs)
    small = analytic_table(args.config, PAPER_MERGE, args.codecs)
    print_scheme_table(f"paper 1B ({PAPER_1B.relative_to(REPO_ROOT)}), from shapes", paper)
    print_scheme_table(f"{repo_path(args.config)}, from shapes", small)

    measured, checks = measure_rounds(args.config, args.codecs)
    print(f"\nmeasured through a real server on loopback ({repo_path(args.config)}, 4 peers):")
    print(check_table(checks))
    framing = {wire: framing_overhead(args.config, wire) for wire in ("fp32", "bf16")}
    print_framing(framing)
    paper_measured, paper_checks = measure_paper_codecs(args.paper_codecs)
    checks += paper_checks

    targets = paper_targets(paper, args.codecs, paper_measured)
    ok = (
        all(c["equal"] for c in checks) and targets.get("measured_spes_int8_amortized_over_reference", 0) <= INT8_TARGET
    )
    print(f"measured = analytic for every peer and round: {'yes' if ok else 'NO'}")
    write_results(
        args.out,
        {
            "mode": "quick" if args.quick else "full",
            "machine": machine_info(),
            "config": repo_path(args.config),
            "codecs": [c.label for c in args.codecs],
            "paper_1b": paper,
            "measured_config": small,
            "measured": measured,
            "paper_1b_measured": paper_measured,
            "checks": checks,
            "framing": framing,
            "targets": targets,
        },
    )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
