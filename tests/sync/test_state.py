"""Persistence of the server's round state: exact round trip, the commit point, refusing foreign or damaged state."""

from __future__ import annotations

import dataclasses
import errno
import json
import os
import re
import stat
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors import SafetensorError

from spes.atomic import lock_holder
from spes.config import ServerSection
from spes.sync.state import (
    LOCK_FILE,
    RUN_FILE,
    STATE_FILE,
    SavedRound,
    load_round,
    lock_state_dir,
    new_run_id,
    run_id_of,
    save_round,
)
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
        r"num_peers=4; restart it with spes_config.num_peers as that run had it, or use a fresh --state_dir for a new "
        r"run$",
    ):
        load_round(tmp_path, tiny_spec(num_peers=4, num_blocks=2))
    # the run's length may change at a restart, but not to a step the run has passed
    save_round(tmp_path / "long", dataclasses.replace(saved(10), spec=dataclasses.replace(SPEC, last_step=40)))
    with pytest.raises(
        ValueError,
        match=r"state.json: the run has completed round 10, this server's max_duration ends it at step 10; restart it "
        r"with a max_duration past step 10, or use a fresh --state_dir for a new run$",
    ):
        load_round(tmp_path / "long", dataclasses.replace(SPEC, last_step=10))
    with pytest.raises(ValueError, match="mode='spes', this server has mode='diloco'"):
        load_round(tmp_path, tiny_spec(mode="diloco"))
    with pytest.raises(ValueError, match="codec='fp32', this server has codec='int8'"):
        load_round(tmp_path, tiny_spec(codec="int8"))


def test_state_of_another_model_is_refused_naming_the_tensor(tmp_path: Path) -> None:
    """A restart whose YAML builds another model than the state's (a mixed-up --state_dir, an edited config) would
    serve the state's tensors to nodes of the YAML's shapes and refuse the run's own nodes as the wrong model."""
    save_round(tmp_path, saved(10))
    with pytest.raises(
        ValueError,
        match=r"state.json: written by a run with another model than this server's: 'blocks.0.attn.qkv.weight' has "
        r"shape \[48, 16\], the run's is \[24, 8\]; .*restart it with the model settings that run had, or use a "
        r"fresh --state_dir for a new run$",
    ):
        load_round(tmp_path, tiny_spec(d=16))
    with pytest.raises(ValueError, match=r"another model than this server's \(configs/other.yaml\): 'blocks"):
        load_round(tmp_path, dataclasses.replace(tiny_spec(d=16), origin="configs/other.yaml"))  # the YAML named
    assert load_round(tmp_path, dataclasses.replace(SPEC, manifest=None)) is not None  # no YAML: the state's model


def test_a_restart_may_change_the_runs_length_while_the_run_has_not_reached_it(tmp_path: Path) -> None:
    save_round(tmp_path, dataclasses.replace(saved(10), spec=dataclasses.replace(SPEC, last_step=40)))
    for length in (80, 11):  # longer, or sooner but past the saved round
        loaded = load_round(tmp_path, dataclasses.replace(SPEC, last_step=length))
        assert loaded is not None and loaded.spec.last_step == length and loaded.length_was == 40
    same = load_round(tmp_path, dataclasses.replace(SPEC, last_step=40))
    assert same is not None and same.spec.last_step == 40 and same.length_was is None
    unset = load_round(tmp_path, dataclasses.replace(SPEC, last_step=None))  # a server started without the YAML
    assert unset is not None and unset.spec.last_step == 40 and unset.length_was is None


def test_a_restart_names_each_server_setting_it_changed(tmp_path: Path) -> None:
    section = ServerSection(merge_alpha_start=0.05, dead_peer_policy="quorum")
    save_round(tmp_path, dataclasses.replace(saved(10), spec=dataclasses.replace(SPEC, server=section)))
    assert json.loads((tmp_path / STATE_FILE).read_text())["server"]["merge_alpha_start"] == 0.05
    same = load_round(tmp_path, dataclasses.replace(SPEC, server=section))
    assert same is not None and same.server_changed == ()
    other = dataclasses.replace(section, merge_alpha_start=0.1, min_peers=2)
    changed = load_round(tmp_path, dataclasses.replace(SPEC, server=other))
    assert changed is not None and changed.server_changed == (
        "server.merge_alpha_start: 0.05 -> 0.1",
        "server.min_peers: None -> 2",
    )
    record = json.loads((tmp_path / STATE_FILE).read_text())
    del record["server"]  # a state written before the section was recorded: nothing to compare
    (tmp_path / STATE_FILE).write_text(json.dumps(record))
    older = load_round(tmp_path, dataclasses.replace(SPEC, server=other))
    assert older is not None and older.server_changed == ()


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
    (tmp_path / STATE_FILE).write_text(json.dumps({"format": "2", "round": 3}))
    with pytest.raises(ValueError, match="of this version \\(format '2', this spes reads format 2\\)"):
        load_round(tmp_path, SPEC)
    other = tmp_path / "other"
    bad = saved(10)
    small = tiny_spec(num_layers=1)
    save_round(other, dataclasses.replace(bad, spec=small))
    with pytest.raises(ValueError, match="do not match the manifest"):
        load_round(other, small)


