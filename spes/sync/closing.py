"""Closing a round: its aggregation on a thread of its own, its persistence, and its publication.

The coordinator hands `RoundCloser.close` the open round once every peer is in (or a quorum round timed out). A
thread then builds the round (`spes.sync.aggregate.build_round`), persists it under `--state_dir`
(`spes.sync.state`, before any peer may download it), and publishes it: the completed round in `RoundState`, its
tensors in `RoundMemory`, the waiting downloads woken. A failure (an aggregate that is not finite, a full disk)
is reported to the waiting peers instead, with what to do, and the previous round stays the latest. `restore` is
the other way a round becomes the latest: a restarted server's persisted one.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass

from spes.sync.aggregate import build_round
from spes.sync.buffers import RoundMemory
from spes.sync.codecs.base import Payload
from spes.sync.codecs.interface import ServerCodec
from spes.sync.protocol import Tensors
from spes.sync.rounds import Completed, RoundState
from spes.sync.spec import RunSpec
from spes.sync.state import SavedRound, load_round, save_round

log = logging.getLogger("spes.server")


@dataclass(frozen=True)
class RoundParts:
    """What the coordinator's jobs (closing rounds, uploads, downloads) share, all guarded by `cond`, the
    coordinator's condition: the round rules' state, the kept buffers and the run's codec."""

    cond: threading.Condition
    state: RoundState
    memory: RoundMemory
    codec: ServerCodec


class RoundJob:
    """One of the coordinator's jobs on its rounds, holding their shared parts (all guarded by `cond`)."""

    def __init__(self, parts: RoundParts) -> None:
        self._cond, self._state, self._memory, self._codec = parts.cond, parts.state, parts.memory, parts.codec


class RoundCloser(RoundJob):
    """Builds, persists and publishes rounds for the coordinator, whose condition guards `state` and `memory`."""

    def __init__(self, parts: RoundParts, state_dir: str | None, published: Callable[[Completed, float], None]) -> None:
        super().__init__(parts)
        self._state_dir, self._published = state_dir, published
        self._thread: threading.Thread | None = None

    def restore(self, spec: RunSpec) -> RunSpec:
        """Publish the round persisted under `--state_dir`, if any; returns the spec completed from it."""
        saved = load_round(self._state_dir, spec) if self._state_dir else None
        if saved is None:
            return spec
        served = self._codec.restore(saved.step, saved.global_model, saved.codec_state)
        done = Completed(
            saved.step, frozenset(saved.peers), saved.fragment, saved.alpha, saved.global_model, saved.momentum, served
        )
        self._state.restore(done)
        self._memory.publish(done)
        log.info(
            "resumed from %s: round %d complete (peers %s); waiting for peers to re-join",
            self._state_dir,
            saved.step,
            list(saved.peers),
        )
        if saved.length_was is not None:
            log.warning(
                "max_duration changed: the run now ends at step %d (it was to end at step %d); every node must resume "
                "with this max_duration",
                saved.spec.last_step,
                saved.length_was,
            )
        if saved.server_changed:
            log.warning(
                "the server: section differs from the one the run's rounds so far had, the next rounds use this "
                "server's: %s",
                "; ".join(saved.server_changed),
            )
        return saved.spec

    def close(self, step: int, spec: RunSpec) -> None:
        """Hand the open round's uploads to a new aggregation thread (the caller holds the lock)."""
        uploads, relayed = self._state.take_uploads()
        self._thread = threading.Thread(
            target=self._run,
            args=(step, uploads, relayed, self._state.fragment, spec),
            name=f"aggregate-{step}",
            daemon=True,
        )
        self._thread.start()

    def join(self, timeout_s: float) -> None:
        """Let a running aggregation finish (shutdown)."""
        if self._thread is not None:
            self._thread.join(timeout=timeout_s)

    def _persist(self, done: Completed, spec: RunSpec) -> None:
        """Save `done` under `--state_dir` (if given), before any peer may download it."""
        if self._state_dir:
            saved = SavedRound(
                done.round,
                tuple(sorted(done.peers)),
                done.fragment,
                done.alpha,
                done.global_model,
                done.momentum,
                self._codec.persisted(done.served),
                spec,
            )
            save_round(self._state_dir, saved)

    def _fail(self, step: int, message: str, traced: bool = True) -> None:
        """Round `step` is not published: the waiting peers get `message`, and may upload it again. `traced`: the
        log keeps the traceback of the error being handled (not for a cause the message names whole, a full disk)."""
        log.error("%s", message, exc_info=traced)
        with self._cond:
            self._state.fail(step, message)
            self._cond.notify_all()

    def _run(
        self, step: int, uploads: dict[int, Tensors], relayed: dict[str, Payload], fragment: int, spec: RunSpec
    ) -> None:
        start = time.perf_counter()
        with self._cond:  # NOTE: only this thread replaces the completed round, in `_publish` below.
            previous = self._state.completed
        received = [t for upload in uploads.values() for t in upload.values()]
        try:
            done = build_round(step, uploads, relayed, fragment, previous, spec, self._codec, self._memory.pool.take)
            del uploads, relayed
            self._memory.pool.give(received, keep=done.tensors())  # merged or converted
            del received
        except Exception as exc:  # report any aggregation failure to the waiting peers
            self._fail(step, f"aggregation of round {step} failed: {exc}")
            return
        try:
            self._persist(done, spec)
        except Exception as exc:
            fix = (
                ": free space there (or fix its permissions), then resume the nodes with --resume=auto; the server's "
                "latest round is still the one before, and the nodes upload this one again"
                if isinstance(exc, OSError)
                else ""
            )
            message = f"the server could not save round {step} under --state_dir {self._state_dir} ({exc}){fix}"
            self._fail(step, message, traced=not isinstance(exc, OSError))
            return
        with self._cond:  # NOTE: counted with it: a status between the two said round N of N - 1 rounds completed
            self._state.complete(done)
            self._memory.publish(done)
            self._cond.notify_all()
            self._published(done, time.perf_counter() - start)
        try:
            done.served.complete()  # NOTE: what no download has made yet: the downloads find it made
        except Exception:  # a bug: `serve` checked what could fail; the downloads will fail on it too
            log.exception("round %d: making what its downloads send failed", step)
            return
        log.debug("round %d: what its downloads send made %.2f s after it began", step, time.perf_counter() - start)


@dataclass(frozen=True)
class CallParts:
    """What the jobs answering peers' calls (uploads, downloads) share beyond `RoundParts`: the closer of the rounds
    they complete or wait for, the peers `joined`, `spec` reading the coordinator's current run spec (a Join may
    complete it) and `stopping` whether the server is shutting down (a call then is refused)."""

    rounds: RoundParts
    closer: RoundCloser
    joined: Collection[int]
    spec: Callable[[], RunSpec]
    stopping: Callable[[], bool]


class PeerCalls(RoundJob):
    """A job answering peers' calls (`Uploads`, `Downloads`), holding their shared parts."""

    def __init__(self, parts: CallParts) -> None:
        super().__init__(parts.rounds)
        self._closer, self._joined, self._spec, self._stopping = parts.closer, parts.joined, parts.spec, parts.stopping
