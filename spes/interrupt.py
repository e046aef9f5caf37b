"""Ctrl-C and SIGTERM: save a checkpoint and stop.

The first signal asks the trainer to save a checkpoint at its next step boundary and stop (exit 130); a node waiting
for a round stops waiting (`Interrupted`) and keeps the round in flight in that checkpoint, so `--resume` continues
exactly. A second signal aborts without saving, unless it arrives within `ECHO_S` of the first: torchrun and srun
pass the terminal's Ctrl-C (or the scheduler's SIGTERM) on to ranks that have already received it.
"""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Callable
from typing import Any

ECHO_S = 2.0
"""A second signal this soon after the first is the same request, passed on by a launcher."""


class Interrupted(Exception):
    """A wait cut short by a stop request; the trainer saves (the round in flight kept) and exits 130."""


class StopRequest:
    """While entered, SIGINT and SIGTERM set `requested` (the first, and its echoes) or abort (a later one)."""

    def __init__(self, announce: Callable[[str], None]) -> None:
        self.requested = False
        self.announce = announce
        self.first_at = 0.0
        self.previous: dict[int, Any] = {}

    def __enter__(self) -> StopRequest:
        if threading.current_thread() is threading.main_thread():  # signals reach the main thread only
            for sig in (signal.SIGINT, signal.SIGTERM):
                self.previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc: object) -> None:
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)

    def _handle(self, signum: int, frame: object) -> None:
        if self.requested:
            if time.monotonic() - self.first_at < ECHO_S:
                return
            raise KeyboardInterrupt
        self.requested, self.first_at = True, time.monotonic()
        self.announce(
            f"received {signal.Signals(signum).name}: saving a checkpoint after this step "
            f"(press Ctrl-C again after {ECHO_S:.0f} s to abort without saving)"
        )
