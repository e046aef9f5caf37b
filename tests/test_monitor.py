"""Console line, throughput window and JSONL metrics."""

from __future__ import annotations

import errno
import json
import math
from pathlib import Path

import pytest
import torch

from spes import monitor
from spes.atomic import OutOfRoom
from spes.distributed import DistInfo
from spes.monitor import MetricsLog, SpeedMonitor, clock, format_line, peak_flops, peak_memory_mb, progress_bar


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


def test_console_line_formats_every_metric_it_knows() -> None:
    metrics = {
        "loss": 2.123456,
        "ce": 2.0,
        "lb_loss": 0.0123456,
        "z_loss": 0.000123456,
        "lr": 0.00012345,
        "grad_norm": 1.23456,
        "tokens_per_s": 1234567.8,
        "mfu": 0.18537,
        "peak_gpu_mb": 14249.2,
        "val_loss": 3.0,
        "val_ppl": 20.0855,
        "merged_val_loss": 2.9,
        "sync_s": 1.234,
        "sync_wait_s": 0.5,
        "sync_upload_s": 0.25,
        "sync_publish_s": 0.125,
        "sync_download_s": 2.0,
        "sync_mb_up": 70.56,
        "sync_mb_down": 188.0,
        "merge_alpha": 0.04567,
        "eta_min": 72.345,
    }
    assert format_line(1, 1, {**metrics, "merged": True}) == (
        "step 1/1 [####################] 100% | loss 2.1235 | ce 2.0000 | lb_loss 0.0123 | z_loss 0.00012 | "
        "lr 1.23e-04 | grad_norm 1.235 | tokens_per_s 1,234,568 | mfu 18.5% | peak_gpu_mb 14,249 | val_loss 3.0000 | "
        "val_ppl 20.09 | merged_val_loss 2.9000 | sync_s 1.23 | sync_wait_s 0.50 | sync_upload_s 0.25 | "
        "sync_publish_s 0.12 | sync_download_s 2.00 | sync_mb_up 70.6 | sync_mb_down 188.0 | merge_alpha 0.046 | "
        "eta 1:12:21"
    )
    assert "merge_alpha" not in format_line(1, 1, {**metrics, "merged": False})  # a round without the warm-up
    nan = format_line(1, 1, {**dict.fromkeys(metrics, math.nan), "merged": True})  # a diverged step as it is
    names = [key if key != "eta_min" else "eta" for key in metrics]
    assert nan.split(" | ")[1:] == [f"{key} {'nan%' if key == 'mfu' else 'nan'}" for key in names]


def test_a_launch_cut_short_counts_the_runs_steps_and_says_where_it_stops() -> None:
    """With stop_at 6 of a 12-step run the line reads 6/12, as the lr and schedules do, not 6/6 (100%)."""
    assert format_line(6, 12, {}, stop=6) == "step 6/12 [##########..........]  50% (stop_at 6)"
    assert format_line(6, 12, {}, stop=12) == format_line(6, 12, {}) == "step 6/12 [##########..........]  50%"


@pytest.mark.parametrize(
    ("minutes", "shown"), [(0.04, "0:00:02"), (0.0, "0:00:00"), (59.999, "1:00:00"), (1501.5, "25:01:30")]
)
def test_the_eta_reads_as_a_clock_down_to_the_second(minutes: float, shown: str) -> None:
    """A short run's ETA was `eta_min 0.0` from start to end; a long run's reads in hours."""
    assert clock(minutes) == shown
    assert format_line(1, 2, {"eta_min": minutes}).endswith(f" | eta {shown}")


def test_a_run_of_one_step_fills_its_bar() -> None:
    assert progress_bar(1, 1, width=4) == "[####] 100%" and progress_bar(0, 0, width=2) == "[..]   0%"


def test_speed_under_a_second_of_samples_is_still_a_rate() -> None:
    speed = SpeedMonitor(window=4)
    speed.record(100, 0.25)
    assert speed.tokens_per_second() == 400.0


def test_metrics_rows_carry_the_seconds_since_the_log_began(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    clock = iter([1000.0, 1012.34567])
    monkeypatch.setattr(monitor.time, "time", lambda: next(clock))
    log = MetricsLog(tmp_path / "a" / "b", enabled=True)  # a save folder not made yet
    log.write(7, {"loss": 1.0})
    assert json.loads(log.path.read_text()) == {"step": 7, "time": 12.346, "loss": 1.0}


@pytest.mark.parametrize(
    ("name", "peak"),
    [
        ("NVIDIA H100 80GB HBM3", 989e12),
        ("NVIDIA A100-SXM4-80GB", 312e12),
        ("NVIDIA A10", 125e12),
        ("NVIDIA L40S", 362e12),  # not the L4's: the longest product name the device's contains
        ("NVIDIA L4", 121e12),
        ("Tesla T4", None),
    ],
)
def test_the_mfu_peak_is_the_datasheet_figure_of_the_devices_product(
    name: str, peak: float | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On CPU through a stand-in for the CUDA device's name (the only thing `peak_flops` reads of it)."""
    asked = []
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device: asked.append(device) or name)
    assert peak_flops(torch.device("cuda", 1)) == peak and asked == [torch.device("cuda", 1)]


@pytest.mark.gpu
def test_peak_gpu_memory_is_the_allocators_peak_in_megabytes() -> None:
    device = torch.device("cuda")
    torch.cuda.reset_peak_memory_stats(device)
    block = torch.empty(50_000_000, dtype=torch.uint8, device=device)
    peak = peak_memory_mb(DistInfo(rank=0, world_size=1, local_rank=0, device=device))
    assert peak == torch.tensor(torch.cuda.max_memory_allocated(device) / 1e6).item() and 50 <= peak < 1000
    del block


def test_the_eta_is_paced_by_the_wall_clock_since_the_launch_began() -> None:
    """Steps 10 to 20 took 50 s with everything between them (rounds, evaluations): 30 steps more take 150 s."""
    speed = SpeedMonitor(window=4)
    assert speed.eta_minutes(20, 50) is None  # not started
    speed.start(10, now=100.0)
    assert speed.eta_minutes(10, 50, now=120.0) is None  # no step done yet in this launch
    assert speed.eta_minutes(20, 50, now=150.0) == 150 / 60
    assert speed.eta_minutes(60, 50, now=150.0) == 0.0
    running = SpeedMonitor(window=4)  # as the trainer calls it: by the monotonic clock
    running.start(10)
    assert 0 <= running.eta_minutes(11, 50) < 1


@pytest.mark.skipif(not Path("/dev/full").exists(), reason="needs Linux's /dev/full")
def test_a_metrics_row_that_finds_the_disk_full_fails_in_one_line_naming_the_file(tmp_path: Path) -> None:
    """A real ENOSPC without a full disk: metrics.jsonl is /dev/full, where every write finds no room. The run ends in
    one line naming the file and what to do (it was `OSError: [Errno 28] No space left on device`, naming neither)."""
    log = MetricsLog(tmp_path, enabled=True)
    log.path.symlink_to("/dev/full")
    with pytest.raises(OutOfRoom) as caught:
        log.write(7, {"loss": 1.5})
    assert caught.value.errno == errno.ENOSPC
    assert str(caught.value) == (
        f"cannot append step 7 to {log.path}: no space left on device; free space on that disk or point save_folder "
        "at another one, then continue with --resume=auto"
    )
