#!/usr/bin/env python
"""CPU seconds a held-model codec spends per round on the paper's 1B config, beside the wire time it saves.

    .venv/bin/python bench/bench_codec.py                      # int8 and sparse on configs/spes_1b, 1 thread
    .venv/bin/python bench/bench_codec.py --codecs sparse:topk=128 --threads 4
    .venv/bin/python bench/bench_codec.py --quick              # configs/tiny.yaml (what CI runs)
    .venv/bin/python bench/bench_codec.py --codecs sparse --threads 2 --clock wall --serial_selection

A round's codec work, SPES peer 0 of the run spec the server builds from the config (a plain round, no merge), all
of it as the round does it (`spes.sync.codecs.held`):
  - the peer: encode every tensor it trains against its held model with its carried error (`encode_delta`: the
    payload and the new error, and the reconstruction of the blocks it owns; `pack`), and apply every tensor it
    downloads to its held model (`unpack` + `apply_delta` into kept memory: blocks relayed from their owners in the
    peers' format, the rest in the server's);
  - the server: apply every peer's upload, and encode every tensor it re-encodes (the shared tensors, once) in its
    format (`quantizer.down`, no carried error).
Each distinct tensor shape is timed once on a random delta (the work depends on the shape alone) and weighted by
how many tensors of the round have it. The record puts each codec's seconds beside the seconds its bytes save
against the fp32 wire at 1 Gbit/s and 100 Mbit/s (`RunSpec.round_bytes`): compression pays where the saving is the
larger. Seconds are process CPU time with `--threads` torch threads (`--clock wall`: wall time, what a round waits on
that many threads), the fastest of `--repeats`. `--serial_selection` also times each work with the sparse selections'
numpy calls on one thread (`spes.sync.codecs.sparse.ROWS_PER_THREAD` out of reach), every other op on torch's
threads, the two call by call in turn: what running them on torch's threads saves, side by side in one process.

Pages: every round makes fresh model-sized tensors, and a fresh tensor costs a page fault per page it touches. spes
turns on PyTorch's 2 MiB pages for CPU tensors of 2 MiB and more (`THP_MEM_ALLOC_ENABLE`, set in `spes/__init__.py`);
the benchmark measures in two processes, with them and with 4 KiB pages, and reports the ratio when the kernel gave
the first one huge pages (`AnonHugePages` seen while it measured; the figures are those of 2 MiB pages).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import torch

from common import (
    PAPER_1B,
    REPO_ROOT,
    CodecChoice,
    best_seconds,
    codec_choice,
    config_file,
    machine_info,
    manifest_of,
    parser,
    repo_path,
    run_child,
    write_results,
)
from spes.config import load_config
from spes.sync.codecs import sparse
from spes.sync.codecs.base import Quantizer
from spes.sync.codecs.held import apply_delta, encode_delta
from spes.sync.codecs.registry import REGISTRY
from spes.sync.protocol import Shape
from spes.sync.spec import RunSpec, run_spec

TINY = REPO_ROOT / "configs" / "tiny.yaml"
LINKS_MBIT = (1000, 100)
CLOCKS = {"cpu": time.process_time, "wall": time.perf_counter}
ENDS = ("peer_encode", "peer_decode", "server_decode", "server_encode")
PAGES = {"2 MiB": "1", "4 KiB": "0"}
"""The page sizes compared -> THP_MEM_ALLOC_ENABLE of the measuring process."""


def quantizer_of(codec: CodecChoice) -> Quantizer:
    """The quantizer of a held-model codec with its settings (SystemExit for a raw codec, which has none)."""
    kind = REGISTRY[codec.name][0]
    if kind is None:
        raise SystemExit(f"error: codec {codec.label!r} does no work per tensor; measure a held-model codec")
    return kind(**codec.settings)


def huge_page_kib() -> int:
    """KiB of this process's memory in huge pages now (0 where the kernel says nothing)."""
    try:
        with open("/proc/self/smaps_rollup") as f:
            return next((int(line.split()[1]) for line in f if line.startswith("AnonHugePages:")), 0)
    except OSError:
        return 0


Key = tuple[Quantizer, Shape, str]


