"""Schedules as pure functions, and which parameters get weight decay."""

from __future__ import annotations

import math

import pytest
import torch

from spes.config import OptimizerConfig, SchedulerConfig, load_config
from spes.model import Transformer
from spes.optim import build_optimizer, lr_at, param_groups, rewarmed_lr


def test_cosine_with_warmup_hand_values() -> None:
    cfg = SchedulerConfig(name="cosine_with_warmup", t_warmup=10, alpha_f=0.1)
    assert lr_at(0, cfg, 1.0, 110) == pytest.approx(0.1)  # the reference (OLMo) warms up from 10% of the peak
    assert lr_at(5, cfg, 1.0, 110) == pytest.approx(0.1 + 0.9 * 0.5)
    assert lr_at(10, cfg, 1.0, 110) == pytest.approx(1.0)
    assert lr_at(60, cfg, 1.0, 110) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.5)))
    assert lr_at(110, cfg, 1.0, 110) == pytest.approx(0.1)
    assert lr_at(500, cfg, 1.0, 110) == pytest.approx(0.1)


def test_warmup_starts_at_warmup_min_lr_when_given() -> None:
    cfg = SchedulerConfig(name="cosine_with_warmup", t_warmup=10, alpha_f=0.1, warmup_min_lr=0.0)
    assert lr_at(0, cfg, 1.0, 110) == 0.0 and lr_at(5, cfg, 1.0, 110) == pytest.approx(0.5)


def test_the_bolt_on_warm_up_after_an_optimizer_reset_meets_the_schedule() -> None:
    """OLMo's BoltOnWarmupScheduler: 0 at the loaded step, linear to the schedule's value t_warmup steps on."""
    cfg = SchedulerConfig(name="cosine_with_warmup", t_warmup=10, alpha_f=0.1)

    def schedule(step: int) -> float:
        return lr_at(step, cfg, 1.0, 1000)

    assert rewarmed_lr(500, 500, 510, schedule) == 0.0
    assert rewarmed_lr(505, 500, 510, schedule) == pytest.approx(schedule(510) / 2)
    assert [rewarmed_lr(s, 500, 510, schedule) for s in (510, 700)] == [schedule(510), schedule(700)]


def test_linear_and_constant() -> None:
    linear = SchedulerConfig(name="linear_with_warmup", t_warmup=0, alpha_f=0.0)
    assert lr_at(50, linear, 2.0, 100) == pytest.approx(1.0)
    assert lr_at(7, SchedulerConfig(name="constant"), 3e-4, 100) == 3e-4


def test_norms_and_embeddings_are_not_decayed_by_default() -> None:
    cfg, _ = load_config("configs/tiny.yaml", [])
    model = Transformer.for_run(cfg)
    decay, no_decay = param_groups(model, OptimizerConfig())
    names = {id(p): n for n, p in model.named_parameters()}
    assert all(names[id(p)].endswith(("norm.weight", "embed.weight")) for p in no_decay["params"])
    assert any(names[id(p)] == "lm_head.weight" for p in decay["params"])
    assert no_decay["weight_decay"] == 0.0
    everything = OptimizerConfig(decay_norm_and_bias=True, decay_embeddings=True)
    assert len(param_groups(model, everything)) == 1


def test_only_trainable_parameters_enter_the_optimizer() -> None:
    cfg, _ = load_config("configs/tiny.yaml", ["--spes_config.peer_id=2"])
    model = Transformer.for_run(cfg)
    opt = build_optimizer(model, cfg.optimizer)
    in_opt = {id(p) for g in opt.param_groups for p in g["params"]}
    assert in_opt == {id(p) for p in model.parameters() if p.requires_grad}
    assert opt.param_groups[0]["betas"] == (0.9, 0.95)
    assert isinstance(opt, torch.optim.AdamW)
