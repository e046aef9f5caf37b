"""Data parallelism inside a node: launch checks, frozen experts under DDP/FSDP2, whole-tensor gather/load
for the SPES round, activation checkpointing, and loss-curve equivalence of single / DDP / FSDP2.

The multi-process tests run real `torchrun` launches on gloo through `dist_helpers`.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import signal
import subprocess
import sys
import time
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait
from pathlib import Path
from typing import Any

import pytest
import torch

from dist_helpers import SMALL_NODE, child_env, parameter_server, run_logged, run_ranks, torchrun
from spes.config import TrainConfig, load_config
from spes.distributed import DistInfo, check_launch
from spes.schema import ConfigError
from terminal_helpers import on_a_terminal, read_until

TINY = "configs/tiny.yaml"
# Peer 1 of 2 owns experts 2..3 of 4: half the experts of every layer are frozen.
SPES_PEER = [
    "--model.moe_num_experts=4",
    "--spes_config.num_peers=2",
    "--spes_config.num_train_experts_per_node=2",
    "--spes_config.peer_id=1",
]


def _cfg(*overrides: str) -> TrainConfig:
    return load_config(TINY, [*SMALL_NODE, *overrides])[0]


# ---------------------------------------------------------------------------------------------------------------
# spes.torchrun's line on a signal (torchrun's run stood in for: the ranks' words planted)


@pytest.mark.parametrize(
    ("left", "said"),
    [
        (
            {"rank1.txt": "error: interrupted without saving; rank 1", "rank0.txt": "error: saved step 7's checkpoint"},
            "saved step 7's checkpoint",
        ),
        (
            {},
            "no rank said what it saved (a rank still running 300 s after the signal is killed: --shutdown_timeout or "
            "TORCH_ELASTIC_SHUTDOWN_TIMEOUT gives it longer); --resume=auto continues from save_folder's latest "
            "checkpoint, or starts afresh when there is none",
        ),
    ],
)
def test_on_a_signal_spes_torchrun_says_what_the_lowest_rank_did_in_one_line(
    left: dict[str, str],
    said: str,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    caplog: pytest.LogCaptureFixture,
) -> None:
    """It said every rank had been asked to save a checkpoint, also when none had reached a step or saved anything,
    after torch's warning "Received 15 death signal, shutting down workers"."""
    import torch.distributed.run
    from torch.distributed.elastic.multiprocessing.api import SignalException

    import spes.torchrun

    def signalled(args: object) -> None:
        for name, line in left.items():
            (Path(os.environ[spes.torchrun.ERROR_DIR_ENV]) / name).write_text(line + "\n")
        logging.getLogger("torch.distributed.elastic.agent.server.api").warning("Received 15 death signal")
        raise SignalException("got signal: 15", sigval=signal.SIGTERM)

    monkeypatch.setenv(spes.torchrun.ERROR_DIR_ENV, "")  # NOTE: main sets it; the test's end takes it away again
    monkeypatch.setattr(torch.distributed.run, "run", signalled)
    assert spes.torchrun.main(["--standalone", "--nproc_per_node=2", "-m", "spes.train", TINY]) == 143
    assert capsys.readouterr().err == f"error: stopped by SIGTERM: {said}\n" and "death signal" not in caplog.text


