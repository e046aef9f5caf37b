"""Experiment dashboards: Weights & Biases and TensorBoard, fed the same records as `metrics.jsonl`.

Both are optional extras (`pip install -e '.[wandb]'`, `'.[tensorboard]'`), imported only when the
config asks for them and only on the main rank:

    wandb:                      # W&B run named/grouped as here; WANDB_MODE=offline works with no account
      project: spes
      name: ${run_name}-node${spes_config.peer_id}
      group: ${run_name}
    tensorboard:                # event files in <save_folder>/tensorboard unless log_dir is set
      log_dir: null

Every numeric metric the trainer writes to `metrics.jsonl` (losses, lr, throughput, sync, validation
and downstream evaluations) is logged at its step; W&B also gets the resolved config.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from spes.config import ConfigError, TrainConfig, to_dict

# Records holding these keys are logged even between `wandb.log_interval` steps (evaluations are rare).
_ALWAYS = ("val_", "merged_", "eval/")


def _missing_extra(key: str, package: str, extra: str) -> ConfigError:
    return ConfigError(
        f"config key '{key}' is set but the {package} package is not installed: "
        f"pip install -e '.[{extra}]' (or remove '{key}' from the config)"
    )


def numeric(metrics: dict[str, Any]) -> dict[str, float]:
    """The numbers of a metrics record as floats (bools, strings and containers dropped)."""
    return {k: float(v) for k, v in metrics.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}


class WandbTracker:
    """One W&B run per node; its files go to `<save_folder>/wandb`."""

    def __init__(self, cfg: TrainConfig) -> None:
        assert cfg.wandb is not None
        try:
            import wandb
        except ImportError:
            raise _missing_extra("wandb", "wandb", "wandb") from None
        w = cfg.wandb
        folder = Path(cfg.save_folder)
        folder.mkdir(parents=True, exist_ok=True)
        self.log_interval = max(1, w.log_interval)
        try:
            self.run = wandb.init(
                project=w.project or "spes",
                entity=w.entity,
                name=w.name or cfg.run_name,
                group=w.group,
                config=to_dict(cfg),
                dir=str(folder),
            )
        except wandb.errors.Error as err:  # e.g. no API key: a setup problem the user fixes, not a crash
            raise ConfigError(
                f"config key 'wandb' is set but W&B could not start: {err} (log in with `wandb login`, "
                f"or set WANDB_MODE=offline to log locally and `wandb sync` later)"
            ) from None

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        if step % self.log_interval == 0 or any(k.startswith(_ALWAYS) for k in metrics):
            self.run.log(numeric(metrics), step=step)

    def close(self) -> None:
        self.run.finish()


class TensorBoardTracker:
    """Scalars under their metric names in `<save_folder>/tensorboard` (or `tensorboard.log_dir`)."""

    def __init__(self, cfg: TrainConfig) -> None:
        assert cfg.tensorboard is not None
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:
            raise _missing_extra("tensorboard", "tensorboard", "tensorboard") from None
        self.log_dir = Path(cfg.tensorboard.log_dir or Path(cfg.save_folder) / "tensorboard")
        self.writer = SummaryWriter(log_dir=str(self.log_dir))

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        for key, value in numeric(metrics).items():
            if math.isfinite(value):
                self.writer.add_scalar(key, value, global_step=step)
        self.writer.flush()  # NOTE: so a crash or a kill loses at most the line being written

    def close(self) -> None:
        self.writer.close()


class Trackers:
    """The dashboards the config turns on (none by default); a no-op off the main rank."""

    def __init__(self, cfg: TrainConfig, enabled: bool) -> None:
        self.trackers: list[WandbTracker | TensorBoardTracker] = []
        if not enabled:
            return
        if cfg.wandb is not None:
            self.trackers.append(WandbTracker(cfg))
        if cfg.tensorboard is not None:
            self.trackers.append(TensorBoardTracker(cfg))

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        for tracker in self.trackers:
            tracker.log(step, metrics)

    def close(self) -> None:
        for tracker in self.trackers:
            tracker.close()
        self.trackers = []
