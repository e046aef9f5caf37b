"""The committed benchmark records (bench/results/*.json) as the renderer reads them, and what each must carry.

Every figure published in README.md and docs/ is read from one of these records by `bench/report.py`. A record
names the run that produced it: its `command`, its `commit` (a clean tree's full hash, or `<hash>-dirty-<diff
hash>` as `bench/common.py: git_commit` writes it) and its `machine`. Records written before those rules held
are listed in `KNOWN_GAPS` with what they lack; the list may only shrink (tests/test_report.py): a new record
without its provenance, or a listed one that no longer lacks it, fails the test.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

CLEAN_COMMIT = re.compile(r"[0-9a-f]{40}")
DIRTY_COMMIT = re.compile(r"[0-9a-f]{40}-dirty-[0-9a-f]{16}")

KNOWN_GAPS = {
    "bench_overlap_0022": "dirty tree, diff not kept",
    "bench_overlap_2309": "dirty tree, diff not kept",
    "bench_overlap_2345": "dirty tree, diff not kept",
    "bench_wan_gpu": "dirty tree, diff not kept",
    "bench_wan_gpu_steps": "commit not a full hash; no machine",
}
"""Records written before their provenance was checked (issue 30), and what each lacks. Shown beside their figures
in docs/benchmarks.md's list of records (with a record's own `provenance_note`, if any); re-measuring one removes it
from here."""

COMMANDS = {
    "bench_gpu": "bash bench/prepare_gpu.sh, then bash bench/run_gpu.sh on a GPU",
    "bench_fused_loss_gpu": ".venv/bin/python bench/bench_fused_loss.py --device cuda",
    "bench_quickstart": ".venv/bin/python bench/bench_quickstart.py",
    "bench_codec": ".venv/bin/python bench/bench_codec.py",
    "mini_repro_codecs": ".venv/bin/python bench/mini_repro.py --codecs int8 bf16 sparse",
    "mini_repro_codecs_seed7": ".venv/bin/python bench/mini_repro.py --codecs bf16 sparse --seed 7",
    "mini_repro_codecs_diloco": ".venv/bin/python bench/mini_repro.py --codecs sparse --dilico",
    "bench_wire_sparse": ".venv/bin/python bench/bench_wire.py",
    "bench_overlap_f5_same_shape": (
        ".venv/bin/python bench/bench_overlap.py --shape mini_repro --fragments 5 --codecs fp32 int8 --repeats 2 "
        "--steps 200 --out bench/results/bench_overlap_f5_same_shape.json"
    ),
    "mini_repro_codecs_f5": (
        ".venv/bin/python bench/mini_repro.py --codecs bf16 --overlap --overlap_fragments 5 --only spes_overlap_d2_f5 "
        "codec_bf16 --runs bench/results/mini_repro_codecs_f5 --out bench/results/mini_repro_codecs_f5.json"
    ),
    "mini_repro_codecs_f5_seed7": (
        ".venv/bin/python bench/mini_repro.py --codecs bf16 --overlap --overlap_fragments 5 --only spes_overlap_d2_f5 "
        "codec_bf16 --seed 7 --runs bench/results/mini_repro_codecs_f5_seed7 "
        "--out bench/results/mini_repro_codecs_f5_seed7.json"
    ),
    "mini_repro_codecs_f5_held": (
        ".venv/bin/python bench/mini_repro.py --codecs int8 sparse --overlap --overlap_fragments 5 --only "
        "codec_int8_spes_overlap_d2_f5 codec_sparse_spes_overlap_d2_f5 --runs bench/results/mini_repro_codecs_f5_held "
        "--out bench/results/mini_repro_codecs_f5_held.json"
    ),
    "mini_repro_codecs_f5_held_seed7": (
        ".venv/bin/python bench/mini_repro.py --codecs int8 sparse --overlap --overlap_fragments 5 --only "
        "codec_int8_spes_overlap_d2_f5 --seed 7 --runs bench/results/mini_repro_codecs_f5_held_seed7 "
        "--out bench/results/mini_repro_codecs_f5_held_seed7.json"
    ),
    "bench_wan_codecs": (
        ".venv/bin/python bench/bench_wan.py --wires bf16 int8 sparse --planes tcp "
        "--out bench/results/bench_wan_codecs.json"
    ),
    "wan_sparse_phases": (
        ".venv/bin/python bench/bench_wan.py --speeds 1000 100 20 --wires sparse --planes tcp --rounds 3 "
        "--out bench/results/wan_sparse_phases.json"
    ),
}
"""The command that writes a record not committed yet (a record that exists names its own)."""


class Missing(Exception):
    """A figure's record is not committed (yet)."""

    def __init__(self, record: str) -> None:
        super().__init__(record)
        self.record = record


