#!/usr/bin/env python
"""Memory and time of a training step with and without `fused_loss` (the LM head and loss a chunk at a time).

    .venv/bin/python bench/bench_fused_loss.py           # the 1B node (151,936-entry vocabulary), 2 blocks
    .venv/bin/python bench/bench_fused_loss.py --quick   # configs/tiny.yaml, seconds
    .venv/bin/python bench/bench_fused_loss.py --device cuda   # on a GPU: amp_bf16, torch.cuda peak memory

Each arm runs in a fresh process: it builds SPES peer 0 of the config as `spes.train` does (the real `Trainer`),
takes one untimed step (AdamW state, first-call allocations), then times `--steps` steps on the same batch. Memory
is what a step adds above the model, its optimizer state and what the first step left: on the CPU the process's
peak RSS (`ru_maxrss`; the first step's peak lacks the AdamW state, so the later steps' is the peak) over its RSS
after the first step, on a GPU `torch.cuda.max_memory_allocated` over the memory allocated after it. Both arms
train on the same tokens from the same seed; the report is refused unless their losses agree (the two
computations differ only in the order of their sums). The 1B layout is cut to 2 blocks and one sequence per step
so that the whole-logits arm fits this project's 24 GiB CPU machine.
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import tempfile
from pathlib import Path
from typing import Any

import psutil
import torch

from bench_train import build_variant, timed_step
from common import MIB, REPO_ROOT, format_table, machine_info, parser, run_child, write_results

FULL = (
    REPO_ROOT / "configs" / "spes_1b" / "node_0.yaml",
    [
        "--model.n_layers=2",
        "--global_train_batch_size=1",
        "--device_train_microbatch_size=1",
    ],
)
QUICK = (REPO_ROOT / "configs" / "tiny.yaml", ["--global_train_batch_size=4", "--device_train_microbatch_size=4"])
LOSS_AGREEMENT = 1e-4
"""Largest relative difference of the arms' losses for the premise 'the same computation' to hold."""


def measure(config: Path, overrides: list[str], fused: bool, steps: int, device: torch.device) -> dict[str, Any]:
    """Run in a fresh process: one untimed and `steps` timed steps of the node, with or without `fused_loss`."""
    torch.manual_seed(0)
    cpu_precision = [] if device.type == "cuda" else ["--precision=fp32"]
    arm = [*overrides, *cpu_precision, f"--fused_loss={str(fused).lower()}"]
    with tempfile.TemporaryDirectory(prefix="bench_fused_loss_") as tmp:
        variant = build_variant(config, "torch", "spes", device, tmp, arm)
        cfg = variant.cfg
        batch = torch.randint(
            0,
            cfg.model.vocab_size,
            (cfg.global_train_batch_size, cfg.model.max_sequence_length + 1),
            generator=torch.Generator().manual_seed(0),
        )
        losses = [variant.trainer.train_step(batch)["loss"]]
        rss_before = psutil.Process().memory_info().rss
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
            allocated_before = torch.cuda.memory_allocated(device)
        seconds = []
        for _ in range(steps):
            seconds.append(timed_step(variant, batch))
        if device.type == "cuda":
            added = torch.cuda.max_memory_allocated(device) - allocated_before
        else:
            added = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - rss_before
    return {
        "fused_loss": fused,
        "first_loss": float(losses[0]),
        "tokens_per_step": batch.shape[0] * (batch.shape[1] - 1),
        "vocab": cfg.model.embedding_size,
        "step_seconds": seconds,
        "median_step_s": statistics.median(seconds),
        "memory_added_bytes": added,
        "memory_measure": "torch.cuda.max_memory_allocated" if device.type == "cuda" else "ru_maxrss - rss",
    }


def run_arms(steps: int, device: str, quick: bool) -> dict[str, dict[str, Any]]:
    """Each arm in a process of its own (its memory high-water mark its own), refused unless both trained on the
    same tokens."""
    flags = ["--steps", str(steps), "--device", device, *(["--quick"] if quick else [])]
    arms = {name: run_child(Path(__file__), ["--child", name, *flags], timeout=1800) for name in ("whole", "fused")}
    if arms["whole"]["tokens_per_step"] != arms["fused"]["tokens_per_step"]:
        raise SystemExit(f"error: the arms trained on different token counts: {arms}; no report written")
    return arms


def loss_agreement(whole: dict[str, Any], fused: dict[str, Any]) -> float:
    """The arms' first losses' relative difference, refused past `LOSS_AGREEMENT`: a faster loss that computes
    something else is no result."""
    agreement = abs(fused["first_loss"] - whole["first_loss"]) / abs(whole["first_loss"])
    if agreement > LOSS_AGREEMENT:
        raise SystemExit(
            f"error: the arms' first losses differ by {agreement:.2e} (more than {LOSS_AGREEMENT:g}): not the same "
            "computation, no report written"
        )
    return agreement


def main(argv: list[str] | None = None) -> int:
    p = parser("bench_fused_loss", __doc__)
    p.add_argument("--child", choices=["whole", "fused"], help=argparse.SUPPRESS)
    p.add_argument("--steps", type=int, default=None, help="timed steps per arm (default 3, quick 1)")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu", help="where to train")
    args = p.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda needs a CUDA GPU and a CUDA build of torch")
    config, overrides = QUICK if args.quick else FULL
    steps = args.steps or (1 if args.quick else 3)
    device = torch.device("cuda", 0) if args.device == "cuda" else torch.device("cpu")
    if args.child:
        print(json.dumps(measure(config, overrides, args.child == "fused", steps, device)))
        return 0

    arms = run_arms(steps, args.device, args.quick)
    whole, fused = arms["whole"], arms["fused"]
    agreement = loss_agreement(whole, fused)
    memory_ratio = fused["memory_added_bytes"] / whole["memory_added_bytes"]
    time_ratio = fused["median_step_s"] / whole["median_step_s"]
    print(
        f"{config.relative_to(REPO_ROOT)} {' '.join(overrides)} on {args.device}: {whole['tokens_per_step']:,} tokens "
        f"per step, vocabulary {whole['vocab']:,}"
    )
    rows = [
        [name, f"{a['first_loss']:.6f}", f"{a['median_step_s']:.3f}", f"{a['memory_added_bytes'] / MIB:,.0f}"]
        for name, a in arms.items()
    ]
    print(format_table(["loss", "first loss", "step s", "memory added MiB"], rows))
    print(f"fused / whole: memory added {memory_ratio:.3f}x, step time {time_ratio:.3f}x")
    record = {
        "mode": "quick" if args.quick else "full",
        "machine": machine_info(),
        "device": args.device,
        "config": str(config.relative_to(REPO_ROOT)),
        "overrides": overrides,
        "arms": arms,
        "loss_agreement": agreement,
        "memory_ratio": memory_ratio,
        "step_time_ratio": time_ratio,
    }
    write_results(args.out, record)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
