"""What a run is waiting for, in one line: the server logs it, a waiting node logs it, `python -m spes.status`
prints it (all from the server's Status)."""

from __future__ import annotations

from spes.sync.proto import spes_pb2 as pb

REPORT_S = 30.0
"""How often the server and a waiting node say what they wait for."""


def completed(current_round: int) -> str:
    """The server's latest completed round (named by its step; -1: none yet) in the words the server's log, a node's
    join line and `python -m spes.status` share: one concept, one name."""
    return "no round completed yet" if current_round < 0 else f"round {current_round} complete"


def describe(status: pb.StatusReply) -> str:
    """The run's state from its Status: the open round, who is in, who is missing and when each was last seen."""
    seen = {p.peer: p for p in status.presence}
    missing = [p for p in range(status.num_peers) if p not in status.peers_joined]
    latest = completed(status.current_round)
    if status.open_round >= 0:
        # NOTE: an open round that waits for no peer is being merged and served: "waiting for []" read as a stall
        waiting = f"waiting for {list(status.missing_peers)}" if status.missing_peers else "merging and serving it"
        what = (
            f"round {status.open_round} open for {status.open_round_age_s:.0f} s, uploaded by "
            f"{list(status.peers_uploaded)}, {waiting}"
        )
        absent = list(status.missing_peers)
    elif missing:
        what, absent = f"{latest}; {len(status.peers_joined)} of {status.num_peers} peers joined", missing
    else:
        what, absent = f"{latest}; every peer joined, none has uploaded the next round yet", []
    notes = [_seen(p, seen.get(p), status) for p in absent]
    return f"run {status.run_id}: {what}" + (f" ({'; '.join(notes)})" if notes else "")


def _seen(peer: int, presence: pb.PeerPresence | None, status: pb.StatusReply) -> str:
    """A missing peer: connected (its presence stream is open: alive, training towards its upload), when it was
    last heard from, or not joined to this server process (`_not_joined`)."""
    if presence is None:
        return f"peer {peer} {_not_joined(status)}"
    if presence.connected:
        return f"peer {peer} connected (training)"
    return f"peer {peer} disconnected, last heard {presence.last_seen_s:.0f} s ago"


def _not_joined(status: pb.StatusReply) -> str:
    """Why a server process knows nothing of a peer. One that resumed a round from --state_dir (it holds a round and
    has completed none itself) restarted: its peers joined the one before and are re-joining (a node backs off while
    the server is down). Once it has completed rounds of its own, whether it restarted is no longer known."""
    if not status.persistent or status.current_round < 0:
        return "never joined"
    if status.rounds_completed == 0:
        return "not joined since the server restarted"
    return "not joined since the server started"
