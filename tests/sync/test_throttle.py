"""Warnings a client can cause, throttled: at most `burst` per window and kind, the rest counted and said."""

from __future__ import annotations

import logging

import pytest

from spes.sync.throttle import ThrottledLog, left_out


def test_each_kind_logs_its_burst_per_window_and_says_what_it_left_out(caplog: pytest.LogCaptureFixture) -> None:
    now = [0.0]
    warn = ThrottledLog(logging.getLogger("throttle-test"), burst=3, period_s=10.0, clock=lambda: now[0])
    with caplog.at_level(logging.WARNING, "throttle-test"):
        for i in range(8):
            warn.warning("token", "bad token %d", i)
        warn.warning("idle", "idle %d", 0)  # another kind has a window of its own
        now[0] = 9.9
        warn.warning("token", "bad token %d", 8)  # still the first window
        now[0] = 12.0
        warn.warning("token", "bad token %d", 9)  # a new window: the old one's count first
        for i in range(10, 14):
            warn.warning("token", "bad token %d", i)
        now[0] = 15.0
        warn.flush()
        warn.flush()  # nothing left to say
    assert [r.getMessage() for r in caplog.records] == [
        "bad token 0",
        "bad token 1",
        "bad token 2",
        "idle 0",
        "6 more 'token' warnings left out in 12 s",
        "bad token 9",
        "bad token 10",
        "bad token 11",
        "2 more 'token' warnings left out in 3 s",
    ]
    assert left_out(caplog.text) == {"token": 8}


def test_by_default_ten_per_kind_every_ten_seconds_a_window_starting_at_its_edge(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The server's setting (what docs/running.md states): 10 warnings of a kind per 10 s; the next window opens
    exactly 10 s after the first."""
    now = [100.0]
    warn = ThrottledLog(logging.getLogger("throttle-test"), clock=lambda: now[0])
    with caplog.at_level(logging.WARNING, "throttle-test"):
        for i in range(11):
            warn.warning("token", "bad token %d", i)
        now[0] = 110.0
        warn.warning("token", "bad token %d", 11)
    assert [r.getMessage() for r in caplog.records] == [
        *(f"bad token {i}" for i in range(10)),
        "1 more 'token' warnings left out in 10 s",
        "bad token 11",
    ]