def not_measured(record: str) -> str:
    """What a figure of a record that does not exist yet says instead."""
    command = COMMANDS.get(record, f"the benchmark that writes bench/results/{record}.json")
    return f"not measured yet (run: `{command}`)"


class Records:
    """The records of one results directory, each read once; `records("bench_sync")` is the record's JSON."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self._read: dict[str, dict[str, Any]] = {}

    def __call__(self, name: str) -> dict[str, Any]:
        if name not in self._read:
            path = self.directory / f"{name}.json"
            if not path.is_file():
                raise Missing(name)
            record = json.loads(path.read_text())
            if not isinstance(record, dict):
                raise ValueError(f"{path}: a record is a JSON object")
            self._read[name] = record
        return self._read[name]

    def committed(self, names: Iterable[str]) -> list[dict[str, Any]]:
        """The records of `names` that are committed, in order (a later run may add the others)."""
        found = []
        for name in names:
            try:
                found.append(self(name))
            except Missing:
                continue
        return found

    def names(self) -> list[str]:
        return sorted(p.stem for p in self.directory.glob("*.json"))

    def value(self, expression: str) -> str:
        """A figure written in a document as `record/key/.../key[|unit][:format]`: the record's value at that path
        (list items by index), divided by `unit` (mib, gib, mb, gb, k, pct) and formatted (`format(value, spec)`)."""
        path, _, spec = expression.partition(":")
        path, _, unit = path.partition("|")
        name, *keys = path.split("/")
        value: Any = self(name)
        for key in keys:
            try:
                value = value[int(key)] if isinstance(value, list) else value[key]
            except (KeyError, IndexError, ValueError, TypeError):
                raise KeyError(f"{name}.json has no {'/'.join(keys)} (at {key!r})") from None
        if unit:
            value = value / UNITS[unit]
        return format(value, spec)


UNITS = {"mib": 2**20, "gib": 2**30, "mb": 1e6, "gb": 1e9, "k": 1e3, "pct": 1e-2}


def provenance_gap(record: dict[str, Any]) -> str | None:
    """What of its command, commit and machine a record lacks ("dirty tree, diff not kept", ...), None if nothing.
    A record of parts run apart (mutation testing: `modules`, each naming its commit) names them per part, each part
    its own run's."""
    parts = runs_of_parts(record)
    if not parts:
        return run_gap(record)
    found = [run_gap(p, command_needed=False) for p in parts]
    return "; ".join(sorted({gap for gaps in found if gaps for gap in gaps.split("; ")})) or None


def runs_of_parts(record: dict[str, Any]) -> list[dict[str, Any]]:
    """The parts of a record of parts run apart (mutation testing: `modules`, each naming its commit), [] for any
    other record."""
    parts = record.get("modules")
    if isinstance(parts, dict) and parts and all(isinstance(p, dict) and "commit" in p for p in parts.values()):
        return list(parts.values())
    return []


def run_gap(run: dict[str, Any], *, command_needed: bool = True) -> str | None:
    """What of its command, commit and machine one run's record lacks, None if nothing. A part of a record of parts
    need not name its command: those written before each part named its own have none (a command found is checked)."""
    gaps = []
    command, commit, machine = run.get("command"), run.get("commit"), run.get("machine")
    if (command_needed or "command" in run) and (not isinstance(command, str) or not command):
        gaps.append("no command")
    if not isinstance(commit, str) or not commit:
        gaps.append("no commit")
    elif re.fullmatch(r"[0-9a-f]{40}-dirty", commit):
        gaps.append("dirty tree, diff not kept")
    elif not (CLEAN_COMMIT.fullmatch(commit) or DIRTY_COMMIT.fullmatch(commit)):
        gaps.append("commit not a full hash")
    if not (isinstance(machine, dict) and machine):
        gaps.append("no machine")
    return "; ".join(gaps) or None


def link(mbit: float) -> str:
    """A link speed as the tables and sentences name it."""
    return f"{mbit / 1000:g} Gbit/s" if mbit >= 1000 else f"{mbit:g} Mbit/s"


CODEC_SEEDS = {"": 6198, "_seed7": 7}
"""The mini-reproduction's seeds by record suffix."""


OWN_BLOCKS = "mini_repro_codecs_own"
"""The held-model codecs' comparison after an owner keeps its own blocks as trained (1da3a8e)."""

DENSE_SPARSE = "mini_repro_codecs_dense"
"""The sparse curve at 1da3a8e with a denser setting beside the two of `OWN_BLOCKS` (seed 6198)."""

DILOCO_CURVE = "mini_repro_codecs_diloco_curve"
"""The sparse curve in DiLoCo mode: three denser settings than the default beside fp32 (seed 6198)."""

INT8_RECORD = "mini_repro_codecs_int8"
"""int8 against fp32, both seeds at one commit (`mini_repro.py --codecs int8`): the int8 runs' table and figures."""

