"""How fast a node trains: its optimizer step timed as `spes.train` runs it, in tokens/s and MFU, and the
host-device synchronizations of the step counted.

One measurement for every caller, so their figures agree: `bench/bench_gpu.py` (the GPU benchmark's record)
and `python -m spes.preflight --gpu` (a node's own check) both build the node with `build_timed_node`, time it
with `time_steps` and turn the times into figures with `step_figures`.

A step of the config's global batch can take many seconds (the 1B node: 32 micro-batches of 8 x 2,048 tokens),
so steps of a few micro-batches are timed instead, at two sizes, and the config's step is projected from the
line through them: `fixed_s + per_micro_batch_s x micro-batches` (fixed: clipping, the optimizer step, the
one sync). The micro-batches keep the config's shape, so the kernels are the ones a real step runs.
"""

from __future__ import annotations

import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from spes.config import TrainConfig
from spes.distributed import DistInfo, parallelize
from spes.gc_schedule import scheduled_collection
from spes.model import Transformer, tflops_done_per_token, tflops_per_token
from spes.moe import ExpertBlocks
from spes.monitor import peak_flops
from spes.optim import build_optimizer
from spes.trainer import Trainer

TORCH_DIR = Path(torch.__file__).resolve().parent
TORCH_WRAPPERS = {str(TORCH_DIR / f) for f in ("_tensor.py", "functional.py", "nn/functional.py", "overrides.py")}
"""torch's Python wrappers of its functions: a call through them is the caller's."""
SPES_DIR = str(Path(__file__).resolve().parent)
_PASSED = TORCH_WRAPPERS | {__file__}
"""Frames between a counted call and its caller: the counter's own, and torch's wrappers."""
_T = torch.Tensor
SYNCING = {
    _T.item: "item",
    _T.tolist: "tolist",
    _T.__bool__: "bool",
    _T.__int__: "int",
    _T.__float__: "float",
    _T.__index__: "index",
    _T.cpu: "cpu",
    _T.numpy: "numpy",
    _T.nonzero: "nonzero",
    torch.nonzero: "nonzero",
    _T.bincount: "bincount",
    torch.bincount: "bincount",
    _T.unique: "unique",
    torch.unique: "unique",
    _T.masked_select: "masked_select",
    torch.masked_select: "masked_select",
}
"""Calls that make the host wait for the device on CUDA: a value read back, or an output whose shape depends on
the data (bincount reads its largest input back)."""


class SyncCounter(TorchFunctionMode):
    """Counts the calls that would synchronize host and device on CUDA, made directly by spes code.

    A test double for CUDA's sync debug mode that runs on the CPU, where nothing synchronizes: it intercepts
    torch calls at the Python level and records each call of a `SYNCING` function whose caller lives in the
    spes package (a call torch's own code makes, such as AdamW reading its step counter, which lives on the CPU,
    is left out).
    `events` lists them as (file:line, call).
    """

    def __init__(self) -> None:
        super().__init__()
        self.events: list[tuple[str, str]] = []

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        name = SYNCING.get(func)
        if name is not None and (where := _spes_caller()) is not None:
            self.events.append((where, name))
        return func(*args, **(kwargs or {}))


def _spes_caller() -> str | None:
    """`file:line` of the code that made the call (past this module's frames and torch's thin Python wrappers), if
    it is spes code."""
    frame = sys._getframe(1)
    while frame is not None and frame.f_code.co_filename in _PASSED:
        frame = frame.f_back  # type: ignore[assignment]
    if frame is None or not frame.f_code.co_filename.startswith(SPES_DIR):
        return None
    return f"{Path(frame.f_code.co_filename).name}:{frame.f_lineno}"


def build_timed_node(cfg: TrainConfig, device: torch.device) -> Trainer:
    """The node of one process as `spes.train` builds it (model on meta, weights, activation checkpointing and
    compile as configured, AdamW over its trainable parameters) and its trainer, without data or a server.
    `cfg.save_folder` must be a scratch folder (the trainer's metrics log lives there)."""
    cfg = cfg.on_device(device.type)
    with torch.device("meta"):
        model = Transformer.for_run(cfg, training=True)
    model.to_empty(device=device)
    model.init_weights(cfg.seed)
    info = DistInfo(rank=0, world_size=1, local_rank=0, device=device)
    model = parallelize(model, cfg, info)  # type: ignore[assignment]
    return Trainer(
        cfg=cfg,
        model=model,
        optimizer=build_optimizer(model, cfg.optimizer),
        loader=None,  # type: ignore[arg-type]  # train_step is given its batches
        info=info,
        log=lambda _line: None,
    )


def random_batch(cfg: TrainConfig, sequences: int, seed: int = 0) -> torch.Tensor:
    """`sequences` windows of random token ids below the vocabulary (the step's cost does not depend on them)."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, cfg.model.vocab_size, (sequences, cfg.model.max_sequence_length + 1), generator=gen)


def timed_step(trainer: Trainer, batch: torch.Tensor) -> float:
    """Seconds of one `Trainer.train_step`, the device's queue drained before and after."""
    device = trainer.info.device
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    started = time.perf_counter()
    trainer.train_step(batch)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - started


