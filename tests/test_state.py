"""Persistence of the server's round state: exact round trip, the commit point, refusing foreign or damaged state."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch

from spes.sync.state import STATE_FILE, SavedRound, load_round, save_round
from sync_helpers import tiny_manifest

MANIFEST = tiny_manifest()
RUN = {"num_peers": 2, "experts_per_peer": 2, "mode": "spes"}


def saved(step: int, seed: int = 0, momentum: bool = True) -> SavedRound:
    gen = torch.Generator().manual_seed(seed)
    model = {n: torch.randn(s, generator=gen) for n, s in MANIFEST.items()}
    buf = {"embed.weight": torch.randn(MANIFEST["embed.weight"], generator=gen)} if momentum else {}
    return SavedRound(step, (0, 1), True, 0.0123456789, dict(MANIFEST), model, buf)


def assert_equal(got: SavedRound, want: SavedRound) -> None:
    assert (got.step, got.peers, got.merged, got.alpha, got.manifest) == (
        want.step,
        want.peers,
        want.merged,
        want.alpha,
        want.manifest,
    )
    for ours, theirs in ((got.global_model, want.global_model), (got.momentum, want.momentum)):
        assert sorted(ours) == sorted(theirs)
        for name in theirs:
            assert ours[name].dtype == theirs[name].dtype and torch.equal(ours[name], theirs[name]), name


def test_fresh_directory_has_no_state(tmp_path: Path) -> None:
    assert load_round(tmp_path / "nothing", RUN) is None
    assert load_round(tmp_path, RUN) is None


def test_round_trip_is_exact_and_old_rounds_are_pruned(tmp_path: Path) -> None:
    save_round(tmp_path, saved(10, seed=1), RUN)
    assert_equal(load_round(tmp_path, RUN), saved(10, seed=1))  # type: ignore[arg-type]
    (tmp_path / ".round-20.safetensors.abc.tmp").write_bytes(b"half a file")  # left by a crash
    save_round(tmp_path, saved(20, seed=2, momentum=False), RUN)
    assert_equal(load_round(tmp_path, RUN), saved(20, seed=2, momentum=False))  # type: ignore[arg-type]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["round-20.safetensors", STATE_FILE]
    record = json.loads((tmp_path / STATE_FILE).read_text())
    assert record["round"] == 20 and record["manifest"]["embed.weight"] == [16, 8]


def test_a_fragments_round_keeps_its_fragment_the_layout_and_a_partial_global_model(tmp_path: Path) -> None:
    whole = saved(4, seed=3)
    part = {n: t for n, t in whole.global_model.items() if n.startswith("blocks.0.")}
    fragment_round = dataclasses.replace(whole, global_model=part, momentum={}, fragment=1, fragments=2, sync_steps=4)
    save_round(tmp_path, fragment_round, RUN)
    loaded = load_round(tmp_path, RUN)
    assert loaded is not None and (loaded.fragment, loaded.fragments, loaded.sync_steps) == (1, 2, 4)
    assert sorted(loaded.global_model) == sorted(part) and loaded.manifest == whole.manifest
    save_round(tmp_path, dataclasses.replace(fragment_round, fragment=0), RUN)  # a whole round must hold every tensor
    with pytest.raises(ValueError, match="do not match the manifest"):
        load_round(tmp_path, RUN)


def test_state_json_is_the_commit_point(tmp_path: Path) -> None:
    """A crash after the tensor file of round 30 was written but before state.json was replaced keeps round 20."""
    save_round(tmp_path, saved(20, seed=2), RUN)
    (tmp_path / "round-30.safetensors").write_bytes((tmp_path / "round-20.safetensors").read_bytes())
    (tmp_path / f".{STATE_FILE}.xyz.tmp").write_text("{ half")
    assert_equal(load_round(tmp_path, RUN), saved(20, seed=2))  # type: ignore[arg-type]


def test_the_held_model_of_an_int8_wire_round_trips_writing_shared_tensors_once(tmp_path: Path) -> None:
    want = saved(10, seed=4)
    held = {n: t if n.startswith("blocks.0") else t + 1 for n, t in want.global_model.items()}
    save_round(tmp_path, dataclasses.replace(want, held=held), RUN)
    record = json.loads((tmp_path / STATE_FILE).read_text())
    assert record["held_is_global"] == sorted(n for n in MANIFEST if n.startswith("blocks.0"))
    got = load_round(tmp_path, RUN)
    assert got is not None and list(got.held) == list(MANIFEST)
    for name, tensor in held.items():
        assert torch.equal(got.held[name], tensor), name
    assert_equal(got, want)


def test_state_of_another_run_is_refused(tmp_path: Path) -> None:
    save_round(tmp_path, saved(10), RUN)
    with pytest.raises(
        ValueError,
        match=r"state.json: written by a run with num_peers=2, this server has "
        r"num_peers=4; restart with the same settings or use a fresh --state_dir",
    ):
        load_round(tmp_path, {**RUN, "num_peers": 4})
    with pytest.raises(ValueError, match="mode='spes', this server has mode='diloco'"):
        load_round(tmp_path, {**RUN, "mode": "diloco"})


def test_state_naming_the_peers_total_peers_still_loads(tmp_path: Path) -> None:
    """A state written before the server's settings named the peer count `num_peers` resumes as it is."""
    save_round(tmp_path, saved(10), RUN)
    record = json.loads((tmp_path / STATE_FILE).read_text())
    record["run"] = {"total_peers": 2, "experts_per_peer": 2, "mode": "spes"}
    (tmp_path / STATE_FILE).write_text(json.dumps(record))
    assert_equal(load_round(tmp_path, RUN), saved(10))  # type: ignore[arg-type]


def test_damaged_state_is_refused_with_the_file_named(tmp_path: Path) -> None:
    tensor_file = save_round(tmp_path, saved(10), RUN)
    tensor_file.write_bytes(tensor_file.read_bytes()[:-4])
    with pytest.raises(ValueError, match="round-10.safetensors has .* bytes, state.json recorded"):
        load_round(tmp_path, RUN)
    tensor_file.unlink()
    with pytest.raises(FileNotFoundError, match="round-10.safetensors, which is missing"):
        load_round(tmp_path, RUN)
    (tmp_path / STATE_FILE).write_text("[1, 2]")
    with pytest.raises(ValueError, match="not a spes server state"):
        load_round(tmp_path, RUN)
    other = tmp_path / "other"
    bad = saved(10)
    save_round(other, SavedRound(10, (0,), False, 0.0, {"x": (3,)}, bad.global_model, {}), RUN)
    with pytest.raises(ValueError, match="do not match the manifest"):
        load_round(other, RUN)
