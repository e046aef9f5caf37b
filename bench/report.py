#!/usr/bin/env python
"""Plot the full benchmark results (bench/results/*.json) into docs/benchmarks.png for docs/benchmarks.md, and
render the README's GPU section from the GPU records.

    .venv/bin/python bench/report.py [--results bench/results] [--png docs/benchmarks.png] [--readme README.md]

Six panels: memory of the paper's 1B node (analytic) and of the small node (measured), bytes on the wire
per peer per round for the 1B, sync throughput against raw TCP, aggregation against memcpy, and training
tokens/s per MoE backend. A panel whose JSON is missing says so instead of failing. The README's text between
`<!-- gpu-table:start -->` and `<!-- gpu-table:end -->` is replaced by `gpu_section`: the variants of
`bench_gpu.json` (or a note that it does not exist yet) and, for GPUs of 24, 48 and 80 GB, the fastest measured
setting whose peak memory fits.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from common import REPO_ROOT, RESULTS_DIR
from spes.atomic import write_atomic

GIB, MIB = 2**30, 2**20


def _load(results: Path, name: str) -> dict[str, Any] | None:
    path = results / f"{name}.json"
    if not path.is_file():
        return None
    data = json.loads(path.read_text())
    return data if data.get("mode") == "full" else None


def _stacked(ax: Any, groups: dict[str, dict[str, float]], unit: str, title: str) -> None:
    """Stacked bars: one bar per group, one segment per part (weights, grads, AdamW)."""
    names = list(groups)
    parts = list(next(iter(groups.values())))
    bottoms = [0.0] * len(names)
    for part, color in zip(parts, ("tab:gray", "tab:orange", "tab:purple")):
        values = [groups[n][part] for n in names]
        ax.bar(names, values, bottom=bottoms, label=part, color=color)
        bottoms = [b + v for b, v in zip(bottoms, values)]
    for i, total in enumerate(bottoms):
        ax.text(i, total, f"{total:.2f}" if total < 100 else f"{total:.0f}", ha="center", va="bottom", fontsize=8)
    ax.set_ylabel(unit)
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=7)


def panel_memory_1b(ax: Any, mem: dict[str, Any]) -> None:
    groups = {
        f"{kind} node": {
            "weights": v["analytic"]["param_bytes"] / GIB,
            "grads": v["analytic"]["grad_bytes"] / GIB,
            "AdamW": v["analytic"]["optimizer_bytes"] / GIB,
        }
        for kind, v in mem["paper_1b"].items()
    }
    _stacked(ax, groups, "GiB (fp32, one replica)", "paper 1B: static training memory (analytic)")


def panel_memory_small(ax: Any, mem: dict[str, Any]) -> None:
    groups = {
        f"{kind} node": {
            "weights": v["measured"]["param_bytes"] / MIB,
            "grads": v["measured"]["grad_bytes"] / MIB,
            "AdamW": v["measured"]["optimizer_bytes"] / MIB,
        }
        for kind, v in mem["measured"].items()
    }
    _stacked(ax, groups, "MiB", f"{mem['config']}: measured (bars) and peak RSS above baseline (x)")
    peaks = [v["measured"]["peak_minus_before_bytes"] / MIB for v in mem["measured"].values()]
    ax.plot(list(groups), peaks, "kx", markersize=9)


def panel_wire(ax: Any, wire: dict[str, Any]) -> None:
    schemes = wire["paper_1b"]["schemes"]
    names = list(schemes)
    x = range(len(names))
    ax.bar([i - 0.2 for i in x], [schemes[n]["up"] / GIB for n in names], 0.4, label="up")
    ax.bar([i + 0.2 for i in x], [schemes[n]["down"] / GIB for n in names], 0.4, label="down (plain round)")
    ax.set_xticks(list(x), [n.replace("_", "\n") for n in names], fontsize=7)
    ax.set_ylabel("GiB per peer per round")
    ax.set_title("paper 1B: bytes on the wire per peer per round", fontsize=9)
    ax.legend(fontsize=7)


def panel_sync(ax: Any, sync: dict[str, Any]) -> None:
    runs = list(sync["measurements"])  # e.g. fp32_grpc, fp32_tcp: wire dtype and where payloads go
    best = {
        k: (max(r["gb_s"] for r in m["spes_rounds"]), max(r["gb_s"] for r in m["raw_rounds"]))
        for k, m in sync["measurements"].items()
    }
    x = range(len(runs))
    ax.bar([i - 0.2 for i in x], [best[k][0] for k in runs], 0.4, label="SPES round (server + peers)")
    ax.bar([i + 0.2 for i in x], [best[k][1] for k in runs], 0.4, label="raw TCP, same bytes")
    for i, k in enumerate(runs):
        ax.text(i - 0.2, best[k][0], f"{best[k][0] / best[k][1]:.0%}", ha="center", va="bottom", fontsize=8)
    ax.set_xticks(list(x), [k.replace("_", " wire\n").replace("tcp", "TCP data plane") for k in runs], fontsize=8)
    ax.set_ylabel("GB/s (all peers, up + down)")
    ax.set_title(f"sync of a {sync['model_bytes_fp32'] / 1e9:.2f} GB model on loopback", fontsize=9)
    ax.legend(fontsize=7)


def panel_aggregate(ax: Any, agg: dict[str, Any]) -> None:
    rows = agg["results"]
    short = {"spes plain round": "SPES", "spes merge round": "SPES+merge", "diloco average": "DiLoCo"}
    labels = [f"{short.get(r['case'], r['case'])}\n{r['dtype']}" for r in rows]
    x = range(len(rows))
    ax.bar([i - 0.27 for i in x], [r["aggregate_gb_s"] for r in rows], 0.27, label="aggregate_round")
    ax.bar(list(x), [r["memcpy_gb_s"] for r in rows], 0.27, label="clone (memcpy into new memory)")
    ax.bar([i + 0.27 for i in x], [r["copy_into_gb_s"] for r in rows], 0.27, label="copy_ (into reused memory)")
    ax.set_xticks(list(x), labels, fontsize=8)
    ax.set_ylabel("GB/s of uploads")
    ax.set_title(f"round math on {agg['model_bytes_fp32'] / 1e9:.2f} GB, {agg['peers']} peers", fontsize=9)
    ax.legend(fontsize=7)


def panel_train(ax: Any, train: dict[str, Any]) -> None:
    rows = train["results"]
    ax.bar(
        [r["variant"].replace("/", "\n") for r in rows],
        [r["tokens_per_s"] for r in rows],
        color=["tab:red" if r["kind"] == "spes" else "tab:blue" for r in rows],
    )
    ax.set_ylabel("tokens/s")
    ax.set_title(f"{train['config']} on {train['device']}: training speed", fontsize=9)


GPU_MARKERS = ("<!-- gpu-table:start -->", "<!-- gpu-table:end -->")
CARDS = (("24 GB", "RTX 4090, L4", 22.0), ("48 GB", "L40S, A6000", 44.4), ("80 GB", "A100 / H100 80GB", 79.1))
"""GPU classes of the advice, with the memory their cards report (GiB; the smallest of the class)."""
USABLE = 0.9  # NOTE: spes.preflight's USABLE_MEMORY: the rest is allocator slack, CUDA context, fragmentation


def gpu_settings(results: Path) -> list[dict[str, Any]]:
    """Every measured 1B node setting on a GPU: the variants of bench_gpu.json and the runs of
    bench_wan_gpu_steps.json, each with its tokens/s of the config's step, peak GiB and record."""
    out = []
    gpu = _load(results, "bench_gpu") or {"variants": [], "machine": {}}
    for v in gpu["variants"]:
        if v["status"] == "ok" and v.get("peak_memory_bytes"):
            s = v["settings"]
            setting = (
                f"`moe_backend: {v['moe_backend']}`, micro-batch {s['micro_batch']}"
                f"{', `fused_loss`' if s['fused_loss'] else ''}{', `compile`' if s['compile'] else ''}"
                f"{'' if s['checkpointing'] else ', no activation checkpointing'}"
            )
            out.append(
                {
                    "setting": setting,
                    "tokens_per_s": v["tokens_per_s"],
                    "peak_gib": v["peak_memory_bytes"] / GIB,
                    "record": "bench_gpu.json",
                    "device": gpu["machine"].get("name", ""),
                }
            )
    steps_path = results / "bench_wan_gpu_steps.json"
    steps = json.loads(steps_path.read_text()) if steps_path.is_file() else {"runs": []}
    for run in steps["runs"]:
        out.append(
            {
                "setting": f"`moe_backend: {run['moe_backend']}`, micro-batch {run['microbatch']} (no activation "
                "checkpointing, whole logits: before issue 29)",
                "tokens_per_s": run["sequences_per_step"] * 2048 / run["step_s"],
                "peak_gib": run["peak_memory_gib"],
                "record": steps_path.name,
                "device": steps["device"],
            }
        )
    return out


