"""Tests for spes.sync.overlap: the apply rule of an overlapped round and the pending round's file."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import save_file

from spes.sync.overlap import PendingRound, apply_overlapped


def bits(t: torch.Tensor) -> torch.Tensor:
    """The raw bits of a float tensor, so -0.0 and +0.0 (and NaN payloads) compare as different."""
    return t.view({torch.float32: torch.int32, torch.bfloat16: torch.int16}[t.dtype])


def test_hand_computed_case() -> None:
    glob = {"shared": torch.tensor([1.0, 2.0, 3.0]), "frozen": torch.tensor([10.0, 20.0])}
    snapshot = {"shared": torch.tensor([0.5, 0.5, 0.5])}
    now = {"shared": torch.tensor([0.75, 0.25, 1.5]), "frozen": torch.tensor([-1.0, -2.0])}
    out = apply_overlapped(glob, now, snapshot)
    # shared: global + (now - snapshot) = [1 + 0.25, 2 - 0.25, 3 + 1.0]; frozen: the global values
    assert torch.equal(out["shared"], torch.tensor([1.25, 1.75, 4.0]))
    assert torch.equal(out["frozen"], torch.tensor([10.0, 20.0]))
    assert torch.equal(now["shared"], torch.tensor([0.75, 0.25, 1.5])), "inputs must not be modified"


def test_hand_computed_case_with_a_damped_correction() -> None:
    glob = {"shared": torch.tensor([1.0, 2.0, 3.0]), "frozen": torch.tensor([10.0, 20.0])}
    snapshot = {"shared": torch.tensor([0.5, 0.5, 0.5])}
    now = {"shared": torch.tensor([0.75, 0.25, 1.5]), "frozen": torch.tensor([-1.0, -2.0])}
    out = apply_overlapped(glob, now, snapshot, correction=0.5)
    # shared: now + 0.5 * (global - snapshot) = [0.75 + 0.25, 0.25 + 0.75, 1.5 + 1.25]; frozen: the global values
    assert torch.equal(out["shared"], torch.tensor([1.0, 1.0, 2.75]))
    assert torch.equal(out["frozen"], torch.tensor([10.0, 20.0]))


def test_a_damped_correction_keeps_the_mean_over_peers_and_shrinks_their_spread() -> None:
    """The server's global is the peers' mean snapshot, so the corrections sum to zero: any c keeps the mean
    of the peers' new values, and a smaller c leaves them nearer their own (the spread shrinks less per round,
    but a late correction no longer overshoots)."""
    gen = torch.Generator().manual_seed(2)
    snaps = [torch.randn(40, generator=gen) for _ in range(4)]
    nows = [s + 0.1 * torch.randn(40, generator=gen) for s in snaps]
    glob = torch.stack(snaps).mean(0)
    for c in (1.0, 0.5, 0.25):
        out = [apply_overlapped({"w": glob}, {"w": n}, {"w": s}, correction=c)["w"] for n, s in zip(nows, snaps)]
        torch.testing.assert_close(torch.stack(out).mean(0), torch.stack(nows).mean(0))
        for o, n, s in zip(out, nows, snaps):
            torch.testing.assert_close(o - n, c * (glob - s))


def test_zero_delay_is_the_blocking_result_bit_for_bit() -> None:
    gen = torch.Generator().manual_seed(0)
    glob = {"a": torch.randn(64, 33, generator=gen), "b": torch.tensor([-0.0, 0.0, -1e-40, 3.0])}
    now = {"a": torch.randn(64, 33, generator=gen), "b": torch.tensor([5.0, -0.0, 7.0, -2.0])}
    snapshot = {n: t.clone() for n, t in now.items()}
    out = apply_overlapped(glob, now, snapshot)
    for name in glob:
        assert torch.equal(bits(out[name]), bits(glob[name])), name


def test_zero_delay_widens_a_bf16_global_exactly() -> None:
    glob = {"w": torch.randn(300).to(torch.bfloat16)}
    now = {"w": torch.randn(300)}
    out = apply_overlapped(glob, now, {"w": now["w"].clone()})
    assert out["w"].dtype == torch.float32
    assert torch.equal(bits(out["w"]), bits(glob["w"].float()))


def test_untrained_tensors_take_the_global_values() -> None:
    glob = {"other_experts": torch.full((2, 3), 4.0), "shared": torch.zeros(2)}
    now = {"other_experts": torch.full((2, 3), -9.0), "shared": torch.ones(2), "own": torch.ones(3)}
    snapshot = {"shared": torch.zeros(2), "own": torch.zeros(3)}
    out = apply_overlapped(glob, now, snapshot)
    assert torch.equal(out["other_experts"], glob["other_experts"])
    assert out["other_experts"] is not glob["other_experts"]
    # "own" was not downloaded: the server took it verbatim from the snapshot, so theta_now is kept
    assert torch.equal(out["own"], now["own"]) and out["own"] is not now["own"]
    assert torch.equal(out["shared"], torch.ones(2))
    narrow = apply_overlapped({"other_experts": glob["other_experts"].bfloat16()}, now, snapshot)
    assert narrow["other_experts"].dtype == torch.float32  # widened to the parameter's dtype, as loading would
    assert torch.equal(narrow["other_experts"], glob["other_experts"])


def test_delayed_steps_keep_the_local_progress() -> None:
    gen = torch.Generator().manual_seed(1)
    snap = torch.randn(50, generator=gen)
    steps = [torch.randn(50, generator=gen) * 1e-2 for _ in range(3)]
    now = snap + sum(steps)
    glob = torch.randn(50, generator=gen)
    out = apply_overlapped({"w": glob}, {"w": now}, {"w": snap})
    torch.testing.assert_close(out["w"], glob + sum(steps))


@pytest.mark.parametrize(
    ("glob", "now", "snap", "match"),
    [
        ({"w": torch.zeros(3)}, {"w": torch.zeros(4)}, {"w": torch.zeros(4)}, r"'w'.*shape \[3\] in the global"),
        ({"w": torch.zeros(4)}, {"w": torch.zeros(4)}, {"w": torch.zeros(2, 2)}, r"'w'.*shape \[2, 2\] in the snap"),
        (
            {"w": torch.zeros(4)},
            {"w": torch.zeros(4)},
            {"w": torch.zeros(4, dtype=torch.bfloat16)},
            r"^tensor 'w': dtype torch.bfloat16 in the snapshot, the node's parameter has torch.float32 \(the snapshot "
            r"must be an exact copy\)$",
        ),
        ({"w": torch.zeros(4, dtype=torch.int64)}, {"w": torch.zeros(4)}, {}, r"'w'.*not a floating-point"),
        ({"x": torch.zeros(4)}, {"w": torch.zeros(4)}, {}, r"'x' is in the global model but not"),
        ({}, {"w": torch.zeros(4)}, {"y": torch.zeros(4)}, r"'y' is in the round's snapshot but not"),
    ],
)
def test_mismatches_name_the_tensor(glob: dict, now: dict, snap: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        apply_overlapped(glob, now, snap)


def test_take_copies_and_due() -> None:
    param = torch.ones(3)
    pending = PendingRound.take(round_id=200, step=200, params={"w": param})
    param.add_(1.0)
    assert torch.equal(pending.snapshot["w"], torch.ones(3))
    assert pending.due(sync_steps=100) == 300
    with pytest.raises(ValueError, match="round_id and step >= 0"):
        PendingRound(round_id=-1, step=0, snapshot={})
    with pytest.raises(ValueError, match="round_id and step >= 0"):
        PendingRound(round_id=0, step=-1, snapshot={})
    assert PendingRound(round_id=0, step=0, snapshot={}).due(sync_steps=10) == 10  # a round at step 0 is one


def test_save_load_round_trip(tmp_path) -> None:
    snapshot = {"a": torch.randn(4, 5), "b": torch.randn(7).to(torch.bfloat16)}
    pending = PendingRound(round_id=300, step=301, snapshot=snapshot)
    path = tmp_path / "ckpt" / "pending_round.safetensors"
    pending.save(path)
    loaded = PendingRound.load(path, manifest={"a": (4, 5), "b": (7,), "c": (1,)})
    assert (loaded.round_id, loaded.step) == (300, 301)
    assert set(loaded.snapshot) == {"a", "b"}
    for name, tensor in snapshot.items():
        assert loaded.snapshot[name].dtype == tensor.dtype
        assert torch.equal(bits(loaded.snapshot[name]), bits(tensor))
    assert not list(path.parent.glob("*.tmp")), "the atomic write left a temporary file"


def test_load_refuses_what_does_not_fit(tmp_path) -> None:
    path = tmp_path / "pending.safetensors"
    PendingRound(round_id=1, step=1, snapshot={"a": torch.zeros(4)}).save(path)
    with pytest.raises(ValueError, match=r"'a' has shape \[4\], this model's is \[2, 2\]"):
        PendingRound.load(path, manifest={"a": (2, 2)})
    with pytest.raises(ValueError, match=r"'a' is not a tensor of this model"):
        PendingRound.load(path, manifest={"z": (4,)})
    with pytest.raises(FileNotFoundError, match="missing.safetensors"):
        PendingRound.load(tmp_path / "missing.safetensors")
    garbage = tmp_path / "garbage.safetensors"
    garbage.write_bytes(b"not a safetensors file at all")
    with pytest.raises(ValueError, match="garbage.safetensors: not a readable safetensors"):
        PendingRound.load(garbage)
    foreign = tmp_path / "foreign.safetensors"
    save_file({"a": torch.zeros(1)}, str(foreign), metadata={"format": "9"})
    with pytest.raises(ValueError, match="format '9'"):
        PendingRound.load(foreign)
    no_ids = tmp_path / "no_ids.safetensors"
    save_file({"a": torch.zeros(1)}, str(no_ids), metadata={"format": "1"})
    with pytest.raises(ValueError, match="round_id/step"):
        PendingRound.load(no_ids)
