"""A stored loss curve of configs/tiny.yaml that refactors must reproduce (torchtitan's practice).

The curve is 12 centralized steps on the session corpus (the first 120 stdlib modules of this Python).
To re-record it after an intended numerical change: SPES_RECORD_LOSS_CURVE=1 pytest tests/test_loss_curve.py
Without a curve for this interpreter the test skips, except under CI (environment variable CI set: CI runs
.ci/run with CI=true), where it fails: CI's Python must have its curve stored.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

from spes.train import main

REPO = Path(__file__).resolve().parents[1]
STORED = REPO / "tests" / "data" / "tiny_loss_curve.json"


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
        stored = json.loads(STORED.read_text()) if STORED.exists() else {}
        stored[key] = losses
        STORED.write_text(json.dumps(stored, indent=1) + "\n")
        pytest.skip(f"recorded the loss curve for {key} in {STORED}")
    stored = json.loads(STORED.read_text())
    if key not in stored:
        missing = f"no stored curve for {key} (the corpus is this Python's stdlib); record one as the docstring says"
        if os.environ.get("CI"):  # NOTE: CI must check the curve, so there a missing one is a failure, not a skip
            pytest.fail(f"CI: {missing}")
        pytest.skip(missing)
    # NOTE: 1e-4 absorbs float differences between CPUs' SIMD paths; a real change to the math moves it far more.
    assert losses == pytest.approx(stored[key], abs=1e-4)
