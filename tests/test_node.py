"""`spes.node`: the node `python -m spes.train` builds and runs, and what it decides before and around training: the
save folder it claims (refusing one in use or holding another run's saves), the checkpoint it starts from (a resume,
a rewind, `--resume=auto`), its data and vocabulary checks, the line that says its mode and experts, a node its
server would refuse, a signal before the training loop, a requeued or preempted run. Its decisions are tested in this
process, directly where a function makes one (what mutation testing credits), and end to end through the `main` of
`spes.train` or a `python -m spes.train` child where only a run shows them. The command line itself is
tests/test_train.py's."""

from __future__ import annotations

import contextlib
import errno
import json
import os
import re
import signal
import subprocess
import sys
import time
import weakref
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace
from typing import Any, cast

import numpy as np
import pytest
import torch

import spes.node
from data_fixtures import write_token_shard
from dist_helpers import SMALL_NODE, child_env, parameter_server, run_logged
from node_runs import FAST, REPO, TINY, assert_one_line, train
from peer_nodes import CPU
from spes.atomic import LockHeld, hold_lock, lock_holder
from spes.checkpoint import Checkpoint
from spes.config import TrainConfig, load_config
from spes.data import TokenSequenceDataset
from spes.guard import NonFiniteError
from spes.interrupt import Stopped
from spes.node import (
    SAVE_FOLDER_LOCK,
    _another_layout,
    _continues_run,
    _dataset,
    _load,
    _name_latest,
    _trainer_state,
    _training_loader,
    _validation,
    _what_is_saved,
    build_node,
    check_save_folder,
    check_shard_vocab,
    claim_save_folder,
    describe_experts,
    holding_save_folder,
    rejoin,
    start_checkpoint,
    unfinished,
)
from spes.save_folder import META_FILE
from spes.tokenizer import load_tokenizer
from spes.torchrun import ERROR_DIR_ENV
from spes.train import apply_resume, main


def _checkpoints(folder: Path, *names: str, latest: str | None = None) -> Path:
    """`folder` holding a complete-looking checkpoint directory per name, and a `latest` file naming `latest`."""
    for name in names:
        (folder / name).mkdir(parents=True)
        (folder / name / META_FILE).write_text("{}")
    folder.mkdir(parents=True, exist_ok=True)
    if latest is not None:
        (folder / "latest").write_text(f"{latest}\n")
    return folder


@pytest.mark.parametrize(
    ("overrides", "said"),
    [
        (
            ["--spes_config.peer_id=1"],
            "SPES node, peer 1 of 4; experts: trains 2..3 of 8 in every MoE layer, the others frozen",
        ),
        (
            ["--spes_config.peer_id=3", "--spes_config.num_train_experts_per_node=3"],
            "SPES node, peer 3 of 4; experts: trains none (3 per peer leave it none of 8), only the shared parameters",
        ),
        (
            ["--using_dilico=true", "--spes_config.peer_id=2"],
            "DiLoCo node, peer 2 of 4; experts: trains all 8 of every MoE layer",
        ),
        (["--using_spes=false"], "centralized run; experts: trains all 8 of every MoE layer"),
    ],
)
def test_a_node_says_its_mode_and_which_experts_it_trains(overrides: list[str], said: str) -> None:
    """A DiLoCo node's log said only that it trains every expert, as a centralized run's does: never its mode."""
    assert describe_experts(load_config(TINY, overrides)[0]) == said


def test_a_resume_into_another_expert_layout_names_only_the_layouts_settings(tmp_path: Path) -> None:
    """A SPES run's folder resumed as a DiLoCo node: the refusal named every change since the checkpoint as the expert
    layout (a longer max_duration, a token file); only the layout's settings and this run's layout are named."""
    cfg = load_config(TINY, ["--using_dilico=true"])[0]
    changes = [
        "using_dilico: False -> True",
        "max_duration: '5st' -> '60st'",
        "spes_config.token_file: None -> 'token'",
        "spes_config.num_train_experts_per_node: 4 -> 2",
    ]
    assert _another_layout(cfg, tmp_path / "step5", changes) == (
        f"{tmp_path / 'step5'} holds this save_folder's run with another expert layout (using_dilico: False -> True; "
        "spes_config.num_train_experts_per_node: 4 -> 2: this run stores each MoE layer's 8 experts in one block): a "
        "resume continues that run as it was saved; to start this layout from its weights, choose another "
        f"save_folder with --load_path={tmp_path / 'step5'}"
    )
    assert _another_layout(cfg, tmp_path / "step5", changes[1:3]).startswith(  # the layout's keys unchanged
        f"{tmp_path / 'step5'} holds this save_folder's run with another expert layout (this run stores each MoE "
    )


def test_the_checkpoint_a_start_loads_and_what_it_says_of_it(tmp_path: Path) -> None:
    """`--resume=auto` over a save folder holding no checkpoint starts fresh or from load_path, saying which, and
    from the folder's `latest` once it holds one; a resume of a folder holding nothing is refused before the model
    exists, and one whose `latest` names a missing checkpoint is told that instead."""
    save, start = tmp_path / "run", _checkpoints(tmp_path, "start") / "start"

    def begin(*overrides: str) -> tuple[Path | None, list[str]]:
        cfg, _ = load_config(TINY, [f"--save_folder={save}", *overrides])
        logged: list[str] = []
        return start_checkpoint(cfg, logged.append), logged

    assert begin() == (None, [])
    assert begin(f"--load_path={start}") == (start, [])
    assert begin("--try_load_latest_save=true") == (None, [f"no checkpoint in {save} yet: starting fresh"])
    assert begin("--try_load_latest_save=true", f"--load_path={start}") == (
        start,
        [f"no checkpoint in {save} yet: starting from {start}"],
    )
    with pytest.raises(ValueError, match=re.escape(f"nothing to resume: save_folder {save} holds no checkpoint yet")):
        begin(f"--load_path={save}")
    save.mkdir()
    (save / "latest").write_text("step4\n")  # its checkpoint lost: not "nothing to resume"
    with pytest.raises(ValueError, match=re.escape(f"{save / 'latest'} names step4, which is missing or incomplete")):
        begin(f"--load_path={save}")
    _checkpoints(save, "step4", "step8")
    assert begin(f"--load_path={save}") == (save / "step4", [])
    assert begin("--try_load_latest_save=true") == (save / "step4", [])
    passed_over = f"note: resuming save_folder {save}; load_path {start} is not read"
    assert begin("--try_load_latest_save=true", f"--load_path={start}") == (save / "step4", [passed_over])
    (save / "latest").unlink()  # killed after publishing step8, before naming it: its newest
    assert begin(f"--load_path={save}") == (save / "step8", [])


