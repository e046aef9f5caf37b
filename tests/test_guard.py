"""The non-finite guard on a real (small) corpus: a NaN stops the run naming the step, or is skipped N times in a
row; no checkpoint of NaN weights is written or trained from, and the last good checkpoint survives rotation."""

from __future__ import annotations

import copy
import math
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from disk_helpers import drop_checksums
from dist_helpers import SMALL_NODE, run_logged, run_ranks
from peer_nodes import peer_config, start_peer
from spes.config import load_config
from spes.distributed import DistInfo
from spes.guard import NonFiniteError, NonFiniteSkips, all_finite, check_weights_finite, first_nonfinite_parameter
from spes.node import build_node
from spes.sync.server import spec_of_run
from spes.train import main
from spes.trainer import Trainer
from sync_helpers import running_server

REPO = Path(__file__).resolve().parents[1]
TINY = str(REPO / "configs" / "tiny.yaml")
CPU = DistInfo(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"))
QUIET = ["--using_spes=false", "--eval_interval=null", "--log_interval=1"]


def _trainer(corpus, folder: Path, *extra: str) -> tuple[Trainer, list[str]]:  # type: ignore[no-untyped-def]
    cfg, _ = load_config(TINY, [*corpus.overrides(folder), *QUIET, *extra])
    node = build_node(cfg, CPU, log=lambda _m: None)
    logged: list[str] = []
    trainer = Trainer(
        cfg=cfg, model=node.model, optimizer=node.optimizer, loader=node.loader, info=CPU, log=logged.append
    )
    if node.checkpoint is not None:
        trainer.load_state_dict(node.checkpoint.trainer)
    return trainer, logged


def test_all_finite_and_the_first_bad_parameter() -> None:
    assert all_finite(torch.tensor([1.0, 2.0]), CPU) == (True, [1.0, 2.0])
    assert not all_finite(torch.tensor([1.0, float("inf")]), CPU)[0]
    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2))
    assert first_nonfinite_parameter(model) is None
    with torch.no_grad():
        model[1].bias[0] = float("nan")
    assert first_nonfinite_parameter(model) == "1.bias"


def test_non_finite_weights_are_refused_naming_the_first_and_what_was_refused() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2))
    check_weights_finite(model, "not saving", "never said")  # finite: nothing to say
    with torch.no_grad():
        model[1].weight[1, 0] = float("-inf")
        model[1].bias[0] = float("nan")
    with pytest.raises(NonFiniteError) as err:
        check_weights_finite(model, "not saving the checkpoint of step 3", "resume from step 2")
    assert (
        str(err.value)
        == "not saving the checkpoint of step 3: the model weights hold NaN/inf (1.weight); resume from step 2"
    )


def test_a_nan_step_stops_the_run_naming_it_and_keeps_the_last_checkpoint(tiny_corpus, tmp_path: Path) -> None:
    """The issue's run: with keep=1, a NaN at step 3 must neither be applied nor saved nor delete step2."""
    trainer, _ = _trainer(
        tiny_corpus,
        tmp_path,
        "--max_duration=4st",
        "--save_interval=1",
        "--save_num_checkpoints_to_keep=1",
        "--stop_at=2",
    )
    trainer.fit()
    good = (tmp_path / "step2" / "model.safetensors").read_bytes()
    trainer, _ = _trainer(
        tiny_corpus,
        tmp_path,
        "--max_duration=4st",
        "--save_interval=1",
        "--save_num_checkpoints_to_keep=1",
        f"--load_path={tmp_path}",
    )
    with torch.no_grad():
        next(trainer.model.parameters()).fill_(float("nan"))
    with pytest.raises(NonFiniteError, match=r"^step 3: loss nan / grad_norm nan is not finite; stopped"):
        trainer.fit()
    assert trainer.step == 2
    assert (tmp_path / "latest").read_text().strip() == "step2"
    assert (tmp_path / "step2" / "model.safetensors").read_bytes() == good
    assert not (tmp_path / "step3").exists()


