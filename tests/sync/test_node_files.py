"""The sync wing's files in a node checkpoint: each reads back what was written, and a damaged or foreign one is
refused naming the file."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from spes.sync.node_files import (
    CODEC_FILE,
    PENDING_FILE,
    RUN_FILE,
    load_codec_state,
    read_pending,
    read_run_id,
    save_codec_state,
    write_run_id,
)
from spes.sync.overlap import PendingRound

MANIFEST = {"a": (2, 3), "b": (4,)}


def test_run_id_round_trips_and_is_none_without_a_record(tmp_path: Path) -> None:
    assert read_run_id(None) is None and read_run_id(tmp_path) is None
    write_run_id(tmp_path / RUN_FILE, "run-7")
    assert read_run_id(tmp_path) == "run-7"


@pytest.mark.parametrize("damaged", ["{", "[]", '{"id": 1}'])
def test_a_damaged_run_record_is_named(tmp_path: Path, damaged: str) -> None:
    (tmp_path / RUN_FILE).write_text(damaged)
    with pytest.raises(ValueError, match=f"{RUN_FILE}: not a run record .*damaged; write the run's id into it"):
        read_run_id(tmp_path)


def test_a_pending_round_is_read_when_it_holds_what_the_node_uploads(tmp_path: Path) -> None:
    assert read_pending(tmp_path, MANIFEST, lambda step: ["a"]) is None
    PendingRound(round_id=4, step=4, snapshot={"a": torch.ones(2, 3)}).save(tmp_path / PENDING_FILE)
    asked: list[int] = []
    pending = read_pending(tmp_path, MANIFEST, lambda step: asked.append(step) or ["a"])
    assert pending is not None and pending.step == 4 and asked == [4]
    assert torch.equal(pending.snapshot["a"], torch.ones(2, 3))


def test_a_pending_round_of_other_tensors_is_refused(tmp_path: Path) -> None:
    PendingRound(round_id=4, step=4, snapshot={"a": torch.ones(2, 3)}).save(tmp_path / PENDING_FILE)
    with pytest.raises(ValueError, match=f"{PENDING_FILE}: its snapshot is not of the tensors .* at step 4"):
        read_pending(tmp_path, MANIFEST, lambda step: ["a", "b"])


def test_the_codec_state_round_trips(tmp_path: Path) -> None:
    path = tmp_path / CODEC_FILE
    save_codec_state(path, {"codec": "int8"}, {"a.error": torch.arange(6.0).view(2, 3)})
    metadata, tensors = load_codec_state(path)
    assert metadata == {"codec": "int8"}
    assert torch.equal(tensors["a.error"], torch.arange(6.0).view(2, 3))


def test_a_damaged_codec_state_is_named(tmp_path: Path) -> None:
    path = tmp_path / CODEC_FILE
    path.write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{garbage")
    with pytest.raises(ValueError, match=f"codec state {path}: not a readable safetensors file"):
        load_codec_state(path)


def test_a_damaged_run_record_is_named_with_what_to_do(tmp_path: Path) -> None:
    (tmp_path / RUN_FILE).write_text('{"id": 1}')
    with pytest.raises(ValueError) as err:
        read_run_id(tmp_path)
    assert str(err.value) == (
        f"{tmp_path / RUN_FILE}: not a run record ('run_id'): the checkpoint is damaged; write the run's id into it as "
        '{"run_id": "<id>"} (python -m spes.status names the run), or load an older checkpoint with '
        "--load_path=<save_folder>/step<N>"
    )


def test_a_pending_round_of_other_tensors_is_refused_naming_what_may_have_written_it(tmp_path: Path) -> None:
    PendingRound(round_id=4, step=4, snapshot={"a": torch.ones(2, 3)}).save(tmp_path / PENDING_FILE)
    with pytest.raises(ValueError) as err:
        read_pending(tmp_path, MANIFEST, lambda step: ["b"])
    assert str(err.value) == (
        f"pending round {tmp_path / PENDING_FILE}: its snapshot is not of the tensors this node trains at step 4 (was "
        "it written by another spes_config.peer_id, mode, sync_steps or overlap_fragments?)"
    )


def test_a_pending_round_is_held_to_the_models_shapes(tmp_path: Path) -> None:
    """The same names but another model's shapes (another model.* config): refused before any round is applied."""
    PendingRound(round_id=4, step=4, snapshot={"a": torch.ones(3, 2)}).save(tmp_path / PENDING_FILE)
    with pytest.raises(ValueError) as err:
        read_pending(tmp_path, MANIFEST, lambda step: ["a"])
    assert (
        str(err.value)
        == f"pending round {tmp_path / PENDING_FILE}: tensor 'a' has shape [3, 2], this model's is [2, 3]"
    )
