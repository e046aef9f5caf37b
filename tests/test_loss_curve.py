"""A stored loss curve of configs/tiny.yaml that refactors must reproduce (torchtitan's practice).

The curve is 12 centralized steps on the session corpus (the first 120 stdlib modules of this Python).
To re-record it after an intended numerical change (as docs/testing.md says):
SPES_RECORD_LOSS_CURVE=1 .venv/bin/python -m pytest tests/test_loss_curve.py
Without a curve for this interpreter the test skips, except under CI (environment variable CI set: CI runs
.ci/run with CI=true), where it fails: CI's Python must have its curve stored.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import resource
import signal
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from spes.atomic import write_atomic
from spes.train import main

REPO = Path(__file__).resolve().parents[1]
STORED = REPO / "tests" / "data" / "tiny_loss_curve.json"


def record(stored: Path, key: str, losses: list[float]) -> None:
    """Store `losses` as `key`'s curve beside the other Pythons' curves, atomically: a re-record cut short (a full
    disk, Ctrl-C) must not leave half a file, which would fail every Python's test and lose their curves."""
    curves = json.loads(stored.read_text()) if stored.exists() else {}
    curves[key] = losses
    write_atomic(stored, json.dumps(curves, indent=1) + "\n")


def test_tiny_config_reproduces_the_stored_loss_curve(tiny_corpus, tmp_path: Path) -> None:
    args = [
        str(REPO / "configs" / "tiny.yaml"),
        "--using_spes=false",
        *tiny_corpus.overrides(tmp_path),
        "--max_duration=12st",
        "--eval_interval=null",
        "--save_interval=null",
        "--log_interval=1",
    ]
    assert main(args) == 0
    losses = [json.loads(line)["loss"] for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    key = f"python{sys.version_info.major}.{sys.version_info.minor}"
    if os.environ.get("SPES_RECORD_LOSS_CURVE"):
        record(STORED, key, losses)
        pytest.skip(f"recorded the loss curve for {key} in {STORED}")
    stored = json.loads(STORED.read_text())
    if key not in stored:
        missing = f"no stored curve for {key} (the corpus is this Python's stdlib); record one as the docstring says"
        if os.environ.get("CI"):  # NOTE: CI must check the curve, so there a missing one is a failure, not a skip
            pytest.fail(f"CI: {missing}")
        pytest.skip(missing)
    # NOTE: 1e-4 absorbs float differences between CPUs' SIMD paths; a real change to the math moves it far more.
    assert losses == pytest.approx(stored[key], abs=1e-4)


@contextlib.contextmanager
def file_size_limit(size: int) -> Iterator[None]:
    """Writes past `size` bytes of a file fail (EFBIG), as on a full disk; SIGXFSZ, which would end this process
    instead, is ignored meanwhile."""
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (size, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        signal.signal(signal.SIGXFSZ, handler)


def test_a_record_cut_short_leaves_the_stored_curves_whole(tmp_path: Path) -> None:
    stored = tmp_path / "curves.json"
    record(stored, "python3.0", [1.0])
    before = stored.read_text()
    with pytest.raises(OSError), file_size_limit(len(before) + 8):
        record(stored, "python3.1", [2.0] * 100)
    assert stored.read_text() == before and [p.name for p in tmp_path.iterdir()] == [stored.name]
    record(stored, "python3.1", [2.0])
    assert json.loads(stored.read_text()) == {"python3.0": [1.0], "python3.1": [2.0]}


def test_the_docstring_re_records_the_curve_as_the_testing_doc_says() -> None:
    command = re.search(r"SPES_RECORD_LOSS_CURVE=1 .*", __doc__ or "")
    assert command is not None and command.group() in (REPO / "docs" / "testing.md").read_text()
