"""The round rules without sockets: admission, dead-peer policy, download readiness, join checks."""

from __future__ import annotations

import grpc
import pytest
import torch

from spes.sync.merge import trainable_names
from spes.sync.proto import spes_pb2 as pb
from spes.sync.protocol import PROTOCOL_VERSION, Refused
from spes.sync.rounds import (
    RoundPolicy,
    RoundState,
    check_join,
    check_manifest,
    manifest_differences,
)
from sync_helpers import tiny_manifest

MANIFEST = tiny_manifest()
NAMES = list(MANIFEST)


def test_admission_duplicates_old_future_and_busy_rounds() -> None:
    state = RoundState(num_peers=2)
    assert not state.admit(0, 5)
    assert not state.stage_upload(0, 5, {})
    assert state.admit(0, 5) and state.snapshot().uploaded_peers == (0,)
    with pytest.raises(Refused, match="round 7 is ahead of the open round 5, which still waits for peers") as err:
        state.admit(1, 7)
    assert err.value.reason == "future_round"
    with pytest.raises(Refused, match="round 3 is old: round 5 is open now") as err:
        state.admit(1, 3)
    assert err.value.reason == "stale_round"
    assert state.stage_upload(1, 5, {})
    uploads, relayed = state.take_uploads()
    assert sorted(uploads) == [0, 1] and state.staged == {} and relayed == {}  # handed over, no longer held here
    assert state.admit(1, 5)
    with pytest.raises(Refused, match="while round 5 is being aggregated") as err:
        state.admit(0, 6)
    assert (err.value.code, err.value.reason) == (grpc.StatusCode.UNAVAILABLE, "busy")
    state.complete(5, {"x": torch.ones(1)}, {}, merged=False, alpha=0.0)
    snap = state.snapshot()
    assert (snap.open_round, snap.completed_round, snap.aggregating, snap.round_peers) == (None, 5, False, (0, 1))
    assert not state.admit(1, 6)
    state.stage_upload(1, 6, {})
    assert state.admit(0, 5)  # a late retry of a committed upload stays a no-op while round 6 is open
    with pytest.raises(Refused, match="round 4 is old: round 6 is open now"):
        state.admit(0, 4)


def test_a_round_closed_without_a_peer_is_stale_for_it() -> None:
    state = RoundState(num_peers=3)
    state.restore(10, {0, 1}, {"x": torch.ones(1)}, {}, merged=False, alpha=0.0)
    with pytest.raises(Refused, match="round 10 is old: round 10 has already completed without peer 2") as err:
        state.admit(2, 10)
    assert err.value.reason == "stale_round"
    assert state.admit(1, 10)


def test_policy_wait_fails_after_the_timeout_naming_missing_peers() -> None:
    policy = RoundPolicy(num_peers=3, timeout_s=10)
    state = RoundState(num_peers=3)
    state.stage_upload(0, 1, {})
    opened = state.opened_at
    assert state.seconds_left(policy, now=opened + 4) == pytest.approx(6)
    assert not state.must_close(policy, frozenset(), now=opened + 9)
    timed_out = r"did not complete within --round_timeout=10 s of its first upload: still waiting for peers \[1, 2"
    with pytest.raises(Refused, match=timed_out) as err:
        state.must_close(policy, frozenset(), now=opened + 10)
    assert (err.value.code, err.value.reason) == (grpc.StatusCode.DEADLINE_EXCEEDED, "round_timeout")


