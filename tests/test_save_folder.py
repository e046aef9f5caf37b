"""A save folder's layout: finding a checkpoint by path, by step and through `latest` (after a kill too), naming
what a folder that holds none is instead, pruning by schedule, and removing what a killed save left behind. No
tensors: a checkpoint here is a directory holding a meta.json, which is all the layout looks at."""

from __future__ import annotations

from pathlib import Path

import pytest

from spes.save_folder import (
    LATEST,
    META_FILE,
    CheckpointError,
    earlier_checkpoint_fix,
    list_checkpoints,
    not_a_save_folder,
    prune,
    remove_stale_temporaries,
    resolve_checkpoint,
    resolve_step,
)


def _checkpoint(directory: Path) -> Path:
    """A directory the layout takes for a complete checkpoint: it holds a meta.json (what that says is
    spes.checkpoint's)."""
    directory.mkdir(parents=True)
    (directory / META_FILE).write_text("{}")
    return directory


def test_an_olmo_or_hugging_face_directory_as_load_path_is_named_with_the_way_in(tmp_path: Path) -> None:
    """The first implementation's launcher passed its OLMo checkpoint as --load_path; spes said the directory held
    no checkpoint, leaving the user to find docs/migrating.md's conversion."""
    olmo, hf, empty = tmp_path / "step1000-unsharded", tmp_path / "hf", tmp_path / "empty"
    for directory, files in (
        (olmo, ("model.pt", "optim.pt", "train.pt", "config.yaml")),
        (hf, ("config.json", "model.safetensors")),
        (empty, ()),
    ):
        directory.mkdir()
        for name in files:
            (directory / name).touch()
    with pytest.raises(CheckpointError) as err:
        resolve_checkpoint(olmo, what="load_path")
    assert str(err.value) == (
        f"load_path {olmo} is an OLMo checkpoint (the first implementation's: convert it to Hugging Face with its "
        "converter first), which spes does not read (its checkpoints are its own, pickle-free): write one from "
        "Hugging Face weights with python -m spes.hf import --hf <HF model dir> --out <dir>/step0 "
        "--num_train_experts_per_node K and point load_path at it (docs/migrating.md)"
    )
    with pytest.raises(CheckpointError, match=r"is a Hugging Face model directory \(a dense one is upcycled"):
        resolve_checkpoint(hf, what="load_path")
    (tmp_path / "olmo_sharded" / "model_and_optim").mkdir(parents=True)  # OLMo's sharded layout: no *.pt beside it
    with pytest.raises(CheckpointError, match="is an OLMo checkpoint"):
        resolve_checkpoint(tmp_path / "olmo_sharded", what="load_path")
    for name in ("config.json", "model.safetensors"):  # half of a Hugging Face directory is none
        (tmp_path / name.split(".")[0]).mkdir()
        (tmp_path / name.split(".")[0] / name).touch()
        with pytest.raises(CheckpointError, match="holds no checkpoint: neither a checkpoint directory"):
            resolve_checkpoint(tmp_path / name.split(".")[0], what="load_path")
    with pytest.raises(CheckpointError, match="holds no checkpoint: neither a checkpoint directory"):
        resolve_checkpoint(empty, what="load_path")


