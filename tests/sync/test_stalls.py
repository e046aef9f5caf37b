"""Time this process did not run (`spes.sync.stalls`), as its looks at a clock tell."""

from __future__ import annotations

import logging
import threading
import time

import pytest

from spes.sync.stalls import STALL_S, Stalls


def test_a_gap_between_looks_of_stall_s_or_more_is_counted_whole_and_a_shorter_one_not() -> None:
    now = [0.0]
    stalls = Stalls(lambda: now[0])
    for step in (0.25, STALL_S - 0.01, 0.25):
        now[0] += step
        assert stalls.note() == 0.0
    now[0] += 6.0
    assert stalls.total() == 6.0  # a caller that wakes before the looking thread counts the stall itself
    assert stalls.note() == 0.0 and stalls.total() == 6.0  # once


def test_a_stall_of_exactly_stall_s_counts_and_each_is_logged(caplog: pytest.LogCaptureFixture) -> None:
    """A gap of exactly STALL_S is a stall; stalls add up, each logged with its length."""
    now = [0.0]
    stalls = Stalls(lambda: now[0])
    with caplog.at_level(logging.WARNING, logger="spes.sync"):
        now[0] += STALL_S
        assert stalls.note() == STALL_S
        now[0] += 3
        assert stalls.note() == 3
    assert stalls.total() == STALL_S + 3
    assert [r.getMessage() for r in caplog.records] == [
        f"this process did not run for {gap:.1f} s (stopped, suspended or starved): round timeouts, and on a server "
        "its streams' and peers' silence, do not count that time"
        for gap in (STALL_S, 3)
    ]


@pytest.mark.timeout(30)
def test_its_looking_thread_notes_a_stall_on_its_own(caplog: pytest.LogCaptureFixture) -> None:
    """The process's daemon thread, started once, notes a stall though nobody asks for the total (a server frozen
    while no download waits still has its round's timeout pushed back)."""
    now = [0.0]
    stalls = Stalls(lambda: now[0])
    with caplog.at_level(logging.WARNING, logger="spes.sync"):
        assert stalls.watch() is stalls and stalls.watch() is stalls
        thread = stalls._thread
        assert thread is not None and thread.daemon and thread.name == "spes-stalls"
        assert [t for t in threading.enumerate() if t is thread] == [thread]
        now[0] += 5
        deadline = time.monotonic() + 10
        while not caplog.records and time.monotonic() < deadline:
            time.sleep(0.05)
    [record] = caplog.records
    assert record.threadName == "spes-stalls" and record.getMessage().startswith("this process did not run for 5.0 s")
    assert stalls._thread is thread  # started once


def test_awake_seconds_run_with_the_clock_but_not_over_a_stall_and_never_go_back() -> None:
    """`awake` is the clock less the stalls: a look's gap under STALL_S counts, one of STALL_S or more does not (even
    when `awake` is the first to see it), and no later look takes any of it back."""
    now = [100.0]
    stalls = Stalls(lambda: now[0])
    assert stalls.awake() == 100.0
    now[0] += STALL_S - 0.5
    assert stalls.awake() == 100.0 + STALL_S - 0.5
    now[0] += 30
    assert stalls.awake() == 100.0 + STALL_S - 0.5 and stalls.total() == 30
    now[0] += 1
    assert stalls.note() == 0.0 and stalls.awake() == 101.0 + STALL_S - 0.5
