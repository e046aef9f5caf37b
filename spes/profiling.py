"""The PyTorch profiler over a few training steps (`torch_profiling`, OLMo's key and schedule).

Why these steps: the first steps of a process compile, allocate and warm the caches, so they say little about the
steady state; OLMo's schedule skips one step, warms the profiler up over five more and records the three after
(`WAIT`, `WARMUP`, `ACTIVE`), once per process. What it leaves: the operators and kernels of those steps by their
own time (the device's when there is one) in the log, and a Chrome trace, gzipped, under
`save_folder/profiler/` (open it in https://ui.perfetto.dev or chrome://tracing) to see where a step waits.
"""

from __future__ import annotations

import contextlib
import gzip
import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity

from spes.atomic import write_atomic

WAIT, WARMUP, ACTIVE = 1, 5, 3
"""OLMo's profiling schedule, in training steps of this process: steps 7 to 9 are recorded."""
TABLE_ROWS = 20


@contextlib.contextmanager
def step_profiler(
    enabled: bool, folder: Path, log: Callable[[str], None], device: torch.device
) -> Iterator[Callable[[int], None]]:
    """Inside, `profiled(step)` ends training step `step` for the profiler; once the `ACTIVE` steps are recorded it
    logs their table of operators and writes `folder/steps<first>-<last>.chrome_trace.json.gz`. Disabled, the
    profiler is never started and `profiled` does nothing."""
    if not enabled:
        yield lambda _step: None
        return
    seen: list[int] = []
    cuda = device.type == "cuda"

    def ready(prof: torch.profiler.profile) -> None:
        # NOTE: also called when a run ends inside the recorded steps: then it names those it recorded
        steps = f"{seen[min(WAIT + WARMUP, len(seen) - 1)]}-{seen[-1]}"
        sort = "self_cuda_time_total" if cuda else "self_cpu_time_total"
        log(f"profile of steps {steps}, by own time:\n{prof.key_averages().table(sort_by=sort, row_limit=TABLE_ROWS)}")
        trace = folder / f"steps{steps}.chrome_trace.json.gz"
        try:
            write_atomic(trace, lambda tmp: _gzipped_trace(prof, tmp))
        except OSError as exc:  # a diagnostic: the run goes on without it
            log(f"profiler trace not written ({exc}): training goes on")
            return
        log(f"profiler trace written to {trace}")

    activities = [ProfilerActivity.CPU, *([ProfilerActivity.CUDA] if cuda else [])]
    schedule = torch.profiler.schedule(wait=WAIT, warmup=WARMUP, active=ACTIVE, repeat=1)
    with torch.profiler.profile(activities=activities, schedule=schedule, on_trace_ready=ready) as prof:

        def profiled(step: int) -> None:
            seen.append(step)
            prof.step()

        yield profiled


def _gzipped_trace(prof: torch.profiler.profile, out: str) -> None:
    """The profile's Chrome trace, gzipped into `out` (torch gzips only a path ending in .gz, and `out` is the
    atomic write's temporary name)."""
    with tempfile.TemporaryDirectory(dir=Path(out).parent) as scratch:
        raw = Path(scratch) / "trace.json"
        prof.export_chrome_trace(str(raw))
        with raw.open("rb") as src, gzip.open(out, "wb") as dst:
            shutil.copyfileobj(src, dst)
