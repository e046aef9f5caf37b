"""A command run as a terminal's foreground job, on a pty the test can hang up (as a dropped SSH session does)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
OWN_TERMINAL = (
    "import fcntl, os, sys, termios; fcntl.ioctl(0, termios.TIOCSCTTY, 0); os.execv(sys.argv[1], sys.argv[1:])"
)
"""Take stdin's pty as the controlling terminal of this new session, then become the command."""


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