def gpu_section(results: Path) -> str:
    """The README's GPU section (markdown), from the records alone."""
    gpu = _load(results, "bench_gpu")
    lines = []
    if gpu is None:
        lines.append(
            "No GPU benchmark record yet: `bench/results/bench_gpu.json` is written by `bash bench/run_gpu.sh` on a "
            "GPU (issue 29) and this section is rendered from it by `bench/report.py`."
        )
    else:
        m = gpu["machine"]
        lines += [
            f"The 1B SPES node (`configs/spes_1b/node_0.yaml`, peer 0, amp_bf16) on one {m.get('name', 'GPU')} "
            f"(torch {m['torch']}, commit {gpu['commit'][:12]}; record `bench/results/bench_gpu.json`, "
            "`bench/bench_gpu.py`): each variant's step of 256 sequences projected from timed steps of 1 and 4 "
            "micro-batches; MFU by `tflops_per_token` and, after the slash, by the FLOPs done (frozen experts skip "
            "their weight gradients).",
            "",
            "| variant | step s | tokens/s | MFU | peak GiB | syncs/step |",
            "|---|---|---|---|---|---|",
        ]
        for v in gpu["variants"]:
            if v["status"] != "ok":
                lines.append(f"| {v['name']} | {v['status']} | | | | |")
                continue
            mfu = f"{v['mfu']:.1%} / {v['mfu_done']:.1%}" if "mfu" in v else "n/a"
            peak = f"{v['peak_memory_bytes'] / GIB:.1f}" if v.get("peak_memory_bytes") else "n/a"
            lines.append(
                f"| {v['name']} | {v['step_s']:.2f} | {v['tokens_per_s']:,.0f} | {mfu} | {peak} | "
                f"{v['syncs_per_step']['count']} |"
            )
    lines += [
        "",
        f"What to set, by GPU memory: the fastest measured setting whose peak is at most {USABLE:.0%} of the card's "
        "memory (`spes.preflight`'s margin); `python -m spes.preflight CONFIG` estimates the largest micro-batch "
        "of any other setting.",
        "",
    ]
    lines += ["| GPU | setting | tokens/s | peak GiB | measured on |", "|---|---|---|---|---|"]
    settings = gpu_settings(results)
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


