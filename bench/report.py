#!/usr/bin/env python
"""Render every published figure from the committed records: README.md and docs/*.md, and docs/benchmarks.png.

    .venv/bin/python bench/report.py            # re-render the documents in place, redraw the plot
    .venv/bin/python bench/report.py --check    # exit 1, showing the difference, if any document is not as rendered

No figure of README.md or docs/ is typed by hand; a document marks where each one goes:

- `<!--f:NAME-->...<!--/f-->` around a figure in a sentence: NAME is a named figure of `bench/figures.py`
  (`FIGURES`), or a record path `record/key/.../key[|unit][:format]` (`records.Records.value`), e.g.
  `<!--f:bench_sync/measurements/fp32_tcp/spes_over_raw_throughput:.0%-->75%<!--/f-->`;
- `<!-- NAME:start -->` ... `<!-- NAME:end -->` around a table or paragraph: NAME is a block of `bench/tables.py`
  (`BLOCKS`);
- documents rendered whole (`tables.WHOLE_FILES`): the mini-reproductions' reports.

A figure whose record is not committed yet reads "not measured yet (run: <command>)". Outside the marks a document
states no measured figure (`stray_figures`); tests/test_report.py re-renders everything and fails on any
difference, and on a record without its command, commit and machine (`records.provenance_gap`).

The plot's six panels: memory of the paper's 1B node (analytic) and of the small node (measured), bytes on the
wire per peer per round for the 1B, sync throughput against raw TCP, aggregation against memcpy, and training
tokens/s per MoE backend. A panel whose JSON is missing says so instead of failing.
"""

from __future__ import annotations

import difflib
import json
import re
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from common import REPO_ROOT, RESULTS_DIR
from figures import FIGURES
from records import Missing, Records, not_measured
from spes.atomic import write_atomic
from spes.cli import ArgumentParser
from tables import BLOCKS, GPU_MARKERS, WHOLE_FILES

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


INLINE = re.compile(r"<!--f:(?P<name>[^>]*?)-->(?P<body>.*?)<!--/f-->")
BLOCK = re.compile(r"<!-- (?P<name>[\w.-]+):start -->\n(?P<body>.*?)\n?<!-- (?P=name):end -->", re.S)
MARK = re.compile(r"<!--f:|<!--/f-->|<!-- [\w.-]+:(?:start|end) -->")
PUBLISHED = ("README.md", "docs")
"""What the renderer fills: README.md and every markdown file under docs/."""


class RenderError(ValueError):
    """A document's marks are broken or name a figure no renderer knows: says which file, line and name."""


def published(root: Path = REPO_ROOT) -> list[Path]:
    """Every document the renderer fills, README.md first."""
    return [root / "README.md", *sorted((root / "docs").glob("*.md"))]


def figure(name: str, records: Records) -> str:
    """The text of the inline figure `name`: a named figure, else a record path."""
    if name not in FIGURES and "/" not in name:
        raise KeyError("no such named figure in bench/figures.py (a record's value is written record/key/...)")
    try:
        return FIGURES[name](records) if name in FIGURES else records.value(name)
    except Missing as missing:
        return not_measured(missing.record)


def block_text(name: str, records: Records) -> str:
    try:
        return BLOCKS[name](records)
    except Missing as missing:
        return not_measured(missing.record)


def render_text(text: str, records: Records, where: str = "text") -> str:
    """`text` with every block and inline figure filled from `records`; RenderError on a broken or unknown mark."""

    def line_of(offset: int) -> str:
        return f"{where}:{text.count(chr(10), 0, offset) + 1}"

    def fill_block(m: re.Match[str]) -> str:
        if m["name"] not in BLOCKS:
            raise RenderError(f"{line_of(m.start())}: no block {m['name']!r} in bench/tables.py")
        return f"<!-- {m['name']}:start -->\n{block_text(m['name'], records)}\n<!-- {m['name']}:end -->"

    def fill_inline(m: re.Match[str]) -> str:
        name = m["name"].strip()
        try:
            value = figure(name, records)
        except (KeyError, ValueError, TypeError) as exc:
            raise RenderError(f"{line_of(m.start())}: figure {name!r}: {exc}") from None
        return f"<!--f:{m['name']}-->{value}<!--/f-->"

    left = BLOCK.sub("", INLINE.sub("", text))
    if broken := MARK.search(left):
        raise RenderError(f"{line_of(text.index(broken[0]))}: {broken[0]!r} without its pair on the same footing")
    return INLINE.sub(fill_inline, BLOCK.sub(fill_block, text))


