"""Time this process did not run (`spes.sync.stalls`), as its looks at a clock tell."""

from __future__ import annotations

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