def test_a_run_id_is_made_once_per_state_dir_and_a_damaged_record_refused(tmp_path: Path) -> None:
    state_dir = tmp_path / "new" / "state"
    run_id = run_id_of(state_dir)
    assert re.fullmatch(r"[0-9a-f]{16}", run_id) and run_id_of(state_dir) == run_id != new_run_id()
    record = json.loads((state_dir / RUN_FILE).read_text())
    assert record["run_id"] == run_id and re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d", record["created"])
    for damaged in ("{ half", "[]", "{}"):
        (state_dir / RUN_FILE).write_text(damaged)
        with pytest.raises(ValueError, match=r"run.json: not a spes run record \(.*\); move it away or pick another "):
            run_id_of(state_dir)


def test_a_state_dir_is_held_by_one_server_at_a_time_and_free_again_once_it_lets_go(tmp_path: Path) -> None:
    """Two servers on one --state_dir would write their rounds over each other's: while one holds its lock (its pid
    in the lock file) another is refused, naming it; once the first lets go (closing the descriptor, as its exit or
    death does) the directory is free, and a round saved meanwhile leaves the lock file alone."""
    state_dir = tmp_path / "new" / "state"
    held = lock_state_dir(state_dir)  # the directory made as needed
    try:
        assert (state_dir / LOCK_FILE).read_text() == f"{lock_holder()}\n"
        for _ in range(2):  # a refusal leaves the holder's lock (and pid) as it was
            with pytest.raises(ValueError) as refused:
                lock_state_dir(state_dir)
            assert str(refused.value) == (
                f"--state_dir {state_dir} is in use by another parameter server ({lock_holder()}); stop it or pass "
                "another --state_dir"
            )
        save_round(state_dir, saved(1))
        assert (state_dir / LOCK_FILE).is_file()
    finally:
        os.close(held)
    again = lock_state_dir(state_dir)
    os.close(again)
    (tmp_path / "file").write_text("")
    with pytest.raises(ValueError, match=r"^--state_dir .*/file: cannot use it \(.*\); pick another --state_dir$"):
        lock_state_dir(tmp_path / "file")


def test_a_refusal_names_the_holder_its_lock_file_names_and_anyone_may_read_it(tmp_path: Path) -> None:
    umask = os.umask(0o022)
    try:
        held = lock_state_dir(tmp_path)
    finally:
        os.umask(umask)
    try:
        assert stat.S_IMODE((tmp_path / LOCK_FILE).stat().st_mode) == 0o644
        for written, named in ((b"", "pid unknown"), (b"\xff12\n", "\ufffd12")):  # none written yet, or not text
            os.ftruncate(held, 0)
            os.pwrite(held, written, 0)
            with pytest.raises(ValueError, match=rf"in use by another parameter server \({named}\); stop it"):
                lock_state_dir(tmp_path)
    finally:
        os.close(held)


def test_the_whole_spec_round_trips_and_completes_a_server_started_without_yaml(tmp_path: Path) -> None:
    spec = dataclasses.replace(tiny_spec(overlap_fragments=2, sync_steps=4), last_step=40)
    save_round(tmp_path / "a" / "b", dataclasses.replace(saved(8), spec=spec))  # its directory made as needed
    opened = dataclasses.replace(spec, manifest=None, sync_steps=None, block_owners=None, experts_per_block=None)
    for asked in (spec, dataclasses.replace(opened, last_step=None)):
        loaded = load_round(tmp_path / "a" / "b", asked)
        assert loaded is not None and loaded.spec == spec and loaded.spec.last_step == 40
    with pytest.raises(ValueError, match="written by a run with overlap_fragments=2, this server has overlap_fr"):
        load_round(tmp_path / "a" / "b", tiny_spec(sync_steps=4))


def test_a_state_without_the_optional_fields_is_a_whole_round_without_shared_codec_tensors(tmp_path: Path) -> None:
    save_round(tmp_path, saved(10))
    record = json.loads((tmp_path / STATE_FILE).read_text())
    del record["codec_is_global"], record["fragment"]
    (tmp_path / STATE_FILE).write_text(json.dumps(record))
    loaded = load_round(tmp_path, SPEC)
    assert loaded is not None and loaded.fragment == 0 and loaded.codec_state == {}


