"""Ctrl-C and SIGTERM: save a checkpoint and stop.

The first signal asks the trainer to save a checkpoint at its next step boundary and stop (exit 130); a node waiting
for a round stops waiting (`Interrupted`) and keeps the round in flight in that checkpoint, so `--resume` continues
exactly. A second signal aborts without saving, unless it arrives within `ECHO_S` of the first: torchrun and srun
pass the terminal's Ctrl-C (or the scheduler's SIGTERM) on to ranks that have already received it. Outside the
training loop (`Interruptible`: building the node, joining the server) either signal interrupts at once, and the
node says what its save folder holds (`spes.train`); once the loop has ended on an error, the first signal is ignored:
the rank is leaving already, and under torchrun it is the launcher stopping the ranks of a failed group (every rank
agrees on a non-finite step, and the first to exit has the others signalled while they unwind).
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


class Stopped(SystemExit):
    """The trainer's stop on a signal at `step`, that step saved: exit 130 (a SystemExit, so nothing on the way out
    takes it for a failure)."""

    def __init__(self, step: int) -> None:
        super().__init__(130)
        self.step = step


class Unsaved(KeyboardInterrupt):
    """An interrupt that stopped a node before it saved; its message says what its save folder holds to continue."""


class _Handling:
    """While entered, SIGINT and SIGTERM go to `_handle` (from the main thread only: signals reach it alone)."""

    def __init__(self) -> None:
        self.first_at: float | None = None
        self.leaving = False
        self.previous: dict[int, Any] = {}

    def __enter__(self) -> _Handling:
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                self.previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, error: type[BaseException] | None, *exc: object) -> None:
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)
            outer = getattr(handler, "__self__", None)
            if not isinstance(outer, _Handling):
                continue
            outer.leaving |= error is not None
            if outer.first_at is None:  # NOTE: a launcher's echo of our signal may arrive after we are gone; the
                outer.first_at = self.first_at  # handler back in place ignores it

    def _echo(self) -> bool:
        """Whether this signal is a launcher's echo of the first (recorded now when it is the first)."""
        if self.first_at is not None:
            return time.monotonic() - self.first_at < ECHO_S
        self.first_at = time.monotonic()
        return False

    def _handle(self, signum: int, frame: object) -> None:
        raise NotImplementedError


class Interruptible(_Handling):
    """While entered, SIGTERM interrupts as Ctrl-C does (KeyboardInterrupt), and a launcher's echo of either is
    ignored. Why: by default SIGTERM (a scheduler's, torchrun's) kills a node that has not reached its training loop
    outright, leaving no word of what it saved, and the echo interrupted the node's unwinding of the first signal.
    Once an inner handling ended on an error (`leaving`), the first signal is ignored too: torchrun's stop of a failed
    group interrupted a rank's unwinding of the error all ranks agreed on (an `Exception ignored` traceback)."""

    def _handle(self, signum: int, frame: object) -> None:
        already_leaving = self.leaving and self.first_at is None
        if not self._echo() and not already_leaving:
            raise KeyboardInterrupt


class StopRequest(_Handling):
    """While entered, SIGINT and SIGTERM set `requested` (the first, and its echoes) or abort (a later one)."""

    def __init__(self, announce: Callable[[str], None]) -> None:
        super().__init__()
        self.announce = announce

    @property
    def requested(self) -> bool:
        return self.first_at is not None

    def __enter__(self) -> StopRequest:
        super().__enter__()
        return self

    def _handle(self, signum: int, frame: object) -> None:
        first = not self.requested
        if self._echo():
            return
        if not first:
            raise KeyboardInterrupt
        self.announce(
            f"received {signal.Signals(signum).name}: saving a checkpoint after this step "
            f"(press Ctrl-C again after {ECHO_S:.0f} s to abort without saving)"
        )