class ShapeTimer:
    """Seconds of one tensor's round work per (format, shape), each computed once; notes the huge pages seen.

    With `serial`, each work is also timed with the sparse selections' numpy calls on one thread, the two variants
    call by call in turn (so drift and the process's history weigh on both alike); `serial_view` then reads those."""

    def __init__(self, repeats: int, clock: Callable[[], float], serial: bool = False) -> None:
        self.repeats, self.clock, self.serial = repeats, clock, serial
        self.huge_kib = 0
        self.serial_view = False
        self._cache: dict[Key, float] = {}
        """By the quantizer's value (a frozen dataclass: its settings), not its id, which a freed one passes on."""
        self._serial: dict[Key, float] = {}

    def encode(self, quantizer: Quantizer, shape: Shape, carried: bool, reconstruct: bool) -> float:
        """`encode_delta` (with a carried error or without) + `pack` of a tensor of `shape`, and its reconstruction
        when the encoder keeps it (a peer's own blocks, every tensor the server encodes)."""
        key = (quantizer, shape, f"encode {carried} {reconstruct}")
        if key not in self._cache:
            base, value, error = self._tensors(shape)

            def work() -> None:
                sent = encode_delta(quantizer, "t", value, base, error if carried else None)
                sent.payload.pack()
                if reconstruct:
                    _ = sent.reconstruction  # made when first read

            self._time(key, work)
        return self._read(key)

    def decode(self, quantizer: Quantizer, shape: Shape) -> float:
        """`unpack` + `apply_delta` to the held model of a payload of `shape` in `quantizer`'s format, into memory
        kept from round to round (the server's upload buffers, a trainer's spare held tensors)."""
        key = (quantizer, shape, "decode")
        if key not in self._cache:
            base, value, _ = self._tensors(shape)
            payload = encode_delta(quantizer, "t", value, base).payload
            data, params, kept = payload.pack(), payload.params(), torch.empty_like(base)
            self._time(key, lambda: apply_delta(base, quantizer.unpack("t", shape, params, data), quantizer, kept))
        return self._read(key)

    @staticmethod
    def _tensors(shape: Shape) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """A held model, a trained value near it, a carried error (fixed seeds: every arm times the same work)."""
        gen = torch.Generator().manual_seed(0)
        base = torch.randn(shape, generator=gen)
        return base, base + torch.randn(shape, generator=gen) * 1e-3, torch.randn(shape, generator=gen) * 1e-4

    def _time(self, key: Key, fn: Callable[[], object]) -> None:
        if self.serial:
            self._cache[key], self._serial[key] = best_of_both(fn, self.repeats, self.clock)
        else:
            self._cache[key] = best_seconds(fn, self.repeats, self.clock)
        self.huge_kib = max(self.huge_kib, huge_page_kib())

    def _read(self, key: Key) -> float:
        return (self._serial if self.serial_view else self._cache)[key]


@contextlib.contextmanager
def serial_selection() -> Iterator[None]:
    """The sparse selections' numpy calls on one thread, whatever torch's thread count (every other op on torch's
    threads as before): what they cost before they ran on torch's threads."""
    rows = sparse.ROWS_PER_THREAD
    sparse.ROWS_PER_THREAD = sys.maxsize
    try:
        yield
    finally:
        sparse.ROWS_PER_THREAD = rows


def best_of_both(fn: Callable[[], object], repeats: int, clock: Callable[[], float]) -> tuple[float, float]:
    """The fastest of `repeats` calls of `fn` as it is and with `serial_selection`, called in turn (one untimed call
    of each first)."""

    def serial() -> None:
        with serial_selection():
            fn()

    fn()
    serial()
    best = [float("inf"), float("inf")]
    for _ in range(repeats):
        for i, call in enumerate((fn, serial)):
            started = clock()
            call()
            best[i] = min(best[i], clock() - started)
    return best[0], best[1]


def weighted(spec: RunSpec, names: Iterable[str], per_shape: Callable[[Shape], float]) -> float:
    """The sum over `names` of `per_shape(shape)`, each distinct shape computed once."""
    assert spec.manifest is not None
    counts = Counter(tuple(spec.manifest[n]) for n in names)
    return sum(count * per_shape(shape) for shape, count in counts.items())