def test_two_schedules_of_one_kind_each_keep_their_own_newest(tmp_path: Path) -> None:
    """Off FSDP, the first implementation's save_interval 10000 (keep 1) and save_interval_unsharded 5000 (keep 5)
    both write step<N>/: counted together, the keep 1 deleted the unsharded schedule's checkpoints at every save."""
    for step in (5, 10, 15, 20, 25, 30):
        (tmp_path / f"step{step}").mkdir()
    (tmp_path / "step20-sharded").mkdir()  # another kind: not this prune's
    prune(tmp_path, "unsharded", [(10, 1), (5, 5)])
    assert [p.name for p in list_checkpoints(tmp_path)] == [f"step{s}" for s in (10, 15, 20)] + [
        "step20-sharded",
        "step25",
        "step30",
    ]
    (tmp_path / "step35").mkdir()  # on the 5-step schedule only: the 10-step one keeps its own newest, step30
    prune(tmp_path, "unsharded", [(10, 1), (5, 1)])
    assert [p.name for p in list_checkpoints(tmp_path, "unsharded")] == ["step30", "step35"]
    for step in (15, 20, 25):
        (tmp_path / f"step{step}").mkdir()
    (tmp_path / "step35").rmdir()
    (tmp_path / "step33").mkdir()  # off both schedules (a last step's save): the newest of each
    prune(tmp_path, "unsharded", [(10, 1), (5, 5)])
    assert [p.name for p in list_checkpoints(tmp_path, "unsharded")] == [f"step{s}" for s in (15, 20, 25, 30, 33)]
    prune(tmp_path, "unsharded", [(None, 2)])  # one schedule: the newest two, as a plain keep=2
    assert [p.name for p in list_checkpoints(tmp_path, "unsharded")] == ["step30", "step33"]


def test_a_folder_that_is_no_save_folder_is_named_for_what_it_is(tmp_path: Path) -> None:
    run = tmp_path / "run"
    for node in ("node1", "node0"):
        _checkpoint(run / node / "step20-sharded")
        (run / node / LATEST).write_text("step20-sharded")
    (run / "server_state").mkdir()
    (run / "server_state" / "state.json").write_text("{}")
    (run / "empty").mkdir()
    assert not_a_save_folder(run) == (
        f"holds the save folders of the nodes, not a checkpoint: pass one of them, e.g. {run / 'node0'}"
    )
    assert not_a_save_folder(run / "server_state") == (
        f"is the parameter server's state, which holds no checkpoint: pass a node's save folder, e.g. {run / 'node0'}"
    )
    assert not_a_save_folder(run / "node0" / "step20-sharded") == (
        f"is a checkpoint, not a save folder: pass the save folder it is in, {run / 'node0'} with step 20"
    )
    (run / "node0" / "final").mkdir()
    (run / "node0" / "final" / META_FILE).write_text("{}")
    assert not_a_save_folder(run / "node0" / "final").endswith(f"pass the save folder it is in, {run / 'node0'}")
    assert not_a_save_folder(run / "empty") == (
        "holds no checkpoint (no latest file, no step<N> directory): pass a node's save folder, e.g. output/<run>/node0"
    )
    with pytest.raises(FileNotFoundError, match=r"^run directory .*server_state is the parameter server's state"):
        resolve_step(run / "server_state", "latest")


def test_a_step_is_found_by_number_unsharded_first_or_through_latest(tmp_path: Path) -> None:
    run = tmp_path / "node0"
    with pytest.raises(FileNotFoundError, match=f"^run directory {run} does not exist \\(expected a spes save_folder"):
        resolve_step(run, 1)
    run.mkdir()
    with pytest.raises(FileNotFoundError, match=r"^run directory .*node0 holds no checkpoint \(no latest file, no st"):
        resolve_step(run, 5)
    for name in ("step2", "step4-sharded", "step4"):
        _checkpoint(run / name)
    assert resolve_step(run, 4) == run / "step4" and resolve_step(run, "2") == run / "step2"
    with pytest.raises(
        FileNotFoundError, match=f"^checkpoint {run / 'step3'} does not exist; available: step2, step4, "
    ):
        resolve_step(run, 3)
    with pytest.raises(ValueError, match="^checkpoint step must be an integer or 'latest', got 'last'$"):
        resolve_step(run, "last")
    with pytest.raises(FileNotFoundError, match=f"^{run} has no 'latest' file naming the latest checkpoint; avail"):
        resolve_step(run, "latest")
    (run / LATEST).write_text("step4-sharded\n")
    assert resolve_step(run, "latest") == run / "step4-sharded"
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / LATEST).write_text("step9\n")  # a latest naming a checkpoint that is gone, and no other
    with pytest.raises(FileNotFoundError, match=f"^checkpoint {empty / 'step9'} does not exist; available: none$"):
        resolve_step(empty, 9)
    with pytest.raises(
        FileNotFoundError,
        match=r"^run directory nowhere does not exist \(relative to .*; expected a spes save_folder, "
        r"e\.g\. output/<run_name>/node0\)$",
    ):
        resolve_step("nowhere", 1)


