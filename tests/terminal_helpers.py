"""A command run as a terminal's foreground job, on a pty the test can hang up (as a dropped SSH session does)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
OWN_TERMINAL = (
    "import fcntl, os, signal, sys, termios; fcntl.ioctl(0, termios.TIOCSCTTY, 0); "
    "signal.signal(signal.SIGHUP, signal.SIG_DFL); os.execv(sys.argv[1], sys.argv[1:])"
)
"""Take stdin's pty as the controlling terminal of this new session, with SIGHUP as a terminal's job has it (not
ignored, whatever the test runner was started under: `nohup`), then become the command."""


def on_a_terminal(argv: list[str], env: dict[str, str]) -> tuple[subprocess.Popen, int]:
    """`python argv` in a session of its own whose controlling terminal is a new pty, and the pty's master end:
    closing it hangs the terminal up (the kernel's SIGHUP to the job, EIO on each later write to the terminal)."""
    master, slave = os.openpty()
    proc = subprocess.Popen(
        [sys.executable, "-c", OWN_TERMINAL, sys.executable, *argv],
        cwd=REPO,
        env=env,
        stdin=slave,
        stdout=slave,
        stderr=slave,
        start_new_session=True,
    )
    os.close(slave)
    return proc, master


def hangup_as_in_a_terminal() -> None:
    """A child's `preexec_fn`: SIGHUP at its default, as in a terminal's job, though the test runner may have been
    started under `nohup` (an ignored signal stays ignored across exec)."""
    signal.signal(signal.SIGHUP, signal.SIG_DFL)


def read_until(master: int, text: bytes, timeout_s: float) -> bytes:
    """What the terminal showed until `text` (or the job's end, or `timeout_s`)."""
    seen = b""
    deadline = time.monotonic() + timeout_s
    while text not in seen and time.monotonic() < deadline:
        try:
            seen += os.read(master, 4096)
        except OSError:  # NOTE: the job has gone: the terminal shows nothing more
            break
    return seen


def with_reader_gone(argv: list[str], timeout_s: float) -> subprocess.CompletedProcess[str]:
    """`python argv` whose stdout is a pipe whose reader has gone before the first line (`| head -n 0`, `less` quit
    at once); stderr captured."""
    read, write = os.pipe()
    os.close(read)
    with open(write, "wb") as closed:
        return subprocess.run(
            [sys.executable, *argv], cwd=REPO, stdout=closed, stderr=subprocess.PIPE, text=True, timeout=timeout_s
        )
