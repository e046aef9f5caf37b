"""Ctrl-C, SIGTERM and SIGHUP: save a checkpoint and stop.

SIGHUP (a closed terminal, a dropped SSH session) is a stop request as SIGTERM is, as torchrun takes it, unless the
process was started to ignore it (`nohup`); output nobody reads any more (that terminal, a pipe into `head`) is dropped,
not an error (`outliving_readers`). The first signal asks the trainer to save a checkpoint at its next step boundary and
stop (exit 130); a node waiting for a round stops waiting (`Interrupted`) and keeps the round in flight in that
checkpoint, so `--resume` continues exactly. A second signal aborts without saving, unless it arrives within `ECHO_S` of
the first: torchrun and srun pass the terminal's Ctrl-C (or the scheduler's SIGTERM) on to ranks that have already
received it. Outside the training loop (`Interruptible`: building the node, joining the server) any of them interrupts
at once, and the node says what its save folder holds (`spes.train`); once the loop has ended on an error, the first
signal is ignored: the rank is leaving already, and under torchrun it is the launcher stopping the ranks of a failed
group (every rank agrees on a non-finite step, and the first to exit has the others signalled while they unwind).
"""

from __future__ import annotations

import errno
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, TextIO

ECHO_S = 2.0
"""A second signal this soon after the first is the same request, passed on by a launcher."""


def stop_signals() -> tuple[signal.Signals, ...]:
    """The signals that ask this process to stop: SIGINT, SIGTERM and SIGHUP, but not a SIGHUP it was started to
    ignore (`nohup`): that one must go on being ignored."""
    hangup = () if signal.getsignal(signal.SIGHUP) == signal.SIG_IGN else (signal.SIGHUP,)
    return (signal.SIGINT, signal.SIGTERM, *hangup)


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
    """While entered, `stop_signals()` go to `_handle` (from the main thread only: signals reach it alone)."""

    def __init__(self) -> None:
        self.first_at: float | None = None
        self.leaving = False
        self.previous: dict[int, Any] = {}

    def __enter__(self) -> _Handling:
        if threading.current_thread() is threading.main_thread():
            for sig in stop_signals():
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

    def _echo(self, signum: int) -> bool:
        """Whether this signal repeats the first (recorded now when it is the first): a launcher's echo of it, or a
        hangup, which asks for no abort: the terminal closed on a stop under way (Ctrl-C, then the laptop shut)."""
        if self.first_at is not None:
            return signum == signal.SIGHUP or time.monotonic() - self.first_at < ECHO_S
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
        if not self._echo(signum) and not already_leaving:
            raise KeyboardInterrupt


class StopRequest(_Handling):
    """While entered, the stop signals set `requested` (the first, and its echoes) or abort (a later one)."""

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
        if self._echo(signum):
            return
        if not first:
            raise KeyboardInterrupt
        self.announce(
            f"received {signal.Signals(signum).name}: saving a checkpoint after this step "
            f"(press Ctrl-C again after {ECHO_S:.0f} s to abort without saving)"
        )


NOBODY_READS = (errno.EPIPE, errno.EIO)
"""A write's errors that say nobody reads the output any more: a closed pipe (`| head`, `less` quit), a terminal that
hung up (a dropped SSH session)."""


@contextmanager
def outliving_readers(note: str | None) -> Iterator[None]:
    """While entered, keep going when the reader of stdout or stderr goes away: from then on that stream writes to
    /dev/null, and `note` (what goes on, and where its progress is kept), if any, is said once on stderr if still read.
    Why: Python ignores SIGPIPE, so a run piped into `head` or `less` died of a BrokenPipeError at its next progress
    line (exit 6, its steps since the last checkpoint lost), and one whose terminal hung up died of EIO as it said
    it was saving."""
    streams = sys.stdout, sys.stderr
    sys.stdout, sys.stderr = _Unread(sys.stdout, note), _Unread(sys.stderr, None)
    try:
        yield
    finally:
        sys.stdout, sys.stderr = streams


def still_read(stream: TextIO) -> bool:
    """Whether `stream` has a reader as far as `outliving_readers` knows (outside it: always). Why: output that is a
    command's only product (`spes.status --watch`) ends with its reader instead of going on into /dev/null."""
    return not getattr(stream, "unread", False)


def silence(stream: TextIO) -> None:
    """Point `stream`'s file descriptor at /dev/null: what is still buffered for a reader gone, Python's flush at
    exit included, is dropped instead of raising again."""
    null = os.open(os.devnull, os.O_WRONLY)
    os.dup2(null, stream.fileno())
    os.close(null)


class _Unread:
    """A text stream whose writes, once nobody reads them (`NOBODY_READS`), go to /dev/null instead of raising."""

    def __init__(self, stream: TextIO, note: str | None) -> None:
        self._stream = stream
        self._note = note
        self.unread = False

    def write(self, text: str) -> int:
        self._quietly(lambda: self._stream.write(text))
        return len(text)

    def flush(self) -> None:
        self._quietly(self._stream.flush)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)

    def _quietly(self, call: Callable[[], object]) -> None:
        try:
            call()
        except OSError as e:
            if e.errno not in NOBODY_READS:
                raise
            silence(self._stream)
            self.unread = True
            if self._note is not None:
                note, self._note = self._note, None
                print(note, file=sys.stderr, flush=True)
