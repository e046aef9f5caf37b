"""run_scripts/quickstart.sh's own lines, with stand-ins for what it runs (the real run: tests/test_launch.py)."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SETTINGS = ("OUT", "RESUME", "STEPS", "MERGE_INTERVAL", "MERGE_ALPHA_START", "MERGE_DECAY_STEPS")
"""The quickstart's environment settings: the caller's own are not the test's."""


def quickstart_lines(tmp_path: Path, **env: str) -> list[str]:
    """What a copy of quickstart.sh prints, its setup a no-op and its Python one that names what it was asked to run."""
    (tmp_path / "run_scripts").mkdir()
    shutil.copy(REPO / "run_scripts" / "quickstart.sh", tmp_path / "run_scripts")
    (tmp_path / "run_scripts" / "setup.sh").write_text("exit 0\n")
    python = tmp_path / ".venv" / "bin" / "python"
    python.parent.mkdir(parents=True)
    python.write_text('#!/bin/sh\necho "python $1 $2 $3"\n')
    python.chmod(0o755)
    done = subprocess.run(
        ["bash", str(tmp_path / "run_scripts" / "quickstart.sh")],
        env={**{k: v for k, v in os.environ.items() if k not in SETTINGS}, **env},
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    return done.stdout.splitlines()


@pytest.mark.timeout(60)
def test_the_training_stage_says_where_the_run_goes_and_whether_it_continues_one(tmp_path: Path) -> None:
    """With RESUME=1 it announced "400 steps" as for a new run, though the peers go on from their checkpoints."""
    (tmp_path / "new").mkdir()
    lines = quickstart_lines(tmp_path / "new", OUT="output/mine")
    assert lines[-2] == (
        "quickstart [3/3] train: a server and 4 peers on loopback, 400 steps into output/mine (progress below: "
        "peer 0's log)"
    )
    assert lines[-1] == "python -m spes.launch configs/tiny.yaml"
    (tmp_path / "resumed").mkdir()
    lines = quickstart_lines(tmp_path / "resumed", RESUME="1", STEPS="800")
    assert lines[-2] == (
        "quickstart [3/3] train: a server and 4 peers on loopback, the run in output/quickstart continued from its "
        "last checkpoint to step 800 (progress below: peer 0's log)"
    )
