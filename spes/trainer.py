"""The node's training loop: gradient accumulation, clipping, schedules, logging, evaluation, SPES sync, checkpoints.

The loop is generic: what is SPES-specific is that the model was built with only its own expert block
trainable (`Transformer.for_run`) and that, every `sync_steps` steps, `PeerSync.sync` exchanges weights
with the parameter server. Everything with state has `state_dict()` / `load_state_dict()`, so exact
resume is one path: model + optimizer + `Trainer.state_dict()` (step, tokens, data position, RNG).
"""

from __future__ import annotations

import base64
import math
import time
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import torch
from torch import nn

from spes import checkpoint
from spes.config import SchedulerConfig, TrainConfig, parse_duration
from spes.distributed import DistInfo, all_reduce_mean, grad_sync, unwrap, uses_fsdp
from spes.evaluators import evaluators_of
from spes.gc_schedule import scheduled_collection
from spes.guard import NonFiniteSkips, all_finite, check_weights_finite
from spes.interrupt import Interrupted, Stopped, StopRequest
from spes.model import tflops_per_token
from spes.moe import decayed_lb_factor
from spes.monitor import MetricsLog, SpeedMonitor, format_line, peak_flops, peak_memory_mb
from spes.objective import micro_batch_loss, validation_loss
from spes.optim import lr_at, rewarmed_lr, set_lr
from spes.profiling import step_profiler
from spes.save_folder import Keep
from spes.schema import to_dict
from spes.tracking import Trackers

if TYPE_CHECKING:  # the sync wing (grpc) is imported only by runs that sync
    from spes.sync.peer import SyncResult


class Loader(Protocol):
    def __iter__(self) -> Iterator[torch.Tensor]: ...
    def state_dict(self) -> dict[str, Any]: ...
    def load_state_dict(self, state: dict[str, Any]) -> None: ...


class Syncer(Protocol):
    """The node's side of the SPES rounds (`spes.sync.peer.PeerSync`)."""

    def syncs_at(self, step: int) -> bool:
        """Whether `step` is a sync step (every `sync_steps`, or `sync_steps / overlap_fragments` with fragments)."""
        ...

    def sync(self, step: int) -> SyncResult:
        """The round of sync step `step` (without overlap_sync its global model is loaded when this returns)."""
        ...

    def land(self, step: int) -> SyncResult | None:
        """Apply an overlapped round due at `step` (a step between sync steps); None when none is."""
        ...

    stopping: Callable[[], bool]
    """Set by the trainer: whether a stop was requested (a wait for a round then raises `Interrupted`)."""

    def checkpoint_files(self) -> dict[str, Callable[[Path], None]]:
        """Files a checkpoint taken now must hold (a round in flight, the codec's state), by name: each writes itself
        to a path."""
        ...


def schedule_length(cfg: TrainConfig) -> int:
    """`scheduler.t_max` in steps (default: the run's length)."""
    amount, unit = parse_duration(cfg.max_duration)
    t_max = cfg.scheduler.t_max or (amount if unit == "steps" and cfg.scheduler.units == "steps" else None)
    if t_max is None:
        return cfg.duration_steps  # NOTE: not stop_at's: a launch that stops early follows the run's schedule
    if cfg.scheduler.units == "tokens":
        return math.ceil(t_max / cfg.tokens_per_step)
    return t_max


def aux_loss_factor(cfg: TrainConfig, step: int) -> float | None:
    """A SPES node's decayed load-balancing factor at `step` (None: not decayed), ramped over the run's length
    (`max_duration`), as the reference: a launch that stops early (`stop_at`) follows the run's ramp."""
    spes = cfg.spes_config
    if not spes.using_decayed_aux_loss or cfg.owned_experts() is None:
        return None
    return decayed_lb_factor(step, cfg.duration_steps, spes.decayed_factor_update_steps)


