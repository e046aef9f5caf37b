"""spes.speed on the CPU: host-device syncs of a training step counted through a test double (the step of the
CUDA default, grouped_mm, waits for the device once), the optimized step's losses and gradients against the
plain one's, and the step timing and its figures."""

from __future__ import annotations

import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

import spes.speed
from conftest import littering
from spes.config import TrainConfig, load_config
from spes.distributed import DistInfo
from spes.model import Transformer, tflops_done_per_token, tflops_per_token
from spes.objective import micro_batch_loss
from spes.speed import (
    StepTimes,
    SyncCounter,
    build_timed_node,
    describe,
    moe_backend_of,
    random_batch,
    step_figures,
    time_steps,
    timed_step,
    trained_expert_share,
)

REPO = Path(__file__).resolve().parents[1]
TINY = REPO / "configs" / "tiny.yaml"


def tiny(tmp_path: Path, *overrides: str) -> TrainConfig:
    """configs/tiny.yaml as SPES peer 1 (experts 2-3 trained), 3 micro-batches of 2 x 32 tokens per step, no data
    filter."""
    cfg, _ = load_config(
        TINY,
        [
            f"--save_folder={tmp_path}",
            "--spes_config.peer_id=1",
            "--global_train_batch_size=6",
            "--device_train_microbatch_size=2",
            "--model.max_sequence_length=32",
            "--data.instance_filter=null",
            *overrides,
        ],
    )
    return cfg


def syncs_of_one_step(cfg: TrainConfig) -> list[tuple[str, str]]:
    trainer = build_timed_node(cfg, torch.device("cpu"))
    batch = random_batch(cfg, cfg.global_train_batch_size)
    trainer.train_step(batch)  # the first step creates AdamW's state
    with SyncCounter() as counter:
        trainer.train_step(batch)
    return counter.events


def test_a_grouped_mm_step_waits_for_the_device_once(tmp_path: Path) -> None:
    """3 micro-batches x 2 layers of routing, and the only read-back is the step's loss and norm check."""
    events = syncs_of_one_step(tiny(tmp_path, "--model.moe_backend=grouped_mm"))
    assert len(events) == 1, events
    assert events[0][0].startswith("guard.py:") and events[0][1] == "tolist"


def test_the_loop_backend_waits_once_per_layer_and_micro_batch(tmp_path: Path) -> None:
    """The counter sees real syncs: the per-expert loop reads each layer's counts back (the CPU default)."""
    events = syncs_of_one_step(tiny(tmp_path, "--model.moe_backend=torch"))
    from_moe = [e for e in events if e[0].startswith("moe.py:")]
    assert len(from_moe) == 2 * 3 and all(name == "tolist" for _, name in from_moe), events
    assert len(events) == len(from_moe) + 1


def test_logging_expert_counts_adds_one_sync_per_step(tmp_path: Path) -> None:
    events = syncs_of_one_step(
        tiny(tmp_path, "--model.moe_backend=grouped_mm", "--model.moe_log_expert_assignment=true")
    )
    assert len(events) == 2 and all(where.startswith(("guard.py:", "trainer.py:")) for where, _ in events), events


def _losses_and_grads(cfg: TrainConfig, batch: torch.Tensor) -> tuple[list[float], dict[str, torch.Tensor]]:
    """The gradients of one micro-batch, then the losses of two optimizer steps (which those gradients drive)."""
    trainer = build_timed_node(cfg, torch.device("cpu"))
    with trainer.autocast:
        loss, _, _ = micro_batch_loss(trainer.model, batch[: cfg.device_train_microbatch_size], cfg)
    loss.backward()
    grads = {n: p.grad.float().clone() for n, p in trainer.model.named_parameters() if p.grad is not None}
    trainer.optimizer.zero_grad(set_to_none=True)
    losses = [float(trainer.train_step(batch)["loss"]) for _ in range(2)]
    return losses, grads


