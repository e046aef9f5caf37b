"""Checkpoints: unsharded and sharded layouts, `latest`, pruning, crash safety, unsharding, refusing a
checkpoint of another config, and resuming on a different number of ranks (2 -> 1, 1 -> 2)."""

from __future__ import annotations

import errno
import functools
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml

from disk_helpers import cap_file_size, drop_checksums, print_failure, run_child
from dist_helpers import SMALL_NODE, child_env, run_logged, run_ranks, torchrun
from spes.checkpoint import (
    check_model_compatible,
    is_sharded,
    load_checkpoint,
    load_model_state,
    restore,
    save,
    save_checkpoint,
    save_sharded_checkpoint,
    trainer_state,
    unshard,
)
from spes.config import TrainConfig, load_config
from spes.distributed import DistInfo
from spes.model import Transformer
from spes.optim import build_optimizer
from spes.save_folder import CONFIG_FILE, LATEST, META_FILE, CheckpointError, list_checkpoints, resolve_checkpoint
from spes.schema import to_dict

TINY = "configs/tiny.yaml"
PEER0 = ["--model.moe_num_experts=4", "--spes_config.num_peers=2", "--spes_config.num_train_experts_per_node=2"]


def _node(*overrides: str, steps: int = 1) -> tuple[TrainConfig, Transformer, torch.optim.Optimizer]:
    """A SPES peer's model and AdamW after `steps` real optimizer steps on random tokens (deterministic)."""
    cfg = load_config(TINY, [*SMALL_NODE, *PEER0, *overrides])[0]
    model = Transformer.for_run(cfg)
    model.init_weights(cfg.seed)
    optimizer = build_optimizer(model, cfg.optimizer)
    gen = torch.Generator().manual_seed(1)
    for _ in range(steps):
        tokens = torch.randint(0, cfg.model.vocab_size, (2, 17), generator=gen)
        out = model(tokens[:, :-1])
        torch.nn.functional.cross_entropy(out.logits.flatten(0, 1), tokens[:, 1:].flatten()).backward()
        optimizer.step()
        optimizer.zero_grad()
    return cfg, model, optimizer


def _unit_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """One optimizer step on gradients of ones for what the model trains (moments without a forward)."""
    for p in model.parameters():
        p.grad = torch.ones_like(p) if p.requires_grad else None
    optimizer.step()


def _save_unsharded(
    folder: Path, step: int, cfg: TrainConfig, model: Transformer, optimizer: torch.optim.Optimizer, keep: int = -1
) -> Path:
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    return save_checkpoint(
        folder,
        step,
        model_state=model.state_dict(),
        optim_state=get_optimizer_state_dict(model, optimizer),
        trainer_state={"step": step},
        config=to_dict(cfg),
        keep=keep,
    )


def _save_sharded(
    folder: Path, step: int, cfg: TrainConfig, model: Transformer, optimizer: torch.optim.Optimizer, keep: int = -1
) -> Path:
    return save_sharded_checkpoint(
        folder, step, model=model, optimizer=optimizer, trainer_state={"step": step}, config=to_dict(cfg), keep=keep
    )


def _assert_same_state(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=0, atol=0, msg=k)


# ---------------------------------------------------------------------------------------------------------------
# Layouts, latest, pruning (one process: DCP runs without a process group)


def test_sharded_and_unsharded_checkpoints_hold_the_same_state_and_restore_exactly(tmp_path: Path) -> None:
    cfg, model, optimizer = _node(steps=2)
    sharded = _save_sharded(tmp_path, 2, cfg, model, optimizer)
    plain = _save_unsharded(tmp_path, 3, cfg, model, optimizer)
    assert sharded.name == "step2-sharded" and plain.name == "step3"
    assert sorted(p.name for p in sharded.iterdir()) == [
        "config.yaml",
        "meta.json",
        "shard-00001-model-00001-of-00001.safetensors",
    ]
    assert not list(tmp_path.glob(".*"))  # no temporary directories left behind
    a, b = load_checkpoint(sharded), load_checkpoint(plain)
    _assert_same_state(a.model, b.model)
    assert a.optim is not None and b.optim is not None and a.optim["state"].keys() == b.optim["state"].keys()
    for fqn in a.optim["state"]:
        _assert_same_state(a.optim["state"][fqn], b.optim["state"][fqn])
    assert all(".experts." not in fqn or fqn.endswith(".0") for fqn in a.optim["state"])  # frozen: no Adam state

    assert a.config == b.config == to_dict(cfg) and b.optim is not None
    assert all(isinstance(g["betas"], tuple) for g in b.optim["param_groups"])  # as AdamW keeps them (not JSON lists)
    assert list(yaml.safe_load((plain / CONFIG_FILE).read_text())) == list(to_dict(cfg))  # the config's own order

    _, fresh, fresh_optim = _node(steps=0)
    restored = restore(sharded, fresh, fresh_optim)
    assert restored.trainer == {"step": 2} and restored.path == sharded and restored.config == to_dict(cfg)
    assert not restored.reblocked  # a sharded checkpoint is restored in its own layout or refused
    assert restored.model == {} and restored.optim is None  # no tensors: they are in the model and optimizer
    _assert_same_state(fresh.state_dict(), model.state_dict())
    for p, q in zip(fresh.parameters(), model.parameters(), strict=True):
        if p.requires_grad:
            _assert_same_state(fresh_optim.state[p], optimizer.state[q])


@pytest.mark.parametrize("with_optim", [True, False])
def test_an_unsharded_checkpoint_read_slice_by_slice_as_fsdp_ranks_do_restores_exactly(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, with_optim: bool
) -> None:
    """FSDP ranks read an unsharded checkpoint through DCP, each its own slices (none reads a file whole): taken
    here by a one-process model, the path restores what was saved, and without the optimizer leaves it alone."""
    import spes.checkpoint

    cfg, model, optimizer = _node(steps=2)
    plain = _save_unsharded(tmp_path, 3, cfg, model, optimizer)
    _, fresh, fresh_optim = _node(steps=0)
    monkeypatch.setattr(spes.checkpoint, "is_dtensor", lambda t: True)
    monkeypatch.setattr(spes.checkpoint, "load_file", lambda path: pytest.fail(f"{path} read whole"))
    restored = restore(plain, fresh, fresh_optim, with_optim=with_optim)
    assert restored.trainer == {"step": 3} and not restored.reblocked
    _assert_same_state(fresh.state_dict(), model.state_dict())
    for p, q in zip(fresh.parameters(), model.parameters(), strict=True):
        if p.requires_grad:
            assert fresh_optim.state[p].keys() == (optimizer.state[q].keys() if with_optim else set())
            if with_optim:
                _assert_same_state(fresh_optim.state[p], optimizer.state[q])


