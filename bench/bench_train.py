#!/usr/bin/env python
"""Training speed of one node: tokens/s per MoE backend (`torch`, `grouped_mm`), SPES node vs full-model node.

    .venv/bin/python bench/bench_train.py                   # configs/small.yaml on the CPU
    .venv/bin/python bench/bench_train.py --quick           # configs/tiny.yaml, one timed step each
    .venv/bin/python bench/bench_train.py --device cuda     # on a GPU: amp_bf16, tokens/s, MFU, peak memory

Each variant is a real node (model built as `spes.train` builds it, AdamW over its trainable parameters)
and a real optimizer step (`Trainer.train_step`: micro-batches, clipping, schedule) on the config's global
batch of random token ids. The variants are timed in turns (variant A step, variant B step, ...) so that
a change in the machine's load hits all of them alike; the median step is reported. MFU uses
`spes.model.tflops_per_token` (6 x active matmul parameters + attention) against the GPU's bf16 peak;
on the CPU the achieved GFLOP/s are shown instead.
"""

from __future__ import annotations

import os
import statistics
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from common import REPO_ROOT, config_file, format_table, machine_info, parser, repo_path, write_results
from spes import speed
from spes.config import TrainConfig, load_config
from spes.distributed import DistInfo
from spes.model import Transformer, tflops_per_token
from spes.monitor import peak_flops
from spes.optim import build_optimizer
from spes.trainer import Trainer

BACKENDS = ("torch", "grouped_mm")
KINDS = {"spes": [], "full": ["--using_spes=false"]}


@dataclass
class Variant:
    name: str
    backend: str
    kind: str
    cfg: TrainConfig
    trainer: Trainer
    step_seconds: list[float]


def build_variant(
    config: Path, backend: str, kind: str, device: torch.device, save_folder: str, overrides: Sequence[str] = ()
) -> Variant:
    """A node as `spes.train` builds it (peer 0 for SPES), with its optimizer and trainer."""
    extra = ["--precision=amp_bf16"] if device.type == "cuda" else []
    cfg, _ = load_config(
        config, [f"--model.moe_backend={backend}", f"--save_folder={save_folder}", *KINDS[kind], *extra, *overrides]
    )
    with torch.device("meta"):
        model = Transformer.for_run(cfg, training=True)
    model.to_empty(device=device)
    model.init_weights(cfg.seed)
    optimizer = build_optimizer(model, cfg.optimizer)
    info = DistInfo(rank=0, world_size=1, local_rank=0, device=device)
    trainer = Trainer(
        cfg=cfg,
        model=model,
        optimizer=optimizer,
        loader=None,  # type: ignore[arg-type]
        info=info,
        log=lambda _line: None,
    )
    return Variant(f"{kind}/{backend}", backend, kind, cfg, trainer, [])


def timed_step(variant: Variant, batch: torch.Tensor) -> float:
    return speed.timed_step(variant.trainer, batch)


def step_in_turns(variants: list[Variant], batch: torch.Tensor, steps: int, device: torch.device) -> dict[str, int]:
    """A warm-up step of each variant (first-call allocations, AdamW state), then `steps` rounds of one step of each
    in turn, so a change in the machine's load hits every variant alike; on a GPU, each variant's peak memory."""
    for v in variants:
        timed_step(v, batch)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    peaks: dict[str, int] = {}
    for _ in range(steps):
        for v in variants:
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(device)
            v.step_seconds.append(timed_step(v, batch))
            if device.type == "cuda":
                peaks[v.name] = max(peaks.get(v.name, 0), torch.cuda.max_memory_allocated(device))
    return peaks


