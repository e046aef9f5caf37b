"""Fuzz of reading a checkpoint (`spes.checkpoint.load_checkpoint`: meta.json, config.yaml, the safetensors files)
and of the data loader's state it carries (`spes.data.BatchLoader.load_state_dict`): a written checkpoint loads
back; a damaged one loads or is refused with a `CheckpointError` naming the file, a damaged loader state with a
ValueError, never another exception."""

from __future__ import annotations

import json
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from disk_helpers import drop_checksums
from fuzz_helpers import FEW, FUZZ, hostile_json, memory_cap, mutated, mutated_json, refused_only
from spes.checkpoint import load_checkpoint, write_unsharded
from spes.data import BatchLoader, TokenSequenceDataset
from spes.save_folder import CONFIG_FILE, META_FILE, MODEL_FILE, OPTIM_FILE, CheckpointError

pytestmark = pytest.mark.timeout(120)

FILES = [META_FILE, CONFIG_FILE, MODEL_FILE, OPTIM_FILE]


@contextmanager
def _checkpoint() -> Iterator[Path]:
    """An unsharded checkpoint of a two-tensor model with AdamW-like state."""
    model = {"w": torch.arange(6.0).reshape(2, 3), "b": torch.ones(3)}
    optim = {
        "state": {"w": {"exp_avg": torch.zeros(2, 3), "step": torch.tensor(4.0)}},
        "param_groups": [{"lr": 1e-3, "betas": (0.9, 0.95), "params": ["w"]}],
    }
    trainer = {"step": 4, "data": {"epoch": 0, "position": 8, "seed": 1}}
    with tempfile.TemporaryDirectory() as tmp:
        step_dir = Path(tmp) / "step4"
        step_dir.mkdir()
        write_unsharded(step_dir, 4, model_state=model, optim_state=optim, trainer_state=trainer, config={"a": 1})
        yield step_dir


def test_a_checkpoint_loads_back() -> None:
    with _checkpoint() as step_dir:
        ckpt = load_checkpoint(step_dir)
        assert ckpt.trainer["step"] == 4 and torch.equal(ckpt.model["b"], torch.ones(3))
        assert ckpt.optim is not None and ckpt.optim["param_groups"][0]["betas"] == (0.9, 0.95)


def _resized(step_dir: Path, name: str) -> None:
    """Record `name`'s new size in meta.json, so a damaged file of another size reaches its reader."""
    drop_checksums(step_dir)
    meta = json.loads((step_dir / META_FILE).read_text())
    meta["files"][name] = (step_dir / name).stat().st_size
    (step_dir / META_FILE).write_text(json.dumps(meta))


@FEW
@given(st.sampled_from(FILES), st.data())
def test_damaged_checkpoint_files_are_refused(name: str, data: st.DataObject) -> None:
    with _checkpoint() as step_dir:
        path = step_dir / name
        path.write_bytes(data.draw(mutated(path.read_bytes())))
        if name != META_FILE and data.draw(st.booleans()):
            _resized(step_dir, name)
        with memory_cap():
            refused_only(lambda: load_checkpoint(step_dir), CheckpointError)


@FUZZ
@given(st.data())
def test_hostile_meta_fields_are_refused(data: st.DataObject) -> None:
    with _checkpoint() as step_dir:
        meta = json.loads((step_dir / META_FILE).read_text())
        (step_dir / META_FILE).write_text(json.dumps(data.draw(mutated_json(meta))))
        refused_only(lambda: load_checkpoint(step_dir), CheckpointError)


@pytest.mark.parametrize(
    "raw",
    [b"\xff\xfe{}", b'{"kind": "unsharded"\x80}', b"[" * 100_000],
    ids=["not-utf8", "bad-byte", "deeply-nested"],
)
def test_a_meta_json_that_is_not_text_or_too_deep_is_refused(raw: bytes) -> None:
    with _checkpoint() as step_dir:
        (step_dir / META_FILE).write_bytes(raw)
        with pytest.raises(CheckpointError, match=META_FILE):
            load_checkpoint(step_dir)


def test_a_file_name_with_a_nul_byte_in_meta_json_is_refused() -> None:
    with _checkpoint() as step_dir:
        meta = json.loads((step_dir / META_FILE).read_text())
        meta["files"]["model\x00.safetensors"] = 5
        (step_dir / META_FILE).write_text(json.dumps(meta))
        with pytest.raises(CheckpointError, match=META_FILE):
            load_checkpoint(step_dir)


@pytest.mark.parametrize(
    "groups", [[1], [{"betas": 0.9}], ["lr"], [{"lr": 1, "betas": None}]], ids=["int", "betas", "str", "none"]
)
def test_hostile_optimizer_groups_are_refused(groups: list[object]) -> None:
    with _checkpoint() as step_dir:
        meta = json.loads((step_dir / META_FILE).read_text())
        meta["optim_param_groups"] = groups
        (step_dir / META_FILE).write_text(json.dumps(meta))
        with pytest.raises(CheckpointError, match=META_FILE):
            load_checkpoint(step_dir)


@pytest.fixture(scope="module")
def loader() -> Iterator[BatchLoader]:
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "part-0.npy"
        np.save(path, np.arange(400, dtype=np.uint16))
        yield BatchLoader(TokenSequenceDataset([path], 8), batch_size=4, seed=1)


@FUZZ
@given(st.data())
def test_hostile_loader_states_are_refused(loader: BatchLoader, data: st.DataObject) -> None:
    """The loader's state as a checkpoint's meta.json carries it, with hostile fields."""
    state = data.draw(
        mutated_json(loader.state_dict())
        | st.dictionaries(
            st.sampled_from(["epoch", "position", "seed", "order", "windows", "seq_len", "shards"]), hostile_json()
        )
    )
    if refused_only(lambda: loader.load_state_dict(state), ValueError) is not None or not isinstance(state, dict):
        return
    assert loader.epoch >= 0 and 0 <= loader.position < len(loader.dataset)


@pytest.mark.parametrize(
    "state",
    [
        [],
        {"epoch": None, "position": 0, "seed": 1},
        {"epoch": 0, "position": float("inf"), "seed": 1},
        {"epoch": 0, "position": 0, "seed": "1"},
        {"epoch": 0, "position": 0, "seed": 1, "seq_len": [8]},
    ],
    ids=["list", "none", "inf", "text", "list-field"],
)
def test_a_loader_state_of_other_types_is_refused(loader: BatchLoader, state: object) -> None:
    with pytest.raises(ValueError, match="data loader state"):
        loader.load_state_dict(state)  # type: ignore[arg-type]


def test_an_optimizer_tensor_named_without_its_state_key_is_refused() -> None:
    """A damaged optim.safetensors header whose name lost its '/' (a flipped bit keeps the file's size)."""
    with _checkpoint() as step_dir:
        path = step_dir / OPTIM_FILE
        path.write_bytes(path.read_bytes().replace(b"w/exp_avg", b"w_exp_avg"))
        drop_checksums(step_dir)  # as saved before checksums: the optimizer's reader is what refuses it
        with pytest.raises(CheckpointError, match="w_exp_avg"):
            load_checkpoint(step_dir)