@pytest.mark.parametrize("fused_loss", [False, True])
def test_the_grouped_step_gives_the_loops_losses_and_gradients(tmp_path: Path, fused_loss: bool) -> None:
    batch = random_batch(tiny(tmp_path), 6)
    flags = [f"--fused_loss={str(fused_loss).lower()}"]
    plain = _losses_and_grads(tiny(tmp_path / "a", "--model.moe_backend=torch", *flags), batch)
    fast = _losses_and_grads(tiny(tmp_path / "b", "--model.moe_backend=grouped_mm", *flags), batch)
    torch.testing.assert_close(fast[0], plain[0], atol=1e-5, rtol=1e-5)
    assert fast[1].keys() == plain[1].keys() and any(".experts.w1.1" in n for n in plain[1])
    for name in plain[1]:
        torch.testing.assert_close(
            fast[1][name], plain[1][name], atol=1e-5, rtol=1e-4, msg=lambda m, n=name: f"{n}: {m}"
        )


@pytest.mark.parametrize("backend", ["torch", "grouped_mm"])
def test_frozen_experts_in_bf16_give_the_same_amp_step(tmp_path: Path, backend: str, monkeypatch) -> None:
    """Under amp_bf16 the node holds its frozen experts in bf16: the same losses and gradients as fp32-held ones."""
    cfg = tiny(tmp_path, "--precision=amp_bf16", f"--model.moe_backend={backend}")
    batch = random_batch(cfg, 6)
    held = _losses_and_grads(cfg, batch)
    for_run = Transformer.for_run.__func__  # type: ignore[attr-defined]

    def fp32_frozen(cls: type[Transformer], cfg: TrainConfig, training: bool = False) -> Transformer:
        model = for_run(cls, cfg, training=training)
        return model.float()

    monkeypatch.setattr(Transformer, "for_run", classmethod(fp32_frozen))
    plain = _losses_and_grads(tiny(tmp_path / "plain", "--precision=amp_bf16", f"--model.moe_backend={backend}"), batch)
    frozen = [p for n, p in build_timed_node(cfg, torch.device("cpu")).model.named_parameters() if ".experts." in n]
    assert {p.dtype for p in frozen if not p.requires_grad} == {torch.float32}  # the patched build
    assert held[0] == plain[0]
    for name in plain[1]:
        torch.testing.assert_close(held[1][name], plain[1][name], atol=0, rtol=0, msg=lambda m, n=name: f"{n}: {m}")


def test_time_steps_projects_the_configs_step(tmp_path: Path) -> None:
    cfg = tiny(tmp_path, "--global_train_batch_size=8")
    trainer = build_timed_node(cfg, torch.device("cpu"))
    times = time_steps(trainer, lambda n: random_batch(cfg, n), micro_batches=(1, 2), steps=2)
    assert sorted(times.seconds) == [1, 2] and all(len(s) == 2 for s in times.seconds.values())
    share = trained_expert_share(trainer, random_batch(cfg, 2))
    assert 0 < share < 1  # peer 1 trains 2 of 8 experts
    figures = step_figures(cfg, times, torch.device("cpu"), share)
    assert figures["micro_batches_per_step"] == 4 and figures["tokens_per_step"] == 8 * 32
    assert figures["step_s"] == pytest.approx(figures["fixed_s"] + 4 * figures["per_micro_batch_s"])
    assert figures["tokens_per_s"] == pytest.approx(8 * 32 / figures["step_s"])
    assert figures["tflops_done_per_token"] < figures["tflops_per_token"]
    assert "mfu" not in figures  # no datasheet peak for a CPU


def test_time_steps_collects_garbage_as_training_does(tmp_path: Path, collections: list[int]) -> None:
    """The timed steps run under `gen1_gc_interval` as `Trainer.fit`'s do: no automatic collection (each step here
    also makes thousands of reference cycles), a generation-1 one after steps 3 and 6 of 2 + 2 x 2."""
    trainer = build_timed_node(tiny(tmp_path, "--gen1_gc_interval=3"), torch.device("cpu"))
    littering(trainer)
    collections.clear()  # those of building the node
    time_steps(trainer, lambda n: random_batch(trainer.cfg, n), micro_batches=(1, 2), steps=2, warmup=2)
    assert collections == [1, 1]


