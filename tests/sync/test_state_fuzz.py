"""Fuzz of the server's state files (`spes.sync.state`: `state.json`, `round-<step>.safetensors`, `run.json`): a saved
round loads back; a state damaged byte by byte or field by field loads or is refused with a ValueError naming the file
(FileNotFoundError for a tensor file that is gone), never another exception."""

from __future__ import annotations

import json
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from fuzz_helpers import FEW, FUZZ, hostile_json, memory_cap, mutated, mutated_json, refused_only
from spes.sync.state import RUN_FILE, STATE_FILE, SavedRound, load_round, run_id_of, save_round
from sync_helpers import tiny_spec

pytestmark = pytest.mark.timeout(120)

SPEC = tiny_spec()
MANIFEST = SPEC.manifest or {}


@contextmanager
def _saved_state() -> Iterator[Path]:
    """A state directory holding round 4 of `SPEC` (with momentum)."""
    gen = torch.Generator().manual_seed(0)
    model = {n: torch.randn(s, generator=gen) for n, s in MANIFEST.items()}
    momentum = {"embed.weight": torch.zeros(MANIFEST["embed.weight"])}
    with tempfile.TemporaryDirectory() as tmp:
        save_round(tmp, SavedRound(4, (0, 1), 0, 0.5, model, momentum, {}, SPEC))
        yield Path(tmp)


def test_a_saved_round_loads_back() -> None:
    with _saved_state() as state:
        loaded = load_round(state, SPEC)
        assert loaded is not None and loaded.step == 4 and sorted(loaded.global_model) == sorted(MANIFEST)


@FUZZ
@given(st.data())
def test_damaged_state_json_is_refused(data: st.DataObject) -> None:
    with _saved_state() as state:
        path = state / STATE_FILE
        if data.draw(st.booleans()):
            path.write_text(json.dumps(data.draw(mutated_json(json.loads(path.read_text())))))
        else:
            path.write_bytes(data.draw(mutated(path.read_bytes())))
        with memory_cap():
            refused_only(lambda: load_round(state, SPEC), ValueError, FileNotFoundError)


@FEW
@given(st.data())
def test_damaged_tensor_files_are_refused(data: st.DataObject) -> None:
    """A round file damaged at the same size (`state.json` records the size: a cut file is refused by it)."""
    with _saved_state() as state:
        (tensor_file,) = state.glob("round-*.safetensors")
        raw = tensor_file.read_bytes()
        damaged = data.draw(mutated(raw))
        damaged = (damaged + bytes(len(raw)))[: len(raw)] if data.draw(st.booleans()) else damaged
        tensor_file.write_bytes(damaged)
        with memory_cap():
            refused_only(lambda: load_round(state, SPEC), ValueError, FileNotFoundError)


@FUZZ
@given(st.one_of(st.binary(max_size=64), hostile_json().map(lambda v: json.dumps(v).encode())))
def test_damaged_run_records_are_refused(raw: bytes) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / RUN_FILE).write_bytes(raw)
        run_id = refused_only(lambda: run_id_of(tmp), ValueError)
        assert run_id is None or isinstance(run_id, str)


@pytest.mark.parametrize(
    ("field", "value"),
    [("tensor_file", None), ("tensor_file", 7), ("tensor_file_bytes", None), ("alpha", "nan"), ("alpha", "-inf")],
)
def test_a_hostile_field_of_state_json_is_refused(field: str, value: object) -> None:
    with _saved_state() as state:
        record = json.loads((state / STATE_FILE).read_text())
        record[field] = float(value) if isinstance(value, str) else value
        (state / STATE_FILE).write_text(json.dumps(record))
        with pytest.raises(ValueError, match=STATE_FILE):
            load_round(state, SPEC)


def test_a_state_missing_its_file_size_is_refused() -> None:
    with _saved_state() as state:
        record = json.loads((state / STATE_FILE).read_text())
        del record["tensor_file_bytes"]
        (state / STATE_FILE).write_text(json.dumps(record))
        with pytest.raises(ValueError, match="tensor_file_bytes"):
            load_round(state, SPEC)


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_a_round_file_holding_nan_or_inf_is_refused(bad: float) -> None:
    """A flipped bit in a value keeps the file's size: the loaded model must still be finite (in a state saved before
    its checksum, which refuses any flipped bit)."""
    with _saved_state() as state:
        record = json.loads((state / STATE_FILE).read_text())
        del record["tensor_file_xxh3_128"]
        (state / STATE_FILE).write_text(json.dumps(record))
        (tensor_file,) = state.glob("round-*.safetensors")
        raw = bytearray(tensor_file.read_bytes())
        one = torch.tensor([1.0]).view(torch.uint8).numpy().tobytes()
        value = torch.tensor([bad]).view(torch.uint8).numpy().tobytes()
        header = 8 + int.from_bytes(raw[:8], "little")
        raw[header : header + 4] = value
        assert raw[header : header + 4] != one
        tensor_file.write_bytes(bytes(raw))
        with pytest.raises(ValueError, match="NaN or Inf"):
            load_round(state, SPEC)


@pytest.mark.parametrize("name", [RUN_FILE, STATE_FILE])
def test_json_nested_too_deep_is_refused(name: str) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / name).write_bytes(b"[" * 100_000)
        with pytest.raises(ValueError, match=name):
            run_id_of(tmp) if name == RUN_FILE else load_round(tmp, SPEC)


def test_a_bf16_runs_round_with_its_experts_in_bf16_loads_back(tmp_path: Path) -> None:
    """A bf16 run's server keeps the experts as they arrived, in bf16 (what a restarted server of that run reads);
    another dtype is refused."""
    spec = tiny_spec(codec="bf16")
    manifest = spec.manifest or {}
    model = {n: torch.ones(s, dtype=torch.bfloat16 if ".experts." in n else torch.float32) for n, s in manifest.items()}
    save_round(tmp_path, SavedRound(4, (0, 1), 0, 0.5, model, {}, {}, spec))
    loaded = load_round(tmp_path, spec)
    assert loaded is not None and {n: t.dtype for n, t in loaded.global_model.items()} == {
        n: t.dtype for n, t in model.items()
    }
    assert any(t.dtype == torch.bfloat16 for t in model.values())
    save_round(tmp_path, SavedRound(5, (0, 1), 0, 0.5, {n: t.half() for n, t in model.items()}, {}, {}, spec))
    with pytest.raises(ValueError, match="is torch.float16, not one of the wire's dtypes"):
        load_round(tmp_path, spec)