@pytest.mark.parametrize(
    ("left", "said"),
    [
        (
            {"rank0.stopped.txt": "error: interrupted without saving", "rank1.txt": "error: command line (--x=abc)"},
            "error: command line (--x=abc)",
        ),
        (
            {"rank0.txt": "error: server 127.0.0.1:1 unreachable", "rank1.txt": "error: rank 0 failed"},
            "error: server 127.0.0.1:1 unreachable",
        ),
        ({"rank1.stopped.txt": "error: interrupted", "rank0.stopped.txt": "error: saved"}, "error: saved"),
        ({}, "error: rank 1 of spes.train exited with code 2; see its output above"),
    ],
)
def test_after_a_failure_spes_torchrun_prints_a_failed_ranks_line_before_a_stopped_ones(
    left: dict[str, str], said: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Rank 1 refused a command line while a loaded rank 0 was still starting: torchrun's SIGTERM made rank 0 say
    "interrupted without saving", which was printed as why the run ended."""
    import torch.distributed.run
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

    import spes.torchrun

    def failed(args: object) -> None:
        for name, line in left.items():
            (Path(os.environ[spes.torchrun.ERROR_DIR_ENV]) / name).write_text(line + "\n")
        raise ChildFailedError("spes.train", {1: ProcessFailure(1, 4321, 2, "<N/A>")})

    monkeypatch.setenv(spes.torchrun.ERROR_DIR_ENV, "")  # NOTE: main sets it; the test's end takes it away again
    monkeypatch.setattr(torch.distributed.run, "run", failed)
    assert spes.torchrun.main(["--standalone", "--nproc_per_node=2", "-m", "spes.train", TINY]) == 2
    assert capsys.readouterr().err == said + "\n"


@pytest.mark.parametrize(
    ("flags", "env", "timeout"),
    [
        ([], {}, 300),
        (["--shutdown_timeout=45"], {"TORCH_ELASTIC_SHUTDOWN_TIMEOUT": "60"}, 45),
        ([], {"PET_SHUTDOWN_TIMEOUT": "45"}, 45),
        ([], {"TORCH_ELASTIC_SHUTDOWN_TIMEOUT": "60"}, 60),
    ],
)
def test_spes_torchrun_gives_the_ranks_minutes_to_save_unless_the_user_says_otherwise(
    flags: list[str], env: dict[str, str], timeout: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """torch's 30 s SIGKILLed a 1B node stopped by a signal mid-save: its step and its checkpoint take longer."""
    import torch.distributed.run

    import spes.torchrun

    for name in ("PET_SHUTDOWN_TIMEOUT", "TORCH_ELASTIC_SHUTDOWN_TIMEOUT"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    seen = []

    def launch(config: Any, entrypoint: object) -> Any:
        seen.append(config.shutdown_timeout)  # NOTE: what the agent waits before its SIGKILL
        return lambda *args: {}

    monkeypatch.setenv(spes.torchrun.ERROR_DIR_ENV, "")  # NOTE: main sets it; the test's end takes it away again
    monkeypatch.setattr(torch.distributed.run, "elastic_launch", launch)
    assert spes.torchrun.main([*flags, "--standalone", "--nproc_per_node=2", "-m", "spes.train", TINY]) == 0
    assert seen == [timeout] and spes.torchrun.SHUTDOWN_TIMEOUT_S == 300


def test_a_shutdown_timeout_in_the_environment_that_is_no_number_is_refused_naming_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import spes.torchrun

    monkeypatch.setenv("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", "5m")
    with pytest.raises(SystemExit, match="TORCH_ELASTIC_SHUTDOWN_TIMEOUT='5m' is not a number of seconds"):
        spes.torchrun.shutdown_timeout(None)


SLOW_SAVER = """import os, signal, sys, time
from pathlib import Path
from spes.failures import leave_for_launcher
stop = []
signal.signal(signal.SIGTERM, lambda *a: stop.append(1))
Path(sys.argv[1]).touch()
while not stop:
    time.sleep(0.02)
time.sleep(float(sys.argv[2]))  # its step and its save
leave_for_launcher("error: saved step 7's checkpoint and stopped", stopped=True)
sys.exit(130)
"""
"""A rank that takes argv[2] seconds to save after SIGTERM (argv[1]: the file it makes once started)."""


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_rank_saving_within_the_shutdown_timeout_is_heard_and_one_past_it_is_killed(tmp_path: Path) -> None:
    """Real spes.torchrun on SIGTERM: the timeout reaches torch's agent (a rank past it is killed, and the line says
    after how long and how to give it longer); a rank within it saves and its line is the launcher's."""
    script = tmp_path / "saver.py"
    script.write_text(SLOW_SAVER)
    lines = {}
    for timeout in (1, 10):
        started, log = tmp_path / f"started{timeout}", tmp_path / f"run{timeout}.log"
        cmd = [sys.executable, "-m", "spes.torchrun", f"--shutdown_timeout={timeout}", "--standalone"]
        with open(log, "w") as out:
            proc = subprocess.Popen(
                [*cmd, "--nproc_per_node=1", str(script), str(started), "3"],
                env=child_env(),
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        try:
            deadline = time.monotonic() + 60
            while not started.exists():
                assert proc.poll() is None and time.monotonic() < deadline, log.read_text()
                time.sleep(0.05)
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(timeout=60) == 128 + signal.SIGTERM, log.read_text()
        finally:
            proc.kill()
        lines[timeout] = log.read_text().strip().splitlines()[-1]
    assert lines[1].startswith("error: stopped by SIGTERM: no rank said what it saved (a rank still running 1 s ")
    assert lines[10] == "error: stopped by SIGTERM: saved step 7's checkpoint and stopped"


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_closed_terminal_stops_spes_torchrun_as_sigterm_does_its_rank_saved(tiny_corpus, tmp_path: Path) -> None:
    """A dropped SSH session: torchrun passes the SIGHUP on, and the rank, which died of it, now saves; the
    launcher's line, written to the terminal gone, ended it with EIO (exit 1, not 129)."""
    save = tmp_path / "node"
    node = [TINY, *tiny_corpus.overrides(save), "--using_spes=false", "--eval_interval=null", "--save_interval=1000"]
    argv = ["-m", "spes.torchrun", "--standalone", "--nproc_per_node=1", "-m", "spes.train", *node]
    proc, master = on_a_terminal([*argv, "--max_duration=1000st"], child_env())
    try:
        seen = read_until(master, b"step 3/", 90)
        assert b"step 3/" in seen, seen[-2000:]
        os.close(master)
        assert proc.wait(timeout=60) == 128 + signal.SIGHUP
    finally:
        proc.kill()
        proc.wait()
    assert (save / "latest").is_file()


# ---------------------------------------------------------------------------------------------------------------
# Launch checks (pure: the environment is passed in)


def test_no_torchrun_variables_means_one_process() -> None:
    assert check_launch(_cfg("--distributed_strategy=fsdp"), {}, num_gpus=0) == (0, 1, 0)


def test_torchrun_variables_are_read() -> None:
    env = {"RANK": "1", "LOCAL_RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}
    assert check_launch(_cfg("--distributed_strategy=ddp"), env, num_gpus=0) == (1, 2, 1)


@pytest.mark.parametrize(
    "env, message",
    [
        ({"RANK": "0", "WORLD_SIZE": "2"}, "LOCAL_RANK, MASTER_ADDR, MASTER_PORT are not"),
        ({"RANK": "0"}, "launch multi-process runs with torchrun"),
        ({"RANK": "2", "LOCAL_RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "h", "MASTER_PORT": "1"}, "RANK=2 must be"),
        ({"RANK": "x", "LOCAL_RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "h", "MASTER_PORT": "1"}, "RANK='x'"),
    ],
)
def test_half_set_torchrun_environment_is_refused(env: dict[str, str], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        check_launch(_cfg("--distributed_strategy=ddp"), env, num_gpus=0)


def test_rank_count_that_does_not_divide_the_batch_is_refused() -> None:
    env = {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "3", "MASTER_ADDR": "h", "MASTER_PORT": "1"}
    with pytest.raises(ConfigError, match=r"global_train_batch_size' = 8 must be divisible by world_size \(3\)"):
        check_launch(_cfg("--distributed_strategy=fsdp"), env, num_gpus=0)


def test_single_strategy_on_several_processes_is_refused() -> None:
    env = {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "h", "MASTER_PORT": "1"}
    with pytest.raises(ConfigError, match="distributed_strategy' = 'single' cannot run on 2 processes"):
        check_launch(_cfg("--distributed_strategy=single"), env, num_gpus=0)


def test_more_ranks_than_gpus_is_refused() -> None:
    env = {"RANK": "2", "LOCAL_RANK": "2", "WORLD_SIZE": "4", "MASTER_ADDR": "h", "MASTER_PORT": "1"}
    with pytest.raises(ConfigError, match="LOCAL_RANK=2 but this machine has 2 GPU"):
        check_launch(_cfg("--distributed_strategy=fsdp"), env, num_gpus=2)


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_bad_launches_stop_with_one_clear_line_before_training(tiny_corpus, tmp_path: Path) -> None:
    args = ["-m", "spes.train", TINY, *SMALL_NODE, "--using_spes=false", *tiny_corpus.overrides(tmp_path)]
    three = torchrun(3, [*args, "--distributed_strategy=ddp"], log=tmp_path / "three.log", check=False)
    assert three.returncode != 0
    assert "error: config key 'global_train_batch_size' = 8 must be divisible by world_size (3)" in three.stdout
    half = run_logged(
        [sys.executable, *args], tmp_path / "half.log", timeout=60, env=child_env(WORLD_SIZE="2", RANK="0")
    )
    assert half.returncode == 2 and "LOCAL_RANK, MASTER_ADDR, MASTER_PORT are not: launch" in half.stdout
    assert "step 1" not in three.stdout + half.stdout and not (tmp_path / "metrics.jsonl").exists()


# ---------------------------------------------------------------------------------------------------------------
# Workers run by `run_ranks` on every rank (module-level so torchrun's processes can import them)


def _fresh(cfg: TrainConfig) -> torch.nn.Module:
    """The node's plain model with its initial weights."""
    from spes.model import Transformer

    with torch.device("meta"):
        model = Transformer.for_run(cfg)
    model.to_empty(device="cpu")
    model.init_weights(cfg.seed)
    return model


def _build(args: dict[str, Any], info: DistInfo) -> tuple[TrainConfig, torch.nn.Module]:
    """A SPES peer model (half its experts frozen), parallelized as args['strategy'] says."""
    from spes.distributed import parallelize

    cfg = _cfg(*SPES_PEER, f"--distributed_strategy={args['strategy']}", *args.get("overrides", []))
    return cfg, parallelize(_fresh(cfg), cfg, info)


def _frozen_comm_worker(args: dict[str, Any], info: DistInfo) -> dict[str, Any]:
    """One optimizer step; report gradient bytes reduced, which params got grads, and optimizer state size."""
    from grad_meter import attach_grad_comm_meter
    from spes.distributed import unwrap
    from spes.optim import build_optimizer

    cfg, model = _build(args, info)
    meter = attach_grad_comm_meter(model)
    optimizer = build_optimizer(model, cfg.optimizer)
    torch.manual_seed(info.rank)
    tokens = torch.randint(0, cfg.model.vocab_size, (2, cfg.model.max_sequence_length + 1))
    out = model(tokens[:, :-1])
    (torch.nn.functional.cross_entropy(out.logits.flatten(0, 1), tokens[:, 1:].flatten()) + out.lb_loss).backward()
    optimizer.step()
    named = dict(unwrap(model).named_parameters())
    return {
        "comm_bytes": meter.bytes,
        "comm_calls": meter.calls,
        "trainable": {n: list(p.shape) for n, p in named.items() if p.requires_grad},
        "frozen": {n: list(p.shape) for n, p in named.items() if not p.requires_grad},
        "frozen_with_grad": [n for n, p in named.items() if not p.requires_grad and p.grad is not None],
        "trainable_without_grad": [n for n, p in named.items() if p.requires_grad and p.grad is None],
        "optimizer_params": sum(len(g["params"]) for g in optimizer.param_groups),
        "optimizer_state_of_frozen": sum(1 for n, p in named.items() if not p.requires_grad and p in optimizer.state),
    }


def _teardown_worker(args: dict[str, Any], info: DistInfo) -> list[int]:
    """`spes.node.run` under DDP, once to the end and once failing mid-fit: how many DDP wrappers are alive when
    it leaves the process group (the harness leaves it afterwards)."""
    import gc

    from torch.nn.parallel import DistributedDataParallel

    import spes.node as train

    alive: list[int] = []
    train.shutdown_distributed = lambda clean: alive.append(  # type: ignore[assignment]
        sum(isinstance(o, DistributedDataParallel) for o in gc.get_objects())
    )
    cfg = _cfg(
        "--distributed_strategy=ddp",
        "--using_spes=false",
        "--max_duration=2st",
        "--save_interval=null",
        "--save_overwrite=true",  # the second run starts afresh in the first one's save folder
        *args["overrides"],
    )
    train.run(cfg)

    def boom(self: object) -> None:
        raise RuntimeError("boom")

    train.Trainer.fit = boom  # type: ignore[method-assign]
    with pytest.raises(RuntimeError, match="boom"):
        train.run(cfg)
    return alive


@pytest.mark.slow
@pytest.mark.timeout(200)
def test_no_ddp_wrapper_outlives_the_run_into_process_group_teardown(tiny_corpus, tmp_path: Path) -> None:
    """A DDP reducer freed after the process group tears gloo down with the GIL held, which can hang the process
    at exit (seen in CI): `run` must drop every wrapper, on success and on error, before it leaves the group."""
    overrides = [*tiny_corpus.overrides(tmp_path / "run"), "--data.validation_paths=[]"]
    ranks = run_ranks(2, "test_distributed:_teardown_worker", {"overrides": overrides}, tmp_path / "ranks")
    assert ranks == [[0, 0], [0, 0]]


def _numel(shapes: dict[str, list[int]], world: int = 1) -> int:
    """Elements of these tensors, dim 0 padded to a multiple of `world` (as FSDP2 pads its shards)."""
    return sum(math.ceil(s[0] / world) * world * math.prod(s[1:]) if s else 1 for s in shapes.values())


def _sharded_init_worker(args: dict[str, Any], info: DistInfo) -> dict[str, Any] | None:
    """FSDP2 as spes.train builds it: sharded on meta, then each rank allocates and initializes its shards."""
    if args["strategy"] != "fsdp":
        return None
    from spes.distributed import parallelize
    from spes.model import Transformer

    cfg = _cfg(*SPES_PEER, "--distributed_strategy=fsdp")
    with torch.device("meta"):
        model = parallelize(Transformer.for_run(cfg), cfg, info)
    model.to_empty(device="cpu")
    model.init_weights(cfg.seed)
    plain = dict(_fresh(cfg).named_parameters())
    return {
        "equal": all(torch.equal(p.full_tensor(), plain[n]) for n, p in model.named_parameters()),
        "local_fraction": sum(p.to_local().numel() for p in model.parameters())
        / sum(p.numel() for p in plain.values()),
    }


def _two_rank_worker(args: dict[str, Any], info: DistInfo) -> dict[str, Any]:
    """The checks below in one launch (process start-up dominates on 2 cores)."""
    return {
        "comm": _frozen_comm_worker(args, info),
        "sync": _gather_load_worker(args, info),
        "init": _sharded_init_worker(args, info),
    }


@pytest.fixture(scope="module", params=["ddp", "fsdp"])
def two_ranks(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[str, list[Any]]:
    """(strategy, per-rank results of `_two_rank_worker`) from one 2-rank torchrun launch per strategy."""
    out = tmp_path_factory.mktemp(f"two_ranks_{request.param}")
    return request.param, run_ranks(2, "test_distributed:_two_rank_worker", {"strategy": request.param}, out)


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_frozen_experts_have_no_grads_no_optimizer_state_and_no_gradient_traffic(
    two_ranks: tuple[str, list[Any]],
) -> None:
    strategy, results = two_ranks
    for r in (rank["comm"] for rank in results):
        assert r["frozen"] and all(".experts." in n for n in r["frozen"])
        assert r["frozen_with_grad"] == [] and r["trainable_without_grad"] == []
        assert r["optimizer_params"] == len(r["trainable"]) and r["optimizer_state_of_frozen"] == 0
        if strategy == "ddp":  # every bucket holds trainable fp32 gradients only, each exactly once
            assert r["comm_bytes"] == 4 * _numel(r["trainable"])
        else:  # one reduce-scatter per sharded unit over its padded trainable gradients
            assert r["comm_bytes"] == 4 * _numel(r["trainable"], world=2)
            assert r["comm_calls"] == 3  # two blocks + the root (embedding, final norm, LM head)


def _gather_load_worker(args: dict[str, Any], info: DistInfo) -> dict[str, Any]:
    """gather_full of the trainable tensors, then load_full of new values; every rank reports what it holds."""
    from spes.distributed import gather_full, load_full, unwrap
    from spes.optim import build_optimizer

    cfg, model = _build(args, info)
    ref = {n: p.detach() for n, p in _fresh(cfg).named_parameters()}
    optimizer = build_optimizer(model, cfg.optimizer)
    named = dict(unwrap(model).named_parameters())
    trainable = [n for n, p in named.items() if p.requires_grad]
    gathered = gather_full(model, trainable, info)
    gathered_ok = all(torch.equal(gathered[n], ref[n]) for n in gathered)
    # New values for one frozen expert block, one trainable expert block and an uneven-sized norm
    names = ["blocks.0.ffn.experts.w1.0", "blocks.1.ffn.experts.w2.1", "blocks.0.attn_norm.weight", "lm_head.weight"]
    new = {n: torch.full(ref[n].shape, 1.0 + i) for i, n in enumerate(names)} if info.is_main else {}
    params_before = [id(p) for p in optimizer.param_groups[0]["params"]]
    load_full(model, new, info)
    everything = gather_full(model, list(named), info)
    full = {n: everything[n] for n in names} if info.is_main else {}
    local_sums = {
        n: float((p.to_local() if hasattr(p, "to_local") else p).detach().double().sum())
        for n, p in named.items()
        if n in names
    }
    return {
        "gathered": sorted(gathered),
        "gathered_ok": gathered_ok,
        "loaded": {n: float(t.double().sum()) for n, t in full.items()},
        "expected": {n: float(t.double().sum()) for n, t in new.items()},
        "local_sums": local_sums,
        "untouched_equal": all(torch.equal(everything[n], ref[n]) for n in everything if n not in names)
        if info.is_main
        else True,
        "optimizer_params_unchanged": params_before == [id(p) for p in optimizer.param_groups[0]["params"]],
    }


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_sync_gathers_trainable_tensors_and_loads_the_global_model_on_every_rank(
    two_ranks: tuple[str, list[Any]],
) -> None:
    strategy, results = two_ranks
    main, other = (rank["sync"] for rank in results)
    assert main["gathered_ok"] and main["gathered"] and other["gathered"] == []
    assert all(".experts.w1.0" not in n for n in main["gathered"])  # frozen experts are never gathered
    assert main["loaded"] == main["expected"] and main["untouched_equal"]
    assert main["optimizer_params_unchanged"] and other["optimizer_params_unchanged"]
    if strategy == "ddp":  # replicas: every rank holds the whole new tensor
        assert main["local_sums"] == other["local_sums"] == main["expected"]
    else:  # shards: the two halves add up to the whole
        for n, total in main["expected"].items():
            assert main["local_sums"][n] + other["local_sums"][n] == pytest.approx(total)


def test_activation_checkpointing_keeps_parameter_names_and_values() -> None:
    from spes.distributed import apply_checkpointing_and_compile
    from spes.model import Transformer

    outputs = {}
    for mode in (None, "whole_layer", "fine_grained", "one_in_two"):
        cfg = _cfg(*SPES_PEER)
        model = Transformer.for_run(cfg)
        model.init_weights(cfg.seed)
        names = [n for n, _ in model.named_parameters()]
        apply_checkpointing_and_compile(model, mode, None)
        assert [n for n, _ in model.named_parameters()] == names
        tokens = torch.randint(0, cfg.model.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
        out = model(tokens)
        out.logits.float().square().mean().backward()
        outputs[mode] = (out.logits.detach(), model.blocks[0].attn.q_proj.weight.grad.clone())
    for mode, (logits, grad) in outputs.items():
        torch.testing.assert_close(logits, outputs[None][0], msg=f"logits with {mode}")
        torch.testing.assert_close(grad, outputs[None][1], msg=f"gradient with {mode}")


# ---------------------------------------------------------------------------------------------------------------
# The same run on 1 process, DDP x 2 and FSDP2 x 2


def _losses(save_folder: Path) -> list[float]:
    records = [json.loads(line) for line in (save_folder / "metrics.jsonl").read_text().splitlines()]
    return [r["loss"] for r in records if "loss" in r]


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("two_ranks", ["fsdp"], indirect=True)
def test_fsdp_ranks_initialize_only_their_shards_to_the_unsharded_values(two_ranks: tuple[str, list[Any]]) -> None:
    _, ranks = two_ranks
    for rank in ranks:
        assert rank["init"]["equal"]  # the same weights as one process draws
        assert rank["init"]["local_fraction"] <= 0.55  # about half of every tensor, never the whole model


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_single_ddp_and_fsdp_give_the_same_loss_curve(tiny_corpus, tmp_path: Path) -> None:
    """fp32 on CPU, same seed and global batch (8 sequences, micro-batches of 2): 20 steps agree to 1e-4.

    DDP and FSDP2 also recompute activations (whole_layer / fine_grained), which must not change the numbers.
    """
    steps = 20
    common = [
        *SMALL_NODE,
        "--using_spes=false",
        f"--max_duration={steps}st",
        "--save_interval=null",
        "--scheduler.t_warmup=5",
    ]
    runs = {
        "single": (1, []),
        "ddp": (2, ["--activation_checkpointing=whole_layer"]),
        "fsdp": (2, ["--activation_checkpointing=fine_grained"]),
    }
    curves = {}
    for name, (nproc, extra) in runs.items():
        folder = tmp_path / name
        torchrun(
            nproc,
            [
                "-m",
                "spes.train",
                TINY,
                *common,
                *tiny_corpus.overrides(folder),
                "--data.validation_paths=[]",
                f"--distributed_strategy={name}",
                *extra,
            ],
            log=tmp_path / f"{name}.log",
            timeout=180,
        )
        curves[name] = _losses(folder)
    assert len(curves["single"]) == steps
    assert curves["single"][-1] < curves["single"][0] - 0.2  # it really trains
    for name in ("ddp", "fsdp"):
        diff = max(abs(a - b) for a, b in zip(curves[name], curves["single"], strict=True))
        print(f"{name}: largest loss difference to one process over {steps} steps {diff:.2e}")
        assert diff < 1e-4, f"{name} departs from the single-process curve by {diff:.2e}"


# ---------------------------------------------------------------------------------------------------------------
# SPES rounds from multi-rank nodes: a real server and two nodes of two ranks each (DDP and FSDP2)


def _digests(model: torch.nn.Module) -> dict[str, str]:
    """sha256 of every whole parameter (gathered from the shards under FSDP: a collective)."""
    from spes.distributed import unwrap

    out = {}
    for name, p in unwrap(model).named_parameters():
        full = p.detach().full_tensor() if hasattr(p, "full_tensor") else p.detach()
        # NOTE: the raw bytes, whatever the dtype (a SPES node under amp_bf16 holds its frozen experts in bf16)
        out[name] = hashlib.sha256(full.contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()[:16]
    return out


def _sync_node_worker(args: dict[str, Any], info: DistInfo) -> dict[str, Any]:
    """One SPES node on this torchrun's ranks; records every rank's whole model before and after each round."""
    from spes.node import build_node, node_trainer
    from spes.sync.peer import PeerSync, SyncResult

    cfg = load_config(TINY, [*SMALL_NODE, *args["overrides"]])[0]
    quiet = lambda _msg: None  # noqa: E731
    node = build_node(cfg, info, log=quiet)
    peer_sync = PeerSync(cfg, node.model, info, log=quiet)
    peer_sync.join()
    record: dict[str, Any] = {}

    class Recording:
        def sync(self, step: int) -> SyncResult:
            before = _digests(node.model)
            result = peer_sync.sync(step)
            record[str(step)] = {"before": before, "after": _digests(node.model)}
            return result

        def __getattr__(self, name: str) -> object:  # the rest of the Syncer: PeerSync's own
            return getattr(peer_sync, name)

    trainer = node_trainer(cfg, node, info, syncer=Recording(), log=quiet)
    trainer.fit()
    peer_sync.close()
    return {**record, "run_id": peer_sync.client.run_id if peer_sync.client is not None else ""}


def _replacement_worker(args: dict[str, Any], info: DistInfo) -> dict[str, Any]:
    """A fresh node of the run started as `python -m spes.train` starts it: every rank's step and whole model."""
    from spes.node import start_node

    cfg = load_config(TINY, [*SMALL_NODE, *args["overrides"]])[0]
    trainer, syncer = start_node(cfg, info, log=lambda _msg: None)
    assert syncer is not None
    syncer.close()
    return {"step": trainer.step, "digests": _digests(trainer.model)}


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_two_nodes_of_two_ranks_hold_the_same_global_model_after_every_round(tiny_corpus, tmp_path: Path) -> None:
    """Server + node 0 (DDP x 2) + node 1 (FSDP2 x 2): 5 processes, 2 rounds; after each round all four ranks
    hold bit-identical whole models, though the nodes trained different experts on different data."""

    def node(addr: str, peer: int, strategy: str, worker: str = "_sync_node_worker", *extra: str) -> list[Any]:
        overrides = [
            *SPES_PEER,
            f"--spes_config.peer_id={peer}",
            f"--spes_config.server_addr={addr}",
            "--spes_config.sync_steps=2",
            "--max_duration=4st",
            "--save_interval=null",
            "--spes_config.round_timeout_s=200",
            "--spes_config.max_retries=2",
            f"--distributed_strategy={strategy}",
            *tiny_corpus.overrides(tmp_path / f"node{peer}"),
            "--data.validation_paths=[]",
            *extra,
        ]
        return run_ranks(
            2, f"test_distributed:{worker}", {"overrides": overrides}, tmp_path / f"{worker}{peer}", timeout=300
        )

    with ThreadPoolExecutor(2) as pool:
        with parameter_server(  # from the run's YAML and the nodes' overrides, as a user starts it
            tmp_path / "server.log",
            TINY,
            *SMALL_NODE,
            *SPES_PEER,
            "--spes_config.sync_steps=2",
            "--max_duration=4st",
            "--server.merge_interval=4",
            "--server.merge_alpha_start=0.05",
            "--server.merge_topk=1",
        ) as addr:
            futures = [pool.submit(node, addr, 0, "ddp"), pool.submit(node, addr, 1, "fsdp")]
            wait(futures, timeout=360, return_when=FIRST_EXCEPTION)
            ranks = [r for f in futures for r in f.result()]
            run_id = f"--spes_config.run_id={[r.pop('run_id') for r in ranks][0]}"
            # a fresh node replacing node 1 catches up with the run's last round before it trains a step
            replaced = node(addr, 1, "fsdp", "_replacement_worker", run_id, f"--save_folder={tmp_path / 'new1'}")
        # the server is gone: a node still waiting for a failed one gives up after its retries
    assert all(sorted(r) == ["2", "4"] for r in ranks)
    assert [r["step"] for r in replaced] == [4, 4]
    assert all(r["digests"] == ranks[0]["4"]["after"] for r in replaced)
    for step in ("2", "4"):
        after = [r[step]["after"] for r in ranks]
        assert all(a == after[0] for a in after), f"ranks differ after the round at step {step}"
        before0, before1 = ranks[0][step]["before"], ranks[2][step]["before"]
        assert before0 == ranks[1][step]["before"] and before1 == ranks[3][step]["before"]
        shared = [n for n in before0 if ".experts." not in n]
        assert all(before0[n] != before1[n] for n in shared)  # the nodes really trained apart in between
        assert after[0] != before0 and after[0] != before1


def _fsdp_variants_worker(args: dict[str, Any], info: DistInfo) -> dict[str, Any]:
    """Three optimizer steps under each mapping of the reference `fsdp` keys; losses and whole-model digests."""
    from spes.optim import build_optimizer

    results = {}
    for name, overrides in args["variants"].items():
        cfg, model = _build({"strategy": "fsdp", "overrides": overrides}, info)
        optimizer = build_optimizer(model, cfg.optimizer)
        losses = []
        for step in range(3):
            tokens = torch.randint(
                0,
                cfg.model.vocab_size,
                (2, cfg.model.max_sequence_length + 1),
                generator=torch.Generator().manual_seed(100 * step + info.rank),
            )
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=cfg.precision == "amp_bf16"):
                if cfg.fused_loss:  # the head's gradient is computed in the forward, while its weight is gathered
                    out = model(tokens[:, :-1], tokens[:, 1:])
                    loss = out.loss_sum / tokens[:, 1:].numel()
                else:
                    out = model(tokens[:, :-1])
                    loss = torch.nn.functional.cross_entropy(out.logits.float().flatten(0, 1), tokens[:, 1:].flatten())
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            losses.append(float(loss))
        results[name] = {"losses": losses, "digests": _digests(model)}
    return results


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_every_fsdp_setting_trains_and_keeps_ranks_consistent(tmp_path: Path) -> None:
    """sharding_strategy, wrapping_strategy, the amp_bf16 mixed-precision policy and fused_loss, each on 2 gloo
    ranks."""
    variants = {
        "FULL_SHARD": [],
        "SHARD_GRAD_OP": ["--fsdp.sharding_strategy=SHARD_GRAD_OP"],
        "NO_SHARD": ["--fsdp.sharding_strategy=NO_SHARD"],
        "HYBRID_SHARD": ["--fsdp.sharding_strategy=HYBRID_SHARD"],
        "one_unit": ["--fsdp.wrapping_strategy=null"],
        "amp_bf16_mixed": ["--precision=amp_bf16", "--fsdp.precision=mixed"],
        "fused_loss": ["--fused_loss=true"],
    }
    ranks = run_ranks(2, "test_distributed:_fsdp_variants_worker", {"variants": variants}, tmp_path, timeout=200)
    reference = ranks[0]["FULL_SHARD"]["losses"]
    for name in variants:
        assert ranks[0][name]["digests"] == ranks[1][name]["digests"], f"{name}: ranks disagree"
        losses = ranks[0][name]["losses"]
        assert all(math.isfinite(x) for x in losses) and losses[-1] < losses[0], name
        tolerance = 2e-2 if name == "amp_bf16_mixed" else 1e-5  # fp32: the same math whatever the sharding
        assert max(abs(a - b) for a, b in zip(losses, reference)) < tolerance, (name, losses, reference)


# ---------------------------------------------------------------------------------------------------------------
# compile: torch.compile per decoder block


def _train_two_steps(compile_option: dict | bool | None) -> tuple[list[float], torch.nn.Module]:
    """Two AdamW steps of configs/tiny.yaml's model as SPES peer 1 (experts 2-3 trainable) on fixed tokens."""
    from spes.distributed import apply_checkpointing_and_compile
    from spes.model import Transformer
    from spes.objective import language_model_loss

    cfg = load_config(TINY, ["--spes_config.peer_id=1"])[0]
    torch.manual_seed(0)
    model = Transformer.for_run(cfg)
    model.init_weights(cfg.seed)
    apply_checkpointing_and_compile(model, None, compile_option)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    tokens = torch.randint(0, cfg.model.vocab_size, (4, 33), generator=torch.Generator().manual_seed(3))
    losses = []
    for _ in range(2):
        out = model(tokens[:, :-1])
        loss = language_model_loss(out.logits, tokens[:, 1:]) + out.lb_loss + out.z_loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses, model


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_compiled_blocks_match_eager_and_frozen_experts_stay_frozen() -> None:
    """Inductor on the CPU (it needs a C compiler): about 3 minutes on 2 cores, mostly compilation."""
    eager_losses, eager = _train_two_steps(None)
    compiled_losses, compiled = _train_two_steps({"mode": "default", "fullgraph": False})
    assert all(b._compiled_call_impl is not None for b in compiled.blocks)
    assert compiled_losses == pytest.approx(eager_losses, abs=1e-4)
    names = [n for n, _ in eager.named_parameters()]
    assert names == [n for n, _ in compiled.named_parameters()]  # Module.compile keeps the names
    from spes.model import Transformer

    cfg = load_config(TINY, ["--spes_config.peer_id=1"])[0]
    fresh = Transformer.for_run(cfg)
    fresh.init_weights(cfg.seed)
    start = dict(fresh.named_parameters())
    for name, p in compiled.named_parameters():
        moved = not torch.equal(p.detach(), start[name].detach())
        assert moved == p.requires_grad, name  # trainable params moved, frozen experts did not
        assert p.grad is None
    assert any(not p.requires_grad for p in compiled.parameters())


def test_compile_options_are_checked() -> None:
    from spes.distributed import apply_checkpointing_and_compile
    from spes.model import Transformer

    model = Transformer.for_run(_cfg())
    apply_checkpointing_and_compile(model, None, None)
    apply_checkpointing_and_compile(model, None, False)
    assert all(not hasattr(b, "_compiled_call_impl") or b._compiled_call_impl is None for b in model.blocks)
    with pytest.raises(ConfigError, match=r"'compile.modee' is not a torch.compile option"):
        apply_checkpointing_and_compile(model, None, {"modee": "default"})
    with pytest.raises(ConfigError, match=r"^config key 'compile.mode' = 'fast' is not one of torch.compile's \['def"):
        apply_checkpointing_and_compile(model, None, {"mode": "fast"})
    with pytest.raises(ConfigError, match=r"^config key 'compile.backend' = 'inductr' is not one of torch.compile's"):
        apply_checkpointing_and_compile(model, None, {"backend": "inductr"})


@pytest.mark.parametrize("mode", ["fine_grained", "one_in_two"])
def test_a_recomputed_module_is_compiled_inside_its_checkpoint(mode: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """No graph torch.compile makes holds a checkpoint (Inductor of torch 2.11 on CUDA failed on such a block graph:
    bench/results/bench_gpu.json), `fused_loss`'s head is compiled too, no norm runs eager (fine_grained recomputes
    sublayers with their norms: the GPU profile had eager fp32 norms among its largest rows), and the compiled,
    recomputed model computes what the plain one does."""
    from torch._dynamo.backends.debugging import aot_eager

    from spes.distributed import apply_checkpointing_and_compile
    from spes.model import RMSNorm, Transformer

    torch._dynamo.reset()
    norm_calls: list[bool] = []  # per call of an RMSNorm: was it being traced for a graph (True) or eager (False)
    norm_forward = RMSNorm.forward

    def recorded_norm(self: RMSNorm, x: torch.Tensor) -> torch.Tensor:
        norm_calls.append(torch.compiler.is_compiling())
        return norm_forward(self, x)

    monkeypatch.setattr(RMSNorm, "forward", recorded_norm)
    graphs: list[torch.fx.GraphModule] = []

    def recording(gm: torch.fx.GraphModule, inputs: list) -> object:
        graphs.append(gm)
        return aot_eager(gm, inputs)

    cfg = _cfg(*SPES_PEER, "--model.moe_backend=torch")
    tokens = torch.randint(0, cfg.model.vocab_size, (2, 17), generator=torch.Generator().manual_seed(0))
    results = []
    for checkpointing, options in ((None, None), (mode, {"backend": recording})):
        model = Transformer.for_run(cfg)
        model.init_weights(cfg.seed)
        apply_checkpointing_and_compile(model, checkpointing, options)
        norm_calls.clear()
        out = model(tokens[:, :-1])
        fused = model(tokens[:, :-1], tokens[:, 1:], logit_z_weight=1.0)
        (out.logits.float().square().mean() + fused.loss_sum).backward()
        grad = model.blocks[0].attn.q_proj.weight.grad.clone()
        results.append((out.logits.detach(), fused.ce_sum.detach(), fused.logit_z_sum.detach(), grad))
    assert graphs, "nothing was compiled"
    assert norm_calls and all(norm_calls), f"{norm_calls.count(False)} of {len(norm_calls)} norm calls ran eager"
    held = [n.target for g in graphs for n in g.graph.nodes if "checkpoint" in str(n.target)]
    assert not held, held
    assert any("logsumexp" in str(n.target) for g in graphs for n in g.graph.nodes)
    for compiled, plain in zip(results[1], results[0]):
        torch.testing.assert_close(compiled, plain)
