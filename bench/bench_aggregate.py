#!/usr/bin/env python
"""Speed of the server's round math (`build_global`) against a plain memory copy of the same bytes.

    .venv/bin/python bench/bench_aggregate.py           # a 1.2 GB model (paper 1B widths, 3 layers), 4 peers
    .venv/bin/python bench/bench_aggregate.py --quick   # configs/tiny.yaml's model

The uploads are what a SPES server holds when a round completes: for each of 4 peers, random tensors for
the shared parameters and its own expert block, named and shaped like the real model (in fp32, and in
bf16 as they arrive over a bf16 wire). Timed in the same run, best of N: `build_global` on a plain
round, on a merge round (the expert-merging warm-up on every layer), the DiLoCo average, and two memcpy
baselines of the same bytes: `clone()` of every uploaded tensor (allocates, as the round math must) and
`copy_()` into tensors allocated beforehand (pure bandwidth: fresh memory costs page faults, which on this
machine make `clone` several times slower than `copy_`). GB/s are upload bytes consumed per second.
"""

from __future__ import annotations

import sys
from typing import Any

import torch

from common import (
    PAPER_1B,
    REPO_ROOT,
    best_seconds,
    format_table,
    manifest_bytes,
    model_record,
    parser,
    server_overrides,
    vocabulary,
    write_results,
)
from spes.config import ServerSection
from spes.sync.merge import build_global
from spes.sync.server import spec_of_run
from spes.sync.spec import RunSpec

# The paper's 1B widths (d_model 768, 16 experts of 2048) with 3 layers and a 50k vocabulary: 1.24 GB in fp32.
FULL_MODEL = ["--model.n_layers=3", *vocabulary(50304)]
QUICK_CONFIG = REPO_ROOT / "configs" / "tiny.yaml"
MERGE = ServerSection(merge_interval=100, merge_alpha_start=0.05, merge_decay_steps=10000, merge_topk=4)


def make_uploads(spec: RunSpec, dtype: torch.dtype) -> dict[int, dict[str, torch.Tensor]]:
    """Random uploads of every peer of the run `spec` (what the server has decoded when the round completes)."""
    gen = torch.Generator().manual_seed(0)
    manifest = spec.manifest or {}
    return {
        p: {n: torch.randn(manifest[n], generator=gen).to(dtype) for n in spec.trainable(p)}
        for p in range(spec.num_peers)
    }


def clone_all(uploads: dict[int, dict[str, torch.Tensor]]) -> list[torch.Tensor]:
    return [t.clone() for upload in uploads.values() for t in upload.values()]


def copy_all(uploads: dict[int, dict[str, torch.Tensor]], into: list[torch.Tensor]) -> None:
    for dst, src in zip(into, (t for upload in uploads.values() for t in upload.values())):
        dst.copy_(src)


def bench_case(
    name: str, uploads: dict[int, dict[str, torch.Tensor]], *, spec: RunSpec, step: int, repeats: int
) -> dict[str, Any]:
    """Time build_global and clone on the same uploads, in the same run."""
    nbytes = sum(t.numel() * t.element_size() for u in uploads.values() for t in u.values())
    agg_s = best_seconds(lambda: build_global(uploads, spec=spec, step=step).tensors, repeats)
    copy_s = best_seconds(lambda: clone_all(uploads), repeats)
    into = clone_all(uploads)
    reused_s = best_seconds(lambda: copy_all(uploads, into), repeats)
    return {
        "case": name,
        "upload_bytes": nbytes,
        "aggregate_s": agg_s,
        "memcpy_s": copy_s,
        "aggregate_gb_s": nbytes / agg_s / 1e9,
        "memcpy_gb_s": nbytes / copy_s / 1e9,
        "aggregate_over_memcpy": copy_s / agg_s,
        "copy_into_s": reused_s,
        "copy_into_gb_s": nbytes / reused_s / 1e9,
        "aggregate_over_copy_into": reused_s / agg_s,
    }


def main(argv: list[str] | None = None) -> int:
    p = parser("bench_aggregate", __doc__)
    p.add_argument("--repeats", type=int, default=None, help="timed repetitions, best kept (default 5, quick 2)")
    args = p.parse_args(argv)
    config, overrides = (QUICK_CONFIG, []) if args.quick else (PAPER_1B, FULL_MODEL)
    repeats = args.repeats or (2 if args.quick else 5)
    spes = spec_of_run(str(config), [*overrides, *server_overrides(MERGE)])  # the server's, from the YAML
    diloco = spec_of_run(str(config), [*overrides, *server_overrides(MERGE), "--using_dilico=true"])
    peers, k = spes.num_peers, spes.experts_per_block
    spes_manifest = spes.manifest or {}
    print(
        f"model: {manifest_bytes(spes_manifest) / 1e9:.2f} GB fp32 ({config.relative_to(REPO_ROOT)} "
        f"{' '.join(overrides)}), {peers} peers x {k} experts; torch threads {torch.get_num_threads()}"
    )

    results = []
    for dtype_name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        uploads = make_uploads(spes, dtype)
        for case, step in (("spes plain round", MERGE.merge_interval + 1), ("spes merge round", MERGE.merge_interval)):
            results.append({"dtype": dtype_name, **bench_case(case, uploads, spec=spes, step=step, repeats=repeats)})
        del uploads
        uploads = make_uploads(diloco, dtype)
        results.append(
            {"dtype": dtype_name, **bench_case("diloco average", uploads, spec=diloco, step=1, repeats=repeats)}
        )
        del uploads
    rows = [
        [
            r["case"],
            r["dtype"],
            f"{r['upload_bytes'] / 1e9:.3f}",
            f"{r['aggregate_s']:.3f}",
            f"{r['aggregate_gb_s']:.2f}",
            f"{r['memcpy_gb_s']:.2f}",
            f"{r['aggregate_over_memcpy']:.2f}",
            f"{r['copy_into_gb_s']:.2f}",
            f"{r['aggregate_over_copy_into']:.2f}",
        ]
        for r in results
    ]
    print(
        format_table(
            ["case", "uploads", "GB in", "aggregate s", "GB/s", "clone GB/s", "vs clone", "copy_ GB/s", "vs copy_"],
            rows,
        )
    )
    write_results(
        args.out,
        {
            **model_record(args.quick, config, overrides),
            "peers": peers,
            "experts_per_peer": k,
            "model_bytes_fp32": manifest_bytes(spes_manifest),
            "results": results,
        },
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
