"""Training metrics: a windowed throughput meter, one readable console line per log step, and JSONL on disk.

Kept apart from the trainer loop (OLMo-core's callbacks in spirit): the loop hands over a dict of
numbers, this module formats and stores them.
"""

from __future__ import annotations

import json
import math
import time
from collections import deque
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from spes.atomic import room_for, write_atomic
from spes.save_folder import free_space_fix

if TYPE_CHECKING:
    from spes.distributed import DistInfo

PEAK_BF16_FLOPS = {
    "H100": 989e12,
    "H200": 989e12,
    "H800": 989e12,
    "A100": 312e12,
    "A800": 312e12,
    "L40S": 362e12,
    "L4": 121e12,
    "A10": 125e12,
    "A6000": 155e12,
    "B200": 2250e12,
}
"""Dense bf16 peak FLOP/s per GPU by product name (vendor datasheets, SXM parts), for MFU."""


def peak_flops(device: torch.device) -> float | None:
    """The datasheet bf16 peak of a CUDA device (the longest product name its name contains), None if unknown."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((v for k, v in sorted(PEAK_BF16_FLOPS.items(), key=lambda kv: -len(kv[0])) if k in name), None)


def peak_memory_mb(info: DistInfo) -> float | None:
    """Peak GPU memory allocated so far, in MB (10^6 bytes), the most of the node's ranks (OLMo's
    `System/Peak GPU Memory (MB)`); None on a CPU. A collective on a GPU node: every rank calls it."""
    if info.device.type != "cuda":
        return None
    peak = torch.tensor(torch.cuda.max_memory_allocated(info.device) / 1e6, device=info.device)
    if info.world_size > 1:
        dist.all_reduce(peak, op=dist.ReduceOp.MAX)
    return float(peak.item())


class SpeedMonitor:
    """Tokens/s over the last `window` steps (excluding time spent in sync and evaluation), and the pace of the
    whole launch for its ETA."""

    def __init__(self, window: int) -> None:
        self.samples: deque[tuple[int, float]] = deque(maxlen=window)
        self.paced_from: tuple[float, int] | None = None
        """(`time.monotonic()`, step) where this launch began training (`start`)."""

    def start(self, step: int, now: float | None = None) -> None:
        self.paced_from = (time.monotonic() if now is None else now, step)

    def record(self, tokens: int, seconds: float) -> None:
        self.samples.append((tokens, seconds))

    def tokens_per_second(self) -> float:
        seconds = sum(s for _, s in self.samples)
        return sum(t for t, _ in self.samples) / seconds if seconds > 0 else 0.0

    def eta_minutes(self, step: int, last: int, now: float | None = None) -> float | None:
        """Minutes from `step` to `last` at the pace since `start` (None before a step past it): by the wall clock,
        so the rounds, evaluations and checkpoints to come count too, which tokens/s leaves out."""
        if self.paced_from is None or step <= self.paced_from[1]:
            return None
        started, first = self.paced_from
        now = time.monotonic() if now is None else now
        return max(last - step, 0) * (now - started) / (step - first) / 60


def progress_bar(done: int, total: int, width: int = 20) -> str:
    filled = int(width * done / max(total, 1))
    return "[" + "#" * filled + "." * (width - filled) + f"] {100 * done / max(total, 1):3.0f}%"


def clock(minutes: float) -> str:
    """`minutes` as H:MM:SS, what an ETA reads as (a run of hours, or of seconds)."""
    seconds = round(minutes * 60)
    return f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"


FORMATS = {
    "loss": ".4f",
    "ce": ".4f",
    "lb_loss": ".4f",
    "z_loss": ".5f",
    "lr": ".2e",
    "grad_norm": ".3f",
    "tokens_per_s": ",.0f",
    "mfu": ".1%",
    "peak_gpu_mb": ",.0f",
    "val_loss": ".4f",
    "val_ppl": ".2f",
    "merged_val_loss": ".4f",
    "sync_s": ".2f",
    "sync_wait_s": ".2f",
    "sync_upload_s": ".2f",
    "sync_publish_s": ".2f",
    "sync_download_s": ".2f",
    "sync_mb_up": ".1f",
    "sync_mb_down": ".1f",
    "merge_alpha": ".3f",
}
"""The metrics the console line shows, in its order, each under its metrics.jsonl name with its format."""


def format_line(step: int, total: int, metrics: dict[str, Any], stop: int | None = None) -> str:
    """`step 120/1000 [##.....]  12% | loss 5.4321 | ... | eta 0:12:34` from whatever metrics are present: the
    bar counts the run's `total` steps, a launch that ends before them (`stop_at`) says where; the merge warm-up's
    alpha only on the rounds it ran (`merged`); `eta_min` as H:MM:SS."""
    head = f"step {step}/{total} {progress_bar(step, total)}"
    parts = [head if stop is None or stop >= total else f"{head} (stop_at {stop})"]
    for key, spec in FORMATS.items():
        if metrics.get(key) is not None and (key != "merge_alpha" or metrics.get("merged")):
            parts.append(f"{key} {format(metrics[key], spec)}")
    eta = metrics.get("eta_min")
    if eta is not None:
        parts.append(f"eta {clock(eta) if math.isfinite(eta) else eta}")
    return " | ".join(parts)


class MetricsLog:
    """Appends one JSON object per logged step to `<save_folder>/metrics.jsonl` (main rank only)."""

    def __init__(self, folder: str | Path, enabled: bool) -> None:
        self.enabled = enabled
        self.path = Path(folder) / "metrics.jsonl"
        if enabled:
            self.path.parent.mkdir(parents=True, exist_ok=True)
        self.start = time.time()

    def write(self, step: int, metrics: dict[str, Any]) -> None:
        if not self.enabled:
            return
        record = {"step": step, "time": round(time.time() - self.start, 3), **metrics}
        with (
            room_for(f"cannot append step {step} to {self.path}", free_space_fix("save_folder")),
            open(self.path, "a") as f,
        ):
            f.write(json.dumps(record) + "\n")  # NOTE: a row a full disk cuts short is dropped by a resume's truncate

    def truncate(self, step: int) -> None:
        """Drop the rows past `step`: a resumed (or restarted) run logs those steps again, each step once."""
        if not self.enabled or not self.path.is_file():
            return
        lines = self.path.read_text().splitlines(keepends=True)
        kept = [ln for ln in lines if _step_of(ln) <= step]
        if len(kept) != len(lines):
            write_atomic(self.path, "".join(kept))


def _step_of(line: str) -> float:
    """The step of a metrics row; a row cut short by a kill counts as past every step (it is dropped)."""
    try:
        return json.loads(line)["step"]
    except (ValueError, KeyError, TypeError):
        return math.inf
