"""The report lines both node checks print: `spes.preflight` (config, server, link, disk, data) and
`spes.gpu_check` (the CUDA paths), and the device matmul rate both measure against.

Kept apart so that neither check module imports the other (`python -m spes.preflight --gpu` hands over to
`spes.gpu_check`).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

GIB = 2**30


@dataclass(frozen=True)
class Check:
    """One line of the report: passed, failed (with what to do) or skipped (could not be measured)."""

    name: str
    status: str  # "ok" | "FAIL" | "skip"
    detail: str
    fix: str = ""

    @property
    def failed(self) -> bool:
        return self.status == "FAIL"


def ok(name: str, detail: str) -> Check:
    return Check(name, "ok", detail)


def fail(name: str, detail: str, fix: str) -> Check:
    return Check(name, "FAIL", detail, fix)


def skip(name: str, detail: str) -> Check:
    return Check(name, "skip", detail)


def gib(num_bytes: float) -> str:
    """A size in GiB, or MiB below one GiB."""
    return f"{num_bytes / GIB:.2f} GiB" if num_bytes >= GIB else f"{num_bytes / 2**20:.1f} MiB"


def report(checks: list[Check], out: Callable[[str], None] = print) -> int:
    """Print one line per check (and what to do under a failed one); 1 if any failed."""
    for check in checks:
        out(f"{check.status:<4}  {check.name:<8}  {check.detail}")
        if check.fix:
            out(f"{'':<4}  {'':<8}  -> {check.fix}")
    failed = [c.name for c in checks if c.failed]
    if failed:
        out(f"preflight FAILED: {', '.join(failed)} (see the -> lines); fix and run again")
        return 1
    out("preflight passed: this node is ready to start")
    return 0


def matmul_flops_per_s(kind: str, seconds: float = 0.3) -> float:
    """The device's dense matmul rate (bf16 on CUDA, fp32 on the CPU), measured for about `seconds`; torch imported
    here, so that the report lines cost `python -m spes.preflight --help` and a bad config nothing."""
    import torch

    n = 4096 if kind == "cuda" else 512
    dtype = torch.bfloat16 if kind == "cuda" else torch.float32
    a = torch.randn(n, n, device=kind, dtype=dtype)
    b = torch.randn(n, n, device=kind, dtype=dtype)
    a @ b  # warm-up
    count, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        a @ b
        count += 1
        if kind == "cuda":
            torch.cuda.synchronize()
    return 2 * n**3 * count / (time.perf_counter() - start)
