"""Console line, throughput window and JSONL metrics."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from spes.distributed import DistInfo
from spes.monitor import MetricsLog, SpeedMonitor, format_line, peak_flops, peak_memory_mb, progress_bar


def test_console_line_shows_present_metrics_in_a_fixed_order() -> None:
    line = format_line(5, 20, {"lr": 1e-3, "loss": 2.5, "tokens_per_s": 12345.6, "val_loss": None, "other": 1})
    assert line.startswith("step 5/20 [#####...............]  25%")
    assert line.index("loss 2.5000") < line.index("lr 1.00e-03") < line.index("tokens_per_s 12,346")
    assert "val_loss" not in line and "other" not in line


def test_progress_bar_bounds() -> None:
    assert progress_bar(0, 10, width=4) == "[....]   0%"
    assert progress_bar(10, 10, width=4) == "[####] 100%"


def test_speed_window_keeps_the_last_steps() -> None:
    speed = SpeedMonitor(window=2)
    for tokens, seconds in ((100, 10.0), (100, 1.0), (300, 1.0)):
        speed.record(tokens, seconds)
    assert speed.tokens_per_second() == 200.0
    assert SpeedMonitor(window=3).tokens_per_second() == 0.0


def test_metrics_jsonl_only_on_the_main_rank(tmp_path: Path) -> None:
    MetricsLog(tmp_path / "main", enabled=True).write(3, {"loss": 1.5})
    MetricsLog(tmp_path / "other", enabled=False).write(3, {"loss": 1.5})
    record = json.loads((tmp_path / "main" / "metrics.jsonl").read_text())
    assert record["step"] == 3 and record["loss"] == 1.5
    assert not (tmp_path / "other").exists()


def test_no_mfu_peak_and_no_gpu_memory_on_cpu() -> None:
    assert peak_flops(torch.device("cpu")) is None
    assert peak_memory_mb(DistInfo(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"))) is None


def test_truncate_keeps_each_step_once_after_a_resume(tmp_path: Path) -> None:
    log = MetricsLog(tmp_path, enabled=True)
    for step in range(1, 8):
        log.write(step, {"loss": float(step)})
    with open(log.path, "a") as f:
        f.write('{"step": 8, "lo')  # a row cut short by a kill
    log.truncate(5)  # resumed from the checkpoint of step 5
    for step in range(6, 9):
        log.write(step, {"loss": -float(step)})
    rows = [json.loads(line) for line in log.path.read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, 9))
    assert [r["loss"] for r in rows[4:6]] == [5.0, -6.0]
    MetricsLog(tmp_path / "fresh", enabled=True).truncate(0)  # nothing written yet: nothing to do