def scheduler_in_steps(cfg: TrainConfig) -> SchedulerConfig:
    """`cfg.scheduler` counted in optimizer steps: with `scheduler.units: tokens` its `t_warmup` is a number of
    tokens (as `t_max`, see `schedule_length`), and `lr_at` compares it with a step."""
    sched = cfg.scheduler
    if sched.units == "steps":
        return sched
    return replace(sched, units="steps", t_warmup=math.ceil(sched.t_warmup / cfg.tokens_per_step))


def _encode_rng() -> dict[str, str]:
    state = {"cpu": base64.b64encode(torch.get_rng_state().numpy().tobytes()).decode()}
    if torch.cuda.is_available():
        state["cuda"] = base64.b64encode(torch.cuda.get_rng_state().numpy().tobytes()).decode()
    return state


def _decode_rng(state: dict[str, str]) -> None:
    torch.set_rng_state(torch.frombuffer(bytearray(base64.b64decode(state["cpu"])), dtype=torch.uint8))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(torch.frombuffer(bytearray(base64.b64decode(state["cuda"])), dtype=torch.uint8))


def retention(cfg: TrainConfig, sharded: bool, unsharded: bool) -> Keep:
    """What a save prunes its kind to: with `sharded` (FSDP) checkpoints each schedule writes its own kind and keeps
    its own count; off FSDP both write `step<N>/`, and each schedule keeps its own newest (`save_folder.prune`)."""
    if sharded or cfg.save_interval_unsharded is None:
        return cfg.save_num_unsharded_checkpoints_to_keep if unsharded else cfg.save_num_checkpoints_to_keep
    schedules = (
        (cfg.save_interval, cfg.save_num_checkpoints_to_keep),
        (cfg.save_interval_unsharded, cfg.save_num_unsharded_checkpoints_to_keep),
    )
    return [(interval, keep) for interval, keep in schedules if interval]


