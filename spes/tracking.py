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
and downstream evaluations) is logged at its step; W&B also gets the resolved config. The dashboards also get
each metric OLMo (so the first SPES implementation) logged, under OLMo's name (`olmo_aliases`: e.g.
`train/CrossEntropyLoss`, `optim/learning_rate_group0`, `System/Peak GPU Memory (MB)`), so a dashboard built
for those runs shows spes runs unchanged.
"""

from __future__ import annotations

import math
import threading
from pathlib import Path
from typing import Any

from spes.atomic import room_for
from spes.config import TrainConfig
from spes.evaluators import TASK_NAMES
from spes.save_folder import free_space_fix
from spes.schema import ConfigError, to_dict

# Records holding these keys are logged even between `wandb.log_interval` steps (evaluations are rare).
_ALWAYS = ("val_", "merged_", "eval/")

OLMO_NAMES = {
    "ce": "train/CrossEntropyLoss",
    "lb_loss": "train/LoadBalancingLoss",
    "z_loss": "train/MoEZLoss",
    "lr": "optim/learning_rate_group0",
    "grad_norm": "optim/total_grad_norm",
    "tokens": "throughput/total_tokens",
    "peak_gpu_mb": "System/Peak GPU Memory (MB)",
    "val_loss": "eval/validation/CrossEntropyLoss",
    "val_ppl": "eval/validation/Perplexity",
}
"""spes metric -> the name OLMo logs the same quantity under (`z_loss` is the router z-loss, OLMo's MoEZLoss)."""
_OLMO_DOWNSTREAM_METRICS = {"acc": "acc", "acc_norm": "len_norm"}
_OLMO_LABELS = {task: label for label, task in TASK_NAMES.items()}


def olmo_aliases(metrics: dict[str, Any], world_size: int = 1) -> dict[str, float]:
    """The metrics of a record that OLMo also logged, under OLMo's names (what its dashboards chart).

    Derived ones: `train/Perplexity` = exp(ce), `throughput/device/tokens_per_second` = the node's tokens/s over
    its ranks, `train/TokensTotal|TokensPercentage/layer<l>/expert<e>` from `tokens_per_expert`, and downstream
    scores `eval/<task>/acc|acc_norm` as `eval/downstream/<label>_acc|len_norm`.
    """
    values = numeric(metrics)
    out = {OLMO_NAMES[k]: v for k, v in values.items() if k in OLMO_NAMES}
    if "ce" in values:
        out["train/Perplexity"] = math.exp(min(values["ce"], 50.0))
    if "tokens_per_s" in values:
        out["throughput/device/tokens_per_second"] = values["tokens_per_s"] / world_size
    for layer, counts in enumerate(metrics.get("tokens_per_expert") or []):
        total = sum(counts) or 1
        for expert, count in enumerate(counts):
            out[f"train/TokensTotal/layer{layer}/expert{expert}"] = float(count)
            out[f"train/TokensPercentage/layer{layer}/expert{expert}"] = 100.0 * count / total
    for key, value in values.items():
        parts = key.split("/")
        if len(parts) == 3 and parts[0] == "eval" and parts[2] in _OLMO_DOWNSTREAM_METRICS:
            label = _OLMO_LABELS.get(parts[1], parts[1])
            out[f"eval/downstream/{label}_{_OLMO_DOWNSTREAM_METRICS[parts[2]]}"] = value
    return out


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
                tags=w.tags,
                config=to_dict(cfg),
                dir=str(folder),
            )
        except wandb.errors.Error as err:  # e.g. no API key: a setup problem the user fixes, not a crash
            raise ConfigError(
                f"config key 'wandb' is set but W&B could not start: {err} (log in with `wandb login`, "
                f"or set WANDB_MODE=offline to log locally and `wandb sync` later)"
            ) from None

    def log(self, step: int, metrics: dict[str, float]) -> None:
        if step % self.log_interval == 0 or any(k.startswith(_ALWAYS) for k in metrics):
            self.run.log(metrics, step=step)

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
        self.key = "tensorboard.log_dir" if cfg.tensorboard.log_dir else "save_folder"
        with self._room():
            self.writer = SummaryWriter(log_dir=str(self.log_dir))
        _quiet_writer_threads()

    def log(self, step: int, metrics: dict[str, float]) -> None:
        with self._room():
            for key, value in metrics.items():
                if math.isfinite(value):
                    self.writer.add_scalar(key, value, global_step=step)
            self.writer.flush()  # NOTE: so a crash or a kill loses at most the line being written

    def close(self) -> None:
        with self._room():
            self.writer.close()

    def _room(self) -> Any:
        """A full disk under the event files as one line naming them (the writer's thread met it; `flush` raises it)."""
        return room_for(f"cannot write the TensorBoard event files in {self.log_dir}", free_space_fix(self.key))


def _quiet_writer_threads() -> None:
    """Leave the error of TensorBoard's writer thread to the call that raises it again (`flush`, named there as one
    line), instead of a thread traceback printed above that line; other threads' errors print as before.

    NOTE: the writer thread (`_AsyncWriterThread`) keeps what it raised in its `exception`, which the writer's next
    call raises in the caller's thread."""
    previous = threading.excepthook
    if getattr(previous, "spes_quiet_writers", False):
        return

    def hook(args: threading.ExceptHookArgs) -> None:
        writer = type(args.thread).__module__.startswith("tensorboard.")
        if not writer or args.exc_value is None or getattr(args.thread, "exception", None) is not args.exc_value:
            previous(args)

    hook.spes_quiet_writers = True  # type: ignore[attr-defined]
    threading.excepthook = hook


class Trackers:
    """The dashboards the config turns on (none by default); a no-op off the main rank."""

    def __init__(self, cfg: TrainConfig, enabled: bool, world_size: int = 1) -> None:
        self.world_size = world_size
        self.trackers: list[WandbTracker | TensorBoardTracker] = []
        if not enabled:
            return
        if cfg.wandb is not None:
            self.trackers.append(WandbTracker(cfg))
        if cfg.tensorboard is not None:
            self.trackers.append(TensorBoardTracker(cfg))

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        """A metrics record under spes's names and, beside them, OLMo's (`olmo_aliases`)."""
        if not self.trackers:
            return
        values = {**numeric(metrics), **olmo_aliases(metrics, self.world_size)}
        for tracker in self.trackers:
            tracker.log(step, values)

    def close(self) -> None:
        for tracker in self.trackers:
            tracker.close()
        self.trackers = []