@dataclass
class StepTimes:
    """Timed steps by micro-batches per step, and the peak device memory over them (None on the CPU)."""

    micro_batch: int
    seconds: dict[int, list[float]] = field(default_factory=dict)
    warmup_seconds: list[float] = field(default_factory=list)
    peak_memory_bytes: int | None = None

    def fit(self) -> tuple[float, float]:
        """(fixed_s, per_micro_batch_s): the line through the medians of the smallest and largest step."""
        lo, hi = min(self.seconds), max(self.seconds)
        t_lo, t_hi = statistics.median(self.seconds[lo]), statistics.median(self.seconds[hi])
        if hi == lo or t_hi <= t_lo:  # NOTE: one size, or noise larger than the difference: no fixed part
            return 0.0, t_hi / hi
        per_micro = (t_hi - t_lo) / (hi - lo)
        return max(t_lo - lo * per_micro, 0.0), per_micro

    def projected_step_s(self, micro_batches: int) -> float:
        fixed, per_micro = self.fit()
        return fixed + per_micro * micro_batches


def time_steps(
    trainer: Trainer,
    batch_of: Callable[[int], torch.Tensor],
    micro_batches: tuple[int, ...] = (1, 4),
    steps: int = 5,
    warmup: int = 2,
) -> StepTimes:
    """Time `steps` steps of each number of `micro_batches` (after `warmup` steps of the largest: first-call
    allocations, AdamW's state, compilation); `batch_of(n)` gives a batch of n sequences. The garbage collector
    runs as in `Trainer.fit` (`gen1_gc_interval`), between the timed steps."""
    mb = trainer.cfg.device_train_microbatch_size
    device = trainer.info.device
    times = StepTimes(micro_batch=mb)
    with scheduled_collection(trainer.cfg.gen1_gc_interval) as collect:

        def step(batch: torch.Tensor) -> float:
            seconds = timed_step(trainer, batch)
            collect(trainer.step)
            return seconds

        times.warmup_seconds = [step(batch_of(max(micro_batches) * mb)) for _ in range(warmup)]
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        for m in micro_batches:
            batch = batch_of(m * mb)
            times.seconds[m] = [step(batch) for _ in range(steps)]
    if device.type == "cuda":
        times.peak_memory_bytes = torch.cuda.max_memory_allocated(device)
    return times


@torch.no_grad()
def trained_expert_share(trainer: Trainer, batch: torch.Tensor) -> float:
    """The share of routed token copies that land on experts this node trains, from one forward of `batch`."""
    owned = trainer.cfg.owned_experts()
    if owned is None:
        return 1.0
    batch = batch.to(trainer.info.device)
    with trainer.autocast:
        # NOTE: given the labels, the model's head computes loss sums a chunk at a time instead of the logits
        counts_LE = trainer.model(batch[:, :-1], batch[:, 1:]).tokens_per_expert
    return float(counts_LE[:, owned[0] : owned[1]].sum() / counts_LE.sum())


def moe_backend_of(model: torch.nn.Module) -> str:
    """The backend the model's experts compute with (`auto` resolved)."""
    experts = next(m for m in model.modules() if isinstance(m, ExpertBlocks))
    return experts._resolved or experts.backend


def step_figures(cfg: TrainConfig, times: StepTimes, device: torch.device, share: float) -> dict[str, Any]:
    """Tokens/s and MFU of the config's whole step (projected from `times`), by `tflops_per_token` and by the
    FLOPs done (frozen experts skip their weight gradients: `share` of the routed copies are trained)."""
    mb = cfg.device_train_microbatch_size
    num_micro = cfg.global_train_batch_size // mb
    tokens = num_micro * mb * cfg.model.max_sequence_length
    fixed, per_micro = times.fit()
    step_s = times.projected_step_s(num_micro)
    largest = max(times.seconds)
    measured_s = statistics.median(times.seconds[largest])
    spread = (max(times.seconds[largest]) - min(times.seconds[largest])) / measured_s
    tps = tokens / step_s
    flops, done = tflops_per_token(cfg.model) * 1e12, tflops_done_per_token(cfg.model, share) * 1e12
    out: dict[str, Any] = {
        "micro_batch": mb,
        "micro_batches_per_step": num_micro,
        "tokens_per_step": tokens,
        "step_s": step_s,
        "fixed_s": fixed,
        "per_micro_batch_s": per_micro,
        "tokens_per_s": tps,
        "measured_micro_batches": largest,
        "measured_step_s": measured_s,
        "measured_tokens_per_s": largest * mb * cfg.model.max_sequence_length / measured_s,
        "timed_steps_s": {str(m): s for m, s in times.seconds.items()},
        "timed_spread": spread,  # (slowest - fastest) / median of the largest steps: how far one timing is to trust
        "warmup_s": times.warmup_seconds,
        "tflops_per_token": flops / 1e12,
        "trained_expert_share": share,
        "tflops_done_per_token": done / 1e12,
        "achieved_tflops": tps * flops / 1e12,
        "peak_memory_bytes": times.peak_memory_bytes,
    }
    peak = peak_flops(device)
    if peak is not None:
        out.update(peak_tflops=peak / 1e12, mfu=tps * flops / peak, mfu_done=tps * done / peak)
    return out


def describe(figures: dict[str, Any]) -> str:
    """One line of `step_figures`: the projected step, tokens/s and MFU."""
    mfu = (
        f", MFU {figures['mfu']:.1%} by tflops_per_token ({figures['mfu_done']:.1%} of the FLOPs done, "
        f"{figures['trained_expert_share']:.0%} of routed copies trained; peak {figures['peak_tflops']:,.0f} TFLOP/s)"
        if "mfu" in figures
        else f", {figures['achieved_tflops']:.3g} TFLOP/s by tflops_per_token"
    )
    return (
        f"{figures['tokens_per_s']:,.0f} tokens/s for a step of {figures['micro_batches_per_step']} micro-batches of "
        f"{figures['micro_batch']} ({figures['step_s']:.3g} s: {figures['per_micro_batch_s']:.3g} s per micro-batch "
        f"+ {figures['fixed_s']:.3g} s){mfu}"
    )
