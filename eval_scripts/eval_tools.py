#!/usr/bin/env python
"""Helpers of eval_scripts/eval_full.sh: which reference benchmarks are on this machine, and the results table.

    python eval_scripts/eval_tools.py available [--tasks a,b,...] [--status status.json] [--hub_off REASON]
        Prints one line "<shots> <task,task,...>" per few-shot setting ("default": lm-eval's own), for the
        reference tasks (or --tasks) whose data sets are in the local Hugging Face datasets cache or, when
        HF_HUB_OFFLINE is not 1 and the Hub answers, can be downloaded; a group (mmlu) needs every one of its
        tasks' data sets. The missing ones are named on stderr with the reason (and in --status, for the report
        and for the trainer's in-loop evaluators, which check their tasks this way once at start). --hub_off
        says why the Hub is off when a caller already decided it and set HF_HUB_OFFLINE itself.
    python eval_scripts/eval_tools.py hub_off
        Prints why downloads from the Hub are off here (nothing when they are on).
    python eval_scripts/eval_tools.py summarize <out_dir>
        Collects the lm_eval result files under <out_dir>/raw into <out_dir>/results.json and
        <out_dir>/results.md (a markdown table), and prints the table.

The reference suite is the first SPES implementation's eval_full.sh: sciq, piqa, winogrande, arc_easy, social_iqa,
openbookqa and boolq 0-shot; arc_challenge 25-shot; hellaswag 10-shot; mmlu, cmmlu and ceval-valid with lm-eval's
default shots.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

from spes.atomic import write_atomic
from spes.cli import ArgumentParser
from spes.hub import hub_offline, hub_reachable

REFERENCE_TASKS: dict[str, int | None] = {
    "sciq": 0,
    "piqa": 0,
    "winogrande": 0,
    "arc_easy": 0,
    "social_iqa": 0,
    "openbookqa": 0,
    "boolq": 0,
    "arc_challenge": 25,
    "hellaswag": 10,
    "mmlu": None,
    "cmmlu": None,
    "ceval-valid": None,
}
"""Task (or group) -> shots; None: lm-eval's own default (the first implementation passed no --num_fewshot)."""
STATUS_FILE = "reference_status.json"
DEFAULT_SHOTS = "default"


def dataset_is_local(path: str, name: str | None) -> bool:
    """Whether `datasets` can build this data set: from the local cache alone in offline mode (set by `main`),
    else from the cache or the Hub."""
    import datasets

    try:
        datasets.load_dataset_builder(path, name)
    except Exception:  # datasets raises ConnectionError, FileNotFoundError, DatasetNotFoundError... when offline
        return False
    return True


def leaf_configs(index: dict[str, Any], name: str) -> list[dict[str, Any]] | None:
    """The task configs `name` stands for in lm-eval's task index: itself, or every task of a group or tag
    (recursively); None when lm-eval knows no such name."""
    entry = index.get(name)
    if entry is None:
        return None
    kind = entry.kind.name
    if kind == "GROUP":  # NOTE: members written inline (dicts) are not looked into
        members = [m for m in (entry.cfg or {}).get("task", []) if isinstance(m, str)]
    elif kind == "TAG":
        members = [n for n, e in index.items() if name in e.tags and e.kind.name != "TAG"]
    else:
        return [entry.cfg or {}]
    return [leaf for member in members for leaf in leaf_configs(index, member) or []]


def task_status(index: dict[str, Any], task: str, shots: int | None) -> dict[str, Any]:
    """A task's (or group's) data set(s) and whether every one is available here, with the reason if not."""
    leaves = leaf_configs(index, task)
    if not leaves:
        return {"shots": shots, "dataset": None, "available": False, "reason": "lm-eval has no such task"}
    sets = sorted({(str(c.get("dataset_path")), c.get("dataset_name")) for c in leaves if c.get("dataset_path")})
    paths = sorted({path for path, _ in sets})
    label = f"{paths[0]}/{sets[0][1]}" if len(sets) == 1 and sets[0][1] else ", ".join(paths)
    if len(sets) > 1:
        label += f" ({len(sets)} configs)"
    missing = next((f"{p}/{n}" if n else p for p, n in sets if not dataset_is_local(p, n)), None)
    status = {"shots": shots, "dataset": label, "available": missing is None}
    return status if missing is None else {**status, "reason": f"no data set {missing}"}


def hub_off_reason() -> str:
    """Why downloads from the Hub are off here, '' when they are on. Asked once, before anything sets
    HF_HUB_OFFLINE for speed, so that a skipped data set is blamed on the user's setting or on the network."""
    if hub_offline():
        return "HF_HUB_OFFLINE=1 is set"
    return "" if hub_reachable() else "the Hub is unreachable"


def why_missing(hub_off: str) -> str:
    """Why a data set counts as missing here, `hub_off` being `hub_off_reason()`."""
    if hub_off:
        return f"not in the local Hugging Face cache ({hub_off})"
    return "neither in the local Hugging Face cache nor downloadable"


def reference_status(tasks: dict[str, int | None] = REFERENCE_TASKS) -> dict[str, dict[str, Any]]:
    """Per task: its data set(s) and whether they are available locally."""
    from lm_eval.tasks import TaskManager

    index = TaskManager().task_index
    return {task: task_status(index, task, shots) for task, shots in tasks.items()}