def result(
    v: Variant, tokens: int, flops: float, peak: float | None, base: float, peaks: dict[str, int]
) -> dict[str, Any]:
    """One variant's record: its median step, tokens/s and achieved FLOP/s, speed against full/torch (`base`, its
    median step), and where known its MFU and peak memory."""
    median = statistics.median(v.step_seconds)
    tps = tokens / median
    r: dict[str, Any] = {
        "variant": v.name,
        "backend": v.backend,
        "kind": v.kind,
        "step_seconds": v.step_seconds,
        "median_step_s": median,
        "tokens_per_s": tps,
        "gflops": tps * flops / 1e9,
        "speed_vs_full_torch": base / median,
        "trainable_params": sum(p.numel() for p in v.trainer.trainable),
    }
    if peak is not None:
        r["mfu"] = tps * flops / peak
    if v.name in peaks:
        r["peak_memory_bytes"] = peaks[v.name]
    return r


def results_table(results: list[dict[str, Any]]) -> str:
    """The variants side by side, MFU and peak memory columns only where measured (a GPU)."""
    rows = [
        [r["variant"], f"{r['median_step_s']:.3f}", f"{r['tokens_per_s']:,.0f}", f"{r['gflops']:.1f}"]
        + [f"{r['speed_vs_full_torch']:.2f}"]
        + ([f"{r['mfu']:.1%}"] if "mfu" in r else [])
        + ([f"{r['peak_memory_bytes'] / 2**30:.2f}"] if "peak_memory_bytes" in r else [])
        for r in results
    ]
    headers = ["node/backend", "step s", "tokens/s", "GFLOP/s", "vs full/torch"]
    headers += ["MFU"] if "mfu" in results[0] else []
    headers += ["peak GiB"] if "peak_memory_bytes" in results[0] else []
    return format_table(headers, rows)


def main(argv: list[str] | None = None) -> int:
    p = parser("bench_train", __doc__)
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu", help="where to train")
    p.add_argument("--config", type=config_file, default=None, help="node config (default: small, quick: tiny)")
    p.add_argument("--steps", type=int, default=None, help="timed steps per variant (default 5, quick 1)")
    args = p.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("error: --device cuda needs a CUDA GPU and a CUDA build of torch; this machine has neither")
    device = torch.device("cuda", 0) if args.device == "cuda" else torch.device("cpu")
    config = args.config or REPO_ROOT / "configs" / ("tiny.yaml" if args.quick else "small.yaml")
    steps = args.steps or (1 if args.quick else 5)
    torch.set_num_threads(os.cpu_count() or 1)

    with tempfile.TemporaryDirectory(prefix="bench_train_") as tmp:
        variants = [build_variant(config, b, k, device, f"{tmp}/{k}_{b}") for b in BACKENDS for k in KINDS]
        cfg = variants[0].cfg
        gen = torch.Generator().manual_seed(0)
        batch = torch.randint(
            0, cfg.model.vocab_size, (cfg.global_train_batch_size, cfg.model.max_sequence_length + 1), generator=gen
        )
        peaks = step_in_turns(variants, batch, steps, device)

    tokens = cfg.global_train_batch_size * cfg.model.max_sequence_length
    flops = tflops_per_token(cfg.model) * 1e12
    base = statistics.median(next(v for v in variants if v.name == "full/torch").step_seconds)
    peak = peak_flops(device)
    results = [result(v, tokens, flops, peak, base, peaks) for v in variants]
    print(
        f"{repo_path(config)} on {device}: global batch {cfg.global_train_batch_size} x "
        f"{cfg.model.max_sequence_length} tokens, micro-batch {cfg.device_train_microbatch_size}, "
        f"{cfg.precision}, median of {steps} step(s), torch threads {torch.get_num_threads()}"
    )
    print(results_table(results))
    record = {
        "mode": "quick" if args.quick else "full",
        "machine": machine_info(),
        "device": str(device),
        "config": repo_path(config),
        "tokens_per_step": tokens,
        "tflops_per_token": flops / 1e12,
        "results": results,
    }
    write_results(args.out, record)
    return 0


if __name__ == "__main__":
    sys.exit(main())