def test_skip_nonfinite_steps_skips_that_many_in_a_row_then_stops(tiny_corpus, tmp_path: Path) -> None:
    trainer, logged = _trainer(
        tiny_corpus, tmp_path, "--max_duration=10st", "--save_interval=null", "--skip_nonfinite_steps=2"
    )
    with torch.no_grad():
        next(trainer.model.parameters()).fill_(float("nan"))
    with pytest.raises(NonFiniteError, match=r"^step 3: .* \(3 steps in a row\)"):
        trainer.fit()
    skipped = [m for m in logged if "update is skipped" in m]
    assert [m.split(":")[0] for m in skipped] == ["warning", "warning"] and "step 2:" in skipped[1]


def test_skips_count_only_bad_steps_in_a_row() -> None:
    skips = NonFiniteSkips(allowed=1, save_folder="runs/x")
    assert skips.check(1, 2.0, 1.0, finite=True) is None
    assert skips.check(2, math.nan, 1.0, finite=False) == (
        "warning: step 2: loss nan / grad_norm 1.0 is not finite; its update is skipped (1 of at most 1 in a row)"
    )
    assert skips.check(3, 2.0, 1.0, finite=True) is None and skips.in_a_row == 0  # a good step ends the streak
    assert skips.check(4, 2.0, math.inf, finite=False) is not None
    with pytest.raises(
        NonFiniteError,
        match=r"^step 5: loss nan / grad_norm inf is not finite \(2 steps in a row\); "
        r"stopped without applying it or saving \(the newest checkpoint in runs/x is untouched\)",
    ):
        skips.check(5, math.nan, math.inf, finite=False)
    with pytest.raises(NonFiniteError, match=r"^step 1: loss nan / grad_norm 1.0 is not finite; stopped"):
        NonFiniteSkips(allowed=0, save_folder="runs/x").check(1, math.nan, 1.0, finite=False)


def test_a_skipped_step_leaves_the_weights_unchanged(tiny_corpus, tmp_path: Path) -> None:
    trainer, _ = _trainer(
        tiny_corpus, tmp_path, "--max_duration=10st", "--save_interval=null", "--skip_nonfinite_steps=1"
    )
    head = dict(trainer.model.named_parameters())["lm_head.weight"]
    with torch.no_grad():
        head[0, 0] = float("inf")  # every logit row meets it: the loss is NaN, the weights stay finite elsewhere
    before = {k: v.clone() for k, v in trainer.model.state_dict().items()}
    metrics = trainer.train_step(next(iter(trainer.loader)))
    assert metrics["loss"] != metrics["loss"] and trainer.step == 1 and trainer.skips.in_a_row == 1
    after = trainer.model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)


