#!/usr/bin/env python
"""Memory of a SPES node against a full-model (DiLoCo/centralized) node: measured and from the shapes.

    .venv/bin/python bench/bench_memory.py           # configs/small.yaml measured + the paper's 1B analytically
    .venv/bin/python bench/bench_memory.py --quick   # configs/tiny.yaml measured + the 1B analytically

Measured: each node kind runs in its own fresh process (so peak RSS is its own): build the real model and
AdamW, run two training steps on one micro-batch, and read the bytes of the trainable parameters, of the
`.grad` tensors after backward and of the optimizer state after the step, and the process's peak RSS
(`ru_maxrss`) against its RSS before the model existed. Analytic: `spes.preflight.model_state_bytes`
(fp32 weights and gradients, two fp32 AdamW moments per trained parameter); the measured figures must agree
within 5%. The peak is also set beside the node preflight's whole estimate (model state + activations).
The paper's 1B config (`configs/spes_1b/node_0.yaml`) is counted on the meta device and analytically (no
weights are allocated).
"""

from __future__ import annotations

import argparse
import json
import resource
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import psutil
import torch

from common import (
    MIB,
    PAPER_1B,
    REPO_ROOT,
    config_file,
    format_table,
    machine_info,
    parser,
    repo_path,
    run_child,
    vocabulary,
    write_results,
)
from spes.config import TrainConfig, load_config
from spes.model import Transformer, count_params
from spes.objective import language_model_loss
from spes.optim import build_optimizer, optimizer_state_bytes
from spes.preflight import FP32, memory_need, model_state_bytes

TOLERANCE = 0.05
KINDS = {"spes": [], "full": ["--using_spes=false"]}
MINIATURE = [
    "--model.d_model=16",
    "--model.n_heads=2",
    "--model.n_layers=1",
    "--model.mlp_hidden_size=16",
    *vocabulary(64),
    "--model.max_sequence_length=8",
]


def node_config(path: Path, kind: str) -> TrainConfig:
    """Peer 0 of a SPES run, or the same model trained whole (centralized / a DiLoCo peer)."""
    cfg, _ = load_config(path, KINDS[kind])
    return cfg


