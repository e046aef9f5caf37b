"""Round bookkeeping of the parameter server: who may upload what, and when a round may close.

The server calls `RoundState` under its lock (and `spes.sync.aggregate.build_round`, the round's math, on its
aggregation thread); nothing here touches sockets or files, so every rule is tested directly
(tests/sync/test_rounds.py).

A round is keyed by the global step at which the peers synchronize. It opens with its first verified upload, and
only the round the run's schedule expects next may open (`spes.sync.spec.RunSpec.next_round`: an upload for any
other round, a far-future one say, is refused naming the expected one). It closes when every peer is in, or,
under `server.dead_peer_policy: quorum`, once `server.round_timeout_s` seconds have passed since it opened and
enough peers are in:

- shared tensors are averaged over the peers that arrived (in peer order, so the result is reproducible);
- an expert block whose owner did not arrive keeps its value in the previous global model;
- the very first round has no previous global model, so in SPES mode it cannot close without every owner
  of an expert block (`close_blocker` says so, and the waiting downloads fail with that message); with fragments
  (`spes.sync.fragments`), neither can the first round of each fragment.

Under `wait` (the reference behaviour) a round closes only with every peer. Time the server itself did not run (its
process stopped or starved: a paused VM, SIGSTOP, a swap storm) does not count toward a round's timeout
(`spes.sync.stalls`): the peers could not reach it then, and on waking it would close the round before their retries
arrive.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace

import grpc
import torch

from spes.config import ServerSection
from spes.sync.codecs.base import Payload
from spes.sync.codecs.interface import Served
from spes.sync.fragments import WHOLE
from spes.sync.protocol import Reason, Refused, Tensors
from spes.sync.stalls import STALLS, Stalls


def quorum(server: ServerSection, num_peers: int) -> int:
    """Fewest peers a quorum round needs: `server.min_peers`, or a majority."""
    return server.min_peers if server.min_peers is not None else num_peers // 2 + 1


@dataclass(frozen=True)
class Completed:
    """A completed round: what it built (the global model, the outer momentum, what the codec serves) and who."""

    round: int
    peers: frozenset[int]
    fragment: int
    """The part of the model the round covered (`spes.sync.fragments`; WHOLE: every tensor)."""
    alpha: float
    """The merge warm-up's strength applied (0: none)."""
    global_model: Tensors
    momentum: Tensors
    served: Served
    digests: Mapping[int, int] = field(default_factory=dict)
    """Per peer, the digest of the upload the round took (a re-upload must match it)."""

    @property
    def merged(self) -> bool:
        return self.alpha > 0

    def tensors(self) -> list[torch.Tensor]:
        """Every tensor the round holds (global model, momentum, what the codec serves), for buffer reuse."""
        return [*self.global_model.values(), *self.momentum.values(), *self.served.holds()]


@dataclass(frozen=True)
class RoundSnapshot:
    """A consistent picture of the round state (for Status, logs and persistence)."""

    open_round: int | None
    completed_round: int | None
    uploaded_peers: tuple[int, ...]
    round_peers: tuple[int, ...]
    aggregating: bool
    merged: bool
    alpha: float
    open_age_s: float