def test_latest_resolves_to_a_moved_aside_copy_only_when_the_replacement_never_arrived(tmp_path: Path) -> None:
    run = tmp_path / "node0"
    _checkpoint(run / "step1")
    _checkpoint(run / "step2")
    (run / LATEST).write_text("step4\n")
    with pytest.raises(
        CheckpointError,
        match=f"latest names step4, which is missing or incomplete; load a complete one by its path "
        f"\\({run / 'step1'}, {run / 'step2'}\\) or write its name into {run / LATEST}$",
    ):
        resolve_checkpoint(run)
    aside = _checkpoint(run / ".step4.old-123")
    assert resolve_checkpoint(run) == aside  # killed between moving the old copy aside and publishing the new one
    _checkpoint(run / "step4")
    assert resolve_checkpoint(run) == run / "step4"  # the new copy arrived: it wins
    assert resolve_checkpoint(run / "step2") == run / "step2"


@pytest.mark.parametrize("content", [b"", b"\n", b"\xcc\xcc garbage", b"../elsewhere\n", b"step2\x00"])
def test_a_latest_emptied_or_garbled_is_refused_in_one_line_naming_the_checkpoint_to_resume_from(
    tmp_path: Path, content: bytes
) -> None:
    """A crash on a filesystem without data journaling empties `latest`; a bad copy garbles it. Read, the first gave
    "latest names node0" (the folder itself), the second a UnicodeDecodeError traceback."""
    run = tmp_path / "node0"
    _checkpoint(run / "step1")
    _checkpoint(run / "step2")
    (run / LATEST).write_bytes(content)
    with pytest.raises(CheckpointError) as err:
        resolve_checkpoint(run)
    assert str(err.value) == (
        f"{run / LATEST}: damaged (it holds {content!r}, not a checkpoint's name); remove it to resume from the "
        f"newest complete checkpoint, {run / 'step2'}, or write another one's name into it"
    )
    (run / LATEST).unlink()
    assert resolve_checkpoint(run) == run / "step2"  # what the advice leads to
    for step in ("step1", "step2"):
        (run / step / META_FILE).unlink()
    (run / LATEST).write_bytes(content)
    with pytest.raises(CheckpointError, match=f"; {run} holds no complete checkpoint: remove it to start that save"):
        resolve_checkpoint(run)


def test_the_checkpoint_to_go_back_to_from_a_damaged_one_is_the_newest_complete_before_it(tmp_path: Path) -> None:
    run = tmp_path / "node0"
    for name in ("step5", "step10-sharded", "step20", "step30"):
        _checkpoint(run / name)
    (run / "step25").mkdir()  # incomplete: no meta.json
    assert earlier_checkpoint_fix(run / "step30") == (
        f"use an earlier checkpoint: the newest is step 20, {run / 'step20'} (write step20 into {run / LATEST} to "
        "resume from it)"
    )
    assert earlier_checkpoint_fix(run / "step20").startswith(f"use an earlier checkpoint: the newest is step 10, {run}")
    assert earlier_checkpoint_fix(run / "step5") == f"use an earlier checkpoint (there is none in {run})"
    assert earlier_checkpoint_fix(tmp_path / "exported") == f"use an earlier checkpoint (there is none in {tmp_path})"


def test_latest_naming_a_missing_checkpoint_in_a_folder_without_others_says_what_to_do(tmp_path: Path) -> None:
    """It advised "pass one of [] explicitly": no checkpoint to pass, and no setting named."""
    run = tmp_path / "node0"
    run.mkdir()
    (run / LATEST).write_text("step9\n")
    (run / "step8").mkdir()  # a save cut short: no meta.json
    with pytest.raises(CheckpointError) as refused:
        resolve_checkpoint(run, what="load_path")
    assert str(refused.value) == (
        f"{run / LATEST} names step9, which is missing or incomplete; {run} holds no complete checkpoint: point "
        f"load_path at another one, or remove {run / LATEST} to start that save folder afresh"
    )