@pytest.mark.parametrize(
    ("seconds", "fit"),
    [
        ({1: [1.0, 1.3, 1.1], 4: [2.0, 2.3, 2.1]}, (1.1 - 1 / 3, 1 / 3)),  # the line through the medians
        ({1: [0.1], 2: [1.0]}, (0.0, 0.9)),  # a negative fixed part is none
        ({1: [2.0], 4: [1.0]}, (0.0, 0.25)),  # noise past the difference: the largest step alone, no fixed part
        ({4: [2.0, 1.0, 3.0]}, (0.0, 0.5)),  # one size
        ({1: [1.0], 4: [1.0]}, (0.0, 0.25)),  # no difference at all: no fixed part either
    ],
)
def test_step_times_fit_a_line_through_the_median_of_the_smallest_and_largest_step(
    seconds: dict[int, list[float]], fit: tuple[float, float]
) -> None:
    times = StepTimes(micro_batch=2, seconds=seconds)
    assert times.fit() == pytest.approx(fit)
    assert times.projected_step_s(10) == pytest.approx(fit[0] + 10 * fit[1])


def test_step_figures_of_given_times_and_a_datasheet_peak(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """What the benchmark records and `preflight --gpu` prints, from step times given here: the config's step of 3
    micro-batches of 2 x 32 tokens projected from steps of 1 and 2, and MFU against a peak of 1 TFLOP/s."""
    cfg = tiny(tmp_path)
    times = StepTimes(micro_batch=2, seconds={1: [0.5], 2: [0.8, 0.6, 1.0]}, warmup_seconds=[3.0], peak_memory_bytes=7)
    monkeypatch.setattr(spes.speed, "peak_flops", lambda device: 1e12)
    figures = step_figures(cfg, times, torch.device("cpu"), share=0.25)
    tps = 192 / (0.2 + 3 * 0.3)
    flops, done = tflops_per_token(cfg.model), tflops_done_per_token(cfg.model, 0.25)
    assert figures.pop("timed_steps_s") == {"1": [0.5], "2": [0.8, 0.6, 1.0]}
    assert figures.pop("warmup_s") == [3.0]
    assert figures == pytest.approx(
        {
            "micro_batch": 2,
            "micro_batches_per_step": 3,
            "tokens_per_step": 192,
            "step_s": 1.1,
            "fixed_s": 0.2,
            "per_micro_batch_s": 0.3,
            "tokens_per_s": tps,
            "measured_micro_batches": 2,
            "measured_step_s": 0.8,
            "measured_tokens_per_s": 128 / 0.8,
            "timed_spread": 0.4 / 0.8,
            "tflops_per_token": flops,
            "trained_expert_share": 0.25,
            "tflops_done_per_token": done,
            "achieved_tflops": tps * flops,
            "peak_memory_bytes": 7,
            "peak_tflops": 1.0,
            "mfu": tps * flops,
            "mfu_done": tps * done,
        }
    )
    assert describe(figures) == (
        f"{tps:,.0f} tokens/s for a step of 3 micro-batches of 2 (1.1 s: 0.3 s per micro-batch + 0.2 s), MFU "
        f"{tps * flops:.1%} by tflops_per_token ({tps * done:.1%} of the FLOPs done, 25% of routed copies trained; "
        "peak 1 TFLOP/s)"
    )
    monkeypatch.setattr(spes.speed, "peak_flops", lambda device: None)
    without_peak = step_figures(cfg, times, torch.device("cpu"), share=0.25)
    assert without_peak.keys() == figures.keys() - {"peak_tflops", "mfu", "mfu_done"} | {"timed_steps_s", "warmup_s"}
    assert describe(without_peak).endswith(f"+ 0.2 s), {tps * flops:.3g} TFLOP/s by tflops_per_token")


class _Trainer:
    """What `time_steps` and `timed_step` use of a Trainer: its micro-batch, device and step; each step recorded."""

    def __init__(self, device: torch.device, calls: list[tuple[str, Any]], pause_s: float = 0.0) -> None:
        self.cfg = SimpleNamespace(device_train_microbatch_size=2, gen1_gc_interval=None)
        self.info = SimpleNamespace(device=device)
        self.step, self.calls, self.pause_s = 0, calls, pause_s

    def train_step(self, batch: torch.Tensor) -> None:
        time.sleep(self.pause_s)
        self.step += 1
        self.calls.append(("step", len(batch)))


def test_time_steps_warms_up_on_the_largest_step_and_reads_cuda_peak_memory_of_the_timed_ones(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """On CUDA (its calls replaced by recorders here): each step between two synchronizations, the peak memory
    counter reset after the warm-up and read after the timed steps, by default 2 warm-up steps and 5 of each size."""
    calls: list[tuple[str, Any]] = []
    device = torch.device("cuda", 0)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda d: calls.append(("sync", d)))
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda d: calls.append(("reset", d)))
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda d: calls.append(("peak", d)) or 123)
    times = time_steps(_Trainer(device, calls), lambda n: torch.zeros(n, 3), micro_batches=(1, 4))  # type: ignore[arg-type]

    def steps(sequences: int, count: int) -> list[tuple[str, Any]]:
        return [("sync", device), ("step", sequences), ("sync", device)] * count

    assert calls == [*steps(8, 2), ("reset", device), *steps(2, 5), *steps(8, 5), ("peak", device)]
    assert times.micro_batch == 2 and times.peak_memory_bytes == 123
    assert len(times.warmup_seconds) == 2 and {m: len(s) for m, s in times.seconds.items()} == {1: 5, 4: 5}


