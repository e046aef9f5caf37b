"""Python's garbage collector while a node trains: automatic collection off, a generation-1 collection every
`gen1_gc_interval` steps instead (OLMo's key, and its default of every step).

Why: an automatic collection starts whenever allocations cross a threshold, in the middle of a step and on each
rank at its own moment, and a full one walks every object the process holds (about half a million once the 1B
model is built and compiled: 0.3 s on a CPU core), a pause in which the GPU runs out of queued work and the other
ranks wait at the next collective. At fixed steps every rank collects at the same point, between steps, and a
generation-1 collection walks only the objects made since the last one. Nothing piles up unseen: a training step
leaves almost nothing behind that outlives one (20 compiled steps of the 1B model's widths on a CPU, collected so:
one object more in the oldest generation, and a full collection after them found no garbage).
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Callable, Iterator


@contextlib.contextmanager
def scheduled_collection(interval: int | None) -> Iterator[Callable[[int], None]]:
    """Inside, automatic collection is off (as it was before, after) and the given `collect(step)` runs a
    generation-1 collection at the steps that are multiples of `interval`; `interval` None leaves the collector
    alone and `collect` does nothing."""
    if interval is None:
        yield lambda _step: None
        return

    def collect(step: int) -> None:
        if step % interval == 0:
            gc.collect(1)

    enabled = gc.isenabled()
    gc.disable()
    try:
        yield collect
    finally:
        if enabled:
            gc.enable()