def test_a_path_that_names_no_checkpoint_is_refused_with_what_to_name_instead(tmp_path: Path) -> None:
    """Missing, a file, an empty directory, a directory holding checkpoints: the path under the name it came by."""
    fix = (
        "point it at a checkpoint directory such as output/<run_name>/node0/step100, or a save folder holding 'latest'"
    )

    def refusal(path: Path, **what: str) -> str:  # `what` left out: "checkpoint"
        with pytest.raises((FileNotFoundError, CheckpointError)) as err:
            resolve_checkpoint(path, **what)
        return f"{type(err.value).__name__}: {err.value}"

    assert refusal(tmp_path / "nope") == f"FileNotFoundError: checkpoint {tmp_path / 'nope'}: no such directory ({fix})"
    (tmp_path / "file").write_text("x")
    assert refusal(tmp_path / "file", what="load_path") == (
        f"CheckpointError: load_path {tmp_path / 'file'}: a file, not a directory ({fix})"
    )
    run = tmp_path / "run"
    (run / "node0" / "step6").mkdir(parents=True)  # incomplete: no meta.json
    assert refusal(run / "node0") == (
        f"CheckpointError: checkpoint {run / 'node0'} holds no checkpoint: neither a checkpoint directory (a step<N> "
        "directory spes saved) nor a save folder (holding such directories or a 'latest' file); step6 lack(s) the "
        f"meta.json a complete checkpoint holds; {fix}"
    )
    for step in (2, 4, 8):
        _checkpoint(run / "node0" / f"step{step}")
    (run / "node0" / "step10").mkdir()  # incomplete
    assert resolve_checkpoint(run / "node0") == run / "node0" / "step8"  # killed before `latest` was written
    for node in ("node0", "node1"):
        (run / node).mkdir(exist_ok=True)
        (run / node / LATEST).write_text("step8\n")
    assert refusal(run) == (  # the run directory above the nodes' save folders
        f"CheckpointError: checkpoint {run} is neither a checkpoint nor a save folder itself, but holds them; point it "
        f"at one: {run / 'node0'}, {run / 'node1'}"
    )


def test_what_a_killed_save_left_is_removed_and_an_old_copy_without_its_replacement_restored(tmp_path: Path) -> None:
    run = tmp_path / "node0"
    _checkpoint(run / "step4")
    _checkpoint(run / ".step4.old-7")  # its replacement is in place: a leftover
    _checkpoint(run / ".step6.old-5")  # killed before step6's replacement arrived: the only copy
    (run / ".step8.old-1").mkdir()  # no meta.json: not a complete copy
    _checkpoint(run / ".step10.tmp-99")  # a staged save never published
    (run / ".latest.abc.tmp").write_text("step10")
    (run / "notes.txt").write_text("the user's")
    remove_stale_temporaries(run)
    assert sorted(p.name for p in run.iterdir()) == ["notes.txt", "step4", "step6"]
    assert (run / "step6" / META_FILE).is_file()


def test_a_folder_without_a_complete_checkpoint_names_each_incomplete_one_or_none(tmp_path: Path) -> None:
    fix = (
        "point it at a checkpoint directory such as output/<run_name>/node0/step100, or a save folder holding 'latest'"
    )
    head = "holds no checkpoint: neither a checkpoint directory (a step<N> directory spes saved) nor a save folder"
    with pytest.raises(CheckpointError) as err:
        resolve_checkpoint(tmp_path)
    assert str(err.value) == f"checkpoint {tmp_path} {head} (holding such directories or a 'latest' file); {fix}"
    for step in (3, 5):
        (tmp_path / f"step{step}").mkdir()  # no meta.json: incomplete
    with pytest.raises(CheckpointError) as err:
        resolve_checkpoint(tmp_path)
    assert str(err.value) == (
        f"checkpoint {tmp_path} {head} (holding such directories or a 'latest' file); step3, step5 lack(s) the "
        f"meta.json a complete checkpoint holds; {fix}"
    )
