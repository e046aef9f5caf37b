"""Time this process did not run, which no round timeout counts: a node or a server frozen mid-round (a laptop lid
closed, a paused VM, SIGSTOP, a swap storm) wakes with the round time it had left.

A frozen process holds its sockets open but answers nothing; waking, it sees its clock jumped. A node that counted
the jump would give up on a round its retry could still finish (it asks the server and catches up), and a server
would close a round before the retries of the peers that could not reach it arrive. Both measure the jump here, once
per process, with a daemon thread that looks every `TICK_S`: a gap of `STALL_S` or more between two looks is counted
whole. The server's other clocks (a stream's idle time, a peer's silence, its data plane's socket timeouts and
handshake deadlines) run on `Stalls.awake` for the same reason: woken, it would end every open stream and connection
and hand every quiet peer's id to the next process that asks.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

log = logging.getLogger("spes.sync")

TICK_S = 0.25
"""How often the `Stalls` thread looks whether this process runs."""
STALL_S = 2.0
"""A gap this long between two of its looks (each a few microseconds) is time the process did not run, or ran
without letting any other thread take the GIL: either way no time a round's wait had."""


class Stalls:
    """Seconds this process did not run (stopped, suspended, starved), measured by a daemon thread that looks every
    `TICK_S`: a gap of `STALL_S` or more between two looks is counted whole (`note`). Thread-safe."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self._lock = threading.Lock()
        self._seen = clock()
        self._total = 0.0
        self._thread: threading.Thread | None = None

    def note(self) -> float:
        """The process runs now: count the gap since the last look if it is a stall; returns that gap (0: none)."""
        with self._lock:
            now = self.clock()
            gap, self._seen = now - self._seen, now
            if gap < STALL_S:
                return 0.0
            self._total += gap
        log.warning(
            "this process did not run for %.1f s (stopped, suspended or starved): round timeouts, and on a server its "
            "streams' and peers' silence, do not count that time",
            gap,
        )
        return gap

    def total(self) -> float:
        """Seconds not run so far, a stall not yet noted by the thread included (the thread may wake after the
        caller does)."""
        self.note()
        with self._lock:
            return self._total

    def awake(self) -> float:
        """This process's clock less its stalls so far: the seconds it ran, on which an age it keeps (a stream's
        silence, a peer's) grows only while it runs. A server frozen past its idle timeouts would otherwise wake to
        find every peer silent too long, though the peers were fine and only it was away. Never goes back."""
        self.note()
        with self._lock:
            return self._seen - self._total

    def watch(self) -> Stalls:
        """Start the looking thread (once)."""
        with self._lock:
            if self._thread is None:
                self._seen = self.clock()
                self._thread = threading.Thread(target=self._run, name="spes-stalls", daemon=True)
                self._thread.start()
        return self

    def _run(self) -> None:
        tick = threading.Event()
        while not tick.wait(TICK_S):
            self.note()


STALLS = Stalls()
"""This process's stalls, which every round timeout of it shares (a node's deadlines, the server's open round), and
the server's stream and peer ages (`spes.sync.admission`) and its data plane's waits (`spes.sync.plane_tcp`)."""
