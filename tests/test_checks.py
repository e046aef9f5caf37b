"""The node checks' report lines and the matmul rate both checks measure against (spes.checks)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from spes import checks
from spes.checks import GIB, Check, fail, gib, matmul_flops_per_s, ok, report, skip


def test_sizes_read_in_gib_from_one_gib_up_and_in_mib_below() -> None:
    assert [gib(n) for n in (GIB, 2.5 * GIB, GIB - 2**20, 3 * 2**20)] == [
        "1.00 GiB",
        "2.50 GiB",
        "1023.0 MiB",
        "3.0 MiB",
    ]


def test_the_report_prints_a_line_per_check_what_to_do_under_a_failure_and_the_verdict() -> None:
    lines: list[str] = []
    passed = [ok("devices", "one CPU"), skip("link", "not measured")]
    assert report(passed, lines.append) == 0
    assert lines == [
        "ok    devices   one CPU",
        "skip  link      not measured",
        "preflight passed: this node is ready to start",
    ]
    lines.clear()
    assert (
        report([*passed, fail("disk", "1 GiB free", "free some"), fail("data", "no shard", "fix")], lines.append) == 1
    )
    assert lines[2:] == [
        "FAIL  disk      1 GiB free",
        "                -> free some",
        "FAIL  data      no shard",
        "                -> fix",
        "preflight FAILED: disk, data (see the -> lines); fix and run again",
    ]
    assert skip("x", "why") == Check("x", "skip", "why", "") and not skip("x", "why").failed


class _Counted:
    """Stands in for a matrix: counts the products taken of it."""

    products = 0

    def __matmul__(self, other: object) -> _Counted:
        _Counted.products += 1
        return self


@pytest.fixture
def recorded(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[tuple[object, ...]]]:
    """torch.randn, torch.cuda.synchronize and the clock replaced: the matrices made, the syncs, the readings."""
    made: list[tuple[object, ...]] = []
    monkeypatch.setattr(torch, "randn", lambda *shape, device, dtype: made.append((shape, device, dtype)) or _Counted())
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: made.append(("synchronize",)))
    clock = iter([0.0, 0.1, 0.2, 0.3, 0.5])
    monkeypatch.setattr(checks.time, "perf_counter", lambda: next(clock))
    _Counted.products = 0
    yield made


def test_the_matmul_rate_counts_the_products_done_within_the_time_on_the_cpu(
    recorded: list[tuple[object, ...]],
) -> None:
    """A warm-up product, then products while less than 0.3 s (the default) has passed: 2 of them, in 0.5 s."""
    assert matmul_flops_per_s("cpu") == 2 * 512**3 * 2 / 0.5
    assert recorded == [((512, 512), "cpu", torch.float32)] * 2 and _Counted.products == 3


def test_on_cuda_the_rate_is_of_bf16_products_of_4096_each_waited_for(recorded: list[tuple[object, ...]]) -> None:
    assert matmul_flops_per_s("cuda", seconds=0.3) == 2 * 4096**3 * 2 / 0.5
    assert recorded == [((4096, 4096), "cuda", torch.bfloat16)] * 2 + [("synchronize",)] * 2
