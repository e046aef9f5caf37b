"""Warnings that anyone who reaches the server can cause at will (a call with a wrong token, an idle or dropped
connection, a refused call), logged at most `burst` times per `period_s` for each kind, with the number left out
said by the first one logged after (or when the server stops: `flush`).

Why: logged in full, a loop of wrong-token calls on one connection wrote ~1,500 lines (165 KB) a second to the
server's log, enough to fill its disk in days and to spend its CPU on formatting; throttled, the log still says
what happened, and how often. The kinds are fixed by the code (never from what a client sent), so their number is
bounded too.
"""

from __future__ import annotations

import logging
import re
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

LEFT_OUT = "%d more '%s' warnings left out in %.0f s"
"""The line that counts a window's warnings not logged (their kind, and how long the window ran)."""
_LEFT_OUT = re.compile(r"(\d+) more '([^']+)' warnings left out in ")


def left_out(log_text: str) -> dict[str, int]:
    """Per kind, how many warnings a log's `LEFT_OUT` lines say were not logged (what a reader adds to the lines
    it counts)."""
    counts: dict[str, int] = {}
    for number, kind in _LEFT_OUT.findall(log_text):
        counts[kind] = counts.get(kind, 0) + int(number)
    return counts


@dataclass
class _Window:
    start: float
    logged: int = 0
    left_out: int = 0


class ThrottledLog:
    """`warning(kind, msg, *args)`: `logger.warning(msg, *args)` unless `burst` warnings of `kind` were already logged
    in the current `period_s` window. Thread-safe."""

    def __init__(
        self,
        logger: logging.Logger,
        *,
        burst: int = 10,
        period_s: float = 10.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.logger, self.burst, self.period_s, self._clock = logger, burst, period_s, clock
        self._lock = threading.Lock()
        self._windows: dict[str, _Window] = {}

    def warning(self, kind: str, msg: str, *args: object) -> None:
        with self._lock:
            now = self._clock()
            window = self._windows.get(kind)
            if window is None or now - window.start >= self.period_s:
                if window is not None:
                    self._say_left_out(kind, window, now)
                window = self._windows[kind] = _Window(now)
            if window.logged >= self.burst:
                window.left_out += 1
                return
            window.logged += 1
        self.logger.warning(msg, *args)

    def flush(self) -> None:
        """Say what every kind's current window left out (a server that stops)."""
        with self._lock:
            now = self._clock()
            for kind, window in self._windows.items():
                self._say_left_out(kind, window, now)
            self._windows.clear()

    def _say_left_out(self, kind: str, window: _Window, now: float) -> None:
        if window.left_out:
            self.logger.warning(LEFT_OUT, window.left_out, kind, now - window.start)
