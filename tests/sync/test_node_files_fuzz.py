"""Fuzz of what a node checkpoint holds for the sync wing (`spes.sync.node_files`: `run.json`, `pending_round.st`,
`codec_state.st`; `spes.sync.overlap.PendingRound`): saved files load back; damaged ones load or are refused with a
ValueError naming the file, never another exception."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from fuzz_helpers import FEW, FUZZ, hostile_json, memory_cap, mutated, refused_only
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

pytestmark = pytest.mark.timeout(120)

MANIFEST = {"w": (3, 4), "b": (5,)}


def _pending() -> PendingRound:
    return PendingRound(round_id=20, step=20, snapshot={n: torch.ones(s) for n, s in MANIFEST.items()})


@FUZZ
@given(st.text(max_size=20))
def test_run_ids_round_trip(run_id: str) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        write_run_id(Path(tmp) / RUN_FILE, run_id)
        assert read_run_id(Path(tmp)) == run_id


@FUZZ
@given(st.one_of(st.binary(max_size=64), hostile_json().map(lambda v: json.dumps(v).encode())))
def test_damaged_run_records_are_refused(raw: bytes) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / RUN_FILE).write_bytes(raw)
        refused_only(lambda: read_run_id(Path(tmp)), ValueError)


@FEW
@given(st.data())
def test_damaged_pending_rounds_are_refused(data: st.DataObject) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / PENDING_FILE
        _pending().save(path)
        path.write_bytes(data.draw(mutated(path.read_bytes())))
        with memory_cap():
            pending = refused_only(lambda: read_pending(Path(tmp), MANIFEST, lambda step: sorted(MANIFEST)), ValueError)
    if pending is not None:
        assert pending.round_id >= 0 and pending.step >= 0  # type: ignore[attr-defined]


@FEW
@given(st.data())
def test_damaged_codec_states_are_refused(data: st.DataObject) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / CODEC_FILE
        save_codec_state(path, {"codec": "int8", "round": "20"}, {"held/w": torch.ones(3, 4)})
        path.write_bytes(data.draw(mutated(path.read_bytes())))
        with memory_cap():
            refused_only(lambda: load_codec_state(path), ValueError)


@FUZZ
@given(
    st.dictionaries(
        st.sampled_from(["format", "round_id", "step", "x"]),
        st.one_of(st.sampled_from(["1", "0", "-1", "20", "2" * 40, "1e3", " 5", "\u0665"]), st.text(max_size=25)),
    )
)
def test_hostile_pending_metadata_is_refused(metadata: dict[str, str]) -> None:
    """Header metadata with ids that are not integers, negative, or past any step."""
    from safetensors.torch import save_file

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / PENDING_FILE
        save_file({n: torch.ones(s) for n, s in MANIFEST.items()}, str(path), metadata=metadata)
        refused_only(lambda: PendingRound.load(path, MANIFEST), ValueError)


def test_a_run_record_nested_too_deep_is_refused(tmp_path: Path) -> None:
    """JSON nested deeper than the interpreter's recursion limit raises RecursionError in `json.loads`."""
    (tmp_path / RUN_FILE).write_bytes(b"[" * 100_000)
    with pytest.raises(ValueError, match="not a run record"):
        read_run_id(tmp_path)
