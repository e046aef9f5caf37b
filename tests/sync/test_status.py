"""What a run waits for, in one line (spes.sync.status); `python -m spes.status` is tests/test_status_cli.py."""

from __future__ import annotations

from pathlib import Path

import pytest

from spes.sync.proto import spes_pb2 as pb
from spes.sync.status import describe
from sync_helpers import joined_clients, make_client, peer_upload, running_server, sync_all, tiny_spec


def test_the_line_names_the_open_round_who_is_in_and_when_the_missing_were_last_heard() -> None:
    status = pb.StatusReply(
        run_id="abc",
        num_peers=4,
        current_round=10,
        open_round=20,
        open_round_age_s=42.4,
        peers_joined=[0, 1, 2],
        peers_uploaded=[0, 1],
        missing_peers=[2, 3],
        presence=[pb.PeerPresence(peer=p, last_seen_s=7.2, connected=p != 2) for p in range(3)],
    )
    assert describe(status) == (
        "run abc: round 20 open for 42 s, uploaded by [0, 1], waiting for [2, 3] (peer 2 disconnected, last heard "
        "7 s ago; peer 3 never joined)"
    )
    joining = pb.StatusReply(run_id="abc", num_peers=2, current_round=-1, open_round=-1, peers_joined=[1])
    assert describe(joining) == "run abc: no round completed yet; 1 of 2 peers joined (peer 0 never joined)"


def test_round_zero_counts_and_a_run_with_everyone_in_and_nothing_missing_names_nobody() -> None:
    opened = pb.StatusReply(
        run_id="r",
        num_peers=2,
        current_round=0,
        open_round=0,
        open_round_age_s=3,
        peers_joined=[0, 1],
        peers_uploaded=[1],
        missing_peers=[0],
        presence=[pb.PeerPresence(peer=0, last_seen_s=2.4, connected=True)],
    )
    assert (
        describe(opened)
        == "run r: round 0 open for 3 s, uploaded by [1], waiting for [0] (peer 0 connected (training))"
    )
    idle = pb.StatusReply(run_id="r", num_peers=2, current_round=0, open_round=-1, peers_joined=[0, 1])
    assert describe(idle) == "run r: round 0 complete; every peer joined, none has uploaded the next round yet"


def test_an_open_round_every_peer_uploaded_is_being_merged_not_waiting_for_nobody() -> None:
    merging = pb.StatusReply(
        run_id="r",
        num_peers=2,
        current_round=4,
        open_round=5,
        open_round_age_s=9,
        peers_joined=[0, 1],
        peers_uploaded=[0, 1],
    )
    assert describe(merging) == "run r: round 5 open for 9 s, uploaded by [0, 1], merging and serving it"


def test_a_peer_a_restarted_server_has_not_seen_is_not_joined_since_the_restart_not_never_joined() -> None:
    """After a restart from --state_dir (a round resumed, none completed since) every node is backing off and
    re-joining: "never joined" sent users looking for a node that was never started."""
    fresh = pb.StatusReply(run_id="r", num_peers=2, current_round=-1, open_round=-1, persistent=True)
    assert describe(fresh).endswith("(peer 0 never joined; peer 1 never joined)")
    first = pb.StatusReply(run_id="r", num_peers=2, current_round=0, open_round=-1, peers_joined=[0], persistent=True)
    assert describe(first).endswith("(peer 1 not joined since the server restarted)")  # round 0 resumed is a round
    resumed = pb.StatusReply(
        run_id="r", num_peers=2, current_round=40, open_round=-1, peers_joined=[0], persistent=True
    )
    assert (
        describe(resumed)
        == "run r: round 40 complete; 1 of 2 peers joined (peer 1 not joined since the server restarted)"
    )
    going_on = pb.StatusReply(
        run_id="r", num_peers=2, current_round=48, open_round=-1, peers_joined=[0], persistent=True, rounds_completed=2
    )
    assert describe(going_on).endswith("(peer 1 not joined since the server started)")  # restarted or not: unknown
    in_memory = pb.StatusReply(run_id="r", num_peers=2, current_round=48, open_round=-1, peers_joined=[0])
    assert describe(in_memory).endswith("(peer 1 never joined)")  # nothing to resume: it never restarted


@pytest.mark.timeout(60)
def test_a_server_restarted_on_its_state_dir_waits_for_peers_not_joined_since_the_restart(tmp_path: Path) -> None:
    spec = tiny_spec()
    state = str(tmp_path / "state")
    with running_server(spec, state_dir=state) as (_, addr), joined_clients(addr, spec) as clients:
        sync_all(clients, 1, {p: peer_upload(spec, p, seed=1) for p in range(2)})
        run_id = clients[0].run_id
    with running_server(spec, state_dir=state) as (server, addr), make_client(addr, spec, 0, run_id=run_id) as node:
        node.join()
        assert describe(server.service.status()) == (
            f"run {run_id}: round 1 complete; 1 of 2 peers joined (peer 1 not joined since the server restarted)"
        )