def available(status_path: Path | None, tasks: dict[str, int | None] = REFERENCE_TASKS, hub_off: str = "") -> int:
    status = reference_status(tasks)
    if status_path is not None:
        write_atomic(status_path, json.dumps(status, indent=2))
    missing = [f"{t} ({s['reason']})" for t, s in status.items() if not s["available"]]
    if missing:
        no_data = any(s["dataset"] for s in status.values() if not s["available"])
        why = f"; data sets are {why_missing(hub_off)}" if no_data else ""
        print(f"tasks skipped: {', '.join(missing)}{why}", file=sys.stderr)
    by_shots: dict[str, list[str]] = {}
    for task, s in status.items():
        if s["available"]:
            by_shots.setdefault(DEFAULT_SHOTS if s["shots"] is None else str(s["shots"]), []).append(task)
    for shots, names in by_shots.items():
        print(shots, ",".join(names))
    return 0


def collect(raw_dir: Path) -> dict[str, dict[str, Any]]:
    """Per task: metrics (value, stderr), shots and samples, from the newest lm_eval result file of each run."""
    tasks: dict[str, dict[str, Any]] = {}
    for run in sorted(p for p in raw_dir.iterdir() if p.is_dir()):
        files = sorted(run.rglob("results_*.json"), key=lambda p: p.stat().st_mtime)
        if not files:
            continue
        data = json.loads(files[-1].read_text(encoding="utf-8"))
        for task, metrics in data.get("results", {}).items():
            entry: dict[str, Any] = {
                "run": run.name,
                "shots": data.get("n-shot", {}).get(task),
                "samples": data.get("n-samples", {}).get(task, {}).get("effective"),
                "metrics": {},
            }
            for key, value in metrics.items():
                metric, comma, filter_name = key.partition(",")
                if not comma or metric.endswith("_stderr") or not isinstance(value, (int, float)):
                    continue
                stderr = metrics.get(f"{metric}_stderr,{filter_name}")
                entry["metrics"][metric] = {
                    "value": value,
                    "stderr": stderr if isinstance(stderr, (int, float)) else None,
                }
            tasks[task] = entry
    return tasks


def markdown(tasks: dict[str, dict[str, Any]], status: dict[str, dict[str, Any]] | None) -> str:
    lines = ["| task | shots | metric | value | stderr | samples |", "|---|---:|---|---:|---:|---:|"]
    for task, entry in sorted(tasks.items()):
        for metric, m in entry["metrics"].items():
            stderr = "" if m["stderr"] is None else f"{m['stderr']:.4f}"
            lines.append(
                f"| {task} | {entry['shots']} | {metric} | {m['value']:.4f} | {stderr} | "
                f"{entry['samples'] if entry['samples'] is not None else ''} |"
            )
    if status:
        skipped = [f"{t} ({s['dataset'] or s.get('reason')})" for t, s in status.items() if not s["available"]]
        if skipped:
            lines += ["", f"Not run (data set not available locally): {', '.join(skipped)}."]
    return "\n".join(lines) + "\n"


def summarize(out_dir: Path) -> int:
    raw = out_dir / "raw"
    if not raw.is_dir():
        print(f"error: {raw} does not exist: no lm_eval results to summarize", file=sys.stderr)
        return 2
    tasks = collect(raw)
    status_path = out_dir / STATUS_FILE
    status = json.loads(status_path.read_text(encoding="utf-8")) if status_path.is_file() else None
    table = markdown(tasks, status)
    for name, text in (
        ("results.json", json.dumps({"tasks": tasks, "reference_status": status}, indent=2)),
        ("results.md", table),
    ):
        write_atomic(out_dir / name, text)
    print(table, end="")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    avail = sub.add_parser("available", help="reference tasks whose data sets are available locally")
    avail.add_argument("--tasks", help="comma-separated lm-eval tasks or groups to check instead (lm-eval's shots)")
    avail.add_argument("--status", type=Path, help="also write the per-task status here (JSON)")
    avail.add_argument("--hub_off", help="why the Hub is off, as `hub_off` printed it (default: asked now)")
    sub.add_parser("hub_off", help="why downloads from the Hub are off here (nothing when they are on)")
    summ = sub.add_parser("summarize", help="lm_eval results -> results.json + results.md")
    summ.add_argument("out_dir", type=Path)
    args = parser.parse_args(argv)
    # NOTE: read by huggingface_hub/datasets when they are imported, so set before any of them is. Without
    # a reachable Hub, offline mode turns minutes of retries into an immediate "not cached".
    if args.command == "summarize":
        return summarize(args.out_dir)
    hub_off = hub_off_reason() if args.command == "hub_off" or args.hub_off is None else args.hub_off
    if args.command == "hub_off":
        print(hub_off)
        return 0
    if hub_off:
        os.environ["HF_HUB_OFFLINE"] = os.environ["HF_DATASETS_OFFLINE"] = "1"
    tasks = dict.fromkeys(filter(None, args.tasks.split(",")), None) if args.tasks else REFERENCE_TASKS
    return available(args.status, tasks, hub_off)


if __name__ == "__main__":
    raise SystemExit(main())
