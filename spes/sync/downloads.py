"""The parameter server's downloads: wait for a round, select what a peer gets, hand it to a plane, count it.

`Downloads` is one job of the `spes.sync.coordinator.Coordinator`, which holds it and whose condition guards
everything here: a download waits until the round it asks for is the latest completed one (closing a timed-out
round under `quorum` when it can), has the run's codec select what the peer gets, and keeps the round's tensors
pinned in `spes.sync.buffers.RoundMemory` while a plane sends them.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass

import grpc

from spes.sync.admission import require_joined
from spes.sync.closing import CallParts, PeerCalls
from spes.sync.codecs.lazy import Overlay
from spes.sync.proto import spes_pb2 as pb
from spes.sync.protocol import Refused, shutting_down
from spes.sync.rounds import RoundState
from spes.sync.spec import RunSpec
from spes.sync.wire import EncodedModel, Item

log = logging.getLogger("spes.server")

WAIT_POLL_S = 1.0
"""A waiting download re-checks its caller this often (the data plane cannot be woken when its client hangs up)."""


@dataclass
class Outgoing:
    """One download for a plane to send: the round's `RoundInfo`, then `tensors` in their shared encoded forms."""

    info: pb.RoundInfo
    tensors: Mapping[str, Item]
    encoded: EncodedModel
    wire_dtype: str
    sent: int = 0
    """Payload bytes the plane has sent so far (counted in the server's traffic once the download ends)."""


class Downloads(PeerCalls):
    """The downloads of one run; `cond` (the coordinator's) guards `state`, `memory`, `joined` and `bytes_out`."""

    def __init__(self, parts: CallParts) -> None:
        super().__init__(parts)
        self.bytes_out = 0
        """Payload bytes sent by every download that ended."""

    @contextmanager
    def serve(
        self,
        peer: int,
        step: int,
        full: bool,
        is_active: Callable[[], bool],
        time_left_s: float | None,
        base_round: int = -1,
    ) -> Iterator[Outgoing | None]:
        """Wait for round `step` and select what `peer` gets, whatever carries it (None: the caller went away).

        Raises `Refused`. The plane sends `Outgoing.info`, then the tensors in their encoded forms (shared by
        every download of the round), adding to `Outgoing.sent`; however that ends, leaving the block counts the
        bytes and lets the round's tensors be reused once no download reads them. `base_round`: the round of the
        model the peer holds (a held-model codec sends it deltas against that).
        """
        with self._cond:
            require_joined(self._joined, peer)
            if not self._await_round(peer, step, full, is_active, time_left_s):
                outgoing = None
            else:
                outgoing = self._outgoing(peer, step, full, base_round)
                self._memory.pin(step)
        if outgoing is None:
            yield None
            return
        try:
            yield outgoing
        finally:
            with self._cond:
                self.bytes_out += outgoing.sent
                self._memory.unpin(step)

    def _outgoing(self, peer: int, step: int, full: bool, base_round: int) -> Outgoing:
        """What a download of the completed round `step` sends `peer` (lock held): the codec's selection, every
        tensor for a catch-up, else the round's download names."""
        done, spec = self._state.completed, self._spec()
        assert done is not None and spec.manifest is not None
        selection = self._codec.select(done.served, full=full, base_round=base_round)
        names = list(selection.items) if selection.whole else list(done.global_model)
        if full and len(names) < len(spec.manifest):
            raise Refused(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"peer {peer} asks for the whole global model, but round {step} holds only the fragments that have "
                f"had a round so far ({len(names)} of {len(spec.manifest)} tensors): a node that falls behind "
                "before every fragment has had one (step sync_steps) must start the run again",
            )
        if not selection.whole:
            names = spec.downloads(peer, spec.layout.names(done.fragment, names), merged=done.merged)
        info = pb.RoundInfo(
            round=step,
            merged=done.merged,
            alpha=done.alpha,
            names=names,
            peers=sorted(done.peers),
            base_round=selection.base_round,
        )
        encoded = self._memory.encoded(selection.key, selection.items, self._codec.raw_dtype)
        sent = Overlay(names, {}, selection.items.__getitem__)  # NOTE: a view: a codec may make an item when read
        return Outgoing(info, sent, encoded, self._codec.raw_dtype)

    def _await_round(
        self, peer: int, step: int, full: bool, is_active: Callable[[], bool], time_left_s: float | None
    ) -> bool:
        """Wait (lock held) until round `step` is the latest completed one; False if the caller went away.

        A round that timed out is closed here under `quorum` when it can be; otherwise the wait fails
        with a message naming the missing peers. `time_left_s` is the caller's own deadline (None: none).
        """
        state = self._state
        give_up = math.inf if time_left_s is None else time.monotonic() + time_left_s
        while True:
            if self._stopping():
                raise shutting_down()
            if not is_active() or time.monotonic() >= give_up:
                return False
            if state.check_download(peer, step, full):
                return True
            if state.must_close(uncopied_owners(self._spec(), state)):
                log.warning(
                    "round %d timed out: closing it with peers %s (server.dead_peer_policy quorum)",
                    step,
                    sorted(state.uploaded),
                )
                self._closer.close(step, self._spec())
                continue
            self._cond.wait(min(state.seconds_left(), give_up - time.monotonic(), WAIT_POLL_S))


def uncopied_owners(spec: RunSpec, state: RoundState) -> frozenset[int]:
    """Peers owning expert blocks the open round covers of which the global model holds no copy yet (lock held): a
    quorum round cannot close without them (the run's first round, or the first of a fragment's)."""
    done = state.completed
    if spec.manifest is None or spec.mode != "spes":
        return frozenset()
    held = done.global_model if done else {}
    covered = spec.layout.names(state.fragment, spec.manifest)
    return frozenset(owner for n in covered if n not in held and (owner := spec.owner(n)) is not None)
