#!/usr/bin/env python
"""CPU seconds a held-model codec spends per round on the paper's 1B config, beside the wire time it saves.

    .venv/bin/python bench/bench_codec.py                      # int8 and sparse on configs/spes_1b, 1 thread
    .venv/bin/python bench/bench_codec.py --codecs sparse:topk=128 --threads 4
    .venv/bin/python bench/bench_codec.py --quick              # configs/tiny.yaml (what CI runs)

A round's codec work, SPES peer 0 of the run spec the server builds from the config (a plain round, no merge):
  - the peer: encode every tensor it trains (`quantizer.encode` + `pack`), and read every tensor it downloads
    (`unpack` + `decode`: blocks relayed from their owners in the peers' format, the rest in the server's);
  - the server: read every peer's upload and encode every tensor it re-encodes (the shared tensors, once) in its
    format (`quantizer.down`).
Each distinct tensor shape is timed once on a random delta (the work depends on the shape alone) and weighted by
how many tensors of the round have it. The record puts each codec's seconds beside the seconds its bytes save
against the fp32 wire at 1 Gbit/s and 100 Mbit/s (`RunSpec.round_bytes`): compression pays where the saving is the
larger. Seconds are process CPU time with `--threads` torch threads, the fastest of `--repeats`.
"""

from __future__ import annotations

import sys
import time
from collections import Counter
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch

from common import REPO_ROOT, CodecChoice, best_seconds, codec_choice, machine_info, manifest_of, parser, write_results
from spes.config import load_config
from spes.sync.codecs.base import Quantizer
from spes.sync.codecs.registry import REGISTRY
from spes.sync.protocol import Shape
from spes.sync.spec import RunSpec, run_spec

PAPER_1B = REPO_ROOT / "configs" / "spes_1b" / "node_0.yaml"
TINY = REPO_ROOT / "configs" / "tiny.yaml"
LINKS_MBIT = (1000, 100)


def quantizer_of(codec: CodecChoice) -> Quantizer:
    """The quantizer of a held-model codec with its settings (SystemExit for a raw codec, which has none)."""
    kind = REGISTRY[codec.name][0]
    if kind is None:
        raise SystemExit(f"error: codec {codec.label!r} does no work per tensor; measure a held-model codec")
    return kind(**codec.settings)


def shape_seconds(quantizer: Quantizer, shape: Shape, repeats: int) -> dict[str, float]:
    """Seconds to encode + pack, and to unpack + decode, one tensor of `shape` in `quantizer`'s format."""
    delta = torch.randn(shape, generator=torch.Generator().manual_seed(0)) * 1e-3
    payload = quantizer.encode("t", delta)
    data, params = payload.pack(), payload.params()
    return {
        "encode": best_seconds(lambda: quantizer.encode("t", delta).pack(), repeats, time.process_time),
        "decode": best_seconds(
            lambda: quantizer.decode(quantizer.unpack("t", shape, params, data)), repeats, time.process_time
        ),
    }


def weighted(spec: RunSpec, names: Iterable[str], per_shape: Callable[[Shape], float]) -> float:
    """The sum over `names` of `per_shape(shape)`, each distinct shape computed once."""
    assert spec.manifest is not None
    counts = Counter(tuple(spec.manifest[n]) for n in names)
    return sum(count * per_shape(shape) for shape, count in counts.items())


def round_seconds(spec: RunSpec, quantizer: Quantizer, repeats: int) -> dict[str, float]:
    """Peer 0's and the server's codec seconds in one plain round of `spec`."""
    up, down = quantizer, quantizer.down
    cache: dict[tuple[int, Shape], dict[str, float]] = {}

    def timed(q: Quantizer, shape: Shape) -> dict[str, float]:
        key = (id(q), shape)
        if key not in cache:
            cache[key] = shape_seconds(q, shape, repeats)
        return cache[key]

    downloads = spec.downloads(0, merged=False)
    relayed = [n for n in downloads if spec.owner(n) is not None]
    reencoded = [n for n in spec.trainable(0) if spec.owner(n) is None]
    uploads = [n for p in range(spec.num_peers) for n in spec.trainable(p)]
    peer_encode = weighted(spec, spec.trainable(0), lambda s: timed(up, s)["encode"])
    peer_decode = weighted(spec, relayed, lambda s: timed(up, s)["decode"])
    peer_decode += weighted(spec, [n for n in downloads if n not in relayed], lambda s: timed(down, s)["decode"])
    server_decode = weighted(spec, uploads, lambda s: timed(up, s)["decode"])
    server_encode = weighted(spec, reencoded, lambda s: timed(down, s)["encode"])
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


def measure(config: Path, codec: CodecChoice, repeats: int) -> dict[str, Any]:
    cfg = load_config(config, codec.overrides())[0]
    spec = run_spec(cfg, manifest_of(cfg))
    fp32_cfg = load_config(config, CodecChoice.parse("fp32").overrides())[0]
    fp32 = run_spec(fp32_cfg, manifest_of(fp32_cfg))
    seconds = round_seconds(spec, quantizer_of(codec), repeats)
    saving = wire_saving(spec, fp32)
    print(
        f"{codec.label}: peer {seconds['peer_s']:.2f} s (encode {seconds['peer_encode_s']:.2f}, decode "
        f"{seconds['peer_decode_s']:.2f}), server {seconds['server_s']:.2f} s per round; its bytes save "
        + ", ".join(f"{s:.1f} s at {link}" for link, s in saving["saved_s"].items())
        + " against fp32",
        flush=True,
    )
    return {"settings": codec.settings, **seconds, **saving}


def main(argv: list[str] | None = None) -> int:
    p = parser("bench_codec", __doc__)
    p.add_argument("--config", type=Path, default=None, help="the run's YAML (default: the paper's 1B; quick: tiny)")
    p.add_argument(
        "--codecs", type=codec_choice, nargs="+", default=None, metavar="CODEC", help="held-model codecs (NAME[:k=v])"
    )
    p.add_argument("--threads", type=int, default=1, help="torch threads (default 1: seconds per core)")
    p.add_argument("--repeats", type=int, default=None, help="timed calls per shape (default 3; quick: 1)")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    config = args.config or (TINY if args.quick else PAPER_1B)
    codecs = args.codecs or [CodecChoice.parse(c) for c in ("int8", "sparse")]
    repeats = args.repeats or (1 if args.quick else 3)
    results = {c.label: measure(config, c, repeats) for c in codecs}
    write_results(
        args.out,
        {
            "mode": "quick" if args.quick else "full",
            "config": str(config.relative_to(REPO_ROOT)),
            "threads": args.threads,
            "repeats": repeats,
            "machine": machine_info(),
            "codecs": results,
        },
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
