"""Helpers for the fault-injection tests: real server processes, /proc readings, and the fault-free oracle."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from spes.sync.merge import build_global
from spes.sync.spec import RunSpec

REPO = Path(__file__).resolve().parents[2]
TESTS = REPO / "tests"
sys.path.insert(0, str(REPO / "bench"))

from common import spec_overrides as spec_overrides  # noqa: E402  (bench/common.py: a server's overrides of a spec)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@dataclass
class ServerProcess:
    """A `python -m spes.server` child process with its log file."""

    proc: subprocess.Popen[bytes]
    port: int
    log: Path

    @property
    def addr(self) -> str:
        return f"127.0.0.1:{self.port}"

    def log_text(self) -> str:
        return self.log.read_text(errors="replace")

    def kill(self) -> None:
        """SIGKILL: no shutdown handler runs, nothing is flushed or saved."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(timeout=10)

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout=15)


def server_command(open_files: tuple[int, int] | None = None) -> list[str]:
    """`python -m spes.server`, in a process whose (soft, hard) limit of open files is `open_files` if given.

    NOTE: the limit is set by the new interpreter itself, not by a `preexec_fn`: Python code run between fork and
    exec of a process using gRPC (these tests' in-process servers and clients) crashed the child in gRPC's poller."""
    if open_files is None:
        return [sys.executable, "-m", "spes.server"]
    limit = (
        f"import resource, runpy, sys; resource.setrlimit(resource.RLIMIT_NOFILE, {open_files}); "
        "sys.argv[0] = 'spes.server'; runpy.run_module('spes.server', run_name='__main__', alter_sys=True)"
    )
    return [sys.executable, "-c", limit]


def start_server_process(
    log: Path,
    args: list[str],
    *,
    port: int = 0,
    env: dict[str, str] | None = None,
    timeout_s: float = 60,
    open_files: tuple[int, int] | None = None,
) -> ServerProcess:
    """Start the server on 127.0.0.1 and wait for its 'listening on' line (the port it bound); `open_files`: its
    (soft, hard) limit of open files."""
    command = [*server_command(open_files), "--host", "127.0.0.1", "--port", str(port), *args]
    with open(log, "ab") as out:
        proc = subprocess.Popen(command, cwd=REPO, env={**os.environ, **(env or {})}, stdout=out, stderr=out)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for line in log.read_text(errors="replace").splitlines():
            if "listening on 127.0.0.1:" in line:
                bound = int(line.split("listening on 127.0.0.1:")[1].split()[0])
                if port in (0, bound):
                    return ServerProcess(proc, bound, log)
        if proc.poll() is not None:
            break
        time.sleep(0.05)
    proc.kill()
    proc.wait()
    raise AssertionError(f"the server did not start:\n{log.read_text(errors='replace')}")


@contextlib.contextmanager
def server_process(log: Path, args: list[str], **kwargs: object) -> Iterator[ServerProcess]:
    server = start_server_process(log, args, **kwargs)  # type: ignore[arg-type]
    try:
        yield server
    finally:
        server.kill()


def proc_usage(pid: int) -> dict[str, int]:
    """Resident and peak memory (bytes), threads and open file descriptors of a live process."""
    fields = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        fields[key] = value.split()
    return {
        "rss": int(fields["VmRSS"][0]) * 1024,
        "peak_rss": int(fields["VmHWM"][0]) * 1024,
        "threads": int(fields["Threads"][0]),
        "fds": len(os.listdir(f"/proc/{pid}/fd")),
    }


def fault_free(uploads: dict[int, dict[int, dict[str, torch.Tensor]]], spec: RunSpec) -> dict[str, torch.Tensor]:
    """The global model after the rounds of `uploads` (step -> peer -> tensors) of the run `spec` with no fault."""
    global_model: dict[str, torch.Tensor] = {}
    momentum: dict[str, torch.Tensor] = {}
    for step in sorted(uploads):
        built = build_global(uploads[step], spec=spec, step=step, previous=global_model, momentum=momentum)
        global_model, momentum = built.tensors, built.momentum
    return global_model


def assert_exact(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    """Every tensor of `got` equals `want`'s bit for bit."""
    assert got and set(got) <= set(want), sorted(set(got) - set(want))
    for name, tensor in got.items():
        assert torch.equal(tensor, want[name]), name