def test_a_codecs_state_is_of_the_tensors_the_global_model_holds_in_a_fragments_round_too(tmp_path: Path) -> None:
    """Before every fragment has had a round, the held model is as partial as the global model: a restarted server
    resumes from it (it was refused as not matching the manifest)."""
    spec = tiny_spec(codec="int8", overlap_fragments=2, sync_steps=4)
    whole = dataclasses.replace(saved(2, seed=5), spec=spec, momentum={}, fragment=1)
    part = {n: t for n, t in whole.global_model.items() if n.startswith("blocks.0.")}
    fragment_round = dataclasses.replace(whole, global_model=part, codec_state={n: t + 1 for n, t in part.items()})
    save_round(tmp_path, fragment_round)
    got = load_round(tmp_path, spec)
    assert got is not None and list(got.codec_state) == [n for n in MANIFEST if n in part]
    assert_equal(got, fragment_round)
    elsewhere = {n: torch.zeros(s) for n, s in MANIFEST.items() if n not in part}
    save_round(tmp_path, dataclasses.replace(fragment_round, codec_state=elsewhere))  # not what the model holds
    with pytest.raises(ValueError, match="do not match the manifest"):
        load_round(tmp_path, spec)


def test_momentum_must_be_of_model_tensors_and_every_tensor_of_its_shape(tmp_path: Path) -> None:
    full = saved(10)
    everywhere = dataclasses.replace(full, momentum={n: torch.zeros(s) for n, s in MANIFEST.items()})
    save_round(tmp_path / "all", everywhere)
    assert_equal(load_round(tmp_path / "all", SPEC), everywhere)  # momentum for every tensor: fine
    stray = dataclasses.replace(full, momentum={"not.a.tensor": torch.zeros(2)})
    save_round(tmp_path / "stray", stray)
    with pytest.raises(ValueError, match="do not match the manifest"):
        load_round(tmp_path / "stray", SPEC)
    name = next(iter(MANIFEST))
    reshaped = {name: torch.zeros(3)}  # a fragment's round (not every tensor), one tensor of another shape
    save_round(tmp_path / "shape", dataclasses.replace(full, global_model=reshaped, momentum={}, fragment=1))
    with pytest.raises(ValueError, match="round-10.safetensors: its tensors do not match the manifest in"):
        load_round(tmp_path / "shape", SPEC)


def test_a_byte_flipped_in_the_round_files_tensors_is_refused_not_served(tmp_path: Path) -> None:
    """A flipped bit in a tensor's bytes keeps the file's size, header and finiteness: a restarted server served
    the damaged global model to every peer."""
    tensor_file = save_round(tmp_path, saved(10))
    data = bytearray(tensor_file.read_bytes())
    data[-5] ^= 0x10
    tensor_file.write_bytes(bytes(data))
    with pytest.raises(ValueError) as refused:
        load_round(tmp_path, SPEC)
    assert str(refused.value) == (
        f"{tensor_file}: its bytes differ from the checksum state.json recorded (changed on disk since the round was "
        "saved): the state directory is damaged"
    )
    record = json.loads((tmp_path / STATE_FILE).read_text())
    (tmp_path / STATE_FILE).write_text(json.dumps({**record, "tensor_file_xxh3_128": None}))  # saved before checksums
    assert load_round(tmp_path, SPEC) is not None


def test_a_damaged_tensor_file_of_the_recorded_size_is_refused_as_unreadable(tmp_path: Path) -> None:
    tensor_file = save_round(tmp_path, saved(10))
    record = json.loads((tmp_path / STATE_FILE).read_text())
    del record["tensor_file_xxh3_128"]  # a state saved before checksums: the safetensors reader is what refuses it
    (tmp_path / STATE_FILE).write_text(json.dumps(record))
    data = bytearray(tensor_file.read_bytes())
    data[8:24] = b"\xff" * 16  # the header's JSON
    tensor_file.write_bytes(bytes(data))
    with pytest.raises(ValueError, match=r"round-10.safetensors: unreadable \(.*\): the state directory is damaged$"):
        load_round(tmp_path, SPEC)
    tensor_file.unlink()
    with pytest.raises(FileNotFoundError, match=f"^{tmp_path / STATE_FILE} names {tensor_file}, which is missing"):
        load_round(tmp_path, SPEC)