def tensor_bytes(tensors: Sequence[torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def build(cfg: TrainConfig) -> tuple[Transformer, torch.optim.Optimizer]:
    with torch.device("meta"):
        model = Transformer.for_run(cfg, training=True)
    model.to_empty(device="cpu")
    model.init_weights(cfg.seed)
    return model, build_optimizer(model, cfg.optimizer)


def train_steps(cfg: TrainConfig, model: Transformer, optimizer: torch.optim.Optimizer, steps: int) -> tuple[int, int]:
    """`steps` steps on one random micro-batch; returns (gradient bytes after the last backward, tokens per step)."""
    batch = torch.randint(
        0, cfg.model.vocab_size, (cfg.device_train_microbatch_size, cfg.model.max_sequence_length + 1)
    )
    grad_bytes = 0
    for _ in range(steps):
        out = model(batch[:, :-1])
        assert out.logits is not None
        (language_model_loss(out.logits, batch[:, 1:]) + out.lb_loss + out.z_loss).backward()
        grad_bytes = tensor_bytes([p.grad for p in model.parameters() if p.grad is not None])
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return grad_bytes, batch.shape[0] * (batch.shape[1] - 1)


def measure_node(path: Path, kind: str) -> dict[str, Any]:
    """Run in a fresh process: real model + AdamW, two steps on one micro-batch; bytes and peak RSS.

    A miniature of the same model trains first, so that the libraries' lazily loaded kernels and thread
    pools are already in the baseline RSS and the peak above it is the node's own.
    """
    torch.set_num_threads(1)
    torch.manual_seed(0)
    cfg = node_config(path, kind)
    mini, _ = load_config(path, KINDS[kind] + MINIATURE)
    train_steps(mini, *build(mini), steps=2)
    rss_before = psutil.Process().memory_info().rss
    model, optimizer = build(cfg)
    params = list(model.parameters())
    trainable = [p for p in params if p.requires_grad]
    grad_bytes, tokens = train_steps(cfg, model, optimizer, steps=2)
    return {
        "kind": kind,
        "params": sum(p.numel() for p in params),
        "trainable_params": sum(p.numel() for p in trainable),
        "param_bytes": tensor_bytes(params),
        "trainable_bytes": tensor_bytes(trainable),
        "grad_bytes": grad_bytes,
        "optimizer_bytes": optimizer_state_bytes(optimizer),
        "tokens_per_step": tokens,
        "rss_before_bytes": rss_before,
        "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
    }


def analytic(cfg: TrainConfig) -> dict[str, int]:
    """fp32 weights, fp32 gradients of the trained parameters, two fp32 AdamW moments per trained parameter
    (`spes.preflight.model_state_bytes`, what the node preflight plans with)."""
    state = model_state_bytes(cfg)
    return {
        "params": state.params,
        "trainable_params": state.trained,
        "param_bytes": state.weights,
        "trainable_bytes": FP32 * state.trained,
        "grad_bytes": state.grads,
        "optimizer_bytes": state.optimizer,
        "static_bytes": state.total,
    }


def meta_counts(cfg: TrainConfig) -> dict[str, int]:
    """Parameter counts read off the real module tree on the meta device (nothing allocated)."""
    with torch.device("meta"):
        counts = count_params(Transformer.for_run(cfg))
    return {"params": counts.total, "trainable_params": counts.trainable}


def rel_err(measured: float, expected: float) -> float:
    return abs(measured - expected) / expected if expected else 0.0


CHECKED = ("trainable_bytes", "grad_bytes", "optimizer_bytes", "static_bytes")
RATIOS = (*CHECKED, "peak_minus_before_bytes")


def measure_kind(config: Path, kind: str) -> dict[str, Any]:
    """One node kind measured in a process of its own (its peak RSS its own), with the figures derived from it and
    the preflight's estimate of the same node beside them."""
    m = run_child(Path(__file__), ["--child", kind, "--config", str(config)])
    m["static_bytes"] = m["param_bytes"] + m["grad_bytes"] + m["optimizer_bytes"]
    m["peak_minus_before_bytes"] = m["peak_rss_bytes"] - m["rss_before_bytes"]
    cfg = node_config(config, kind)
    static, per_seq = memory_need(cfg, 1)
    m["preflight_estimate_bytes"] = static + cfg.device_train_microbatch_size * per_seq
    return m


def agreement(kind: str, m: dict[str, Any], a: dict[str, int]) -> list[dict[str, Any]]:
    """The measured figures against the analytic ones: the 5% check the benchmark stands on."""
    errors = {key: rel_err(m[key], a[key]) for key in CHECKED}
    return [
        {"kind": kind, "figure": k, "measured": m[k], "analytic": a[k], "rel_err": e, "within_5pct": e <= TOLERANCE}
        for k, e in errors.items()
    ]


def measured_table(measured: dict[str, dict[str, Any]]) -> str:
    """The measured nodes, MiB per figure, the analytic static memory and the preflight's estimate beside them."""
    rows = [
        [
            kind,
            f"{m['params'] / 1e6:.2f}M",
            f"{m['trainable_params'] / 1e6:.2f}M",
            *(f"{m[k] / MIB:.1f}" for k in ("param_bytes", "grad_bytes", "optimizer_bytes", "static_bytes")),
            f"{row['analytic']['static_bytes'] / MIB:.1f}",
            f"{m['peak_minus_before_bytes'] / MIB:.1f}",
            f"{m['preflight_estimate_bytes'] / MIB:.1f}",
        ]
        for kind, row in measured.items()
        for m in [row["measured"]]
    ]
    header = ["node", "params", "trained", "weights MiB", "grads MiB", "AdamW MiB", "static MiB", "analytic MiB"]
    return format_table([*header, "peak RSS - base MiB", "preflight estimate MiB"], rows)


def paper_1b() -> dict[str, dict[str, Any]]:
    """The paper's 1B config counted analytically and on the meta device (nothing allocated); prints its table."""
    paper: dict[str, dict[str, Any]] = {}
    rows = []
    for kind in KINDS:
        cfg = node_config(PAPER_1B, kind)
        a, meta = analytic(cfg), meta_counts(cfg)
        err = max(rel_err(meta[k], a[k]) for k in meta)
        paper[kind] = {"analytic": a, "meta_device": meta, "meta_vs_analytic_rel_err": err}
        gib = (f"{a[k] / 2**30:.2f}" for k in ("param_bytes", "grad_bytes", "optimizer_bytes", "static_bytes"))
        rows.append([kind, f"{a['params'] / 1e9:.3f}B", f"{a['trainable_params'] / 1e9:.3f}B", *gib, f"{err:.1e}"])
    ps, pf = paper["spes"]["analytic"], paper["full"]["analytic"]
    print(f"\npaper 1B config ({PAPER_1B.relative_to(REPO_ROOT)}), fp32 weights + grads + AdamW, one replica:")
    header = ["node", "params", "trained", "weights GiB", "grads GiB", "AdamW GiB", "static GiB", "meta vs analytic"]
    print(format_table(header, rows))
    print(
        f"SPES / full static memory: {ps['static_bytes'] / pf['static_bytes']:.3f} "
        f"(saves {(pf['static_bytes'] - ps['static_bytes']) / 2**30:.2f} GiB per replica)"
    )
    return paper


def main(argv: list[str] | None = None) -> int:
    p = parser("bench_memory", __doc__)
    p.add_argument("--child", choices=sorted(KINDS), help=argparse.SUPPRESS)
    p.add_argument(
        "--config", type=config_file, default=None, help="config measured for real (default: small, quick: tiny)"
    )
    args = p.parse_args(argv)
    config = args.config or REPO_ROOT / "configs" / ("tiny.yaml" if args.quick else "small.yaml")
    if args.child:
        print(json.dumps(measure_node(config, args.child)))
        return 0

    measured = {
        kind: {"measured": measure_kind(config, kind), "analytic": analytic(node_config(config, kind))}
        for kind in KINDS
    }
    checks = [c for kind, row in measured.items() for c in agreement(kind, row["measured"], row["analytic"])]
    s, f = (measured[k]["measured"] for k in ("spes", "full"))
    ratios = {key: s[key] / f[key] for key in RATIOS}
    print(f"measured on {repo_path(config)} (one micro-batch of {s['tokens_per_step']} tokens, fp32, CPU):")
    print(measured_table(measured))
    print("SPES / full: " + ", ".join(f"{k.replace('_bytes', '')} {v:.3f}" for k, v in ratios.items()))
    worst = max(c["rel_err"] for c in checks)
    print(f"measured vs analytic: worst relative error {worst:.2%} ({'OK' if worst <= TOLERANCE else 'OVER 5%'})")
    record = {
        "mode": "quick" if args.quick else "full",
        "machine": machine_info(),
        "config": repo_path(config),
        "measured": measured,
        "ratios_spes_over_full": ratios,
        "checks": checks,
        "paper_1b": paper_1b(),
    }
    write_results(args.out, record)
    return 0 if worst <= TOLERANCE else 1


if __name__ == "__main__":
    sys.exit(main())
