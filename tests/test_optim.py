"""Schedules as pure functions, and which parameters get weight decay."""

from __future__ import annotations

import math

import pytest
import torch

from spes.config import OptimizerConfig, SchedulerConfig, load_config
from spes.model import Transformer
from spes.optim import build_optimizer, lr_at, optimizer_state_bytes, param_groups, rewarmed_lr, set_lr


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


def test_the_bolt_on_warm_up_ends_exactly_on_the_schedule() -> None:
    """The learning rate the trainer sets and logs at a re-warm-up's last step is the schedule's, bit for bit:
    schedule(end) * (end - start) / (end - start) rounds twice and misses it at many steps (0.1 * 3 / 3 is not
    0.1); a zero-length re-warm-up (t_warmup 0) is the schedule from its first step."""
    cfg = SchedulerConfig(name="cosine_with_warmup", t_warmup=10, alpha_f=0.1)

    def schedule(step: int) -> float:
        return lr_at(step, cfg, 4e-4, 1000)

    assert any(schedule(s) * 10 / 10 != schedule(s) for s in range(10, 300)), "the case must round"
    for start in range(0, 290):
        assert rewarmed_lr(start + 10, start, start + 10, schedule) == schedule(start + 10), start
    for step in (0, 7, 500):
        assert rewarmed_lr(step, step, step, schedule) == schedule(step)


def test_the_warm_up_hands_over_to_the_decay_at_the_peak_exactly() -> None:
    """At step t_warmup the linear schedule's learning rate is the configured peak itself, as logged; the warm-up
    line there, start + (peak - start) * t / t, misses it by a bit (at a peak of 3e-4, for every t below)."""
    for t_warmup in (1, 2, 3, 10, 100, 2000):
        cfg = SchedulerConfig(name="linear_with_warmup", t_warmup=t_warmup, alpha_f=0.1)
        assert lr_at(t_warmup, cfg, 3e-4, 10 * t_warmup) == 3e-4, t_warmup


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


def test_schedules_away_from_the_unit_peak_and_the_midpoint() -> None:
    """A peak other than 1 and a floor other than 0 (where a product and a quotient differ), and points where the
    linear and cosine schedules part (they agree at the midpoint)."""
    peak, t_warmup, t_max = 2e-3, 10, 110
    cosine = SchedulerConfig(name="cosine_with_warmup", t_warmup=t_warmup, alpha_f=0.1)
    linear = SchedulerConfig(name="linear_with_warmup", t_warmup=t_warmup, alpha_f=0.1)
    for cfg in (cosine, linear):
        assert lr_at(0, cfg, peak, t_max) == pytest.approx(0.1 * peak)
        assert lr_at(4, cfg, peak, t_max) == pytest.approx(0.1 * peak + 0.9 * peak * 4 / 10)
        assert lr_at(t_max, cfg, peak, t_max) == pytest.approx(0.1 * peak)
    quarter = t_warmup + (t_max - t_warmup) // 4
    assert lr_at(quarter, linear, peak, t_max) == pytest.approx(peak - 0.9 * peak * 0.25)
    assert lr_at(quarter, cosine, peak, t_max) == pytest.approx(
        0.1 * peak + 0.9 * peak * 0.5 * (1 + math.cos(0.25 * math.pi))
    )


def test_a_one_step_decay_reaches_the_floor_at_its_step() -> None:
    for name in ("cosine_with_warmup", "linear_with_warmup"):
        cfg = SchedulerConfig(name=name, t_warmup=5, alpha_f=0.1)
        assert lr_at(6, cfg, 1.0, 6) == pytest.approx(0.1), name


def test_the_optimizer_takes_every_setting_of_its_config() -> None:
    """lr, betas, eps and weight decay as configured; multi-tensor (foreach) kernels, one launch per group."""
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LayerNorm(4))
    cfg = OptimizerConfig(learning_rate=3e-3, betas=(0.8, 0.9), eps=1e-6, weight_decay=0.25)
    opt = build_optimizer(model, cfg)
    assert (opt.defaults["lr"], opt.defaults["betas"], opt.defaults["eps"]) == (3e-3, (0.8, 0.9), 1e-6)
    assert opt.defaults["foreach"] is True
    assert [g["weight_decay"] for g in opt.param_groups] == [0.25, 0.0]
    assert [len(g["params"]) for g in opt.param_groups] == [1, 3]  # the linear's weight; its bias, the norm's two


def test_norm_and_embedding_weights_are_exactly_the_undecayed_ones() -> None:
    cfg, _ = load_config("configs/tiny.yaml", [])
    model = Transformer.for_run(cfg)
    decay, no_decay = param_groups(model, OptimizerConfig(weight_decay=0.3))
    names = {id(p): n for n, p in model.named_parameters() if p.requires_grad}  # this SPES node's own and shared
    want = {n for n, p in model.named_parameters() if p.requires_grad and (p.ndim < 2 or n == "embed.weight")}
    assert {names[id(p)] for p in no_decay["params"]} == want and decay["weight_decay"] == 0.3
    assert {names[id(p)] for p in decay["params"]} == set(names.values()) - want


def test_set_lr_and_the_bytes_of_optimizer_state() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.LayerNorm(2))
    opt = build_optimizer(model, OptimizerConfig())
    set_lr(opt, 0.125)
    assert [g["lr"] for g in opt.param_groups] == [0.125, 0.125]
    assert optimizer_state_bytes(opt) == 0
    model(torch.ones(1, 3)).sum().backward()
    opt.step()
    params = list(model.parameters())
    # exp_avg and exp_avg_sq in fp32 for every value, and one fp32 step counter per tensor
    assert optimizer_state_bytes(opt) == 2 * 4 * sum(p.numel() for p in params) + 4 * len(params)