class Trainer:
    def __init__(
        self,
        *,
        cfg: TrainConfig,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        loader: Loader,
        info: DistInfo,
        eval_batches: Callable[[], Iterator[torch.Tensor]] | None = None,
        syncer: Syncer | None = None,
        log: Callable[[str], None] = print,
    ) -> None:
        self.cfg, self.model, self.optimizer, self.loader, self.info = cfg, model, optimizer, loader, info
        self.eval_batches, self.syncer, self.log = eval_batches, syncer, log
        self.step, self.tokens = 0, 0
        self.max_steps, self.t_max, self.scheduler = cfg.max_steps, schedule_length(cfg), scheduler_in_steps(cfg)
        self.speed = SpeedMonitor(cfg.speed_monitor.window_size)
        self.metrics = MetricsLog(cfg.save_folder, enabled=info.is_main)
        self.trackers = Trackers(cfg, enabled=info.is_main, world_size=info.world_size)
        self.downstream = evaluators_of(cfg, info, log)
        self.autocast = torch.autocast(info.device.type, dtype=torch.bfloat16, enabled=cfg.precision == "amp_bf16")
        self.flops_per_token = tflops_per_token(cfg.model) * 1e12
        self.peak = peak_flops(info.device)
        self.trainable = [p for p in model.parameters() if p.requires_grad]
        self.last_saved = -1
        self.skips = NonFiniteSkips(cfg.skip_nonfinite_steps, cfg.save_folder)
        self.history: list[dict[str, Any]] = []
        self.lr_rewarm: tuple[int, int] | None = None
        """(start, end) of a warm-up bolted on after `reset_optimizer_state` (`spes.optim.rewarmed_lr`), if any."""

    # -- state ------------------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        state = {"step": self.step, "tokens": self.tokens, "data": self.loader.state_dict(), "rng": _encode_rng()}
        return state if self.lr_rewarm is None else {**state, "lr_rewarm": list(self.lr_rewarm)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.step, self.tokens = state.get("step", 0), state.get("tokens", 0)
        if "data" in state:
            self.loader.load_state_dict(state["data"])
        if "rng" in state:
            _decode_rng(state["rng"])
        if "lr_rewarm" in state:
            start, end = state["lr_rewarm"]
            self.lr_rewarm = (int(start), int(end))
        self.last_saved = self.step

    def lr(self, step: int) -> float:
        """The learning rate of optimizer step `step`: the schedule, or its bolted-on warm-up."""
        peak, sched = self.cfg.optimizer.learning_rate, self.scheduler
        if self.lr_rewarm is None:
            return lr_at(step, sched, peak, self.t_max)
        return rewarmed_lr(step, *self.lr_rewarm, lambda s: lr_at(s, sched, peak, self.t_max))

    def resumed_round(self, result: SyncResult) -> None:
        """A round applied at start (the one an interrupted run was waiting for, or the run's latest when it has
        moved past this node): continue from its step and log that step's row with the round's figures (the
        interrupted process saved before it could; the step's training figures went with it)."""
        self.metrics.truncate(min(self.step, result.step - 1))  # NOTE: rows past the checkpoint's step did not happen
        self.step = result.step
        self._record(self.step, result.metrics())

    def _limit(self) -> str:
        """The setting `max_steps` comes from, and how to train on past it."""
        if self.max_steps < self.cfg.duration_steps:
            return f"stop_at is {self.max_steps} (max_duration is {self.cfg.duration_steps} steps); raise stop_at"
        return f"max_duration is {self.max_steps} steps; raise max_duration"

    # -- the loop ---------------------------------------------------------------------------------------------
    def fit(self) -> list[dict[str, Any]]:
        """Train to `max_steps`; returns the logged metric records."""
        batches = iter(self.loader)
        self.metrics.truncate(self.step)  # rows of an earlier attempt past this step are history that did not happen
        if self.step >= self.max_steps:
            self.log(f"nothing to do: checkpoint is at step {self.step}, {self._limit()}")
            return self.history
        if self.step == 0 and not self.cfg.no_pre_train_checkpoint:
            self.save()  # the initial weights, e.g. to compare runs that start from them
        fit_started = time.monotonic()
        self.speed.start(self.step, fit_started)
        profiling = self.cfg.torch_profiling and self.info.is_main
        with (
            StopRequest(self.log) as stop,
            scheduled_collection(self.cfg.gen1_gc_interval) as collect,
            step_profiler(profiling, Path(self.cfg.save_folder) / "profiler", self.log, self.info.device) as profiled,
        ):
            if self.syncer is not None:
                self.syncer.stopping = lambda: stop.requested
            while self.step < self.max_steps:
                started = time.perf_counter()
                metrics = self.train_step(next(batches))
                self.speed.record(self.cfg.tokens_per_step, time.perf_counter() - started)
                try:
                    self.after_step(metrics)
                    waited_out = False
                except Interrupted:  # a stop request while waiting for a round: it stays in flight, saved with us
                    waited_out = True
                collect(self.step)
                profiled(self.step)
                limit = self.cfg.time_limit
                interrupted, out_of_time = self._stop_requested(
                    stop, limit is not None and time.monotonic() - fit_started >= limit
                )
                if waited_out or interrupted:
                    if self.last_saved != self.step:  # NOTE: a save of this step holds its round in flight already
                        self.save()
                    self.log(f"stopped at step {self.step}; resume with --resume (or load_path={self.cfg.save_folder})")
                    raise Stopped(self.step)
                if out_of_time:
                    self.log(f"time_limit of {limit} s reached at step {self.step}: saving; resume with --resume")
                    break
        if self.last_saved != self.step and (self.cfg.save_interval is not None or self.step < self.max_steps):
            self.save()
        self.trackers.close()
        return self.history

    def _stop_requested(self, stop: StopRequest, out_of_time: bool) -> tuple[bool, bool]:
        """(a rank was interrupted, a rank ran past `time_limit`), agreed by every rank in one collective."""
        flags = all_reduce_mean(torch.tensor([float(stop.requested), float(out_of_time)]), self.info)
        return bool(flags[0].item() > 0), bool(flags[1].item() > 0)

    def train_step(self, batch: torch.Tensor) -> dict[str, Any]:
        """One optimizer step over this rank's share of the global batch, in micro-batches.

        The host waits for the device once per step, to read the loss and gradient norm it decides on (with
        `moe_log_expert_assignment`, once more for the counts); nothing in the micro-batch loop reads a value
        back, so the host queues the whole step's work ahead of the device (with `moe_backend` grouped_mm, the
        `auto` choice on CUDA: tests/test_speed.py counts the syncs)."""
        self.model.train()
        self._apply_decayed_aux_factor()
        batch = self._to_device(batch)
        sums = torch.zeros(3, device=self.info.device)
        routed_LE = torch.zeros((), dtype=torch.long, device=self.info.device)  # tokens each expert received
        micro = batch.split(self.cfg.device_train_microbatch_size)
        for i, mb in enumerate(micro):
            with grad_sync(self.model, i == len(micro) - 1), self.autocast:
                loss, mb_ce, out = micro_batch_loss(self.model, mb, self.cfg)
            (loss / len(micro)).backward()
            sums += torch.stack([mb_ce.detach(), out.lb_loss.detach(), out.z_loss.detach()]) / len(micro)
            if self.cfg.model.moe_log_expert_assignment:
                routed_LE = routed_LE + out.tokens_per_expert.detach()
        max_norm = self.cfg.max_grad_norm if self.cfg.max_grad_norm is not None else math.inf
        grad_norm = torch.nn.utils.clip_grad_norm_(self.trainable, max_norm)
        grad_norm = grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor") else grad_norm
        finite, (ce, lb, z, norm) = all_finite(torch.cat([sums, grad_norm.reshape(1).to(sums)]), self.info)
        warning = self.skips.check(self.step + 1, ce + lb + z, norm, finite)
        if warning is not None:
            self.log(warning)
        self.step += 1
        self.tokens += self.cfg.tokens_per_step
        lr = self.lr(self.step)
        set_lr(self.optimizer, lr)
        if finite:
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        metrics: dict[str, Any] = {
            "loss": ce + lb + z,
            "ce": ce,
            "lb_loss": lb,
            "z_loss": z,
            "lr": lr,
            "grad_norm": norm,
        }
        if self.cfg.model.moe_log_expert_assignment:
            metrics["tokens_per_expert"] = self._node_total(routed_LE)
        return metrics

    def _to_device(self, batch: torch.Tensor) -> torch.Tensor:
        """The batch on the device, copied from pinned memory so that the copy does not wait for the device."""
        if self.info.device.type == "cuda" and batch.device.type == "cpu" and not batch.is_pinned():
            batch = batch.pin_memory()  # NOTE: a pageable copy would wait for the work queued before it
        return batch.to(self.info.device, non_blocking=True)

    def _node_total(self, counts: torch.Tensor) -> list:
        """Per-rank counts summed over the node's ranks, as (nested) lists of ints for metrics.jsonl."""
        mean = all_reduce_mean(counts.double(), self.info)
        return (mean * self.info.world_size).round().long().tolist()

    def _apply_decayed_aux_factor(self) -> None:
        factor = aux_loss_factor(self.cfg, self.step)
        if factor is not None:
            unwrap(self.model).set_own_count_scale(factor)  # type: ignore[operator]

    def after_step(self, metrics: dict[str, Any]) -> None:
        """Evaluation, SPES sync, logging and checkpointing that follow an optimizer step."""
        cfg, step = self.cfg, self.step
        eval_now = (
            self.eval_batches is not None
            and cfg.eval_interval
            and (step % cfg.eval_interval == 0 or step == self.max_steps)
        )
        if eval_now:
            metrics["val_loss"] = self.evaluate()
            metrics["val_ppl"] = math.exp(min(metrics["val_loss"], 50.0))
        synced = self._sync_round(step)
        if synced is not None:
            metrics.update(synced.metrics())
            step = self.step
            if eval_now and cfg.spes_config.eval_after_sync and synced.rounds:
                metrics["merged_val_loss"] = self.evaluate()
        downstream_now = self.downstream is not None and self.downstream.due(step)
        if downstream_now:  # NOTE: after the sync, so on the merged global model
            assert self.downstream is not None
            metrics.update(self.downstream.run(self.model, step))
        metrics.update(self._throughput(step))
        if step % cfg.log_interval == 0 or step == self.max_steps or eval_now or synced is not None or downstream_now:
            self._record(step, metrics)
            if self.info.is_main:
                self.log(format_line(step, self.cfg.duration_steps, metrics, stop=self.max_steps))
        self._save_due(step)

    def _sync_round(self, step: int) -> SyncResult | None:
        """The round of step `step`, if any: a sync step's (its weights checked finite before they leave), or an
        overlapped round landing now. A node that had fallen behind continues at the round's step."""
        if self.syncer is None:
            return None
        if self.syncer.syncs_at(step):
            check_weights_finite(
                self.model,
                f"not uploading the weights of step {step}",
                "the server keeps the last good round; resume from an earlier checkpoint",
            )
            synced: SyncResult | None = self.syncer.sync(step)
        else:  # an overlapped round lands at a fixed step, maybe between sync steps
            synced = self.syncer.land(step)
        if synced is not None:
            self.step = synced.step
        return synced

    def _record(self, step: int, metrics: dict[str, Any]) -> None:
        """Step `step`'s row: kept in the history, metrics.jsonl and the trackers."""
        self.history.append({"step": step, **metrics})
        self.metrics.write(step, metrics)
        self.trackers.log(step, metrics)

    def _save_due(self, step: int) -> None:
        """The checkpoints `save_interval` and `save_interval_unsharded` ask for at step `step`."""
        cfg = self.cfg
        if cfg.save_interval and step % cfg.save_interval == 0:
            self.save()
        if (
            cfg.save_interval_unsharded
            and step % cfg.save_interval_unsharded == 0
            and (self.last_saved != step or uses_fsdp(cfg, self.info))
        ):
            self.save(unsharded=True)

    def _throughput(self, step: int) -> dict[str, float]:
        """Tokens/s (of the training steps alone: OLMo's throughput), tokens so far, MFU (on a GPU of known peak)
        and the minutes left to `max_steps` (`SpeedMonitor.eta_minutes`)."""
        tps = self.speed.tokens_per_second()
        out = {"tokens_per_s": tps, "tokens": self.tokens}
        if self.peak is not None:
            out["mfu"] = tps / self.info.world_size * self.flops_per_token / self.peak
        peak_mb = peak_memory_mb(self.info)
        if peak_mb is not None:
            out["peak_gpu_mb"] = peak_mb
        if (eta := self.speed.eta_minutes(step, self.max_steps)) is not None:
            out["eta_min"] = eta
        return out

    @torch.no_grad()
    def evaluate(self) -> float:
        """Mean validation cross entropy over the validation batches (every rank runs the same batches)."""
        assert self.eval_batches is not None
        self.model.eval()
        total, count = torch.zeros((), device=self.info.device), 0
        for batch in self.eval_batches():
            batch = batch.to(self.info.device)
            with self.autocast:
                total += validation_loss(self.model, batch, self.cfg.fused_loss) * batch.shape[0]
            count += batch.shape[0]
        self.model.train()
        return float(total / max(count, 1))

    def save(self, unsharded: bool = False) -> None:
        """A checkpoint (a collective): sharded under FSDP, every rank writing its shards; else (or when
        `unsharded`) the whole state gathered to the main rank, which writes it."""
        cfg = self.cfg
        check_weights_finite(
            self.model,
            f"not saving the checkpoint of step {self.step}",
            f"the newest checkpoint in {cfg.save_folder} is kept; resume from it with a lower optimizer.learning_rate",
        )
        sharded = uses_fsdp(cfg, self.info) and not unsharded
        path = checkpoint.save(
            cfg.save_folder,
            self.step,
            self.model,
            self.optimizer,
            trainer_state=self.state_dict(),
            config=to_dict(cfg),
            sharded=sharded,
            keep=retention(self.cfg, uses_fsdp(self.cfg, self.info), unsharded),
            extra=self.syncer.checkpoint_files() if self.syncer is not None else None,
        )
        if path is not None:
            self.log(f"saved {'sharded ' if sharded else ''}checkpoint {path}")
        self.last_saved = self.step