def test_a_checkpoint_of_nan_weights_is_refused_at_start_in_one_line(
    tiny_corpus, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    args = [TINY, *tiny_corpus.overrides(tmp_path), *QUIET, "--max_duration=2st", "--save_interval=2"]
    assert main(args) == 0
    weights = tmp_path / "step2" / "model.safetensors"
    tensors = load_file(weights)
    name = sorted(tensors)[0]
    tensors[name] = torch.full_like(tensors[name], float("nan"))
    save_file(tensors, weights)  # same size: the checkpoint still looks complete
    drop_checksums(tmp_path / "step2")  # NOTE: as a checkpoint saved before checksums: the guard is what refuses it
    capsys.readouterr()
    assert main([*args, "--max_duration=4st", "--resume"]) == 4
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "step2" in err and "NaN/inf" in err and name in err, err
    assert not (tmp_path / "step4").exists()


@pytest.mark.slow
@pytest.mark.timeout(180)
@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_every_rank_stops_at_the_same_bad_step(strategy: str, tiny_corpus, tmp_path: Path) -> None:
    """An absurd learning rate overflows the weights at step 1; under DDP/FSDP both ranks agree that step 3 is
    the second bad one in a row (none hangs in a collective) and spes.torchrun ends with that one line, said once."""
    cmd = [
        sys.executable,
        "-m",
        "spes.torchrun",
        "--standalone",
        "--nproc_per_node=2",
        "-m",
        "spes.train",
        TINY,
        *tiny_corpus.overrides(tmp_path),
        *SMALL_NODE,
        *QUIET,
        f"--distributed_strategy={strategy}",
        "--optimizer.learning_rate=1e30",
        "--max_duration=6st",
        "--save_interval=1",
        "--skip_nonfinite_steps=1",
    ]
    proc = run_logged(cmd, tmp_path / "run.log", timeout=150)
    last = proc.stdout.strip().splitlines()[-1]
    assert proc.returncode == 4 and "Traceback" not in proc.stdout, proc.stdout[-3000:]
    assert last.startswith("error: step 3: ") and "(2 steps in a row)" in last, last
    said = [line for line in proc.stdout.splitlines() if line.startswith("error: ") or "failed (exitcode" in line]
    assert said == [last], said  # the ranks leave their lines to spes.torchrun, and torchrun's own is silenced
    saved = sorted(p.name for p in tmp_path.glob("step*"))
    assert saved == (["step1-sharded", "step2-sharded"] if strategy == "fsdp" else ["step1", "step2"]), saved


def first_difference(before: object, after: object, where: str = "") -> str | None:
    """Where two (nested) state dicts first differ (tensors compared element for element), or None."""
    if isinstance(before, torch.Tensor):
        return None if isinstance(after, torch.Tensor) and torch.equal(before, after) else where
    if isinstance(before, dict) and isinstance(after, dict):
        if before.keys() != after.keys():
            return f"{where} keys"
        return next((d for k, v in before.items() if (d := first_difference(v, after[k], f"{where}/{k}"))), None)
    if isinstance(before, (list, tuple)) and isinstance(after, (list, tuple)) and len(before) == len(after):
        return next((d for i, v in enumerate(before) if (d := first_difference(v, after[i], f"{where}/{i}"))), None)
    return None if before == after else where


def test_the_stopping_step_leaves_the_weights_and_the_optimizer_state_unchanged(tiny_corpus, tmp_path: Path) -> None:
    """The README's promise: a non-finite step stops the run *before* its update is applied. After a good step
    (so Adam has moments and a step count to lose), an inf weight makes step 2 NaN: it stops, and the weights
    and the optimizer's whole state are as step 1 left them."""
    trainer, _ = _trainer(tiny_corpus, tmp_path, "--max_duration=10st", "--save_interval=null")
    batches = iter(trainer.loader)
    trainer.train_step(next(batches))
    head = dict(trainer.model.named_parameters())["lm_head.weight"]
    with torch.no_grad():
        head[0, 0] = float("inf")  # every logit row meets it: the loss is NaN, every other weight still finite
    weights = copy.deepcopy(trainer.model.state_dict())
    optimizer = copy.deepcopy(trainer.optimizer.state_dict())
    assert optimizer["state"], "the first step made optimizer state"
    with pytest.raises(NonFiniteError, match=r"^step 2: loss nan / grad_norm nan is not finite; stopped"):
        trainer.train_step(next(batches))
    assert trainer.step == 1
    changed = first_difference(weights, trainer.model.state_dict()) or first_difference(
        optimizer, trainer.optimizer.state_dict()
    )
    assert changed is None, f"the stopping step changed {changed}"


def nan_in_an_unused_row(trainer: Trainer) -> None:
    """NaN in an embedding row no token id reaches (the table is padded past the vocabulary): the weights are not
    finite, yet every loss and gradient norm is, so only the weight check stands between them and disk or wire."""
    with torch.no_grad():
        trainer.model.embed.weight[-1].fill_(float("nan"))


def test_non_finite_weights_with_a_finite_loss_are_never_saved(tiny_corpus, tmp_path: Path) -> None:
    trainer, _ = _trainer(
        tiny_corpus, tmp_path, "--model.embedding_size=4160", "--max_duration=4st", "--save_interval=2"
    )
    nan_in_an_unused_row(trainer)
    with pytest.raises(NonFiniteError, match=r"^not saving the checkpoint of step 2: .*NaN/inf \(embed.weight\)"):
        trainer.fit()
    assert trainer.step == 2 and all(math.isfinite(r["loss"]) for r in trainer.history)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["metrics.jsonl"]  # no step2, no latest, no temporary


def test_non_finite_weights_with_a_finite_loss_are_never_uploaded(tiny_corpus, tmp_path: Path) -> None:
    open_run = spec_of_run(None, ["--spes_config.num_peers=2", "--spes_config.num_train_experts_per_node=4"])
    with running_server(open_run) as (server, addr):  # a server without the run's YAML: it learns the model
        cfg = peer_config(tiny_corpus, tmp_path, addr, 0, "--model.embedding_size=4160", "--max_duration=4st")
        trainer = start_peer(cfg)
        try:
            before = server.service.status()
            nan_in_an_unused_row(trainer)
            with pytest.raises(NonFiniteError, match=r"^not uploading the weights of step 2: .*\(embed.weight\)"):
                trainer.fit()
        finally:
            assert trainer.syncer is not None
            trainer.syncer.close()
        after = server.service.status()
    assert trainer.step == 2 and all(math.isfinite(r["loss"]) for r in trainer.history)
    assert before.peers_joined == [0] and after.bytes_in == before.bytes_in
    assert (after.open_round, after.current_round, list(after.peers_uploaded)) == (-1, -1, [])


def _nan_on_rank_1(args: dict, info: DistInfo) -> list:
    """Rank 1 alone sees a NaN metric and holds a NaN weight, in a plain module and in its own shard of an FSDP2
    module; what each rank's checks conclude."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    bad = info.rank == 1
    finite, _ = all_finite(torch.tensor([1.0, math.nan if bad else 2.0], device=info.device), info)
    plain = torch.nn.Linear(2, 2).to(info.device)
    sharded = fully_shard(torch.nn.Linear(4, 4).to(info.device), mesh=init_device_mesh(info.device.type, (2,)))
    if bad:
        with torch.no_grad():
            plain.bias[0] = math.nan
            sharded.weight.to_local()[0, 0] = math.nan  # type: ignore[operator]
    messages = []
    for model in (plain, sharded):
        try:
            check_weights_finite(model, "not saving", "resume from an earlier checkpoint")
            messages.append(None)
        except NonFiniteError as exc:
            messages.append(str(exc))
    return [finite, messages]


NCCL = pytest.param(
    "nccl",
    marks=[pytest.mark.gpu, pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs, one per rank")],
)


@pytest.mark.slow
@pytest.mark.timeout(180)
@pytest.mark.parametrize("backend", ["gloo", NCCL])
def test_every_rank_agrees_on_one_ranks_nan(backend: str, tmp_path: Path) -> None:
    """The guard's one all-reduce (gloo on the CPU; NCCL on CUDA tensors, as on a GPU node): a NaN on rank 1, in a
    replicated weight or in its shard of an FSDP2 one, stops rank 0 too, which says it came from another rank."""
    results = run_ranks(2, "test_guard:_nan_on_rank_1", {}, tmp_path, backend=backend)
    assert [finite for finite, _ in results] == [False, False]
    said = "not saving: the model weights hold NaN/inf ({}); resume from an earlier checkpoint"
    assert [messages for _, messages in results] == [
        [said.format("on another rank"), said.format("on another rank")],
        [said.format("bias"), said.format("weight")],  # each rank checks only its own shard of an FSDP2 weight
    ]