CODEC_RECORDS = ("mini_repro_codecs", "mini_repro_codecs_f5", OWN_BLOCKS, DENSE_SPARSE, INT8_RECORD)
"""The SPES codec comparisons of the mini-reproduction, oldest first, each seed's under its suffix: the codec curve,
the comparison of the overlapped schedules on each codec (with bf16's blocking arm), the held-model codecs'
after their change of 1da3a8e, the denser sparse curve at that commit, and int8's against fp32."""


BEFORE_CARRIED_FIX = "mini_repro_codecs_d1"
"""Each round applied one step after its sync step (`overlap_steps: 1`) at 1da3a8e, before a fragment's round kept
the error the other fragments carry (428a315)."""
F5_RECORDS = (
    "mini_repro_codecs_f5",
    "mini_repro_codecs_f5_held",
    OWN_BLOCKS,
    BEFORE_CARRIED_FIX,
    "mini_repro_codecs_fix",
)
"""The comparisons of the overlapped schedules (5 fragments) on each codec against blocking fp32, oldest first, each
seed's under its suffix: the raw codecs' run, the held-model codecs' run after their fix (1d792a4), after an owner
keeps its own blocks (1da3a8e), each round applied one step after its sync step (`overlap_steps: 1`), and that again
after the fix of the carried error over fragments, each with its own blocking fp32 arm at its commit."""


def f5_arms(records: Records, suffix: str = "", names: Sequence[str] = F5_RECORDS) -> list[dict[str, Any]]:
    """The arms of each of `names<suffix>` (by default `F5_RECORDS`) that is committed, newest first."""
    return [x["arms"] for x in reversed(records.committed(f"{n}{suffix}" for n in names))]


def int8_runs(records: Records) -> list[dict[str, Any]]:
    """int8 against fp32, seed by seed (`INT8_RECORD<suffix>` for each of `CODEC_SEEDS`)."""
    return [records(f"{INT8_RECORD}{suffix}") for suffix in CODEC_SEEDS]


def codec_losses(records: Records, codec: str, suffix: str = "") -> tuple[float, float]:
    """(fp32, codec) final validation losses of the SPES arm in one seed's codec comparison (`suffix`: "" or
    "_seed7"): from its arm `codec_<codec>` in the newest of `CODEC_RECORDS<suffix>` that has it (each compares its
    arms with its own fp32 arm); Missing when none has."""
    for x in reversed(records.committed(f"{n}{suffix}" for n in CODEC_RECORDS)):
        if f"codec_{codec}" in x["arms"]:
            return x["arms"]["spes"]["final_val_loss"], x["arms"][f"codec_{codec}"]["final_val_loss"]
    raise Missing(f"{CODEC_RECORDS[-1]}{suffix}")


def wire_measured(records: Records) -> dict[str, Any]:
    """The codecs bench_wire measured on the paper's 1B through real servers, by label (a record of its first form
    holds int8's alone, under `paper_1b_int8_measured`)."""
    r = records("bench_wire")
    return r["paper_1b_measured"] if "paper_1b_measured" in r else {"int8": r["paper_1b_int8_measured"]}


GPU_RUNS = {
    "bench_gpu": "every variant, as prepared",
    "bench_gpu_compile": "the compiled variants again, each recomputed module now compiled inside its checkpoint",
    "bench_gpu_head": "compiled variants again, `fused_loss`'s chunk of LM head and loss now compiled too",
}
"""The GPU runs of the 1B node, oldest first, and what each measured. Figures compare within one run only."""


def gpu_runs(records: Records) -> list[tuple[str, dict[str, Any]]]:
    """The GPU runs committed, oldest first, each with its record (a full run's: not a `--quick` one)."""
    out = []
    for name in GPU_RUNS:
        try:
            run = records(name)
        except Missing:
            continue
        if run.get("mode") == "full":
            out.append((name, run))
    return out


CUDA_DEFAULTS = "grouped_mm+fused+compile"
"""The variant of the node as a config that leaves `compile` and `fused_loss` null builds it on a CUDA GPU."""

PROFILED_MICRO_BATCHES = 2
"""Micro-batches of the step bench_gpu.py profiles: its kernel table and `device_busy` are of a step this long."""


def gpu_variant(run: dict[str, Any], name: str) -> dict[str, Any] | None:
    """The variant `name` of a GPU run, if it ran to the end there."""
    return next((v for v in run["variants"] if v["name"] == name and v["status"] == "ok"), None)


def default_gpu_step(records: Records) -> tuple[float, str]:
    """The 1B node's step at its CUDA defaults, in seconds, from the newest GPU run that measured it, and that run."""
    for name, run in reversed(gpu_runs(records)):
        if (v := gpu_variant(run, CUDA_DEFAULTS)) is not None:
            return v["step_s"], name
    raise Missing(f"no GPU run measured {CUDA_DEFAULTS}")