def test_a_timed_step_is_the_seconds_its_step_took() -> None:
    seconds = timed_step(_Trainer(torch.device("cpu"), [], pause_s=0.05), torch.zeros(2, 3))  # type: ignore[arg-type]
    assert 0.05 <= seconds < 5


def test_random_batches_are_windows_of_token_ids_drawn_from_their_seed(tmp_path: Path) -> None:
    cfg = tiny(tmp_path)
    want = torch.randint(0, cfg.model.vocab_size, (3, 33), generator=torch.Generator().manual_seed(0))
    torch.manual_seed(1)  # the global generator, seeded otherwise: the batch draws from its own
    assert torch.equal(random_batch(cfg, 3), want)
    assert not torch.equal(random_batch(cfg, 3, seed=1), want)


def test_the_timed_node_is_the_one_process_node_spes_train_builds(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Main rank of one process (its metrics are written), the config's device defaults settled for its device,
    frozen experts held in bf16 under amp as a training node holds them, its experts' backend named as configured."""
    settled = []
    on_device = TrainConfig.on_device
    monkeypatch.setattr(TrainConfig, "on_device", lambda cfg, kind: settled.append(kind) or on_device(cfg, kind))
    trainer = build_timed_node(
        tiny(tmp_path, "--precision=amp_bf16", "--model.moe_backend=grouped_mm"), torch.device("cpu")
    )
    assert settled == ["cpu"]
    assert trainer.info == DistInfo(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"))
    frozen = {p.dtype for n, p in trainer.model.named_parameters() if ".experts." in n and not p.requires_grad}
    assert frozen == {torch.bfloat16}
    assert moe_backend_of(trainer.model) == "grouped_mm"
    auto = build_timed_node(tiny(tmp_path / "auto"), torch.device("cpu"))
    assert moe_backend_of(auto.model) == "torch"  # `auto` resolved: the per-expert loop on a CPU