@pytest.mark.parametrize("sharded", [False, True])
def test_a_checkpoint_before_the_first_step_leaves_the_optimizer_untouched(tmp_path: Path, sharded: bool) -> None:
    """torch would create Adam's state with a zero-gradient step (advancing its step count) if asked for it."""
    cfg, model, optimizer = _node(steps=0)
    path = save(tmp_path, 0, model, optimizer, trainer_state={"step": 0}, config=to_dict(cfg), sharded=sharded)
    assert path is not None and not optimizer.state
    _, fresh, fresh_optim = _node(steps=0)
    assert restore(path, fresh, fresh_optim).trainer == {"step": 0}
    _assert_same_state(fresh.state_dict(), model.state_dict())
    assert not fresh_optim.state


@pytest.mark.parametrize("sharded", [False, True])
def test_save_and_restore_carry_the_model_the_optimizer_the_trainer_and_the_config(
    tmp_path: Path, sharded: bool
) -> None:
    """The trainer's pair, either kind, into a folder not made yet; `keep` prunes; without the optimizer's state
    only the weights and the trainer state come back. The optimizer's hyperparameters come back as they were saved
    (a schedule may have moved them), not as a fresh optimizer holds them."""
    cfg, model, optimizer = _node(steps=2)
    for group in optimizer.param_groups:
        group["lr"], group["weight_decay"] = 0.123, 0.456
    folder = tmp_path / "runs" / "node0"
    for step in (2, 3):
        trainer = {"step": step, "tokens": 100 * step}
        path = save(folder, step, model, optimizer, trainer_state=trainer, config=to_dict(cfg), sharded=sharded, keep=1)
    assert path is not None and [p.name for p in list_checkpoints(folder)] == [path.name]
    meta = json.loads((path / META_FILE).read_text())
    assert (meta["kind"], meta["step"]) == ("sharded" if sharded else "unsharded", 3)
    assert meta.get("world_size") == (1 if sharded else None)  # the ranks that wrote the shards
    assert load_checkpoint(path).config == to_dict(cfg)
    for with_optim in (True, False):
        _, fresh, fresh_optim = _node(steps=0)
        restored = restore(path, fresh, fresh_optim, with_optim=with_optim)
        assert restored.trainer == {"step": 3, "tokens": 300} and restored.config == to_dict(cfg)
        _assert_same_state(fresh.state_dict(), model.state_dict())
        assert bool(fresh_optim.state) == with_optim
        hyper = [(g["lr"], g["weight_decay"]) for g in fresh_optim.param_groups]
        lr, decay = cfg.optimizer.learning_rate, cfg.optimizer.weight_decay
        assert hyper == ([(0.123, 0.456)] * 2 if with_optim else [(lr, decay), (lr, 0.0)])
        for p, q in zip(fresh.parameters(), model.parameters(), strict=True):
            if p.requires_grad and with_optim:
                _assert_same_state(fresh_optim.state[p], optimizer.state[q])


def test_a_centralized_checkpoint_restores_into_a_spes_peer_as_its_weights_reblocked(tmp_path: Path) -> None:
    """One block of every expert (centralized) -> blocks of the peer's size: the weights carry over, the optimizer
    and trainer state cannot (frozen blocks have no moments): the peer starts anew from them."""
    cfg = load_config(TINY, [*SMALL_NODE, "--model.moe_num_experts=4", "--using_spes=false"])[0]
    central = Transformer.for_run(cfg)
    central.init_weights(cfg.seed)
    optimizer = build_optimizer(central, cfg.optimizer)
    _unit_step(central, optimizer)  # its moments are of every expert: they cannot follow
    path = save(tmp_path, 5, central, optimizer, trainer_state={"step": 5}, config=to_dict(cfg), sharded=False)
    assert path is not None
    _, peer, peer_optim = _node(steps=0)
    restored = restore(path, peer, peer_optim)
    assert restored.trainer == {} and restored.reblocked and not peer_optim.state
    again = Transformer.for_run(cfg)
    assert not restore(path, again, build_optimizer(again, cfg.optimizer)).reblocked  # the same layout
    saved = central.state_dict()
    for name, tensor in peer.state_dict().items():
        if ".experts." in name:
            layer, block = name.rsplit(".", 1)
            whole = saved[f"{layer}.0"]
            assert torch.equal(tensor, whole[int(block) * 2 : (int(block) + 1) * 2]), name
        else:
            assert torch.equal(tensor, saved[name]), name


def test_a_checkpoint_of_other_layers_is_refused_naming_what_differs_after_reblocking(tmp_path: Path) -> None:
    """Its expert blocks would fit the peer's; the refusal names the third layer, not the block layout."""
    cfg = load_config(TINY, [*SMALL_NODE, "--model.moe_num_experts=4", "--using_spes=false", "--model.n_layers=3"])[0]
    central = Transformer.for_run(cfg)
    optimizer = build_optimizer(central, cfg.optimizer)
    path = save(tmp_path, 5, central, optimizer, trainer_state={}, config=to_dict(cfg), sharded=False)
    _, peer, peer_optim = _node(steps=0)
    with pytest.raises(CheckpointError) as err:
        restore(tmp_path, peer, peer_optim)
    attn = ["blocks.2.attn.k_norm.weight", "blocks.2.attn.k_proj.weight", "blocks.2.attn.o_proj.weight"]
    assert str(err.value) == (
        f"{path}: checkpoint does not match this model config: missing [], unexpected {attn} "
        "(was it written with other model or spes_config keys?)"
    )