def render_all(records: Records, root: Path = REPO_ROOT) -> dict[Path, str]:
    """Every published document as rendered from `records` (the ones without marks as they are)."""
    out = {}
    for path in published(root):
        relative = str(path.relative_to(root))
        whole = WHOLE_FILES.get(relative)
        out[path] = whole(records) if whole is not None else render_text(path.read_text(), records, relative)
    return out


FIGURE_LIKE = re.compile(
    r"\d[\d,]*\.\d+\s*%|\b\d+\s*%|\b\d+(?:\.\d+)?x\b|\b\d+\.\d{2,}|\b\d{1,3}(?:,\d{3})+\b"
    r"|\b\d+\.\d+\s*(?:GiB|MiB|KiB|GB|MB|KB|ms|s|min|h)\b"
)
"""What looks like a measured figure in prose: a percentage, a ratio (1.8x), a number with two or more decimals,
a number with thousands separators, a decimal number of bytes or seconds. Settings (`sync_steps` 10, 1 MiB chunks,
RTT 50 ms) are whole numbers and pass."""
UNCHECKED = re.compile(r"```.*?```|`[^`\n]*`|<!--.*?-->|\]\([^)]*\)|arXiv[ :]\d{4}\.\d{4,5}", re.S)


def stray_figures(text: str) -> list[str]:
    """`line: figure` for every measured-looking figure outside the marks, code and link targets of `text`."""
    filled = INLINE.sub(lambda m: " " * len(m[0]), BLOCK.sub(lambda m: "\n" * m[0].count("\n"), text))
    prose = UNCHECKED.sub(lambda m: "\n" * m[0].count("\n") + " ", filled)
    return [f"{prose.count(chr(10), 0, m.start()) + 1}: {m[0]}" for m in FIGURE_LIKE.finditer(prose)]


def update_readme(readme: Path, section: str) -> None:
    """Replace the text between the GPU markers of `readme` by `section`."""
    text = readme.read_text()
    start, end = GPU_MARKERS
    if start not in text or end not in text:
        raise SystemExit(f"error: {readme} lacks the markers {start} ... {end} around its GPU section")
    head, rest = text.split(start, 1)
    _, tail = rest.split(end, 1)
    write_atomic(readme, f"{head}{start}\n{section}\n{end}{tail}")


def gpu_section(results: Path) -> str:
    """The README's GPU section from the records of `results`."""
    return BLOCKS["gpu-table"](Records(results))


def main(argv: list[str] | None = None) -> int:
    p = ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--results", type=Path, default=RESULTS_DIR, help="directory of the benchmarks' JSON")
    p.add_argument("--png", type=Path, default=REPO_ROOT / "docs" / "benchmarks.png", help="output image")
    p.add_argument("--check", action="store_true", help="change nothing: exit 1 if a document is not as rendered")
    p.add_argument("--no_png", action="store_true", help="render the documents only")
    args = p.parse_args(argv)
    try:
        rendered = render_all(Records(args.results))
    except RenderError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    stale = [path for path, text in rendered.items() if path.read_text() != text]
    if args.check:
        for path in stale:
            old, new = path.read_text().splitlines(), rendered[path].splitlines()
            print("\n".join(difflib.unified_diff(old, new, str(path), "rendered", lineterm="", n=1)))
        if stale:
            print(
                f"error: {len(stale)} document(s) differ from the records: run .venv/bin/python bench/report.py",
                file=sys.stderr,
            )
        return 1 if stale else 0
    for path in stale:
        write_atomic(path, rendered[path])
        print(f"rendered {path.relative_to(REPO_ROOT)}")
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
