"""The tables (and the paragraphs around them) that `bench/report.py` renders into README.md and docs/ from records.

Each entry of `BLOCKS` fills the text between `<!-- NAME:start -->` and `<!-- NAME:end -->` of any published
document; `WHOLE_FILES` are documents rendered whole (the mini-reproductions' reports). A block whose record is
missing says "not measured yet (run: ...)" instead (`records.Missing`).
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from typing import Any

from common import idle_share
from records import (
    CODEC_SEEDS,
    DENSE_SPARSE,
    DILOCO_CURVE,
    F5_RECORDS,
    GPU_RUNS,
    PROFILED_MICRO_BATCHES,
    Missing,
    Records,
    codec_losses,
    default_gpu_step,
    gpu_runs,
    int8_runs,
    link,
    not_measured,
    wire_measured,
)

GIB, MIB = 2**30, 2**20

Block = Callable[[Records], str]
BLOCKS: dict[str, Block] = {}


def block(name: str) -> Callable[[Block], Block]:
    """Register a block renderer under `name` (the marker's name)."""

    def register(fn: Block) -> Block:
        BLOCKS[name] = fn
        return fn

    return register


def table(headers: list[str], rows: list[list[Any]]) -> str:
    """A markdown table."""
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def short(commit: str) -> str:
    """A commit as the docs show it: 7 hex digits, `-dirty` kept."""
    return commit[:7] + ("-dirty" if "-dirty" in commit else "")


# ---------------------------------------------------------------------------------------------------------------
# GPU advice (README)

GPU_MARKERS = ("<!-- gpu-table:start -->", "<!-- gpu-table:end -->")
CARDS = (("24 GB", "RTX 4090, L4", 22.0), ("48 GB", "L40S, A6000", 44.4), ("80 GB", "A100 / H100 80GB", 79.1))
"""GPU classes of the advice, with the memory their cards report (GiB; the smallest of the class)."""
USABLE = 0.9  # NOTE: spes.preflight's USABLE_MEMORY: the rest is allocator slack, CUDA context, fragmentation


def _setting(v: dict[str, Any]) -> str:
    s = v["settings"]
    return (
        f"`moe_backend: {v['moe_backend']}`, micro-batch {s['micro_batch']}"
        f"{', `fused_loss`' if s['fused_loss'] else ''}{', `compile`' if s['compile'] else ''}"
        f"{'' if s['checkpointing'] else ', no activation checkpointing'}"
    )


def gpu_settings(records: Records) -> list[dict[str, Any]]:
    """Every measured 1B node setting on a GPU a config can make (a variant with a bench-only loss chunk or head is
    not one), each at its newest measurement: the variants of the GPU runs and
    the runs of bench_wan_gpu_steps.json, each with its tokens/s of the config's step, peak GiB and record."""
    newest: dict[str, dict[str, Any]] = {}
    for name, run in gpu_runs(records):
        for v in run["variants"]:
            bench_only = v["settings"].get("loss_chunk") or v["settings"].get("head")
            if v["status"] == "ok" and v.get("peak_memory_bytes") and not bench_only:
                newest[_setting(v)] = {
                    "setting": _setting(v),
                    "tokens_per_s": v["tokens_per_s"],
                    "peak_gib": v["peak_memory_bytes"] / GIB,
                    "record": f"{name}.json",
                    "device": run["machine"].get("name", ""),
                }
    out = list(newest.values())
    try:
        steps = records("bench_wan_gpu_steps")
    except Missing:
        steps = {"runs": []}
    for run in steps["runs"]:
        out.append(
            {
                "setting": f"`moe_backend: {run['moe_backend']}`, micro-batch {run['microbatch']} (no activation "
                "checkpointing, whole logits: before issue 29)",
                "tokens_per_s": run["sequences_per_step"] * 2048 / run["step_s"],
                "peak_gib": run["peak_memory_gib"],
                "record": "bench_wan_gpu_steps.json",
                "device": steps["device"],
            }
        )
    return out


def _gpu_variants(name: str, gpu: dict[str, Any]) -> list[str]:
    m = gpu["machine"]
    lines = [
        f"**`{name}.json`**: {GPU_RUNS[name]}. The 1B SPES node (`configs/spes_1b/node_0.yaml`, peer 0, amp_bf16) "
        f"on one {m.get('name', 'GPU')} (torch {m['torch']}, commit {gpu['commit'][:12]}; `bench/bench_gpu.py`): "
        "each variant's step of 256 sequences projected from timed steps of 1 and 4 micro-batches; MFU by "
        "`tflops_per_token` and, after the slash, by the FLOPs done (frozen experts skip their weight gradients); "
        "spread: (slowest - fastest) / median of the timed steps of 4; GPU busy: the profiled step's kernel time "
        "over the timed step of as many micro-batches (below 100%, the GPU waited).",
        "",
        "| variant | step s | tokens/s | MFU | peak GiB | syncs/step | spread | GPU busy |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for v in gpu["variants"]:
        if v["status"] != "ok":
            lines.append(f"| {v['name']} | {v['status']} | | | | | | |")
            continue
        mfu = f"{v['mfu']:.1%} / {v['mfu_done']:.1%}" if "mfu" in v else "n/a"
        peak = f"{v['peak_memory_bytes'] / GIB:.1f}" if v.get("peak_memory_bytes") else "n/a"
        timed = v["timed_steps_s"][str(max(map(int, v["timed_steps_s"])))]
        spread = (max(timed) - min(timed)) / statistics.median(timed)
        lines.append(
            f"| {v['name']} | {v['step_s']:.2f} | {v['tokens_per_s']:,.0f} | {mfu} | {peak} | "
            f"{v['syncs_per_step']['count']} | {spread:.0%} | {device_busy(v):.0%} |"
        )
    return [*lines, ""]


def device_busy(v: dict[str, Any]) -> float:
    """A variant's `device_busy` (bench_gpu.py); for a record from before it, the same from the kernel table: the
    total its shares imply, less the record_function ranges in it (they span kernels that are rows of their own)."""
    if "device_busy" in v:
        return float(v["device_busy"])
    top = v["top_kernels"]
    spans = sum(k["ms"] for k in top if k["name"].startswith("Optimizer."))
    kernel_s = (top[0]["ms"] / top[0]["share"] - spans) / 1e3
    return kernel_s / (v["fixed_s"] + PROFILED_MICRO_BATCHES * v["per_micro_batch_s"])


@block("gpu-table")
def gpu_block(records: Records) -> str:
    """The README's GPU section (markdown), from the records alone."""
    runs = gpu_runs(records)
    lines = []
    if not runs:
        lines.append(
            "No GPU benchmark record yet: `bench/results/bench_gpu.json` is written by `bash bench/run_gpu.sh` on a "
            "GPU (issue 29) and this section is rendered from it by `bench/report.py`."
        )
    for name, run in runs:
        lines += _gpu_variants(name, run)
    lines += [
        f"What to set, by GPU memory: the fastest measured setting (at its newest measurement) whose peak is at most "
        f"{USABLE:.0%} of the card's memory (`spes.preflight`'s margin); `.venv/bin/python -m spes.preflight CONFIG` "
        "estimates the largest micro-batch of any other setting.",
        "",
    ]
    lines += ["| GPU | setting | tokens/s | peak GiB | measured on |", "|---|---|---|---|---|"]
    settings = gpu_settings(records)
    for label, cards, total in CARDS:
        fits = [s for s in settings if s["peak_gib"] <= USABLE * total]
        if not fits:
            smallest = min(settings, key=lambda s: s["peak_gib"], default=None)
            what = f"smallest measured: {smallest['setting']} at {smallest['peak_gib']:.1f} GiB" if smallest else ""
            lines.append(f"| {label} ({cards}) | no measured setting fits; {what} | | | |")
            continue
        best = max(fits, key=lambda s: s["tokens_per_s"])
        lines.append(
            f"| {label} ({cards}) | {best['setting']} | {best['tokens_per_s']:,.0f} | {best['peak_gib']:.1f} | "
            f"{best['device']} (`{best['record']}`) |"
        )
    return "\n".join(lines)


def mib(b: float) -> str:
    return f"{b / MIB:,.0f} MiB"


def pct(x: float) -> str:
    return f"{x:+.2%}"


# ---------------------------------------------------------------------------------------------------------------
# docs/benchmarks.md


@block("bench-memory")
def memory_tables(records: Records) -> str:
    r = records("bench_memory")
    return f"{measured_memory_table(r)}\n\n{paper_memory_table(r)}"


def measured_memory_table(r: dict[str, Any]) -> str:
    """The config measured for real: each node's bytes by kind and its peak above its baseline, SPES over full."""
    ratio = r["ratios_spes_over_full"]

    def row(label: str, x: dict[str, Any]) -> list[Any]:
        mb = [f"{x[k] / MIB:.1f} MiB" for k in ("param_bytes", "grad_bytes", "optimizer_bytes", "static_bytes")]
        return [
            label,
            f"{x['params'] / 1e6:.2f}M",
            f"{x['trainable_params'] / 1e6:.2f}M",
            *mb,
            f"{x['peak_minus_before_bytes'] / MIB:.1f} MiB",
        ]

    spes, full = r["measured"]["spes"]["measured"], r["measured"]["full"]["measured"]
    header = [f"{r['config']} (measured)", "params", "trained", "weights", "grads", "AdamW", "static"]
    ratios = [
        "SPES / full",
        "",
        f"{spes['trainable_params'] / full['trainable_params']:.3f}",
        f"{spes['param_bytes'] / full['param_bytes']:.3f}",
        f"{ratio['grad_bytes']:.3f}",
        f"{ratio['optimizer_bytes']:.3f}",
        f"**{ratio['static_bytes']:.3f}**",
        f"{ratio['peak_minus_before_bytes']:.3f}",
    ]
    rows = [row("SPES node (peer 0 of 4)", spes), row("full node (DiLoCo / centralized)", full), ratios]
    return table([*header, "peak RSS above baseline"], rows)


def paper_memory_table(r: dict[str, Any]) -> str:
    """The paper's 1B config, counted analytically: what the saving is at the size the method is for."""

    def row(label: str, x: dict[str, Any]) -> list[Any]:
        gb = [f"{x[k] / GIB:.2f} GiB" for k in ("param_bytes", "grad_bytes", "optimizer_bytes", "static_bytes")]
        return [label, f"{x['params'] / 1e9:.3f}B", f"{x['trainable_params'] / 1e9:.3f}B", *gb]

    a, b = (r["paper_1b"][kind]["analytic"] for kind in ("spes", "full"))
    ratios = [
        "SPES / full",
        "",
        f"{a['trainable_params'] / b['trainable_params']:.3f}",
        f"{a['param_bytes'] / b['param_bytes']:.3f}",
        f"{a['grad_bytes'] / b['grad_bytes']:.3f}",
        f"{a['optimizer_bytes'] / b['optimizer_bytes']:.3f}",
        f"**{a['static_bytes'] / b['static_bytes']:.3f}** ({(a['static_bytes'] - b['static_bytes']) / GIB:.2f} GiB)",
    ]
    return table(
        ["paper 1B (analytic, one replica)", "params", "trained", "weights", "grads", "AdamW", "static"],
        [row("SPES node (4 of 16 experts)", a), row("full node", b), ratios],
    )


SCHEME_LABELS = {
    "spes_fp32": "SPES fp32",
    "spes_bf16": "**SPES bf16**",
    "spes_int8": "SPES int8 deltas (section 2b)",
    "diloco_fp32": "DiLoCo fp32",
    "diloco_bf16": "DiLoCo bf16",
    "reference_fp32": "reference fp32",
}


@block("bench-wire")
def wire_table(records: Records) -> str:
    s = records("bench_wire")["paper_1b"]["schemes"]
    ref = s["reference_fp32"]["up_plus_down"]
    rows = []
    for name, label in SCHEME_LABELS.items():
        x = s[name]
        diloco = s.get(f"diloco_{name.split('_')[1]}") if name.startswith(("spes", "diloco")) else None
        rows.append(
            [
                label,
                mib(x["up"]),
                mib(x["down"]),
                mib(x["down_merge_round"]),
                mib(x["up_plus_down"]),
                mib(x["amortized_up_plus_down"]),
                f"{x['up_plus_down'] / ref:.3f}",
                f"{x['up_plus_down'] / diloco['up_plus_down']:.3f}" if diloco else "-",
            ]
        )
    return table(
        [
            "paper 1B, per peer per round",
            "up",
            "down",
            "down, merge round",
            "up + down",
            "amortized",
            "/ reference",
            "/ DiLoCo same dtype",
        ],
        rows,
    )


@block("bench-wire-measured")
def wire_measured_table(records: Records) -> str:
    """Peer 0's bytes on the paper's 1B through real servers, per codec measured: the first round (as a catch-up),
    a merge round, a plain round, and the run's average over its merge rounds."""
    r = records("bench_wire")
    ref, p = r["paper_1b"]["schemes"]["reference_fp32"]["up_plus_down"], r["paper_1b"]
    n, m = p["rounds_in_run"], p["merge_rounds_in_run"]
    rows = []
    for codec, measured in wire_measured(records).items():
        t = measured["totals"]
        for k, label in (
            ("first", "first round, or a catch-up (full fp32 values)"),
            ("merge", "merge round"),
            ("plain", "plain round"),
        ):
            both = t[k]["up"] + t[k]["down"]
            rows.append([f"`{codec}`", label, mib(t[k]["up"]), mib(t[k]["down"]), mib(both), f"{both / ref:.4f}"])
        merged, plain = (t[k]["up"] + t[k]["down"] for k in ("merge", "plain"))
        amortized = (m * merged + (n - m) * plain) / n
        rows.append(
            [f"`{codec}`", f"amortized ({m} merge rounds of {n})", "", "", mib(amortized), f"**{amortized / ref:.4f}**"]
        )
    headers = ["codec", "paper 1B, peer 0", "up", "down", "up + down", f"/ reference fp32 ({mib(ref)})"]
    return table(headers, rows)


CODECS = ("int8", "bf16", "sparse")


@block("codec-loss")
def codec_loss_table(records: Records) -> str:
    """Final validation loss of the mini-reproduction's SPES arm per codec against fp32, side by side in one run."""
    rows = []
    for codec in CODECS:
        cells = []
        for suffix in CODEC_SEEDS:
            try:
                fp32, coded = codec_losses(records, codec, suffix)
            except Missing as missing:
                cells += [not_measured(missing.record), ""]
                continue
            cells += [f"{fp32:.4f} / {coded:.4f}", f"**{(coded - fp32) / fp32:+.3%}**"]
        rows.append([f"`{codec}`", *cells])
    return table(["codec", "seed 6198: fp32 / codec", "vs fp32", "seed 7: fp32 / codec", "vs fp32"], rows)


@block("codec-curve")
def codec_curve_table(records: Records) -> str:
    """Every arm of the codec comparisons: bits per parameter per peer and round against the final loss."""
    rows = []
    names = ("mini_repro_codecs", "mini_repro_codecs_seed7", "mini_repro_codecs_diloco", DILOCO_CURVE, DENSE_SPARSE)
    for x in records.committed([*names, *(f"{n}{s}" for n in F5_RECORDS for s in CODEC_SEEDS)]):
        base = "diloco" if "diloco" in x["arms"] else "spes"
        for arm, a in sorted(x["arms"].items(), key=lambda kv: -kv[1]["bits_per_param"]["last"]):
            settings = [f.split(".")[-1].removeprefix("codec=") for f in a["flags"]] or ["fp32"]
            rows.append(
                [
                    f"{base.upper() if base == 'spes' else 'DiLoCo'}, seed {x['seed']}",
                    f"`{' '.join(settings)}`",
                    f"{a['bits_per_param']['last']:.3f}",
                    f"{a['bits_per_param']['mean']:.3f}",
                    f"{a['final_val_loss']:.4f}",
                    "" if arm == base else f"**{a['vs_fp32']:+.2%}**",
                ]
            )
    if not rows:
        raise Missing("mini_repro_codecs")
    headers = ["run", "codec", "bits/param/round, steady", "over the run", "final val loss", "vs fp32"]
    return table(headers, rows)


@block("int8-runs")
def int8_runs_table(records: Records) -> str:
    rows = []
    for x in int8_runs(records):
        for arm, label in (("spes", "fp32 wire"), ("codec_int8", "int8 deltas")):
            rows.append(
                [
                    f"seed {x['seed']}, {label}",
                    f"{x['arms'][arm]['final_val_loss']:.4f}",
                    f"{x['tokens'][arm]:,}",
                    mib(x["curves"][arm]["bytes"][-1]),
                    f"{x['arms'][arm]['wall_s']:.0f} s",
                    short(x["commit"]),
                ]
            )
    return table(
        [
            "SPES, 4 peers",
            "final validation loss (merged model)",
            "tokens (logged)",
            "bytes moved by all peers",
            "wall",
            "commit",
        ],
        rows,
    )


SYNC_LABELS = {
    "fp32_grpc": ("fp32", "gRPC"),
    "fp32_tcp": ("**fp32**", "**TCP data plane**"),
    "bf16_grpc": ("bf16", "gRPC"),
    "bf16_tcp": ("bf16", "TCP data plane"),
}


@block("bench-sync")
def sync_table(records: Records) -> str:
    rows = []
    for key, (wire, plane) in SYNC_LABELS.items():
        m = records("bench_sync")["measurements"][key]
        best = min(m["spes_rounds"], key=lambda x: x["seconds"])
        raw = min(m["raw_rounds"], key=lambda x: x["seconds"])
        rows.append(
            [
                wire,
                plane,
                f"{best['bytes'] / 1e9:.2f}",
                f"{best['seconds']:.2f} s",
                f"{best['gb_s']:.2f}",
                f"{min(m['server_aggregation_s']):.2f} s",
                f"{raw['seconds']:.2f} s",
                f"{raw['gb_s']:.2f}",
                f"**{m['spes_over_raw_throughput']:.1%}**",
                f"{m['spes_over_raw_excluding_aggregation']:.1%}",
            ]
        )
    return table(
        [
            "wire",
            "payloads over",
            "GB moved",
            "SPES round",
            "SPES GB/s",
            "of which aggregation",
            "raw TCP",
            "raw GB/s",
            "**SPES / raw**",
            "excl. aggregation",
        ],
        rows,
    )


@block("bench-aggregate")
def aggregate_table(records: Records) -> str:
    rows = [
        [
            x["case"],
            x["dtype"],
            f"{x['upload_bytes'] / 1e9:.2f}",
            f"{x['aggregate_s']:.2f} s ({x['aggregate_gb_s']:.1f} GB/s)",
            f"{x['memcpy_gb_s']:.1f} GB/s",
            f"{x['copy_into_gb_s']:.1f} GB/s",
            f"**{x['aggregate_over_copy_into']:.2f}**",
            f"{x['aggregate_over_memcpy']:.2f}",
        ]
        for x in records("bench_aggregate")["results"]
    ]
    return table(
        ["case", "uploads", "GB in", "aggregate", "clone", "copy_", "**aggregate / copy_**", "aggregate / clone"], rows
    )


@block("bench-train")
def train_table(records: Records) -> str:
    rows = [
        [
            x["variant"].replace("/", " / "),
            f"{x['median_step_s']:.2f} s",
            f"{x['tokens_per_s']:,.0f}",
            f"{x['gflops']:.0f}",
            f"**{x['speed_vs_full_torch']:.2f}**",
        ]
        for x in records("bench_train")["results"]
    ]
    return table(["node / MoE backend", "step", "tokens/s", "GFLOP/s", "vs full/torch"], rows)


@block("bench-train-gpu")
def train_gpu_table(records: Records) -> str:
    rows = [
        [
            x["variant"].replace("/", " / "),
            f"{x['median_step_s']:.3f} s",
            f"{x['tokens_per_s']:,.0f}",
            f"**{x['speed_vs_full_torch']:.2f}**",
            f"{x['mfu']:.2%}",
            f"{x['peak_memory_bytes'] / GIB:.2f}",
        ]
        for x in records("bench_train_gpu")["results"]
    ]
    return table(["node / MoE backend", "step", "tokens/s", "vs full/torch", "MFU", "peak GiB"], rows)


@block("bench-fused-loss")
def fused_loss_table(records: Records) -> str:
    arms = records("bench_fused_loss")["arms"]
    rows = [
        [label, f"{a['first_loss']:.6f}", f"{a['median_step_s']:.1f}", mib(a["memory_added_bytes"])]
        for label, a in (("whole logits", arms["whole"]), ("`fused_loss: true`", arms["fused"]))
    ]
    return table(["loss", "first loss", "step s (median)", "memory a step adds"], rows)


@block("mini-repro")
def mini_repro_table(records: Records) -> str:
    runs = [records("mini_repro"), records("mini_repro_seed7")]
    labels = {"centralized": "centralized (4x batch)", "diloco": "DiLoCo, 4 peers", "spes": "SPES, 4 peers"}
    rows = []
    for name, label in labels.items():
        finals = [x["curves"][name]["val_loss"][-1] for x in runs]
        base = [x["curves"]["centralized"]["val_loss"][-1] for x in runs]
        c = runs[0]["curves"][name]
        moved = "0" if name == "centralized" else mib(c["bytes"][-1])
        per_round = (
            "-"
            if name == "centralized"
            else (
                f"{c['bytes_per_peer_round_up'] / MIB:.1f} / {min(c['bytes_per_peer_round_down']) / MIB:.1f} MiB"
                + (
                    f" ({max(c['bytes_per_peer_round_down']) / MIB:.1f} on merge rounds)"
                    if max(c["bytes_per_peer_round_down"]) != min(c["bytes_per_peer_round_down"])
                    else ""
                )
            )
        )
        vs = "-" if name == "centralized" else " / ".join(f"{(f - b) / b:+.1%}" for f, b in zip(finals, base))
        rows.append(
            [label, *(f"{f:.4f}" for f in finals), f"**{sum(finals) / len(finals):.4f}**", vs, moved, per_round]
        )
    seeds = [str(x["seed"]) for x in runs]
    return table(
        [
            "run",
            *(f"final val loss, seed {s}" for s in seeds),
            "**mean**",
            f"vs centralized ({' / '.join(seeds)})",
            "bytes, all peers, up + down",
            "per peer and round (up / down)",
        ],
        rows,
    )


@block("mini-repro-memory")
def mini_repro_memory_table(records: Records) -> str:
    r = records("mini_repro_memory")
    means, sizes = r["mean_curves"], r["sizes"]
    base = means["diloco_small"]["val_loss"][-1]
    any_seed = next(iter(r["curves"].values()))
    rows = [
        [
            arm["label"],
            sizes[arm["size"]],
            f"{means[arm['name']]['val_loss'][-1]:.4f}",
            pct((means[arm["name"]]["val_loss"][-1] - base) / base),
            mib(any_seed[arm["name"]]["bytes"][-1]),
        ]
        for arm in r["arms"]
    ]
    return table(
        [
            f"arm (mean of {len(r['seeds'])} seeds)",
            "experts",
            "final val loss",
            "vs DiLoCo at the budget",
            "communicated",
        ],
        rows,
    )


@block("bench-server-memory")
def server_memory_table(records: Records) -> str:
    rows = [
        [
            f"{c['model_mb']:,.0f} MiB",
            c["peers"],
            f"{c['staged_mb']:,.0f} MiB",
            f"{c['idle_rss_mb']:,.0f} MiB",
            f"{c['peak_rss_mb']:,.0f} MiB",
            f"{c['peak_over_idle_mb']:,.0f} MiB",
            f"{c['peak_over_idle_per_model']:.2f}",
            f"{c['bound_mb']:,.0f} MiB",
            f"**{c['peak_over_idle_per_bound']:.2f}**",
        ]
        for c in records("bench_server_memory")["cases"]
    ]
    return table(
        [
            "model",
            "peers",
            "staged uploads",
            "idle RSS",
            "peak RSS",
            "peak - idle",
            "/ model",
            "bound",
            "**peak - idle / bound**",
        ],
        rows,
    )


@block("bench-soak")
def soak_table(records: Records) -> str:
    rows = []
    for name, label in (("bench_soak", "under churn"), ("bench_soak_no_chaos", "no churn (baseline)")):
        x = records(name)
        c, w = x["chaos"], x["after_warmup"]
        faults = (
            f"{c['idle_grpc_streams']} idle gRPC streams, {c['idle_data_connections']} idle data-plane connections, "
            f"{c['killed_uploads_grpc']} + {c['killed_uploads_data']} uploads killed mid-tensor (gRPC + data plane), "
            f"{c['garbage_frames']} garbage frames, {c['reconnects']} reconnects"
            if c
            else "none"
        )
        logged = (
            f"{x['idle_closed_logged']} idle streams closed, {x['broken_uploads_logged']} broken uploads dropped, "
            f"{x['server_refusals_logged']} refusals"
            if c
            else "-"
        )
        rows.append(
            [
                label,
                f"**{x['rounds_exact']} / {x['rounds']}**",
                faults,
                logged,
                f"{span_of(w['rss_min_max_mb'], '.1f')} MiB (trend {w['rss_trend_mb']:+.1f})",
                span_of(w["threads_min_max"], "d"),
                span_of(w["fds_min_max"], "d"),
            ]
        )
    w = records("bench_soak")["after_warmup"]
    return table(
        [
            "run",
            "rounds exact",
            "faults injected",
            "server logged",
            f"RSS rounds {w['from_round']}-{w['to_round']}",
            "threads",
            "fds",
        ],
        rows,
    )


def span_of(pair: list[float], spec: str) -> str:
    lo, hi = (format(v, spec) for v in pair)
    return lo if lo == hi else f"{lo}-{hi}"


def _wan_link_table(record: dict[str, Any]) -> str:
    """Each measured link, model scale, wire and plane: the round against the link's ideal for its bytes."""
    rows = [
        [
            link(m["peer_mbit"]),
            f"1/{m['scale']}",
            m["wire"],
            "data plane" if m["plane"] == "tcp" else "gRPC",
            f"{m['bytes_per_peer'][0] / 1e6:.1f}",
            f"{m['ideal_s']:.2f}",
            f"{m['spes_s']:.2f}",
            f"**{m['efficiency']:.1%}**",
            f"{m['raw_efficiency']:.1%}",
        ]
        for m in record["measurements"]
    ]
    headers = [
        "link",
        "model",
        "wire",
        "plane",
        "MB per peer",
        "ideal s",
        "SPES s",
        "**SPES / ideal**",
        "raw socket / ideal",
    ]
    return table(headers, rows)


@block("bench-wan")
def wan_table(records: Records) -> str:
    return _wan_link_table(records("bench_wan"))


@block("bench-wan-codecs")
def wan_codecs_table(records: Records) -> str:
    """The codecs through the same links (`bench_wan.py --wires`), each on its own scaled model (`scale_for`)."""
    return _wan_link_table(records("bench_wan_codecs"))


def _idle_rows(record: dict[str, Any], both_planes: bool) -> list[list[Any]]:
    by = {(p["peer_mbit"], p["wire"], p["plane"]): p for p in record["prediction_1b"]}
    rows = []
    for mbit, wire in sorted({(k[0], k[1]) for k in by}, key=lambda k: (-k[0], k[1])):
        tcp, grpc = by[(mbit, wire, "tcp")], by[(mbit, wire, "grpc")]
        cells = [
            f"{tcp['idle_fraction'][n]:.1%} / {grpc['idle_fraction'][n]:.1%}"
            if both_planes
            else f"{tcp['idle_fraction'][n]:.2%}"
            for n in tcp["idle_fraction"]
        ]
        rows.append([link(mbit), wire, f"{tcp['round_s']:,.0f} / {grpc['round_s']:,.0f}", *cells])
    return rows


def _idle_headers(record: dict[str, Any]) -> list[str]:
    steps = list(record["prediction_1b"][0]["idle_fraction"])
    return ["link", "wire", "round s (data plane / gRPC)", f"not training at sync_steps {steps[0]}", *steps[1:]]


@block("bench-wan-1b-cpu")
def wan_cpu_table(records: Records) -> str:
    r = records("bench_wan")
    return table(_idle_headers(r), _idle_rows(r, both_planes=False))


@block("bench-wan-1b-gpu")
def wan_gpu_table(records: Records) -> str:
    r = records("bench_wan_gpu")
    return table(_idle_headers(r), _idle_rows(r, both_planes=True))


@block("bench-wan-gpu-steps")
def wan_gpu_steps_table(records: Records) -> str:
    step = records("bench_wan_gpu")["step_measurement_1b"]
    rows = [
        [
            f"micro-batch {step['microbatch']}, `moe_backend: torch` (the config)",
            f"{records('bench_wan_gpu')['step_s_1b']:.2f} (median of {len(step['timed_step_seconds'])})",
            f"{step['peak_memory_bytes'] / GIB:.1f}",
        ]
    ]
    rows += [
        [f"micro-batch {x['microbatch']}, `{x['moe_backend']}`", f"{x['step_s']:.1f}", f"{x['peak_memory_gib']:.1f}"]
        for x in records("bench_wan_gpu_steps")["runs"]
    ]
    return table([f"1B SPES node step on the {step['device']}", "step s", "peak GiB"], rows)


def _arm_commit(arm: dict[str, Any]) -> str:
    return short((arm.get("run") or {}).get("commit", "?"))


def _overlap_rows(records: Records, names: list[str], arms: list[str]) -> list[list[Any]]:
    rows = []
    for arm in arms:
        cells = []
        for name in names:
            x = records(name)["arms"].get(arm)
            cells += (
                [f"{x['final_val_loss']:.4f}", pct(x["vs_blocking"]) if arm != "spes" else "", _arm_commit(x)]
                if x
                else ["", "", ""]
            )
        rows.append(cells)
    return rows


def _overlap_label(arm: str) -> list[str]:
    """(run, F, D, c) of an arm name of bench/mini_repro.py (`spes`, `spes_overlap_d2_f5_c0.5`)."""
    if arm == "spes":
        return ["blocking", "-", "-", "-"]
    parts = dict((p[0], p[1:]) for p in arm.removeprefix("spes_overlap_").split("_"))
    return ["overlapped", parts.get("f", "1"), parts["d"], parts.get("c", "1")]


@block("overlap-loss")
def overlap_loss_table(records: Records) -> str:
    """Every overlapped arm of the mini-reproduction against its record's blocking arm, per seed, with each arm's
    commit; a blocking row stands above the arms compared with it (records that reused one blocking run share it)."""
    sets = [
        (
            ["mini_repro_overlap", "mini_repro_overlap_seed7"],
            ["spes_overlap_d10", "spes_overlap_d5", "spes_overlap_d1"],
        ),
        (["mini_repro_overlap_correction", "mini_repro_overlap_seed7"], ["spes_overlap_d10_c0.5"]),
        (["mini_repro_overlap_f5", "mini_repro_overlap_f5_seed7"], ["spes_overlap_d2_f5"]),
        (["mini_repro_overlap_f5_c0.5", "mini_repro_overlap_f5_seed7"], ["spes_overlap_d2_f5_c0.5"]),
        (["mini_repro_overlap_f2", "mini_repro_overlap_f5_seed7"], ["spes_overlap_d5_f2"]),
    ]
    rows: list[list[Any]] = []
    shown: list[Any] = []
    for names, arms in sets:
        [blocking] = _overlap_rows(records, names, ["spes"])
        if blocking != shown:
            rows.append([*_overlap_label("spes"), *blocking])
            shown = blocking
        for arm, cells in zip(arms, _overlap_rows(records, names, arms), strict=True):
            rows.append([*_overlap_label(arm), *cells])
    head = [
        "run",
        "F",
        "D",
        "c",
        "seed 6198: final val loss",
        "vs blocking",
        "commit",
        "seed 7",
        "vs blocking",
        "commit",
    ]
    note = "Each overlapped arm is compared with the blocking row above it (of its seed): its record's blocking run."
    return f"{table(head, rows)}\n\n{note}"


F5_ARMS = {
    "spes": "blocking, fp32",
    "codec_bf16": "blocking, bf16",
    "spes_overlap_d2_f5": "overlap + 5 fragments, fp32",
    "codec_int8_spes_overlap_d2_f5": "overlap + 5 fragments, int8",
    "codec_sparse_spes_overlap_d2_f5": "overlap + 5 fragments, sparse",
    "codec_int8_spes_overlap_d1_f5": "overlap + 5 fragments, applied 1 step later, int8",
    "codec_sparse_spes_overlap_d1_f5": "overlap + 5 fragments, applied 1 step later, sparse",
}
"""The arms of `mini_repro.py --codecs bf16 int8 sparse --overlap --overlap_fragments 5 --only ...`, in order."""


@block("overlap-codecs")
def overlap_codecs_table(records: Records) -> str:
    """Each seed's overlapped schedules and codecs against blocking fp32: each comparison (`F5_RECORDS`) with its
    own blocking fp32 arm, every arm of a comparison at one commit."""
    rows = []
    for suffix, seed in CODEC_SEEDS.items():
        for x in records.committed(f"{name}{suffix}" for name in F5_RECORDS):
            rows += _f5_rows(x, seed)
    if not rows:
        raise Missing(F5_RECORDS[0])
    headers = ["seed", "schedule and codec", "final val loss", "vs blocking fp32", "bits/param/round", "commit"]
    return table(headers, rows)


def _f5_rows(x: dict[str, Any], seed: int) -> list[list[str]]:
    """One comparison's arms, its blocking fp32 arm first."""
    rows = []
    for arm, label in F5_ARMS.items():
        if arm in x["arms"]:
            a = x["arms"][arm]
            gap = "" if arm == "spes" else f"**{a['vs_fp32']:+.2%}**"
            commit = short(a["run"]["commit"]) if a["run"] else ""
            rows.append(
                [f"seed {seed}", label, f"{a['final_val_loss']:.4f}", gap, f"{a['bits_per_param']['last']:.2f}", commit]
            )
    return rows


OVERLAP_RECORDS = (
    "bench_overlap",
    "bench_overlap_0022",
    "bench_overlap_2309",
    "bench_overlap_2345",
    "bench_overlap_f5",
    "bench_overlap_f5_pair2",
    "bench_overlap_f5_by_values",
    "bench_overlap_f5_2layers",
    "bench_overlap_f5_same_shape",
)


def _throughput_rows(name: str, x: dict[str, Any]) -> list[list[str]]:
    """A bench_overlap record's runs, pair by pair: the blocking arm, then each overlapped arm with its ratio."""
    layers = next((o.split("=")[1] for o in x["overrides"] if o.startswith("--model.n_layers=")), "2")
    shape = "the mini-reproduction's model" if x.get("shape") == "mini_repro" else f"{layers} layers"
    what = f"`{name}.json`: {x['peers']} peers, {shape}, F = {x.get('fragments') or 1}, {x['link']['mbit']:.1f} Mbit/s"
    arms = ["blocking", *x.get("codecs", {"overlapped": "fp32"})]
    rows = []
    for i, pair in enumerate(x["pairs"], 1):
        ratios = pair.get("ratios", {"overlapped": pair["ratio"]})
        order = "AB" if min(arms, key=lambda arm: pair[arm]["machine"]["when"]) == "blocking" else "BA"
        for arm in arms:
            a = pair[arm]
            waited = sum(a["waited_s"]) / len(a["waited_s"]) / a["train_wall_s"]
            rows.append(
                [
                    what if i == 1 and arm == "blocking" else "",
                    f"{i} ({order})",
                    arm,
                    f"{a['median_step_s']:.2f}",
                    f"{a['round_s']:.1f}",
                    f"{a['train_wall_s']:.0f}",
                    f"{a['tokens'] / a['train_wall_s']:,.0f}",
                    f"{waited:.0%}",
                    f"{a['machine']['load_avg_1_5_15'][0]:.1f}",
                    f"**{ratios[arm]:.2f}x**" if arm in ratios else "",
                ]
            )
    return rows


@block("overlap-throughput")
def overlap_throughput_table(records: Records) -> str:
    rows = []
    for name in OVERLAP_RECORDS:
        try:
            rows += _throughput_rows(name, records(name))
        except Missing:
            if name != OVERLAP_RECORDS[-1]:  # NOTE: the same-shape record is the one a later run adds
                raise
    return table(
        [
            "record",
            "pair (order)",
            "run",
            "step s",
            "round s",
            "train s",
            "tokens/s",
            "waiting for rounds",
            "load avg",
            "overlapped / blocking",
        ],
        rows,
    )


@block("records")
def records_table(records: Records) -> str:
    """Every committed record: what made it (command, commit, machine) and, for older ones, what it lacks."""
    from records import KNOWN_GAPS, runs_of_parts

    rows = []
    for name in records.names():
        x = records(name)
        gap = KNOWN_GAPS.get(name, "")
        if x.get("provenance_note"):
            gap += " (see its provenance_note)"
        if parts := runs_of_parts(x):  # each part its own run: the record last changed with its newest part
            when = max(str((p.get("machine") or {}).get("when", "")) for p in parts)
            rows.append([f"`{name}.json`", "per part (its `modules`)", "per part", "per part", when[:16], gap])
            continue
        m = x.get("machine") or {}
        machine = m.get("name") or (f"{m['cpus']} CPU cores, load {m['load_avg_1_5_15'][0]}" if "cpus" in m else "")
        when = m.get("when", x.get("when", ""))
        command = x.get("command", "")
        rows.append(
            [
                f"`{name}.json`",
                f"`{command}`" if command else "",
                short(x.get("commit", "")),
                machine,
                str(when)[:16],
                gap,
            ]
        )
    return table(["record", "command", "commit", "machine", "when", "lacks"], rows)


WHOLE_FILES: dict[str, Block] = {}


def mini_repro_md(records: Records) -> str:
    """docs/mini_repro.md: the report `bench/mini_repro.py` writes, from its records (every seed's)."""
    import mini_repro

    record = records("mini_repro")
    seeds = [records(n) for n in records.names() if n == "mini_repro" or n.startswith("mini_repro_seed")]
    finals = {r["seed"]: mini_repro.final_losses(r["curves"]) for r in seeds}
    run = record.get("run") or {}
    return mini_repro.report(
        mini_repro.Setup(**record["setup"]),
        record["curves"],
        record["walls_s"],
        record["params"],
        record["machine"],
        "mini_repro.png",
        finals,
        correction=False,
        note=run.get("note"),
    )


def mini_repro_memory_md(records: Records) -> str:
    """docs/mini_repro_memory.md: the report `bench/mini_repro_memory.py` writes, from its record."""
    import mini_repro
    import mini_repro_memory

    record = records("mini_repro_memory")
    per_seed = {int(seed): curves for seed, curves in record["curves"].items()}
    walls = {int(seed): w for seed, w in record["walls_s"].items()}
    sizes = {**record["sizes"], "spes_nodes": {int(e): b for e, b in record["sizes"]["spes_nodes"].items()}}
    return mini_repro_memory.report(
        mini_repro.Setup(**record["setup"]),
        sizes,
        per_seed,
        record["mean_curves"],
        walls,
        record["machine"],
        (record.get("run") or {}).get("total_wall_s"),
        "mini_repro_memory.png",
    )


WHOLE_FILES.update({"docs/mini_repro.md": mini_repro_md, "docs/mini_repro_memory.md": mini_repro_memory_md})


@block("import-layers")
def import_layers(records: Records) -> str:
    """The sync wing's floors as pyproject.toml's import-linter contract states them, top floor first."""
    import tomllib

    from common import REPO_ROOT

    config = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]["contracts"]
    layers = next(c["layers"] for c in config if c["type"] == "layers")
    names = [", ".join(f"`{m.strip().removeprefix('spes.sync.')}`" for m in floor.split("|")) for floor in layers]
    return "\n".join(f"{i}. {floor}" for i, floor in enumerate(names, 1))


# ---------------------------------------------------------------------------------------------------------------
# docs/running.md


@block("wan-rounds")
def wan_rounds_table(records: Records) -> str:
    """Round seconds of the paper's 1B, 4 peers sharing a server link of the peers' speed, per link and wire."""
    by = {(p["peer_mbit"], p["wire"]): p for p in records("bench_wan")["prediction_1b"] if p["plane"] == "tcp"}
    rows = [
        [link(mbit), f"{by[(mbit, 'bf16')]['round_s']:,.0f} s", f"{by[(mbit, 'fp32')]['round_s']:,.0f} s"]
        for mbit in sorted({k[0] for k in by}, reverse=True)
    ]
    return table(["link (peer and server)", "bf16 round", "fp32 round"], rows)


IDLE_SCHEMES = (
    ("bf16", 0, "bf16, blocking"),
    ("int8", 0, "int8, blocking"),
    ("int8", 5, "int8 + overlap + 5 fragments"),
    ("sparse", 0, "sparse, blocking"),
    ("sparse", 5, "sparse + overlap + 5 fragments"),
)
"""The rows of the codec idle table: (codec, `overlap_fragments` or 0 for blocking rounds, label)."""
IDLE_SYNC_STEPS = (25, 50, 100, 200)


@block("idle-codecs")
def idle_codecs_table(records: Records) -> str:
    """The 1B node's share of wall time not training, per link and codec, blocking and overlapped with 5 fragments
    (`common.idle_share`): each codec's 1B round at the efficiency measured for it on the emulated link
    (bench_wan_codecs), and the node's step at its CUDA defaults measured on an H200 (`default_gpu_step`)."""
    x = records("bench_wan_codecs")
    step_s, _ = default_gpu_step(records)
    by = {(p["peer_mbit"], p["wire"]): p for p in x["prediction_1b"]}
    efficiency = {(m["peer_mbit"], m["wire"]): m["efficiency"] for m in x["measurements"]}
    rows = []
    for mbit in sorted({m for m, _ in by}, reverse=True):
        for wire, fragments, label in IDLE_SCHEMES:
            if (mbit, wire) not in by:
                continue
            round_s, rtt_s = by[(mbit, wire)]["round_s"], 2 * x["rtt_ms"] / 1000 / efficiency[(mbit, wire)]
            idle = (idle_share(round_s, step_s, s, fragments, rtt_s) for s in IDLE_SYNC_STEPS)
            rows.append([link(mbit), label, f"{round_s:,.0f} s", *(f"{v:.1%}" for v in idle)])
    headers = ["link", "codec and schedule", "1B round", f"`sync_steps` {IDLE_SYNC_STEPS[0]}"]
    return table([*headers, *map(str, IDLE_SYNC_STEPS[1:])], rows)


@block("wan-idle")
def wan_idle_table(records: Records) -> str:
    """Share of a GPU node's wall time not training, per link, wire and sync_steps (data plane)."""
    record = records("bench_wan_gpu")
    rows = []
    for p in sorted(record["prediction_1b"], key=lambda p: (-p["peer_mbit"], p["wire"])):
        if p["plane"] == "tcp":
            rows.append([link(p["peer_mbit"]), p["wire"], *(f"{v:.1%}" for v in p["idle_fraction"].values())])
    steps = list(record["prediction_1b"][0]["idle_fraction"])
    return table(["link", "wire", f"`sync_steps` {steps[0]}", *steps[1:]], rows)