def test_latest_follows_the_newest_save_of_either_kind_and_pruning_is_per_kind(tmp_path: Path) -> None:
    cfg, model, optimizer = _node()
    for step in (1, 2, 3):
        _save_sharded(tmp_path, step, cfg, model, optimizer, keep=2)
        assert resolve_checkpoint(tmp_path).name == f"step{step}-sharded"
    _save_unsharded(tmp_path, 4, cfg, model, optimizer, keep=1)
    _save_unsharded(tmp_path, 5, cfg, model, optimizer, keep=1)
    assert (tmp_path / LATEST).read_text().strip() == "step5"
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step2-sharded", "step3-sharded", "step5"]
    assert [p.name for p in list_checkpoints(tmp_path, "sharded")] == ["step2-sharded", "step3-sharded"]
    _save_sharded(tmp_path, 6, cfg, model, optimizer, keep=2)
    assert resolve_checkpoint(tmp_path).name == "step6-sharded"
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step3-sharded", "step5", "step6-sharded"]


def test_a_save_prunes_by_the_schedules_it_is_handed(tmp_path: Path) -> None:
    """The trainer hands save_checkpoint its schedules: a save of step 30 keeps the 10-step schedule's newest (30)
    and the 5-step schedule's newest two (25, 30), not one keep for both."""
    for step in (5, 10, 15, 20, 25):
        (tmp_path / f"step{step}").mkdir()
    save_checkpoint(tmp_path, 30, model_state={}, optim_state=None, trainer_state={}, config={}, keep=[(10, 1), (5, 2)])
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step25", "step30"]
    assert (tmp_path / LATEST).read_text() == "step30\n"


def test_unshard_command_writes_the_unsharded_layout(tmp_path: Path) -> None:
    cfg, model, optimizer = _node(steps=2)
    _save_sharded(tmp_path / "run", 2, cfg, model, optimizer)
    _save_unsharded(tmp_path / "reference", 2, cfg, model, optimizer)
    out = tmp_path / "unsharded"
    proc = subprocess.run(
        [sys.executable, "-m", "spes.unshard", str(tmp_path / "run"), str(out)],
        capture_output=True,
        text=True,
        timeout=60,
        env=child_env(),
    )
    assert proc.returncode == 0, proc.stderr
    assert sorted(p.name for p in out.iterdir()) == [
        "config.yaml",
        "meta.json",
        "model.safetensors",
        "optim.safetensors",
    ]
    a, b = load_checkpoint(out), load_checkpoint(tmp_path / "reference" / "step2")
    _assert_same_state(a.model, b.model)
    assert a.optim is not None and b.optim is not None
    assert a.optim["param_groups"] == b.optim["param_groups"] and a.trainer == b.trainer
    with pytest.raises(FileExistsError, match="already exists"):
        unshard(tmp_path / "run", out)
    for taken in (out, out / "config.yaml"):  # a directory with files, or a file
        with pytest.raises(FileExistsError) as err:
            unshard(tmp_path / "run", taken)
        assert str(err.value) == f"{taken} already exists; choose a new directory (e.g. {tmp_path / 'run' / 'step2'})"
    empty = tmp_path / "empty"
    empty.mkdir()
    assert unshard(tmp_path / "run", empty) == empty  # in-process too: the same checkpoint as the command's
    again = load_checkpoint(empty)
    _assert_same_state(again.model, a.model)
    assert (again.trainer, again.config) == (a.trainer, a.config) == ({"step": 2}, to_dict(cfg))
    assert json.loads((empty / META_FILE).read_text())["step"] == 2
    with pytest.raises(CheckpointError, match="already an unsharded checkpoint"):
        unshard(out, tmp_path / "again")


# ---------------------------------------------------------------------------------------------------------------
# Crash safety


def test_a_save_failing_midway_leaves_latest_on_the_previous_complete_checkpoint(tmp_path: Path) -> None:
    cfg, model, optimizer = _node()
    _save_unsharded(tmp_path, 1, cfg, model, optimizer)

    class FailsHalfway(dict):
        def items(self):  # type: ignore[no-untyped-def]
            for i, item in enumerate(super().items()):
                if i == len(self) // 2:
                    raise OSError("disk full (simulated)")
                yield item

    with pytest.raises(OSError, match="disk full"):
        save_checkpoint(
            tmp_path, 2, model_state=FailsHalfway(model.state_dict()), optim_state=None, trainer_state={}, config={}
        )
    with pytest.raises(TypeError):  # trainer state that cannot be written: fails after every shard is on disk
        save_sharded_checkpoint(
            tmp_path, 3, model=model, optimizer=optimizer, trainer_state={"bad": object()}, config={}
        )
    assert resolve_checkpoint(tmp_path).name == "step1"
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step1"]
    load_checkpoint(tmp_path)


def _save_forever(folder: str) -> None:
    """Checkpoint a 16 MiB state again and again, alternating kinds (run in a child process that gets killed)."""
    cfg, model, optimizer = _node(
        "--model.d_model=64", "--model.n_heads=4", "--model.n_layers=4", "--model.mlp_hidden_size=512"
    )
    for step in range(1, 10_000):
        save = _save_sharded if step % 2 else _save_unsharded
        save(Path(folder), step, cfg, model, optimizer, keep=2)
        print(step, flush=True)


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_killing_the_process_during_saves_never_leaves_a_corrupt_latest(tmp_path: Path) -> None:
    folder = tmp_path / "run"
    code = f"import test_checkpoint; test_checkpoint._save_forever({str(folder)!r})"
    for delay in (0.0, 0.2):  # a save takes ~0.1 s here: kills land inside one (or between two)
        proc = subprocess.Popen(
            [sys.executable, "-c", code], env=child_env(), stdout=subprocess.PIPE, text=True, start_new_session=True
        )
        assert proc.stdout is not None and proc.stdout.readline()  # one more save completed
        time.sleep(delay)
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        ckpt = load_checkpoint(folder)  # checks every file's size and reads every tensor
        assert ckpt.model and ckpt.optim is not None
    cfg, model, optimizer = _node()
    _save_sharded(folder, 10_000, cfg, model, optimizer)  # the next save clears what the killed ones left
    assert not [p.name for p in folder.iterdir() if p.name.startswith(".")]


# ---------------------------------------------------------------------------------------------------------------
# Refusing checkpoints that do not fit


