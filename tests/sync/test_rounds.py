"""The round rules without sockets: admission, dead-peer policy, download readiness."""

from __future__ import annotations

from dataclasses import replace

import grpc
import pytest
import torch

from spes.config import ServerSection
from spes.sync.protocol import Refused
from spes.sync.rounds import RoundState, quorum
from spes.sync.stalls import STALL_S, Stalls
from sync_helpers import completed


def every(interval: int):  # type: ignore[no-untyped-def]
    """A schedule with a round every `interval` steps (`RunSpec.next_round` without a last step)."""
    return lambda after: ((after or 0) // interval + 1) * interval


def test_admission_duplicates_old_future_and_busy_rounds() -> None:
    state = RoundState(2, ServerSection(), every(5))
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
        state.admit(0, 10)
    assert (err.value.code, err.value.reason) == (grpc.StatusCode.UNAVAILABLE, "busy")
    state.complete(completed(5, {0, 1}))
    snap = state.snapshot()
    assert (snap.open_round, snap.completed_round, snap.aggregating, snap.round_peers) == (None, 5, False, (0, 1))
    assert not state.admit(1, 10)
    state.stage_upload(1, 10, {})
    assert state.admit(0, 5)  # a late retry of a committed upload stays a no-op while round 10 is open
    with pytest.raises(Refused, match="round 4 is old: round 10 is open now"):
        state.admit(0, 4)


def test_only_the_round_the_schedule_expects_next_may_open() -> None:
    """One upload for a far-future round used to open it and wedge the run; now it is refused naming the round the
    run expects, and the honest round opens as usual."""
    state = RoundState(2, ServerSection(), every(10))
    with pytest.raises(
        Refused, match=r"uploads round 1000000000001, but the run's next round is 10 \(before any"
    ) as err:
        state.admit(1, 10**12 + 1)
    assert (err.value.code, err.value.reason) == (grpc.StatusCode.FAILED_PRECONDITION, "future_round")
    with pytest.raises(Refused, match="next round is 10"):
        state.admit(1, 5)  # off the schedule
    assert not state.admit(0, 10) and state.snapshot().open_round is None
    state.restore(completed(10, {0, 1}))
    with pytest.raises(Refused, match=r"next round is 20 \(after round 10\)"):
        state.admit(0, 30)
    ended = RoundState(2, ServerSection(), lambda after: None)
    with pytest.raises(Refused, match="next round is none: it ended before any round"):
        ended.admit(0, 10)


def test_a_peer_resuming_a_later_round_on_a_server_without_any_says_its_state_is_likely_lost() -> None:
    """A --state_dir whose state.json was deleted (or another --state_dir) restarts the run at its first round: the
    resuming peers' round, on the schedule, was refused asking whether they use the run's sync_steps."""
    state = RoundState(2, ServerSection(), every(10))
    resumed = refusal(state.admit, 0, 30)
    assert (resumed.code, resumed.reason, str(resumed)) == (
        grpc.StatusCode.FAILED_PRECONDITION,
        "future_round",
        "peer 0 resumes at round 30, but this server holds no completed round of the run (its first round is 10): "
        "its state.json is gone, or it was started on another --state_dir; restart it on the --state_dir that holds "
        "the run's state.json, or start a new run (a fresh --state_dir, every node without --resume)",
    )
    assert "sync_steps" in str(refusal(state.admit, 0, 35))  # off the schedule: the peers' settings differ
    state.restore(completed(10, {0, 1}))
    assert "next round is 20 (after round 10)" in str(refusal(state.admit, 0, 30))
    every_step = RoundState(2, ServerSection(), every(1))  # NOTE: sync_steps=1: every step is on the schedule
    assert "holds no completed round of the run (its first round is 1)" in str(refusal(every_step.admit, 0, 3))


def test_a_round_closed_without_a_peer_is_stale_for_it() -> None:
    state = RoundState(3, ServerSection(), every(10))
    state.restore(completed(10, {0, 1}))
    with pytest.raises(Refused, match="round 10 is old: round 10 has already completed without peer 2") as err:
        state.admit(2, 10)
    assert err.value.reason == "stale_round"
    assert state.admit(1, 10)


def test_policy_wait_fails_after_the_timeout_naming_missing_peers() -> None:
    state = RoundState(3, ServerSection(round_timeout_s=10), every(1))
    state.stage_upload(0, 1, {})
    opened = state.opened_at
    assert state.seconds_left(now=opened + 4) == pytest.approx(6)
    assert not state.must_close(frozenset(), now=opened + 9)
    timed_out = (
        r"did not complete within server.round_timeout_s=10 s of its first upload: still waiting for peers \[1, 2"
    )
    with pytest.raises(Refused, match=timed_out) as err:
        state.must_close(frozenset(), now=opened + 10)
    assert (err.value.code, err.value.reason) == (grpc.StatusCode.DEADLINE_EXCEEDED, "round_timeout")


def test_time_the_server_did_not_run_is_not_counted_toward_the_round_timeout() -> None:
    """A stall of the server (`Stalls`: a frozen process) while a round is open pushes its timeout back by that long;
    a stall before the round opened changes nothing (a server frozen mid-round closed it on waking, before the
    retries of the peers that could not reach it arrived)."""
    clock = [0.0]
    stalls = Stalls(lambda: clock[0])
    state = RoundState(3, ServerSection(round_timeout_s=10), every(1), stalls)
    clock[0] += STALL_S + 5  # no round open: nothing to excuse
    state.stage_upload(0, 1, {})
    opened = state.opened_at
    clock[0] += 1
    assert state.seconds_left(now=opened + 1) == pytest.approx(9)
    clock[0] += 20
    assert state.seconds_left(now=opened + 21) == pytest.approx(9)
    assert not state.must_close(frozenset(), now=opened + 21)
    state.restore(completed(1, {0, 1, 2}))
    state.stage_upload(0, 2, {})  # a new round counts from its own opening
    assert state.seconds_left(now=state.opened_at + 10) == 0


def test_policy_quorum_closes_with_enough_peers_once_a_global_model_exists() -> None:
    section = ServerSection(round_timeout_s=10, dead_peer_policy="quorum")
    assert quorum(section, 3) == 2 and quorum(ServerSection(min_peers=1), 4) == 1
    owners = frozenset({0, 1})  # the expert owners without a global copy (the coordinator's to say)
    state = RoundState(3, section, every(1))
    state.stage_upload(2, 1, {})
    late = state.opened_at + 11
    with pytest.raises(Refused, match=r"only peers \[2\] arrived, fewer than server.min_peers=2"):
        state.must_close(owners, now=late)
    state.stage_upload(0, 1, {})
    with pytest.raises(Refused, match=r"no global copy of the experts of peers \[1\] exists yet"):
        state.must_close(owners, now=late)
    assert state.must_close(frozenset({0}), now=late)  # peer 0's experts: it is in
    assert state.must_close(frozenset(), now=late)  # DiLoCo, or every owner's experts have a global copy
    state.take_uploads()
    assert state.seconds_left() == float("inf")  # aggregating: no timeout applies
    with pytest.raises(Refused, match="round 1 timed out and is closing without peer 1") as err:
        state.admit(1, 1)  # too late for this round: the client retries, then catches up
    assert (err.value.code, err.value.reason) == (grpc.StatusCode.UNAVAILABLE, "busy")
    assert state.admit(0, 1)


def test_check_download_ready_wait_or_refused() -> None:
    state = RoundState(2, ServerSection(), every(5))
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
    state.restore(completed(10, {0, 1}))
    assert state.check_download(1, 10, full=False)
    with pytest.raises(Refused, match="round 5 is no longer available: the latest completed round is 10") as err:
        state.check_download(0, 5, full=False)
    assert err.value.reason == "stale_round"


def test_a_re_upload_that_differs_from_the_committed_one_is_refused_naming_the_peer() -> None:
    """The same upload again is a retry (a no-op); other values for a committed (peer, round) are refused, never
    silently dropped, whether its round is still open or complete."""
    state = RoundState(2, ServerSection(), every(1))
    assert not state.admit(0, 1, digest=7)
    state.stage_upload(0, 1, {}, digest=7)
    assert state.admit(0, 1, digest=7)
    with pytest.raises(Refused, match="peer 0 uploads round 1 again with other values") as err:
        state.admit(0, 1, digest=8)
    assert err.value.code == grpc.StatusCode.ALREADY_EXISTS
    state.stage_upload(1, 1, {}, digest=9)
    state.take_uploads()
    state.complete(completed(1, {0, 1}))
    assert state.admit(1, 1, digest=9)
    with pytest.raises(Refused, match="peer 1 uploads round 1 again with other values"):
        state.admit(1, 1, digest=10)


def refusal(call, *args, **kwargs) -> Refused:  # type: ignore[no-untyped-def]
    """The Refused that `call(*args, **kwargs)` raises."""
    with pytest.raises(Refused) as err:
        call(*args, **kwargs)
    return err.value


def test_every_refusal_in_full_with_its_status_code() -> None:
    """What a peer reads: the whole message and the gRPC status its client decides on (retry, catch up, stop)."""
    assert quorum(ServerSection(), 4) == 3  # a majority of 4
    state = RoundState(3, ServerSection(), every(5))
    future = refusal(state.admit, 0, 7)
    assert (future.code, str(future)) == (
        grpc.StatusCode.FAILED_PRECONDITION,
        "peer 0 uploads round 7, but the run's next round is 5 (before any round): do all nodes use the run's "
        "spes_config.sync_steps and max_duration?",
    )
    state.stage_upload(0, 5, {}, fragment=1)
    other = refusal(state.admit, 1, 5, fragment=2)
    assert (other.code, str(other)) == (
        grpc.StatusCode.INVALID_ARGUMENT,
        "peer 1 uploads fragment 2 for round 5, whose other uploads are of fragment 1: do all peers use the same "
        "spes_config.sync_steps and overlap_fragments?",
    )
    assert not state.admit(1, 5, fragment=1)
    assert [refusal(state.admit, 1, step).code for step in (3, 10)] == [grpc.StatusCode.FAILED_PRECONDITION] * 2
    section = ServerSection(dead_peer_policy="quorum", min_peers=1)
    state = RoundState(3, section, every(5))
    state.stage_upload(0, 5, {})
    assert state.close_blocker(frozenset({1})) == (
        "still waiting for peers [1, 2]: no global copy of the experts of peers [1] exists yet (the run's first "
        "round, or the first of their fragment), so this round needs every such owner"
    )
    state.restore(completed(10, {0, 1}))
    stale = refusal(state.admit, 0, 5)
    assert (stale.code, str(stale)) == (
        grpc.StatusCode.FAILED_PRECONDITION,
        "round 5 is old: round 10 has already completed",
    )
    assert refusal(state.check_download, 0, 5, full=False).code == grpc.StatusCode.FAILED_PRECONDITION
    assert refusal(state.check_download, 0, 15, full=False).code == grpc.StatusCode.FAILED_PRECONDITION


def test_a_failed_round_takes_uploads_again_and_the_state_checks_its_own_order() -> None:
    """After a failed aggregation the peers upload the round again; staging, handing over and completing out of
    order (a second upload of a peer, a second hand-over, completing what was not handed over) are refused."""
    state = RoundState(2, ServerSection(), every(5))
    upload = {"x": torch.ones(2)}
    state.stage_upload(0, 5, upload, digest=3)
    with pytest.raises(AssertionError):
        state.stage_upload(0, 5, upload)  # admit says it is committed: nobody stages it twice
    with pytest.raises(AssertionError):
        state.complete(completed(5, {0}))  # not handed to the aggregator yet
    uploads, _ = state.take_uploads()
    assert uploads == {0: upload}
    with pytest.raises(AssertionError):
        state.take_uploads()
    state.fail(5, "aggregation of round 5 failed: boom")
    assert not state.admit(0, 5, digest=4)  # the failed upload is gone, so other values are welcome
    state.stage_upload(0, 5, upload, digest=4)
    assert state.snapshot().aggregating is False and state.admit(0, 5, digest=4)


def test_a_snapshot_tells_the_open_round_its_age_and_the_last_rounds_merge() -> None:
    state = RoundState(2, ServerSection(round_timeout_s=60), every(5))
    idle = state.snapshot()
    assert (idle.open_round, idle.merged, idle.alpha, idle.open_age_s) == (None, False, 0.0, 0.0)
    state.stage_upload(0, 5, {})
    state.opened_at -= 5  # opened 5 s ago
    snap = state.snapshot()
    assert snap.open_round == 5 and 5 <= snap.open_age_s < 60
    assert 0 < state.seconds_left() <= 55
    state.take_uploads()
    state.restore(replace(completed(5, {0}), alpha=0.25))
    done = state.snapshot()
    assert (done.open_round, done.completed_round, done.merged, done.alpha) == (None, 5, True, 0.25)
    assert done.open_age_s == 0.0


def test_a_timeout_check_at_the_present_time_counts_a_stall_that_just_ended_first() -> None:
    """must_close at the present time counts a stall its looking thread has not seen yet: a server that wakes from a
    freeze past the round's timeout does not close the round (nor fail it) before the peers could reach it again."""
    clock = [0.0]
    state = RoundState(3, ServerSection(round_timeout_s=10), every(1), Stalls(lambda: clock[0]))
    state.stage_upload(0, 1, {})
    state.opened_at -= 30  # opened 30 s ago, and the server last ran then
    clock[0] += 30
    assert not state.must_close(frozenset())
    assert 0 < state.seconds_left() <= 10
