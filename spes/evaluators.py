"""Downstream evaluations inside the training loop (config key `evaluators:`), through lm-eval.

    eval_interval: 1000
    evaluators:
      - label: spes_local     # eval_full.sh's local suite: spes_next_text + spes_heldout_ppl
        type: downstream
      - label: piqa           # a reference task (OLMo labels such as openbook_qa are mapped to lm-eval's)
        type: downstream
        limit: 200            # examples per task, so a large run does not stall (default: all)

Every `eval_interval` steps (only at its multiples; on SPES/DiLoCo runs right after the sync, so on the merged
global model), every rank gathers the full weights, and the main rank writes them as a Hugging Face
directory (`spes.hf_convert.export_state`) and runs `python -m lm_eval` on it in a subprocess (lm-eval's
global state and memory stay out of the trainer). The local suite's data is built once per run by
`eval_scripts/build_local_tasks.py` from `data.validation_paths`, cut to the model's context length,
exactly the files `eval_full.sh` uses. Scores go to the metrics record as `eval/<task>/<metric>`, so
to metrics.jsonl and the dashboards. At start the main rank checks every task's data once
(`eval_scripts/eval_tools.py available`: lm-eval knows the task, its data sets are cached or downloadable) and
names the ones it cannot run, with the reason, leaving them out of the run; the first implementation shipped its
evaluation sets, spes takes them from the Hugging Face cache (`hf download --repo-type dataset <name>` once
online, or HF_HOME pointing at a cache that holds them). A task that fails later (window too short) is named
once and left out for the rest of the run.
Entries of `type: lm` are OLMo's validation-loss evaluators: spes computes that from
`data.validation_paths`, so they add nothing here.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from spes.checkpoint import model_state_dict
from spes.config import TrainConfig
from spes.distributed import DistInfo
from spes.schema import ConfigError

REPO = Path(__file__).resolve().parents[1]
EVAL_SCRIPTS = REPO / "eval_scripts"
LOCAL_SUITE = "spes_local"
# OLMo evaluator labels -> lm-eval task names, where they differ.
TASK_NAMES = {"openbook_qa": "openbookqa", "commitment_bank": "cb"}
_ENTRY_KEYS = ("label", "type", "limit")


@dataclass(frozen=True)
class Evaluator:
    """One `evaluators:` entry of type downstream."""

    label: str
    task: str
    limit: int | None


def parse_evaluators(entries: list[dict]) -> list[Evaluator]:
    """The downstream entries of `evaluators:`; ConfigError naming `evaluators[i].<key>` for a bad one."""
    out = []
    for i, entry in enumerate(entries):
        unknown = sorted(set(entry) - set(_ENTRY_KEYS))
        if unknown:
            raise ConfigError(
                f"config key 'evaluators[{i}].{unknown[0]}' is unknown; an evaluator has {list(_ENTRY_KEYS)}"
            )
        label, kind, limit = entry.get("label"), entry.get("type", "downstream"), entry.get("limit")
        if not isinstance(label, str) or not label:
            raise ConfigError(
                f"config key 'evaluators[{i}].label' = {label!r} must name a task, e.g. piqa or {LOCAL_SUITE}"
            )
        if kind not in ("downstream", "lm"):
            raise ConfigError(f"config key 'evaluators[{i}].type' = {kind!r} must be downstream or lm")
        if limit is not None and (not isinstance(limit, int) or isinstance(limit, bool) or limit < 1):
            raise ConfigError(f"config key 'evaluators[{i}].limit' = {limit!r} must be a positive integer or null")
        if kind == "downstream":
            out.append(Evaluator(label=label, task=TASK_NAMES.get(label, label), limit=limit))
    return out


def lm_eval_scores(output_dir: Path) -> dict[str, float]:
    """`eval/<task>/<metric>` -> value from the newest lm-eval results file under `output_dir`."""
    files = sorted(output_dir.rglob("results_*.json"), key=lambda p: p.stat().st_mtime)
    if not files:
        return {}
    scores = {}
    for task, metrics in json.loads(files[-1].read_text(encoding="utf-8")).get("results", {}).items():
        for key, value in metrics.items():
            metric, comma, _ = key.partition(",")
            if comma and not metric.endswith("_stderr") and isinstance(value, (int, float)):
                scores[f"eval/{task}/{metric}"] = float(value)
    return scores


class DownstreamEvals:
    """Runs the configured downstream tasks on the current weights (all ranks call `run`; rank 0 works)."""

    def __init__(
        self, cfg: TrainConfig, *, is_main: bool, device: torch.device, log: Callable[[str], None] = print
    ) -> None:
        self.evaluators = parse_evaluators(cfg.evaluators)
        self.cfg, self.is_main, self.device, self.log = cfg, is_main, device, log
        self.folder = Path(cfg.save_folder).absolute() / "downstream"
        self.disabled: set[str] = set()
        if self.evaluators:
            from spes.hf_map import choose_family

            try:
                choose_family(cfg.model)
            except ValueError as err:
                raise ConfigError(
                    f"config key 'evaluators' needs a model that exports to Hugging Face: {err}"
                ) from None
            if not cfg.eval_interval:
                raise ConfigError(
                    "config key 'evaluators' is set but 'eval_interval' is not: set how many steps "
                    "apart the downstream tasks run"
                )
            if any(e.task == LOCAL_SUITE for e in self.evaluators) and not cfg.data.validation_paths:
                raise ConfigError(
                    f"evaluator '{LOCAL_SUITE}' builds its tasks from data.validation_paths, which is empty"
                )

    def due(self, step: int) -> bool:
        """Whether `step` is an evaluation step: a multiple of `eval_interval` (not the last step otherwise: a
        short trial run of a config with a long interval evaluates nothing)."""
        interval = self.cfg.eval_interval  # set whenever evaluators are (refused otherwise), and >= 1 (its range)
        return bool(self.evaluators) and interval is not None and step % interval == 0

    def check_data(self) -> None:
        """Once, at start, on the main rank: refuse a task lm-eval does not know (a misspelled name, as an unknown
        config key is refused); leave out, named in one line, the tasks it has no data for here (instead of each
        failing at its first evaluation)."""
        tasks = sorted({e.task for e in self.evaluators if e.task != LOCAL_SUITE})
        if not self.is_main or not tasks:
            return
        status_file = self.folder / "task_status.json"
        cmd = [sys.executable, str(EVAL_SCRIPTS / "eval_tools.py"), "available", "--tasks", ",".join(tasks)]
        if not self._subprocess([*cmd, "--status", str(status_file)], Path.cwd(), self.folder / "task_status.log"):
            self.log(f"note: could not check the downstream tasks' data (log: {self.folder / 'task_status.log'})")
            return
        status = json.loads(status_file.read_text(encoding="utf-8"))
        unknown = [task for task, s in status.items() if s["dataset"] is None]  # NOTE: what eval_tools says of no task
        if unknown:
            raise ConfigError(
                f"config key 'evaluators' names tasks lm-eval does not have: {', '.join(unknown)}; check their "
                "spelling (python -m lm_eval --tasks list names them all)"
            )
        missing = {task: s["reason"] for task, s in status.items() if not s["available"]}
        for ev in self.evaluators:
            if ev.task in missing:
                self.disabled.add(ev.label)
        if missing:
            shown = ", ".join(f"{task} ({reason})" for task, reason in missing.items())
            self.log(
                f"note: downstream evaluators left out of this run: {shown}; a data set must be in the Hugging Face "
                "cache (HF_HOME) or downloadable from here (not HF_HUB_OFFLINE=1)"
            )

    def run(self, model: nn.Module, step: int) -> dict[str, float]:
        """Scores of every runnable task at `step` (empty off the main rank)."""
        state = model_state_dict(model, full=True)
        if not self.is_main:
            return {}
        from spes.hf_convert import export_state
        from spes.hub import resolve_tokenizer

        hf_dir = self.folder / "hf"
        tokenizer = resolve_tokenizer(self.cfg.tokenizer.identifier)
        export_state(state, self.cfg.model, hf_dir, tokenizer=tokenizer, overwrite=True)
        del state
        scores: dict[str, float] = {}
        for ev in self.evaluators:
            if ev.label not in self.disabled:
                scores.update(self._run_one(ev, hf_dir, step))
        shown = ", ".join(f"{k.removeprefix('eval/')} {v:.4f}" for k, v in sorted(scores.items()))
        self.log(f"step {step} downstream: {shown or 'no task ran'}")
        return scores

    def _run_one(self, ev: Evaluator, hf_dir: Path, step: int) -> dict[str, float]:
        tasks, cwd = ev.task, Path.cwd()
        if ev.task == LOCAL_SUITE:
            cwd, tasks = self._local_tasks(hf_dir)
            if not tasks:
                return {}
        out = self.folder / "raw" / f"step{step}" / ev.label
        shutil.rmtree(out, ignore_errors=True)
        out.mkdir(parents=True)
        cmd = [
            sys.executable,
            "-m",
            "lm_eval",
            "--model",
            "hf",
            "--model_args",
            f"pretrained={hf_dir},dtype=float32",
            "--tasks",
            tasks,
            "--num_fewshot",
            "0",
            "--include_path",
            str(EVAL_SCRIPTS / "tasks"),
            "--batch_size",
            str(self.cfg.device_eval_batch_size),
            "--output_path",
            str(out),
            "--device",
            str(self.device),
        ]
        if ev.limit is not None:
            cmd += ["--limit", str(ev.limit)]
        done = self._subprocess(cmd, cwd, out / "lm_eval.log")
        scores = lm_eval_scores(out) if done else {}
        if not scores:
            self._disable(ev.label, f"lm_eval failed (log: {out / 'lm_eval.log'})")
        return scores

    def _local_tasks(self, hf_dir: Path) -> tuple[Path, str]:
        """The local suite's data directory (built once, fitted to the model's window) and runnable tasks."""
        data = self.folder / "tasks"
        cmd = [
            sys.executable,
            str(EVAL_SCRIPTS / "build_local_tasks.py"),
            "--shards",
            *self.cfg.data.validation_paths,
            "--tokenizer",
            self.cfg.tokenizer.identifier,
            "--out",
            str(data),
            "--max_tokens",
            str(self.cfg.model.max_sequence_length),
            "--window_tokenizer",
            str(hf_dir),
        ]
        log_path = self.folder / "build_local_tasks.log"
        if not self._subprocess(cmd, Path.cwd(), log_path):
            self._disable(LOCAL_SUITE, f"its task data could not be built (log: {log_path})")
            return data, ""
        manifest = json.loads((data / "manifest.json").read_text(encoding="utf-8"))
        for task, reason in manifest.get("skipped_tasks", {}).items():
            self.log(f"note: downstream task {task} skipped: {reason}")
        return data, ",".join(manifest["tasks"])

    def _subprocess(self, cmd: list[str], cwd: Path, log_path: Path) -> bool:
        log_path.parent.mkdir(parents=True, exist_ok=True)
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
        with open(log_path, "w") as log:
            return subprocess.run(cmd, cwd=cwd, env=env, stdout=log, stderr=subprocess.STDOUT).returncode == 0

    def _disable(self, label: str, reason: str) -> None:
        self.disabled.add(label)
        self.log(f"note: downstream evaluator {label} skipped for the rest of the run: {reason}")


def evaluators_of(cfg: TrainConfig, info: DistInfo, log: Callable[[str], None]) -> DownstreamEvals | None:
    """The run's downstream evaluations, or None when `evaluators:` names none."""
    evals = DownstreamEvals(cfg, is_main=info.is_main, device=info.device, log=log)
    if not evals.evaluators:
        return None
    evals.check_data()
    return evals