def test_checkpoint_of_another_model_config_is_refused_before_loading(tmp_path: Path) -> None:
    cfg, model, optimizer = _node()
    sharded = _save_sharded(tmp_path, 1, cfg, model, optimizer)
    plain = _save_unsharded(tmp_path, 2, cfg, model, optimizer)
    _, wider, wider_optim = _node("--model.d_model=48", steps=0)
    before = {k: v.clone() for k, v in wider.state_dict().items()}
    for path in (sharded, plain):
        with pytest.raises(CheckpointError, match=r"has shape \(4096, 32\) in the checkpoint but \(4096, 48\)"):
            restore(path, wider, wider_optim)
    _assert_same_state(wider.state_dict(), before)
    _, other_peer, other_optim = _node("--spes_config.peer_id=1", steps=0)
    for path in (sharded, plain):
        with pytest.raises(CheckpointError, match="optimizer state is for other parameters.*peer_id"):
            restore(path, other_peer, other_optim)


def test_training_from_a_checkpoint_of_another_config_exits_2_before_training(tiny_corpus, tmp_path: Path) -> None:
    cfg, model, optimizer = _node()
    _save_sharded(tmp_path / "old", 1, cfg, model, optimizer)
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "spes.train",
            TINY,
            *SMALL_NODE,
            *PEER0,
            "--using_spes=false",
            "--model.n_layers=3",
            *tiny_corpus.overrides(tmp_path / "new"),
            f"--load_path={tmp_path / 'old'}",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        env=child_env(),
    )
    assert proc.returncode == 2
    assert "checkpoint does not match this model config" in proc.stderr and "step " not in proc.stdout


# ---------------------------------------------------------------------------------------------------------------
# Resuming on another number of ranks continues the loss curve


def _losses(folder: Path) -> dict[int, float]:
    records = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in records if "loss" in r}


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_resume_on_another_number_of_ranks_continues_the_loss_curve(tiny_corpus, tmp_path: Path) -> None:
    """FSDP x 2 saves sharded at step 4 -> one process resumes and saves unsharded at 6 -> FSDP x 2 resumes.

    All three follow the uninterrupted FSDP x 2 curve (fp32 on CPU, within 1e-5); the unshard command turns
    the FSDP run's last sharded checkpoint into one equal to what the single process wrote at the same step.
    """
    common = [TINY, *SMALL_NODE, "--using_spes=false", "--max_duration=8st", "--data.validation_paths=[]"]
    a, b, c = tmp_path / "fsdp2", tmp_path / "single", tmp_path / "fsdp2_again"
    torchrun(
        2,
        ["-m", "spes.train", *common, *tiny_corpus.overrides(a), "--distributed_strategy=fsdp", "--save_interval=4"],
        log=tmp_path / "a.log",
        timeout=180,
    )
    assert [p.name for p in list_checkpoints(a)] == ["step4-sharded", "step8-sharded"]
    single_run = run_logged(
        [
            sys.executable,
            "-m",
            "spes.train",
            *common,
            *tiny_corpus.overrides(b),
            "--save_interval=2",
            f"--load_path={a / 'step4-sharded'}",
        ],
        tmp_path / "b.log",
        timeout=180,
    )
    assert single_run.returncode == 0, single_run.stdout[-3000:]
    torchrun(
        2,
        [
            "-m",
            "spes.train",
            *common,
            *tiny_corpus.overrides(c),
            "--distributed_strategy=fsdp",
            "--save_interval=null",
            f"--load_path={b / 'step6'}",
        ],
        log=tmp_path / "c.log",
        timeout=180,
    )
    reference, single, again = _losses(a), _losses(b), _losses(c)
    assert sorted(single) == [5, 6, 7, 8] and sorted(again) == [7, 8]
    for step, loss in {**single, **again}.items():
        assert abs(loss - reference[step]) < 1e-5, f"step {step}: {loss} vs uninterrupted {reference[step]}"

    unshard(a / "step8-sharded", tmp_path / "unsharded8")
    from_fsdp, from_single = load_checkpoint(tmp_path / "unsharded8"), load_checkpoint(b / "step8")
    assert from_fsdp.trainer["data"] == from_single.trainer["data"]
    for name, t in from_single.model.items():
        torch.testing.assert_close(from_fsdp.model[name], t, rtol=0, atol=1e-5, msg=name)


def _fsdp_checkpoint_worker(args: dict[str, Any], info: DistInfo) -> dict[str, Any]:
    """FSDP2 x 2, one step, then a checkpoint of either kind restored into a fresh FSDP2 model and optimizer: does
    each rank hold its shards of every weight and moment again, exactly, having read no file whole (its host
    memory would hold the whole model and optimizer)?"""
    from unittest import mock

    import spes.checkpoint
    from spes.distributed import parallelize

    cfg = load_config(TINY, [*SMALL_NODE, *PEER0, "--distributed_strategy=fsdp"])[0]

    def built() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
        with torch.device("meta"):
            model = parallelize(Transformer.for_run(cfg), cfg, info)
        model.to_empty(device="cpu")
        model.init_weights(cfg.seed)
        return model, build_optimizer(model, cfg.optimizer)

    def local(t: torch.Tensor) -> torch.Tensor:
        return t.to_local() if hasattr(t, "to_local") else t

    model, optimizer = built()
    tokens = torch.randint(0, cfg.model.vocab_size, (2, 17), generator=torch.Generator().manual_seed(info.rank))
    logits = model(tokens[:, :-1]).logits
    torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten()).backward()
    optimizer.step()
    same: dict[str, Any] = {}
    for sharded in (True, False):
        folder = Path(args["folder"]) / str(sharded)
        save(folder, 1, model, optimizer, trainer_state={"step": 1}, config={"seed": 7}, sharded=sharded)
        torch.distributed.barrier()  # the main rank wrote an unsharded one alone
        fresh, fresh_optim = built()
        with mock.patch.object(spes.checkpoint, "load_file", wraps=spes.checkpoint.load_file) as whole:
            restored = restore(folder, fresh, fresh_optim)
        pairs = list(zip(model.parameters(), fresh.parameters(), strict=True))
        moments = all(
            torch.equal(local(optimizer.state[p][k]), local(fresh_optim.state[q][k]))
            for p, q in pairs
            if p.requires_grad
            for k in ("exp_avg", "exp_avg_sq")
        )
        weights = all(torch.equal(local(p.detach()), local(q.detach())) for p, q in pairs)
        same["sharded" if sharded else "unsharded"] = (
            weights and moments and restored.trainer == {"step": 1} and restored.config == {"seed": 7}
        )
        same["read whole"] = same.get("read whole", []) + [Path(c.args[0]).name for c in whole.call_args_list]
    same["reblocked"] = _fsdp_reblocked_restore(Path(args["folder"]) / "central", built)
    same["damaged"] = _fsdp_damaged_restore(Path(args["folder"]) / "damaged", model, optimizer, built)
    return {**same, "failed_save": _failing_sharded_save(Path(args["folder"]) / "True", model, optimizer)}