def update_readme(readme: Path, section: str) -> None:
    """Replace the text between the GPU markers of `readme` by `section`."""
    text = readme.read_text()
    start, end = GPU_MARKERS
    if start not in text or end not in text:
        raise SystemExit(f"error: {readme} lacks the markers {start} ... {end} around its GPU section")
    head, rest = text.split(start, 1)
    _, tail = rest.split(end, 1)
    write_atomic(readme, f"{head}{start}\n{section}\n{end}{tail}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--results", type=Path, default=RESULTS_DIR, help="directory of the benchmarks' JSON")
    p.add_argument("--png", type=Path, default=REPO_ROOT / "docs" / "benchmarks.png", help="output image")
    p.add_argument("--readme", type=Path, default=REPO_ROOT / "README.md", help="README whose GPU section to render")
    p.add_argument("--no_png", action="store_true", help="only render the README's GPU section")
    args = p.parse_args(argv)
    update_readme(args.readme, gpu_section(args.results))
    print(f"rendered the GPU section of {args.readme}")
    if args.no_png:
        return 0
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels: list[tuple[str, Callable[[Any, dict[str, Any]], None]]] = [
        ("bench_memory", panel_memory_1b),
        ("bench_memory", panel_memory_small),
        ("bench_wire", panel_wire),
        ("bench_sync", panel_sync),
        ("bench_aggregate", panel_aggregate),
        ("bench_train", panel_train),
    ]
    fig, axes = plt.subplots(2, 3, figsize=(16, 8.5), constrained_layout=True)
    for ax, (name, draw) in zip(axes.flat, panels):
        data = _load(args.results, name)
        if data is None:
            ax.text(0.5, 0.5, f"no full {name} results", ha="center", va="center")
            ax.set_axis_off()
            continue
        draw(ax, data)
        ax.grid(axis="y", alpha=0.3)
    write_atomic(args.png, lambda tmp: fig.savefig(tmp, dpi=100, format=args.png.suffix.lstrip(".")))
    plt.close(fig)
    print(f"wrote {args.png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
