#!/usr/bin/env python
"""The README's first command, timed stage by stage on a fresh clone: install, corpus, training.

    .venv/bin/python bench/bench_quickstart.py            # clone HEAD into a temporary folder, run quickstart.sh
    .venv/bin/python bench/bench_quickstart.py --quick    # the same with a 10-step run, one round (what CI runs)
    .venv/bin/python bench/bench_quickstart.py --quick --venv .venv --corpus data/default   # no install, no corpus

The clone is of the committed HEAD (`git clone`), so it has no .venv, no corpus and no outputs: the run pays every
first-time cost a new user pays on this machine (packages come from its pip index and wheel folder). Each stage's
seconds run from its `quickstart [n/3] NAME:` line to the next stage's line (the last to the script's exit), read
as the lines arrive. `run_scripts/quickstart.sh` quotes the committed record in its stage lines, and the README
renders it. `--venv` and `--corpus` lend the clone an installed environment and a built corpus (linked as its .venv
and data/default), so those stages only check them: a test of the whole path that downloads nothing.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from common import REPO_ROOT, machine_info, parser, write_results

STAGE = re.compile(r"^quickstart \[(\d)/3\] (\w+):")


def timed_stages(cmd: list[str], cwd: Path, env: dict[str, str], timeout: float) -> tuple[dict[str, float], str]:
    """Run `cmd`, timing each stage from its line to the next; (seconds per stage, the output's tail). Past `timeout`
    its whole process group is killed, printing or not (a silent hang must end too)."""
    marks: list[tuple[str, float]] = []
    tail: list[str] = []
    expired = threading.Event()
    with subprocess.Popen(
        cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
    ) as proc:

        def expire() -> None:
            expired.set()
            os.killpg(proc.pid, signal.SIGKILL)

        timer = threading.Timer(timeout, expire)
        timer.daemon = True
        timer.start()
        try:
            assert proc.stdout is not None
            for line in proc.stdout:
                print(line, end="", flush=True)
                tail = [*tail[-40:], line]
                if match := STAGE.match(line):
                    marks.append((match[2], time.monotonic()))
            code = proc.wait()
        finally:
            timer.cancel()
    if expired.is_set():
        raise SystemExit(f"error: the quickstart ran past {timeout:.0f} s; see the output above")
    if code != 0:
        raise SystemExit(f"error: the quickstart exited with {code}:\n{''.join(tail)}")
    ends = [t for _, t in marks[1:]] + [time.monotonic()]
    return {name: end - at for (name, at), end in zip(marks, ends)}, "".join(tail)


def _lend(clone: Path, venv: Path | None, corpus: Path | None) -> dict[str, str]:
    """Link `venv` and `corpus` into `clone` as .venv and data/default (those given); what was lent, for the record."""
    lent = {}
    for path, place in ((venv, ".venv"), (corpus, "data/default")):
        if path is not None:
            (clone / place).parent.mkdir(parents=True, exist_ok=True)
            (clone / place).symlink_to(path.resolve())
            lent[place] = str(path)
    return lent


def main(argv: list[str] | None = None) -> int:
    p = parser("bench_quickstart", __doc__)
    p.add_argument("--timeout", type=float, default=3600, help="seconds the whole run may take")
    p.add_argument("--venv", type=Path, help="an installed environment to link as the clone's .venv (no install)")
    p.add_argument("--corpus", type=Path, help="a built corpus to link as the clone's data/default (no build)")
    args = p.parse_args(argv)
    for flag, path in (("--venv", args.venv), ("--corpus", args.corpus)):
        if path is not None and not path.is_dir():
            p.error(f"{flag} {path}: no such directory")
    with tempfile.TemporaryDirectory() as tmp:
        clone = Path(tmp) / "spes"
        subprocess.run(["git", "clone", "-q", str(REPO_ROOT), str(clone)], check=True)
        env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONPATH")}
        steps = {"STEPS": "10"} if args.quick else {}  # configs/tiny.yaml syncs every 10 steps
        env.update(steps)
        lent = _lend(clone, args.venv, args.corpus)
        if args.venv is not None:  # NOTE: its spes may be another checkout's (the clone's first), and setup.sh
            # would reinstall spes into it from this temporary clone if its stamp differs: pip only dry-runs
            env.update(PYTHONPATH=str(clone), PIP_DRY_RUN="1", PIP_NO_INDEX="1")
        stages, tail = timed_stages(["bash", "run_scripts/quickstart.sh"], clone, env, args.timeout)
    if list(stages) != ["install", "corpus", "train"] or "SPES run summary" not in tail:
        raise SystemExit(f"error: the quickstart's stages were {list(stages)}, or it printed no summary table")
    for name, seconds in stages.items():
        print(f"{name}: {seconds:.0f} s")
    write_results(
        args.out,
        {
            "mode": "quick" if args.quick else "full",
            "machine": machine_info(),
            "environment": steps,
            "lent": lent,
            "stages": stages,
            "total_seconds": sum(stages.values()),
        },
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
