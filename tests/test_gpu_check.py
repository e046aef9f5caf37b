"""The GPU smoke test: its one line without CUDA, and its checks run for real on the CPU (gloo stands in for
NCCL), so the code a GPU node runs first is exercised here too."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from dist_helpers import run_ranks
from spes.config import TrainConfig, load_config
from spes.distributed import DistInfo
from spes.gpu_check import check_all_reduce, check_block, check_fsdp, check_step, main

REPO = Path(__file__).resolve().parents[1]
SMALL = [
    "--model.d_model=32",
    "--model.n_heads=2",
    "--model.mlp_hidden_size=64",
    "--model.max_sequence_length=16",
    "--model.vocab_size=256",
    "--model.embedding_size=256",
    "--device_train_microbatch_size=2",
]


def small_config() -> TrainConfig:
    cfg, _ = load_config(REPO / "configs" / "tiny.yaml", SMALL)
    return cfg


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message of a machine without CUDA")
def test_without_cuda_it_says_so_in_one_line_and_checks_nothing(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(None, []) == 0
    out = capsys.readouterr().out.strip().splitlines()
    assert len(out) == 1 and out[0].startswith("gpu: no CUDA device")


def test_the_block_smoke_measures_tokens_per_second_and_mfu() -> None:
    check = check_block(small_config(), torch.device("cpu"))
    assert check.status == "ok", check
    assert "tokens/s" in check.detail and "MFU" in check.detail and "micro-batch 2 x 16" in check.detail
    assert "compiled" not in check.detail


def test_the_step_check_reports_the_benchmarks_figures(tmp_path: Path) -> None:
    """The node's step timed by spes.speed, as bench/bench_gpu.py times it: tokens/s of the config's whole step."""
    cfg = small_config()
    cfg.save_folder = str(tmp_path)
    check = check_step(cfg, torch.device("cpu"), world=1)
    assert check.status == "ok", check
    assert "tokens/s for a step of 8 micro-batches of 2" in check.detail and "backend torch" in check.detail
    assert check_step(cfg, torch.device("cpu"), world=2).status == "skip"


@pytest.mark.timeout(120)
def test_the_block_smoke_compiles_the_block_when_the_config_does() -> None:
    cfg = small_config()
    cfg.compile = {"backend": "eager"}  # NOTE: dynamo's tracing without Inductor's code generation: seconds on a CPU
    check = check_block(cfg, torch.device("cpu"))
    assert check.status == "ok", check
    assert "one compiled block" in check.detail


def _ranks_worker(args: dict[str, Any], info: DistInfo) -> list[list[str]]:
    cfg = small_config()
    cfg.fused_loss = True  # as a CUDA GPU settles it (TrainConfig.on_device): the step takes the node's objective
    checks = [
        check_all_reduce(info.world_size, info.device, num_bytes=1 << 16),
        check_fsdp(cfg, info.world_size, info.rank, info.device),
    ]
    return [[c.status, c.detail] for c in checks]


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_all_reduce_and_one_fsdp2_step_across_ranks(tmp_path: Path) -> None:
    results = run_ranks(2, "test_gpu_check:_ranks_worker", {}, tmp_path)
    for (reduce_status, reduce_detail), (fsdp_status, fsdp_detail) in results:
        assert reduce_status == "ok" and "over 2 gloo ranks" in reduce_detail, reduce_detail
        assert fsdp_status == "ok" and "over 2 ranks: loss" in fsdp_detail, fsdp_detail


@pytest.mark.gpu
@pytest.mark.timeout(300)
def test_the_gpu_smoke_check_passes_on_this_machine() -> None:
    """The command a GPU node runs first (`python -m spes.preflight --gpu`, here on configs/tiny.yaml: the 1B node's
    run is bench/bench_gpu.py's) passes: the block's bf16 step and the node's optimizer step, and with 2+ GPUs
    NCCL's all-reduce and an FSDP2 step under torchrun."""
    done = subprocess.run(
        [sys.executable, "-m", "spes.preflight", "--gpu", "configs/tiny.yaml"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=240,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    out = done.stdout + done.stderr
    assert done.returncode == 0, out[-4000:]
    assert "preflight passed" in out and re.search(r"^ok +block +one .*tokens/s, MFU", out, re.M), out[-4000:]
    several = torch.cuda.device_count() > 1
    expected = {"step": "skip" if several else "ok", "nccl": "ok" if several else "skip"}
    expected["fsdp"] = expected["nccl"]
    for name, status in expected.items():
        assert re.search(rf"^{status} +{name} ", out, re.M), out[-4000:]