def round_seconds(spec: RunSpec, quantizer: Quantizer, timer: ShapeTimer) -> dict[str, float]:
    """Peer 0's and the server's codec seconds in one plain round of `spec`."""
    up, down = quantizer, quantizer.down
    downloads = spec.downloads(0, merged=False)
    relayed = [n for n in downloads if spec.owner(n) is not None]
    reencoded = [n for n in spec.trainable(0) if spec.owner(n) is None]
    uploads = [n for p in range(spec.num_peers) for n in spec.trainable(p)]
    own = spec.own(0, spec.trainable(0))
    peer_encode = weighted(spec, own, lambda s: timer.encode(up, s, carried=True, reconstruct=True))
    shared = [n for n in spec.trainable(0) if n not in own]
    peer_encode += weighted(spec, shared, lambda s: timer.encode(up, s, carried=True, reconstruct=False))
    peer_decode = weighted(spec, relayed, lambda s: timer.decode(up, s))
    peer_decode += weighted(spec, [n for n in downloads if n not in relayed], lambda s: timer.decode(down, s))
    server_decode = weighted(spec, uploads, lambda s: timer.decode(up, s))
    server_encode = weighted(spec, reencoded, lambda s: timer.encode(down, s, carried=False, reconstruct=True))
    return {
        "peer_encode_s": peer_encode,
        "peer_decode_s": peer_decode,
        "peer_s": peer_encode + peer_decode,
        "server_decode_s": server_decode,
        "server_encode_s": server_encode,
        "server_s": server_decode + server_encode,
    }


def wire_saving(spec: RunSpec, fp32: RunSpec) -> dict[str, Any]:
    """Peer 0's bytes in a plain round on the codec and on fp32, and the seconds the difference takes per link."""
    coded, raw = sum(spec.round_bytes(0, merged=False)), sum(fp32.round_bytes(0, merged=False))
    return {
        "bytes": coded,
        "fp32_bytes": raw,
        "saved_s": {f"{mbit} Mbit/s": (raw - coded) * 8 / (mbit * 1e6) for mbit in LINKS_MBIT},
    }


def measure(config: Path, codec: CodecChoice, timer: ShapeTimer) -> dict[str, Any]:
    cfg = load_config(config, codec.overrides())[0]
    spec = run_spec(cfg, manifest_of(cfg))
    fp32_cfg = load_config(config, CodecChoice.parse("fp32").overrides())[0]
    fp32 = run_spec(fp32_cfg, manifest_of(fp32_cfg))
    seconds = round_seconds(spec, quantizer_of(codec), timer)
    return {"settings": codec.settings, **seconds, **wire_saving(spec, fp32)}


def child(config: Path, codecs: list[CodecChoice], repeats: int, clock: str, serial: bool) -> dict[str, Any]:
    """Every codec measured in this process (its page size set by its parent); with `serial`, each also with its
    selections on one thread, call by call in turn (`best_of_both`)."""
    timer = ShapeTimer(repeats, CLOCKS[clock], serial)
    codecs_seconds = {c.label: measure(config, c, timer) for c in codecs}
    out = {"codecs": codecs_seconds, "huge_page_kib": timer.huge_kib}
    if not serial:
        return out
    timer.serial_view = True  # NOTE: every shape is timed by now: the same rounds read their serial seconds
    return {**out, "serial_selection": {c.label: measure(config, c, timer) for c in codecs if c.name == sparse.NAME}}


def report(label: str, c: dict[str, Any], fourk: dict[str, Any] | None) -> None:
    saved = ", ".join(f"{s:.1f} s at {link}" for link, s in c["saved_s"].items())
    pages = ""
    if fourk is not None:
        pages = f" (x{fourk['peer_s'] / c['peer_s']:.2f} / x{fourk['server_s'] / c['server_s']:.2f} with 4 KiB pages)"
    print(
        f"{label}: peer {c['peer_s']:.2f} s (encode {c['peer_encode_s']:.2f}, decode {c['peer_decode_s']:.2f}), server "
        f"{c['server_s']:.2f} s per round{pages}; its bytes save {saved} against fp32",
        flush=True,
    )