def test_policy_quorum_closes_with_enough_peers_once_a_global_model_exists() -> None:
    policy = RoundPolicy(num_peers=3, timeout_s=10, dead_peer_policy="quorum")
    assert policy.quorum == 2 and RoundPolicy(num_peers=4, min_peers=1).quorum == 1
    owners = frozenset({0, 1})  # the expert owners without a global copy (the coordinator's to say)
    state = RoundState(num_peers=3)
    state.stage_upload(2, 1, {})
    late = state.opened_at + 11
    with pytest.raises(Refused, match=r"only peers \[2\] arrived, fewer than --min_peers=2"):
        state.must_close(policy, owners, now=late)
    state.stage_upload(0, 1, {})
    with pytest.raises(Refused, match=r"no global copy of the experts of peers \[1\] exists yet"):
        state.must_close(policy, owners, now=late)
    assert state.must_close(policy, frozenset({0}), now=late)  # peer 0's experts: it is in
    assert state.must_close(policy, frozenset(), now=late)  # DiLoCo, or every owner's experts have a global copy
    state.take_uploads()
    assert state.seconds_left(policy) == float("inf")  # aggregating: no timeout applies
    with pytest.raises(Refused, match="round 1 timed out and is closing without peer 1") as err:
        state.admit(1, 1)  # too late for this round: the client retries, then catches up
    assert (err.value.code, err.value.reason) == (grpc.StatusCode.UNAVAILABLE, "busy")
    assert state.admit(0, 1)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"timeout_s": 0}, "--round_timeout must be > 0"),
        ({"dead_peer_policy": "vote"}, "--dead_peer_policy must be 'wait' or 'quorum'"),
        ({"min_peers": 4}, r"--min_peers must be in \[1, num_peers=3\]"),
    ],
)
def test_policy_validation(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        RoundPolicy(num_peers=3, **kwargs)


def test_check_download_ready_wait_or_refused() -> None:
    state = RoundState(num_peers=2)
    with pytest.raises(Refused, match="holds no upload of peer 0 for round 5") as err:
        state.check_download(0, 5, full=False)
    assert err.value.reason == "unknown_round"
    state.stage_upload(0, 5, {})
    assert not state.check_download(0, 5, full=False)
    with pytest.raises(Refused, match="holds no upload of peer 1 for round 5"):
        state.check_download(1, 5, full=False)
    assert not state.check_download(1, 5, full=True)  # a full (catch-up) download may wait for the round
    state.take_uploads()
    state.fail(5, "aggregation of round 5 failed: boom")
    with pytest.raises(Refused, match="boom") as err:
        state.check_download(0, 5, full=False)
    assert err.value.code == grpc.StatusCode.INTERNAL
    state.restore(10, {0, 1}, {"x": torch.ones(1)}, {}, merged=False, alpha=0.0)
    assert state.check_download(1, 10, full=False)
    with pytest.raises(Refused, match="round 5 is no longer available: the latest completed round is 10") as err:
        state.check_download(0, 5, full=False)
    assert err.value.reason == "stale_round"


def join(peer: int, **overrides: object) -> pb.JoinRequest:
    fields: dict = {
        "peer_id": peer,
        "num_peers": 2,
        "experts_per_peer": 2,
        "mode": "spes",
        "wire_dtype": "fp32",
        "manifest": [pb.TensorSpec(name=n, shape=s) for n, s in MANIFEST.items()],
        "trainable": trainable_names(NAMES, peer, "spes"),
        "protocol": PROTOCOL_VERSION,
    }
    fields.update(overrides)
    return pb.JoinRequest(**fields)


def test_a_join_asking_for_fragments_on_an_int8_run_is_refused() -> None:
    request = join(0, wire_dtype="int8", fragments=2, sync_steps=4)
    with pytest.raises(
        Refused, match="peer 0 asks for 2 fragments: fragments cannot be combined with wire_dtype='int8'"
    ):
        check_join(request, num_peers=2, experts_per_peer=2, mode="spes", wire_dtype="int8")


def test_check_join() -> None:
    shapes, trainable = check_join(join(1), num_peers=2, experts_per_peer=2, mode="spes")
    assert shapes == MANIFEST and "blocks.0.ffn.experts.w1.1" in trainable
    for request, match in [
        (join(2), r"peer_id 2 is outside \[0, 2\)"),
        (join(0, protocol=0), "speaks wire protocol v0 but this server speaks v5"),
        (join(0, protocol=2), "speaks wire protocol v2 but this server speaks v5"),  # CRC-32C checksums
        (join(0, protocol=3), "speaks wire protocol v3 but this server speaks v5"),  # JSON data-plane frames
        (join(0, protocol=4), "speaks wire protocol v4 but this server speaks v5"),  # no fragments
        (join(0, mode="diloco"), "mode='diloco' but the server runs with mode='spes'"),
        (join(0, wire_dtype="fp8"), "unknown wire_dtype 'fp8'"),
        (join(0, trainable=NAMES), "also claims 'blocks.0.ffn.experts.v1.1'"),
        (join(0, manifest=[pb.TensorSpec(name="a", shape=[1])] * 2), "names a tensor twice"),
    ]:
        with pytest.raises(Refused, match=match):
            check_join(request, num_peers=2, experts_per_peer=2, mode="spes")


def test_manifest_checks() -> None:
    with pytest.raises(ValueError, match="owned by peer 2"):
        check_manifest(tiny_manifest(num_blocks=3), num_peers=2, experts_per_peer=2, mode="spes")
    with pytest.raises(ValueError, match="<= num_train_experts_per_node=1"):
        check_manifest(MANIFEST, num_peers=2, experts_per_peer=1, mode="spes")
    check_manifest(tiny_manifest(num_blocks=1, k=4), num_peers=3, experts_per_peer=4, mode="diloco")
    assert manifest_differences(MANIFEST, MANIFEST) == ""
    assert "missing 'lm_head.weight'" in manifest_differences(
        MANIFEST, {n: s for n, s in MANIFEST.items() if n != "lm_head.weight"}
    )
