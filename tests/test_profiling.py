"""The profiler over training steps (`torch_profiling`): OLMo's schedule, the log's table and a gzipped Chrome trace
written whole; nothing at all when it is off."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest
import torch

from spes.profiling import ACTIVE, WAIT, WARMUP, step_profiler
from spes.train import main

REPO = Path(__file__).resolve().parents[1]


def trace_names(path: Path) -> set[str]:
    return {event.get("name", "") for event in json.loads(gzip.decompress(path.read_bytes()))["traceEvents"]}


def test_steps_7_to_9_of_the_process_are_profiled_and_named_by_the_training_step(tmp_path: Path) -> None:
    lines: list[str] = []
    x = torch.randn(64, 64)
    with step_profiler(True, tmp_path / "profiler", lines.append, torch.device("cpu")) as profiled:
        for step in range(101, 113):  # a run resumed at step 100
            torch.mm(x, x)
            profiled(step)
    first = 100 + WAIT + WARMUP + 1
    assert (first, WAIT + WARMUP + ACTIVE) == (107, 9)
    trace = tmp_path / "profiler" / "steps107-109.chrome_trace.json.gz"
    assert [p.name for p in (tmp_path / "profiler").iterdir()] == [trace.name]  # no temporary file left
    assert "aten::mm" in trace_names(trace)
    assert lines[0].startswith("profile of steps 107-109, by own time:\n") and "aten::mm" in lines[0]
    assert lines[1:] == [f"profiler trace written to {trace}"]


def test_a_run_that_ends_inside_the_recorded_steps_names_those_it_recorded(tmp_path: Path) -> None:
    lines: list[str] = []
    with step_profiler(True, tmp_path, lines.append, torch.device("cpu")) as profiled:
        for step in range(1, WAIT + WARMUP + 3):  # steps 1 to 8: the run ends after the second recorded one
            profiled(step)
    assert lines[-1] == f"profiler trace written to {tmp_path / 'steps7-8.chrome_trace.json.gz'}"


def test_a_trace_that_cannot_be_written_leaves_the_run_going(tmp_path: Path) -> None:
    (tmp_path / "profiler").write_text("a file where the folder should be")
    lines: list[str] = []
    with step_profiler(True, tmp_path / "profiler", lines.append, torch.device("cpu")) as profiled:
        for step in range(1, 13):
            profiled(step)
    assert lines[-1].startswith("profiler trace not written (") and lines[-1].endswith("): training goes on")


def test_off_it_never_starts(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.profiler, "profile", None)  # starting one would fail
    with step_profiler(False, tmp_path / "profiler", print, torch.device("cpu")) as profiled:
        for step in range(1, 20):
            profiled(step)
    assert not (tmp_path / "profiler").exists()


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_training_run_with_torch_profiling_writes_its_trace(
    tiny_corpus, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:  # type: ignore[no-untyped-def]
    args = [
        str(REPO / "configs" / "tiny.yaml"),
        "--using_spes=false",
        *tiny_corpus.overrides(tmp_path / "run"),
        "--max_duration=10st",
        "--save_interval=null",
        "--torch_profiling=true",
    ]
    assert main(args) == 0
    trace = tmp_path / "run" / "profiler" / "steps7-9.chrome_trace.json.gz"
    assert "ProfilerStep#8" in trace_names(trace)
    assert "profile of steps 7-9, by own time:" in capsys.readouterr().out


@pytest.mark.gpu
def test_on_a_gpu_the_table_is_by_device_time_and_the_trace_holds_kernels(tmp_path: Path) -> None:
    lines: list[str] = []
    x = torch.randn(512, 512, device="cuda")
    with step_profiler(True, tmp_path, lines.append, torch.device("cuda")) as profiled:
        for step in range(1, WAIT + WARMUP + ACTIVE + 1):
            torch.mm(x, x)
            profiled(step)
    assert "Self CUDA" in lines[0]
    events = json.loads(gzip.decompress((tmp_path / "steps7-9.chrome_trace.json.gz").read_bytes()))["traceEvents"]
    assert any(event.get("cat") == "kernel" for event in events)