def arguments() -> argparse.ArgumentParser:
    """The benchmark's flags; `--child` is the measuring process's (one per page size)."""
    p = parser("bench_codec", __doc__)
    p.add_argument(
        "--config", type=config_file, default=None, help="the run's YAML (default: the paper's 1B; quick: tiny)"
    )
    p.add_argument(
        "--codecs", type=codec_choice, nargs="+", default=None, metavar="CODEC", help="held-model codecs (NAME[:k=v])"
    )
    p.add_argument("--threads", type=int, default=1, help="torch threads (default 1: seconds per core)")
    p.add_argument("--repeats", type=int, default=None, help="timed calls per shape (default 3; quick: 1)")
    p.add_argument(
        "--clock",
        choices=sorted(CLOCKS),
        default="cpu",
        help="cpu: the process's CPU seconds (the work, on any number of threads); wall: seconds on the clock (what a "
        "round waits with --threads threads)",
    )
    p.add_argument(
        "--serial_selection",
        action="store_true",
        help="also time each sparse codec with its selections on one thread, call by call in turn (2 MiB pages only)",
    )
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    return p


def measure_pages(args: argparse.Namespace, config: Path, codecs: list[CodecChoice], repeats: int) -> dict[str, Any]:
    """The codecs measured once per page size, each in a process of its own (transparent huge pages are a
    process's setting); the one-thread selections only with 2 MiB pages."""
    forwarded = ["--child", "--config", str(config), "--threads", str(args.threads), "--repeats", str(repeats)]
    forwarded += ["--clock", args.clock]
    forwarded += ["--codecs", *(c.text for c in codecs)]
    serial = ["--serial_selection"] if args.serial_selection else []
    return {
        size: run_child(
            Path(__file__), forwarded + serial * (size == "2 MiB"), env={"THP_MEM_ALLOC_ENABLE": flag}, timeout=3600
        )
        for size, flag in PAGES.items()
    }


def print_pages(pages: dict[str, Any], huge: bool) -> None:
    """Each codec at 2 MiB pages (against 4 KiB ones when the kernel gave huge pages), then its one-thread
    selections against the threaded ones."""
    if not huge:
        print("the kernel gave no huge pages (transparent_hugepage: never?): no ratio of the page sizes", flush=True)
    for label, c in pages["2 MiB"]["codecs"].items():
        report(label, c, pages["4 KiB"]["codecs"][label] if huge else None)
    for label, c in pages["2 MiB"].get("serial_selection", {}).items():
        fast = pages["2 MiB"]["codecs"][label]
        ends = ", ".join(f"{end} {c[f'{end}_s']:.2f} s (x{c[f'{end}_s'] / fast[f'{end}_s']:.2f})" for end in ENDS)
        print(f"{label} with its selections on one thread: {ends}", flush=True)


def main(argv: list[str] | None = None) -> int:
    args = arguments().parse_args(argv)
    torch.set_num_threads(args.threads)
    config = args.config or (TINY if args.quick else PAPER_1B)
    codecs = args.codecs or [CodecChoice.parse(c) for c in ("int8", "sparse")]
    for codec in codecs:
        quantizer_of(codec)  # refuse a raw codec before measuring anything
    repeats = args.repeats or (1 if args.quick else 3)
    if args.child:
        print(json.dumps(child(config, codecs, repeats, args.clock, args.serial_selection)))
        return 0
    pages = measure_pages(args, config, codecs, repeats)
    huge = pages["2 MiB"]["huge_page_kib"] > 0
    print_pages(pages, huge)
    record = {
        "mode": "quick" if args.quick else "full",
        "config": repo_path(config),
        "threads": args.threads,
        "clock": args.clock,
        "repeats": repeats,
        "machine": machine_info(),
        "codecs": pages["2 MiB"]["codecs"],
        **({"serial_selection": pages["2 MiB"]["serial_selection"]} if args.serial_selection else {}),
        "pages": pages,
        "huge_pages_seen": huge,
    }
    write_results(args.out, record)
    return 0


if __name__ == "__main__":
    sys.exit(main())
