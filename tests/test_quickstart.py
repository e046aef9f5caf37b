"""run_scripts/quickstart.sh's own lines, with stand-ins for what it runs (the real run: tests/test_launch.py)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SETTINGS = ("OUT", "RESUME", "STEPS", "MERGE_INTERVAL", "MERGE_ALPHA_START", "MERGE_DECAY_STEPS")
"""The quickstart's environment settings: the caller's own are not the test's."""


def quickstart_lines(tmp_path: Path, cwd: Path | None = None, **env: str) -> list[str]:
    """What a copy of quickstart.sh in `tmp_path` prints, started in `cwd` (default: that copy's root), its setup a
    no-op, its Python one that names what it was asked to run (all of it in python.args), and a record of a fresh
    clone's stages."""
    (tmp_path / "run_scripts").mkdir(exist_ok=True)
    shutil.copy(REPO / "run_scripts" / "quickstart.sh", tmp_path / "run_scripts")
    (tmp_path / "run_scripts" / "setup.sh").write_text("exit 0\n")
    python = tmp_path / ".venv" / "bin" / "python"
    python.parent.mkdir(parents=True, exist_ok=True)
    python.write_text('#!/bin/sh\nprintf "%s\\n" "$@" > "$0.args"\necho "python $1 $2 $3"\n')
    python.chmod(0o755)
    (tmp_path / "bench" / "results").mkdir(parents=True, exist_ok=True)
    record = {"stages": {"install": 250.0, "corpus": 20.0, "train": 40.0}}
    (tmp_path / "bench" / "results" / "bench_quickstart.json").write_text(json.dumps(record))
    done = subprocess.run(
        ["bash", str(tmp_path / "run_scripts" / "quickstart.sh")],
        cwd=cwd or tmp_path,
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
        "peer 0's log); on a fresh clone: 40 s"
    )
    assert lines[-1] == "python -m spes.launch configs/tiny.yaml"
    (tmp_path / "resumed").mkdir()
    lines = quickstart_lines(tmp_path / "resumed", RESUME="1", STEPS="800")
    assert lines[-2] == (
        "quickstart [3/3] train: a server and 4 peers on loopback, the run in output/quickstart continued from its "
        "last checkpoint to step 800 (progress below: peer 0's log); on a fresh clone: 40 s for a new run of 400 steps"
    )


@pytest.mark.timeout(60)
def test_the_training_stages_recorded_time_says_what_it_timed_when_this_run_is_another(tmp_path: Path) -> None:
    """`STEPS=800` was announced with the record's time of a 400-step run, as if it were this run's."""
    (tmp_path / "default").mkdir()
    assert quickstart_lines(tmp_path / "default", STEPS="400")[-2].endswith("; on a fresh clone: 40 s")
    (tmp_path / "longer").mkdir()
    assert quickstart_lines(tmp_path / "longer", STEPS="800")[-2].endswith(
        "; on a fresh clone: 40 s for a new run of 400 steps"
    )


@pytest.mark.timeout(60)
def test_a_relative_out_is_from_the_folder_it_is_started_in(tmp_path: Path) -> None:
    """Started from another folder, OUT=runs/a went into the repository's runs/a, and the lines named it runs/a."""
    repo, here = tmp_path / "spes ü", tmp_path / "my runs ü"
    repo.mkdir()
    here.mkdir()
    lines = quickstart_lines(repo, cwd=here, OUT="runs ü/a")
    assert f"400 steps into {here}/runs ü/a (progress below" in lines[-2]
    args = (repo / ".venv" / "bin" / "python.args").read_text().splitlines()
    assert args[args.index("--out") + 1] == f"{here}/runs ü/a"
    quickstart_lines(repo, cwd=here, OUT=f"{tmp_path}/abs ü")  # an absolute OUT is kept as it is
    args = (repo / ".venv" / "bin" / "python.args").read_text().splitlines()
    assert args[args.index("--out") + 1] == f"{tmp_path}/abs ü"
    quickstart_lines(repo, cwd=here)  # the default is the repository's
    args = (repo / ".venv" / "bin" / "python.args").read_text().splitlines()
    assert args[args.index("--out") + 1] == "output/quickstart"