def _fsdp_damaged_restore(
    folder: Path,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    built: Callable[[], tuple[torch.nn.Module, torch.optim.Optimizer]],
) -> str:
    """A byte flipped in the shard file rank 1 hashes (each rank hashes its share): what each rank's restore says."""
    path = save(folder, 1, model, optimizer, trainer_state={}, config={}, sharded=True)
    assert path is not None
    if torch.distributed.get_rank() == 0:
        _flip_byte(path / "shard-00001-model-00001-of-00001.safetensors", 7)
    torch.distributed.barrier()
    fresh, fresh_optim = built()
    try:
        restore(folder, fresh, fresh_optim)
    except CheckpointError as e:
        return str(e)
    return "restored"


def _fsdp_reblocked_restore(folder: Path, built: Callable[[], tuple[torch.nn.Module, torch.optim.Optimizer]]) -> bool:
    """A centralized checkpoint (one block of every expert) restored into FSDP2 SPES peers: read whole, re-blocked
    and sharded in place, does every rank's model hold its weights?"""
    cfg = load_config(TINY, [*SMALL_NODE, "--model.moe_num_experts=4", "--using_spes=false"])[0]
    central = Transformer.for_run(cfg)
    central.init_weights(cfg.seed + 1)
    if torch.distributed.get_rank() == 0:
        save_checkpoint(folder, 1, model_state=central.state_dict(), optim_state=None, trainer_state={}, config={})
    torch.distributed.barrier()
    fresh, fresh_optim = built()
    restored = restore(folder, fresh, fresh_optim)
    saved = central.state_dict()
    for name, param in fresh.named_parameters():
        whole = param.full_tensor() if hasattr(param, "full_tensor") else param
        layer, _, block = name.rpartition(".")
        want = saved[f"{layer}.0"][int(block) * 2 : (int(block) + 1) * 2] if ".experts." in name else saved[name]
        if not torch.equal(whole.detach(), want):
            return False
    return restored.reblocked and not fresh_optim.state


