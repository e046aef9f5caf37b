"""A disk that fills up, for tests that may not mount one: a child process whose files cannot grow past a size.

`RLIMIT_FSIZE` makes a write past the limit fail with EFBIG ("File too large") where a full disk fails with ENOSPC;
spes handles both alike (`spes.atomic.NO_ROOM`). SIGXFSZ, which would kill the process instead, is ignored.
"""

from __future__ import annotations

import json
import resource
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

from dist_helpers import child_env


def cap_file_size(limit: int) -> None:
    """From now on in this process, no file grows past `limit` bytes: a write past it fails with EFBIG."""
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))


def print_failure(error: BaseException) -> None:
    """What a child tells its test about the error it met, as one JSON line on stdout."""
    print(json.dumps({"type": type(error).__name__, "errno": getattr(error, "errno", None), "message": str(error)}))


def run_child(code: str, timeout: float = 120) -> tuple[subprocess.CompletedProcess[str], dict[str, Any] | None]:
    """`python -c code` with the tests importable; the process and the failure it printed (`print_failure`), if any."""
    proc = subprocess.run(
        [sys.executable, "-c", code], env=child_env(), capture_output=True, text=True, timeout=timeout
    )
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    return proc, (json.loads(lines[-1]) if lines else None)


def drop_checksums(step_dir: Path) -> None:
    """Make `step_dir`'s meta.json that of a checkpoint saved before checksums (spes still reads those), so that a
    test's damage reaches the reader behind the checksum check."""
    meta_path = step_dir / "meta.json"
    meta = json.loads(meta_path.read_text())
    meta.pop("xxh3_128"), meta.pop("meta_xxh3_128")
    meta_path.write_text(json.dumps(meta))