def test_a_checkpoint_continues_the_run_of_the_save_folder_it_lies_in(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A checkpoint in save_folder (named relative or not) continues its run; one elsewhere, or the folder itself
    taken for one, starts a new run from it."""
    monkeypatch.chdir(tmp_path)
    cfg, _ = load_config(TINY, [f"--save_folder={tmp_path / 'out'}"])
    assert _continues_run(cfg, Path("out/step4")) and _continues_run(cfg, tmp_path / "out" / "step4")
    assert not _continues_run(cfg, tmp_path / "other" / "step4")
    assert not _continues_run(cfg, tmp_path / "out")
    assert not _continues_run(cfg, None)


def test_save_overwrite_removes_an_earlier_runs_saves_on_the_main_rank_and_a_dry_run_none(tmp_path: Path) -> None:
    """A resume keeps its own saves; the other ranks and a dry run remove nothing (a dry run says what it would);
    the node's lock is no save. A refusal names four saves and counts the others."""
    folder = _checkpoints(tmp_path / "out", "step2", "step4", "step6", latest="step6")
    (folder / "metrics.jsonl").write_text("")
    (folder / SAVE_FOLDER_LOCK).write_text("")
    everything = sorted(p.name for p in folder.iterdir())
    names = "step2, step4, step6, metrics.jsonl and 1 more"
    with pytest.raises(ValueError, match=re.escape(f"save_folder {folder} already holds a run's saves ({names}): ")):
        claim_save_folder(load_config(TINY, [f"--save_folder={folder}"])[0], False, True, print)
    cfg, _ = load_config(TINY, [f"--save_folder={folder}", "--save_overwrite=true"])
    dry, _ = load_config(TINY, [f"--save_folder={folder}", "--save_overwrite=true", "--dry_run=true"])
    logged: list[str] = []
    claim_save_folder(cfg, continuing=True, is_main=True, log=logged.append)
    claim_save_folder(dry, continuing=False, is_main=True, log=logged.append)
    claim_save_folder(cfg, continuing=False, is_main=False, log=logged.append)
    assert sorted(p.name for p in folder.iterdir()) == everything
    claim_save_folder(cfg, continuing=False, is_main=True, log=logged.append)
    assert [p.name for p in folder.iterdir()] == [SAVE_FOLDER_LOCK]
    removed = f"save_overwrite: removed the earlier run's saves in {folder} ({names})"
    assert logged == [
        f"dry run: save_overwrite would remove the earlier run's saves in {folder} ({names})",
        removed,
        removed,
    ]
    claim_save_folder(load_config(TINY, [f"--save_folder={folder}"])[0], False, True, logged.append)  # nothing left
    four = _checkpoints(tmp_path / "four", "step2", "step4", latest="step4")
    (four / "metrics.jsonl").write_text("")
    with pytest.raises(ValueError, match=r"saves \(step2, step4, metrics\.jsonl, latest\): continue"):
        claim_save_folder(load_config(TINY, [f"--save_folder={four}"])[0], False, True, print)


def test_the_main_rank_holds_its_save_folder_while_it_runs_and_the_others_hold_nothing(tmp_path: Path) -> None:
    """Only the main rank, which writes the folder, locks it (a dry run writes nothing); a second holder is refused
    naming this process, and the lock goes with the node."""
    folder = tmp_path / "out"
    cfg, _ = load_config(TINY, [f"--save_folder={folder}"])
    dry, _ = load_config(TINY, [f"--save_folder={folder}", "--dry_run=true"])
    for other, info in ((cfg, replace(CPU, rank=1, world_size=2, local_rank=1)), (dry, CPU)):
        with holding_save_folder(other, info, print):
            assert not folder.exists()
    with holding_save_folder(cfg, CPU, print):
        with pytest.raises(LockHeld):
            os.close(hold_lock(folder / SAVE_FOLDER_LOCK))
        with pytest.raises(
            ValueError, match=re.escape(f"save_folder {folder} is in use by another node ({lock_holder()})")
        ):
            with holding_save_folder(cfg, CPU, print):
                pass
    os.close(hold_lock(folder / SAVE_FOLDER_LOCK))


def test_a_save_folder_no_rank_can_write_is_refused_and_one_that_cannot_be_locked_is_warned_of(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The nearest existing folder above it must be writable and searchable here (checked by every rank); a
    filesystem without flock (some Lustre mounts) must not stop a run."""
    folder = tmp_path / "new" / "run"
    cfg, _ = load_config(TINY, [f"--save_folder={folder}"])
    writable = os.access
    monkeypatch.setattr(spes.node.os, "access", lambda path, mode: path != tmp_path or mode != os.W_OK | os.X_OK)
    with pytest.raises(ValueError, match=re.escape(f"save_folder {folder}: {tmp_path} is not writable here; choose")):
        with holding_save_folder(cfg, replace(CPU, rank=1, world_size=2, local_rank=1), print):
            pass
    monkeypatch.setattr(spes.node.os, "access", writable)

    def no_flock(path: Path) -> int:
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(spes.node, "hold_lock", no_flock)
    logged: list[str] = []
    with holding_save_folder(cfg, CPU, logged.append):
        logged.append("ran")
    assert logged == [
        f"warning: cannot lock save_folder {folder} (No locks available): nothing keeps a second node out of it",
        "ran",
    ]


def test_a_rewind_points_latest_at_the_checkpoint_it_continues_and_names_the_newer_ones_kept(tmp_path: Path) -> None:
    """By name (load_path may be relative); every rank says so, the main rank writes it; nothing when `latest`
    names it already or the checkpoint is none of the folder's (a copy a killed save moved aside)."""
    folder = _checkpoints(tmp_path / "out", "step4", "step8", "step12", latest="step12")
    logged: list[str] = []
    _name_latest(folder, Path("elsewhere/step4"), is_main=False, log=logged.append)
    assert (folder / "latest").read_text() == "step12\n"
    _name_latest(folder, Path("elsewhere/step4"), is_main=True, log=logged.append)
    assert (folder / "latest").read_text() == "step4\n"
    note = f"note: {folder / 'latest'} now names step4, which this run continues"
    assert logged == [f"{note}; step8, step12 (from before it) stay until this run saves those steps"] * 2
    logged.clear()
    _name_latest(folder, folder / "step4", is_main=True, log=logged.append)
    _name_latest(folder, folder / ".step8.aside", is_main=True, log=logged.append)
    assert logged == [] and (folder / "latest").read_text() == "step4\n"
    (folder / "latest").unlink()
    _name_latest(folder, folder / "step12", is_main=True, log=logged.append)
    assert (folder / "latest").read_text() == "step12\n"
    assert logged == [f"note: {folder / 'latest'} now names step12, which this run continues"]


def test_an_unsaved_interrupt_names_the_checkpoint_a_restart_continues_from(tmp_path: Path) -> None:
    """The folder's `latest` (or, without it, its newest checkpoint); none yet; or why `latest` cannot be loaded."""
    folder = tmp_path / "out"
    none_yet = f"save_folder {folder} holds no checkpoint yet: start again with --resume=auto (it starts afresh then)"
    assert _what_is_saved(folder) == none_yet
    folder.mkdir()
    assert _what_is_saved(folder) == none_yet
    (folder / "latest").write_text("step4\n")
    assert _what_is_saved(folder).startswith(f"{folder / 'latest'} names step4, which is missing or incomplete; ")
    _checkpoints(folder, "step4", "step8")
    continue_from = "continue from it with --resume or --resume=auto"
    assert _what_is_saved(folder) == f"save_folder {folder}'s latest checkpoint is step4: {continue_from}"
    (folder / "latest").unlink()
    assert _what_is_saved(folder) == f"save_folder {folder}'s latest checkpoint is step8: {continue_from}"


TRAINER = {"step": 4, "tokens": 1024, "rng": "generators", "data": {"seed": 6198}}
"""A checkpoint's trainer state at step 4 (configs/tiny.yaml warms up for 5 steps)."""


@pytest.mark.parametrize(
    ("continuing", "overrides", "state", "said"),
    [
        (True, [], TRAINER, ""),
        (True, ["--reset_optimizer_state=true"], TRAINER, "ignored"),
        (True, ["--reset_trainer_state=true"], TRAINER, "ignored"),
        (True, ["--restore_dataloader=false"], TRAINER, "ignored"),
        (False, [], TRAINER, ""),
        (False, ["--reset_trainer_state=true"], {}, "weights, optimizer state; starting at step 0"),
        (False, ["--restore_dataloader=false"], {"rng": "generators"}, "weights, optimizer state; starting at step 0"),
        (
            False,
            ["--reset_optimizer_state=true"],
            {**TRAINER, "lr_rewarm": [4, 9]},
            "weights, trainer state; starting at step 4, learning rate warming up again until step 9",
        ),
        (
            False,
            ["--reset_optimizer_state=true", "--restore_dataloader=false"],
            {"rng": "generators", "lr_rewarm": [0, 5]},
            "weights; starting at step 0, learning rate warming up again until step 5",
        ),
        (False, ["--reset_optimizer_state=true", "--reset_trainer_state=true"], {}, "weights; starting at step 0"),
    ],
)
def test_the_trainer_state_a_start_takes_up_from_its_checkpoint(
    tmp_path: Path, continuing: bool, overrides: list[str], state: dict[str, Any], said: str
) -> None:
    """OLMo's reset_* and restore_dataloader keys, taken up by a new run from the checkpoint and ignored, with a
    note, by a resume; the checkpoint's own state is left as it was."""
    cfg, _ = load_config(TINY, [f"--save_folder={tmp_path}", *overrides])
    ckpt = Checkpoint(path=tmp_path / "step4", model={}, optim=None, trainer=dict(TRAINER), config={})
    logged: list[str] = []
    assert _trainer_state(cfg, ckpt, continuing, logged.append) == state and ckpt.trainer == TRAINER
    ignored = (
        f"note: {ckpt.path} continues this save_folder's run, so reset_optimizer_state, reset_trainer_state and "
        "restore_dataloader=false are ignored (as OLMo does on a resume)"
    )
    assert logged == ([] if not said else [ignored] if said == "ignored" else [f"from {ckpt.path}: {said}"])


def test_reset_flags_without_a_load_path_are_noted_and_nothing_is_loaded(tmp_path: Path) -> None:
    model = torch.nn.Linear(2, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    note = "note: reset_optimizer_state / reset_trainer_state change nothing without a load_path (as in OLMo)"
    for overrides, said in (
        ([], []),
        (["--reset_optimizer_state=true"], [note]),
        (["--reset_trainer_state=true"], [note]),
        (["--restore_dataloader=false"], []),
    ):
        cfg, _ = load_config(TINY, [f"--save_folder={tmp_path}", *overrides])
        logged: list[str] = []
        assert _load(cfg, None, False, model, optimizer, logged.append) is None and logged == said, overrides


@pytest.mark.parametrize(
    ("continuing", "overrides", "with_optim", "trainer"),
    [
        (False, [], True, {"step": 4}),
        (False, ["--reset_optimizer_state=true"], False, {"step": 4}),
        (False, ["--reset_trainer_state=true"], True, {"step": 4}),
        (True, ["--reset_optimizer_state=true"], True, {"step": 4}),
        (True, [], True, {}),
    ],
)
def test_a_load_reads_the_optimizer_unless_a_new_run_resets_it_and_says_the_step_and_changes(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    continuing: bool,
    overrides: list[str],
    with_optim: bool,
    trainer: dict[str, Any],
) -> None:
    """reset_optimizer_state skips the saved optimizer only for a new run (a resume keeps it, as OLMo); the start
    says the step it loaded (0 for a checkpoint recording none) and, on a resume alone, each setting changed since;
    the trainer state returned is what that start takes up."""
    cfg, _ = load_config(TINY, [f"--save_folder={tmp_path}", "--seed=5", "--data.seed=7", *overrides])
    saved = {**spes.node.to_dict(cfg), "seed": 4, "data": {**spes.node.to_dict(cfg)["data"], "seed": 6}}
    asked: list[bool] = []

    def restore(path: Path, model: Any, optimizer: Any, *, with_optim: bool) -> Checkpoint:
        asked.append(with_optim)
        return Checkpoint(path=path, model={}, optim=None, trainer=dict(trainer), config=saved)

    monkeypatch.setattr(spes.node, "restore", restore)
    model, logged = torch.nn.Linear(2, 2), cast(list[str], [])
    ckpt = _load(cfg, tmp_path / "step4", continuing, model, torch.optim.SGD(model.parameters()), logged.append)
    assert asked == [with_optim] and ckpt is not None
    assert ckpt.trainer == _trainer_state(cfg, replace(ckpt, trainer=dict(trainer)), continuing, lambda _msg: None)
    changed = "resuming with 2 setting(s) changed since that checkpoint: seed: 4 -> 5; data.seed: 6 -> 7"
    assert logged[0] == f"loaded {tmp_path / 'step4'} (step {trainer.get('step', 0)})"
    assert (changed in logged) == continuing
    model.weight.data[0, 0] = float("nan")
    with pytest.raises(NonFiniteError) as refused:
        _load(cfg, tmp_path / "step4", continuing, model, torch.optim.SGD(model.parameters()), logged.append)
    assert str(refused.value) == (
        f"checkpoint {tmp_path / 'step4'}: the model weights hold NaN/inf (weight); pass an earlier checkpoint as "
        "load_path"
    )


def test_shards_of_another_vocabulary_are_refused_naming_the_first_and_its_key(tmp_path: Path) -> None:
    """A bare OLMo file records no vocabulary and passes; the refusal names the key the shard came from."""
    tokens = np.arange(256, dtype=np.uint16)
    bare = write_token_shard(tmp_path / "bare.npy", tokens, with_sidecar=False)
    same = write_token_shard(tmp_path / "same.npy", tokens, vocab_size=4096)
    small = write_token_shard(tmp_path / "small.npy", tokens, vocab_size=300)
    large = write_token_shard(tmp_path / "large.npy", tokens, vocab_size=50280)
    check_shard_vocab(TokenSequenceDataset([bare, same], 64), 4096)
    with pytest.raises(ValueError) as refused:
        check_shard_vocab(TokenSequenceDataset([bare, same, small, large], 64), 4096, "data.validation_paths")
    assert str(refused.value) == (
        f"token shard {small} was written with a vocabulary of 300 but the tokenizer has 4096 (model.vocab_size); "
        "re-tokenize it with tokenizer.identifier's tokenizer or drop it from data.validation_paths"
    )
    with pytest.raises(ValueError, match=r"large\.npy was written with a vocabulary of 50280 .* from data\.paths$"):
        check_shard_vocab(TokenSequenceDataset([same, large], 64), 4096)


def test_the_training_loader_says_its_data_seed_and_warns_of_shards_of_another_tokenizer(
    tiny_corpus, tmp_path: Path
) -> None:
    """This rank's share of the global batch, in the order of `data.seed` (else `seed`, said so); shards whose
    sidecar records another tokenizer's fingerprint are trained on with a warning (their vocabulary fits)."""
    other = write_token_shard(tmp_path / "other.npy", np.arange(4096, dtype=np.uint16), vocab_size=4096)
    cfg, _ = load_config(TINY, [*tiny_corpus.overrides(tmp_path / "out"), "--data.seed=7", "--data.drop_last=false"])
    logged: list[str] = []
    loader = _training_loader(cfg, replace(CPU, rank=1, world_size=2), logged.append)
    assert logged == ["data order seed 7 (data.seed)"]
    assert (loader.batch_size, loader.seed, loader.rank, loader.world_size) == (cfg.global_train_batch_size, 7, 1, 2)
    assert (loader.drop_last, loader.num_workers, loader.dataset.seq_len) == (False, cfg.data.num_workers, 64)
    cfg, _ = load_config(
        TINY, [*tiny_corpus.overrides(tmp_path / "out"), f"--data.paths=[{other}]", "--data.seed=null"]
    )
    logged.clear()
    _training_loader(cfg, CPU, logged.append)
    fingerprint = load_tokenizer(str(tiny_corpus.tokenizer)).fingerprint[:12]
    assert logged == [
        f"warning: the training shards were written with another tokenizer (fingerprint 000000000000) than "
        f"{tiny_corpus.tokenizer} ({fingerprint}); check data.paths and tokenizer.identifier",
        "data order seed 6198 (seed (data.seed unset))",
    ]


def test_validation_batches_come_from_data_validation_paths_or_not_at_all(tmp_path: Path) -> None:
    """None without validation data or evaluations; a fresh iterator of `eval_subset_num_batches` batches (-1: all)
    each call; held-out data of no full window, or a path naming nothing, refused naming data.validation_paths."""
    shard = write_token_shard(tmp_path / "valid.npy", np.arange(64 * 20, dtype=np.uint16), vocab_size=4096)
    short = write_token_shard(tmp_path / "short.npy", np.arange(63, dtype=np.uint16), vocab_size=4096)

    def validation(*overrides: str) -> Callable[[], Any] | None:
        cfg, _ = load_config(TINY, [f"--data.validation_paths=[{shard}]", *overrides])
        return _validation(cfg)

    assert validation("--eval_interval=null") is None and validation("--data.validation_paths=[]") is None
    batches = validation("--eval_subset_num_batches=2")
    assert batches is not None
    assert [len(b) for b in batches()] == [8, 8] and [len(b) for b in batches()] == [8, 8]
    every = validation("--eval_subset_num_batches=-1")
    assert every is not None and [len(b) for b in every()] == [8, 8, 4]
    with pytest.raises(ValueError, match=r"^data\.validation_paths hold no sequence of 64 tokens: add validation"):
        validation(f"--data.validation_paths=[{short}]")
    with pytest.raises(FileNotFoundError, match=r"^data\.validation_paths: data path '.*nope\.npy' does not exist"):
        validation(f"--data.validation_paths=[{tmp_path / 'nope.npy'}]")
    cfg, _ = load_config(TINY, [f"--data.paths=[{tmp_path}/nothing/*.npy]"])
    with pytest.raises(FileNotFoundError, match=r"^data\.paths: data path pattern .* matches no file"):
        _dataset(cfg, "paths")
    with pytest.raises(ValueError, match=r"^data\.paths: data\.paths is empty"):
        _dataset(load_config(TINY, ["--data.paths=[]"])[0], "paths")


def test_a_save_folder_holding_only_an_incomplete_checkpoint_is_refused_naming_save_folder(tmp_path: Path) -> None:
    """`--resume=auto`, and the line after an unsaved interrupt, over a folder whose `latest` names a checkpoint
    that never completed tell the user to point save_folder (the key they set) elsewhere; a plain resume of an
    empty folder says how to start afresh instead."""
    save = tmp_path / "run"
    (save / "step4").mkdir(parents=True)  # killed before its metadata was written
    (save / "latest").write_text("step4\n")
    refusal = (
        f"{save / 'latest'} names step4, which is missing or incomplete; {save} holds no complete checkpoint: point "
        f"save_folder at another one, or remove {save / 'latest'} to start that save folder afresh"
    )
    cfg, _ = load_config(TINY, [f"--save_folder={save}", "--try_load_latest_save=true"])
    with pytest.raises(ValueError) as refused:
        start_checkpoint(cfg, print)
    assert str(refused.value) == refusal and _what_is_saved(save) == refusal
    empty = tmp_path / "empty"
    cfg, _ = load_config(TINY, [f"--save_folder={empty}", f"--load_path={empty}"])
    with pytest.raises(ValueError) as refused:
        start_checkpoint(cfg, print)
    assert str(refused.value) == (
        f"nothing to resume: save_folder {empty} holds no checkpoint yet (--resume, or load_path naming it); "
        "use --resume=auto, which starts afresh when there is none, or drop --resume"
    )


def test_validation_data_of_no_full_window_is_refused_saying_how_to_train_without_it(tmp_path: Path) -> None:
    """The refusal names the exact setting that drops validation, as the user would type it."""
    short = write_token_shard(tmp_path / "short.npy", np.arange(63, dtype=np.uint16), vocab_size=4096)
    cfg, _ = load_config(TINY, [f"--data.validation_paths=[{short}]"])
    with pytest.raises(ValueError) as refused:
        _validation(cfg)
    assert str(refused.value) == (
        "data.validation_paths hold no sequence of 64 tokens: add validation data, or set "
        "data.validation_paths=[] to train without validation"
    )


@pytest.mark.parametrize(("url_reads", "ranged"), [("range", True), ("download", False)])
def test_a_dataset_reads_urls_as_data_url_reads_says_with_the_configured_dtype_and_vocabulary(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, url_reads: str, ranged: bool
) -> None:
    """url_reads=download must fetch whole files (a server without range requests), range must not; the windows
    are read as memmap_dtype and checked against model.vocab_size."""
    shard = write_token_shard(tmp_path / "train.npy", np.arange(256, dtype=np.uint16), vocab_size=4096)
    asked: list[dict[str, Any]] = []
    resolve = spes.node.resolve_paths

    def recording(paths: Any, **kwargs: Any) -> Any:
        asked.append(kwargs)
        return resolve(paths, **kwargs)

    monkeypatch.setattr(spes.node, "resolve_paths", recording)
    cfg, _ = load_config(TINY, [f"--data.paths=[{shard}]", f"--data.url_reads={url_reads}"])
    dataset = _dataset(cfg, "paths")
    assert asked == [{"ranged": ranged}]
    assert (dataset.memmap_dtype, dataset.vocab_size) == ("uint16", 4096)


def test_the_training_loader_takes_its_workers_and_pinning_from_data(
    tiny_corpus, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """data.num_workers and data.pin_memory reach the loader (pinning is dropped, and said so, without an
    accelerator)."""
    overrides = [*tiny_corpus.overrides(tmp_path / "out"), "--data.num_workers=2", "--data.pin_memory=true"]
    with caplog.at_level("INFO", logger="spes.data"):
        loader = _training_loader(load_config(TINY, overrides)[0], CPU, lambda _msg: None)
    assert loader.num_workers == 2
    accelerated = torch.accelerator.is_available()
    assert loader.pin_memory == accelerated
    assert ("batches are not pinned" in caplog.text) != accelerated


def test_a_nodes_trainer_evaluates_its_validation_data_and_syncs_through_its_syncer(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The trainer `python -m spes.train` fits gets the node's validation batches, its syncer and its log: without
    them a node would never evaluate, or never sync a round."""
    monkeypatch.setattr(spes.node, "Trainer", lambda **kwargs: kwargs)
    parts: dict[str, Any] = {"model": "model", "optimizer": "opt", "loader": "loader", "eval_batches": "evals"}
    given = spes.node.node_trainer(
        cast(Any, "cfg"), spes.node.Node(**parts, checkpoint=None), CPU, syncer=cast(Any, "syncer"), log=print
    )
    assert given == {
        "cfg": "cfg",
        "model": "model",
        "optimizer": "opt",
        "loader": "loader",
        "info": CPU,
        "eval_batches": "evals",
        "syncer": "syncer",
        "log": print,
    }


class _Trainer:
    """What `rejoin` reads and calls of a trainer: its step and the rounds it is handed."""

    def __init__(self, step: int) -> None:
        self.step, self.rounds = step, cast(list[str], [])

    def resumed_round(self, result: str) -> None:
        self.rounds.append(result)


class _Syncer:
    """What `rejoin` asks of a node's side of the rounds: the round held in flight, then the run's latest."""

    def __init__(self, landed: str | None, behind: str | None) -> None:
        self.landed, self.behind, self.asked = landed, behind, cast(list[tuple[Any, ...]], [])

    def resume(self, checkpoint: Path, step: int) -> str | None:
        self.asked.append(("resume", checkpoint, step))
        return self.landed

    def catch_up(self, step: int) -> str | None:
        self.asked.append(("catch_up", step))
        return self.behind


@pytest.mark.parametrize(
    ("step", "landed", "behind", "asked", "rounds"),
    [
        (None, "r4", "r8", [("catch_up", 0)], ["r8"]),
        (0, "r4", None, [("catch_up", 0)], []),
        (4, "r4", "r8", [("resume", 4), ("catch_up", 4)], ["r4", "r8"]),
        (4, None, None, [("resume", 4), ("catch_up", 4)], []),
    ],
)
def test_a_joined_node_takes_the_round_it_held_in_flight_then_the_runs_latest(
    tmp_path: Path,
    step: int | None,
    landed: str | None,
    behind: str | None,
    asked: list[tuple[Any, ...]],
    rounds: list[str],
) -> None:
    """The round in flight is asked for only from a checkpoint of a step past 0 (not a reset one); the run's latest
    round, whatever the start."""
    path = tmp_path / "step4"
    ckpt = None if step is None else Checkpoint(path=path, model={}, optim=None, trainer={"step": step}, config={})
    trainer, syncer, logged = _Trainer(step or 0), _Syncer(landed, behind), cast(list[str], [])
    rejoin(cast(Any, trainer), cast(Any, syncer), ckpt, logged.append)
    assert [tuple(a for a in call if a != path) for call in syncer.asked] == asked
    assert all(call[1] == path for call in syncer.asked if call[0] == "resume") and trainer.rounds == rounds
    applied = ["step 4: applied the round the interrupted run was waiting for"] if landed and step else []
    assert logged == applied


class _Joined:
    """A node's side of the rounds as `start_node` builds it: what it was built with, and whether it joined."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.args, self.kwargs, self.joined = args, kwargs, False

    def join(self) -> None:
        self.joined = True


class _Fitted:
    """The trainer `start_node` returns: the trainer state it was handed."""

    def __init__(self) -> None:
        self.loaded = cast(list[dict[str, Any]], [])

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.loaded.append(state)


@pytest.mark.parametrize("saved", [True, False])
def test_a_started_node_joins_under_its_checkpoints_run_id_and_resumes_its_trainer_and_round(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, saved: bool
) -> None:
    """The syncer is built for this node's model under the run id its checkpoint recorded (none for a fresh start),
    joins, and the trainer syncing through it takes up the checkpoint's state and then its round in flight."""
    ckpt = Checkpoint(path=tmp_path / "step4", model={}, optim=None, trainer={"step": 4}, config={}) if saved else None
    node = spes.node.Node(
        model=torch.nn.Linear(2, 2),
        optimizer=cast(Any, "opt"),
        loader=cast(Any, "loader"),
        eval_batches=None,
        checkpoint=ckpt,
    )
    trainer, calls = _Fitted(), cast(list[tuple[Any, ...]], [])
    monkeypatch.setattr(spes.node, "build_node", lambda *args: calls.append(("build", *args)) or node)
    monkeypatch.setattr(
        "spes.sync.peer.PeerSync", _Joined
    )  # NOTE: first: importing spes.sync.peer binds the real read_run_id
    monkeypatch.setattr("spes.sync.node_files.read_run_id", lambda path: f"run of {path.name}")
    monkeypatch.setattr(
        spes.node, "node_trainer", lambda *args, **kwargs: calls.append(("trainer", *args, kwargs)) or trainer
    )
    monkeypatch.setattr(spes.node, "rejoin", lambda *args: calls.append(("rejoin", *args)))
    cfg, log = load_config(TINY, [f"--save_folder={tmp_path}"])[0], cast(list[str], []).append
    fitted, syncer = spes.node.start_node(cfg, CPU, log)
    assert fitted is trainer and isinstance(syncer, _Joined) and syncer.joined
    assert syncer.args == (cfg, node.model, CPU) and syncer.kwargs == {
        "log": log,
        "run_id": "run of step4" if saved else None,
    }
    assert calls == [
        ("build", cfg, CPU, log),
        ("trainer", cfg, node, CPU, {"syncer": syncer, "log": log}),
        ("rejoin", trainer, syncer, ckpt, log),
    ]
    assert trainer.loaded == ([{"step": 4}] if saved else [])


def test_a_dry_runs_start_checks_evaluators_in_scratch_and_builds_then_closes_its_syncer(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A dry run writes nothing into save_folder: the evaluators are checked against a scratch folder; the syncer
    is built as a real start builds it (config, model, info, log) and closed at once."""
    seen: list[tuple[Any, ...]] = []
    monkeypatch.setattr(spes.node, "evaluators_of", lambda cfg, info, log: seen.append((cfg.save_folder, info, log)))
    monkeypatch.setattr("spes.sync.peer.PeerSync", _Joined)
    monkeypatch.setattr(_Joined, "close", lambda self: seen.append(("closed", *self.args, self.kwargs)), raising=False)
    cfg, log = load_config(TINY, [f"--save_folder={tmp_path}"])[0], cast(list[str], []).append
    node = spes.node.Node(cast(Any, "model"), cast(Any, "opt"), cast(Any, "loader"), None, None)
    spes.node._check_start(cfg, node, CPU, log)
    (scratch, info, logged), closed = seen
    assert scratch != str(tmp_path) and not Path(scratch).exists() and (info, logged) == (CPU, log)
    assert closed == ("closed", cfg, "model", CPU, {"log": log})


class _Done:
    """A trainer whose fit ends at once: the step, tokens and optimizer state the last line says."""

    def __init__(self) -> None:
        self.step, self.tokens = 12, 3072
        self.optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(2**18))], momentum=0.9)
        self.optimizer.state[self.optimizer.param_groups[0]["params"][0]]["momentum_buffer"] = torch.zeros(3 * 2**18)

    def fit(self) -> None:
        pass


@pytest.mark.parametrize(("strategy", "noted"), [("fsdp", True), ("ddp", True), ("single", False)])
def test_a_one_process_run_notes_an_unwrapped_strategy_and_ends_saying_its_step_and_optimizer_state(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], strategy: str, noted: bool
) -> None:
    """fsdp or ddp on one process wraps nothing (said, with how to shard); the last line of a fit names its step,
    tokens and optimizer state in MiB."""
    monkeypatch.setattr(spes.node, "start_node", lambda *_args: (_Done(), None))
    cfg, _ = load_config(TINY, [f"--save_folder={tmp_path}", f"--distributed_strategy={strategy}", "--max_duration=12"])
    spes.node._train(cfg, CPU, [])
    note = (
        f"note: distributed_strategy={strategy} on one process: the model is not wrapped (one rank holds all of it "
        "either way) and checkpoints are unsharded; launch with torchrun --nproc_per_node=N to shard or replicate it\n"
    )
    assert capsys.readouterr().out == (note if noted else "") + "done: step 12, 3,072 tokens, optimizer state 3.0 MiB\n"


class _Stopping(_Done):
    """A trainer stopped by a signal once its step 8 was saved."""

    def fit(self) -> None:
        raise Stopped(8)


class _Closing:
    """A node's side of the rounds that records its close."""

    def __init__(self) -> None:
        self.closed = False

    def close(self) -> None:
        self.closed = True


def test_a_node_stopped_by_a_signal_leaves_spes_torchrun_its_line_and_closes_its_syncer(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The line spes.torchrun prints for a stopped node names the step saved, where, and both ways to continue."""
    syncer = _Closing()
    monkeypatch.setattr(spes.node, "start_node", lambda *_args: (_Stopping(), syncer))
    monkeypatch.setenv(ERROR_DIR_ENV, str(tmp_path))
    monkeypatch.delenv("RANK", raising=False)
    cfg, _ = load_config(TINY, [f"--save_folder={tmp_path / 'out'}"])
    with pytest.raises(Stopped):
        spes.node._train(cfg, CPU, [])
    assert syncer.closed and (tmp_path / "rank0.stopped.txt").read_text() == (
        f"error: saved step 8's checkpoint in {tmp_path / 'out'} and stopped; continue with --resume (or "
        "--resume=auto)\n"
    )


@pytest.mark.parametrize("rank", [0, 1])
def test_a_dry_run_checks_the_node_it_built_and_only_the_main_rank_speaks(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], rank: int
) -> None:
    """Notes, the build's and the start check's lines and the dry run's last line come from the main rank alone
    (each rank of a node builds it); the start is checked on the node just built."""
    node = spes.node.Node(cast(Any, "model"), cast(Any, "opt"), cast(Any, "loader"), None, None)

    def build(cfg: Any, info: Any, log: Callable[[str], None] = print) -> spes.node.Node:
        log("built")
        return node

    def check(cfg: Any, built: spes.node.Node, info: Any, log: Callable[[str], None]) -> None:
        assert built is node
        log("checked")

    monkeypatch.setattr(spes.node, "build_node", build)
    monkeypatch.setattr(spes.node, "_check_start", check)
    cfg, _ = load_config(TINY, [f"--save_folder={tmp_path}", "--dry_run=true"])
    spes.node._train(cfg, replace(CPU, rank=rank, world_size=2, local_rank=rank), ["note: from the command line"])
    said = [
        "note: from the command line",
        "built",
        "checked",
        "dry run: built the node (str, data, optimizer) and checked its save folder, run spec and evaluators; not "
        "training (dry_run=true)",
    ]
    assert capsys.readouterr().out.splitlines() == (said if rank == 0 else [])


@pytest.mark.parametrize("failed", [False, True])
def test_a_run_shuts_its_process_group_down_cleanly_only_when_it_finished(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, failed: bool
) -> None:
    """The run settles its device defaults for the device its process group chose and holds its save folder
    (its refusals printed); a clean shutdown only after a finished run, and after a failure only once the failing
    frames' references (the DDP wrapper) are gone."""
    cuda, seen = replace(CPU, device=torch.device("cuda")), cast(list[tuple[Any, ...]], [])
    held: list[weakref.ref[torch.nn.Module]] = []
    cfg, _ = load_config(TINY, [f"--save_folder={tmp_path}"])
    monkeypatch.setattr(spes.node, "init_distributed", lambda given: seen.append(("init", given)) or cuda)

    @contextlib.contextmanager
    def holding(given: TrainConfig, info: Any, log: Callable[[str], None]) -> Iterator[None]:
        seen.append(("hold", given.fused_loss, info, log))
        yield

    def train(*_args: Any) -> None:
        model = torch.nn.Linear(1, 1)
        held.append(weakref.ref(model))
        if failed:
            raise RuntimeError("the step failed")

    monkeypatch.setattr(spes.node, "holding_save_folder", holding)
    monkeypatch.setattr(spes.node, "_train", train)
    monkeypatch.setattr(spes.node, "shutdown_distributed", lambda clean: seen.append(("shut", clean, held[0]())))
    with pytest.raises(RuntimeError) if failed else contextlib.nullcontext():
        assert spes.node.run(cfg) == 0
    assert seen == [("init", cfg), ("hold", True, cuda, print), ("shut", not failed, None)]


class _Meta(torch.nn.Linear):
    """A model built on meta whose weights `init_weights` makes: the order of its wrapping and weights is seen."""

    def __init__(self, calls: list[tuple[Any, ...]]) -> None:
        super().__init__(2, 2, device="meta")
        self.calls = calls

    def init_weights(self, seed: int) -> None:
        self.calls.append(("init", seed))


class _Wrapper(torch.nn.Module):
    """What `parallelize` returns: a DDP-like wrapper holding the model as `module`."""

    def __init__(self, module: torch.nn.Module) -> None:
        super().__init__()
        self.module = module


@pytest.mark.parametrize(("sharded", "continuing"), [(True, False), (False, True)])
def test_a_node_is_built_from_its_parts_in_order_and_hands_each_on(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, sharded: bool, continuing: bool
) -> None:
    """The server asked about the training model and the checkpoint to load; the folder claimed for this run by the
    main rank; an FSDP model wrapped before its weights exist, a DDP one after; the wrapped model optimized and
    loaded into; `latest` named only by a resume; the validation batches kept for the trainer."""
    calls: list[tuple[Any, ...]] = []

    def record(name: str, result: Any = None) -> Callable[..., Any]:
        return lambda *args, **kwargs: calls.append((name, *args, *kwargs.items())) or result

    folder = tmp_path / "out"
    load_path = (folder if continuing else tmp_path / "other") / "step4"
    ckpt = Checkpoint(path=load_path, model={}, optim=None, trainer={}, config={})
    model, evals = _Meta(calls), cast(Any, "validation batches")
    wrapped = _Wrapper(model)
    monkeypatch.setattr(spes.node, "_training_loader", lambda *_args: "loader")
    monkeypatch.setattr(spes.node, "_validation", lambda _cfg: evals)
    monkeypatch.setattr(spes.node, "start_checkpoint", record("start", load_path))
    monkeypatch.setattr(spes.node.Transformer, "for_run", record("for_run", model))
    monkeypatch.setattr("spes.sync.peer.check_admitted", record("admitted"))
    monkeypatch.setattr(spes.node, "claim_save_folder", record("claim"))
    monkeypatch.setattr(spes.node, "count_params", lambda _model: SimpleNamespace(describe=lambda: "parameters"))
    monkeypatch.setattr(spes.node, "uses_fsdp", record("uses_fsdp", sharded))
    monkeypatch.setattr(spes.node, "parallelize", record("parallelize", wrapped))
    monkeypatch.setattr(spes.node, "build_optimizer", record("optimizer", "opt"))
    monkeypatch.setattr(spes.node, "_load", record("load", ckpt))
    monkeypatch.setattr(spes.node, "_name_latest", record("latest"))
    cfg, log = load_config(TINY, [f"--save_folder={folder}"])[0], cast(list[str], []).append
    node = build_node(cfg, CPU, log)
    wrap = [("parallelize", model, cfg, CPU)]
    assert calls == [
        ("start", cfg, log),
        ("for_run", cfg, ("training", True)),
        ("admitted", cfg, model, CPU, load_path, log),
        ("claim", cfg, continuing, True, log),
        ("uses_fsdp", cfg, CPU),
        *(wrap if sharded else []),
        ("init", cfg.seed),
        *([] if sharded else wrap),
        ("optimizer", wrapped, cfg.optimizer),
        ("load", cfg, load_path, continuing, wrapped, "opt", log),
        *([("latest", folder, load_path, True, log)] if continuing else []),
    ]
    assert node == spes.node.Node(wrapped, cast(Any, "opt"), cast(Any, "loader"), evals, ckpt)


def _no_trainer(*_args: Any, **_kwargs: Any) -> None:
    raise RuntimeError("no trainer")


@pytest.mark.parametrize("synced", [True, False])
def test_a_start_that_fails_after_joining_closes_its_syncer(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, synced: bool
) -> None:
    """A failure after the join leaves the server no half-joined peer; a centralized start has nothing to close."""
    node = spes.node.Node(torch.nn.Linear(2, 2), cast(Any, "opt"), cast(Any, "loader"), None, None)
    closed: list[bool] = []
    monkeypatch.setattr(spes.node, "build_node", lambda *_args: node)
    monkeypatch.setattr("spes.sync.peer.PeerSync", _Joined)
    monkeypatch.setattr(_Joined, "close", lambda self: closed.append(self.joined), raising=False)
    monkeypatch.setattr(spes.node, "node_trainer", _no_trainer)
    cfg, _ = load_config(TINY, [f"--save_folder={tmp_path}", f"--using_spes={synced}"])
    with pytest.raises(RuntimeError, match="no trainer"):
        spes.node.start_node(cfg, CPU, print)
    assert closed == ([True] if synced else [])


@pytest.mark.timeout(120)
def test_a_dry_run_builds_the_node_says_its_notes_and_trains_nothing(
    tiny_corpus, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The command line's notes come first; a strategy that wraps nothing on one process is said to; a dry run
    checks what a start checks and leaves no save folder."""
    args = [*tiny_corpus.overrides(tmp_path / "out"), *FAST, "--dry_run=true", "--distributed_strategy=ddp"]
    cfg, _ = load_config(TINY, args)
    assert spes.node.run(cfg, ["note: from the command line"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "note: from the command line"
    assert out[1].startswith("note: distributed_strategy=ddp on one process: the model is not wrapped (one rank ")
    assert out[-1] == (
        "dry run: built the node (Transformer, data, optimizer) and checked its save folder, run spec and evaluators; "
        "not training (dry_run=true)"
    )
    assert not (tmp_path / "out").exists()


@pytest.mark.timeout(300)
def test_data_tokenizer_and_resume_failures_are_one_line_before_the_model_is_built(
    tiny_corpus, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Through the `main` of `python -m spes.train`, in this process (a process each would only import torch again):
    the node checks its data, tokenizer and checkpoint before it builds its model."""
    big_vocab = write_token_shard(tmp_path / "big_vocab.npy", np.arange(4096, dtype=np.uint16))
    other_eos = write_token_shard(
        tmp_path / "eos.npy", np.arange(4096, dtype=np.uint16), vocab_size=4096, eos_token_id=7
    )
    node = [TINY, *tiny_corpus.overrides(tmp_path / "out"), *FAST]
    for argv, expected in [
        ([*node, f"--data.paths=[{tmp_path}/nothing/*.npy]"], ("data.paths: ", "matches no file")),
        (
            [*node, "--eval_interval=1", "--data.validation_paths=[nope.npy]"],
            ("data.validation_paths: data path 'nope.npy' (from the working directory ", ") does not exist"),
        ),
        ([*node, f"--tokenizer.identifier={tmp_path}/no_tokenizer"], ("tokenizer.identifier '", "no_tokenizer")),
        ([*node, f"--data.paths=[{big_vocab}]"], ("big_vocab.npy", "65536", "model.vocab_size")),
        ([*node, f"--data.paths=[{other_eos}]"], ("eos.npy", "token 7", "model.eos_token_id=7")),
        ([*node, "--resume"], ("nothing to resume", "holds no checkpoint yet", "--resume=auto")),
    ]:
        code = main(argv)
        captured = capsys.readouterr()
        assert_one_line(code, captured.out + captured.err, *expected)  # the error line goes to stderr: it comes last
        assert "parameters" not in captured.out, "the model was built before the data was checked"


@pytest.mark.timeout(120)
def test_a_shard_of_a_smaller_vocabulary_is_refused_as_preflight_refuses_it(
    tiny_corpus, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Its ids fit the embedding, so only its sidecar tells it came from another tokenizer: it was a warning, and
    the node trained on text its tokenizer reads as other words."""
    shard = write_token_shard(tmp_path / "small.npy", np.arange(4096, dtype=np.uint16) % 300, vocab_size=300)
    code = main([TINY, *tiny_corpus.overrides(tmp_path / "out"), *FAST, f"--data.paths=[{shard}]"])
    captured = capsys.readouterr()
    last = assert_one_line(code, captured.out + captured.err, "small.npy", "vocabulary of 300", "has 4096")
    assert "tokenizer.identifier" in last and "parameters" not in captured.out
    data = tiny_corpus.overrides(tmp_path / "out")[:2]
    valid = ["--eval_interval=1", f"--data.validation_paths=[{shard}]", f"--save_folder={tmp_path / 'out'}"]
    code = main([TINY, *data, *FAST, *valid])  # held-out shards too: the validation loss would be of other text
    captured = capsys.readouterr()
    assert assert_one_line(code, captured.out + captured.err, "small.npy", "vocabulary of 300").endswith(
        "or drop it from data.validation_paths"
    )


@pytest.mark.timeout(120)
def test_a_load_path_that_names_no_checkpoint_is_one_line_before_the_model_is_built(
    tiny_corpus, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Missing, a file, an empty directory: the key, the path and what it should name, through `main`."""
    fix = (
        "point it at a checkpoint directory such as output/<run_name>/node0/step100, or a save folder holding 'latest'"
    )
    nowhere, file, empty = tmp_path / "nowhere" / "step100", tmp_path / "file", tmp_path / "empty"
    file.write_text("x")
    empty.mkdir()
    for path, refusal in {
        nowhere: f"load_path {nowhere}: no such directory ({fix})",
        file: f"load_path {file}: a file, not a directory ({fix})",
        empty: f"load_path {empty} holds no checkpoint: neither a checkpoint directory (a step<N> directory spes "
        f"saved) nor a save folder (holding such directories or a 'latest' file); {fix}",
    }.items():
        code = main([TINY, *tiny_corpus.overrides(tmp_path / "out"), *FAST, f"--load_path={path}"])
        captured = capsys.readouterr()
        assert assert_one_line(code, captured.out + captured.err) == f"error: {refusal}" and code == 2
        assert "parameters" not in captured.out, "the model was built before load_path was checked"


@pytest.mark.timeout(120)
def test_a_save_folder_another_node_is_using_is_refused_naming_its_pid(
    tiny_corpus, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Two nodes given one save_folder deleted each other's half-written checkpoints (one died on its vanished
    temporary directory) and interleaved their metrics; the second is now refused before the model is built, and a
    node that has finished lets the next one in."""
    folder = tmp_path / "out"
    folder.mkdir()
    node = [TINY, *tiny_corpus.overrides(folder), *FAST]
    held = hold_lock(folder / SAVE_FOLDER_LOCK)  # another open file: to flock, another node
    try:
        code = main(node)
    finally:
        os.close(held)
    captured = capsys.readouterr()
    assert assert_one_line(code, captured.out + captured.err) == (
        f"error: save_folder {folder} is in use by another node ({lock_holder()}): give each node its own "
        "save_folder (e.g. output/${run_name}/node${spes_config.peer_id}), or stop that process first"
    )
    assert "parameters" not in captured.out and not list(folder.glob("step*"))
    assert main([*node, "--max_duration=1st"]) == 0
    os.close(hold_lock(folder / SAVE_FOLDER_LOCK))  # released when the node ended


def test_a_fresh_start_into_a_folder_holding_saves_says_how_to_continue_that_run_or_start_over(tmp_path: Path) -> None:
    """The same command run again after its run stopped (no --resume) was told the folder held "another run's
    saves"."""
    folder = tmp_path / "out"
    (folder / "step4").mkdir(parents=True)
    (folder / "metrics.jsonl").write_text("")
    cfg, _ = load_config(TINY, [f"--save_folder={folder}"])
    with pytest.raises(ValueError) as refused:
        claim_save_folder(cfg, continuing=False, is_main=True, log=print)
    assert str(refused.value) == (
        f"save_folder {folder} already holds a run's saves (step4, metrics.jsonl): continue that run with --resume, "
        "or set save_overwrite=true to start over (it removes them), or choose another save_folder (or run_name)"
    )


def test_the_preflights_save_folder_check_refuses_what_a_start_would_and_writes_nothing(tmp_path: Path) -> None:
    """`check_save_folder` (spes.preflight's): a passing preflight's node must not stop at start over its folder."""

    def check(folder: Path, *overrides: str, resume: str | None = None) -> str:
        cfg = load_config(TINY, [f"--save_folder={folder}", *overrides])[0]
        apply_resume(cfg, resume)
        try:
            check_save_folder(cfg)
        except ValueError as refused:
            return str(refused)
        return "ok"

    assert check(tmp_path / "new") == "ok" and not (tmp_path / "new").exists()
    assert check(tmp_path / "new", resume="always").startswith(
        f"nothing to resume: save_folder {tmp_path / 'new'} holds no checkpoint yet"
    )
    (tmp_path / "file").write_text("")
    assert check(tmp_path / "file") == (
        f"save_folder {tmp_path / 'file'} is a file, not a folder; choose another save_folder (or run_name)"
    )
    held = tmp_path / "held"
    (held / "step4").mkdir(parents=True)
    said = f"save_folder {held} already holds a run's saves (step4): continue that run with --resume"
    assert check(held).startswith(said)
    assert check(held, f"--load_path={tmp_path / 'not_made_yet'}").startswith(said)  # an upcycled start, to come
    assert check(held, "--save_overwrite=true") == "ok" and (held / "step4").is_dir()  # removed at start, not here
    assert check(held, resume="auto").startswith(f"save_folder {held} holds no checkpoint: ")  # step4 incomplete
    assert check(tmp_path / "new", resume="auto") == "ok"  # a fresh start, said at start
    saved = _checkpoints(tmp_path / "saved", "step4", latest="step4")
    assert check(saved, resume="always") == "ok" and check(saved, resume="auto") == "ok"  # the run continued
    assert check(saved, f"--load_path={saved / 'step4'}") == "ok"  # a rewind: its own checkpoint
    assert check(saved, f"--load_path={held / 'step4'}").startswith(f"load_path {held / 'step4'} ")  # incomplete
    other = _checkpoints(tmp_path / "other", "step2", latest="step2")
    assert check(saved, f"--load_path={other / 'step2'}").startswith(
        f"save_folder {saved} already holds a run's saves (step4, latest): "
    )  # another run's checkpoint, started in a folder this run holds


def test_a_run_that_stop_at_ended_says_so_in_its_last_line(tmp_path: Path) -> None:
    cfg = load_config(TINY, ["--max_duration=12st"])[0]
    assert unfinished(cfg, 12) == "" and unfinished(cfg, 13) == ""
    assert unfinished(cfg, 6) == (
        "; stopped at step 6 of 12 (stop_at): the run is unfinished, continue with --resume and a larger stop_at or "
        "none"
    )


def test_the_main_rank_checks_its_save_folder_once_and_an_unusable_one_is_still_named(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Holding the folder checked it, and claiming it checked it again; every rank (a dry run too) still refuses an
    unusable one before the model is built."""
    checked: list[str] = []
    check = spes.node._usable_folder
    monkeypatch.setattr(spes.node, "_usable_folder", lambda cfg: checked.append(cfg.save_folder) or check(cfg))
    cfg, _ = load_config(TINY, [f"--save_folder={tmp_path / 'out'}"])
    with holding_save_folder(cfg, CPU, print):
        claim_save_folder(cfg, continuing=False, is_main=True, log=print)
    assert checked == [str(tmp_path / "out")]
    (tmp_path / "file").write_text("x")
    cfg, _ = load_config(TINY, [f"--save_folder={tmp_path / 'file'}"])
    for info in (CPU, replace(CPU, rank=1, world_size=2, local_rank=1)):
        with pytest.raises(ValueError, match=r"save_folder .*file is a file, not a folder; choose another save_fold"):
            with holding_save_folder(cfg, info, print):
                pass


def _sigterm(cfg: object, info: object, log: object) -> None:
    """A start_node that receives SIGTERM while the node is being built."""
    os.kill(os.getpid(), signal.SIGTERM)
    raise AssertionError("SIGTERM did not interrupt the node")


@pytest.mark.timeout(60)
def test_a_signal_before_the_training_loop_ends_in_a_line_naming_what_the_save_folder_holds(
    tiny_corpus, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """SIGTERM killed a node still being built (or joining its server) outright, saying nothing, and spes.torchrun
    said every rank had been asked to save; Ctrl-C's line could not say whether there was a checkpoint to continue.
    Under spes.torchrun the line is left for it."""
    folder = tmp_path / "out"
    node = [TINY, *tiny_corpus.overrides(folder), *FAST]
    monkeypatch.setattr(spes.node, "start_node", _sigterm)
    previous = signal.signal(signal.SIGTERM, lambda signum, _frame: None)  # NOTE: without the fix, no kill of pytest
    try:
        assert main(node) == 130
        assert capsys.readouterr().err == (
            f"error: interrupted without saving; save_folder {folder} holds no checkpoint yet: start again with "
            "--resume=auto (it starts afresh then)\n"
        )
        (folder / "step4").mkdir()
        (folder / "step4" / META_FILE).write_text("{}")
        (folder / "latest").write_text("step4\n")
        monkeypatch.setenv(ERROR_DIR_ENV, str(tmp_path))
        monkeypatch.delenv("RANK", raising=False)
        assert main(node) == 130 and capsys.readouterr().err == ""
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert (tmp_path / "rank0.stopped.txt").read_text() == (
        f"error: interrupted without saving; save_folder {folder}'s latest checkpoint is step4: continue from it "
        "with --resume or --resume=auto\n"
    )


@pytest.mark.timeout(120)
def test_a_run_continued_from_an_older_checkpoint_of_its_save_folder_names_it_latest(
    tiny_corpus, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A rewind (load_path naming an older checkpoint of the save folder) left `latest` naming the newer one, so a
    crash before the rewound run's first save resumed the abandoned checkpoint, its metrics skipping steps."""
    folder = tmp_path / "out"
    node = [TINY, *tiny_corpus.overrides(folder), *FAST]
    assert main([*node, "--max_duration=8st", "--save_interval=4"]) == 0
    rewind = f"--load_path={os.path.relpath(folder / 'step4')}"  # relative, as typed; save_folder absolute
    assert main([*node, "--max_duration=6st", rewind]) == 0  # it ends as a crash would: unsaved
    assert (folder / "latest").read_text() == "step4\n" and (folder / "step8").is_dir()
    assert (
        f"note: {folder / 'latest'} now names step4, which this run continues; step8 (from before it) stay until this "
        "run saves those steps"
    ) in capsys.readouterr().out
    assert main([*node, "--max_duration=8st", "--resume"]) == 0
    steps = [json.loads(line)["step"] for line in (folder / "metrics.jsonl").read_text().splitlines()]
    assert steps == list(range(1, 9))


@pytest.mark.timeout(120)
def test_a_resume_over_other_windows_is_refused_before_the_node_joins_a_server(tiny_corpus, tmp_path: Path) -> None:
    """The loader's refusal came only from the trainer, after the join: a node resumed with another
    model.max_sequence_length joined the run first, or waited out its retries for a restarting server."""
    node = [*tiny_corpus.overrides(tmp_path / "out"), *FAST, "--save_interval=2"]
    assert main([TINY, *node]) == 0
    cfg, _ = load_config(TINY, [*node, "--model.max_sequence_length=32"])
    apply_resume(cfg, "always")
    with pytest.raises(ValueError, match="saved with windows of 64 tokens but this run's model.max_sequence_length"):
        build_node(cfg, CPU, log=lambda _m: None)


def _never_built(*_args: object) -> None:
    raise AssertionError("the node built its model before the server was asked")


@pytest.mark.timeout(120)
def test_a_node_the_server_would_refuse_stops_before_building_its_model(
    tiny_corpus, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A DiLoCo node, one of another model size or one with a wrong token was refused only at its join, after
    allocating its weights (and loading its checkpoint): minutes for a 1B node. Its dry join now ends it first, with
    the server's line and the join's exit code, before `save_overwrite` removes an earlier run's saves."""
    from spes.sync.auth import TOKEN_ENV
    from spes.sync.server import spec_of_run
    from sync_helpers import TOKEN, running_server

    monkeypatch.setattr(spes.node, "parallelize", _never_built)
    run = [*tiny_corpus.overrides(tmp_path / "node"), *SMALL_NODE, "--spes_config.num_peers=1"]
    run += ["--spes_config.num_train_experts_per_node=8", "--max_duration=2st", "--save_interval=null"]

    def refusal(addr: str, *other: str) -> str:
        started = time.monotonic()
        code = main([TINY, *run, f"--spes_config.server_addr={addr}", *other])
        captured = capsys.readouterr()
        last = assert_one_line(code, captured.out + captured.err, "(before building the model)")
        assert code == 3 and "experts:" not in captured.out and time.monotonic() - started < 30, captured.out
        return last

    earlier = tmp_path / "node" / "metrics.jsonl"  # an earlier run's saves: a refused node must not remove them
    earlier.parent.mkdir()
    earlier.write_text('{"step": 1}\n')
    spec = spec_of_run(TINY, run)
    with running_server(spec) as (_, addr):
        assert "peer 0 has mode = 'diloco' but the run has mode = 'spes'" in refusal(addr, "--using_dilico=true")
        assert "peer 0's model differs from the run's" in refusal(addr, "--model.n_layers=3", "--save_overwrite=true")
    assert earlier.read_text() == '{"step": 1}\n'
    monkeypatch.setenv(TOKEN_ENV, "not-the-runs-token")
    with running_server(spec, token=TOKEN) as (_, addr):
        assert "failed (UNAUTHENTICATED)" in refusal(addr)


@pytest.mark.timeout(120)
def test_a_node_started_before_its_server_builds_and_leaves_the_wait_to_its_join(
    tiny_corpus, tmp_path: Path, dead_port: int
) -> None:
    """Nodes may start before the server: the dry join that finds none says so and the node builds on."""
    addr = f"127.0.0.1:{dead_port}"
    cfg, _ = load_config(TINY, [*tiny_corpus.overrides(tmp_path / "node"), f"--spes_config.server_addr={addr}"])
    logged: list[str] = []
    build_node(cfg, CPU, logged.append)
    notes = [line for line in logged if line.startswith("note: dry join of the parameter server")]
    asked = f"at spes_config.server_addr={addr} (before building the model) failed (UNAVAILABLE)"
    assert len(notes) == 1 and asked in notes[0], logged
    assert notes[0].endswith("building the model, then joining (waiting for the server as a join does)")
    assert any(line.startswith("SPES node, peer 0 of 4; experts:") for line in logged)


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_sync_failures_are_one_line(tiny_corpus, tmp_path: Path, dead_port: int) -> None:
    """No server; a server of another run layout; a round the other peer never joins."""
    node = [
        TINY,
        *tiny_corpus.overrides(tmp_path / "node"),
        *SMALL_NODE,
        "--spes_config.max_retries=0",
        "--spes_config.rpc_timeout_s=5",
        "--max_duration=2st",
        "--save_interval=null",
    ]
    code, out = train(tmp_path, *node, f"--spes_config.server_addr=127.0.0.1:{dead_port}", name="nobody.log")
    assert_one_line(
        code, out, f"spes_config.server_addr=127.0.0.1:{dead_port}", "is the parameter server running there"
    )
    two = [
        "--spes_config.num_peers=2",
        "--spes_config.num_train_experts_per_node=4",
        "--spes_config.sync_steps=1",
        "--spes_config.round_timeout_s=20",
    ]
    # NOTE: the server of a two-peer run, started from the run's YAML and overrides as a user would
    server = [TINY, *SMALL_NODE, *two, "--max_duration=2st", "--server.round_timeout_s=3"]
    with parameter_server(tmp_path / "server.log", *server) as addr:
        code, out = train(tmp_path, *node, f"--spes_config.server_addr={addr}", name="layout.log")
        assert_one_line(code, out, "num_peers")
        code, out = train(tmp_path, *node, *two, f"--spes_config.server_addr={addr}", name="timeout.log")
        assert_one_line(code, out, "round")


def start_until(cmd: list[str], log: Path, ready: Callable[[], bool]) -> subprocess.Popen:
    """Start `cmd` in its own session, logging to `log`, and wait (120 s at most) until `ready()`."""
    with open(log, "w") as out:
        proc = subprocess.Popen(
            cmd, cwd=REPO, env=child_env(), stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
    deadline = time.time() + 120
    while not ready():
        if proc.poll() is not None or time.time() > deadline:
            proc.kill()
            proc.wait()
            raise AssertionError(log.read_text()[-3000:])
        time.sleep(0.05)
    return proc


def _steps(folder: Path) -> list[int]:
    return [json.loads(line)["step"] for line in (folder / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_a_requeued_run_continues_from_its_last_checkpoint(tiny_corpus, tmp_path: Path) -> None:
    """Kill -9 mid-run and launch the same command again (what a SLURM requeue does): it resumes from the last
    checkpoint (`latest` or not), and metrics.jsonl holds every step once, in order."""
    out = tmp_path / "run"
    cmd = [
        sys.executable,
        "-m",
        "spes.train",
        TINY,
        *tiny_corpus.overrides(out),
        "--using_spes=false",
        "--eval_interval=null",
        "--log_interval=1",
        "--save_interval=5",
        "--max_duration=60st",
        "--save_num_checkpoints_to_keep=1",
        "--resume=auto",
    ]
    proc = start_until(cmd, tmp_path / "first.log", lambda: (out / "latest").exists() and len(_steps(out)) >= 7)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    first = (tmp_path / "first.log").read_text()
    assert "no checkpoint in" in first and "starting fresh" in first
    saved = int((out / "latest").read_text().strip().removeprefix("step"))
    assert 5 <= saved < 60 and max(_steps(out)) > saved  # rows past the checkpoint: they must go
    (out / "latest").unlink()  # as if killed after publishing step<saved>, before pointing `latest` at it
    again = run_logged(cmd, tmp_path / "second.log", timeout=150)
    assert again.returncode == 0, again.stdout[-3000:]
    assert f"loaded {out / f'step{saved}'} (step {saved})" in again.stdout
    assert f"step {saved + 1}/60" in again.stdout and "step 1/60" not in again.stdout
    assert _steps(out) == list(range(1, 61))


ONE_RANK_TORCHRUN = [
    sys.executable,
    "-m",
    "spes.torchrun",
    "--standalone",
    "--nproc_per_node=1",
    "-m",
    "spes.train",
    TINY,
]
"""A node of one rank under spes.torchrun (its config's overrides follow)."""


def _sigterm_once_under_way(cmd: list[str], log: Path, ready: Callable[[], bool]) -> tuple[int, str]:
    """Start `cmd` (its output to `log`), SIGTERM it once `ready()`: its exit code and its output."""
    proc = start_until(cmd, log, ready)
    try:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)
    finally:
        proc.kill()
    return proc.returncode, log.read_text()


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_sigterm_to_spes_torchrun_saves_and_ends_in_one_line(tiny_corpus, tmp_path: Path) -> None:
    """What SLURM sends at a preemption: the rank saves at its next step, the launcher says so in one line."""
    cmd = [
        *ONE_RANK_TORCHRUN,
        *tiny_corpus.overrides(tmp_path),
        "--using_spes=false",
        "--eval_interval=null",
        "--log_interval=1",
        "--save_interval=null",
        "--max_duration=100000st",
    ]
    code, out = _sigterm_once_under_way(cmd, tmp_path / "run.log", (tmp_path / "metrics.jsonl").exists)
    saved = (tmp_path / "latest").read_text().strip()
    assert assert_one_line(code, out) == (
        f"error: stopped by SIGTERM: saved step {saved.removeprefix('step')}'s checkpoint in {tmp_path} and "
        "stopped; continue with --resume (or --resume=auto)"
    )
    assert code == 128 + signal.SIGTERM and "death signal" not in out


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_sigterm_to_spes_torchrun_before_the_first_step_says_nothing_was_saved(
    tiny_corpus, tmp_path: Path, dead_port: int
) -> None:
    """A node still waiting for its server: its ranks were killed outright and the launcher said each had been asked
    to save a checkpoint."""
    cmd = [
        *ONE_RANK_TORCHRUN,
        *tiny_corpus.overrides(tmp_path),
        *SMALL_NODE,
        f"--spes_config.server_addr=127.0.0.1:{dead_port}",
        "--spes_config.max_retries=8",
    ]
    log = tmp_path / "run.log"
    code, out = _sigterm_once_under_way(cmd, log, lambda: "retry 1/8" in log.read_text())
    assert assert_one_line(code, out) == (
        f"error: stopped by SIGTERM: interrupted without saving; save_folder {tmp_path} holds no checkpoint yet: "
        "start again with --resume=auto (it starts afresh then)"
    )
    assert code == 128 + signal.SIGTERM and "death signal" not in out
