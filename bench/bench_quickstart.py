#!/usr/bin/env python
"""The README's first command, timed stage by stage on a fresh clone: install, corpus, training.

    .venv/bin/python bench/bench_quickstart.py            # clone HEAD into a temporary folder, run quickstart.sh
    .venv/bin/python bench/bench_quickstart.py --quick    # the same with a 6-step run (what CI runs)

The clone is of the committed HEAD (`git clone`), so it has no .venv, no corpus and no outputs: the run pays every
first-time cost a new user pays on this machine (packages come from its pip index and wheel folder). Each stage's
seconds run from its `quickstart [n/3] NAME:` line to the next stage's line (the last to the script's exit), read
as the lines arrive. `run_scripts/quickstart.sh` quotes the committed record in its stage lines, and the README
renders it.
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


def main(argv: list[str] | None = None) -> int:
    p = parser("bench_quickstart", __doc__)
    p.add_argument("--timeout", type=float, default=3600, help="seconds the whole run may take")
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        clone = Path(tmp) / "spes"
        subprocess.run(["git", "clone", "-q", str(REPO_ROOT), str(clone)], check=True)
        env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONPATH")}
        steps = {"STEPS": "6"} if args.quick else {}
        env.update(steps)
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
            "stages": stages,
            "total_seconds": sum(stages.values()),
        },
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
