"""Persistence of the server's round state: exact round trip, the commit point, refusing foreign or damaged state."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch

from spes.sync.state import STATE_FILE, SavedRound, load_round, save_round
from sync_helpers import tiny_spec

SPEC = tiny_spec()
MANIFEST = SPEC.manifest or {}


def saved(step: int, seed: int = 0, momentum: bool = True) -> SavedRound:
    gen = torch.Generator().manual_seed(seed)
    model = {n: torch.randn(s, generator=gen) for n, s in MANIFEST.items()}
    buf = {"embed.weight": torch.randn(MANIFEST["embed.weight"], generator=gen)} if momentum else {}
    return SavedRound(step, (0, 1), 0, 0.0123456789, model, buf, {}, SPEC)


def assert_equal(got: SavedRound | None, want: SavedRound) -> None:
    assert got is not None
    assert (got.step, got.peers, got.fragment, got.alpha) == (want.step, want.peers, want.fragment, want.alpha)
    assert got.spec == want.spec and got.spec.manifest == want.spec.manifest
    for ours, theirs in (
        (got.global_model, want.global_model),
        (got.momentum, want.momentum),
        (got.codec_state, want.codec_state),
    ):
        assert sorted(ours) == sorted(theirs)
        for name in theirs:
            assert ours[name].dtype == theirs[name].dtype and torch.equal(ours[name], theirs[name]), name


def test_fresh_directory_has_no_state(tmp_path: Path) -> None:
    assert load_round(tmp_path / "nothing", SPEC) is None
    assert load_round(tmp_path, SPEC) is None


def test_round_trip_is_exact_and_old_rounds_are_pruned(tmp_path: Path) -> None:
    save_round(tmp_path, saved(10, seed=1))
    assert_equal(load_round(tmp_path, SPEC), saved(10, seed=1))
    (tmp_path / ".round-20.safetensors.abc.tmp").write_bytes(b"half a file")  # left by a crash
    save_round(tmp_path, saved(20, seed=2, momentum=False))
    assert_equal(load_round(tmp_path, SPEC), saved(20, seed=2, momentum=False))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["round-20.safetensors", STATE_FILE]
    record = json.loads((tmp_path / STATE_FILE).read_text())
    assert record["round"] == 20 and record["manifest"]["embed.weight"] == [16, 8]
    assert record["spec"]["mode"] == "spes" and record["spec"]["block_owners"] == [0, 1]


def test_a_fragments_round_keeps_its_fragment_and_a_partial_global_model(tmp_path: Path) -> None:
    spec = tiny_spec(overlap_fragments=2, sync_steps=4)
    whole = dataclasses.replace(saved(4, seed=3), spec=spec)
    part = {n: t for n, t in whole.global_model.items() if n.startswith("blocks.0.")}
    fragment_round = dataclasses.replace(whole, global_model=part, momentum={}, fragment=1)
    save_round(tmp_path, fragment_round)
    loaded = load_round(tmp_path, spec)
    assert loaded is not None and loaded.fragment == 1 and loaded.spec.overlap_fragments == 2
    assert sorted(loaded.global_model) == sorted(part) and loaded.spec.manifest == MANIFEST
    save_round(tmp_path, dataclasses.replace(fragment_round, fragment=0))  # a whole round must hold every tensor
    with pytest.raises(ValueError, match="do not match the manifest"):
        load_round(tmp_path, spec)


def test_state_json_is_the_commit_point(tmp_path: Path) -> None:
    """A crash after the tensor file of round 30 was written but before state.json was replaced keeps round 20."""
    save_round(tmp_path, saved(20, seed=2))
    (tmp_path / "round-30.safetensors").write_bytes((tmp_path / "round-20.safetensors").read_bytes())
    (tmp_path / f".{STATE_FILE}.xyz.tmp").write_text("{ half")
    assert_equal(load_round(tmp_path, SPEC), saved(20, seed=2))


def test_a_codecs_state_round_trips_writing_tensors_shared_with_the_global_model_once(tmp_path: Path) -> None:
    spec = tiny_spec(codec="int8")
    want = dataclasses.replace(saved(10, seed=4), spec=spec)
    held = {n: t if n.startswith("blocks.0") else t + 1 for n, t in want.global_model.items()}
    want = dataclasses.replace(want, codec_state=held)
    save_round(tmp_path, want)
    record = json.loads((tmp_path / STATE_FILE).read_text())
    assert record["codec_is_global"] == sorted(n for n in MANIFEST if n.startswith("blocks.0"))
    got = load_round(tmp_path, spec)
    assert got is not None and list(got.codec_state) == list(MANIFEST)
    assert_equal(got, want)


def test_state_of_another_run_is_refused_naming_the_field(tmp_path: Path) -> None:
    save_round(tmp_path, saved(10))
    with pytest.raises(
        ValueError,
        match=r"state.json: written by a run with num_peers=2, this server has "
        r"num_peers=4; restart with the same settings or use a fresh --state_dir",
    ):
        load_round(tmp_path, tiny_spec(num_peers=4, num_blocks=2))
    with pytest.raises(ValueError, match="mode='spes', this server has mode='diloco'"):
        load_round(tmp_path, tiny_spec(mode="diloco"))
    with pytest.raises(ValueError, match="codec='fp32', this server has codec='int8'"):
        load_round(tmp_path, tiny_spec(codec="int8"))


def test_a_server_without_the_runs_yaml_takes_its_open_fields_from_the_state(tmp_path: Path) -> None:
    save_round(tmp_path, saved(10))
    open_spec = dataclasses.replace(SPEC, manifest=None, sync_steps=None, block_owners=None)
    loaded = load_round(tmp_path, open_spec)
    assert loaded is not None and loaded.spec == SPEC and loaded.spec.manifest == MANIFEST and loaded.spec.complete


def test_damaged_or_older_state_is_refused_with_the_file_named(tmp_path: Path) -> None:
    tensor_file = save_round(tmp_path, saved(10))
    tensor_file.write_bytes(tensor_file.read_bytes()[:-4])
    with pytest.raises(ValueError, match="round-10.safetensors has .* bytes, state.json recorded"):
        load_round(tmp_path, SPEC)
    tensor_file.unlink()
    with pytest.raises(FileNotFoundError, match="round-10.safetensors, which is missing"):
        load_round(tmp_path, SPEC)
    (tmp_path / STATE_FILE).write_text("[1, 2]")
    with pytest.raises(ValueError, match="not a spes server state of this version"):
        load_round(tmp_path, SPEC)
    (tmp_path / STATE_FILE).write_text(json.dumps({"format": 1, "round": 3}))
    with pytest.raises(ValueError, match="format 1, this spes reads format 2"):
        load_round(tmp_path, SPEC)
    other = tmp_path / "other"
    bad = saved(10)
    small = tiny_spec(num_layers=1)
    save_round(other, dataclasses.replace(bad, spec=small))
    with pytest.raises(ValueError, match="do not match the manifest"):
        load_round(other, small)
