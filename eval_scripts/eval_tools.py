#!/usr/bin/env python
"""Helpers of eval_scripts/eval_full.sh: which reference benchmarks are on this machine, and the results table.

    python eval_scripts/eval_tools.py available [--status status.json]
        Prints one line "<shots> <task,task,...>" per few-shot setting, for the reference tasks whose
        data sets are in the local Hugging Face datasets cache or, when HF_HUB_OFFLINE is not 1 and the
        Hub answers, can be downloaded. The missing ones are named on stderr (and in --status, for the
        report).
    python eval_scripts/eval_tools.py summarize <out_dir>
        Collects the lm_eval result files under <out_dir>/raw into <out_dir>/results.json and
        <out_dir>/results.md (a markdown table), and prints the table.

The reference suite is the SPES paper's: sciq, piqa, winogrande, arc_easy, social_iqa, openbookqa
and boolq 0-shot; arc_challenge 25-shot; hellaswag 10-shot.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

from spes.atomic import write_atomic
from spes.hub import hub_offline, hub_reachable

REFERENCE_TASKS: dict[str, int] = {
    "sciq": 0,
    "piqa": 0,
    "winogrande": 0,
    "arc_easy": 0,
    "social_iqa": 0,
    "openbookqa": 0,
    "boolq": 0,
    "arc_challenge": 25,
    "hellaswag": 10,
}
STATUS_FILE = "reference_status.json"


def dataset_is_local(path: str, name: str | None) -> bool:
    """Whether `datasets` can build this data set: from the local cache alone in offline mode (set by `main`),
    else from the cache or the Hub."""
    import datasets

    try:
        datasets.load_dataset_builder(path, name)
    except Exception:  # datasets raises ConnectionError, FileNotFoundError, DatasetNotFoundError... when offline
        return False
    return True


def reference_status() -> dict[str, dict[str, Any]]:
    """Per reference task: its data set and whether that is available locally."""
    from lm_eval.tasks import TaskManager

    index = TaskManager().task_index
    status = {}
    for task, shots in REFERENCE_TASKS.items():
        entry = index.get(task)
        cfg = (entry.cfg if entry is not None else None) or {}
        path, name = cfg.get("dataset_path"), cfg.get("dataset_name")
        status[task] = {
            "shots": shots,
            "dataset": f"{path}/{name}" if name else path,
            "available": bool(path) and dataset_is_local(str(path), name),
        }
    return status


def available(status_path: Path | None) -> int:
    status = reference_status()
    if status_path is not None:
        status_path.parent.mkdir(parents=True, exist_ok=True)
        status_path.write_text(json.dumps(status, indent=2), encoding="utf-8")
    missing = [f"{t} ({s['dataset']})" for t, s in status.items() if not s["available"]]
    if missing:
        why = (
            "not in the local Hugging Face cache (HF_HUB_OFFLINE=1 or the Hub is unreachable)"
            if hub_offline()
            else "neither in the local Hugging Face cache nor downloadable"
        )
        print(f"reference tasks skipped, their data sets are {why}: {', '.join(missing)}", file=sys.stderr)
    by_shots: dict[int, list[str]] = {}
    for task, s in status.items():
        if s["available"]:
            by_shots.setdefault(s["shots"], []).append(task)
    for shots, tasks in by_shots.items():
        print(shots, ",".join(tasks))
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
        skipped = [f"{t} ({s['dataset']})" for t, s in status.items() if not s["available"]]
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
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    avail = sub.add_parser("available", help="reference tasks whose data sets are available locally")
    avail.add_argument("--status", type=Path, help="also write the per-task status here (JSON)")
    summ = sub.add_parser("summarize", help="lm_eval results -> results.json + results.md")
    summ.add_argument("out_dir", type=Path)
    args = parser.parse_args(argv)
    # NOTE: read by huggingface_hub/datasets when they are imported, so set before any of them is. Without
    # a reachable Hub, offline mode turns minutes of retries into an immediate "not cached".
    if args.command == "available" and (hub_offline() or not hub_reachable()):
        os.environ["HF_HUB_OFFLINE"] = os.environ["HF_DATASETS_OFFLINE"] = "1"
    return available(args.status) if args.command == "available" else summarize(args.out_dir)


if __name__ == "__main__":
    raise SystemExit(main())
