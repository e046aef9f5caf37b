"""AdamW over the node's trainable parameters, and the learning-rate schedules as pure functions of the step.

Only parameters with `requires_grad` enter the optimizer, so a SPES node keeps no Adam moments for
the experts it does not own (the memory saving of the paper). The schedule is a pure function
`lr_at(step)`, so resuming needs nothing but the step.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import nn

from spes.config import OptimizerConfig, SchedulerConfig

WARMUP_START_FRACTION = 0.1  # OLMo's `warmup_min_lr` default: 10% of the peak


def param_groups(model: nn.Module, cfg: OptimizerConfig) -> list[dict]:
    """Two groups: matrices with weight decay; norms (and embeddings, by default) without."""
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        is_norm = p.ndim < 2
        is_embedding = name.endswith("embed.weight")
        if (is_norm and not cfg.decay_norm_and_bias) or (is_embedding and not cfg.decay_embeddings):
            no_decay.append(p)
        else:
            decay.append(p)
    groups = [{"params": decay, "weight_decay": cfg.weight_decay}]
    if no_decay:
        groups.append({"params": no_decay, "weight_decay": 0.0})
    return groups


def build_optimizer(model: nn.Module, cfg: OptimizerConfig) -> torch.optim.AdamW:
    beta1, beta2 = cfg.betas
    return torch.optim.AdamW(
        param_groups(model, cfg), lr=cfg.learning_rate, betas=(beta1, beta2), eps=cfg.eps, foreach=True
    )


def lr_at(step: int, cfg: SchedulerConfig, peak_lr: float, t_max: int) -> float:
    """Learning rate for optimizer step `step` (1-based; in the scheduler's units).

    Warm-up is linear from `warmup_min_lr` (null: 10% of `peak_lr`, as OLMo; the reference's configs give none) at
    step 0 to `peak_lr` over `t_warmup`; then
    cosine_with_warmup: lr = min + (peak - min) * (1 + cos(pi * (t - t_warmup) / (t_max - t_warmup))) / 2,
    linear_with_warmup: a straight line from peak to min; constant: peak. min = alpha_f * peak.
    """
    if cfg.name == "constant":
        return peak_lr
    if step < cfg.t_warmup:
        start = WARMUP_START_FRACTION * peak_lr if cfg.warmup_min_lr is None else cfg.warmup_min_lr
        return start + (peak_lr - start) * step / max(cfg.t_warmup, 1)
    floor = cfg.alpha_f * peak_lr
    progress = min((step - cfg.t_warmup) / max(t_max - cfg.t_warmup, 1), 1.0)
    if cfg.name == "linear_with_warmup":
        return peak_lr - (peak_lr - floor) * progress
    return floor + (peak_lr - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))


def rewarmed_lr(step: int, start: int, end: int, schedule: Callable[[int], float]) -> float:
    """OLMo's bolt-on warm-up after `reset_optimizer_state`: 0 at step `start`, rising linearly to the schedule's
    value at `end`, then the schedule (a fresh optimizer's first steps are not taken at full rate)."""
    if step >= end:
        return schedule(step)
    return schedule(end) * max(step - start, 0) / (end - start)


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    for group in optimizer.param_groups:
        group["lr"] = lr


def optimizer_state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes held by the optimizer's per-parameter state tensors (Adam moments, step counters)."""
    return sum(
        t.numel() * t.element_size()
        for state in optimizer.state.values()
        for t in state.values()
        if isinstance(t, torch.Tensor)
    )