def _failing_sharded_save(folder: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> str:
    """What each rank raises when rank 0 cannot finish a sharded save (its last file hits a full disk)."""

    def full_disk(path: Path) -> None:
        raise OSError(28, "No space left on device")

    try:
        save(folder, 2, model, optimizer, trainer_state={}, config={}, sharded=True, extra={"x": full_disk})
    except (OSError, CheckpointError) as e:
        return f"{type(e).__name__}: {e}" + ("" if resolve_checkpoint(folder).name == "step1-sharded" else " (moved)")
    return "saved"


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_fsdp_checkpoints_of_either_kind_restore_every_ranks_shards_exactly(tmp_path: Path) -> None:
    ranks = run_ranks(2, "test_checkpoint:_fsdp_checkpoint_worker", {"folder": str(tmp_path / "ckpt")}, tmp_path)
    folder = tmp_path / "ckpt" / "True"
    failed = [  # rank 0 names the full disk and what to do; rank 1 points to rank 0's log
        f"OutOfRoom: cannot save the checkpoint of step 2 in {folder}: no space left on device; nothing of this save "
        f"was kept ({folder / LATEST} still names step1-sharded); free space on that disk or point save_folder at "
        "another one, then continue with --resume=auto",
        f"CheckpointError: rank 0 failed to finish {folder / 'step2-sharded'}; see its log",
    ]
    shard = tmp_path / "ckpt" / "damaged" / "step1-sharded" / "shard-00001-model-00001-of-00001.safetensors"
    damaged = (  # every rank names the file rank 1 found damaged: torchrun may stop rank 1 before it prints
        f"{shard}: its bytes differ from the checksum meta.json recorded (changed on disk since the save); the "
        f"checkpoint is corrupt, use an earlier checkpoint (there is none in {shard.parent.parent})"
    )
    want = [
        {"sharded": True, "unsharded": True, "read whole": [], "reblocked": True, "damaged": damaged, "failed_save": f}
        for f in failed
    ]
    assert ranks == want


def test_a_kill_while_replacing_a_checkpoint_of_the_same_step_keeps_it_loadable(tmp_path: Path) -> None:
    """Re-saving step N moves the old step<N> aside before the new one takes its name; a kill in between
    leaves `latest` naming a missing directory, so the moved copy is used, and put back by the next save."""
    cfg, model, optimizer = _node()
    _save_unsharded(tmp_path, 1, cfg, model, optimizer)
    os.replace(tmp_path / "step1", tmp_path / ".step1.old-999")  # the state right after the first rename
    assert load_checkpoint(tmp_path).path.name == ".step1.old-999"
    _save_sharded(tmp_path, 2, cfg, model, optimizer)
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step1", "step2-sharded"]
    load_checkpoint(tmp_path / "step1")


def test_checkpoints_of_both_kinds_follow_the_umask(tmp_path: Path) -> None:
    """A shared cluster's other users can read what the umask lets them read (0644/0755 under umask 022)."""
    cfg, model, optimizer = _node()
    old = os.umask(0o022)
    try:
        _save_unsharded(tmp_path, 1, cfg, model, optimizer)
        _save_sharded(tmp_path, 2, cfg, model, optimizer)
    finally:
        os.umask(old)
    modes = {p.relative_to(tmp_path).as_posix(): p.stat().st_mode & 0o777 for p in tmp_path.rglob("*")}
    assert modes and all(m == (0o755 if (tmp_path / p).is_dir() else 0o644) for p, m in modes.items()), modes


@pytest.mark.parametrize("sharded", [False, True])
def test_extra_files_are_part_of_either_kind_and_survive_unsharding(tmp_path: Path, sharded: bool) -> None:
    """What a node adds (an overlapped round in flight) is written before publishing, size-checked, carried along."""
    cfg, model, optimizer = _node(steps=1)
    name = "pending_round.st"  # NOTE: a sharded checkpoint takes every `*.safetensors` file for a shard
    path = save(
        tmp_path / "run",
        1,
        model,
        optimizer,
        trainer_state={"step": 1},
        config=to_dict(cfg),
        sharded=sharded,
        extra={name: lambda p: p.write_bytes(b"in flight")},
    )
    assert path is not None and (path / name).read_bytes() == b"in flight"
    assert json.loads((path / "meta.json").read_text())["extra"] == [name]
    if sharded:
        out = unshard(path, tmp_path / "unsharded")
        assert (out / name).read_bytes() == b"in flight"
        assert json.loads((out / "meta.json").read_text())["extra"] == [name]
    (path / name).write_bytes(b"cut")
    with pytest.raises(CheckpointError, match=f"{name}: missing or truncated"):
        load_checkpoint(path)


def test_a_sharded_save_whose_last_files_fail_raises_that_error_and_keeps_latest(tmp_path: Path) -> None:
    cfg, model, optimizer = _node(steps=1)
    first = save(tmp_path, 1, model, optimizer, trainer_state={}, config={}, sharded=True)

    def full_disk(path: Path) -> None:
        raise OSError(28, "No space left on device")

    with pytest.raises(OSError, match="no space left on device"):
        save(tmp_path, 2, model, optimizer, trainer_state={}, config={}, sharded=True, extra={"x": full_disk})
    assert resolve_checkpoint(tmp_path) == first


# ---------------------------------------------------------------------------------------------------------------
# What a checkpoint's meta.json says (finding one in a save folder is tests/test_save_folder.py's)


def _fake_checkpoint(directory: Path, kind: str = "unsharded") -> Path:
    directory.mkdir(parents=True)
    meta = {"kind": kind, "step": 1, "trainer": {}, "optim_param_groups": [], "files": {}}  # no files listed
    (directory / META_FILE).write_text(json.dumps(meta))
    return directory


def test_the_kind_is_read_from_meta_json_of_a_checkpoint_or_of_what_latest_names(tmp_path: Path) -> None:
    run = tmp_path / "node0"
    _fake_checkpoint(run / "step2")
    _fake_checkpoint(run / "step4-sharded", "sharded")
    (run / LATEST).write_text("step4-sharded\n")
    assert is_sharded(run) and is_sharded(run / "step4-sharded") and not is_sharded(run / "step2")


def test_a_model_of_another_config_is_refused_naming_up_to_three_names_of_each_side(tmp_path: Path) -> None:
    t = torch.zeros(2)
    check_model_compatible({"a": t}, {"a": (2,)}, tmp_path)
    with pytest.raises(CheckpointError) as err:
        check_model_compatible({"a": t}, {"a": t, "b": t, "c": t, "d": t, "e": t}, tmp_path)
    assert str(err.value) == (
        f"{tmp_path}: checkpoint does not match this model config: missing ['b', 'c', 'd'], unexpected [] (was it "
        "written with other model or spes_config keys?)"
    )
    with pytest.raises(CheckpointError, match=r"missing \[\], unexpected \['w', 'x', 'y'\] \(was"):
        check_model_compatible({"a": t, "w": t, "x": t, "y": t, "z": t}, {"a": t}, tmp_path)
    with pytest.raises(CheckpointError, match="tensor a has shape \\(2,\\) in the checkpoint but \\(3,\\) in this"):
        check_model_compatible({"a": t}, {"a": torch.zeros(3)}, tmp_path)


def test_unreadable_metadata_is_refused_naming_the_file(tmp_path: Path) -> None:
    step = _fake_checkpoint(tmp_path / "step1")
    meta = json.loads((step / META_FILE).read_text())
    (step / META_FILE).write_text("{ half")
    with pytest.raises(CheckpointError, match=r"meta.json: unreadable checkpoint metadata \(.*\); use an earlier ch"):
        is_sharded(step)
    damaged = [{**meta, "trainer": 3}, {k: v for k, v in meta.items() if k != "trainer"}, {**meta, "files": []}]
    for other in ("[]", *map(json.dumps, damaged)):  # JSON, but not what a save writes
        (step / META_FILE).write_text(other)
        with pytest.raises(CheckpointError) as err:
            is_sharded(step)
        assert str(err.value) == (
            f"{step / META_FILE}: not a checkpoint's metadata; use an earlier checkpoint (there is none in {tmp_path})"
        )


def test_an_unreadable_saved_config_of_the_recorded_size_is_refused_naming_the_file(tmp_path: Path) -> None:
    cfg, model, optimizer = _node(steps=1)
    path = save(tmp_path, 1, model, optimizer, trainer_state={}, config=to_dict(cfg), sharded=False)
    assert path is not None
    drop_checksums(path)  # a checkpoint saved before checksums: the YAML reader is what refuses it
    saved = path / CONFIG_FILE
    size = saved.stat().st_size
    saved.write_text("{" + " " * (size - 1))  # cut-short YAML, the size meta.json recorded
    with pytest.raises(CheckpointError) as err:
        load_checkpoint(path)
    assert (
        str(err.value)
        == f"{saved}: not valid YAML (expected the node content, but found '<stream end>'); use an earlier checkpoint "
        f"(there is none in {tmp_path})"
    )
    saved.write_text("- 1" + " " * (size - 3))
    with pytest.raises(CheckpointError) as err:
        load_checkpoint(path)
    assert str(err.value) == (
        f"{saved}: not a run config (a YAML mapping); use an earlier checkpoint (there is none in {tmp_path})"
    )


@pytest.mark.parametrize("sharded", [False, True])
def test_optimizer_state_of_another_peer_is_refused_naming_up_to_three_names_of_each_side(
    tmp_path: Path, sharded: bool
) -> None:
    cfg, model, optimizer = _node(steps=1)
    path = save(tmp_path, 1, model, optimizer, trainer_state={}, config=to_dict(cfg), sharded=sharded)
    assert path is not None
    _, other, other_optim = _node("--spes_config.peer_id=1", steps=0)
    with pytest.raises(CheckpointError) as err:
        restore(path, other, other_optim)
    ours = [f"blocks.{i}.ffn.experts.{w}.0" for i in range(2) for w in ("v1", "w1", "w2")]
    theirs = [n.removesuffix(".0") + ".1" for n in ours]
    assert str(err.value) == (
        f"{path}: the optimizer state is for other parameters than this run trains (checkpoint only: "
        f"{sorted(ours)[:3]}, run only: {sorted(theirs)[:3]}); was it written by another spes_config.peer_id or "
        "with using_spes/using_dilico set otherwise?"
    )
    assert restore(path, other, other_optim, with_optim=False).trainer == {}  # the weights alone: any peer's
    _, wider, wider_optim = _node("--model.d_model=64", steps=0)
    with pytest.raises(CheckpointError) as err:
        restore(path, wider, wider_optim)
    assert str(err.value).startswith(f"{path}: tensor ") and "has shape" in str(err.value)


def test_unreadable_tensor_files_of_the_recorded_size_are_refused_naming_the_file(tmp_path: Path) -> None:
    cfg, model, optimizer = _node(steps=1)
    for sharded in (False, True):
        path = save(tmp_path / str(sharded), 1, model, optimizer, trainer_state={}, config={}, sharded=sharded)
        assert path is not None
        [tensors] = [p for p in path.iterdir() if p.name.endswith(".safetensors") and "optim" not in p.name]
        drop_checksums(path)
        tensors.write_bytes(bytes(tensors.stat().st_size))  # zeros: the size meta.json recorded, no header
        what = f"{path}: unreadable shard files (" if sharded else f"{tensors}: not a readable safetensors file ("
        _, fresh, fresh_optim = _node(steps=0)
        for read in (functools.partial(load_checkpoint, path), functools.partial(restore, path, fresh, fresh_optim)):
            with pytest.raises(CheckpointError) as err:
                read()
            assert str(err.value).startswith(what), err.value
            assert str(err.value).endswith(
                f"); the checkpoint is corrupt, use an earlier checkpoint (there is none in {tmp_path / str(sharded)})"
            )
            assert "deserializing header" in str(err.value), "the reader's reason is named"


def _flip_byte(path: Path, at: int) -> None:
    """One bit of the byte `at` bytes from the end flipped: the file keeps its size (a disk's or a copy's error)."""
    data = bytearray(path.read_bytes())
    data[-at] ^= 0x10
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("sharded", [False, True])
def test_a_flipped_byte_in_any_file_is_refused_naming_it_and_the_checkpoint_to_go_back_to(
    tmp_path: Path, sharded: bool
) -> None:
    """A byte flipped in a tensor's data keeps every size and header: without the checksums meta.json records, the
    wrong number was trained on (and a SPES node published it to the server)."""
    cfg, model, optimizer = _node(steps=1)
    first = save(tmp_path, 1, model, optimizer, trainer_state={"step": 1}, config=to_dict(cfg), sharded=sharded)
    path = save(tmp_path, 2, model, optimizer, trainer_state={"step": 2}, config=to_dict(cfg), sharded=sharded)
    assert first is not None and path is not None
    fix = (
        f"the checkpoint is corrupt, use an earlier checkpoint: the newest is step 1, {first} (write {first.name} into"
    )
    for damaged in sorted(p for p in path.iterdir() if p.name != META_FILE):
        original = damaged.read_bytes()
        _flip_byte(damaged, 7)
        _, fresh, fresh_optim = _node(steps=0)
        for read in (load_checkpoint, functools.partial(restore, model=fresh, optimizer=fresh_optim)):
            with pytest.raises(CheckpointError) as err:
                read(tmp_path)
            assert str(err.value) == (
                f"{damaged}: its bytes differ from the checksum meta.json recorded (changed on disk since the save); "
                f"{fix} {tmp_path / LATEST} to resume from it)"
            )
        damaged.write_bytes(original)
    meta = json.loads((path / META_FILE).read_text())
    (path / META_FILE).write_text(json.dumps({**meta, "trainer": {"step": 3}}, indent=1))  # still a meta.json
    with pytest.raises(CheckpointError, match=f"^{path / META_FILE}: damaged \\(its content does not match the check"):
        load_checkpoint(path)
    assert load_checkpoint(first).trainer == {"step": 1}


def test_the_model_alone_is_read_for_export_even_when_the_optimizer_file_is_unreadable(tmp_path: Path) -> None:
    """Export and evaluation read the weights only: a damaged optimizer state does not stop them, as it stops a
    resume."""
    cfg, model, optimizer = _node(steps=1)
    for sharded in (False, True):
        path = save(tmp_path / str(sharded), 1, model, optimizer, trainer_state={}, config={}, sharded=sharded)
        assert path is not None
        _assert_same_state(load_model_state(path), model.state_dict())
    path = tmp_path / "False" / "step1"
    (optim,) = path.glob("optim*.safetensors")
    optim.write_bytes(bytes(optim.stat().st_size))
    _assert_same_state(load_model_state(path), model.state_dict())
    with pytest.raises(CheckpointError, match="optim.safetensors: its bytes differ from the checksum meta.json rec"):
        load_checkpoint(path)


def test_a_failure_inside_dcps_read_is_refused_naming_the_checkpoint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """DCP's own errors (its planner's, its reader's) as one line naming the checkpoint. The checks before DCP
    (sizes, headers, names) refuse every damaged file this test could write, so DCP's failure is injected."""
    import torch.distributed.checkpoint as dcp

    cfg, model, optimizer = _node(steps=1)
    path = save(tmp_path, 1, model, optimizer, trainer_state={}, config={}, sharded=True)
    assert path is not None

    def fail(*args: Any, **kwargs: Any) -> None:
        raise RuntimeError("no storage data for 'model/embeddings.weight'\n  (the planner's details)")

    monkeypatch.setattr(dcp, "load", fail)
    want = (
        f"{path}: cannot read the shards (no storage data for 'model/embeddings.weight'); the checkpoint is "
        f"corrupt, use an earlier checkpoint (there is none in {tmp_path})"
    )
    _, fresh, fresh_optim = _node(steps=0)
    for read in (load_checkpoint, lambda p: restore(p, fresh, fresh_optim)):
        with pytest.raises(CheckpointError) as err:
            read(path)
        assert str(err.value) == want


def test_a_checkpoint_written_without_its_config_reads_as_an_empty_one(tmp_path: Path) -> None:
    cfg, model, optimizer = _node(steps=1)
    path = save(tmp_path, 1, model, optimizer, trainer_state={"step": 1}, config=to_dict(cfg), sharded=False)
    assert path is not None
    drop_checksums(path)
    meta = json.loads((path / META_FILE).read_text())
    del meta["files"][CONFIG_FILE]
    (path / META_FILE).write_text(json.dumps(meta))
    (path / CONFIG_FILE).unlink()
    assert load_checkpoint(path).config == {}
    _, fresh, fresh_optim = _node(steps=0)
    assert restore(path, fresh, fresh_optim).config == {}


def test_a_sharded_checkpoint_of_an_amp_node_reads_back_its_bf16_frozen_experts_as_bf16(tmp_path: Path) -> None:
    """Under amp_bf16 a training node holds its frozen experts in bf16: read whole (unshard, export), a sharded
    checkpoint gives them back as they were saved; without the optimizer, only the model is read."""
    cfg = load_config(TINY, [*SMALL_NODE, *PEER0, "--precision=amp_bf16"])[0]
    model = Transformer.for_run(cfg, training=True)
    model.init_weights(cfg.seed)
    frozen = "blocks.0.ffn.experts.w1.1"
    assert model.state_dict()[frozen].dtype == torch.bfloat16
    optimizer = build_optimizer(model, cfg.optimizer)
    _unit_step(model, optimizer)
    path = save(tmp_path, 1, model, optimizer, trainer_state={}, config={}, sharded=True)
    assert path is not None and load_checkpoint(path).optim is not None
    ckpt = load_checkpoint(path, with_optim=False)
    _assert_same_state(ckpt.model, model.state_dict())
    assert ckpt.model[frozen].dtype == torch.bfloat16 and ckpt.optim is None


def test_meta_listing_a_file_named_empty_or_parent_or_betas_not_numbers_is_refused(tmp_path: Path) -> None:
    """A file named '' or '..' names the step directory or its parent, not a file in it; booleans and strings are
    no Adam betas: each is damaged metadata, refused as such before any file is looked at."""
    step = _fake_checkpoint(tmp_path / "step1")
    meta = json.loads((step / META_FILE).read_text())
    damaged = [
        {**meta, "files": {"": 0}},
        {**meta, "files": {"..": 0}},
        {**meta, "optim_param_groups": [{"betas": [True, 0.95]}]},
        {**meta, "optim_param_groups": [{"betas": ["0.9", "0.95"]}]},
    ]
    for other in damaged:
        (step / META_FILE).write_text(json.dumps(other))
        with pytest.raises(CheckpointError) as err:
            is_sharded(step)
        assert str(err.value) == (
            f"{step / META_FILE}: not a checkpoint's metadata; use an earlier checkpoint (there is none in {tmp_path})"
        )
    (step / META_FILE).write_text(json.dumps({**meta, "optim_param_groups": [{"betas": [0.9, 1]}]}))
    assert not is_sharded(step)  # floats and ints are betas


def test_trainer_state_reads_what_the_latest_save_recorded(tmp_path: Path) -> None:
    for step in (2, 4):
        _fake_checkpoint(tmp_path / f"step{step}")
        meta = json.loads((tmp_path / f"step{step}" / META_FILE).read_text())
        trainer = {"step": step, "tokens": 100 * step, "data": {"epoch": 0}}
        (tmp_path / f"step{step}" / META_FILE).write_text(json.dumps({**meta, "trainer": trainer}))
    (tmp_path / LATEST).write_text("step2")
    assert trainer_state(tmp_path) == {"step": 2, "tokens": 200, "data": {"epoch": 0}}
    assert trainer_state(tmp_path / "step4") == {"step": 4, "tokens": 400, "data": {"epoch": 0}}


# ---------------------------------------------------------------------------------------------------------------
# A disk that fills up


def _save_into_a_filling_disk(folder: str, sharded: bool) -> None:
    """Child of the test below: a first checkpoint, then a second one that finds no room (a file-size limit)."""
    cfg, model, optimizer = _node()
    kwargs: dict[str, Any] = {"trainer_state": {"step": 1}, "config": to_dict(cfg), "sharded": sharded, "keep": 1}
    save(folder, 1, model, optimizer, **kwargs)
    cap_file_size(4096)  # every checkpoint has a bigger file
    try:
        save(folder, 2, model, optimizer, **kwargs)
    except BaseException as e:  # noqa: BLE001 -- the test judges it
        print_failure(e)


@pytest.mark.slow
@pytest.mark.timeout(180)
@pytest.mark.parametrize("sharded", [False, True])
def test_a_save_that_finds_no_room_fails_in_one_line_keeping_the_last_checkpoint(tmp_path: Path, sharded: bool) -> None:
    """A full disk (here: a file-size limit, EFBIG; ENOSPC alike) fails the save as one OSError naming the save folder,
    the checkpoint `latest` still names and the fix; nothing of the failed save is left. Safetensors reported it as its
    own SafetensorError (a traceback, exit 1), DCP as a CheckpointException (leaving its temporary directory)."""
    folder = tmp_path / "run"
    proc, failure = run_child(
        f"import test_checkpoint; test_checkpoint._save_into_a_filling_disk({str(folder)!r}, {sharded})"
    )
    assert failure is not None, proc.stderr
    first = "step1-sharded" if sharded else "step1"
    assert failure["type"] == "OutOfRoom" and failure["errno"] == errno.EFBIG
    assert failure["message"] == (
        f"cannot save the checkpoint of step 2 in {folder}: file too large; nothing of this save was kept "
        f"({folder / LATEST} still names {first}); free space on that disk or point save_folder at another one, then "
        "continue with --resume=auto"
    )
    assert sorted(p.name for p in folder.iterdir()) == [LATEST, first]
    assert load_checkpoint(folder).path == folder / first


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_unsharding_into_a_disk_that_fills_up_fails_in_one_line_leaving_nothing(tmp_path: Path) -> None:
    """`python -m spes.unshard` into a full disk (a file-size limit here): one line naming the directory, exit 2, no
    half-written one (it was safetensors' traceback, exit 1)."""
    cfg, model, optimizer = _node()
    _save_sharded(tmp_path / "run", 1, cfg, model, optimizer)
    out = tmp_path / "unsharded"
    code = "import sys, disk_helpers, spes.unshard; disk_helpers.cap_file_size(4096); "
    proc, _ = run_child(code + f"sys.exit(spes.unshard.main([{str(tmp_path / 'run')!r}, {str(out)!r}]))")
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.splitlines()[-1] == (
        f"error: cannot write the unsharded checkpoint {out}: file too large; nothing half-written is left; free space "
        "on that disk or choose another directory"
    )
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run"]