@pytest.mark.parametrize(
    ("found", "refusal"),
    [
        (
            1,
            "written by an earlier spes (server state format 1, this one reads format 2); finish this run with the "
            "spes version that started it (server and every node), or start a new run (a fresh --state_dir, every "
            "node without --resume)",
        ),
        (
            3,
            "written by a later spes (server state format 3, this one reads format 2); run the spes version that wrote "
            "it on the server and every node",
        ),
    ],
)
def test_a_state_of_another_spes_version_says_which_and_what_to_do(tmp_path: Path, found: int, refusal: str) -> None:
    """A format 1 state (spes before 2026-11-27, as it wrote it) was 'not a spes server state of this version ...;
    move it away': the restarted server then holds no round, and the run's resuming nodes are refused."""
    record = {"format": found, "round": 20, "peers": [0, 1], "merged": False, "alpha": 0.0, "sync_steps": 0}
    record |= {"run": {"num_peers": 2, "experts_per_peer": 2, "mode": "spes"}, "held_is_global": [], "fragment": 0}
    (tmp_path / STATE_FILE).write_text(json.dumps({**record, "tensor_file": "round-20.safetensors"}))
    with pytest.raises(ValueError) as refused:
        load_round(tmp_path, SPEC)
    assert str(refused.value) == f"{tmp_path / STATE_FILE}: {refusal}"


@pytest.mark.parametrize(
    ("field", "value", "why"),
    [
        ("tensor_file", 7, "tensor_file 7 is not a file name"),
        ("alpha", float("nan"), "merge alpha nan is not a number"),
        ("tensor_file_xxh3_128", 7, "tensor_file_xxh3_128 7 is not a checksum"),
    ],
)
def test_a_hostile_field_is_refused_saying_what_it_holds(tmp_path: Path, field: str, value: object, why: str) -> None:
    save_round(tmp_path, saved(10))
    record = json.loads((tmp_path / STATE_FILE).read_text())
    (tmp_path / STATE_FILE).write_text(json.dumps({**record, field: value}))
    with pytest.raises(ValueError) as refused:
        load_round(tmp_path, SPEC)
    assert str(refused.value) == (
        f"{tmp_path / STATE_FILE}: not a spes server state of this version ({why}); move it away or pick another "
        "--state_dir"
    )


@pytest.mark.parametrize(
    ("prefix", "spoil", "what"),
    [
        ("", lambda t: t.half(), "is torch.float16, not one of the wire's dtypes"),
        ("momentum/", lambda t: torch.full_like(t, float("inf")), "holds NaN or Inf"),
    ],
    ids=["a model tensor in fp16", "a momentum buffer of Inf"],
)
def test_a_round_file_tensor_of_another_dtype_or_not_finite_is_refused_naming_it(
    tmp_path: Path, prefix: str, spoil: Callable[[torch.Tensor], torch.Tensor], what: str
) -> None:
    """The file and the tensor as the file holds it (a momentum buffer under its prefix) are named."""
    good = saved(10)
    spoilt = {"embed.weight": spoil(good.global_model["embed.weight"])}
    bad = (
        dataclasses.replace(good, momentum=spoilt)
        if prefix
        else dataclasses.replace(good, global_model={**good.global_model, **spoilt})
    )
    tensor_file = save_round(tmp_path, bad)
    with pytest.raises(ValueError) as refused:
        load_round(tmp_path, SPEC)
    assert str(refused.value) == f"{tensor_file}: tensor '{prefix}embed.weight' {what}: the state directory is damaged"


def test_a_round_that_finds_no_room_fails_as_an_oserror_and_the_last_round_stays(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """safetensors reports a full disk as its own SafetensorError: raised as the OSError it stands for, the server's
    failed round carries its fix ("free space there ... --resume=auto"; RoundCloser words it for OSErrors only)."""
    save_round(tmp_path, saved(10, seed=1))

    def full_disk(tensors: object, path: str) -> None:
        Path(path).write_bytes(b"part of a round")
        raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")

    monkeypatch.setattr("spes.sync.state.save_file", full_disk)
    with pytest.raises(OSError) as caught:
        save_round(tmp_path, saved(20, seed=2))
    assert caught.value.errno == errno.ENOSPC and caught.value.filename == str(tmp_path / "round-20.safetensors")
    assert_equal(load_round(tmp_path, SPEC), saved(10, seed=1))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["round-10.safetensors", STATE_FILE]


def test_a_state_dir_without_room_for_the_run_record_is_refused_naming_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A server starting on a full disk: refused in one line naming --state_dir (was a traceback)."""

    def full_disk(path: Path, data: bytes) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr("spes.sync.state.write_atomic", full_disk)
    with pytest.raises(ValueError) as caught:
        run_id_of(tmp_path)
    assert str(caught.value) == (
        f"--state_dir {tmp_path}: cannot write {RUN_FILE} (No space left on device); free space there or pick another "
        "--state_dir"
    )