class RoundState:
    """One open round collecting uploads, and the latest completed round.

    Not thread-safe by itself: the server calls it under its condition's lock. Memory held: the completed round
    and the committed uploads of the open round, handed to the aggregator (and dropped from here) when it closes.
    """

    def __init__(
        self,
        num_peers: int,
        server: ServerSection,
        next_round: Callable[[int | None], int | None],
        stalls: Stalls | None = None,
    ) -> None:
        self.num_peers, self.server, self.next_round = num_peers, server, next_round
        """`next_round(after)`: the round the schedule expects after round `after` (None: before any)."""
        self.stalls = STALLS.watch() if stalls is None else stalls
        """The time this process did not run, which a round's timeout does not count."""
        self.open_round: int | None = None
        self.opened_at = 0.0
        self._stalled_at_open = 0.0
        self.uploaded: set[int] = set()
        self.staged: dict[int, Tensors] = {}
        self.digests: dict[int, int] = {}
        """Per peer, the digest of its committed upload of the open round."""
        self.relayed: dict[str, Payload] = {}
        """The uploaded payloads of the blocks the open round takes verbatim (relayed on download, by the codec)."""
        self.aggregating = False
        self.completed: Completed | None = None
        self.failure: tuple[int, str] | None = None
        self.fragment = WHOLE
        """The part of the model the open round covers (`spes.sync.fragments`; WHOLE: every tensor)."""

    @property
    def completed_round(self) -> int | None:
        return None if self.completed is None else self.completed.round

    def missing_peers(self) -> list[int]:
        return [p for p in range(self.num_peers) if p not in self.uploaded]

    def admit(self, peer: int, step: int, fragment: int = WHOLE, digest: int = 0) -> bool:
        """May `peer` upload `fragment` of round `step`, whose content has `digest`? True: already committed, the
        same (an idempotent no-op); raises Refused if not, ALREADY_EXISTS for a committed upload that differs."""
        done = self.completed
        if done is not None and step == done.round and peer in done.peers:
            return _same(peer, step, digest, done.digests.get(peer, digest))
        if self.open_round is not None:
            committed = self._admit_open(peer, step, fragment)
            return committed and _same(peer, step, digest, self.digests.get(peer, digest))
        if done is not None and step <= done.round:
            raise Refused(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"round {step} is old: round {done.round} has already completed"
                + ("" if step < done.round else f" without peer {peer}"),
                Reason.STALE_ROUND,
            )
        expected = self.next_round(None if done is None else done.round)
        if done is None and expected is not None and step > expected and self.next_round(step - 1) == step:
            raise Refused(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"peer {peer} resumes at round {step}, but this server holds no completed round of the run (its first "
                f"round is {expected}): its state.json is gone, or it was started on another --state_dir; restart it "
                "on the --state_dir that holds the run's state.json, or start a new run (a fresh --state_dir, every "
                "node without --resume)",
                Reason.FUTURE_ROUND,
            )
        if step != expected:
            after = "before any round" if done is None else f"after round {done.round}"
            raise Refused(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"peer {peer} uploads round {step}, but the run's next round is "
                + (f"{expected} ({after})" if expected is not None else f"none: it ended {after}")
                + ": do all nodes use the run's spes_config.sync_steps and max_duration?",
                Reason.FUTURE_ROUND,
            )
        return False

    def _admit_open(self, peer: int, step: int, fragment: int) -> bool:
        """`admit` while round `open_round` collects uploads."""
        if step == self.open_round and fragment != self.fragment:
            raise Refused(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"peer {peer} uploads fragment {fragment} for round {step}, whose other uploads are of fragment "
                f"{self.fragment}: do all peers use the same spes_config.sync_steps and overlap_fragments?",
            )
        if step == self.open_round and (peer in self.uploaded or not self.aggregating):
            return peer in self.uploaded
        if step == self.open_round:
            raise Refused(
                grpc.StatusCode.UNAVAILABLE,
                f"round {step} timed out and is closing without peer {peer}; retry to catch up once it completes",
                Reason.BUSY,
            )
        if step < self.open_round:  # type: ignore[operator]
            raise Refused(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"round {step} is old: round {self.open_round} is open now",
                Reason.STALE_ROUND,
            )
        if self.aggregating:
            raise Refused(
                grpc.StatusCode.UNAVAILABLE,
                f"round {step} cannot open while round {self.open_round} is being aggregated; retry shortly",
                Reason.BUSY,
            )
        raise Refused(
            grpc.StatusCode.FAILED_PRECONDITION,
            f"round {step} is ahead of the open round {self.open_round}, which still waits for peers "
            f"{self.missing_peers()}: do all peers use the same sync_steps?",
            Reason.FUTURE_ROUND,
        )

    def stage_upload(
        self,
        peer: int,
        step: int,
        tensors: Tensors,
        relayed: Mapping[str, Payload] | None = None,
        fragment: int = WHOLE,
        digest: int = 0,
    ) -> bool:
        """Commit a complete, verified upload of `fragment` (and the payloads of its verbatim blocks the codec may
        relay); opens the round if needed. True when every peer is in."""
        if self.open_round is None:
            self.open_round, self.opened_at, self.failure, self.fragment = step, time.monotonic(), None, fragment
            self._stalled_at_open = self.stalls.total()
        assert step == self.open_round and peer not in self.uploaded and not self.aggregating
        self.failure = None
        self.uploaded.add(peer)
        self.staged[peer] = tensors
        self.digests[peer] = digest
        self.relayed.update(relayed or {})
        return len(self.uploaded) == self.num_peers

    def check_download(self, peer: int, step: int, full: bool) -> bool:
        """May a download of round `step` be served now (True), wait (False), or never (raises Refused)?"""
        latest = self.completed_round
        if latest == step:
            return True
        if self.failure is not None and self.failure[0] == step:
            raise Refused(grpc.StatusCode.INTERNAL, self.failure[1])
        if latest is not None and step < latest:
            raise Refused(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"round {step} is no longer available: the latest completed round is {latest}",
                Reason.STALE_ROUND,
            )
        if step != self.open_round or (peer not in self.uploaded and not full):
            raise Refused(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"the server holds no upload of peer {peer} for round {step} (open round: {self.open_round}, "
                f"latest completed: {latest}): upload it first",
                Reason.UNKNOWN_ROUND,
            )
        return False

    def seconds_left(self, now: float | None = None) -> float:
        """Seconds until the open round times out (0 once it has; inf while it is aggregating), not counting the
        time since it opened that this process did not run."""
        if self.open_round is None or self.aggregating:
            return float("inf")
        now = time.monotonic() if now is None else now
        stalled = self.stalls.total() - self._stalled_at_open
        return max(0.0, self.opened_at + stalled + self.server.round_timeout_s - now)

    def must_close(self, owners: frozenset[int], now: float | None = None) -> bool:
        """True when the open round timed out and may close with the peers in (quorum).

        Raises Refused (reason `round_timeout`, naming the missing peers) when it timed out and may not.
        """
        if self.seconds_left(now) > 0:
            return False
        blocker = self.close_blocker(owners)
        if blocker:
            raise Refused(
                grpc.StatusCode.DEADLINE_EXCEEDED,
                f"round {self.open_round} did not complete within server.round_timeout_s="
                f"{self.server.round_timeout_s:g} s of its first upload: {blocker}",
                Reason.ROUND_TIMEOUT,
            )
        return True

    def close_blocker(self, owners: frozenset[int]) -> str:
        """Why the open round cannot close with the peers in now ('' when it can); `owners` own expert blocks the
        round covers of which the global model holds no copy yet (`spes.sync.coordinator`), so they must be in."""
        missing = self.missing_peers()
        if self.server.dead_peer_policy == "wait":
            return f"still waiting for peers {missing} (server.dead_peer_policy wait needs every peer)"
        needed = quorum(self.server, self.num_peers)
        if len(self.uploaded) < needed:
            return f"only peers {sorted(self.uploaded)} arrived, fewer than server.min_peers={needed}"
        unseen = sorted(owners & set(missing))
        if unseen:
            return (
                f"still waiting for peers {missing}: no global copy of the experts of peers {unseen} exists yet "
                "(the run's first round, or the first of their fragment), so this round needs every such owner"
            )
        return ""

    def take_uploads(self) -> tuple[dict[int, Tensors], dict[str, Payload]]:
        """Hand the round's uploads and relayed payloads to the aggregator (they are no longer held here); the round
        is aggregating."""
        assert self.uploaded and not self.aggregating
        self.aggregating = True
        uploads, self.staged = self.staged, {}
        relayed, self.relayed = self.relayed, {}
        return uploads, relayed

    def complete(self, done: Completed) -> None:
        """Publish round `done.round`, built from the uploads of `self.uploaded`."""
        assert done.round == self.open_round and self.aggregating and done.peers == frozenset(self.uploaded)
        self.restore(replace(done, digests=dict(self.digests)))

    def restore(self, done: Completed) -> None:
        """Make `done` the latest completed round (also how a restarted server resumes); no round is open."""
        self.completed = done
        self.open_round, self.uploaded, self.staged, self.aggregating = None, set(), {}, False
        self.relayed, self.failure, self.digests = {}, None, {}

    def fail(self, step: int, message: str) -> None:
        """Aggregation failed: drop the uploads so the peers can upload round `step` again."""
        self.failure = (step, message)
        self.uploaded, self.staged, self.relayed, self.aggregating = set(), {}, {}, False
        self.digests = {}

    def snapshot(self) -> RoundSnapshot:
        done = self.completed
        return RoundSnapshot(
            open_round=self.open_round,
            completed_round=self.completed_round,
            uploaded_peers=tuple(sorted(self.uploaded)),
            round_peers=tuple(sorted(done.peers)) if done else (),
            aggregating=self.aggregating,
            merged=done.merged if done else False,
            alpha=done.alpha if done else 0.0,
            open_age_s=time.monotonic() - self.opened_at if self.open_round is not None else 0.0,
        )


def _same(peer: int, step: int, digest: int, committed: int) -> bool:
    """True when a re-upload holds what the committed one did; Refused ALREADY_EXISTS naming both otherwise."""
    if digest != committed:
        raise Refused(
            grpc.StatusCode.ALREADY_EXISTS,
            f"peer {peer} uploads round {step} again with other values (digest {digest:#018x}, committed "
            f"{committed:#018x}): a round takes one upload per peer. Two processes acting as peer {peer}?",
        )
    return True
